"""The jitted step behind `Optimizer.apply_gradients`: a thin host call, donation, placement, missing state.

The step is jitted over flat lists of arrays, not over Variables: a
Variable's treedef holds its identity (the `ResourceHandle`), so a jit over
Variables would trace again for every freshly built model. Here:

- per call, the host flattens grads, (params, state) and the rest with
  jax's C++ flatten, finds the step's plan by those treedefs (one dict
  lookup), calls the jit on the leaves, and unflattens the outputs with the
  caller's own treedef: the new versions keep the caller's identities;
- a plan's jit key is the optimizer plus an identity-free signature of the
  structure (the treedef with Variables as leaves, and per Variable its
  trainability, slot link and tie, as positions): a freshly built model with
  the same shapes reuses the compiled step, without tracing again;
- placement: every new param, and its slots, leaves the step with the
  param's sharding, whatever the gradient's (XLA would otherwise propagate a
  mix of both, and the donated buffers could not be reused);
- missing state: params without slots in the state (a re-created model) are
  reported by `update` while it is traced; the slots are then created here,
  outside jit, with `opt.init(params, state)`, and the step runs again;
- donated inputs: a version that an earlier step donated raises
  `DonatedVariableError` naming it, not JAX's anonymous error.
"""

from __future__ import annotations

import gc
import operator
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import jax

from varstate._global_step import assert_global_step
from varstate._jax_compat import ArrayImpl, Tracer, in_transformation, is_deleted_array
from varstate._variable import Variable, donated_error
from varstate.optimizers._core._matching import (
    _check_sparse_indices,
    _explicit_sharding,
    _sparse_positions,
    _validate_grads,
    array_of,
    is_var,
    owner_positions,
)
from varstate.optimizers._core._packed import PackedSlot, PackedTree, rebuild
from varstate.optimizers._core._slots import StateMismatchError
from varstate.optimizers._core._state import OptimizerState

if TYPE_CHECKING:
    from varstate.optimizers._core._base import Optimizer

_flatten = jax.tree_util.tree_flatten


class _Key:
    """The static argument of the flat jit: equal for every structure that compiles to the same step.

    Holds no identity (no handle, no treedef with handles), so jit's cache keeps
    no model alive and a freshly built model with the same structure hits it.
    The hash is computed once.
    """

    __slots__ = ("_hash", "opt", "placement", "sig", "sig_hash", "use_global")

    def __init__(self, opt: Any, sig: tuple, sig_hash: int, placement: Any, use_global: bool) -> None:
        self.opt, self.sig, self.sig_hash, self.placement, self.use_global = opt, sig, sig_hash, placement, use_global
        self._hash = hash((opt, sig_hash, placement, use_global))

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        return self is other or (
            isinstance(other, _Key) and self._hash == other._hash and self.use_global == other.use_global
            and self.placement == other.placement and self.sig == other.sig and self.opt == other.opt
        )


class _Plan:
    """What the host needs to run one (optimizer, structure): the jit key, where params and non-slots sit."""

    __slots__ = ("key", "legacy", "n_params", "sparse")

    def __init__(self, key: _Key, n_params: int, sparse: bool) -> None:
        self.key, self.n_params, self.sparse = key, n_params, sparse
        self.legacy = False  # update changes the layout: run over trees (_apply_trees)


_PLANS: dict = {}  # (opt, grads def, (params, state, global step) def, (step, extra) def, use_global) -> _Plan
_MAX_PLANS = 256  # treedefs hold handles: a bounded cache keeps few dead models' identities alive
_SEEN: set = set()  # (optimizer, grads treedef) already stepped over trees
_trace = threading.local()  # the treedefs of the call being traced (identity stays out of jit's key)


def _intern(key: _Key) -> _Key:
    """The one key object equal to `key`: jit's cache then matches it by identity, not by comparing signatures."""
    if len(_KEYS) >= _MAX_PLANS * 4:
        _KEYS.clear()
    return _KEYS.setdefault(key, key)


_KEYS: dict = {}


