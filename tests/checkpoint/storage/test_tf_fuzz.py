"""Fuzzing the TF checkpoint reader: any bad input gives a DataLossError naming the file (or correct values), nothing
else. Derandomised: each run tries the same inputs, so a failure reproduces and a pass does not depend on luck.

Short by default; for a long run by hand:

    TF_FUZZ_EXAMPLES=20000 .venv/bin/python -m pytest tests/checkpoint/storage/test_tf_fuzz.py -q
"""

import os
import tempfile

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from checkpoint import DataLossError
from checkpoint._storage._bundle import GRAPH_KEY, BundleReader, slice_key
from checkpoint._storage._crc import crc32c, mask
from checkpoint._storage._table import read_table, write_table
from checkpoint.protos import tensor_bundle_pb2

DATA = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(__file__))), "data", "tf_checkpoints")
FUZZ = settings(
    max_examples=int(os.environ.get("TF_FUZZ_EXAMPLES", "200")),
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
)
_SRC = os.path.join(DATA, "tf_name", "model.ckpt-2")  # has slices, strings-free; ours_bundle has strings
_FILES = {}
for _name, _prefix in (("name", _SRC), ("bundle", os.path.join(DATA, "ours_bundle", "ckpt-1"))):
    with open(_prefix + ".index", "rb") as _i, open(_prefix + ".data-00000-of-00001", "rb") as _d:
        _FILES[_name] = (_i.read(), _d.read())


def _read_everything(prefix: str) -> dict:
    """Every value, slice list and the graph (None for a value that raised); any other error fails the test, and
    so does a DataLossError that does not name the checkpoint."""
    out = {}
    try:
        reader = BundleReader(prefix)
        out["graph"] = reader.object_graph is not None
        for key in reader.keys():
            try:
                out[key] = (reader.get(key), reader.get_slices(key), reader.shape(key), reader.dtype(key))
            except DataLossError as e:
                assert prefix in str(e), e
                out[key] = None
        reader.close()
    except DataLossError as e:
        assert prefix in str(e), e
        return {}
    return out


def _originals(name: str) -> dict:
    with tempfile.TemporaryDirectory() as d:
        _write(d, *_FILES[name])
        return _read_everything(os.path.join(d, "c"))


def _write(directory: str, index: bytes, data: bytes) -> None:
    with open(os.path.join(directory, "c.index"), "wb") as f:
        f.write(index)
    with open(os.path.join(directory, "c.data-00000-of-00001"), "wb") as f:
        f.write(data)


_ORIGINALS = {name: _originals(name) for name in _FILES}


def _same(a, b) -> bool:
    return a[0].dtype == b[0].dtype and a[0].shape == b[0].shape and a[0].tobytes() == b[0].tobytes() \
        if a[0].dtype != object else a[0].tolist() == b[0].tolist()


mutation = st.tuples(
    st.sampled_from(["flip", "truncate", "overwrite", "insert"]),
    st.floats(0, 1, exclude_max=True),  # where, as a fraction of the file
    st.binary(min_size=1, max_size=16),
)


def _mutate(blob: bytes, kind: str, where: float, payload: bytes) -> bytes:
    pos = int(where * len(blob))
    if kind == "flip" and blob:
        return blob[:pos] + bytes([blob[pos] ^ (1 << (payload[0] % 8))]) + blob[pos + 1 :]
    if kind in ("truncate", "flip"):
        return blob[:pos]
    if kind == "overwrite":
        return blob[:pos] + payload + blob[pos + len(payload) :]
    return blob[:pos] + payload + blob[pos:]


@FUZZ
@given(st.sampled_from(sorted(_FILES)), st.booleans(), st.lists(mutation, min_size=1, max_size=3))
def test_mutated_files_give_format_errors_or_the_original_values(name, in_index, mutations):
    index, data = _FILES[name]
    for m in mutations:
        if in_index:
            index = _mutate(index, *m)
        else:
            data = _mutate(data, *m)
    with tempfile.TemporaryDirectory() as d:
        _write(d, index, data)
        got = _read_everything(os.path.join(d, "c"))
    for key, value in got.items():
        if key != "graph" and value is not None:  # what reads at all reads right: checksums caught the rest
            assert _same(value, _ORIGINALS[name][key]), key


