"""`Optimizer`: the base of TF-style optimizers as immutable configs with pure updates.

How a step runs (TF's `Optimizer.apply_gradients`, functionally): each param
leaf is paired with its gradient leaf; None gradients and non-trainable
Variables are skipped; a dense gradient goes to `_dense`, an `IndexedSlices`
to `_sparse` (after summing duplicate indices, as TF's
`_deduplicate_indexed_slices`, unless the subclass sets `_dedup = False`);
then `_finish` updates the non-slot variables once (Adam's beta powers).
"""

from __future__ import annotations

import dataclasses
import gc
from collections.abc import Callable
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from jax._src import core as _core

from varstate._indexed_slices import IndexedSlices, convert_to_tensor_or_indexed_slices
from varstate._variable import Variable, make_slot
from varstate.optimizers._state import OptimizerState

Array = Any
Hyper = float | Callable[[Any], Any]  # a hyperparameter: a float or a callable of the step


def _is_var(x: Any) -> bool:
    return isinstance(x, Variable)


def _is_grad_leaf(x: Any) -> bool:
    return x is None or isinstance(x, (Variable, IndexedSlices))


def _value(p: Any) -> Any:
    return p._value if isinstance(p, Variable) else p


def _label(path: tuple, p: Any) -> str:
    where = jax.tree_util.keystr(path) or "<root>"
    return f"{p.name!r} (params{where})" if isinstance(p, Variable) else f"params{where}"


def _first_difference(grads: Any, params: Any) -> str:
    """The first key path present in one tree and not in the other, as a readable string."""
    def paths(tree, is_leaf):
        return [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_leaf)[0]]

    g_paths, p_paths = paths(grads, _is_grad_leaf), paths(params, _is_var)
    for gp, pp in zip(g_paths, p_paths, strict=False):
        if gp != pp:
            return f"grads{gp or '<root>'} vs params{pp or '<root>'}"
    if len(g_paths) > len(p_paths):
        return f"grads{g_paths[len(p_paths)]} has no matching param"
    if len(p_paths) > len(g_paths):
        return f"params{p_paths[len(g_paths)]} has no matching gradient"
    return "the container types differ at the root"


def _flatten_grads(grads: Any, params: Any) -> tuple[list, list, Any, list]:
    """(param leaves, grad leaves, param treedef, key paths), grads matched to params' structure."""
    flat, p_def = jax.tree_util.tree_flatten_with_path(params, is_leaf=_is_var)
    try:
        g_leaves = p_def.flatten_up_to(grads)
    except (ValueError, TypeError):
        raise ValueError(
            f"apply_gradients: grads do not have the structure of params; first difference at "
            f"{_first_difference(grads, params)}. Pass grads with exactly the structure of params "
            "(None for a param without gradient)."
        ) from None
    paths = [p for p, _ in flat]
    return [x for _, x in flat], g_leaves, p_def, paths


def _owners(leaves: list) -> list[int]:
    """For each leaf, the index of the first leaf holding the same variable (itself if none)."""
    first: dict[int, int] = {}
    return [first.setdefault(p.resource_id, i) if isinstance(p, Variable) else i for i, p in enumerate(leaves)]


def _sum_grads(a: Any, b: Any, shape: tuple) -> Any:
    """The sum of two gradients of one variable, sparse while both are."""
    if isinstance(a, IndexedSlices) and isinstance(b, IndexedSlices):
        return IndexedSlices(jnp.concatenate([a.values, b.values]), jnp.concatenate([a.indices, b.indices]), shape)

    def dense(g):
        return add_rows(jnp.zeros(shape, g.values.dtype), g.indices, g.values) if isinstance(g, IndexedSlices) else g

    return dense(a) + dense(b)


