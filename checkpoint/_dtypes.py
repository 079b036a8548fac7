"""Dtype tables and the 64->32-bit narrowing rule, in one place.

`BY_ENUM` maps TF's DataType enum to numpy dtypes (ml_dtypes for bfloat16,
float8, int4, uint4); `BY_NAME` maps the same dtypes by name, as the orbax
format stores them. Narrowing: with JAX's 64-bit types off, JAX holds an
int64 (TF's global step) as int32 and a float64 as float32. A stored 64-bit
value may then fill a 32-bit variable, but only if every element keeps its
value's class: an integer out of int32's range or a finite float that would
overflow is refused, naming the key. jax is imported only when a value is
narrowed, so reading TF files stays light.

>>> import numpy as np
>>> from checkpoint import _dtypes
>>> _dtypes.BY_ENUM[1], _dtypes.ENUM_OF[np.dtype("int64")], _dtypes.BY_NAME["bfloat16"].name
(dtype('float32'), 9, 'bfloat16')
>>> _dtypes.narrow(np.array([7], np.int64), np.dtype("int32"), "step", "step/.ATTRIBUTES/VARIABLE_VALUE")
array([7], dtype=int32)
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

from checkpoint.protos import types_pb2

BY_ENUM: dict[int, np.dtype] = {
    enum: np.dtype(t)
    for enum, t in {
        types_pb2.DT_FLOAT: np.float32,
        types_pb2.DT_DOUBLE: np.float64,
        types_pb2.DT_HALF: np.float16,
        types_pb2.DT_BFLOAT16: ml_dtypes.bfloat16,
        types_pb2.DT_INT8: np.int8,
        types_pb2.DT_INT16: np.int16,
        types_pb2.DT_INT32: np.int32,
        types_pb2.DT_INT64: np.int64,
        types_pb2.DT_UINT8: np.uint8,
        types_pb2.DT_UINT16: np.uint16,
        types_pb2.DT_UINT32: np.uint32,
        types_pb2.DT_UINT64: np.uint64,
        types_pb2.DT_BOOL: np.bool_,
        types_pb2.DT_COMPLEX64: np.complex64,
        types_pb2.DT_COMPLEX128: np.complex128,
        # The low-precision types TF 2.21 keeps in variables (one element per byte, as ml_dtypes).
        types_pb2.DT_FLOAT8_E5M2: ml_dtypes.float8_e5m2,
        types_pb2.DT_FLOAT8_E4M3FN: ml_dtypes.float8_e4m3fn,
        types_pb2.DT_INT4: ml_dtypes.int4,
        types_pb2.DT_UINT4: ml_dtypes.uint4,
    }.items()
}
ENUM_OF: dict[np.dtype, int] = {v: k for k, v in BY_ENUM.items()}
BY_NAME: dict[str, np.dtype] = {d.name: d for d in BY_ENUM.values()}
STRING_ENUM = types_pb2.DT_STRING


def by_name(name: str, key: str) -> np.dtype:
    """The dtype stored under `name` for checkpoint value `key` (ValueError if unsupported)."""
    try:
        return BY_NAME[name]
    except (KeyError, TypeError):
        raise ValueError(f"Checkpoint value {key!r} has unsupported dtype {name!r}.") from None


def is_real(dtype: np.dtype) -> bool:
    """Booleans, integers and floats, ml_dtypes' included (numpy gives those kind "V")."""
    dtype = np.dtype(dtype)
    return dtype.kind in "biuf" or (dtype.kind == "V" and dtype.name.startswith(("float", "bfloat", "int", "uint")))


def held_as(dtype: np.dtype) -> np.dtype:
    """The dtype JAX holds a value of `dtype` in (32-bit while 64-bit types are off)."""
    import jax

    return np.dtype(jax.dtypes.canonicalize_dtype(dtype))


def fits(stored: np.dtype, want: np.dtype) -> bool:
    """True if a stored value may fill a variable of dtype `want`: the same dtype, or its narrowed form."""
    stored, want = np.dtype(stored), np.dtype(want)
    return stored == want or held_as(stored) == want


def narrow(value: np.ndarray, want: np.dtype, name: str, key: str) -> np.ndarray:
    """`value` as `want` (see the module docstring); ValueError naming `key` if an element would change."""
    want = np.dtype(want)
    if value.dtype == want:
        return value
    if np.issubdtype(value.dtype, np.integer) and value.size:
        info = np.iinfo(want)
        lo, hi = value.min(), value.max()
        if lo < info.min or hi > info.max:
            raise ValueError(
                f"Tensor {key!r} ({value.dtype}) holds {lo if lo < info.min else hi}, out of range for variable "
                f"{name!r} ({want}; JAX's 64-bit types are disabled): enable them with "
                "jax.config.update('jax_enable_x64', True)."
            )
    with np.errstate(over="ignore", invalid="ignore"):  # checked just below
        out = value.astype(want)
    if np.issubdtype(value.dtype, np.inexact) and value.size:
        # float64 -> float32 turns values beyond float32's range into inf: refuse, as for integers.
        lost = np.isfinite(value) & ~np.isfinite(out)
        if lost.any():
            raise ValueError(
                f"Tensor {key!r} ({value.dtype}) holds {value[lost].flat[0]}, out of range for variable "
                f"{name!r} ({want}; JAX's 64-bit types are disabled): enable them with "
                "jax.config.update('jax_enable_x64', True)."
            )
    return out


def narrow_to_held(value: np.ndarray, name: str, key: str) -> np.ndarray:
    """`value` in the dtype JAX holds it in (narrowed, with the checks of `narrow`)."""
    return narrow(value, held_as(value.dtype), name, key)


PYTHON_TYPES: dict[str, type] = {"bool": bool, "int": int, "float": float, "str": str}


def python_type(value: object) -> type:
    """The Python type a Python value is saved as: bool, int, float or str (an IntEnum is an int)."""
    return next(t for t in PYTHON_TYPES.values() if isinstance(value, t))
