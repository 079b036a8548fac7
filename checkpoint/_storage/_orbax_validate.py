"""The orbax format's checks: every entry of meta/metadata is data, checked before it is used.

`validate` checks one entry (its type, dtype, shape, slices, and where its
bytes are); `check_stored` checks what orbax's files hold against the
entries (each array's shape, dtype and chunks, and that the bytes are on
disk). The reader (`_orbax.OrbaxReader`) runs both when it opens, and turns
a `BadMetadataError` into a DataLossError naming the checkpoint.
"""

from __future__ import annotations

import json
import math
import os
import re
from typing import Any

from checkpoint import _dtypes, _keys
from checkpoint._errors import DataLossError
from checkpoint._storage._files import read_regular, stored_bytes
from checkpoint._storage._orbax_layout import STORED_AS

ARRAY_NAME = re.compile(r"a[0-9]+")
BATCH_NAME = re.compile(r"p[0-9]+")
_SLICE_SUFFIX = re.compile(r"@slice_[0-9]+")  # slice i of a sliced value, in a checkpoint without batches
MAX_DEPTH = 16  # JSON nesting; the format needs 6 (meta, entries, entry, slices, slice, shape)
_MAX_RANK = 64  # numpy's limit
_MAX_ELEMENTS = 1 << 59  # a shape's elements (zero dimensions counted as one), as the TF reader allows
# Bytes the values may claim beyond the files under values/: orbax inlines a value of up to 1 KiB in its
# compressed b-tree nodes, and only the last batch can be that small; every other value is stored raw.
_SLACK = 1 << 16
_PROBE_AT_ONCE = 256  # arrays whose stored shape and dtype are read at once
_ORBAX_METADATA_LIMIT = 256 << 20  # bytes of values/_METADATA (orbax's tree metadata), as for meta/metadata


class BadMetadataError(Exception):
    """Metadata that failed a check: the detail, with the key it concerns, for the DataLossError."""

    def __init__(self, detail: str, kind: str = "ValueError") -> None:
        detail = detail if len(detail) <= 2000 else detail[:2000] + "..."  # keys from a file can be megabytes
        super().__init__(f"{kind}: {detail}")


def short(value: Any, limit: int = 120) -> str:
    """repr of a value read from a file, cut short: a hostile file's strings can be megabytes."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def first_line(error: BaseException, limit: int = 300) -> str:
    # tensorstore's messages run to a page (the whole spec); the first line says what failed.
    text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return text if len(text) <= limit else text[:limit] + "..."


def too_deep(value: Any) -> bool:
    level = [value]
    for _ in range(MAX_DEPTH):  # level by level, not recursion: the depth is what is being checked
        inner: list[Any] = []
        for node in level:
            children = node.values() if type(node) is dict else node
            inner.extend(c for c in children if type(c) is dict or type(c) is list)
        if not inner:
            return False
        level = inner
    return True


def _check_shape(key: str, shape: Any) -> tuple[int, ...]:
    if type(shape) is not list or len(shape) > _MAX_RANK or not all(type(d) is int and d >= 0 for d in shape) \
            or math.prod(d or 1 for d in shape) > _MAX_ELEMENTS:
        raise BadMetadataError(f"entry {key!r}: bad shape {short(shape)}")
    return tuple(shape)


def _dtype_name(key: str, e: dict) -> str:
    name = e.get("dtype")
    if type(name) is not str or name not in _dtypes.BY_NAME:
        raise BadMetadataError(f"Checkpoint value {key!r} has unsupported dtype {short(name)}.")
    return name


def validate(key: str, e: Any, batches: list[int]) -> list | None:
    """Metadata is data: every name, shape and offset is checked before it is used.

    Returns a sliced entry's slices as (offset, extent) per dimension, else None.
    """
    if type(e) is not dict:
        raise BadMetadataError(f"entry {key!r} is not an object", "TypeError")
    if "python" in e:
        want = _dtypes.PYTHON_TYPES.get(e["python"]) if type(e["python"]) is str else None
        if want is None:
            raise BadMetadataError(f"entry {key!r}: unknown Python type {short(e['python'])}")
        if type(e.get("value")) is not want and not (want is float and type(e.get("value")) is int):
            raise BadMetadataError(f"entry {key!r}: value does not match its type {e['python']!r}")
        if want is str:
            try:
                e["value"].encode("utf-8")  # restore hands it on as UTF-8 bytes
            except UnicodeEncodeError:
                raise BadMetadataError(f"entry {key!r}: value is not UTF-8 text (it holds a lone surrogate)") \
                    from None
        return None
    dtype = _dtype_name(key, e)
    shape = _check_shape(key, e.get("shape"))
    if "slices" not in e:
        _validate_stored(key, e, batches, dtype, shape)
        return None
    slices = e["slices"]
    if type(slices) is not list or not slices:
        raise BadMetadataError(f"entry {key!r}: bad slices")
    boxes = []
    for part in slices:  # linear: a hostile file may hold tens of thousands
        if type(part) is not dict:
            raise BadMetadataError(f"entry {key!r}: a slice is not an object", "TypeError")
        if _dtype_name(key, part) != dtype:
            raise BadMetadataError(f"entry {key!r}: a slice of {dtype} holds {part['dtype']}")
        part_shape = _check_shape(key, part.get("shape"))
        spec = part.get("spec")
        try:
            full, offset, extent = _keys.parse_slice_spec(key, spec if type(spec) is str else "")
        except ValueError as err:
            raise BadMetadataError(str(err)) from None
        if full != shape or extent != part_shape or any(
                o < 0 or o + n > d for o, n, d in zip(offset, extent, shape, strict=True)):
            raise BadMetadataError(f"entry {key!r}: slice {short(spec)} does not fit shape {list(shape)}")
        _validate_stored(key, part, batches, dtype, part_shape)
        boxes.append(list(zip(offset, extent, strict=True)))
    _check_tiling(key, shape, boxes, "slices")
    return boxes


def _check_tiling(key: str, shape: tuple[int, ...], boxes: list, what: str) -> None:
    """The boxes ((offset, extent) per dimension) of a value's slices or shards cover its shape exactly once."""
    try:
        tiled = _keys.covers_exactly(shape, boxes)
    except ValueError as err:  # more fragmented than this reader checks
        raise BadMetadataError(f"entry {key!r}: {err}") from None
    if not tiled:
        raise BadMetadataError(f"entry {key!r}: its {what} overlap or do not cover shape {list(shape)}")


