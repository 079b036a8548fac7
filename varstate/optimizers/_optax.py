"""`from_optax`: any optax GradientTransformation with its state as slot and non-slot Variables."""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import jax
import jax.numpy as jnp

from varstate._indexed_slices import IndexedSlices
from varstate._variable import Variable
from varstate.optimizers._core._base import Optimizer
from varstate.optimizers._core._matching import (
    array_of,
    cast_like,
    check_indices_range,
    convert_grad,
    flatten_grads,
    is_var,
    owner_positions,
    path_label,
    with_value,
)
from varstate.optimizers._core._messages import check_arguments
from varstate.optimizers._core._slots import Existing, check_non_slots, check_slots, make_slot, non_slot_home
from varstate.optimizers._core._state import OptimizerState


def _parts(opt_state: Any, values: Any, p_def: Any) -> tuple[Any, list[tuple[str, bool, Any]]]:
    """Splits an optax state into per-param subtrees (slots) and other leaves (non-slots).

    Returns the treedef whose leaves are those parts, and for each part its
    name, whether it is a slot and its value (a slot's as one entry per param
    leaf). A part is a slot when it has the structure of `values` (params
    with None at skipped positions) and the same shapes.
    """
    v_def = jax.tree.structure(values)
    v_shapes = [x.shape for x in jax.tree.leaves(values)]

    def per_param(x: Any) -> bool:
        if x is None or jax.tree.structure(x) != v_def:
            return False
        return [getattr(y, "shape", None) for y in jax.tree.leaves(x)] == v_shapes

    flat, outer = jax.tree_util.tree_flatten_with_path(opt_state, is_leaf=per_param)
    # Plain names: a dict key, an index, an attribute's name.
    short = [jax.tree_util.keystr(path[-1:], simple=True) if path else "state" for path, _ in flat]
    parts = []
    for (path, part), name in zip(flat, short, strict=True):
        if short.count(name) > 1:  # e.g. two `count`s in a chain: spell the whole path
            name = jax.tree_util.keystr(path, simple=True, separator="_")
        is_slot = per_param(part)
        parts.append((name, is_slot, p_def.flatten_up_to(part) if is_slot else part))
    return outer, parts


