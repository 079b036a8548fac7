"""crc32c, one copy for every format (TF's masked form for TF files).

google_crc32c's public functions read numpy arrays in place but hold the
GIL (measured: a Python thread ran at about a fifth of its speed beside a
256 MB checksum), while `write_bundle` overlaps a large value's checksum with
its write. So large buffers go through the same C function by ctypes, which
releases the GIL; small ones and pure-Python builds use the public API.
"""

from __future__ import annotations

import ctypes
from typing import Any

import google_crc32c
import numpy as np

_MASK_DELTA = 0xA282EAD8
_CTYPES_FROM = 1 << 16  # below this, the ctypes call costs more than the GIL it frees


try:
    from google_crc32c import _crc32c

    _extend: Any = ctypes.CDLL(_crc32c.__file__).crc32c_extend
    _extend.restype = ctypes.c_uint32
    _extend.argtypes = [ctypes.c_uint32, ctypes.c_void_p, ctypes.c_size_t]
except (ImportError, OSError, AttributeError):  # pure-Python build of google_crc32c
    _extend = None


def crc32c(data, crc: int = 0) -> int:
    """crc32c of the bytes of `data` (bytes, a buffer, or a numpy array), extending `crc`; `data` is not changed."""
    if isinstance(data, bytes):
        return google_crc32c.extend(crc, data)
    arr = np.ascontiguousarray(data) if isinstance(data, np.ndarray) else np.frombuffer(data, np.uint8)
    arr = arr.reshape(-1).view(np.uint8) if arr.size else np.empty(0, np.uint8)
    if _extend is not None and arr.nbytes >= _CTYPES_FROM:
        return _extend(crc, arr.ctypes.data, arr.nbytes)
    return google_crc32c.extend(crc, arr if arr.flags.c_contiguous else arr.tobytes())


def crc32c_spans(buf: np.ndarray, spans: list[tuple[int, int]]) -> list[int]:
    """crc32c of each (offset, length) range of the contiguous uint8 array `buf` (ranges checked to lie in it)."""
    if buf.dtype != np.uint8 or buf.ndim != 1 or not buf.flags.c_contiguous:
        raise TypeError(f"crc32c_spans needs a contiguous 1-D uint8 array, got {buf.dtype} {buf.shape}")
    for start, n in spans:
        if start < 0 or n < 0 or start + n > buf.size:
            raise ValueError(f"crc32c_spans: range [{start}, +{n}) lies outside the {buf.size} bytes")
    if _extend is None:
        return [google_crc32c.extend(0, buf[start:start + n].tobytes()) for start, n in spans]
    # One address for the whole buffer: a slice (and its ctypes pointer) per value costs more than
    # the checksum of a small value.
    base = buf.ctypes.data
    return [_extend(0, base + start, n) for start, n in spans]


def mask(crc: int) -> int:
    """TF's masked crc: rotated and offset, so a crc stored in data is not itself a crc of it."""
    return ((((crc >> 15) | (crc << 17)) & 0xFFFFFFFF) + _MASK_DELTA) & 0xFFFFFFFF
