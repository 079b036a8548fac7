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
  restore records the dtype each value was stored in, so it saves back so;
- structure: a tree flattened over Python's containers and optimizer
  states, which tells a save that its roots have the structure of the last
  save's (`checkpoint/_graph/_cache.py`).

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

from varstate._variable import Variable, derived
from varstate.optimizers._core._state import CONTAINERS

__all__ = ["flatten", "record_saved_dtype", "saved_dtype", "slot_link", "with_value"]


def with_value(var: Variable, value: Any) -> Variable:
    """A new version of `var` holding `value` as is (no cast, no placement)."""
    return var._with_value(value)


def flatten(tree: Any) -> tuple[list, Any] | None:
    """(leaves, treedef) of `tree` over Python's containers (dicts, lists, tuples, named tuples, None) and the
    optimizer step's own nodes (an optimizer state's parts, packed params, an AutoCastVariable's Variable), in C:
    a Variable and every other object is a leaf. None where JAX cannot make such a registry."""
    return None if CONTAINERS is None else CONTAINERS.flatten(tree)


def slot_link(var: Variable) -> tuple[int, str] | None:
    """(primary's resource id, slot name) when `var` is an optimizer slot, else None."""
    handle = var.handle
    if handle.slot_of is None or handle.slot_name is None:  # set together (optimizers' make_slot)
        return None
    return handle.slot_of, handle.slot_name


def saved_dtype(var: Variable) -> np.dtype:
    """The dtype a checkpoint stores for `var` (its own unless one was recorded)."""
    recorded = var.handle.saved_dtype
    return np.dtype(var.dtype if recorded is None else recorded)


def record_saved_dtype(var: Variable, dtype: Any) -> Variable:
    """`var`, remembering that it is stored as `dtype` (a restored int64 held as int32): itself when its handle
    says so already, else a version with a handle of its own (the one it shares, a template's, is immutable)."""
    # A quantized TF dtype compares equal to its integer storage: its metadata tag is what keeps it.
    dtype = np.dtype(dtype)
    recorded = None if dtype == np.dtype(var.dtype) and not dtype.metadata else dtype
    current = var.handle.saved_dtype
    if _tagged(recorded) == _tagged(current):
        return var
    return derived(var, saved_dtype=recorded)


def _tagged(dtype: np.dtype | None) -> tuple[np.dtype, Any] | None:
    # Compared with its tag (see above); None kept apart, as numpy reads a None it is compared with as float64.
    return None if dtype is None else (dtype, dtype.metadata)
