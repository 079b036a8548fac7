"""The jitted step behind `Optimizer.apply_gradients`: a thin host call, donation, placement.

A gradient goes one way: `apply_gradients` -> `apply_jitted` (host) -> the
jit -> `fused_update` (a fused state's groups, `_packed`) -> `opt.update`
(the math) -> back here to pin and unflatten. Missing state is
`apply_gradients`' to create (`StateMismatchError`, then `opt.init`).

The step is jitted over flat lists of arrays, not over Variables: a
Variable's treedef holds its identity (the `ResourceHandle`), so a jit over
Variables would trace again for every freshly built model. Here:

- per call, the host flattens grads and the rest with jax's C++ flatten,
  and params with a registry of Python's containers alone (`CONTAINERS`,
  `_state`), in which a Variable is a leaf: no Python call per Variable. A
  structure seen before (`_Seen`) is found by one dict lookup and one
  comparison of a list (per leaf, its Variable's handle or its type); its
  values are read by a list comprehension, its new versions made without a
  call per Variable and put into the caller's containers by the containers'
  treedef. The new state is returned as its flat values
  (`OptimizerState._from_flat`: its Variables are made when it is read), and
  the next step takes a state of that layout as it is: no slot Variable is
  made, read or checked on the way. Only a structure not seen before (or
  one holding other pytree classes, or a step inside `custom_gradient`)
  takes jax's default flatten, finds or makes the step's plan by those
  treedefs and unflattens with the caller's own treedef. Either way the new
  versions keep the caller's identities;
- a plan's jit key is the optimizer plus an identity-free signature of the
  structure (the treedef with Variables as leaves, and per Variable its
  trainability, slot link and tie, as positions): a freshly built model with
  the same shapes reuses the compiled step, without tracing again;
- placement: every new param, and its slots, leaves the step with the
  param's sharding, whatever the gradient's (XLA would otherwise propagate a
  mix of both, and the donated buffers could not be reused); the first step
  of a structure places the state as its params (`_state_on_params`) and
  commits the uncommitted rest only if some input is committed (`_commit`),
  so the second step's inputs are placed as the first's and nothing
  compiles again;
- layout: `update` must return params and state laid out as given (the
  outputs take the caller's treedef); else a ValueError names the first
  difference;
- donated inputs: a version that an earlier step donated raises
  `DonatedVariableError` naming it, not JAX's anonymous error.
"""

from __future__ import annotations

import dataclasses
import gc
import operator
import threading
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from varstate import _variable
from varstate._global_step import assert_global_step
from varstate._indexed_slices import IndexedSlices
from varstate._jax_compat import ArrayImpl, Tracer, is_deleted_array
from varstate._pack import Packed
from varstate._variable import Variable, donated_error, version
from varstate.optimizers._core._matching import (
    _check_sparse_indices,
    _explicit_sharding,
    _is_leaf,
    _validate_grads,
    array_of,
    entered,
    first_difference,
    is_var,
    owner_positions,
    with_value,
)
from varstate.optimizers._core._packed import PackedSlot, PackedTree, fused_update
from varstate.optimizers._core._slots import StateMismatchError, refuse_params_became_arrays
from varstate.optimizers._core._state import CONTAINERS, LeafLayout, OptimizerState

_flatten = jax.tree_util.tree_flatten


