"""The .index table (LevelDB SSTable layout): TF-written files, round trips, and every corruption error."""

import os
import struct

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from checkpoint import CheckpointFormatError
from checkpoint._storage._crc import crc32c, mask
from checkpoint._storage._table import _separator, _successor, read_table, write_table

DATA = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(__file__))), "data", "tf_checkpoints")
TF_INDEX = os.path.join(DATA, "tf_object", "ckpt-1.index")


def _tf_index() -> bytes:
    with open(TF_INDEX, "rb") as f:
        return f.read()


def _footer_handles(data: bytes) -> list[int]:
    values, pos = [], len(data) - 48
    for _ in range(4):
        value = shift = 0
        while True:
            b = data[pos]
            pos += 1
            value |= (b & 0x7F) << shift
            shift += 7
            if b < 0x80:
                break
        values.append(value)
    return values


def _bitwise_crc32c(data: bytes) -> int:
    """crc32c by its definition: reflected polynomial 0x82F63B78, initial and final value 0xFFFFFFFF."""
    crc = 0xFFFFFFFF
    for byte in data:
        crc ^= byte
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 if crc & 1 else 0)
    return crc ^ 0xFFFFFFFF


def test_crc32c_is_the_definitions_on_every_buffer_kind():
    # RFC 3720's published vectors (B.4), the standard check value, then the bitwise definition
    assert crc32c(bytes(32)) == 0x8A9136AA and crc32c(b"\xff" * 32) == 0x62A8AB43
    assert crc32c(bytes(range(32))) == 0x46DD794E and crc32c(bytes(range(31, -1, -1))) == 0x113FDB5C
    assert crc32c(b"123456789") == 0xE3069283
    payload = np.random.default_rng(0).integers(0, 256, 100_000, dtype=np.uint8)  # past the GIL-free size
    want = _bitwise_crc32c(payload.tobytes())
    assert crc32c(payload.tobytes()) == want
    assert crc32c(payload) == want
    assert crc32c(memoryview(payload.tobytes())) == want
    assert crc32c(payload[5000:].tobytes(), crc32c(payload[:5000])) == want
    strided = np.arange(64, dtype=np.int32).reshape(8, 8)[:, ::2]
    assert crc32c(strided) == _bitwise_crc32c(strided.tobytes())


def test_crc32c_reads_the_bytes_of_types_a_buffer_cannot_export_and_of_empty_arrays():
    halves = np.arange(10, dtype=np.float32).astype(jnp.bfloat16)
    assert crc32c(halves) == _bitwise_crc32c(halves.tobytes())
    assert crc32c(np.zeros((2, 0), np.float32)) == crc32c(b"") == 0


def test_block_trailers_of_a_tf_index_are_masked_crc32c():
    data = _tf_index()
    _, _, offset, size = _footer_handles(data)
    (stored,) = struct.unpack_from("<I", data, offset + size + 1)
    assert data[offset + size] == 0  # TF writes uncompressed blocks
    assert mask(crc32c(data[offset : offset + size + 1])) == stored
    assert mask(crc32c(data[offset : offset + size + 1])) != crc32c(data[offset : offset + size + 1])


def test_reads_a_tf_index_header_first_then_sorted_keys():
    items = read_table(_tf_index(), TF_INDEX)
    keys = [k for k, _ in items]
    assert keys[0] == b"" and keys == sorted(keys) and len(set(keys)) == len(keys)
    assert b"_CHECKPOINTABLE_OBJECT_GRAPH" in keys
    assert b"model/dense/bias/.ATTRIBUTES/VARIABLE_VALUE" in keys


def test_round_trip_with_many_blocks_and_shared_prefixes():
    items = [(b"layer_%05d/kernel" % i, bytes([i % 256]) * (i % 70)) for i in range(5000)]
    data = write_table(items, block_size=1024)
    assert read_table(data, "t") == items
    _, _, _, index_size = _footer_handles(data)
    assert index_size > 1000  # many data blocks, so many index entries


def test_round_trip_of_an_empty_table_and_binary_keys():
    assert read_table(write_table([]), "t") == []
    items = [(b"", b"header"), (b"\x00\x01", b"a"), (b"\x00\xff\xff", b""), (b"\xff\xff", b"z" * 300)]
    assert read_table(write_table(items, block_size=1), "t") == items


def test_write_table_refuses_unsorted_or_duplicate_keys():
    with pytest.raises(ValueError, match=r"keys must be unique and sorted: b'b' then b'a'"):
        write_table([(b"b", b""), (b"a", b"")])
    with pytest.raises(ValueError, match=r"keys must be unique and sorted: b'a' then b'a'"):
        write_table([(b"a", b""), (b"a", b"")], block_size=1)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.binary(max_size=6), min_size=2, max_size=2, unique=True))
