"""`convert_to_tensor_or_indexed_slices`: TF's conversion of a gradient-like value.

Kept out of `_indexed_slices` because it reads Variables, and `_variable`
imports `IndexedSlices` (for scatters): the sparse type imports nothing of
varstate.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from varstate._indexed_slices import IndexedSlices
from varstate._jax_compat import Tracer
from varstate._variable import Variable


def convert_to_tensor_or_indexed_slices(value: Any, dtype: Any = None, name: str | None = None) -> Any:
    """Returns `value` as IndexedSlices or a jax.Array (TF's `convert_to_tensor_or_indexed_slices`).

    Variables are read; IndexedSlices pass through; numbers, lists and numpy
    arrays are converted.

    Args:
        value: an array, a number, a list, a Variable or IndexedSlices.
        dtype: the dtype expected; numbers and numpy arrays are converted to
            it, jax.Arrays, Variables and IndexedSlices must already have it.
            None keeps the value's own.
        name: a name for error messages.

    Returns:
        `value` itself if IndexedSlices, else a jax.Array.

    Raises:
        TypeError: `value` is not convertible (a string, a dict, None...).
        ValueError: `dtype` differs from that of IndexedSlices, a jax.Array or
            a Variable (never cast, as TF).

    >>> import varstate
    >>> varstate.convert_to_tensor_or_indexed_slices([1.0, 2.0]).tolist()
    [1.0, 2.0]
    """
    where = f" ({name})" if name else ""
    if isinstance(value, Variable):
        value = value.read_value()
    if isinstance(value, (IndexedSlices, jax.Array)) and dtype is not None and jnp.dtype(dtype) != value.dtype:
        kind = "IndexedSlices" if isinstance(value, IndexedSlices) else "Tensor"  # never cast, as TF
        raise ValueError(
            f"Tensor conversion requested dtype {jnp.dtype(dtype)} for {kind} with dtype {value.dtype}{where}."
        )
    if isinstance(value, IndexedSlices):
        return value
    shown = isinstance(value, (str, bytes, dict, set)) or value is None  # named with its repr
    if shown or not (hasattr(value, "__array__") or isinstance(
            value, (jax.Array, Tracer, int, float, complex, bool, list, tuple, np.generic))):
        what = f"{type(value).__name__} {value!r:.60}" if shown else type(value).__name__
        raise TypeError(
            f"Cannot convert {what} to a tensor or IndexedSlices{where}: "
            "expected an array, a number, a Variable or IndexedSlices."
        )
    try:
        return jnp.asarray(value, dtype=dtype)
    except (TypeError, ValueError) as e:
        raise TypeError(f"Cannot convert {type(value).__name__} to a tensor{where}: {e}") from None
