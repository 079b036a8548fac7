"""HDF5 access for `checkpoint.keras`'s readers: libhdf5 never decodes a variable-length value of an untrusted file.

Why (issue 26 item 3): libhdf5 reads variable-length strings (``layer_names``, each Keras 3 layer's ``name``)
through the file's global heap, and its walk of a damaged heap collection can loop forever holding the GIL (one
byte of ``tf_keras/mlp.h5`` does it), so no timeout in this process ends it; a damaged heap id makes it allocate
and zero up to 4 GiB first (one byte: 24 s, 4.4 GB), and a damaged variable-length type crashes the process. Ways
out, measured (2,000 one-weight layers: 1.4 s to read today; the fixtures: 4 ms):

- reading untrusted files in a spawned child process with a time limit: 0.2-0.5 s per file (a hundredfold on a
  small file);
- reading everything with the pure-Python ``pyfive``: 0.40 s to walk the 2,000-layer file, no faster than h5py
  here, but it checks no metadata checksum (a flipped bit in an object header would read as a wrong name or shape
  where libhdf5 raises DataLossError), and itself runs for minutes on a damaged dataset shape;
- scanning the whole file for heap collections before libhdf5 opens it: free on metadata, but a scan of 100 MB of
  weights costs twice h5py's read of them;
- what is done here: h5py (libhdf5) reads the structure, checksums, links and datasets as before, and the few
  variable-length string attributes are read by ``pyfive`` (pure Python, a loop per heap object that always
  advances) at the object's address, through a file whose reads are bounded (`_Budget`), so that a damaged file
  ends in the library's error. Cost: about what h5py takes for the same attributes (2,000 layers: 1.03x), plus
  pyfive's import (0.1-0.2 s, with numcodecs and fsspec) at the first HDF5 read of a process. Attributes of any
  other type than numbers and strings are refused before anything reads them.
"""

from __future__ import annotations

import contextlib
import io
import os
import warnings
from collections.abc import Iterator
from typing import Any

import numpy as np

from checkpoint._errors import CheckpointFormatError

# What the pyfive reads of one file may take in all: the file about four times over (each object header and heap
# collection is read once; an honest 2,000-layer file reads well under its size) plus a floor for small files.
_BUDGET_RATIO = 4
_BUDGET_FLOOR = 1 << 20
# An open h5py file's number -> the pyfive readers of its strings (one per open: libhdf5 gives two opens of one
# file one number, and each reader reads the same bytes).
_SOURCES: dict[int, list[_Strings]] = {}


_MAGIC = b"\x89HDF\r\n\x1a\n"


def is_hdf5(path: str) -> bool:
    """Whether the file at `path` carries HDF5's signature (read without h5py)."""
    # The signature sits at offset 0, or 512, 1024, ... when a user block precedes it.
    with open(path, "rb") as f:
        for offset in (0, 512, 1024, 2048):
            f.seek(offset)
            if f.read(8) == _MAGIC:
                return True
    return False


def h5py_module():
    # h5py is imported here, not at module import: reading TF checkpoints needs none of it.
    try:
        import h5py
    except ImportError:
        raise ImportError(
            "Reading or writing Keras HDF5 weights needs h5py, which is not installed: pip install h5py"
        ) from None
    return h5py


class _Budget(io.RawIOBase):
    """A read-only file that raises once its reads add up to more than `limit` bytes: bounds pyfive's work."""

    def __init__(self, raw: Any, limit: int, where: str) -> None:
        super().__init__()
        self.raw, self.left, self.limit, self.where = raw, limit, limit, where

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        return self.raw.seek(offset, whence)

    def tell(self) -> int:
        return self.raw.tell()

    def read(self, size: int = -1) -> bytes:
        data = self.raw.read(size)
        self.left -= len(data)
        if self.left < 0:
            raise CheckpointFormatError(
                f"{self.where}: reading its string attributes takes more than {self.limit} bytes of reads; the "
                "file's metadata is damaged or crafted (it loops)"
            )
        return data

    def readinto(self, buffer: Any) -> int:
        data = self.read(len(buffer))
        buffer[: len(data)] = data
        return len(data)


class _Strings:
    """pyfive's view of one file, opened at the first variable-length attribute read from it."""

    def __init__(self, source: str | bytes, where: str) -> None:
        self.source, self.where = source, where
        self.file: Any = None
        self.raw: Any = None

    def attributes(self, address: int) -> dict:
        if self.file is None:
            try:
                import pyfive  # type: ignore[import-untyped]  # no py.typed
            except ImportError:
                raise ImportError(
                    "Reading Keras HDF5 weights needs pyfive, which is not installed: pip install pyfive"
                ) from None
            self.raw = open(self.source, "rb") if isinstance(self.source, str) else io.BytesIO(self.source)
            size = self.raw.seek(0, os.SEEK_END)
            self.raw.seek(0)
            self.file = pyfive.File(_Budget(self.raw, _BUDGET_FLOOR + _BUDGET_RATIO * size, self.where))
        with warnings.catch_warnings():
            # pyfive warns of attribute types it cannot read (and sets them to None): those are not ours to read.
            warnings.simplefilter("ignore")
            return self.file._get_dataobjects(address).get_attributes()

    def close(self) -> None:
        if self.raw is not None:
            self.raw.close()


