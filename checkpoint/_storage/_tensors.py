"""Checkpoint values as TF tensors: host arrays, slices assembled, Python scalars as TF stores them."""

from __future__ import annotations

from typing import Any

import numpy as np

from checkpoint import _keys


def to_host(value: Any) -> np.ndarray:
    """`value` (a jax.Array, numpy array or scalar) as a host numpy array (a jax.Array copies itself over)."""
    return np.asarray(value)


def tf_tensors(values: dict[str, Any], object_graph: bytes) -> dict[str, Any]:
    """{checkpoint key: value | [(slice info, part), ...]} as `write_bundle`'s tensors (slices assembled)."""
    tensors: dict[str, Any] = {}
    for key, v in values.items():
        if isinstance(v, list):
            full = np.zeros(v[0][0].full_shape, np.dtype(v[0][1].dtype))
            for info, part in v:
                full[_keys.slice_index(info.var_offset, info.var_shape)] = to_host(part)
            tensors[key] = full
        elif isinstance(v, str):
            tensors[key] = v.encode()
        elif isinstance(v, (bool, int, float)):
            if type(v) is int and not -(2**63) <= v < 2**63:
                raise OverflowError(
                    f"Cannot save {key!r} in the TF format: the Python int {v} does not fit in int64. Save with "
                    "format='orbax' (any int), or store the number as a string."
                )
            tensors[key] = np.asarray(v, np.int64 if type(v) is int else None)
        else:
            tensors[key] = to_host(v)
    tensors[_keys.OBJECT_GRAPH_KEY] = object_graph
    return tensors