def _check_indices_range(indices: Any, nrows: int, label: str) -> None:
    """IndexError (TF: InvalidArgumentError) for concrete out-of-range indices."""
    if isinstance(indices, _core.Tracer):
        return
    idx = np.asarray(indices).reshape(-1)
    bad = np.flatnonzero((idx < 0) | (idx >= nrows))
    if bad.size:
        k = int(bad[0])
        raise IndexError(
            f"apply_gradients: IndexedSlices gradient for {label}: index {int(idx[k])} at offset {k} in "
            f"indices is out of range for a first dimension of size {nrows} (valid: 0..{nrows - 1})."
        )


def _convert_grad(g: Any, var: Any, label: str) -> Any:
    """The gradient as an array or IndexedSlices of values, checked against the variable."""
    if not jnp.issubdtype(var.dtype, jnp.inexact):
        raise ValueError(
            f"apply_gradients: {label} has dtype {var.dtype}; optimizers update floating-point or complex "
            "variables only (as TF's). Make it trainable=False, or pass None as its gradient."
        )
    if isinstance(g, IndexedSlices):
        values = _value(g.values)
        indices = _value(g.indices)
        if not hasattr(values, "shape") or not hasattr(indices, "shape"):
            values, indices = jnp.asarray(values), jnp.asarray(indices)
        if not jnp.issubdtype(indices.dtype, jnp.integer) or indices.ndim != 1:
            raise TypeError(
                f"apply_gradients: IndexedSlices gradient for {label}: indices must be a 1-D integer array, "
                f"got shape {tuple(indices.shape)} dtype {indices.dtype}."
            )
        if var.ndim == 0 or tuple(values.shape) != (indices.shape[0], *var.shape[1:]):
            raise ValueError(
                f"apply_gradients: IndexedSlices gradient for {label}: values have shape {tuple(values.shape)}, "
                f"expected {(indices.shape[0], *var.shape[1:])} (indices shape {tuple(indices.shape)} + "
                f"variable shape {tuple(var.shape)}[1:])."
            )
        if g.dense_shape is not None and tuple(g.dense_shape) != tuple(var.shape):
            raise ValueError(
                f"apply_gradients: IndexedSlices gradient for {label}: dense_shape {tuple(g.dense_shape)} "
                f"differs from the variable's shape {tuple(var.shape)}."
            )
        _check_dtype(values.dtype, var.dtype, label)
        return IndexedSlices(values, indices, g.dense_shape)
    try:
        g = convert_to_tensor_or_indexed_slices(g)
    except TypeError:
        raise TypeError(
            f"apply_gradients: gradient for {label} must be convertible to a Tensor or IndexedSlices, "
            f"or None: got {type(g).__name__} {g!r:.60}."
        ) from None
    if tuple(g.shape) != tuple(var.shape):
        raise ValueError(
            f"apply_gradients: gradient for {label} has shape {tuple(g.shape)}, "
            f"the variable has shape {tuple(var.shape)}."
        )
    _check_dtype(g.dtype, var.dtype, label)
    return g


def _check_dtype(got: Any, want: Any, label: str) -> None:
    if got != want:
        raise TypeError(
            f"apply_gradients: gradient for {label} has dtype {got}, the variable has dtype {want}. "
            f"Cast the gradient with .astype({want})."
        )


def _dedupe(values: Array, indices: Array, nrows: int) -> tuple[Array, Array]:
    """Sums rows with equal indices; unique indices padded with `nrows` (an out-of-range row, dropped)."""
    n = indices.shape[0]
    uniq, inv = jnp.unique(indices, return_inverse=True, size=n, fill_value=nrows)
    return jax.ops.segment_sum(values, inv.reshape(-1), num_segments=n), uniq


def gather_rows(x: Array, idx: Array) -> Array:
    """Rows `x[idx]`; out-of-range (padding) rows read as zeros."""
    return x.at[idx].get(mode="fill", fill_value=0, wrap_negative_indices=False)


def set_rows(x: Array, idx: Array, rows: Array) -> Array:
    """`x` with rows `idx` replaced; out-of-range (padding) rows are dropped."""
    return x.at[idx].set(rows, mode="drop", wrap_negative_indices=False)


