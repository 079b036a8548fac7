"""Dtype tables and the 64->32-bit narrowing rule, in one place.

`BY_ENUM` maps TF's DataType enum to numpy dtypes (ml_dtypes for bfloat16,
float8, int4, uint4); `BY_NAME` maps the same dtypes by name, as the orbax
format stores them. TF's quantized types (qint8, quint8, qint16, quint16,
qint32) read as their integer storage, in a dtype tagged with the TF type
(`quantized`, `tf_name`) that `ENUM_OF` maps back to it.

Narrowing: with JAX's 64-bit types off, JAX holds an int64 (TF's global
step) as int32 and a float64 as float32. A stored 64-bit value may then fill
a 32-bit variable, but only if every element keeps its value's class: an
integer out of int32's range, a finite float that would overflow to inf or a
nonzero float that would underflow to 0 is refused, naming the key and the
fix (64-bit types on, or an explicit cast). jax is imported only when a
value is narrowed, so reading TF files stays light.

>>> import numpy as np
>>> from checkpoint import _dtypes
>>> _dtypes.BY_ENUM[1], _dtypes.ENUM_OF[np.dtype("int64")], _dtypes.BY_NAME["bfloat16"].name
(dtype('float32'), 9, 'bfloat16')
>>> _dtypes.narrow(np.array([7], np.int64), np.dtype("int32"), "step", "step/.ATTRIBUTES/VARIABLE_VALUE")
array([7], dtype=int32)
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import numpy as np

from checkpoint.protos import types_pb2

# ml_dtypes' types by TF enum: the low-precision types TF 2.21 keeps in variables (one element per byte).
# Importing ml_dtypes takes about 0.5 s, most of `varstate-ckpt`'s start, so the tables take these entries on their
# first miss (or at once when jax has imported ml_dtypes already).
_ML_DTYPES = {
    types_pb2.DT_BFLOAT16: "bfloat16",
    types_pb2.DT_FLOAT8_E5M2: "float8_e5m2",
    types_pb2.DT_FLOAT8_E4M3FN: "float8_e4m3fn",
    types_pb2.DT_INT4: "int4",
    types_pb2.DT_UINT4: "uint4",
}
_loaded = False
_TABLES: list[LazyTable] = []


class LazyTable(dict):
    """A dtype table whose ml_dtypes entries (`extra(ml_dtypes)`) are added on its first miss or listing."""

    def __init__(self, plain: dict, extra: Callable[[Any], dict]) -> None:
        super().__init__(plain)
        self._extra = extra
        _TABLES.append(self)
        if _loaded:
            self.fill()

    def fill(self) -> None:
        for key, value in self._extra(sys.modules["ml_dtypes"]).items():
            dict.__setitem__(self, key, value)

    def __missing__(self, key):
        if _loaded:
            raise KeyError(key)
        _load()
        return self[key]

    def __contains__(self, key: object) -> bool:
        if not _loaded and not super().__contains__(key):
            _load()
        return super().__contains__(key)

    def get(self, key, default=None):
        return self[key] if key in self else default

    def __iter__(self):
        _load()
        return super().__iter__()

    def keys(self):
        _load()
        return super().keys()

    def values(self):
        _load()
        return super().values()

    def items(self):
        _load()
        return super().items()


def _load() -> None:
    global _loaded
    if _loaded:
        return
    import ml_dtypes  # noqa: F401  (LazyTable.fill reads it from sys.modules)

    _loaded = True
    for table in _TABLES:
        table.fill()


def _ml_by_enum(ml: Any) -> dict[int, np.dtype]:
    return {enum: np.dtype(getattr(ml, attr)) for enum, attr in _ML_DTYPES.items()}


BY_ENUM: dict[int, np.dtype] = LazyTable({
    enum: np.dtype(t)
    for enum, t in {
        types_pb2.DT_FLOAT: np.float32,
        types_pb2.DT_DOUBLE: np.float64,
        types_pb2.DT_HALF: np.float16,
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
    }.items()
}, _ml_by_enum)

# TF's quantized types hold plain integers (the scale lives elsewhere, as TF's ops pass it). They read as
# their integer storage in a dtype tagged with the TF type: it compares and hashes equal to the plain
# integer dtype (numpy ignores metadata there), so it computes and restores as that integer, and a writer
# that finds the tag writes the TF type back.
_QUANTIZED_TYPES = (
    (types_pb2.DT_QINT8, "qint8", np.int8),
    (types_pb2.DT_QUINT8, "quint8", np.uint8),
    (types_pb2.DT_QINT16, "qint16", np.int16),
    (types_pb2.DT_QUINT16, "quint16", np.uint16),
    (types_pb2.DT_QINT32, "qint32", np.int32),
)
QUANTIZED: dict[int, np.dtype] = {
    enum: np.dtype(storage, metadata={"tf_dtype": name}) for enum, name, storage in _QUANTIZED_TYPES
}
_QUANTIZED_ENUM: dict[str, types_pb2.DataType] = {name: enum for enum, name, _ in _QUANTIZED_TYPES}


def tf_name(dtype: np.dtype) -> str | None:
    """The TF quantized type a tagged dtype stands for (``"qint8"``), or None for any other dtype.

    >>> import numpy as np
    >>> from checkpoint import _dtypes
    >>> q = _dtypes.quantized("qint8")
    >>> q == np.int8, _dtypes.tf_name(q), _dtypes.tf_name(np.dtype(np.int8)), _dtypes.ENUM_OF[q]
    (True, 'qint8', None, 11)
    """
    try:
        meta = np.dtype(dtype).metadata
    except TypeError:
        return None
    name = meta.get("tf_dtype") if meta else None
    return name if name in _QUANTIZED_ENUM else None


def quantized(name: str) -> np.dtype:
    """The tagged integer dtype of TF's quantized type `name` (qint8, quint8, qint16, quint16, qint32).

    Tag an array with it (``values.astype(quantized("qint8"))``) and `write_bundle` stores it as that
    TF type; reading it back gives the same tagged dtype.
    """
    try:
        return QUANTIZED[_QUANTIZED_ENUM[name]]
    except KeyError:
        raise ValueError(f"{name!r} is not a TF quantized type; expected one of {sorted(_QUANTIZED_ENUM)}.") from None


class _EnumOf(LazyTable):
    """{numpy dtype: TF enum}, where a dtype tagged as a quantized type maps to that type's enum."""

    def __getitem__(self, dtype: np.dtype) -> types_pb2.DataType:
        name = tf_name(dtype)
        return _QUANTIZED_ENUM[name] if name is not None else super().__getitem__(np.dtype(dtype))

    def __contains__(self, dtype: object) -> bool:
        return tf_name(dtype) is not None or super().__contains__(dtype)  # type: ignore[arg-type]  # tf_name: None for a non-dtype

    def get(self, dtype, default=None):
        # An untagged dtype in the table needs no quantized-tag lookup (a writer asks once per value).
        found = dict.get(self, dtype) if isinstance(dtype, np.dtype) and dtype.metadata is None else None
        return found if found is not None else super().get(dtype, default)


