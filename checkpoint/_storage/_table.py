"""The sorted key -> value table of a TensorBundle's `.index` file (LevelDB's SSTable layout).

A table is ``[data blocks][metaindex block][index block][footer]``. Every block
is followed by a compression byte and the masked crc32c of block + byte; the
48-byte footer holds the handles (varint64 offset, size) of the metaindex and
index blocks and ends with a magic number. Block entries share key prefixes
with their predecessor, except at restart points.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable

from checkpoint._errors import CheckpointFormatError
from checkpoint._storage._crc import crc32c, mask

__all__ = ["read_table", "write_table"]

_MAGIC = 0xDB4775248B80FB57
_FOOTER_SIZE = 48
_TRAILER_SIZE = 5  # compression type byte + fixed32 crc
BLOCK_SIZE = 262_144  # a data block is cut once it reaches this many bytes (TF's default)
_RESTART_INTERVAL = 16


def read_varint(buf: bytes, pos: int, end: int, limit_bits: int, what: str) -> tuple[int, int]:
    result = shift = 0
    while True:
        if pos >= end or shift >= limit_bits:
            raise CheckpointFormatError(f"bad varint ({what})")
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            return result, pos
        shift += 7


def varint(value: int) -> bytes:
    """`value` as a varint64: seven bits a byte, the lowest first, the high bit set on all but the last."""
    out = bytearray()
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _block(data: bytes, handle: tuple[int, int], end: int, what: str) -> tuple[int, int]:
    """Checks a block's trailer; returns where its contents start and stop in `data`."""
    offset, size = handle
    if offset + size + _TRAILER_SIZE > end:
        raise CheckpointFormatError(
            f"{what} at offset {offset} with {size} bytes runs past the end of the table ({end} bytes): "
            "the file is truncated or corrupt"
        )
    ctype = data[offset + size]
    (stored,) = struct.unpack_from("<I", data, offset + size + 1)
    if mask(crc32c(memoryview(data)[offset : offset + size + 1])) != stored:
        raise CheckpointFormatError(
            f"{what} at offset {offset}: checksum mismatch (the file is corrupt); copy it again from its source"
        )
    if ctype == 1:
        raise CheckpointFormatError(
            f"{what} at offset {offset} is snappy-compressed; this reader has no snappy decompressor. "
            "Re-save the checkpoint uncompressed (TensorFlow writes uncompressed .index files)."
        )
    if ctype != 0:
        raise CheckpointFormatError(f"{what} at offset {offset}: unknown compression type {ctype}")
    return offset, offset + size


def _entries(buf: bytes, start: int, stop: int, what: str) -> list[tuple[bytes, bytes]]:
    if stop - start < 4:
        raise CheckpointFormatError(f"{what}: {stop - start} bytes is too short for a block")
    (num_restarts,) = struct.unpack_from("<I", buf, stop - 4)
    stop -= 4 + 4 * num_restarts
    if stop < start:
        raise CheckpointFormatError(f"{what}: claims {num_restarts} restart points in {stop - start} bytes")
    pos = start
    out: list[tuple[bytes, bytes]] = []
    key = b""
    while pos < stop:
        entry = pos
        shared, pos = read_varint(buf, pos, stop, 35, what)
        non_shared, pos = read_varint(buf, pos, stop, 35, what)
        value_len, pos = read_varint(buf, pos, stop, 35, what)
        if shared > len(key) or pos + non_shared + value_len > stop:
            raise CheckpointFormatError(f"{what}: entry at offset {entry - start} runs past its block")
        new_key = key[:shared] + buf[pos : pos + non_shared]
        pos += non_shared
        if out and new_key <= key:
            raise CheckpointFormatError(f"{what}: keys out of order ({key!r} then {new_key!r})")
        key = new_key
        out.append((key, buf[pos : pos + value_len]))
        pos += value_len
    return out