def _validate_stored(key: str, e: dict, batches: list[int], dtype: str, shape: tuple[int, ...]) -> None:
    """Where a value's bytes are: its own array, or a range of a batch (``pack`` on disk); and their crc32c."""
    crc = e.get("crc32c")
    if "array" in e and "shards" in e:
        _validate_shards(key, e["shards"], shape)
    elif type(crc) is not int or not 0 <= crc < 1 << 32:
        raise BadMetadataError(f"entry {key!r}: no crc32c")
    if crc is not None and (type(crc) is not int or not 0 <= crc < 1 << 32):
        raise BadMetadataError(f"entry {key!r}: bad crc32c {short(crc)}")
    if "array" in e:
        name = e["array"]
        if type(name) is not str or not (ARRAY_NAME.fullmatch(name) or name == key or (
                name.startswith(key) and _SLICE_SUFFIX.fullmatch(name[len(key):]))):
            raise BadMetadataError(f"entry {key!r}: bad array name {short(e['array'])}")
        if "stored_as" in e and (dtype not in STORED_AS or e["stored_as"] != STORED_AS[dtype].name):
            raise BadMetadataError(f"entry {key!r}: {dtype} cannot be stored as {short(e['stored_as'])}")
        return
    batch, offset = e.get("pack"), e.get("offset")
    nbytes = math.prod(shape) * _dtypes.BY_NAME[dtype].itemsize
    if type(batch) is not int or not 0 <= batch < len(batches):
        raise BadMetadataError(f"entry {key!r}: no pack {short(batch)}")
    if type(offset) is not int or offset < 0 or offset + nbytes > batches[batch]:
        raise BadMetadataError(f"entry {key!r}: bytes [{short(offset)}, +{nbytes}) lie outside pack {batch}")


def _validate_shards(key: str, shards: Any, shape: tuple[int, ...]) -> None:
    """A sharded array's per-shard checksums: boxes that tile its shape, each with a crc32c."""
    if type(shards) is not list or not shards:
        raise BadMetadataError(f"entry {key!r}: bad shards {short(shards)}")
    boxes = []
    for part in shards:
        box = part.get("box") if type(part) is dict else None
        crc = part.get("crc32c") if type(part) is dict else None
        if type(crc) is not int or not 0 <= crc < 1 << 32 or type(box) is not list or len(box) != len(shape) or \
                not all(type(b) is list and len(b) == 2 and all(type(n) is int for n in b) for b in box):
            raise BadMetadataError(f"entry {key!r}: bad shard {short(part)}")
        boxes.append([tuple(b) for b in box])
    _check_tiling(key, shape, boxes, "shards")