def open_file(path: str) -> contextlib.AbstractContextManager[Any]:
    """`path` opened by h5py for reading; its attributes are to be read with `attribute`."""
    return _opened(path, path, path)


def open_bytes(data: bytes, where: str) -> contextlib.AbstractContextManager[Any]:
    """An HDF5 file held in memory (a ``.keras`` archive's weights), opened as `open_file` opens a path."""
    return _opened(io.BytesIO(data), data, where)


@contextlib.contextmanager
def _opened(file: Any, source: str | bytes, where: str) -> Iterator[Any]:
    """`file` opened by h5py, with the pyfive reader of its strings registered under its file number."""
    with h5py_module().File(file, "r") as h5:
        number, strings = h5.id.fileno, _Strings(source, where)
        _SOURCES.setdefault(number, []).append(strings)
        try:
            yield h5
        finally:
            _SOURCES[number].remove(strings)
            if not _SOURCES[number]:
                del _SOURCES[number]
            strings.close()


def _text(value: Any, name: str, where: str) -> Any:
    try:
        if isinstance(value, bytes):
            return value.decode("utf-8")
        if isinstance(value, np.ndarray) and value.dtype == object:
            return [v.decode("utf-8") if isinstance(v, bytes) else str(v) for v in value.ravel()]
    except UnicodeDecodeError as e:
        raise CheckpointFormatError(f"{where}: attribute {name!r} is not UTF-8 text ({e}); the file is damaged") from e
    raise CheckpointFormatError(f"{where}: attribute {name!r} reads as {type(value).__name__}, not text; the file is "
                                "damaged or was not written by Keras")


def attribute(obj: Any, name: str, default: Any, where: str) -> Any:
    """``obj.attrs[name]`` (variable-length strings as str), or `default` without one.

    Keras writes numbers and strings there; any other type raises CheckpointFormatError before a byte of the value
    is read, and variable-length strings are read without libhdf5 (see the module docstring).
    """
    h5t = h5py_module().h5t
    if name not in obj.attrs:
        return default
    kind = obj.attrs.get_id(name).get_type()
    if kind.get_class() == h5t.STRING and kind.is_variable_str():
        opened = _SOURCES.get(obj.id.fileno)
        if not opened:
            raise RuntimeError(f"{where}: the file was not opened by checkpoint.keras._hdf5; open it with open_file")
        address = h5py_module().h5o.get_info(obj.id).addr
        try:
            values = opened[-1].attributes(address)  # the reader of the file's latest open
        except (CheckpointFormatError, ImportError):
            raise
        except Exception as e:  # pyfive's own exceptions for damaged bytes: assertions, struct, index, key errors
            raise CheckpointFormatError(
                f"{where}: attribute {name!r} cannot be read ({type(e).__name__}: {e}); the file is damaged"
            ) from e
        if name not in values:
            raise CheckpointFormatError(f"{where}: attribute {name!r} is listed by libhdf5 but not found in the "
                                        "object header; the file is damaged")
        return _text(values[name], name, where)
    if kind.get_class() not in (h5t.INTEGER, h5t.FLOAT, h5t.STRING):
        raise CheckpointFormatError(
            f"{where}: attribute {name!r} is of HDF5 type class {kind.get_class()}, where Keras writes numbers or "
            "strings; the file is damaged or was not written by Keras"
        )
    return obj.attrs[name]


def names(group: Any, where: str) -> list[str]:
    """The names of `group`'s members; CheckpointFormatError for one that is not UTF-8 (h5py gives it as bytes)."""
    out = list(group)
    bad = next((name for name in out if not isinstance(name, str)), None)
    if bad is not None:
        raise CheckpointFormatError(f"{where} holds a member whose name is not UTF-8 ({bad!r}); the file is damaged")
    return out


def stored_dataset(group: Any, name: str, where: str) -> Any:
    """``group[name]`` if it is a dataset whose data this file holds (no link followed); else CheckpointFormatError."""
    h5py = h5py_module()
    link = group.get(name, getlink=True)
    if link is not None and not isinstance(link, h5py.HardLink):
        raise CheckpointFormatError(f"{where} is a {type(link).__name__}; links are not followed")
    ds = group.get(name)
    if not isinstance(ds, h5py.Dataset) or ds.is_virtual or ds.external:
        raise CheckpointFormatError(f"{where} is not a dataset stored in this file")
    return ds


def raised_by_h5py(error: BaseException) -> bool:
    """Whether h5py raised `error` itself (a ValueError or TypeError from a damaged type, name or encoding)."""
    tb = error.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb is not None and "h5py" in tb.tb_frame.f_code.co_filename.replace("\\", "/").split("/")
