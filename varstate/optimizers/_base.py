"""`Optimizer`: the base of TF-style optimizers as immutable configs with pure updates.

How a step runs (TF's `Optimizer.apply_gradients`, functionally): each param
leaf is paired with its gradient leaf; None gradients and non-trainable
Variables are skipped (`_matching`); a dense gradient goes to `_dense`, an
`IndexedSlices` to `_sparse` (after summing duplicate indices, as TF's
`_deduplicate_indexed_slices`, unless the subclass sets `_dedup = False`);
then `_finish` updates the non-slot variables once (Adam's beta powers).
`apply_gradients` runs that step jitted, with donation (`_step`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from varstate._indexed_slices import IndexedSlices
from varstate._variable import Variable
from varstate.optimizers import _step
from varstate.optimizers._matching import _flatten_grads, _gradients_by_owner, _is_var, _label, _owners, _value
from varstate.optimizers._rows import _dedupe
from varstate.optimizers._slots import _make_slot, _scalar_placement
from varstate.optimizers._state import OptimizerState

Hyper = float | Callable[[Any], Any]  # a hyperparameter: a float or a callable of the step


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
        work = _gradients_by_owner(p_leaves, g_leaves, paths, owners)
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
        return _step.apply_jitted(self, grads, params, state, step)