def check_stored(path: str, stored: dict[str, tuple[str, tuple[int, ...], str]]) -> str:
    """The shape and dtype orbax holds for each array are the claimed ones, and their bytes are on disk.

    `stored`: array name -> (a key it holds, shape, stored dtype name), for
    the checkpoint at `path`. Returns the zarr driver the arrays are read
    with. Before anything is allocated: tensorstore allocates what its own
    metadata (in the values files) says, so a lie there, or here, would
    otherwise become a huge allocation.
    """
    values = os.path.join(path, "values")
    on_disk = stored_bytes(values, path)
    if not stored:
        return "zarr"
    if not os.path.isdir(values):
        raise unreadable(path, stored, "the values directory is missing")
    import tensorstore as ts  # orbax's own storage library

    driver = "zarr3" if _uses_zarr3(path, values) else "zarr"
    context = ts.Context()
    names = list(stored)
    for start in range(0, len(names), _PROBE_AT_ONCE):
        # Opened together (tensorstore reads their metadata concurrently), a few hundred at a time: a file naming a
        # million arrays that are not there fails at the first batch.
        opening = {name: open_array(values, driver, name, context) for name in names[start:start + _PROBE_AT_ONCE]}
        for name, future in opening.items():
            key, shape, dtype = stored[name]
            array = future_result(path, future, {name: stored[name]})
            if BATCH_NAME.fullmatch(name) and tuple(array.shape) != shape:
                raise DataLossError(
                    f"Checkpoint {path!r}: cannot read stored values: value {key!r} lies in pack {name[1:]}, "
                    f"which holds {math.prod(array.shape)} bytes; the metadata says {shape[0]}. The checkpoint is "
                    "corrupted."
                )
            if tuple(array.shape) != shape or array.dtype.name != dtype:
                raise DataLossError(
                    f"Checkpoint {path!r}: cannot read stored values: value {key!r} is stored as "
                    f"{tuple(array.shape)} {array.dtype.name}, its metadata says {shape} {dtype}. The checkpoint "
                    "is corrupted."
                )
            chunk = tuple(array.chunk_layout.read_chunk.shape or ())
            if len(chunk) != len(shape) or any(c > max(d, 1) for c, d in zip(chunk, shape, strict=True)):
                # tensorstore reads whole chunks: one larger than the array would be an allocation of any size
                raise unreadable(path, {name: stored[name]}, f"it is stored in chunks of {chunk}, larger than the "
                                                              f"array's shape {shape}")
    sizes = {name: math.prod(shape) * _dtypes.BY_NAME[dtype].itemsize for name, (_, shape, dtype) in stored.items()}
    if sum(sizes.values()) > on_disk + _SLACK:
        largest = {n: stored[n] for n in sorted(sizes, key=sizes.__getitem__, reverse=True)}  # the likeliest cut short
        raise unreadable(path, largest, f"they take {sum(sizes.values())} bytes, but the files under {values} "
                                         f"hold {on_disk}: a value file is truncated or missing")
    return driver


def open_array(values: str, driver: str, name: str, context: Any) -> Any:
    """A future of stored array `name` of the values directory `values`, opened for reading with tensorstore."""
    import tensorstore as ts  # orbax's own storage library

    kvstore = {"driver": "ocdbt", "base": {"driver": "file", "path": values + os.sep}, "path": name}
    return ts.open({"driver": driver, "kvstore": kvstore}, open=True, read=True, context=context)


def future_result(path: str, future: Any, names: dict) -> Any:
    """The result of tensorstore's `future` for stored arrays `names` (as for `unreadable`)."""
    try:
        return future.result()
    except Exception as e:  # tensorstore's errors are of many types; all mean the files are damaged
        raise unreadable(path, names, first_line(e)) from None


def _uses_zarr3(path: str, values: str) -> bool:
    try:
        about = json.loads(read_regular(os.path.join(values, "_METADATA"), _ORBAX_METADATA_LIMIT, "orbax's metadata"))
    except FileNotFoundError:
        return False  # orbax's default; it fails on the read if the files say otherwise
    except (ValueError, RecursionError) as e:
        raise DataLossError(f"Checkpoint {path!r}: cannot read stored values: values/_METADATA is "
                            f"corrupted ({first_line(e)}).") from None
    return isinstance(about, dict) and about.get("use_zarr3") is True


def unreadable(path: str, names: dict, why: str) -> DataLossError:
    """The DataLossError for stored arrays that cannot be read: `names` maps each to (its key, ...)."""
    keys = list(dict.fromkeys(key for key, *_ in names.values()))
    which = ", ".join(repr(k) for k in keys[:3]) + (f" and {len(keys) - 3} more" if len(keys) > 3 else "")
    return DataLossError(
        f"Checkpoint {path!r}: cannot read stored values ({which}): {why}. The value files are damaged; "
        "restore an older checkpoint."
    )