@dataclasses.dataclass(frozen=True)
class _OptaxOptimizer(Optimizer):
    tx: Any
    name: str = "optax"

    _elementwise: ClassVar[bool] = False  # a transformation may reduce over a whole param (clipping, factoring)

    def _values(self, p_leaves: list, p_def: Any) -> Any:
        # Non-trainable Variables are hidden from optax (None), so they get no state, as in TF; so is
        # every place of a variable after its first (tied weights: one state, at every place).
        owners = owner_positions(p_leaves)
        return p_def.unflatten([
            None if (isinstance(p, Variable) and not p.trainable) or owners[i] != i else array_of(p)
            for i, p in enumerate(p_leaves)
        ])

    def _initial_parts(self, p_leaves: list, p_def: Any) -> list[tuple[str, bool, Any]]:
        values = self._values(p_leaves, p_def)
        return _parts(self.tx.init(values), values, p_def)[1]

    def _initial_arrays(self, leaves: list, initial: Any = None) -> tuple[dict[str, list], dict[str, Any]]:
        """The initial slots (one entry per leaf, None where none) and non-slots as arrays: traceable (`to_optax`)."""
        del initial  # the transformation's own init is traceable
        parts = self._initial_parts(leaves, jax.tree.structure(leaves, is_leaf=is_var))
        return ({name: part for name, is_slot, part in parts if is_slot},
                {name: part for name, is_slot, part in parts if not is_slot})

    def init(self, params: Any, state: OptimizerState | None = None, *, stepped: Any = None,
             fused: bool | None = None, reinitialize_slots: bool = False) -> OptimizerState:
        check_arguments(self, "init", params, state=state)
        if stepped is not None:
            raise TypeError(
                "from_optax(...).init: stepped= leaves the slots of unstepped params out, as TF does; an optax "
                "transformation's init makes its state for every param. Call init(params) without stepped=."
            )
        if fused:
            raise TypeError(
                "from_optax(...).init: fused=True packs the slots of varstate's own optimizers; an optax "
                "transformation is fused by optax itself: from_optax(optax.flatten(optax.adam(...)))."
            )
        flat, p_def = jax.tree_util.tree_flatten_with_path(params, is_leaf=is_var)
        p_leaves, paths = [x for _, x in flat], [p for p, _ in flat]
        existing = Existing(state, p_def, paths)
        registry, placement = non_slot_home(p_leaves)  # replicated over the first variable's mesh, as the base's
        slots, non_slots = {}, {}
        for name, is_slot, part in self._initial_parts(p_leaves, p_def):
            if is_slot:
                made = []
                for i, (p, s) in enumerate(zip(p_leaves, part, strict=True)):
                    kept = None if s is None else existing.get(name, i, p, (s.shape, s.dtype))
                    if kept is None and s is not None and not reinitialize_slots:
                        existing.refuse_foreign(name, i, p, p_leaves)
                    # Copied: an optax state may hold the params' own arrays, and both are donated.
                    made.append(kept if kept is not None else None if s is None else
                                make_slot(p, name, s) if isinstance(p, Variable) else s)
                slots[name] = p_def.unflatten([made[i] for i in owner_positions(p_leaves)])
            elif name in existing.non_slots:
                non_slots[name] = existing.non_slots[name]
            else:
                part = part if placement is None else jax.device_put(part, placement)
                non_slots[name] = Variable(part, name=name, trainable=False, registry=registry)
        return OptimizerState(slots=slots, non_slots=non_slots)

    def update(
        self, grads: Any, params: Any, state: OptimizerState, step: Any = None, **extra_args: Any
    ) -> tuple[Any, OptimizerState]:
        """One step of the hosted transformation (pure, un-jitted; see `Optimizer.update`).

        Args:
            grads: the gradients, with the params' structure.
            params: the params pytree.
            state: the `OptimizerState` from `init`.
            step: ignored: optax transformations count their own steps.
            **extra_args: passed to ``tx.update`` (``value=`` for
                ``reduce_on_plateau``, ``grad=``, ...).

        Returns:
            ``(params, state)``, the new versions.

        >>> import jax, jax.numpy as jnp, optax
        >>> from varstate.optimizers import from_optax
        >>> plateau = optax.contrib.reduce_on_plateau(factor=0.5, patience=1)
        >>> opt = from_optax(optax.chain(optax.sgd(1.0), plateau))
        >>> p = [jnp.ones(2)]
        >>> state = opt.init(p)
        >>> for loss in (1.0, 2.0, 3.0):  # no improvement twice: the scale halves twice
        ...     p, state = jax.jit(opt.update)([jnp.ones(2)], p, state, value=loss)
        >>> state.non_slot("scale").value.item(), p[0].tolist()
        (0.25, [-0.75, -0.75])
        """
        del step  # optax transformations count their own steps
        p_leaves, g_leaves, p_def, paths = flatten_grads(grads, params)
        values = self._values(p_leaves, p_def)
        v_leaves = p_def.flatten_up_to(values)
        owners = owner_positions(p_leaves)
        summed: dict[int, Any] = {}  # a tied variable's gradients add up at its first place
        for i, (p, g) in enumerate(zip(p_leaves, g_leaves, strict=True)):
            v = v_leaves[owners[i]]
            if v is None or g is None:
                continue
            g = convert_grad(g, v, path_label(paths[i], p))
            if isinstance(g, IndexedSlices):
                check_indices_range(g.indices, v.shape[0], path_label(paths[i], p))
                g = IndexedSlices(g.values, g.indices, v.shape).to_dense()
            summed[owners[i]] = g if owners[i] not in summed else summed[owners[i]] + g
        # TF skips a variable without gradient: feed zeros, then keep its old value and slots.
        skipped = [i for i, v in enumerate(v_leaves) if v is not None and i not in summed]
        dense = [None if v is None else summed.get(i, jnp.zeros_like(v)) for i, v in enumerate(v_leaves)]
        outer, shapes = _parts(jax.eval_shape(self.tx.init, values), values, p_def)
        wants = {name: part for name, is_slot, part in shapes if is_slot}

        def want(i, name, slot):
            s = wants[name][i]
            return None if s is None or v_leaves[i] is None else (s.shape, s.dtype)

        slot_leaves = check_slots(state, list(wants), p_leaves, p_def, paths, owners, want)
        check_non_slots(state, [name for name, is_slot, _ in shapes if not is_slot])
        parts = []
        for name, is_slot, _ in shapes:
            if is_slot:
                parts.append(p_def.unflatten([
                    None if v is None else array_of(s) for s, v in zip(slot_leaves[name], v_leaves, strict=True)
                ]))
            else:
                parts.append(state.non_slots[name]._value)
        updates, new_opt_state = self.tx.update(
            p_def.unflatten(dense), outer.unflatten(parts), values, **extra_args
        )
        u_leaves = p_def.flatten_up_to(updates)
        new_p = [p if v is None or i in skipped else with_value(p, cast_like((v + u).astype(v.dtype), v))
                 for i, (p, v, u) in enumerate(zip(p_leaves, v_leaves, u_leaves, strict=True))]
        new_p = [new_p[i] for i in owners]
        slots, non_slots = {}, {}
        for (name, is_slot, _), part in zip(shapes, outer.flatten_up_to(new_opt_state), strict=True):
            if is_slot:
                old = p_def.flatten_up_to(state.slots[name])
                new = p_def.flatten_up_to(part)
                made = [o if o is None or n is None or i in skipped else with_value(o, cast_like(n, v_leaves[i]))
                        for i, (o, n) in enumerate(zip(old, new, strict=True))]
                slots[name] = p_def.unflatten([made[i] for i in owners])
            else:
                non_slots[name] = state.non_slots[name]._with_value(part)
        return p_def.unflatten(new_p), OptimizerState(slots=slots, non_slots=non_slots)