class _Fixed:
    """A keyword argument of `update` that is no array (lbfgs's ``value_fn``): part of the compiled step's key,
    as a static argument of jit is, held in the treedef (a pytree node with no children)."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value


jax.tree_util.register_pytree_node(_Fixed, lambda f: ((), f.value), lambda value, _: _Fixed(value))


class _Static:
    """A static argument of the flat jit (the step's key, its placement): a long tuple, hashed once.

    The step's key is (optimizer, signature, placement, use_global). It holds
    no identity (no handle, no treedef with handles), so jit's cache keeps no
    model alive and a freshly built model with the same structure hits it.
    With a mesh of Auto axes a traced value does not know its input's
    sharding and jit reuses one trace across input shardings, so the
    shardings to pin to (params', non-slots') are part of the key.
    """

    __slots__ = ("_hash", "value")

    def __init__(self, *value: Any) -> None:
        self.value, self._hash = value, hash(value)

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        return self is other or (isinstance(other, _Static) and self._hash == other._hash and self.value == other.value)


@dataclasses.dataclass(slots=True, eq=False)
class _Plan:
    """What the host needs to run one (optimizer, structure): the jit key, the param count, the last shardings."""

    key: _Static
    n_params: int
    sparse: bool
    sliced: bool  # a fused state of unpacked params on CPU: the step is compiled by `_jitted_sliced`
    shardings: tuple = ()


# The step's two caches, both for the host's time per step. _PLANS: a structure's plan by its treedefs, one dict
# lookup (a signature walks every leaf); its treedefs hold handles, so it is bounded and keeps few dead models'
# identities alive. _KEYS interns jit keys: jit's cache then matches a freshly built model's equal key by
# identity, instead of comparing two signatures on every step.
_PLANS: dict = {}  # (opt, grads def, (params, state, global step) def, (step, extra) def, use_global) -> _Plan
_KEYS: dict = {}
_MAX_PLANS = 256
_trace = threading.local()  # the treedefs of the call being traced (identity stays out of jit's key)


@dataclasses.dataclass(slots=True, eq=False)
class _Seen:
    """A (params, state, global step) structure a step ran before: its plan, its default treedef (for a trace),
    and how `CONTAINERS` sees its params and its state's parts (`LeafLayout`s) and its global step's handle.

    Params with this layout, a state of it (one this structure's step returned
    has it by identity, any other is compared) and this global step have the
    default treedef `ps_def`, Variables' identities included: they take `plan`
    without a signature, and the outputs are rebuilt as `ps_def.unflatten`
    would, the state as its flat values (`OptimizerState._from_flat`).
    """

    plan: _Plan
    ps_def: Any
    params: LeafLayout
    state: LeafLayout
    global_step: Any  # its handle, or None without one
    n_params: int  # leaves of params, then of the state

    def leaves(self, p_marks: list, p_leaves: list, state: OptimizerState, global_step: Any) -> list | None:
        """The default registry's leaves of (params, state, global step) when they have this structure, else None.
        `p_marks`, `p_leaves`: the params' as `CONTAINERS` flattens them."""
        if p_marks != self.params.marks or (
                self.global_step is not (None if global_step is None else global_step._handle)):
            return None
        flat = state._flat
        if flat is not None and flat[0] is self.state:
            s_values = flat[1]
        else:
            s_leaves, s_def = CONTAINERS.flatten(state._made())
            if s_def != self.state.c_def or LeafLayout.marks_of(s_leaves) != self.state.marks:
                return None
            s_values = self.state.values(s_leaves)
        leaves = self.params.values(p_leaves)
        leaves.extend(s_values)
        if global_step is not None:
            leaves.append(global_step._value)
        return leaves

    def rebuild(self, values: list) -> tuple:
        """The step's outputs in the caller's containers, each Variable's new version with its identity."""
        n, m = self.n_params, self.n_params + len(self.state.marks)
        return (self.params.rebuild(values[:n]), OptimizerState._from_flat(self.state, values[n:m]),
                None if self.global_step is None else version(values[m], self.global_step))


# Structures by (optimizer, grads def, other def, use_global, params' containers def): a few `_Seen` each (models
# of one layout differ by their Variables' identities alone); an empty tuple where none can be recognised.
# Bounded as _PLANS.
_SEEN: dict = {}


def _recall(key: tuple, params: Any, state: Any, global_step: Any) -> tuple | None:
    """(the `_Seen` of this structure, its default leaves) when a step ran on it before; () when it cannot be
    recognised (`_remember` found so; a read inside `custom_gradient`, which goes by the hook); else None."""
    if (CONTAINERS is None or _variable._read_hook is not None or type(state) is not OptimizerState
            or (global_step is not None and type(global_step) is not Variable)):
        return ()
    p_leaves, p_def = CONTAINERS.flatten(params)
    candidates = _SEEN.get((*key, p_def))
    if not candidates:
        return None if candidates is None else ()
    p_marks = LeafLayout.marks_of(p_leaves)
    for seen in candidates:
        leaves = seen.leaves(p_marks, p_leaves, state, global_step)
        if leaves is not None:
            return seen, leaves
    return None


def _remember(key: tuple, params: Any, state: OptimizerState, global_step: Any, plan: _Plan,
              ps_def: Any) -> _Seen | None:
    """This structure as a `_Seen`, kept for the next calls; None where `CONTAINERS` cannot stand in for the
    default registry (`LeafLayout.of`)."""
    p_layout = LeafLayout.of(params)
    parts = state._made()
    s_layout = None if p_layout is None else LeafLayout.of(parts, parts[1])
    key = (*key, CONTAINERS.flatten(params)[1])
    seen = None if p_layout is None or s_layout is None else _Seen(
        plan, ps_def, p_layout, s_layout, None if global_step is None else global_step._handle, len(p_layout.marks))
    if len(_SEEN) >= _MAX_PLANS:
        del _SEEN[next(iter(_SEEN))]
    # The newest first: models of one layout may take turns.
    _SEEN[key] = () if seen is None else (seen, *_SEEN.get(key, ())[:3])
    return seen


def _intern(key: _Static) -> _Static:
    if len(_KEYS) >= _MAX_PLANS * 4:
        _KEYS.clear()
    return _KEYS.setdefault(key, key)


def _new_plan(opt: Any, grads: Any, params: Any, state: Any, global_step: Any, other: Any, use_global: bool) -> _Plan:
    refuse_params_became_arrays(params, state)
    top, sig_def = _flatten((grads, params, state, global_step, other),
                           is_leaf=lambda x: isinstance(x, (Variable, PackedTree)))
    leaves = []
    for x in top:  # a packed slot tree: its layout, then its unpacked slots as leaves of their own
        leaves.append(x)
        if isinstance(x, PackedTree):
            leaves.extend(_flatten(x.loose, is_leaf=is_var)[0])
    first: dict[int, int] = {}
    for i, x in enumerate(leaves):
        if isinstance(x, Variable):
            first.setdefault(x._handle.resource_id, i)

    def describe(x: Any) -> Any:  # identity-free: positions instead of handles
        if isinstance(x, PackedTree):
            return x.layout.signature(lambda rid: first.get(rid, -1))
        if isinstance(x, Variable):
            h = x._handle
            return (type(x), first[h.resource_id], h.trainable, h.synchronization, h.aggregation, h.slot_name,
                    None if h.slot_of is None else first.get(h.slot_of, -1))
        return None

    sig = (sig_def, tuple(map(describe, leaves)))
    sparse = any(isinstance(g, IndexedSlices) for g in jax.tree.leaves(grads, is_leaf=_is_leaf))
    # Packed params step whole buffers, sliced nowhere: the default emitters run that step 2x-3x faster.
    sliced = not isinstance(params, Packed) and any(
        d.platform == "cpu" for bs in state.packed.values() for b in bs for d in b.devices())
    return _Plan(_intern(_Static(opt, sig, None, use_global)), len(jax.tree.leaves(params)), sparse, sliced)


def apply_jitted(opt: Any, grads: Any, params: Any, state: OptimizerState, step: Any, global_step: Any = None,
                 extra: dict | None = None) -> tuple:
    """`opt.update` under the flat jit, concrete sparse indices checked first (`Optimizer.apply_gradients`).

    Returns ``(params, state)``, or ``(params, state, global_step)`` when `global_step` is given (incremented).
    """
    if global_step is not None:
        if not isinstance(global_step, Variable):
            raise TypeError(
                f"apply_gradients: global_step must be the global step Variable "
                f"(varstate.get_or_create_global_step()), got {type(global_step).__name__} {global_step!r:.60}."
            )
        assert_global_step(global_step)
    opt = opt._compile_key()
    use_global = global_step is not None and (
        step is None or (isinstance(step, Variable) and step._handle is global_step._handle))
    other = (None if use_global else step, {k: _Fixed(v) if callable(v) else v for k, v in (extra or {}).items()})
    g_leaves, g_def = _flatten(grads)
    o_leaves, o_def = _flatten(other)
    key = (opt, g_def, o_def, use_global)
    # Rebuilding the outputs allocates a Python object per param Variable (per Variable on the slow path: 3,000
    # for Adam over 1,000 params); with the collector on, that is collections within the step, each also running
    # jax's collection hook. Deferred to the end of the step, it is one.
    collect = gc.isenabled()
    gc.disable()
    try:
        recalled = _recall(key, params, state, global_step)
        if recalled:
            seen, ps_leaves = recalled
            plan, ps_def = seen.plan, seen.ps_def
        else:
            ps_leaves, ps_def = _flatten((params, state, global_step))
            pkey = (opt, g_def, ps_def, o_def, use_global)
            plan = _PLANS.get(pkey)
            if plan is None:
                placed = _state_on_params(params, state, global_step)
                if placed is not None:
                    state, global_step = placed
                    ps_leaves = _flatten((params, state, global_step))[0]
                ps_leaves = _commit(ps_leaves, g_leaves + o_leaves)
                plan = _new_plan(opt, grads, params, state, global_step, other, use_global)
                if len(_PLANS) >= _MAX_PLANS:
                    del _PLANS[next(iter(_PLANS))]
                _PLANS[pkey] = plan
            seen = None if recalled == () else _remember(key, params, state, global_step, plan, ps_def)
        if plan.sparse:
            _check_sparse_indices(grads, params)
        # With one device nothing can drift, and jit keeps outputs uncommitted.
        if jax.device_count() > 1 and _place(plan, ps_leaves[:plan.n_params], state):
            ps_leaves = _commit(ps_leaves, g_leaves + o_leaves)  # new param arrays, a structure seen before
        # The usual slip, stepping the params or state a step already took, shows in their first leaves: named
        # here, before XLA logs its own line about the deleted buffer (two checks, 70 ns; every leaf of Adam over
        # 1,000 params would cost 0.2 ms a step).
        first_state = ps_leaves[plan.n_params] if len(ps_leaves) > plan.n_params else None
        if (ps_leaves and is_deleted_array(ps_leaves[0])) or is_deleted_array(first_state):
            spent = _first_donated(params, state, global_step)
            if spent is not None:
                raise donated_error(spent)
        _trace.defs = (g_def, ps_def, o_def)
        try:
            new = _jitted(plan)(plan.key, ps_leaves, g_leaves, o_leaves)
        finally:
            _trace.defs = None
        out = ps_def.unflatten(new) if seen is None else seen.rebuild(new)
        return out if global_step is not None else out[:2]
    except StateMismatchError:
        raise  # `apply_gradients` creates the missing state and steps again
    except TypeError:
        _validate_grads(grads, params)  # TF's message for a gradient jit cannot take (e.g. a string)
        raise
    except (RuntimeError, ValueError) as e:  # JAX raises either for a deleted buffer, by where it finds it
        spent = _first_donated(params, state, global_step)
        if spent is not None:
            raise donated_error(spent) from e
        clash = _device_clash(grads, params, state, global_step)
        if clash is not None:
            raise ValueError(clash) from e
        raise
    finally:
        if collect:
            gc.enable()


def _flat_step(key: _Static, ps_leaves: list, g_leaves: list, o_leaves: list) -> list:
    g_def, ps_def, o_def = _trace.defs
    opt, _, placement, use_global = key.value
    grads = g_def.unflatten(g_leaves)
    params, state, global_step = ps_def.unflatten(ps_leaves)
    step, extra = o_def.unflatten(o_leaves)
    extra = {k: v.value if isinstance(v, _Fixed) else v for k, v in extra.items()}
    # Traced only: the messages of the optimizer's update, run here, name apply_gradients (else they are its own).
    with entered("apply_gradients"):
        new = fused_update(opt.update, grads, _tie(params), _tie(state), global_step if use_global else step, extra)
    _check_layout(opt, (params, state), new)
    new_params, new_state = _pinned(params, state, *new, placement and placement.value)
    if global_step is not None:
        global_step = global_step._with_value(global_step.read_value() + 1)
    return _flatten((new_params, new_state, global_step))[0]


# The state before the gradients: XLA's CPU scheduler then runs a param's two slot updates one after the other,
# each reading its gradient while the other's read left it in cache (as optax's step), where gradients first had
# every first slot updated before any second one: a gradient read twice from memory, 10% of the step's time on
# 200 params of 256x64 (benchmarks/optimizers.py).
_jitted_update = jax.jit(_flat_step, static_argnums=(0,), donate_argnums=(1,))
# A fused state's step reads each param's slice of the packed buffers: XLA:CPU's fusion emitters compile each of
# those slices as a kernel of its own (distinct offsets, so no two share one), 13 s for 1,000 slices; its older
# emitters take 3 s, and run the step no slower (1,000 x 16x4 Adam: first step 18 s -> 7.5 s, step 5.3 -> 4.1 ms;
# the unfused step, 1,000 alike kernels that the new emitters share, goes the other way: 6.7 s -> 17 s).
_jitted_sliced = jax.jit(_flat_step, static_argnums=(0,), donate_argnums=(1,),
                         compiler_options={"xla_cpu_use_fusion_emitters": False})


def _jitted(plan: _Plan) -> Any:
    return _jitted_sliced if plan.sliced else _jitted_update


def _check_layout(opt: Any, given: tuple, returned: Any) -> None:
    """ValueError when `update` returned params or state laid out otherwise than given (their first difference)."""
    for name, before, after in zip(("params", "state"), given, returned, strict=True):
        if jax.tree.structure(after) != jax.tree.structure(before):
            raise ValueError(
                f"apply_gradients: {type(opt).__name__}.update returned {name} laid out otherwise than it was "
                f"given; first difference: {first_difference(after, before, *_layout_names(name))}. "
                f"The jitted step hands its outputs back in the caller's own layout: return {name} in the "
                "containers given (a list for a list) and each Variable's new version in its place, or call "
                "update under your own jax.jit."
            )


def _layout_names(tree: str) -> tuple[tuple[str, str], tuple[str, str]]:
    return (f"returned {tree}", f"given {tree}"), (f"place in the given {tree}", f"place in the returned {tree}")


def lower(opt: Any, grads: Any, params: Any, state: OptimizerState, step: Any = None) -> Any:
    """The flat step lowered for these arguments (`.compile().memory_analysis()` in the benchmark)."""
    other: tuple[Any, dict] = (step, {})
    flat = [_flatten(x) for x in (grads, (params, state, None), other)]
    plan = _new_plan(opt, grads, params, state, None, other, False)
    _trace.defs = tuple(d for _, d in flat)
    try:
        return _jitted(plan).lower(plan.key, flat[1][0], flat[0][0], flat[2][0])
    finally:
        _trace.defs = None


def _labelled(**trees: Any) -> Iterator[tuple[str, Any]]:
    """(a name for the caller, its value) per leaf of the step's inputs: "Variable 'w' (params['w'])", "grads[0]"."""
    for where, tree in trees.items():
        for path, x in jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_var)[0]:
            at = f"{where}{jax.tree_util.keystr(path)}"
            yield (f"Variable {x.name!r} ({at})" if isinstance(x, Variable) else at), array_of(x)