def _new_plan(opt: Any, g_def: Any, grads: Any, params: Any, state: Any, global_step: Any, other: Any,
              use_global: bool) -> _Plan:
    top, sig_def = _flatten((grads, params, state, global_step, other), is_leaf=_is_var_or_packed)
    leaves = []
    for x in top:  # a packed slot tree: its layout, then its unpacked slots as leaves of their own
        if isinstance(x, PackedTree):
            leaves.append(x)
            leaves.extend(_flatten(x.loose, is_leaf=is_var)[0])
        else:
            leaves.append(x)
    first: dict[int, int] = {}
    desc = []
    for i, x in enumerate(leaves):
        if isinstance(x, PackedTree):  # identity-free: each packed slot's place and its primary's position
            desc.append((PackedTree, x.layout.p_def, tuple(None if m is None else (
                m.group, m.offset, m.shape, None if m.slot is None else first.get(m.slot._handle.slot_of, -1),
                None if m.slot is None else m.slot._handle.slot_name) for m in x.layout.marks)))
        elif isinstance(x, Variable):
            h = x._handle
            first.setdefault(h.resource_id, i)
            desc.append(x)
        else:
            desc.append(None)
    for i, x in enumerate(desc):
        if isinstance(x, Variable):
            h = x._handle
            primary = None if h.slot_of is None else first.get(h.slot_of, -1)
            desc[i] = (type(x), first[h.resource_id], h.trainable, h.synchronization, h.aggregation, h.slot_name,
                       primary)
    sig = (sig_def, tuple(desc))
    n_params = len(jax.tree.leaves(params))
    sparse = _sparse_positions(g_def, grads) != ()
    return _Plan(_intern(_Key(opt, sig, hash(sig), None, use_global)), n_params, sparse)


def _is_var_or_packed(x: Any) -> bool:
    return isinstance(x, (Variable, PackedTree))


def _check_global_step(global_step: Any) -> None:
    if not isinstance(global_step, Variable):
        raise TypeError(
            f"apply_gradients: global_step must be the global step Variable "
            f"(varstate.get_or_create_global_step()), got {type(global_step).__name__} {global_step!r:.60}."
        )
    assert_global_step(global_step)


def apply_jitted(
    opt: Optimizer, grads: Any, params: Any, state: OptimizerState, step: Any, global_step: Any = None,
    extra: dict | None = None, _retry: bool = True,
) -> tuple:
    """`opt.update` under the flat jit, concrete sparse indices checked first (`Optimizer.apply_gradients`).

    Returns ``(params, state)``, or ``(params, state, global_step)`` when `global_step` is given (incremented).
    """
    if global_step is not None:
        _check_global_step(global_step)
    use_global = global_step is not None and (
        step is None or (isinstance(step, Variable) and step._handle is global_step._handle))
    other = (None if use_global else step, extra or {})
    g_leaves, g_def = _flatten(grads)
    ps_leaves, ps_def = _flatten((params, state, global_step))
    o_leaves, o_def = _flatten(other)
    pkey = (opt, g_def, ps_def, o_def, use_global)
    # Unflattening the outputs allocates one Python object per Variable (3,000 for Adam over 1,000 params); with
    # the collector on, that is several collections per step, each also running jax's collection hook. Deferred
    # to the end of the step, it is one.
    collect = gc.isenabled()
    gc.disable()
    try:
        plan = _PLANS.get(pkey)
        if plan is None:
            # Arrays made outside jit are uncommitted and jit's outputs are committed: a second compile on step 2
            # unless the first step's inputs are committed too (no copy: aliased).
            ps_leaves = _commit(ps_leaves)
            plan = _new_plan(opt, g_def, grads, params, state, global_step, other, use_global)
            if len(_PLANS) >= _MAX_PLANS:
                del _PLANS[next(iter(_PLANS))]
            _PLANS[pkey] = plan
        if plan.legacy:
            return _apply_trees(opt, grads, params, state, step, global_step, extra, use_global)
        if plan.sparse:
            _check_sparse_indices(grads, params)
        key = plan.key
        if _multi_device():
            placement, uncommitted = _placement(ps_leaves[:plan.n_params], state)
            if uncommitted:  # new params (uncommitted arrays) with a structure seen before: commit them too
                ps_leaves = _commit(ps_leaves)
            if placement is not key.placement:
                key = plan.key = _intern(_Key(opt, key.sig, key.sig_hash, placement, use_global))
        _trace.defs = (g_def, ps_def, o_def)
        try:
            out = _jitted_update(key, g_leaves, ps_leaves, o_leaves)
        except _Restructured:
            plan.legacy = True
            return _apply_trees(opt, grads, params, state, step, global_step, extra, use_global)
        finally:
            _trace.defs = None
        out = ps_def.unflatten(out)
        return out if global_step is not None else out[:2]
    except StateMismatchError:
        if in_transformation() or not _retry:
            raise  # under a caller's trace no Variable can be made; the message says what to do
        # Params without state: create it outside jit, as TF's optimizers create missing slots, and step again.
        state = opt.init(params, state)
        return apply_jitted(opt, grads, params, state, step, global_step, extra, _retry=False)
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


class _Restructured(Exception):  # noqa: N818 (a signal, caught below, never seen by users)
    """`update` returned params or state laid out otherwise than given: the step then runs over trees."""


def _flat_step(key: _Key, g_leaves: list, ps_leaves: list, o_leaves: list) -> list:
    g_def, ps_def, o_def = _trace.defs
    grads = g_def.unflatten(g_leaves)
    params, state, global_step = ps_def.unflatten(ps_leaves)
    step, extra = o_def.unflatten(o_leaves)
    out = _tree_step(key.opt, key.placement, key.use_global, grads, params, state, global_step, step, extra)
    leaves, out_def = _flatten(out)
    if out_def != ps_def:
        raise _Restructured
    return leaves


