"""`write_bundle`: values -> a TensorBundle (`.index` + one data shard) that TensorFlow reads.

`tf_tensors` turns checkpoint values (host arrays, slices, Python scalars) into the values it takes.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import functools
import os
import struct
import sys
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from checkpoint import _dtypes, _keys
from checkpoint._storage._bundle import VERSION, data_filename, slice_key
from checkpoint._storage._crc import crc32c, mask
from checkpoint._storage._files import replacing, vectored
from checkpoint._storage._host import libc_function
from checkpoint._storage._table import read_table, varint, write_table
from checkpoint.protos import tensor_bundle_pb2, types_pb2

__all__ = ["Sliced", "assembled", "start_bundle", "tf_tensors", "write_bundle", "write_bundle_of_processes"]

_OVERLAP_BYTES = 1 << 20  # a value this large has its checksum computed beside its write
_LITTLE = sys.byteorder == "little"
_GATHER_BYTES = 1 << 20  # small values written together: bounds the host copies of device arrays held at once


@dataclasses.dataclass(frozen=True)
class Sliced:
    """A tensor stored as slices (TF1 Saver's partitioned variables): its full shape and (offset, part) pairs."""

    full_shape: tuple[int, ...]
    parts: list[tuple[tuple[int, ...], np.ndarray]]


def _records(tensors: Mapping[str, Any]) -> list[tuple[bytes, str, Any, Any]]:
    """(table key, key for messages, value to store or None, full entry of a sliced tensor or None), sorted."""
    records: list[tuple[bytes, str, Any, Any]] = []
    for key, value in tensors.items():
        if not isinstance(key, str) or not key:
            raise ValueError(f"write_bundle: keys must be non-empty str, got {key!r}.")
        name = key.encode("utf-8", "surrogateescape")
        if name[0] == 0:
            raise ValueError(f"write_bundle: key {key!r} starts with a NUL byte, reserved for slice keys.")
        if not isinstance(value, Sliced):
            records.append((name, key, value, None))
            continue
        boxes = []
        for offset, part in value.parts:
            part = np.asarray(part)
            if len(offset) != len(value.full_shape) or part.ndim != len(offset) or any(
                    o < 0 or o + n > d for o, n, d in zip(offset, part.shape, value.full_shape, strict=True)):
                raise ValueError(f"write_bundle: a slice of {key!r} at {offset} with shape {part.shape} does not fit "
                                 f"its full shape {value.full_shape}.")
            boxes.append(list(zip(offset, part.shape, strict=True)))
            records.append((slice_key(name, boxes[-1]), f"{key} (slice at {offset})", part, None))
        if not _keys.covers_exactly(value.full_shape, boxes):
            raise ValueError(f"write_bundle: the slices of {key!r} overlap or do not cover its shape "
                             f"{value.full_shape}.")
        dtypes = {np.asarray(p).dtype for _, p in value.parts}
        if len(dtypes) != 1:
            raise ValueError(f"write_bundle: the slices of {key!r} have different dtypes {sorted(map(str, dtypes))}.")
        records.append((name, key, None, _full_entry(key, value.full_shape, dtypes.pop(), boxes)))
    return sorted(records, key=lambda r: r[0])


def _full_entry(key: str, full_shape: tuple[int, ...], dtype: np.dtype, boxes: list) -> bytes:
    """The stored entry of a tensor saved as slices: shape, dtype and each slice's (start, length) per dimension."""
    # Lengths are explicit even where a slice spans a whole dimension, as TF1's Saver writes them.
    return tensor_bundle_pb2.BundleEntryProto(
        dtype=_as_value(key, np.zeros(0, dtype))[0], shape={"dim": [{"size": d} for d in full_shape]},
        slices=[{"extent": [{"start": o, "length": n} for o, n in box]} for box in boxes],
    ).SerializeToString()


def _as_value(key: str, value) -> tuple[types_pb2.DataType, np.ndarray | bytes, tuple[int, ...], int | None]:
    """(dtype enum, bytes to write, shape, unmasked crc32c or None: that of the bytes) of one value."""
    if isinstance(value, (bytes, str)):
        value = np.array(value.encode() if isinstance(value, str) else value, dtype=object)
    arr = np.asarray(value)
    if arr.dtype.kind in "OSU":
        data, crc = _encode_strings(key, arr)
        return _dtypes.STRING_ENUM, data, arr.shape, crc
    dtype = arr.dtype.newbyteorder("=") if arr.dtype.byteorder in "<>" else arr.dtype
    enum = _dtypes.ENUM_OF.get(dtype)
    if enum is None:
        raise TypeError(
            f"write_bundle: key {key!r} has dtype {arr.dtype}, which a TF checkpoint cannot hold "
            f"(supported: {sorted(str(d) for d in _dtypes.ENUM_OF)}, strings)."
        )
    if not (arr.flags.c_contiguous and arr.dtype.isnative and _LITTLE):  # TF stores C order, little-endian
        arr = np.ascontiguousarray(arr, dtype.newbyteorder("<"))
    return enum, arr.reshape(-1).view(np.uint8), arr.shape, None


def _encode_strings(key: str, arr: np.ndarray) -> tuple[bytes, int]:
    items = [s.encode("utf-8") if isinstance(s, str) else s for s in arr.reshape(-1).tolist()]
    for s in items:
        if not isinstance(s, bytes):
            raise TypeError(f"write_bundle: key {key!r} holds {type(s).__name__}, expected bytes or str elements.")
    lengths = b"".join(varint(len(s)) for s in items)
    # Both checksums cover the lengths as fixed-width integers, not as the varints stored.
    packed = b"".join(struct.pack("<I" if len(s) <= 0xFFFFFFFF else "<Q", len(s)) for s in items)
    checksum = struct.pack("<I", mask(crc32c(packed)))
    strings = b"".join(items)
    return lengths + checksum + strings, crc32c(strings, crc32c(checksum, crc32c(packed)))


def write_bundle(prefix: str | os.PathLike, tensors: Mapping[str, Any]) -> None:
    """Writes `tensors` as the TensorBundle `prefix.index` + `prefix.data-00000-of-00001`.

    A `bytes` (or `str`) value is a scalar string; object, bytes_ and str_
    arrays are string tensors; a `Sliced` value is stored as TF1's Saver
    stores a partitioned variable. Both files are written under temporary names,
    synced to disk and renamed into place, data first: a crash or a power loss
    never leaves a readable half checkpoint.
    """
    start_bundle(prefix, tensors)()


def start_bundle(prefix: str | os.PathLike, tensors: Mapping[str, Any],
                 staging: float | None = None) -> Callable[[], None]:
    """Starts `write_bundle(prefix, tensors)`; returns the function that completes it.

    With `staging` None nothing is written (or read) before the returned
    function runs. With a number of bytes, the values go to the data file
    in order now, until the ones left fit in `staging` bytes; those are
    copied (a jax.Array to the host) and the returned function, which may
    run in another thread, writes them and the index: from the return on,
    the caller may change or donate every array it passed. The copies hold
    at most `staging` bytes.
    """
    prefix = os.fspath(prefix)
    records = _records(tensors)
    os.makedirs(os.path.dirname(os.path.abspath(prefix)), exist_ok=True)
    files = contextlib.ExitStack()
    data, index = files.enter_context(replacing(data_filename(prefix, 0, 1), prefix + ".index", tempstate=True))
    with contextlib.ExitStack() as on_error:
        on_error.push(files)
        writer = files.enter_context(_DataWriter(data, 0))
        if staging is not None:
            now = _beyond(records, staging)
            writer.write(records[:now])
            records = [(name, key, _snapshot(value), full) for name, key, value, full in records[now:]]
        on_error.pop_all()

    def finish() -> None:
        with files:
            writer.write(records)
            writer.close()
            _write_index(index, 1, writer.items)

    return finish


def _nbytes(value: Any) -> int:
    return len(value) if isinstance(value, (bytes, str)) else int(getattr(value, "nbytes", 64))


def _beyond(records: list, staging: float) -> int:
    """How many of `records`, from the first, must be written now for the rest to fit in `staging` bytes."""
    left = 0
    for i in range(len(records) - 1, -1, -1):
        value = records[i][2]
        left += 0 if value is None else _nbytes(value)
        if left > staging:
            return i + 1
    return 0


def _snapshot(value: Any) -> Any:
    """`value` as a host copy nothing else refers to (bytes and Python values are immutable already)."""
    return value if value is None or isinstance(value, (bytes, str, bool, int, float)) else np.array(value)


def _start_writeback(fd: int, offset: int, size: int) -> None:
    """Asks the kernel to start writing these bytes to disk now, without waiting (Linux; a no-op elsewhere).

    The fsync that ends the write then waits for what is left, not for the
    whole file: the disk writes one value while the next is copied to the
    page cache.
    """
    if _SYNC_FILE_RANGE is not None:
        _SYNC_FILE_RANGE(fd, offset, size, 2)  # SYNC_FILE_RANGE_WRITE: start writeback, do not wait for it


_SYNC_FILE_RANGE = libc_function("sync_file_range", [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint],
                                 ctypes.c_int) if sys.platform.startswith("linux") else None


class _DataWriter:
    """Writes values to a data file one after another; `items` are their stored index entries (in shard `shard`)."""

    def __init__(self, path: str, shard: int) -> None:
        self.file = open(path, "wb", buffering=0)  # closed by close() or __exit__
        self.pool = ThreadPoolExecutor(1)
        self.shard, self.offset = shard, 0
        self.items: list[tuple[bytes, bytes]] = []
        self.small: list[np.ndarray] = []  # small values, written together by one writev
        self.small_bytes = 0

    def __enter__(self) -> _DataWriter:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def write(self, records: list) -> None:
        for name, key, value, full in records:
            if full is not None:
                self.items.append((name, full))
                continue
            enum, data, shape, crc = _as_value(key, value)
            size = len(data) if isinstance(data, bytes) else data.size
            if crc is None and size < _OVERLAP_BYTES:
                crc = crc32c(data)
            # A large value's checksum runs beside its write (both release the GIL).
            job = self.pool.submit(crc32c, data) if crc is None else None
            if size < _OVERLAP_BYTES:
                if size:
                    self.small.append(data)  # type: ignore[arg-type]  # bytes are a buffer too
                    self.small_bytes += size
            else:
                self._flush()
                self._write_all([data])
                _start_writeback(self.file.fileno(), self.offset, size)
            # Fields are serialized in number order, so an entry is its (dtype, shape) head, the same for
            # many values, followed by its own fields.
            tail = tensor_bundle_pb2.BundleEntryProto(
                shard_id=self.shard, offset=self.offset, size=size,
                crc32c=mask(crc if job is None else job.result()),  # type: ignore[arg-type]  # crc None only with a job
            )
            self.items.append((name, _entry_head(enum, shape) + tail.SerializeToString()))
            self.offset += size
            if self.small_bytes >= _GATHER_BYTES:
                self._flush()
        self._flush()

    def _flush(self) -> None:
        if self.small:
            self._write_all(self.small)
            self.small, self.small_bytes = [], 0

    def _write_all(self, buffers: list) -> None:
        vectored([memoryview(b).cast("B") for b in buffers], lambda views: _writev(self.file, views))

    def close(self) -> None:
        if not self.file.closed:
            self.pool.shutdown()
            self.file.close()


def _writev(file: Any, views: list[memoryview]) -> int:
    """Bytes written of `views`, in order, by one system call where the platform has writev (no gathering copy)."""
    return os.writev(file.fileno(), views) if hasattr(os, "writev") else file.write(views[0])


@functools.lru_cache(maxsize=1024)
def _entry_head(enum: int, shape: tuple[int, ...]) -> bytes:
    """The serialized dtype and shape fields of a stored entry."""
    entry = tensor_bundle_pb2.BundleEntryProto(dtype=enum, shape={"dim": [{"size": d} for d in shape]})  # type: ignore[arg-type]  # an int is a DataType
    return entry.SerializeToString()


def _write_index(temp_path: str, num_shards: int, items: list[tuple[bytes, bytes]]) -> None:
    header = tensor_bundle_pb2.BundleHeaderProto(num_shards=num_shards, version={"producer": VERSION})
    index = write_table([(b"", header.SerializeToString()), *sorted(items)])
    with open(temp_path, "wb") as f:
        f.write(index)


def assembled(parts: list) -> np.ndarray:
    """A partitioned value ([(SaveSliceInfo, part)]) as one host array, for formats without slices."""
    full = np.zeros(parts[0][0].full_shape, np.dtype(parts[0][1].dtype))
    for info, part in parts:
        full[_keys.slice_index(info.var_offset, info.var_shape)] = part  # a jax.Array copies itself over
    return full


def tf_tensors(values: dict[str, Any], object_graph: bytes) -> dict[str, Any]:
    """{checkpoint key: value | [(slice info, part), ...]} as `write_bundle`'s tensors (slices assembled)."""
    tensors: dict[str, Any] = {}
    for key, v in values.items():
        if isinstance(v, list):
            tensors[key] = assembled(v)
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
            # An array as it is: the writer reads each to the host as it writes it (on CPU it shares the buffer),
            # so on an accelerator the host holds one value at a time, plus what start_bundle's `staging` copies.
            tensors[key] = v
    tensors[_keys.OBJECT_GRAPH_KEY] = object_graph
    return tensors


# ---------------------------------------------------------------------------
# several processes (jax.distributed): one data file each, one merged index
# ---------------------------------------------------------------------------
def write_bundle_of_processes(prefix: str, tensors: Mapping[str, Any], process: int, processes: int,
                              allgather: Any) -> None:
    """Writes this process's part of a TensorBundle written by `processes` processes at once (TF's MergeBundles layout).

    Every process calls it with the same keys. `tensors` values may be
    arrays that span processes (a `jax.Array` not fully addressable): each
    process writes the shards it holds (replica 0) as slices of that tensor
    into its own ``prefix.data-<process>-of-<processes>``; values every
    process holds whole, and the object graph, are written by process 0.
    The index entries are exchanged with `allgather` (bytes -> every
    process's bytes; a few bytes a key) once every data file is on disk, and
    process 0 writes the one index, listing every key with its shard_id and
    each sliced tensor's slices, as TF's MergeBundles merges the bundles of
    a sharded save. TensorFlow and `BundleReader` read it as any bundle.
    """
    os.makedirs(os.path.dirname(os.path.abspath(prefix)), exist_ok=True)
    records: dict[bytes, tuple] = {}  # by table key
    fulls: dict[bytes, bytes] = {}  # the entry of each sliced tensor, listing every process's slices
    for key, value in tensors.items():
        pieces = _pieces(value, process)
        if pieces is None:  # every process holds it whole: process 0 writes it
            if process == 0:
                records.update((r[0], r) for r in _records({key: value}))
            continue
        full_shape, dtype, boxes, parts = pieces
        name = key.encode("utf-8", "surrogateescape")
        fulls[name] = _full_entry(key, full_shape, dtype, sorted(boxes))
        for offset, part in parts:
            part = np.asarray(part)
            skey = slice_key(name, list(zip(offset, part.shape, strict=True)))
            records[skey] = (skey, f"{key} (slice at {list(offset)})", part, None)
    with (replacing(data_filename(prefix, process, processes), tempstate=True) as (data,),
          _DataWriter(data, process) as writer):
        writer.write(sorted(records.values(), key=lambda r: r[0]))
    blobs = allgather(write_table(writer.items))  # after every process's data file is in place
    if process != 0:
        return
    merged = dict(fulls)
    for i, blob in enumerate(blobs):
        merged.update(read_table(blob, f"the index entries of process {i}"))
    with replacing(prefix + ".index", tempstate=True) as (index,):  # the index last: it is what makes the bundle
        _write_index(index, processes, list(merged.items()))


def _pieces(value: Any, process: int) -> tuple | None:
    """(full shape, dtype, every slice's box, [(offset, data)] this process writes); None: process 0 writes it."""
    if isinstance(value, Sliced):
        full_shape, parts = tuple(value.full_shape), list(value.parts)
    elif _global_boxes(value) is not None:
        full_shape, parts = tuple(value.shape), [((0,) * value.ndim, value)]
    else:
        return None
    boxes, mine = [], []
    for offset, part in parts:
        held = _global_boxes(part)
        if held is None:  # a part every process holds whole
            boxes.append(tuple(zip(offset, np.shape(part), strict=True)))
            if process == 0:
                mine.append((tuple(offset), part))
            continue
        boxes += [tuple((o + b, n) for o, (b, n) in zip(offset, box, strict=True)) for box in held]
        mine += [(tuple(o + h for o, h in zip(offset, at, strict=True)), data) for at, data in _held_parts(part)]
    return full_shape, np.dtype(parts[0][1].dtype), boxes, mine


def _global_boxes(value: Any) -> list[tuple[tuple[int, int], ...]] | None:
    """The distinct shards ((start, length) per dimension) of an array no process holds whole; else None."""
    import jax  # loaded: several processes save only through it

    if not isinstance(value, jax.Array) or value.is_fully_addressable or value.is_fully_replicated:
        return None
    shape = value.shape
    return sorted({_keys.box_of(index, shape) for index in value.sharding.devices_indices_map(shape).values()})


def _held_parts(value: Any) -> list[tuple[tuple[int, ...], Any]]:
    """(offset, data) of the shards this process writes: replica 0 of each it holds."""
    return [(tuple(o for o, _ in _keys.box_of(s.index, value.shape)), s.data)
            for s in value.addressable_shards if s.replica_id == 0]