def add_rows(x: Array, idx: Array, rows: Array) -> Array:
    """`x` with `rows` added at `idx` (duplicates accumulate); out-of-range rows are dropped."""
    return x.at[idx].add(rows, mode="drop", wrap_negative_indices=False)


def as_dtype(x: Any, dtype: Any) -> Array:
    """A hyperparameter as TF passes it to a kernel: a float32 tensor cast to the variable's dtype."""
    return jnp.asarray(x, jnp.float32).astype(dtype)


@dataclasses.dataclass(frozen=True)
class Optimizer:
    """Base of all optimizers: an immutable, hashable config; state lives in `OptimizerState`.

    Public API:

    - ``init(params) -> OptimizerState``: creates slot Variables (named
      ``<primary>/<slot>``, linked to the primary by resource id, with its
      dtype and sharding) and non-slot Variables. Call it outside jit.
    - ``update(grads, params, state, step=None) -> (params, state)``: the pure,
      un-jitted step; use it inside your own ``jax.jit`` (a wrapper such as a
      loss-scale optimizer calls this).
    - ``apply_gradients(grads, params, state, step=None)``: ``update`` under
      ``jax.jit`` with ``params`` and ``state`` donated; the optimizer is a
      static argument, so each config compiles once per input structure.

    ``params`` is a pytree whose leaves are Variables or plain arrays. A plain
    array param is updated too; its slots are plain arrays (there is no
    resource to link a slot Variable to). ``grads`` has params' structure; a leaf is an array, a Variable,
    an `IndexedSlices` or None (skipped, as are non-trainable Variables).
    Hyperparameters are floats or callables ``f(step)``; a callable needs
    ``step=`` (e.g. the global step's value). Arithmetic runs in the
    variable's dtype with hyperparameters rounded to float32 first, as TF's
    kernels do. `IndexedSlices` indices are range-checked while concrete
    (``apply_gradients``, or ``update`` outside jit); inside a caller's jit
    out-of-range rows are dropped, as `Variable.scatter_add` does.

    Subclass contract (all on array values, inside the traced step):

    - ``_slot_inits() -> {slot name: fill value}`` and
      ``_non_slot_inits() -> {name: float32 initial value}``;
    - ``_dense(h, grad, var, slots, non_slots) -> (var, slots)`` and
      ``_sparse(h, values, indices, var, slots, non_slots) -> (var, slots)``
      where ``h`` maps hyperparameter names to resolved values, ``slots`` maps
      slot names to arrays; sparse indices are unique, padded with an
      out-of-range row (see `gather_rows` / `set_rows`), unless
      ``_dedup = False`` (then raw indices, duplicates included);
    - ``_finish(h, non_slots) -> non_slots`` runs once per step.

    A wrapper overrides ``init``/``update`` and delegates to an inner optimizer.

    >>> import jax.numpy as jnp, varstate
    >>> from varstate.optimizers import GradientDescent
    >>> w = varstate.Variable(jnp.array([1.0, 2.0]), name="w")
    >>> opt = GradientDescent(0.5)
    >>> state = opt.init({"w": w})
    >>> params, state = opt.apply_gradients({"w": jnp.array([1.0, 1.0])}, {"w": w}, state)
    >>> params["w"].value.tolist(), params["w"].resource_id == w.resource_id
    ([0.5, 1.5], True)
    """

    _dedup: ClassVar[bool] = True
    _hyper_names: ClassVar[tuple[str, ...]] = ()

    def __post_init__(self) -> None:
        for name in self._hyper_names:
            x = getattr(self, name)
            if callable(x):
                continue
            # Arrays are unhashable; a config must be a static jit argument.
            try:
                x = float(np.asarray(x))
            except (TypeError, ValueError):
                raise TypeError(
                    f"{type(self).__name__}: {name} must be a float or a callable of the step, "
                    f"got {type(x).__name__} {x!r:.40}."
                ) from None
            object.__setattr__(self, name, x)

    # --- subclass hooks -------------------------------------------------
    def _slot_inits(self) -> dict[str, float]:
        return {}

    def _non_slot_inits(self) -> dict[str, float]:
        return {}

    def _dense(self, h, grad, var, slots, non_slots):
        raise NotImplementedError

    def _sparse(self, h, values, indices, var, slots, non_slots):
        raise NotImplementedError

    def _finish(self, h, non_slots):
        return non_slots

    # --- public API -----------------------------------------------------
    def init(self, params: Any) -> OptimizerState:
        """Slots for every trainable param and the non-slot variables (call outside jit).

        >>> import jax.numpy as jnp, varstate
        >>> from varstate.optimizers import Momentum
        >>> w = varstate.Variable(jnp.zeros(2), name="dense/kernel")
        >>> Momentum(0.1, momentum=0.9).init([w]).slots["momentum"][0].name
        'dense/kernel/momentum'
        """
        leaves, p_def = jax.tree.flatten(params, is_leaf=_is_var)
        owners = _owners(leaves)
        slots = {}
        for slot_name, fill in self._slot_inits().items():
            made = []
            for i, p in enumerate(leaves):
                if isinstance(p, Variable) and not p.trainable:
                    made.append(None)
                elif owners[i] != i:  # a shared variable (tied weights): one slot, at every place
                    made.append(made[owners[i]])
                else:
                    made.append(_make_slot(p, slot_name, fill))
            slots[slot_name] = p_def.unflatten(made)
        non_slots = {}
        first = next((p for p in leaves if isinstance(p, Variable)), None)
        registry = first.handle.registry if first is not None else None
        placement = _scalar_placement(first)
        for name, value in self._non_slot_inits().items():
            value = jnp.asarray(value, jnp.float32, device=placement)
            non_slots[name] = Variable(value, name=name, trainable=False, registry=registry)
        return OptimizerState(slots=slots, non_slots=non_slots)

    def hyperparameters(self, step: Any = None) -> dict[str, Any]:
        """Hyperparameter values at `step` (callables are called with it).

        >>> from varstate.optimizers import GradientDescent
        >>> GradientDescent(lambda step: 0.1 / (1 + step)).hyperparameters(step=1)["learning_rate"]
        0.05
        """
        out = {}
        for name in self._hyper_names:
            x = getattr(self, name)
            if callable(x):
                if step is None:
                    raise TypeError(
                        f"{type(self).__name__}.{name} is a callable of the step, but no step was given: "
                        "pass step= to apply_gradients/update (e.g. step=global_step.value)."
                    )
                x = x(step)
            out[name] = x
        return out

    def update(self, grads: Any, params: Any, state: OptimizerState, step: Any = None) -> tuple[Any, OptimizerState]:
        """One pure step (no jit, no donation): returns new params and state.

        >>> import jax, jax.numpy as jnp
        >>> from varstate.optimizers import GradientDescent
        >>> opt = GradientDescent(0.1)
        >>> p = {"w": jnp.ones(2)}
        >>> new_p, _ = jax.jit(opt.update)({"w": jnp.ones(2)}, p, opt.init(p))
        >>> new_p["w"].tolist()
        [0.8999999761581421, 0.8999999761581421]
        """
        p_leaves, g_leaves, p_def, paths = _flatten_grads(grads, params)
        owners = _owners(p_leaves)
        slot_names = list(state.slots)
        slot_leaves = {n: p_def.flatten_up_to(state.slots[n]) for n in slot_names}
        non_slots = {k: v._value for k, v in state.non_slots.items()}
        if isinstance(step, Variable):
            step = step.read_value()
        h = self.hyperparameters(step)
        # One update per variable: the gradients of a variable found at several places (tied
        # weights) add up, as TF's tape adds the contributions of every read.
        work: dict[int, Any] = {}
        for i, (p, g) in enumerate(zip(p_leaves, g_leaves, strict=True)):
            if g is None or (isinstance(p, Variable) and not p.trainable):
                continue
            label = _label(paths[i], p)
            g = _convert_grad(g, _value(p), label)
            if isinstance(g, IndexedSlices):
                _check_indices_range(g.indices, _value(p).shape[0], label)
            work[owners[i]] = g if owners[i] not in work else _sum_grads(work[owners[i]], g, _value(p).shape)
        if not work:
            raise ValueError(
                "apply_gradients: no gradients provided for any variable (every gradient is None or its "
                f"variable is non-trainable): {[_label(paths[i], p) for i, p in enumerate(p_leaves)]}."
            )
        new_p = list(p_leaves)
        new_slots = {n: list(slot_leaves[n]) for n in slot_names}
        for i, g in work.items():
            p = p_leaves[i]
            var = _value(p)
            slots = {}
            for n in slot_names:
                s = slot_leaves[n][i]
                if s is None:
                    raise ValueError(
                        f"apply_gradients: no slot {n!r} for {_label(paths[i], p)}; the state was made by init() "
                        "for other params. Call opt.init(params) with these params."
                    )
                slots[n] = _value(s)
            if isinstance(g, IndexedSlices):
                values, indices = g.values, g.indices
                if self._dedup:
                    values, indices = _dedupe(values, indices, var.shape[0])
                var, slots = self._sparse(h, values, indices, var, slots, non_slots)
            else:
                var, slots = self._dense(h, g, var, slots, non_slots)
            new_p[i] = p._with_value(var) if isinstance(p, Variable) else var
            for n in slot_names:
                s = slot_leaves[n][i]
                new_slots[n][i] = s._with_value(slots[n]) if isinstance(s, Variable) else slots[n]
        for j, i in enumerate(owners):
            if i != j and i in work:
                new_p[j] = new_p[i]
                for n in slot_names:
                    new_slots[n][j] = new_slots[n][i]
        non_slots = self._finish(h, non_slots)
        state = OptimizerState(
            slots={n: p_def.unflatten(new_slots[n]) for n in slot_names},
            non_slots={k: v._with_value(non_slots[k]) for k, v in state.non_slots.items()},
        )
        return p_def.unflatten(new_p), state

    def apply_gradients(
        self, grads: Any, params: Any, state: OptimizerState, step: Any = None
    ) -> tuple[Any, OptimizerState]:
        """`update` under jit with `params` and `state` donated (their old buffers are deleted).

        >>> import jax.numpy as jnp, varstate
        >>> from varstate.optimizers import Adam
        >>> w = varstate.Variable(jnp.zeros(3), name="w")
        >>> opt = Adam(0.1)
        >>> state = opt.init([w])
        >>> (w,), state = opt.apply_gradients([jnp.ones(3)], [w], state)
        >>> [round(x, 4) for x in w.value.tolist()], round(state.non_slot("beta1_power").value.item(), 4)
        ([-0.1, -0.1, -0.1], 0.81)
        """
        g_def = _check_sparse_indices(grads, params)
        key = (self, g_def)
        if key not in _SEEN:
            # Arrays made outside jit are uncommitted and jit's outputs are committed: a second
            # compile on step 2 unless the first step's inputs are committed too (no copy: aliased).
            params, state = _commit((params, state))
            if len(_SEEN) < 4096:
                _SEEN.add(key)
        # Unflattening the outputs allocates one Python object per Variable (3,000 for Adam over
        # 1,000 params); with the collector on, that is several collections per step, each also
        # running jax's collection hook. Deferred to the end of the step, it is one.
        collect = gc.isenabled()
        gc.disable()
        try:
            return _jitted_update(self, grads, params, state, step)
        except TypeError:
            _validate_grads(grads, params)  # TF's message for a gradient jit cannot take (e.g. a string)
            raise
        finally:
            if collect:
                gc.enable()