def _tree_step(opt: Optimizer, placement: Any, use_global: bool, grads: Any, params: Any, state: OptimizerState,
               global_step: Any, step: Any, extra: dict) -> tuple:
    if use_global:
        step = global_step
    new_params, new_state = opt.update(grads, _tie(params), _tie(state), step, **extra)
    new_params, new_state = _pinned(params, state, new_params, new_state, placement)
    if global_step is not None:
        global_step = global_step._with_value(global_step.read_value() + 1)
    return new_params, new_state, global_step


_jitted_update = jax.jit(_flat_step, static_argnums=(0,), donate_argnums=(2,))
# Over trees of Variables (identity in the treedef: a new model traces again): only for an `update` that
# returns another layout than it was given.
_jitted_trees = jax.jit(_tree_step, static_argnums=(0, 1, 2), donate_argnums=(4, 5, 6))


def _apply_trees(opt, grads, params, state, step, global_step, extra, use_global):
    key = (opt, jax.tree.structure(grads))
    if key not in _SEEN:
        params, state, global_step = _commit_tree((params, state, global_step))
        if len(_SEEN) < 4096:
            _SEEN.add(key)
    placement, uncommitted = (None, False)
    if _multi_device():
        placement, uncommitted = _placement(jax.tree.leaves(params), state)
    if uncommitted:
        params, state, global_step = _commit_tree((params, state, global_step))
    out = _jitted_trees(opt, placement, use_global, grads, params, state, global_step,
                        None if use_global else step, extra or {})
    return out if global_step is not None else out[:2]


def lower(opt: Optimizer, grads: Any, params: Any, state: OptimizerState, step: Any = None) -> Any:
    """The flat step lowered for these arguments (`.compile().memory_analysis()` in the benchmark)."""
    other = (step, {})
    g_leaves, g_def = _flatten(grads)
    ps_leaves, ps_def = _flatten((params, state, None))
    o_leaves, o_def = _flatten(other)
    plan = _new_plan(opt, g_def, grads, params, state, None, other, False)
    _trace.defs = (g_def, ps_def, o_def)
    try:
        return _jitted_update.lower(plan.key, g_leaves, ps_leaves, o_leaves)
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


def _commit(leaves: list) -> list:
    """`leaves` with every uncommitted concrete array committed: where it is (aliased, no copy), or where the
    committed ones are (one device, or replicated over their mesh)."""
    concrete = [i for i, x in enumerate(leaves) if isinstance(x, jax.Array) and not isinstance(x, Tracer)]
    at = [i for i in concrete if not leaves[i].committed]
    if not at:
        return leaves
    committed = {leaves[i].sharding for i in concrete if leaves[i].committed}
    devices = {d for s in committed for d in s.device_set}
    # The rest joins the committed ones where jit would move it on every call, as its outputs will be (a global
    # step made on device 0 for params on device 1, or on one mesh): else step 2 compiles again.
    if len(devices) == 1:
        shardings = [jax.sharding.SingleDeviceSharding(next(iter(devices)))] * len(at)
    elif devices:
        meshes = {getattr(s, "mesh", None) for s in committed}
        mesh = meshes.pop() if len(meshes) == 1 else None
        if not isinstance(mesh, jax.sharding.Mesh) or not all(d.process_index == jax.process_index()
                                                              for d in devices):
            return leaves  # placed across devices otherwise (or other processes'): left to jit
        shardings = [jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())] * len(at)
    else:
        shardings = [leaves[i].sharding for i in at]
    # One batched device_put: 1,000 single ones cost 100 ms on CPU, about 30 times this.
    put = jax.device_put([leaves[i] for i in at], shardings, may_alias=True)
    leaves = list(leaves)
    for i, x in zip(at, put, strict=True):
        leaves[i] = x
    return leaves


def _commit_tree(tree: Any) -> Any:
    leaves, treedef = _flatten(tree)
    return treedef.unflatten(_commit(leaves))


# --- placement ---------------------------------------------------------------------------------------------------
class _Placement:
    """The shardings of the param values and non-slot values given to one step: a static argument of the jit.

    With a mesh of Auto axes a traced value does not know its input's sharding
    and jit reuses one trace across input shardings, so the shardings to pin to
    must be part of the cache key. The hash is computed once; the previous
    step's placement is reused while its shardings compare equal, so a training
    loop pays one flatten of params per step (no hash of a long tuple).
    """

    __slots__ = ("_hash", "non_slots", "params")

    def __init__(self, params: tuple, non_slots: tuple) -> None:
        self.params, self.non_slots = params, non_slots
        self._hash = hash((params, non_slots))

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        return self is other or (
            isinstance(other, _Placement) and self._hash == other._hash
            and self.params == other.params and self.non_slots == other.non_slots
        )


