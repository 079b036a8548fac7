"""Uninitialized variables and initialization straight on the target devices."""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from varstate._registry import Registry
from varstate._variable import Variable


def uninitialized(
    shape: Any,
    dtype: Any,
    *,
    name: str | None = None,
    sharding: jax.sharding.Sharding | None = None,
    trainable: bool = True,
    registry: Registry | None = None,
) -> Variable:
    """A Variable with a shape, dtype and placement but no value yet.

    Its value is a `jax.ShapeDtypeStruct`; use it as a restore template or
    initialize it with `zero_initializer`. Nothing is allocated.

    Args:
        shape: the shape, a sequence of non-negative ints.
        dtype: the dtype.
        name: the name, as `Variable`'s (default ``"Variable"``).
        sharding: where the value will live (restore and `zero_initializer`
            place it there); None for the default device.
        trainable: whether the variable is trainable.
        registry: the `Registry` the name is unique in; None is the default one.

    Returns:
        The uninitialized Variable (`Variable.is_initialized` is False).

    Raises:
        TypeError: `shape` is not a sequence of ints.
        ValueError: a dimension is negative.

    >>> import jax.numpy as jnp, varstate
    >>> v = varstate.uninitialized((2, 3), jnp.float32, name="w")
    >>> v.is_initialized, varstate.zero_initializer(v).value.sum().item()
    (False, 0.0)
    """
    try:
        shape = tuple(int(d) for d in shape)
    except TypeError:
        raise TypeError(f"uninitialized: shape must be a sequence of ints, got {shape!r}.") from None
    if any(d < 0 for d in shape):
        raise ValueError(f"uninitialized: negative dimension in shape {shape}.")
    struct = jax.ShapeDtypeStruct(shape, jnp.dtype(dtype), sharding=sharding)
    return Variable(struct, name=name, trainable=trainable, registry=registry)


@functools.lru_cache(maxsize=256)
def _zeros_fn(shape: tuple[int, ...], dtype: Any, sharding: Any):
    # jit with out_shardings creates each shard on its own device: no host
    # array and no transfer of the full value.
    return jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding)


def zero_initializer(v: Variable) -> Variable:
    """A new version of the uninitialized `v` holding zeros, created on its devices.

    Args:
        v: a Variable made by `uninitialized`.

    Returns:
        The new version, zeros with `v`'s shape, dtype and sharding (each
        shard made on its own device, no host copy).

    Raises:
        TypeError: `v` is not a Variable.
        ValueError: `v` already has a value (as TF's zero_initializer).

    >>> import jax.numpy as jnp, varstate
    >>> v = varstate.zero_initializer(varstate.uninitialized((3,), jnp.int32))
    >>> v.value.tolist()
    [0, 0, 0]
    """
    if not isinstance(v, Variable):
        raise TypeError(f"zero_initializer: expected a varstate.Variable, got {type(v).__name__}.")
    if v.is_initialized:
        raise ValueError(
            f"zero_initializer: variable {v.name!r} is already initialized; "
            "it only initializes variables made with varstate.uninitialized(...)."
        )
    struct = v.value
    return v._with_value(_zeros_fn(struct.shape, struct.dtype, struct.sharding)())