def test_index_separators_lie_between_blocks(pair):
    a, b = sorted(pair)
    sep = _separator(a, b)
    assert a <= sep < b and len(sep) <= len(a)
    assert _successor(a) >= a


def _with_block(data: bytes, offset: int, size: int, new_block: bytes, ctype: int = 0) -> bytes:
    # Replaces a block keeping the trailer valid, so the structural check (not the crc) must catch it.
    assert len(new_block) == size
    crc = mask(crc32c(new_block + bytes([ctype])))
    return data[:offset] + new_block + bytes([ctype]) + struct.pack("<I", crc) + data[offset + size + 5 :]


@pytest.mark.parametrize(
    "corrupt, message",
    [
        (lambda d: d[:47], r"t\.index: 47 bytes is too short for a checkpoint index \(at least 48\)"),
        (lambda d: d[:-1] + b"\x00", r"t\.index: not a checkpoint index \(bad magic number 0x00477524"),
        (lambda d: d[:-100], r"t\.index: not a checkpoint index \(bad magic number"),
        (lambda d: d[:-48] + b"\xff" * 40 + d[-8:], r"t\.index: bad varint \(footer\)"),
    ],
)
def test_bad_file_level_structure(corrupt, message):
    with pytest.raises(CheckpointFormatError, match=message):
        read_table(corrupt(_tf_index()), "t.index")


def test_a_flipped_bit_anywhere_in_a_block_fails_its_checksum():
    data = _tf_index()
    _, _, index_offset, _ = _footer_handles(data)
    for pos in (0, 17, index_offset - 6, index_offset + 3):
        bad = bytearray(data)
        bad[pos] ^= 0x10
        with pytest.raises(CheckpointFormatError, match=r"t\.index: (data|metaindex|index) block.*checksum mismatch"):
            read_table(bytes(bad), "t.index")


def test_snappy_and_unknown_compression_are_refused_by_name():
    data = _tf_index()
    _, _, offset, size = _footer_handles(data)
    block = data[offset : offset + size]
    with pytest.raises(CheckpointFormatError, match=r"t\.index: index block at offset \d+ is snappy-compressed; "
                       r"this reader has no snappy decompressor\. Re-save the checkpoint uncompressed"):
        read_table(_with_block(data, offset, size, block, ctype=1), "t.index")
    with pytest.raises(CheckpointFormatError, match=r"t\.index: index block at offset \d+: unknown compression type 7"):
        read_table(_with_block(data, offset, size, block, ctype=7), "t.index")


def test_a_handle_past_the_end_is_refused_without_reading_it():
    data = _tf_index()
    meta_off, meta_size, offset, _ = _footer_handles(data)
    huge = bytearray()
    for v in (meta_off, meta_size, offset, 1 << 40):  # an index block "of a terabyte"
        while v >= 0x80:
            huge.append((v & 0x7F) | 0x80)
            v >>= 7
        huge.append(v)
    bad = data[:-48] + bytes(huge).ljust(40, b"\0") + data[-8:]
    with pytest.raises(CheckpointFormatError, match=r"index block at offset \d+ with 1099511627776 bytes runs past "
                       r"the end of the table \(\d+ bytes\): the file is truncated or corrupt"):
        read_table(bad, "t.index")


def test_block_contents_that_lie_about_their_sizes():
    data = write_table([(b"a", b"1"), (b"b", b"2")])
    _, _, offset, size = _footer_handles(data)
    # The single data block starts at 0; rewrite it with valid trailers but bad contents.
    block_size = offset - 8 - 5 - 5  # data block, then the 8-byte metaindex block
    block = data[:block_size]
    restarts_lie = block[:-4] + struct.pack("<I", 1000)
    with pytest.raises(CheckpointFormatError, match=r"data block 0: claims 1000 restart points in"):
        read_table(_with_block(data, 0, block_size, restarts_lie), "t")
    value_too_long = block[:5] + bytes([0, 1, 100]) + block[8:]  # the second entry's value "has 100 bytes"
    with pytest.raises(CheckpointFormatError, match=r"data block 0: entry at offset 5 runs past its block"):
        read_table(_with_block(data, 0, block_size, value_too_long), "t")
    swapped = bytes([0, 1, 1]) + b"b2" + bytes([0, 1, 1]) + b"a1" + block[10:]
    with pytest.raises(CheckpointFormatError, match=r"data block 0: keys out of order \(b'b' then b'a'\)"):
        read_table(_with_block(data, 0, block_size, swapped), "t")
    bad_varint = b"\xff" * 10 + block[10:]
    with pytest.raises(CheckpointFormatError, match=r"bad varint \(data block 0\)"):
        read_table(_with_block(data, 0, block_size, bad_varint), "t")
    assert size > 0
