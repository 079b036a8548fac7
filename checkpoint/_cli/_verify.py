"""`varstate-ckpt verify PATH`: every checksum a checkpoint carries, checked by reading each value once.

TF bundles carry a crc32c per value and per block of their index (and the
object graph is a value); this library's orbax format a crc32c per value and
one of its metadata. Their readers check all of these as they open and read,
so verifying is opening the checkpoint and reading every value through the
same reader restore uses. Checkpoints orbax itself wrote, Keras HDF5 files
(``.weights.h5``, ``.h5``, ``.keras``) and safetensors carry no checksums of
their values: their structure is checked as their readers check it, and
every value is read, which finds truncation and broken layouts but not a
flipped bit. Values are read one at a time (an orbax batch of small values
at a time), so memory stays bounded by the largest value.

Exit status: 0 all checked and intact, 1 damage found (the first damaged key
is printed, with what is wrong), 2 bad input (not a checkpoint).
"""

from __future__ import annotations

import contextlib
import os
import zipfile
from collections.abc import Iterator
from typing import Any

import numpy as np

from checkpoint import _storage
from checkpoint._cli import _out as out
from checkpoint._errors import DataLossError
from checkpoint._storage._safetensors import SafetensorsReader, is_safetensors

_KERAS_SUFFIXES = (".h5", ".hdf5", ".keras")
_KERAS_ARCHIVE_WEIGHTS = "model.weights.h5"  # the weights inside a .keras archive
_KERAS_ARCHIVE, _KERAS_HDF5 = "Keras archive (.keras)", "Keras HDF5 weights"
# What a value read of a damaged file raises in the readers below (tensorstore and libhdf5 report damage as
# exceptions of several types); a bug of ours (AttributeError, ...) still ends with a traceback.
_READ_ERRORS = (OSError, ValueError, RuntimeError, KeyError, TypeError, EOFError, zipfile.BadZipFile)

NO_CHECKSUMS = "this format has no checksums: its structure was checked and every value read"


class _DamageError(Exception):
    """Damage found: `key` (None for the metadata) and what is wrong."""

    def __init__(self, key: str | None, error: BaseException | str, format: str | None = None) -> None:
        super().__init__(key, error)
        self.key, self.error, self.format = key, " ".join(str(error).split()), format


def verify(args) -> int:
    path = args.path
    report: dict[str, Any] = {"path": path, "format": None, "checksums": None, "values": 0, "bytes": 0,
                              "ok": False, "damaged": None}
    try:
        with _opened(path) as (fmt, checksums, values):
            report.update(format=fmt, checksums=checksums)
            for _key, nbytes in values:
                report["values"] += 1
                report["bytes"] += nbytes
        report["ok"] = True
    except _DamageError as e:
        report["damaged"] = {"key": e.key, "error": e.error}
        report["format"] = report["format"] or e.format
    if args.json:
        out.print_json(report)
        return 0 if report["ok"] else 1
    out.say(f"{path}: {report['format']}" if report["format"] else path)
    if report["damaged"] is not None:
        d = report["damaged"]
        where = "found on opening it, before any value was read" if d["key"] is None else repr(d["key"])
        out.say(f"DAMAGED: {where}: {d['error']}")
        n = report["values"]
        out.say(f"{n} value{'' if n == 1 else 's'} read intact before it")
        return 1
    total = f"{report['values']} values, {out.human(report['bytes'])}"
    out.say(f"{total}: every checksum matches (the metadata's and each value's)" if report["checksums"] else
            f"{total}: {NO_CHECKSUMS}")
    out.say("OK")
    return 0


@contextlib.contextmanager
def _opened(path: str) -> Iterator[tuple[str, bool, Iterator[tuple[str, int]]]]:
    """(format name, carries checksums, iterator of (key, bytes read)) for the checkpoint at `path`."""
    if is_safetensors(path):  # a file or index by its name, or a directory holding one
        yield _safetensors(path)
        return
    from checkpoint.keras._hdf5 import is_hdf5

    if os.path.isfile(path) and (path.endswith(_KERAS_SUFFIXES) or is_hdf5(path)):
        with contextlib.ExitStack() as stack:
            fmt, values = _keras(path, stack)
            yield fmt, False, values
        return
    try:
        reader = _storage.open_reader(path)
        if reader.object_graph is not None:  # a TF bundle's graph is a value, read (and checked) here
            len(reader.object_graph.nodes)
    except DataLossError as e:  # found and claiming to be a checkpoint, but damaged
        raise _DamageError(None, e) from None
    from checkpoint._storage._orbax_native import OrbaxTreeReader  # imports nothing heavy

    yield reader.format_name, not isinstance(reader, OrbaxTreeReader), _values(reader)


def _values(reader: _storage.Reader) -> Iterator[tuple[str, int]]:
    """Reads every value of `reader` once, in storage order; yields (key, bytes) or raises _DamageError."""
    for group in reader.stored_together(out.key_list(reader)):
        for key in group:
            try:
                value = np.asarray(reader.get(key))
            except _READ_ERRORS as e:
                raise _DamageError(key, e) from None
            yield key, out.value_bytes(value)
            del value
        # The orbax readers keep what they read for later restores: dropped once its batch is done.
        reader.release()


def _safetensors(path: str) -> tuple[str, bool, Iterator[tuple[str, int]]]:
    try:
        reader = SafetensorsReader(path)
    except DataLossError as e:  # its header or index is damaged
        raise _DamageError(None, e, "safetensors") from None
    return reader.format_name, False, _values(reader)


def _keras(path: str, stack: contextlib.ExitStack) -> tuple[str, Iterator[tuple[str, int]]]:
    """A Keras HDF5 file (or the one inside a .keras archive): its datasets, each read on its own."""
    from checkpoint.keras._hdf5 import h5py_module, is_hdf5, open_bytes, open_file

    h5py = h5py_module()
    if zipfile.is_zipfile(path):
        try:
            with zipfile.ZipFile(path) as z:
                if _KERAS_ARCHIVE_WEIGHTS not in z.namelist():
                    raise out.UsageError(f"{path}: a zip archive without {_KERAS_ARCHIVE_WEIGHTS}, so not a .keras "
                                         "model file")
                data = z.read(_KERAS_ARCHIVE_WEIGHTS)  # zip checks its CRC-32 of the whole weights file here
        except (zipfile.BadZipFile, OSError, EOFError) as e:
            raise _DamageError(None, f"the archive: {e}", _KERAS_ARCHIVE) from None
        opened, fmt = open_bytes(data, f"{path}: {_KERAS_ARCHIVE_WEIGHTS}"), _KERAS_ARCHIVE
    elif is_hdf5(path):
        opened, fmt = open_file(path), _KERAS_HDF5
    else:
        raise out.UsageError(f"{path}: not an HDF5 file (no HDF5 signature), so not Keras weights")
    try:
        f = stack.enter_context(opened)
        names: list[str] = []
        f.visititems(lambda name, obj: names.append(name) if isinstance(obj, h5py.Dataset) else None)
    except (DataLossError, *_READ_ERRORS) as e:
        raise _DamageError(None, e, fmt) from None

    def values() -> Iterator[tuple[str, int]]:
        for name in names:
            try:
                ds = f[name]
                if ds.is_virtual or ds.external:
                    raise ValueError("its data is kept outside this file")
                value = np.asarray(ds[()])
            except _READ_ERRORS as e:
                raise _DamageError(name, e, fmt) from None
            yield name, out.value_bytes(value)

    return fmt, values()