def _validate_grads(grads: Any, params: Any) -> None:
    p_leaves, g_leaves, _, paths = _flatten_grads(grads, params)
    for i, (p, g) in enumerate(zip(p_leaves, g_leaves, strict=True)):
        if g is not None:
            _convert_grad(g, _value(p), _label(paths[i], p))


def _scalar_placement(first: Variable | None) -> Any:
    """Where a non-slot scalar lives: with the first variable (TF colocates it), replicated over its mesh."""
    sharding = getattr(first, "sharding", None) if first is not None else None
    if isinstance(sharding, jax.sharding.NamedSharding):
        return jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec())
    if isinstance(sharding, jax.sharding.SingleDeviceSharding):
        return sharding
    return None


def _make_slot(p: Any, slot_name: str, fill: float) -> Any:
    value = _value(p)
    sharding = getattr(value, "sharding", None)
    if isinstance(value, jax.ShapeDtypeStruct):
        raise ValueError(
            f"Optimizer.init: {p.name!r} is uninitialized; initialize or restore it before creating slots."
        )
    slot_value = jnp.full(value.shape, fill, value.dtype, device=sharding)
    return make_slot(p, slot_name, slot_value) if isinstance(p, Variable) else slot_value


def _tie(tree: Any) -> Any:
    """`tree` with every later place of a variable holding its first place's version.

    Tied weights share one buffer; read at one place only, the others are pruned from the
    executable, so jit never donates that buffer twice (which XLA refuses).
    """
    leaves, treedef = jax.tree.flatten(tree, is_leaf=_is_var)
    return treedef.unflatten([leaves[i] for i in _owners(leaves)])