_last_placement: list = [None]
_device_count: list = []  # [int], filled on first use


def _multi_device() -> bool:
    """Whether the process has several devices; with one, nothing can drift and jit keeps outputs uncommitted."""
    if not _device_count:
        _device_count.append(jax.device_count())
    return _device_count[0] > 1


def _sharding(x: Any) -> Any:
    return x.sharding if type(x) is ArrayImpl else None  # not a tracer (a step inside a caller's jit)


def _placement(leaves: list, state: OptimizerState) -> tuple[_Placement | None, bool]:
    """The placement key of a step, and whether a param's value is uncommitted (made outside jit).

    `leaves` are the param values. Called in processes with several devices only.
    """
    shardings = tuple([x.sharding if type(x) is ArrayImpl else None for x in leaves])
    non_slots = tuple([_sharding(v._value) if isinstance(v, Variable) else None for v in state.non_slots.values()])
    last = _last_placement[0]
    # The previous step's outputs carry the very sharding objects of its executable: committed, same key.
    if (last is not None and len(last.params) == len(shardings) and all(map(operator.is_, last.params, shardings))
            and last.non_slots == non_slots):
        return last, False
    # Arrays made outside jit are uncommitted and jit's outputs committed: one compile more unless committed now.
    uncommitted = not all([x.committed for x in leaves if type(x) is ArrayImpl])
    if last is not None and last.params == shardings and last.non_slots == non_slots:
        last.params = shardings  # equal values (hash unchanged): the next step's identity test then passes
        return last, uncommitted
    made = _Placement(shardings, non_slots)
    _last_placement[0] = made
    return made, uncommitted


def _target(value: Any, concrete: Any) -> tuple[str, Any] | None:
    """How to keep a traced output on `value`'s sharding: from its type (Explicit axes) or the concrete one."""
    typed = _explicit_sharding(value)
    if typed is not None:
        return "reshard", typed
    if isinstance(concrete, jax.sharding.Sharding) and len(concrete.device_set) > 1:
        return "constrain", concrete
    return None


def _pin(x: Any, target: tuple[str, Any] | None, shape: tuple) -> Any:
    if target is None or x is None or isinstance(x, PackedSlot):  # packed: one device only, nothing to pin
        return x
    value = array_of(x)
    if tuple(value.shape) != shape:
        return x
    how, sharding = target
    if how == "reshard":
        value = jax.sharding.reshard(value, sharding)
    else:
        value = jax.lax.with_sharding_constraint(value, sharding)
    return x._with_value(value) if isinstance(x, Variable) else value


def _pinned(params: Any, state: OptimizerState, new_params: Any, new_state: OptimizerState, placement: Any):
    """New params and slots on their params' shardings, non-slots on their own (traced)."""
    p_leaves, p_def = jax.tree.flatten(params, is_leaf=is_var)
    concrete = placement.params if placement is not None and len(placement.params) == len(p_leaves) else None
    targets, shapes = [], []
    for i, p in enumerate(p_leaves):
        v = array_of(p)
        targets.append(_target(v, concrete[i] if concrete is not None else None))
        shapes.append(tuple(v.shape))
    if not any(targets):
        pinned_params, slots = new_params, new_state._stored
    else:
        pinned_params = p_def.unflatten([
            _pin(x, t, s) for x, t, s in zip(p_def.flatten_up_to(new_params), targets, shapes, strict=True)
        ])
        slots = {}
        for name, tree in new_state._stored.items():
            if isinstance(tree, PackedTree):  # its unpacked slots (large, sharded params) are pinned as any
                if tree.layout.p_def != p_def:
                    slots[name] = tree
                    continue
                leaves = tree.leaves()
            else:
                try:
                    leaves = p_def.flatten_up_to(tree)
                except (ValueError, TypeError):
                    slots[name] = tree  # not laid out like params (another optimizer's): left as it is
                    continue
            pinned = [_pin(x, t, s) for x, t, s in zip(leaves, targets, shapes, strict=True)]
            slots[name] = rebuild(p_def, pinned, tree)
    given = list(state.non_slots.values())
    ns_concrete = placement.non_slots if placement is not None and len(placement.non_slots) == len(given) else None
    ns_target = {
        name: (_target(v._value, ns_concrete[j] if ns_concrete is not None else None), tuple(v.shape))
        for j, (name, v) in enumerate(state.non_slots.items())
    }
    non_slots = {
        name: _pin(v, *ns_target[name]) if name in ns_target else v for name, v in new_state.non_slots.items()
    }
    return pinned_params, OptimizerState(slots, non_slots, new_state.packed)
