"""The global step: a scalar integer, non-trainable Variable named `global_step`."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from varstate._registry import Registry
from varstate._variable import Variable, owning_variable


def int64_counter(name: str, registry: Registry | None, device: Any = None) -> Variable:
    """A zero TF int64 counter: int64 under `jax_enable_x64`, else int32 (JAX's widest), saved as int64."""
    dtype = jax.dtypes.canonicalize_dtype(np.int64)  # int32 unless jax_enable_x64
    # saved as int64: TF restores only an int64 into its own counter
    return owning_variable(jnp.zeros((), dtype, device=device), name=name, trainable=False, registry=registry,
                           saved_dtype=np.dtype(np.int64))


def get_or_create_global_step(registry: Registry | None = None) -> Variable:
    """The registry's global step, created (value 0) on first use.

    TF's global step is int64. JAX holds int64 only when `jax_enable_x64` is
    on; otherwise the value is int32 (JAX's widest integer then), and
    checkpoints still store it as int64, so TF restores it into its own
    global step and it restores back (with a range check). The variable
    returned is the version created first: a training loop threads its own
    updated versions, the registry only keeps the identity.

    TF1's finds a variable already named ``global_step`` and takes it as the
    global step. A registry holds identities, not values, so it cannot hand
    back that variable's current version: it refuses instead of making a
    second counter named ``global_step_1``, which no TF checkpoint knows.

    Args:
        registry: the `Registry` whose global step it is; None is the default one.

    Returns:
        The non-trainable scalar Variable named ``global_step``.

    Raises:
        ValueError: the registry already has a variable named
            ``global_step`` that this function did not make.

    >>> import varstate
    >>> r = varstate.Registry()
    >>> gs = varstate.get_or_create_global_step(r)
    >>> (gs.name, gs.trainable, gs.shape, gs is varstate.get_or_create_global_step(r))
    ('global_step', False, (), True)
    """
    registry = Registry.default() if registry is None else registry
    with registry._lock:
        if registry._global_step is None:
            # The registry holds the global step strongly, as TF's collection does.
            if registry._names.get("global_step") is not None:
                raise ValueError(
                    "get_or_create_global_step: this registry already has a variable named 'global_step' that it "
                    "did not make, so the global step made now would be 'global_step_1', a name TF's checkpoints "
                    "do not know (TF1 would take that variable, but a registry keeps identities, not its current "
                    "value). Use that variable as the global step (apply_gradients(..., global_step=it); "
                    "varstate.assert_global_step checks it), or rename it, or give the global step a registry of "
                    "its own: get_or_create_global_step(varstate.Registry())."
                )
            registry._global_step = int64_counter("global_step", registry)
        return registry._global_step


def assert_global_step(global_step: Any) -> None:
    """Checks that `global_step` can be a global step, as TF's `assert_global_step` does.

    Args:
        global_step: the candidate: a Variable or an array.

    Raises:
        TypeError: `global_step` is not a Variable or array, not of an integer
            dtype, or not a scalar.

    >>> import jax.numpy as jnp, varstate
    >>> varstate.assert_global_step(jnp.int32(3)) is None
    True
    """
    if not isinstance(global_step, (Variable, jax.Array, np.ndarray, np.generic)):
        raise TypeError(
            f"global_step must be a Variable or an array, got {type(global_step).__name__} {global_step!r:.60}."
        )
    dtype = np.dtype(global_step.dtype)
    if not np.issubdtype(dtype, np.integer):
        raise TypeError(f"global_step must have an integer dtype, got {dtype}.")
    if tuple(global_step.shape) != ():
        raise TypeError(f"global_step must be a scalar, got shape {tuple(global_step.shape)}.")