def _step(opt: Optimizer, grads: Any, params: Any, state: OptimizerState, step: Any) -> tuple[Any, OptimizerState]:
    return opt.update(grads, _tie(params), _tie(state), step)


_jitted_update = jax.jit(_step, static_argnums=0, donate_argnums=(2, 3))

_SEEN: set = set()  # (optimizer, grads treedef) already stepped by apply_gradients


def _commit(tree: Any) -> Any:
    arrays = [x for x in jax.tree.leaves(tree) if isinstance(x, jax.Array) and not isinstance(x, _core.Tracer)]
    if len({d for x in arrays if x.committed for d in x.sharding.device_set}) > 1:
        return tree  # placed across devices already: committing the rest to one device would clash

    def commit(x):
        if isinstance(x, jax.Array) and not isinstance(x, _core.Tracer) and not x.committed:
            return jax.device_put(x, x.sharding, may_alias=True)
        return x
    return jax.tree.map(commit, tree)


# grads treedef -> positions (in jax.tree.leaves(grads)) of IndexedSlices indices, or () when none.
_SPARSE_POSITIONS: dict[Any, tuple[int, ...]] = {}


def _check_sparse_indices(grads: Any, params: Any) -> Any:
    """Checks concrete IndexedSlices indices before jit, where they are still visible; returns grads' treedef."""
    g_def = jax.tree.structure(grads)
    positions = _SPARSE_POSITIONS.get(g_def)
    if positions == ():
        return g_def
    if positions is None:
        positions = tuple(i for i, m in enumerate(jax.tree.leaves(_mark_indices(grads))) if m)
        if len(_SPARSE_POSITIONS) < 1024:
            _SPARSE_POSITIONS[g_def] = positions
        if not positions:
            return g_def
    try:
        p_leaves, g_leaves, _, paths = _flatten_grads(grads, params)
    except ValueError:
        return g_def  # reported with its path when the step is traced
    for i, (p, g) in enumerate(zip(p_leaves, g_leaves, strict=True)):
        if isinstance(g, IndexedSlices) and hasattr(_value(p), "shape") and _value(p).ndim:
            _check_indices_range(_value(g.indices), _value(p).shape[0], _label(paths[i], p))
    return g_def


def _mark_indices(grads: Any) -> Any:
    """grads with each leaf replaced by True where it is an IndexedSlices' indices, else False."""
    def mark(x):
        if isinstance(x, IndexedSlices):
            return IndexedSlices(jax.tree.map(lambda _: False, x.values), True, x.dense_shape)
        return jax.tree.map(lambda _: False, x)
    return jax.tree.map(mark, grads, is_leaf=_is_grad_leaf)