def read_table(data: bytes, name: str) -> list[tuple[bytes, bytes]]:
    """Every (key, value) of a table, in key order; `data` is the whole file, `name` names it in errors."""
    if len(data) < _FOOTER_SIZE:
        raise CheckpointFormatError(
            f"{name}: {len(data)} bytes is too short for a checkpoint index (at least {_FOOTER_SIZE}): "
            "the file is truncated"
        )
    footer = len(data) - _FOOTER_SIZE
    lo, hi = struct.unpack_from("<II", data, len(data) - 8)
    if lo | (hi << 32) != _MAGIC:
        raise CheckpointFormatError(
            f"{name}: not a checkpoint index (bad magic number {lo | (hi << 32):#018x}, expected {_MAGIC:#018x})"
        )
    try:
        pos = footer
        handles = []
        for _ in range(4):  # metaindex offset, size; index offset, size
            value, pos = read_varint(data, pos, len(data) - 8, 70, "footer")
            handles.append(value)
        _block(data, (handles[0], handles[1]), footer, "metaindex block")  # unused, but checked like the rest
        index = _entries(data, *_block(data, (handles[2], handles[3]), footer, "index block"), "index block")
        result: list[tuple[bytes, bytes]] = []
        for i, (_, handle) in enumerate(index):
            what = f"data block {i}"
            off, p = read_varint(handle, 0, len(handle), 70, what)
            size, _ = read_varint(handle, p, len(handle), 70, what)
            entries = _entries(data, *_block(data, (off, size), footer, what), what)
            if result and entries and entries[0][0] <= result[-1][0]:
                raise CheckpointFormatError(f"{what}: keys out of order across blocks")
            result.extend(entries)
    except CheckpointFormatError as e:
        raise CheckpointFormatError(f"{name}: {e}") from None
    return result


def _shared(a: bytes, b: bytes) -> int:
    """The length of the prefix `a` and `b` share."""
    n = min(len(a), len(b))
    # The highest set bit of the XOR of the two prefixes, read as big-endian integers, is the first differing byte.
    diff = int.from_bytes(a[:n], "big") ^ int.from_bytes(b[:n], "big")
    return n - (diff.bit_length() + 7) // 8


def _separator(a: bytes, b: bytes) -> bytes:
    # A short key k with a <= k < b (LevelDB's FindShortestSeparator).
    n = _shared(a, b)
    if n < min(len(a), len(b)) and a[n] < 0xFF and a[n] + 1 < b[n]:
        return a[:n] + bytes([a[n] + 1])
    return a


def _successor(a: bytes) -> bytes:
    # A short key >= a (LevelDB's FindShortSuccessor).
    for i, c in enumerate(a):
        if c != 0xFF:
            return a[:i] + bytes([c + 1])
    return a


def _finish_block(entries: list[tuple[bytes, bytes]], interval: int) -> bytearray:
    out = bytearray()
    restarts = []
    prev = b""
    for i, (key, value) in enumerate(entries):
        if i % interval == 0:
            restarts.append(len(out))
            prev = b""  # a restart point stores its key whole
        shared = _shared(prev, key)
        lengths = (shared, len(key) - shared, len(value))
        # Lengths below 128 are one-byte varints: the bytes themselves (nearly every entry of an index)
        out += bytes(lengths) if max(lengths) < 0x80 else b"".join(map(varint, lengths))
        out += key[shared:] + value
        prev = key
    restarts = restarts or [0]
    out += struct.pack(f"<{len(restarts)}I", *restarts)
    out += struct.pack("<I", len(restarts))
    return out


def write_table(items: Iterable[tuple[bytes, bytes]], block_size: int = BLOCK_SIZE) -> bytes:
    """The bytes of an uncompressed table holding `items` (sorted by key, keys unique)."""
    out = bytearray()
    index: list[tuple[bytes, bytes]] = []  # (separator key, handle) per data block

    def emit(block: bytearray) -> bytes:
        start = len(out)
        out.extend(block)
        out.append(0)  # no compression
        out.extend(struct.pack("<I", mask(crc32c(bytes(out[start:])))))
        return varint(start) + varint(len(block))  # the block's handle

    block: list[tuple[bytes, bytes]] = []
    size = 0
    done = None  # (last key, handle) of a finished block whose index entry awaits the next key
    last = None
    for key, value in items:
        if last is not None and key <= last:
            raise ValueError(f"table keys must be unique and sorted: {last!r} then {key!r}")
        last = key
        if done:
            index.append((_separator(done[0], key), done[1]))
            done = None
        block.append((key, value))
        size += len(key) + len(value) + 8
        if size >= block_size:
            done = (key, emit(_finish_block(block, _RESTART_INTERVAL)))
            block, size = [], 0
    if block:
        done = (block[-1][0], emit(_finish_block(block, _RESTART_INTERVAL)))
    if done:
        index.append((_successor(done[0]), done[1]))
    meta = emit(_finish_block([], 1))
    idx = emit(_finish_block(index, 1))
    footer = (meta + idx).ljust(40, b"\0") + struct.pack("<II", _MAGIC & 0xFFFFFFFF, _MAGIC >> 32)
    return bytes(out + footer)
