"""The jitted step behind `Optimizer.apply_gradients`: donation, tied weights and compile caching.

`update` runs under one module-level `jax.jit` with the optimizer as a static
argument and params and state donated, so every config compiles once per
input structure and the step updates buffers in place.
"""

from __future__ import annotations

import gc
from typing import TYPE_CHECKING, Any

import jax

from varstate._jax_compat import Tracer
from varstate.optimizers._matching import _check_sparse_indices, _is_var, _owners, _validate_grads
from varstate.optimizers._state import OptimizerState

if TYPE_CHECKING:
    from varstate.optimizers._base import Optimizer


def apply_jitted(
    opt: Optimizer, grads: Any, params: Any, state: OptimizerState, step: Any
) -> tuple[Any, OptimizerState]:
    """`opt.update` under `_jitted_update`, concrete sparse indices checked first (`Optimizer.apply_gradients`)."""
    g_def = _check_sparse_indices(grads, params)
    key = (opt, g_def)
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
        return _jitted_update(opt, grads, params, state, step)
    except TypeError:
        _validate_grads(grads, params)  # TF's message for a gradient jit cannot take (e.g. a string)
        raise
    finally:
        if collect:
            gc.enable()


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
    arrays = [x for x in jax.tree.leaves(tree) if isinstance(x, jax.Array) and not isinstance(x, Tracer)]
    if len({d for x in arrays if x.committed for d in x.sharding.device_set}) > 1:
        return tree  # placed across devices already: committing the rest to one device would clash

    def commit(x):
        if isinstance(x, jax.Array) and not isinstance(x, Tracer) and not x.committed:
            return jax.device_put(x, x.sharding, may_alias=True)
        return x
    return jax.tree.map(commit, tree)
