"""TensorFlow's TensorBundle: `P.index` (a table of BundleEntryProto) + `P.data-0000i-of-0000N` (raw bytes).

Numeric values are raw C-order bytes; string tensors are ``varint64`` lengths,
a masked crc32c of the lengths, then the bytes. Every value carries a masked
crc32c. A partitioned variable saved by TF1's Saver has a full entry listing
its slices, and one entry per slice under an OrderedCode key.
"""

from __future__ import annotations

import math
import os
import re
import struct
import weakref
from functools import cached_property
from typing import Any

import numpy as np
from google.protobuf.message import DecodeError

from checkpoint import _dtypes, _keys
from checkpoint._errors import CheckpointFormatError
from checkpoint._storage._crc import crc32c, mask
from checkpoint._storage._files import open_regular, pread, pread_into, read_regular, within
from checkpoint._storage._host import held_here, one_by_one, place, place_many, read_grouped, read_runs
from checkpoint._storage._table import read_table, read_varint
from checkpoint.protos import tensor_bundle_pb2, types_pb2

__all__ = ["BundleReader", "data_filename", "slice_key"]

GRAPH_KEY = _keys.OBJECT_GRAPH_KEY
_STRING = _dtypes.STRING_ENUM
# Bundle format versions (TF's kTensorBundleVersion and kTensorBundleMinConsumer).
VERSION = 1
MIN_PRODUCER = 0
INDEX_LIMIT = 4 << 30  # bytes; TF's index for a million tensors is about 100 MB
_BAD_CRC = "checksum mismatch (the data file is corrupt); copy it again from its source"


def data_filename(prefix: str, shard: int, num_shards: int) -> str:
    """The path of one data shard of the bundle at `prefix`."""
    return f"{prefix}.data-{shard:05d}-of-{num_shards:05d}"


def _dtype_name(enum: int) -> str:
    try:
        return f"{types_pb2.DataType.Name(enum)} ({enum})"
    except ValueError:
        return f"an unknown dtype ({enum})"


def _num_increasing(value: int) -> bytes:
    # OrderedCode's unsigned form: a length byte, then big-endian bytes.
    n = (value.bit_length() + 7) // 8
    return bytes([n]) + value.to_bytes(n, "big")


def _signed_num_increasing(value: int) -> bytes:
    # OrderedCode's signed form: n bytes of two's complement whose first n bits
    # (inverted for negatives) say n, so that encodings sort as the numbers do.
    x = ~value if value < 0 else value
    n = (x.bit_length() + 7) // 7  # the fewest n with x < 2 ** (7n - 1)
    bits = (value & ((1 << (8 * n)) - 1)) ^ (((1 << n) - 1) << (7 * n))
    return bits.to_bytes(n, "big")


def slice_key(name: bytes, extents: list[tuple[int, int]]) -> bytes:
    """The table key of one saved slice: `extents` is (start, length) per dimension, length -1 for all."""
    return _slice_key_head(name, len(extents)) + _slice_key_tail(extents)


def _slice_key_head(name: bytes, rank: int) -> bytes:
    # The part every slice of one tensor shares, escaped once however many slices there are.
    escaped = re.sub(rb"[\x00\xff]", lambda m: m[0] + (b"\xff" if m[0] == b"\x00" else b"\x00"), name)
    return _num_increasing(0) + escaped + b"\x00\x01" + _num_increasing(rank)


def _slice_key_tail(extents: list[tuple[int, int]]) -> bytes:
    return b"".join(_signed_num_increasing(start) + _signed_num_increasing(length) for start, length in extents)


def _close_all(fds: dict) -> None:
    for fd, _ in fds.values():
        os.close(fd)
    fds.clear()