ENUM_OF: dict[np.dtype, types_pb2.DataType] = _EnumOf({v: k for k, v in dict.items(BY_ENUM)},
                                                      lambda ml: {v: k for k, v in _ml_by_enum(ml).items()})
BY_NAME: dict[str, np.dtype] = LazyTable({d.name: d for d in dict.values(BY_ENUM)},
                                         lambda ml: {d.name: d for d in _ml_by_enum(ml).values()})
BY_ENUM.update(QUANTIZED)  # after ENUM_OF and BY_NAME: a tagged dtype must not stand in for its plain integer
if "ml_dtypes" in sys.modules:  # imported already (jax imports it): nothing to save
    _load()
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


def _refuse(value: np.ndarray, want: np.dtype, name: str, key: str, held: object, what: str) -> ValueError:
    return ValueError(
        f"Tensor {key!r} ({value.dtype}) holds {held}, {what} for variable {name!r} ({want}; JAX's 64-bit types "
        "are disabled): enable them with jax.config.update('jax_enable_x64', True), or cast the value yourself "
        f"and assign it, if the change is acceptable (from a TF or orbax checkpoint: "
        f"checkpoint.read_checkpoint(path).get({key!r}).astype({want.name!r}))."
    )


def narrow(value: np.ndarray, want: np.dtype, name: str, key: str) -> np.ndarray:
    """`value` as `want` (see the module docstring); ValueError naming `key` if an element would change class.

    >>> import numpy as np
    >>> from checkpoint import _dtypes
    >>> _dtypes.narrow(np.array([1e-300]), np.dtype("float32"), "w", "w")
    Traceback (most recent call last):
    ValueError: Tensor 'w' (float64) holds 1e-300, which float32 rounds to 0, for variable 'w' (float32; ...
    """
    want = np.dtype(want)
    if value.dtype == want:
        return value
    if np.issubdtype(value.dtype, np.integer) and value.size:
        info = np.iinfo(want)
        lo, hi = value.min(), value.max()
        if lo < info.min or hi > info.max:
            raise _refuse(value, want, name, key, lo if lo < info.min else hi, "out of range")
    with np.errstate(over="ignore", under="ignore", invalid="ignore"):  # checked just below
        out = value.astype(want)
    if np.issubdtype(value.dtype, np.inexact) and value.size:
        # float64 -> float32 turns values beyond float32's range into inf, and those below its smallest
        # subnormal into 0: either changes what the value is, so refuse, as for integers.
        lost = np.isfinite(value) & ~np.isfinite(out)
        if lost.any():
            raise _refuse(value, want, name, key, value[lost].flat[0], "out of range")
        vanished = (value != 0) & (out == 0)
        if vanished.any():
            raise _refuse(value, want, name, key, value[vanished].flat[0], f"which {want.name} rounds to 0,")
    return out


def narrow_to_held(value: np.ndarray, name: str, key: str) -> np.ndarray:
    """`value` in the dtype JAX holds it in (narrowed, with the checks of `narrow`)."""
    return narrow(value, held_as(value.dtype), name, key)


PYTHON_TYPES: dict[str, type] = {"bool": bool, "int": int, "float": float, "str": str}


def python_type(value: object) -> type:
    """The Python type a Python value is saved as: bool, int, float or str (an IntEnum is an int)."""
    return next(t for t in PYTHON_TYPES.values() if isinstance(value, t))