def _entry_strategy():
    dims = st.lists(st.sampled_from([0, 1, 2, 3, 5, -1, 1 << 31, 1 << 62]), max_size=4)
    extent = st.tuples(st.sampled_from([0, 1, 2, -1, 1 << 40]), st.sampled_from([None, -1, 0, 1, 2, 1 << 40]))
    return st.fixed_dictionaries(
        {
            "dtype": st.sampled_from([0, 1, 2, 3, 7, 10, 14, 19, 20, 21, 99, 101]),
            "shape": dims,
            "unknown_rank": st.booleans(),
            "shard_id": st.sampled_from([0, 0, 0, 1, -1, 1 << 30]),
            "offset": st.sampled_from([0, 1, 7, -1, 1 << 40]),
            "size": st.sampled_from([0, 1, 4, 8, 16, 1 << 40, -1]),
            "good_crc": st.booleans(),
            "slices": st.lists(st.lists(extent, max_size=3), max_size=3),
        }
    )


@FUZZ
@given(
    st.lists(_entry_strategy(), min_size=1, max_size=3),
    st.binary(max_size=48),
    st.sampled_from([0, 1, 2, 1 << 30]),
    st.sampled_from([0, 1, 7]),
)
def test_lying_entries_give_format_errors_never_crashes_or_huge_allocations(entries, data, num_shards, endian):
    header = tensor_bundle_pb2.BundleHeaderProto(num_shards=num_shards, endianness=endian, version={"producer": 1})
    items = [(b"", header.SerializeToString())]
    for i, e in enumerate(entries):
        proto = tensor_bundle_pb2.BundleEntryProto(
            dtype=e["dtype"], shard_id=e["shard_id"], offset=e["offset"], size=e["size"]
        )
        proto.shape.unknown_rank = e["unknown_rank"]
        for d in e["shape"]:
            proto.shape.dim.add(size=d)
        lo, hi = max(e["offset"], 0), max(e["offset"], 0) + max(e["size"], 0)
        proto.crc32c = mask(crc32c(data[lo:hi])) if e["good_crc"] else 12345
        for extents in e["slices"]:
            s = proto.slices.add()
            for start, length in extents:
                x = s.extent.add(start=start)
                if length is not None:
                    x.length = length
            piece = tensor_bundle_pb2.BundleEntryProto(dtype=e["dtype"], offset=0, size=len(data))
            piece.crc32c = mask(crc32c(data))
            key = slice_key(f"k{i}".encode(), [(x.start, x.length if x.HasField("length") else -1) for x in s.extent])
            items.append((key, piece.SerializeToString()))
        items.append((f"k{i}".encode(), proto.SerializeToString()))
    items.append((GRAPH_KEY.encode(), items[-1][1]))
    with tempfile.TemporaryDirectory() as d:
        with open(os.path.join(d, "c.index"), "wb") as f:
            f.write(write_table(sorted(dict(items).items())))
        with open(os.path.join(d, "c.data-00000-of-00001"), "wb") as f:
            f.write(data)
        got = _read_everything(os.path.join(d, "c"))
    for key, value in got.items():
        if key != "graph" and value is not None:
            array, _, shape, dtype = value
            assert array.shape == shape and array.dtype == dtype and array.nbytes <= max(len(data), 1) * 8


@FUZZ
@given(st.binary(max_size=300))
def test_random_bytes_are_never_an_index(blob):
    # even with the right magic number at the end: a block's checksum would have to match by chance (2**-32)
    with pytest.raises(DataLossError, match=r"^fuzz/c\.index: "):
        read_table(blob + _FILES["name"][0][-8:], "fuzz/c.index")


def test_the_fuzzed_sources_read_cleanly():
    for name in _FILES:
        values = _ORIGINALS[name]
        assert values and all(v is not None for v in values.values()), name
    assert np.asarray(_ORIGINALS["name"]["emb"][0]).shape == (10, 4)