def _first_donated(params: Any, state: OptimizerState, global_step: Any = None) -> str | None:
    """A name for the first param or state leaf whose buffer an earlier step donated, or None."""
    return next((label for label, v in _labelled(params=params, state=state, global_step=global_step)
                 if is_deleted_array(v)), None)


def _device_clash(grads: Any, params: Any, state: OptimizerState, global_step: Any = None) -> str | None:
    """Why one step cannot run, when two of its inputs are committed to different devices; else None.

    TF places each variable's update on that variable's device; a jitted step
    is one XLA program, which runs on one set of devices. JAX's own error
    names positions of the flat step's arguments, not the caller's variables.
    """
    first = None
    for label, v in _labelled(params=params, state=state, global_step=global_step, grads=grads):
        if type(v) is not ArrayImpl or not v.committed:
            continue
        devices = v.sharding.device_set
        if first is None:
            first = label, devices
        elif devices != first[1]:
            return (
                f"apply_gradients: {first[0]} is on {_devices(first[1])} but {label} is on {_devices(devices)}. "
                "One step runs as one XLA program on one set of devices (TF would run each variable's update "
                "on its own device): put every param and gradient on the same devices (one device, or shard "
                "them over one mesh with jax.device_put(x, NamedSharding(mesh, spec))), or give each "
                "device's params an optimizer state of their own and step them separately."
            )
    return None