class BundleReader:
    """Reads the tensors of the TensorBundle at `prefix` (`prefix.index` + data shards).

    Values are read on demand, one positioned read per tensor, and every
    checksum is verified. Keys are str; slice keys of partitioned variables
    are hidden (their full names are listed and reassembled by `get`).
    """

    def __init__(self, prefix: str | os.PathLike):
        self.prefix = os.fspath(prefix)
        self.path = self.prefix  # the Reader protocol's name for it
        self.index_path = self.prefix + ".index"
        self._root = os.path.dirname(os.path.abspath(self.prefix))  # every file must resolve inside it
        within(self._root, self.index_path)
        items = read_table(read_regular(self.index_path, INDEX_LIMIT, "the checkpoint index"), self.index_path)
        if not items or items[0][0] != b"":
            raise CheckpointFormatError(f"{self.index_path}: no bundle header (the entry under the empty key)")
        header = self._parse(tensor_bundle_pb2.BundleHeaderProto, items[0][1], "the header")
        v = header.version
        if v.producer < MIN_PRODUCER or v.min_consumer > VERSION or VERSION in v.bad_consumers:
            raise CheckpointFormatError(
                f"{self.index_path}: bundle version {v.producer} (min consumer {v.min_consumer}, bad consumers "
                f"{list(v.bad_consumers)}) cannot be read by this reader (version {VERSION})"
            )
        if header.num_shards < 1:
            raise CheckpointFormatError(f"{self.index_path}: header claims {header.num_shards} data shards")
        self.num_shards = header.num_shards
        if header.endianness not in (header.LITTLE, header.BIG):
            raise CheckpointFormatError(f"{self.index_path}: header has an unknown endianness {header.endianness}")
        self._swap = header.endianness == header.BIG
        self._entries: dict[str, tensor_bundle_pb2.BundleEntryProto] = {}
        self._slices: dict[bytes, bytes] = {}
        for key, value in items[1:]:
            if key[0] == 0:  # OrderedCode keys of saved slices start with a 0 byte
                self._slices[key] = value
            else:
                name = key.decode("utf-8", "surrogateescape")
                self._entries[name] = self._parse(tensor_bundle_pb2.BundleEntryProto, value, f"key {name!r}")
        self._shapes: dict[str, tuple[int, ...]] = {}  # checked once: a restore asks each value's twice
        self._files: dict[int, tuple[int, int]] = {}
        self._finalizer = weakref.finalize(self, _close_all, self._files)

    def _parse(self, cls, value: bytes, what: str):
        try:
            return cls.FromString(value)
        except DecodeError:
            raise CheckpointFormatError(f"{self.index_path}: {what} is not a valid {cls.__name__}") from None

    def close(self) -> None:
        """Closes the data files (reopened if another value is read)."""
        _close_all(self._files)

    def __enter__(self) -> BundleReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"BundleReader({self.prefix!r}, {len(self.keys())} tensors)"

    @property
    def format_name(self) -> str:
        return f"TF {'object' if self.object_graph is not None else 'name'}-based checkpoint"

    def __contains__(self, key: str) -> bool:
        return key in self._entries and key != GRAPH_KEY

    def keys(self) -> list[str]:
        """Tensor names in sorted order (without the object graph's key)."""
        return [k for k in self._entries if k != GRAPH_KEY]

    def stored_together(self, keys: list[str]) -> list[list[str]]:
        return one_by_one(keys)

    def release(self) -> None:
        """Keeps no host copies: nothing to forget."""

    def entry(self, key: str) -> tensor_bundle_pb2.BundleEntryProto:
        """The BundleEntryProto stored for `key`."""
        try:
            return self._entries[key]
        except KeyError:
            raise KeyError(
                f"Key {key!r} not found in checkpoint {self.prefix} ({len(self.keys())} keys; list them with "
                "`python -m checkpoint inspect`)."
            ) from None

    def shape(self, key: str) -> tuple[int, ...]:
        """The full shape of tensor `key`."""
        shape = self._shapes.get(key)
        if shape is None:
            shape = self._shapes[key] = self._shape(key)
        return shape

    def _shape(self, key: str) -> tuple[int, ...]:
        entry = self.entry(key)
        shape = tuple(d.size for d in entry.shape.dim)
        too_big = math.prod(d or 1 for d in shape) > (1 << 59)  # numpy refuses even with a zero dimension
        if entry.shape.unknown_rank or any(d < 0 for d in shape) or len(shape) > 64 or too_big:
            raise CheckpointFormatError(f"{self.index_path}: key {key!r} has an invalid shape {shape}")
        return shape

    def dtype(self, key: str) -> np.dtype:
        """The numpy dtype of tensor `key` (`object` for strings, whose values are bytes)."""
        enum = self.entry(key).dtype
        if enum == _STRING:
            return np.dtype(object)
        try:
            return _dtypes.BY_ENUM[enum]
        except KeyError:
            raise CheckpointFormatError(
                f"{self.index_path}: key {key!r} has {_dtype_name(enum)}, which this reader does not support "
                f"(supported: {sorted(_dtype_name(e) for e in (*_dtypes.BY_ENUM, _STRING))})"
            ) from None

    def get_slices(self, key: str) -> list[tuple[slice, ...]]:
        """Where each saved slice of a partitioned tensor sits (`[]` if saved whole).

        `reader.get(key)[s]` is the value of slice `s`.
        """
        shape = self.shape(key)
        return [self._extents(key, s, shape)[1] for s in self.entry(key).slices]

    def _extents(self, key: str, proto, shape: tuple[int, ...]) -> tuple[list[tuple[int, int]], tuple[slice, ...]]:
        if len(proto.extent) != len(shape):
            raise CheckpointFormatError(
                f"{self.index_path}: key {key!r} has a slice of rank {len(proto.extent)} for shape {shape}"
            )
        extents, index = [], []
        for e, dim in zip(proto.extent, shape, strict=True):
            start, length = e.start, e.length
            if not length and not e.HasField("length"):  # HasField costs as much as the rest: only for a 0
                length = -1
            stop = start + (dim if length == -1 else length)
            if start < 0 or length < -1 or stop > dim or (length == -1 and start):
                raise CheckpointFormatError(
                    f"{self.index_path}: key {key!r} has a slice (start {start}, length {length}) outside "
                    f"its shape {shape}"
                )
            extents.append((start, length))
            index.append(slice(start, stop))
        return extents, tuple(index)

    def get(self, key: str) -> np.ndarray:
        """The value of tensor `key` (a new array; strings as an object array of bytes)."""
        shape = self.shape(key)
        dtype = self.dtype(key)
        entry = self.entry(key)
        if not entry.slices:
            return self._read(entry, self._locate(key, entry, shape, dtype), shape, dtype)
        # Linear in the slices: a hostile index may hold tens of thousands for one tensor.
        head = _slice_key_head(key.encode("utf-8", "surrogateescape"), len(shape))
        parts, boxes = [], []
        for proto in entry.slices:
            extents, index = self._extents(key, proto, shape)
            skey = head + _slice_key_tail(extents)
            if skey not in self._slices:
                raise CheckpointFormatError(
                    f"{self.index_path}: the entry of slice {[(i.start, i.stop) for i in index]} of key {key!r} "
                    "is missing"
                )
            sentry = self._parse(tensor_bundle_pb2.BundleEntryProto, self._slices[skey], f"a slice of {key!r}")
            if sentry.dtype != entry.dtype:
                raise CheckpointFormatError(
                    f"{self.index_path}: a slice of key {key!r} has {_dtype_name(sentry.dtype)}, the full "
                    f"tensor {_dtype_name(entry.dtype)}"
                )
            part_shape = tuple(i.stop - i.start for i in index)
            boxes.append([(i.start, n) for i, n in zip(index, part_shape, strict=True)])
            parts.append((index, sentry, part_shape, self._locate(key, sentry, part_shape, dtype)))
        try:
            tiled = _keys.covers_exactly(shape, boxes)
        except ValueError as e:  # too fragmented to check in bounded time
            raise CheckpointFormatError(f"{self.index_path}: the saved slices of key {key!r}: {e}") from None
        if not tiled:
            raise CheckpointFormatError(
                f"{self.index_path}: the saved slices of key {key!r} overlap or do not cover its shape {shape}"
            )
        stored = sum(p[1].size for p in parts)
        available = sum(self._files[shard][1] for shard in {p[1].shard_id for p in parts})
        if stored > available:  # slices sharing bytes would multiply a small file into a huge tensor
            raise CheckpointFormatError(
                f"{self.index_path}: the slices of key {key!r} claim {stored} bytes, but their data files hold "
                f"{available}"
            )
        out = np.empty(shape, dtype)  # only now: the slices' stored bytes account for every element
        for shard in {p[1].shard_id for p in parts}:
            group = [p for p in parts if p[1].shard_id == shard]
            start = min(p[1].offset for p in group)
            span = max(p[1].offset + p[1].size for p in group) - start
            # Strings, a lone slice, or slices scattered in the file: one read each.
            if dtype.kind == "O" or len(group) < 2 or span > 2 * sum(p[1].size for p in group) + (1 << 20):
                for index, sentry, part_shape, located in group:
                    out[index] = self._read(sentry, located, part_shape, dtype)
                continue
            # Side by side in the file (as every writer puts them): one read for all, then each checked.
            fd, where = group[0][3]
            span_bytes = np.empty(span, np.uint8)
            pread_into(fd, span_bytes, start, where)
            for index, sentry, part_shape, (_, where) in group:
                raw = span_bytes[sentry.offset - start:sentry.offset - start + sentry.size]
                out[index] = self._checked(raw, sentry, where, dtype).view(dtype).reshape(part_shape)
        return out

    def _locate(self, key: str, entry, shape: tuple[int, ...], dtype: np.dtype) -> tuple[int, str]:
        """Checks that `entry`'s bytes lie inside its shard and fit `shape`; returns (fd, error prefix)."""
        shard = entry.shard_id
        path = data_filename(self.prefix, shard, self.num_shards)
        if shard not in self._files:
            if not 0 <= shard < self.num_shards:
                raise CheckpointFormatError(
                    f"{self.index_path}: key {key!r} is in shard {shard}, but the bundle has {self.num_shards}"
                )
            within(self._root, path)
            try:
                fd, size = open_regular(path, f"data shard {shard}")
            except FileNotFoundError:
                raise CheckpointFormatError(
                    f"{path}: data shard missing (needed for key {key!r} of {self.index_path}); copy every "
                    f"{os.path.basename(self.prefix)}.data-* file with the .index"
                ) from None
            if self._files.setdefault(shard, (fd, size))[0] != fd:
                os.close(fd)  # another thread opened it first
        fd, file_size = self._files[shard]
        where = f"{path}: key {key!r}"
        if entry.offset < 0 or entry.size < 0 or entry.offset + entry.size > file_size:
            raise CheckpointFormatError(
                f"{where}: value at offset {entry.offset} with {entry.size} bytes runs past the end of the "
                f"file ({file_size} bytes): the file is truncated or the index is corrupt"
            )
        expected = math.prod(shape) * dtype.itemsize
        if dtype.kind != "O" and entry.size != expected:
            raise CheckpointFormatError(
                f"{where}: stored size {entry.size} bytes, expected {expected} for shape {shape} of {dtype}"
            )
        return fd, where

    def _read(self, entry, located: tuple[int, str], shape: tuple[int, ...], dtype: np.dtype):
        fd, where = located
        if dtype.kind == "O":
            return self._strings(where, pread(fd, entry.size, entry.offset, where), shape, entry.crc32c)
        flat = read_runs([(fd, entry.offset, entry.size, where)])[0]  # aligned: what device_put takes without a copy
        return self._checked(flat, entry, where, dtype).view(dtype).reshape(shape)

    def _read_group(self, keys: list[str], plans: dict[str, tuple]) -> list[np.ndarray]:
        """Each key's value, checked; keys stored back to back are read with one pread (`read_runs`)."""
        flats = read_runs([(plans[k][1][0], plans[k][0].offset, plans[k][0].size, plans[k][1][1]) for k in keys])
        return [self._checked(flat, entry, where, dtype).view(dtype).reshape(shape)
                for flat, (entry, (_, where), shape, dtype) in zip(flats, [plans[k] for k in keys], strict=True)]

    def _checked(self, flat: np.ndarray, entry, where: str, dtype: np.dtype) -> np.ndarray:
        """`flat` (a value's stored bytes) after its crc32c is checked, in native byte order (swapped in place)."""
        if mask(crc32c(flat)) != entry.crc32c:
            raise CheckpointFormatError(f"{where}: {_BAD_CRC}")
        if self._swap and dtype.itemsize > 1:
            unit = dtype.itemsize // (2 if dtype.kind == "c" else 1)
            flat.view(f"u{unit}").byteswap(inplace=True)
        return flat

    def _strings(self, where: str, raw: bytes, shape: tuple[int, ...], crc: int) -> np.ndarray:
        count = math.prod(shape)
        if count > len(raw):  # each element needs at least one length byte
            raise CheckpointFormatError(f"{where}: {len(raw)} bytes cannot hold {count} strings")
        lengths, pos = [], 0
        try:
            for _ in range(count):
                n, pos = read_varint(raw, pos, len(raw), 70, "string length")
                if n > len(raw):  # a length "of terabytes" in a few bytes
                    raise ValueError
                lengths.append(n)
        except ValueError:
            raise CheckpointFormatError(f"{where}: bad string length") from None
        order = ">" if self._swap else "<"
        packed = b"".join(struct.pack(f"{order}I" if n <= 0xFFFFFFFF else f"{order}Q", n) for n in lengths)
        if pos + 4 > len(raw) or struct.unpack_from("<I", raw, pos)[0] != mask(crc32c(packed)):
            raise CheckpointFormatError(f"{where}: {_BAD_CRC.replace('mismatch', 'mismatch in the string lengths')}")
        if pos + 4 + sum(lengths) != len(raw):
            raise CheckpointFormatError(
                f"{where}: string lengths add up to {sum(lengths)} bytes, but {len(raw) - pos - 4} are stored"
            )
        if mask(crc32c(raw[pos:], crc32c(packed))) != crc:
            raise CheckpointFormatError(f"{where}: {_BAD_CRC}")
        pos += 4
        out = np.empty(count, object)
        for i, n in enumerate(lengths):
            out[i] = raw[pos : pos + n]
            pos += n
        return out.reshape(shape)

    def get_into(self, key: str, sharding: Any) -> Any:
        value = self.get_many({key: sharding})[key]
        return place(value, sharding) if isinstance(value, np.ndarray) else value

    def get_many(self, requests: dict[str, Any]) -> dict[str, Any]:
        """{key: target sharding or None} -> {key: jax.Array on that sharding, or np.ndarray}.

        A value saved whole, in a plain dtype, for a sharding this process
        holds whole is read into the aligned buffer it is placed from (no
        second host copy), in threads a few values ahead (`read_grouped`),
        each checksummed before it is placed; values under 1 MB go in
        groups, in file order (a run stored back to back is one read, each
        value in its own buffer), placed by one `device_put`. The rest come
        back on the host: the caller places them after reading the dtype
        each was stored in (a quantized TF dtype's tag, which a jax.Array
        would drop).
        """
        direct = {k: s for k, s in requests.items() if s is not None and self._direct(k, s)}
        out: dict[str, Any] = {}
        if direct:
            plans = {}  # every entry checked before the first byte is read
            for key in direct:
                shape, dtype, entry = self.shape(key), self.dtype(key), self.entry(key)
                plans[key] = (entry, self._locate(key, entry, shape, dtype), shape, dtype)
            size = lambda k: plans[k][0].size
            read = lambda keys: self._read_group(keys, plans)
            in_file_order = sorted(direct, key=lambda k: (plans[k][0].shard_id, plans[k][0].offset))
            for keys, hosts in read_grouped(in_file_order, size, read):
                out.update(zip(keys, place_many(hosts, [direct[k] for k in keys]), strict=True))
        return {k: out[k] if k in out else self.get(k) for k in requests}

    def _direct(self, key: str, sharding: Any) -> bool:
        dtype = self.dtype(key)
        return held_here(sharding) and not self.entry(key).slices and dtype.kind != "O" and dtype.metadata is None

    @cached_property
    def object_graph(self):
        """The parsed TrackableObjectGraph of an object-based checkpoint; None for a name-based one."""
        if GRAPH_KEY not in self._entries:
            return None
        from checkpoint.protos import trackable_object_graph_pb2

        value = self.get(GRAPH_KEY)
        if value.shape != () or not isinstance(value.item(), bytes):
            raise CheckpointFormatError(f"{self.index_path}: {GRAPH_KEY} is not a scalar string")
        graph = self._parse(trackable_object_graph_pb2.TrackableObjectGraph, value.item(), f"key {GRAPH_KEY!r}")
        if not graph.nodes:  # the walks over it start at node 0
            raise CheckpointFormatError(f"{self.index_path}: its object graph ({GRAPH_KEY}) has no nodes; TF's always "
                                        "holds the root object, node 0")
        return graph
