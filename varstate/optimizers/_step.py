"""The jitted step behind `Optimizer.apply_gradients`: donation, placement, missing state and compile caching.

`update` runs under one module-level `jax.jit` with the optimizer as a static
argument and params and state donated, so every config compiles once per
input structure and the step updates buffers in place. Around it:

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
from typing import TYPE_CHECKING, Any

import jax

from varstate._jax_compat import ArrayImpl, Tracer, in_transformation, is_deleted_array
from varstate._variable import Variable, donated_error
from varstate.optimizers._matching import (
    _check_sparse_indices,
    _explicit_sharding,
    _is_var,
    _owners,
    _validate_grads,
    _value,
)
from varstate.optimizers._slots import StateMismatchError
from varstate.optimizers._state import OptimizerState

if TYPE_CHECKING:
    from varstate.optimizers._base import Optimizer


def apply_jitted(
    opt: Optimizer, grads: Any, params: Any, state: OptimizerState, step: Any
) -> tuple[Any, OptimizerState]:
    """`opt.update` under `_jitted_update`, concrete sparse indices checked first (`Optimizer.apply_gradients`)."""
    g_def = _check_sparse_indices(grads, params)
    key = (opt, g_def)
    # Unflattening the outputs allocates one Python object per Variable (3,000 for Adam over
    # 1,000 params); with the collector on, that is several collections per step, each also
    # running jax's collection hook. Deferred to the end of the step, it is one.
    collect = gc.isenabled()
    gc.disable()
    try:
        if key not in _SEEN:
            # Arrays made outside jit are uncommitted and jit's outputs are committed: a second compile on
            # step 2 unless the first step's inputs are committed too (no copy: aliased).
            params, state = _commit((params, state))
            if len(_SEEN) < 4096:
                _SEEN.add(key)
        placement, uncommitted = _placement(params, state)
        if uncommitted:
            # New params (uncommitted arrays) with a (config, grads structure) seen before: commit them too.
            params, state = _commit((params, state))
        try:
            return _jitted_update(opt, grads, params, state, step, placement)
        except StateMismatchError:
            if in_transformation():
                raise  # under a caller's trace no Variable can be made; the message says what to do
        # Params without state: create it outside jit, as TF's optimizers create missing slots, and step again.
        state = opt.init(params, state)
        params, state = _commit((params, state))
        return _jitted_update(opt, grads, params, state, step, _placement(params, state)[0])
    except TypeError:
        _validate_grads(grads, params)  # TF's message for a gradient jit cannot take (e.g. a string)
        raise
    except (RuntimeError, ValueError) as e:  # JAX raises either for a deleted buffer, by where it finds it
        spent = _first_donated(params, state)
        if spent is not None:
            raise donated_error(spent) from e
        raise
    finally:
        if collect:
            gc.enable()


def _first_donated(params: Any, state: OptimizerState) -> str | None:
    """A name for the first param or state leaf whose buffer an earlier step donated, or None."""
    for where, tree in (("params", params), ("state", state)):
        for path, x in jax.tree_util.tree_flatten_with_path(tree, is_leaf=_is_var)[0]:
            if is_deleted_array(_value(x)):
                at = f"{where}{jax.tree_util.keystr(path)}"
                return f"Variable {x.name!r} ({at})" if isinstance(x, Variable) else at
    return None


def _tie(tree: Any) -> Any:
    """`tree` with every later place of a variable holding its first place's version.

    Tied weights share one buffer; read at one place only, the others are pruned from the
    executable, so jit never donates that buffer twice (which XLA refuses).
    """
    leaves, treedef = jax.tree.flatten(tree, is_leaf=_is_var)
    return treedef.unflatten([leaves[i] for i in _owners(leaves)])


def _step(
    opt: Optimizer, grads: Any, params: Any, state: OptimizerState, step: Any, placement: Any = None
) -> tuple[Any, OptimizerState]:
    new_params, new_state = opt.update(grads, _tie(params), _tie(state), step)
    return _pinned(params, state, new_params, new_state, placement)


_jitted_update = jax.jit(_step, static_argnums=(0, 5), donate_argnums=(2, 3))

_SEEN: set = set()  # (optimizer, grads treedef) already stepped by apply_gradients


def _commit(tree: Any) -> Any:
    arrays = [x for x in jax.tree.leaves(tree) if isinstance(x, jax.Array) and not isinstance(x, Tracer)]
    if len({d for x in arrays if x.committed for d in x.sharding.device_set}) > 1:
        return tree  # placed across devices already: committing the rest to one device would clash

    def commit(x):
        if isinstance(x, jax.Array) and not isinstance(x, Tracer) and not x.committed:
            return jax.device_put(x, x.sharding, may_alias=True)
        return x
    return jax.tree.map(commit, tree)


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
_multi_device: list = []  # [bool], filled on first use: one device in the process means nothing can drift


def _sharding(x: Any) -> Any:
    return x.sharding if type(x) is ArrayImpl else None  # not a tracer (a step inside a caller's jit)


def _placement(params: Any, state: OptimizerState) -> tuple[_Placement | None, bool]:
    """The placement key of a step, and whether a param's value is uncommitted (made outside jit).

    Costs one flatten of params per step (about 0.35 ms for 1,000 params), in processes with several devices
    only: with one, nothing can drift and jit keeps its outputs uncommitted too.
    """
    if not _multi_device:
        _multi_device.append(jax.device_count() > 1)
    if not _multi_device[0]:
        return None, False
    leaves = jax.tree.leaves(params)
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
    if target is None or x is None:
        return x
    value = _value(x)
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
    p_leaves, p_def = jax.tree.flatten(params, is_leaf=_is_var)
    concrete = placement.params if placement is not None and len(placement.params) == len(p_leaves) else None
    targets, shapes = [], []
    for i, p in enumerate(p_leaves):
        v = _value(p)
        targets.append(_target(v, concrete[i] if concrete is not None else None))
        shapes.append(tuple(v.shape))
    if not any(targets):
        pinned_params, slots = new_params, new_state.slots
    else:
        pinned_params = p_def.unflatten([
            _pin(x, t, s) for x, t, s in zip(p_def.flatten_up_to(new_params), targets, shapes, strict=True)
        ])
        slots = {}
        for name, tree in new_state.slots.items():
            try:
                leaves = p_def.flatten_up_to(tree)
            except (ValueError, TypeError):
                slots[name] = tree  # not laid out like params (another optimizer's): left as it is
                continue
            slots[name] = p_def.unflatten([_pin(x, t, s) for x, t, s in zip(leaves, targets, shapes, strict=True)])
    given = list(state.non_slots.values())
    ns_concrete = placement.non_slots if placement is not None and len(placement.non_slots) == len(given) else None
    ns_target = {
        name: (_target(v._value, ns_concrete[j] if ns_concrete is not None else None), tuple(v.shape))
        for j, (name, v) in enumerate(state.non_slots.items())
    }
    non_slots = {
        name: _pin(v, *ns_target[name]) if name in ns_target else v for name, v in new_state.non_slots.items()
    }
    return pinned_params, OptimizerState(slots=slots, non_slots=non_slots)