def _devices(devices: Any) -> str:
    ids = sorted(devices, key=lambda d: d.id)
    return str(ids[0]) if len(ids) == 1 else f"devices {[d.id for d in ids]}"


def _tie(tree: Any) -> Any:
    """`tree` with every later place of a variable holding its first place's version.

    Tied weights share one buffer; read at one place only, the others are pruned from the
    executable, so jit never donates that buffer twice (which XLA refuses).
    """
    leaves, treedef = jax.tree.flatten(tree, is_leaf=is_var)
    return treedef.unflatten([leaves[i] for i in owner_positions(leaves)])


def _commit(leaves: list, others: list) -> list:
    """`leaves` (params and state) with every uncommitted concrete array committed where the committed ones
    among `leaves` and `others` (the gradients, the step) are (one device, or replicated over their mesh), or
    where it is (aliased, no copy); `leaves` as they are when nothing is committed.

    jit's outputs are uncommitted only while all its inputs are: a step given some committed input returns
    committed params and state, so the second step's inputs would differ from the first's and compile again
    (and so would the caller's jitted gradient function, given committed params). With the first step's
    params and state committed, every step sees the inputs of the first. Without a committed input (arrays made
    outside jit, state made for them by `init`) the outputs stay uncommitted: nothing to do.
    """
    concrete = [i for i, x in enumerate(leaves) if isinstance(x, jax.Array) and not isinstance(x, Tracer)]
    at = [i for i in concrete if not leaves[i].committed]
    if not at:
        return leaves
    committed: set[Any] = {x.sharding for x in [leaves[i] for i in concrete] + others
                           if type(x) is ArrayImpl and x.committed}
    if not committed:
        return leaves
    devices = {d for s in committed for d in s.device_set}
    # The rest joins the committed ones where jit would move it on every call, as its outputs will be (a global
    # step made on device 0 for params on device 1, or on one mesh): else step 2 compiles again.
    if len(devices) == 1:
        shardings: list[jax.sharding.Sharding] = [jax.sharding.SingleDeviceSharding(next(iter(devices)))] * len(at)
    elif devices:
        meshes = {getattr(s, "mesh", None) for s in committed}
        mesh = meshes.pop() if len(meshes) == 1 else None
        if not isinstance(mesh, jax.sharding.Mesh) or not all(d.process_index == jax.process_index()
                                                              for d in devices):
            return leaves  # placed across devices otherwise (or other processes'): left to jit
        shardings = [jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())] * len(at)
    # One batched device_put: 1,000 single ones cost 100 ms on CPU, about 30 times this.
    put = jax.device_put([leaves[i] for i in at], shardings, may_alias=True)
    leaves = list(leaves)
    for i, x in zip(at, put, strict=True):
        leaves[i] = x
    return leaves


