"""Where optimizer state lives: slot Variables beside their primaries, non-slot scalars with the first.

A slot (TF's `slot_creator`) is a non-trainable Variable named
``<primary name>/<slot name>``, in the primary's registry, with its shape,
dtype and sharding, linked to it by resource id so that checkpoints file it
under the primary. An optimizer whose slots are shaped otherwise (Adafactor's
row and column accumulators) says so by `Optimizer._slot_layout`.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from varstate._jax_compat import ArrayImpl
from varstate._registry import outside_name_scopes
from varstate._variable import Variable, owning_variable
from varstate.optimizers._core._matching import array_of, entry, is_var, path_label
from varstate.optimizers._core._packed import is_slot_leaf


def make_slot(primary: Variable, slot_name: str, value: Any, *, fresh: bool = False) -> Variable:
    """A slot Variable for `primary` (TF's `_create_slot_var`), linked by resource id.

    Named ``<primary name>/<slot name>``, non-trainable, in the primary's
    registry; a shard's slot gets the shard's slice of a full slot named
    ``<full name>/<slot name>``. `value` is copied (it may be another array's
    buffer, e.g. an optax state holding the params) unless `fresh`: made for
    this slot alone.
    """
    info = primary.save_slice_info
    if info is not None:
        info = type(info)(f"{info.full_name}/{slot_name}", info.full_shape, info.var_offset, info.var_shape)
    registry = primary._handle.registry
    with outside_name_scopes():  # the primary's name has its scope already
        return owning_variable(value, name=f"{primary.name}/{slot_name}", trainable=False, save_slice_info=info,
                               registry=registry, copy=not fresh, slot_of=primary.resource_id, slot_name=slot_name)


def uncommitted(value: Any) -> bool:
    """True for an eager array made outside jit without a device (`jnp.ones`): jit may move it, and its outputs
    stay uncommitted only while every input is. State made for such a param is made uncommitted too: a committed
    slot would commit the first step's outputs, and the second step (and the caller's jitted gradient function,
    given the new params) would compile again for the committed inputs."""
    return type(value) is ArrayImpl and not value.committed


def non_slot_home(params: Any) -> tuple[Any, Any]:
    """(registry, device) of the non-slot variables of `params`: the first Variable's registry, and its place
    (TF colocates them with it), replicated over its mesh; None for an uncommitted first Variable (`uncommitted`)."""
    first = next((p for p in jax.tree.leaves(params, is_leaf=is_var) if isinstance(p, Variable)), None)
    if first is None:
        return None, None
    return first.handle.registry, replicated_home(first._value)


def replicated_home(value: Any) -> Any:
    """Where values colocated with the array `value` go: its place, replicated over its mesh; None for an
    uncommitted array (`uncommitted`) or another kind of sharding."""
    if uncommitted(value):
        return None
    sharding = value.sharding
    if isinstance(sharding, jax.sharding.NamedSharding):
        sharding = jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec())
    kept = isinstance(sharding, (jax.sharding.NamedSharding, jax.sharding.SingleDeviceSharding))
    return sharding if kept else None


def filled_slot(p: Any, slot_name: str, fill: float, verb: str = "Optimizer.init",
                layout: tuple | None = None) -> Any:
    """A new slot of `p` filled with `fill`: shaped as `p`, or as `layout` (`Optimizer._slot_layout`) says."""
    value = array_of(p)
    sharding = getattr(value, "sharding", None)
    if isinstance(value, jax.ShapeDtypeStruct):
        raise ValueError(f"{verb}: {p.name!r} is uninitialized; initialize or restore it before creating slots.")
    shape, dtype, axes = (*param_want(p), None) if layout is None else layout
    if axes is not None and isinstance(sharding, jax.sharding.NamedSharding):
        # each slot dimension is split as the param dimension it follows is (Adafactor's r: the rows)
        spec = tuple(sharding.spec) + (None,) * (value.ndim - len(sharding.spec))
        sharding = jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(*(spec[a] for a in axes)))
    slot_value = jnp.full(shape, fill, dtype, device=None if uncommitted(value) else sharding)
    return make_slot(p, slot_name, slot_value, fresh=True) if isinstance(p, Variable) else slot_value


# --- a state that does not belong to the params ---------------------------------------------------------------
class StateMismatchError(ValueError):
    """The state lacks (or misfiles) state for some params; `apply_gradients` then calls `init(params, state)`.

    Raised by `update` while the step is traced, where no Variable can be
    created; the message tells a caller of `update` what to do.
    """


def fit_error(slot_name: str, slot: Any, label: str, want: tuple) -> str | None:
    """Why `slot` cannot be the slot `slot_name` of the param `label`, which needs `want` (shape, dtype); else None."""
    v = array_of(slot)
    shape, dtype = tuple(want[0]), want[1]
    if tuple(v.shape) == shape and v.dtype == dtype:
        return None
    what = f"{slot.name!r}" if isinstance(slot, Variable) else "the plain array there"
    return (
        f"the optimizer state does not fit the params: slot {slot_name!r} of {label} is {what} with shape "
        f"{tuple(v.shape)} and dtype {v.dtype}, but the param needs shape {shape} and dtype {dtype}. "
        "Make a state for these params with opt.init(params), or restore the state saved with them."
    )


def param_want(p: Any) -> tuple:
    """What a slot of `p` must be: the param's own shape and dtype (every built-in optimizer's slots)."""
    v = array_of(p)
    return tuple(v.shape), v.dtype


def became_array(where: str, slot_name: str, slot: Variable, label: str, p: Any) -> ValueError:
    """The error for a param that was a Variable when its state was made and is a plain array now."""
    v = array_of(p)
    return ValueError(
        f"{where}: {label} is a plain array ({v.dtype}{list(v.shape)}), but the state holds the slot {slot_name!r} "
        f"{slot.name!r} of a Variable there: expected that Variable, found an array, so the step and the checkpoint "
        "would go on without its slots. Change a Variable's value and keep the Variable: `v.assign(v * 2)`, or "
        "`varstate.with_values(params, new_arrays)` for a tree."
    )


def refuse_params_became_arrays(params: Any, state: Any) -> None:
    """`became_array` for the first plain-array param whose place in `state` holds a slot Variable.

    Run when a step's plan is built (once per structure), before the trace.
    """
    flat, p_def = jax.tree_util.tree_flatten_with_path(params, is_leaf=is_var)
    for name, tree in getattr(state, "slots", {}).items():
        try:
            slots = p_def.flatten_up_to(tree)
        except (ValueError, TypeError):
            continue  # another structure: check_slots reports it
        for (path, p), s in zip(flat, slots, strict=True):
            if not isinstance(p, Variable) and isinstance(s, Variable):
                raise became_array("apply_gradients", name, s, path_label(path, p), p)


def check_slots(state: Any, names: Any, p_leaves: list, p_def: Any, paths: list, owners: list[int], want) -> dict:
    """{slot name: the slot leaves in params' order}, checked while the step is traced.

    Each param at leaf `i` with `want(i, name, slot found there)` not None (the
    slot's shape and dtype: the param's, or as `Optimizer._slot_layout` says) must
    have, in every slot tree, the slot linked to it (a Variable param) or an
    array (a plain-array param) of that shape and dtype;
    otherwise `StateMismatchError` (apply_gradients then creates what is missing,
    outside jit, and steps again).
    """
    def mismatch(why: str) -> StateMismatchError:
        return StateMismatchError(
            f"{entry()}: {why} The state was made for other params (a grown model, another model's "
            "state). apply_gradients creates the missing state, as TF's optimizers do, unless the state holds slots "
            "of other Variables (then it raises; reinitialize_slots=True makes fresh slots); inside your own jit, "
            "call `state = opt.init(params, state)` first (outside jit): it keeps the state's slots for these "
            "params and creates the others."
        )

    out = {}
    for n in names:
        if n not in state.slots:
            raise mismatch(f"the state has no {n!r} slots (it has {sorted(state.slots)}).")
        try:
            out[n] = p_def.flatten_up_to(state.slots[n])
        except (ValueError, TypeError):
            raise mismatch(f"state.slots[{n!r}] does not have the structure of params.") from None
    for i, p in enumerate(p_leaves):
        if owners[i] != i:
            continue
        for n in names:
            s = out[n][i]
            need = want(i, n, s)
            if need is None:
                continue
            label = path_label(paths[i], p)
            if isinstance(p, Variable):
                if not isinstance(s, Variable) or s.handle.slot_of != p.resource_id:
                    held = f"the slot of another variable ({s.name!r})" if isinstance(s, Variable) else (
                        "nothing" if s is None else "a plain array")
                    raise mismatch(f"no slot {n!r} for {label}: the state holds {held} there.")
            elif isinstance(s, Variable):
                raise became_array("apply_gradients", n, s, label, p)
            elif s is None:
                raise mismatch(f"no slot {n!r} for {label}.")
            why = fit_error(n, s, label, need)
            if why is not None:
                raise StateMismatchError(f"{entry()}: {why}")
    return out


def check_non_slots(state: Any, names: Any) -> None:
    missing = [n for n in names if n not in state.non_slots]
    if missing:
        raise StateMismatchError(
            f"{entry()}: the state has no non-slot variable {missing[0]!r} (it has {sorted(state.non_slots)}); "
            "it was made by another optimizer. apply_gradients creates it; inside your own jit, call "
            "`state = opt.init(params, state)` first (outside jit)."
        )


class Existing:
    """The slots a state already holds for params: by primary's resource id (Variables), by position (arrays).

    `init(params, state)` keeps these (TF creates a slot only where none
    exists) and makes the rest; one whose shape or dtype does not fit its
    param is a ValueError naming both.
    """

    def __init__(self, state: Any, p_def: Any, paths: list) -> None:
        self.by_rid: dict[tuple[str, int], Variable] = {}
        self.where: dict[tuple[str, int], str] = {}  # a slot's place in the state, for messages
        self.positional: dict[str, list] = {}
        self.paths = paths
        self.names = list(state.slots) if state is not None else []
        self.non_slots = dict(state.non_slots) if state is not None else {}
        self._param_ids: set[int] | None = None
        for name in self.names:
            tree = state.slots[name]
            for path, s in jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_slot_leaf)[0]:
                if isinstance(s, Variable) and s.handle.slot_of is not None:
                    if self.by_rid.setdefault((name, s.handle.slot_of), s) is s:
                        self.where[name, s.handle.slot_of] = f"state.slots[{name!r}]{jax.tree_util.keystr(path)}"
            try:
                self.positional[name] = p_def.flatten_up_to(tree)
            except (ValueError, TypeError):
                pass  # another structure: Variables are still found by identity

    def get(self, name: str, i: int, p: Any, want: tuple) -> Any:
        """The existing slot `name` of the param `p` at leaf `i`, checked to fit `want` (shape, dtype), or None."""
        if isinstance(p, Variable):
            s = self.by_rid.get((name, p.resource_id))
        else:
            leaves = self.positional.get(name)
            s = leaves[i] if leaves is not None else None
            if isinstance(s, Variable):
                raise became_array("Optimizer.init", name, s, path_label(self.paths[i], p), p)
        if s is None:
            return None
        why = fit_error(name, s, path_label(self.paths[i], p), want)
        if why is not None:
            raise ValueError(why[0].upper() + why[1:])
        return s

    def refuse_foreign(self, name: str, i: int, p: Any, leaves: list) -> None:
        """ValueError before a fresh slot `name` is made for the Variable `p` (leaf `i`) while the state holds
        `name` slots of Variables that are not among the params (`leaves`).

        Such a state was loaded or built for other Variables (a model rebuilt after a restore, `from_nnx` params
        with a state read from a file): its slots would be dropped for zeros. A param that merely has no slot yet
        (a grown model, one never stepped) gets one, as TF's optimizers create a missing slot.
        """
        if not isinstance(p, Variable):
            return  # a plain array has no identity: its slot is found by position
        if self._param_ids is None:
            self._param_ids = {x.resource_id for x in leaves if isinstance(x, Variable)}
        here = self.positional[name][i] if name in self.positional else None  # named first: the slot in p's place
        rid = here.handle.slot_of if isinstance(here, Variable) else None
        if rid is None or rid in self._param_ids:
            rid = next((r for n, r in self.by_rid if n == name and r not in self._param_ids), None)
            if rid is None:
                return
        key = (name, rid)
        slot = self.by_rid[key]
        primary = slot.handle.registry.get(rid)  # gone when every version of it was dropped
        other = primary.name if primary is not None else slot.name.removesuffix(f"/{name}")
        raise ValueError(
            f"The optimizer state holds slots of other Variables: {path_label(self.paths[i], p)} has no slot "
            f"{name!r} in it, while {self.where[key]} is {slot.name!r}, the slot of the Variable {other!r}, which "
            "is not among the params. Making fresh slots here would drop that state (a model rebuilt after a "
            "restore, or from_nnx(model) params with a state loaded for other Variables). Build the state on these "
            "params: state = opt.init(params), or restore the saved state into opt.init(params) (for a Keras "
            "file, checkpoint.keras.load_optimizer_state(path, opt, params)); or pass reinitialize_slots=True to "
            "apply_gradients or init to start these params' slots from their initial values."
        )
