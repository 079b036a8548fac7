"""Damaged and hostile safetensors files: each refused with a CheckpointFormatError naming the file and tensor."""

import json
import os

import numpy as np
import pytest

import checkpoint.safetensors as st
from checkpoint import CheckpointFormatError
from checkpoint._storage import _safetensors as storage


def _file(path, header, data=b"", raw_header=None):
    text = raw_header if raw_header is not None else json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(len(text).to_bytes(8, "little") + text + data)
    return str(path)


def _one(dtype="F32", shape=(2,), offsets=(0, 8)):
    return {"t": {"dtype": dtype, "shape": list(shape), "data_offsets": list(offsets)}}


@pytest.mark.parametrize(("header", "data", "match"), [
    (_one(offsets=(0, 16)), bytes(8), r"tensor 't': data_offsets \[0, 16\] are not \[begin, end\] within the 8 data"),
    (_one(offsets=(4, 2)), bytes(8), r"tensor 't': data_offsets \[4, 2\] are not \[begin, end\]"),
    (_one(offsets=(-8, 0)), bytes(8), r"data_offsets \[-8, 0\] are not"),
    (_one(shape=(3,)), bytes(8), r"tensor 't': shape \(3,\) of F32 is 12 bytes, but its data_offsets \[0, 8\] hold 8"),
    (_one(dtype="F4"), bytes(8), r"tensor 't': dtype 'F4' is not one this reader knows"),
    (_one(dtype=3), bytes(8), r"tensor 't': dtype 3 is not one"),
    (_one(shape=(-2,)), bytes(8), r"tensor 't': shape \[-2\] is not a list of at most 64 non-negative integers"),
    (_one(shape=(True, 2)), bytes(8), r"shape \[True, 2\] is not a list"),
    ({"t": [1, 2]}, b"", r"tensor 't': expected an object with dtype, shape and data_offsets, found \[1, 2\]"),
    ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
      "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}, bytes(12),
     r"tensors 'a' and 'b' overlap \(bytes 4 to 8\)"),
    ({"__metadata__": {"a": 1}}, b"", r"__metadata__ must map strings to strings"),
    ([1], b"", r"the header is list, expected a JSON object"),
])
def test_damaged_headers(tmp_path, header, data, match):
    path = _file(tmp_path / "bad.safetensors", header, data)
    with pytest.raises(CheckpointFormatError, match=match) as e:
        st.load(path)
    assert str(e.value).startswith(path)


@pytest.mark.parametrize(("raw", "match"), [
    (b"{not json", r"the header is not valid JSON"),
    (b"\xff\xfe", r"the header is not valid JSON"),
    (b'{"t": {"dtype": "F32", "shape": [0], "data_offsets": [0, 0]}, "t": {}}', r"the name 't' appears twice"),
    (b"[" * 100_000 + b"]" * 100_000, r"the header is not valid JSON \(nested too deeply\)"),  # no RecursionError
])
def test_headers_that_are_not_json(tmp_path, raw, match):
    path = _file(tmp_path / "bad.safetensors", None, raw_header=raw)
    with pytest.raises(CheckpointFormatError, match=match):
        st.load(path)


def test_header_length_bounded_and_inside_the_file(tmp_path):
    path = str(tmp_path / "h.safetensors")
    with open(path, "wb") as f:
        f.write((1 << 40).to_bytes(8, "little") + b"{}")
    with pytest.raises(CheckpointFormatError, match=r"h.safetensors: the header length says 1099511627776 bytes, "
                                                    r"but the file has 2 after it and this reader accepts at most"):
        st.load(path)
    with open(path, "wb") as f:
        f.write(b"\x01\x02")
    with pytest.raises(CheckpointFormatError, match=r"2 bytes, too short for a safetensors file"):
        st.load(path)
    os.mkfifo(tmp_path / "fifo.safetensors")
    with pytest.raises(CheckpointFormatError, match=r"fifo.safetensors: a safetensors file is not a regular file "
                                                    r"\(it is a FIFO\)"):
        st.load(tmp_path / "fifo.safetensors")