# --- placement ---------------------------------------------------------------------------------------------------
_UNCOMMITTED = object()  # where the state of params made outside jit goes: uncommitted, as they are


def _state_on_params(params: Any, state: OptimizerState, global_step: Any) -> tuple | None:
    """(state, global step) placed as their params, as TF keeps a slot on its variable's device; None if they are.

    A step's executable is keyed by its inputs' placement, and its outputs
    take the params' (`_pinned`): a first step given state placed otherwise
    (made on device 0 for params on a mesh, committed where the params are
    not) would compile again on the second. So a slot goes to its param's
    sharding, the rest (non-slots, packed buffers, the global step) to the
    params' common place (their device, or replicated over their mesh); for
    uncommitted params, committed state is made uncommitted too (a host copy,
    once per structure: jit has no other way). Run once per structure.
    """
    p_leaves, p_def = jax.tree.flatten(params, is_leaf=is_var)
    values = [x for x in map(array_of, p_leaves) if type(x) is ArrayImpl]
    if not values:
        return None
    if not any(x.committed for x in values):
        common: Any = _UNCOMMITTED
    elif all(x.committed for x in values):
        shardings = {x.sharding for x in values}
        meshes = {getattr(x, "mesh", None) for x in shardings}
        mesh = meshes.pop() if len(meshes) == 1 else None
        if len({d for x in shardings for d in x.device_set}) == 1:
            common = jax.sharding.SingleDeviceSharding(next(iter(values[0].sharding.device_set)))
        elif isinstance(mesh, jax.sharding.Mesh):
            common = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
        else:
            return None  # over several devices otherwise: left to jit
    else:
        return None  # a mix: `_commit` commits the rest where the committed ones are
    moved = False

    def move(x: Any, where: Any) -> Any:
        nonlocal moved
        value = array_of(x)
        if type(value) is not ArrayImpl or not value.committed:
            return x  # an uncommitted one goes where the rest is, with the params (`_commit`)
        if not value.is_fully_addressable or (where is not _UNCOMMITTED and not where.is_fully_addressable):
            return x  # other processes' devices: every process would have to move it alike; left to jit
        if where is _UNCOMMITTED:
            if len(value.sharding.device_set) > 1:
                return x
            new = jnp.asarray(np.asarray(value))
        elif value.sharding == where:
            return x
        else:
            new = jax.device_put(value, where)
        moved = True
        return with_value(x, new)

    targets = [common if common is _UNCOMMITTED or type(v := array_of(p)) is not ArrayImpl else v.sharding
               for p in p_leaves]
    # `move` leaves a None and a packed slot (no array) as they are.
    slots = _per_param(state._stored, p_def, lambda leaves: [move(x, t) for x, t in zip(leaves, targets, strict=True)])
    non_slots = {k: move(v, common) for k, v in state.non_slots.items()}
    packed = {k: tuple(move(b, common) for b in bs) for k, bs in state.packed.items()}
    traced = {k: tuple(move(x, common) for x in pair) for k, pair in state._traced.items()}
    global_step = None if global_step is None else move(global_step, common)
    return (OptimizerState(slots, non_slots, packed, traced), global_step) if moved else None