def from_optax(tx: Any, name: str = "optax") -> Optimizer:
    """Hosts an optax ``GradientTransformation`` as an `Optimizer` with identity-linked state.

    The parts of the optax state shaped like the params (e.g. Adam's ``mu``
    and ``nu``) become slot Variables named after their field, linked to
    their primaries; everything else (e.g. ``count``) becomes non-slot
    Variables. Field names that occur twice are spelled with their path
    (``0_count``). A state not shaped like the params (``optax.masked``'s,
    ``optax.multi_transform``'s, which hold a subset of them) has no slots:
    its moments are non-slot Variables named by path, so `get_slot` finds
    none and a rebuilt model is not matched by identity. None gradients leave their variable and its slots
    untouched (TF's rule; optax itself sees a zero gradient);
    `IndexedSlices` are densified; non-trainable Variables get no state.

    Args:
        tx: the optax ``GradientTransformation`` (already built with its
            hyperparameters: ``optax.adam(1e-3)``, not ``optax.adam``).
        name: a label for the optimizer, kept in its config (and repr); the
            state's variable names do not use it.

    Returns:
        An `Optimizer` whose `Optimizer.update` runs ``tx.update``.

    Raises:
        TypeError: `tx` is a varstate Optimizer already, a function that makes
            a transformation (not called), or has no ``init``/``update``.

    >>> import jax.numpy as jnp, optax, varstate
    >>> from varstate.optimizers import from_optax
    >>> w = varstate.Variable(jnp.ones(2), name="w")
    >>> opt = from_optax(optax.adam(0.1))
    >>> state = opt.init({"w": w})
    >>> params, state = opt.apply_gradients({"w": jnp.ones(2)}, {"w": w}, state)
    >>> state.get_slot(w, "mu").name, sorted(state.non_slots), [round(x, 3) for x in params["w"].value.tolist()]
    ('w/mu', ['count'], [0.9, 0.9])
    """
    if isinstance(tx, Optimizer):
        raise TypeError(
            f"from_optax: got {type(tx).__name__}, a varstate Optimizer already: use it as it is "
            "(from_optax hosts optax transformations; to_optax goes the other way)."
        )
    if not (hasattr(tx, "init") and hasattr(tx, "update")) and callable(tx):
        module = getattr(tx, "__module__", None) or ""
        name = getattr(tx, "__name__", type(tx).__name__)
        spelled = f"optax.{name}" if module.split(".")[0] == "optax" else name
        raise TypeError(
            f"from_optax: got {spelled}, a function that makes a transformation, not a transformation: call it "
            f"with its hyperparameters, e.g. from_optax({spelled}(1e-3))."
        )
    if not (hasattr(tx, "init") and hasattr(tx, "update")):
        raise TypeError(
            f"from_optax: expected an optax GradientTransformation (with init and update), got {type(tx).__name__}."
        )
    return _OptaxOptimizer(tx=tx, name=name)