def test_a_file_truncated_after_its_header_was_read(tmp_path):
    path = st.save(tmp_path / "m.safetensors", {"a": np.ones(1000, np.float32)})
    reader = storage.SafetensorsReader(path)
    os.truncate(path, 100)
    with pytest.raises(CheckpointFormatError, match=r"m.safetensors: tensor 'a': the file shrank while reading"):
        reader.get("a")


def _index(tmp_path, weight_map, name="model.safetensors.index.json"):
    path = tmp_path / name
    path.write_text(json.dumps({"metadata": {"total_size": 8}, "weight_map": weight_map}))
    return str(path)


def test_index_paths_never_leave_the_directory(tmp_path):
    inner = tmp_path / "model"
    inner.mkdir()
    st.save(tmp_path / "outside.safetensors", {"t": np.ones(2, np.float32)})
    for file in ("../outside.safetensors", str(tmp_path / "outside.safetensors")):
        index = _index(inner, {"t": file})
        with pytest.raises(CheckpointFormatError, match=r"tensor 't' is in .*outside.safetensors'?, which is outside "
                                                        r"the index's directory"):
            st.load(index)
    os.symlink(tmp_path / "outside.safetensors", inner / "link.safetensors")
    with pytest.raises(CheckpointFormatError, match="which is outside the index's directory"):
        st.load(_index(inner, {"t": "link.safetensors"}))


def test_index_and_shards_must_agree(tmp_path):
    st.save(tmp_path / "s.safetensors", {"t": np.ones(2, np.float32)})
    with pytest.raises(CheckpointFormatError, match=r"the index puts tensor 'u' in .*s.safetensors, which does not "
                                                    "hold it"):
        st.load(_index(tmp_path, {"t": "s.safetensors", "u": "s.safetensors"}))
    bad = tmp_path / "bad.safetensors.index.json"
    bad.write_text(json.dumps({"weight_map": {"t": 3}}))
    with pytest.raises(CheckpointFormatError, match="expected a JSON object with a weight_map of tensor names"):
        st.load(bad)
    bad.write_text("{")
    with pytest.raises(CheckpointFormatError, match=r"bad.safetensors.index.json: not valid JSON"):
        st.load(bad)
    with pytest.raises(FileNotFoundError, match=r"expected one \*.safetensors.index.json index or one"):
        st.load(tmp_path)  # two indexes in one directory


def test_a_missing_shard_is_named_as_damage_and_metadata_values_are_checked(tmp_path):
    from safetensors.numpy import save_file

    from checkpoint import DataLossError

    index = st.save(tmp_path / "m.safetensors", {"a": np.ones(64, np.float32), "b": np.zeros(64, np.float32)},
                    max_shard_size=300)
    os.remove(tmp_path / "m-00002-of-00002.safetensors")
    with pytest.raises(DataLossError, match=r"the index puts 1 tensor \('b' first\) in m-00002-of-00002.safetensors, "
                                            r"which is missing from .*; copy that shard beside the index"):
        st.load(index)
    path = str(tmp_path / "clash.safetensors")  # a tensor and a Python value at one path: a hostile file
    save_file({"a": np.arange(3, dtype=np.float32)}, path,
              metadata={storage.NAMES_ARE_PATHS: storage.PATHS, storage.PYTHON: json.dumps({"a": 3})})
    with pytest.raises(CheckpointFormatError, match=r"clash.safetensors: 'a' is both a tensor and a Python value of "
                                                    r"its varstate.python metadata; the file is damaged"):
        st.load(path)
    for bad in (None, {}, [1, 2], 10**30):
        save_file({"t": np.ones(2, np.float32)}, path,
                  metadata={storage.NAMES_ARE_PATHS: storage.PATHS, storage.PYTHON: json.dumps({"c": bad})})
        with pytest.raises(CheckpointFormatError, match=r"__metadata__ entry 'varstate.python' holds .* at 'c', "
                                                        r"expected a bool, int64, float or str; the file is damaged"):
            st.load(path)