def _per_param(stored: dict[str, Any], p_def: Any, f: Callable[[list], list]) -> dict[str, Any]:
    """The slot trees with `f` applied to the leaves (one per param) of each that is laid out as the params."""
    out = dict(stored)
    for name, tree in stored.items():
        if isinstance(tree, PackedTree):  # its unpacked slots (large, sharded params) as any
            if tree.layout.p_def == p_def:
                out[name] = PackedTree.build(p_def, f(tree.leaves()), tree.layout)
            continue
        try:
            out[name] = p_def.unflatten(f(p_def.flatten_up_to(tree)))
        except (ValueError, TypeError):
            pass  # not laid out like params (another optimizer's): left as it is
    return out


def _place(plan: _Plan, leaves: list, state: OptimizerState) -> bool:
    """Keys `plan` by the shardings of the param values `leaves` and of the non-slots; True if they changed and a
    param's value is uncommitted (made outside jit: `_commit` then decides). Called with several devices only."""
    # Concrete arrays only: a tracer (a step inside a caller's jit) has no sharding to key by.
    values = state._non_slot_values()
    shardings = tuple([x.sharding if type(x) is ArrayImpl else None for x in leaves])
    non_slots = tuple([x.sharding if type(x) is ArrayImpl else None for x in values])
    opt, sig, last, use_global = plan.key.value
    # The previous step's outputs carry the very sharding objects of its executable: committed, same key (no
    # hash or comparison of a long tuple).
    if last is not None and all(map(operator.is_, plan.shardings, shardings)) and last.value[1] == non_slots:
        return False
    if last is None or last.value != (shardings, non_slots):
        plan.key = _intern(_Static(opt, sig, _Static(shardings, non_slots), use_global))
    plan.shardings = shardings
    return not all([x.committed for x in leaves if type(x) is ArrayImpl])


