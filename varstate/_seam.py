"""The one door through which `checkpoint` touches varstate's internals.

`checkpoint` builds and restores object graphs from Variables. Everything it
needs beyond varstate's public names goes through the functions here, so
that varstate can change its private layout without breaking checkpoints,
and a reader of `checkpoint/` sees exactly what it relies on:

- value replacement: a new version of a Variable holding a restored value,
  without the checks `assign` makes (restore has already checked it);
- slot links: which primary (by resource id) and slot name a slot belongs to;
- saved dtype: the dtype a checkpoint stores for a Variable when it differs
  from the value's (TF's int64 counters while JAX's 64-bit types are off);
  restore records the dtype each value was stored in, so it saves back so.

>>> import jax.numpy as jnp, varstate
>>> from varstate import _seam
>>> w = varstate.Variable(jnp.zeros(2), name="w")
>>> _seam.with_value(w, jnp.ones(2)).resource_id == w.resource_id
True
>>> _seam.slot_link(w) is None
True
"""

from __future__ import annotations

from typing import Any

import numpy as np

from varstate._jax_compat import file_names_without_directories, stable_custom_call_targets
from varstate._variable import Variable

__all__ = [
    "file_names_without_directories",
    "record_saved_dtype",
    "saved_dtype",
    "slot_link",
    "stable_custom_call_targets",
    "with_value",
]


def with_value(var: Variable, value: Any) -> Variable:
    """A new version of `var` holding `value` as is (no cast, no placement)."""
    return var._with_value(value)


def slot_link(var: Variable) -> tuple[int, str] | None:
    """(primary's resource id, slot name) when `var` is an optimizer slot, else None."""
    handle = var.handle
    if handle.slot_of is None:
        return None
    return handle.slot_of, handle.slot_name


def saved_dtype(var: Variable) -> np.dtype:
    """The dtype a checkpoint stores for `var` (its own unless one was recorded)."""
    recorded = var.handle.saved_dtype
    return np.dtype(var.dtype if recorded is None else recorded)


def record_saved_dtype(var: Variable, dtype: Any) -> None:
    """Remember that `var` is stored as `dtype` (a restored int64 held as int32)."""
    # A quantized TF dtype compares equal to its integer storage: its metadata tag is what keeps it.
    dtype = np.dtype(dtype)
    var.handle.saved_dtype = None if dtype == np.dtype(var.dtype) and not dtype.metadata else dtype