def _target(value: Any, concrete: Any) -> Callable[[Any], Any] | None:
    """How to keep a traced output on `value`'s sharding: from its type (Explicit axes) or the concrete one."""
    typed = _explicit_sharding(value)
    if typed is not None:
        return lambda x: jax.sharding.reshard(x, typed)
    if isinstance(concrete, jax.sharding.Sharding) and len(concrete.device_set) > 1:
        return lambda x: jax.lax.with_sharding_constraint(x, concrete)
    return None


def _pin(x: Any, target: Callable[[Any], Any] | None, shape: tuple) -> Any:
    if target is None or x is None or isinstance(x, PackedSlot):  # packed: one device only, nothing to pin
        return x
    value = array_of(x)
    return with_value(x, target(value)) if tuple(value.shape) == shape else x


def _concrete(placement: Any, part: int, n: int) -> Any:
    """The concrete shardings `placement[part]` of `n` values; Nones without placement or for another layout."""
    return placement[part] if placement is not None and len(placement[part]) == n else [None] * n


def _pinned(params: Any, state: OptimizerState, new_params: Any, new_state: OptimizerState, placement: Any):
    """New params and slots on their params' shardings, non-slots on their own (traced)."""
    p_leaves, p_def = jax.tree.flatten(params, is_leaf=is_var)
    shardings = _concrete(placement, 0, len(p_leaves))
    targets = [(_target(array_of(p), c), tuple(array_of(p).shape)) for p, c in zip(p_leaves, shardings, strict=True)]

    def pinned(leaves: list) -> list:
        return [_pin(x, *t) for x, t in zip(leaves, targets, strict=True)]

    slots = new_state._stored
    if any(t for t, _ in targets):
        new_params = p_def.unflatten(pinned(p_def.flatten_up_to(new_params)))
        slots = _per_param(slots, p_def, pinned)
    given = state.non_slots
    ns_targets = {name: (_target(v._value, c), tuple(v.shape))
                  for (name, v), c in zip(given.items(), _concrete(placement, 1, len(given)), strict=True)}
    non_slots = {name: _pin(v, *ns_targets[name]) if name in ns_targets else v
                 for name, v in new_state.non_slots.items()}
    return new_params, OptimizerState(slots, non_slots, new_state.packed, new_state._traced)
