"""The orbax backend's fast paths (issue 15) give the bytes, checks and errors of the plain ones.

- batches are laid out in one allocation per batch: the same bytes, offsets and
  checksums as values concatenated one after another with their padding;
- `crc32c_spans` (one checksum per range of a buffer) equals `crc32c` of each slice;
- large values restored onto a sharding this process holds are read by
  tensorstore a few at a time and checked before they reach a device.
"""

import json
import os

import jax
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import checkpoint
from checkpoint._storage import _orbax, _orbax_layout
from checkpoint._storage._crc import crc32c, crc32c_spans
from checkpoint.protos.trackable_object_graph_pb2 import TrackableObjectGraph


def _reference_batches(values, batch_bytes):
    """The batch layout written out the obvious way: values back to back, each padded to 64 bytes."""
    batches, places, current, offset = [], [], [], 0
    for v in values:
        raw = np.ascontiguousarray(v).reshape(-1).view(np.uint8)
        if current and offset + raw.size > batch_bytes:
            batches.append(np.concatenate(current) if offset else np.zeros(64, np.uint8))
            current, offset = [], 0
        places.append((len(batches), offset, crc32c(raw.tobytes())))
        pad = -(offset + raw.size) % 64
        current += [raw, np.zeros(pad, np.uint8)]
        offset += raw.size + pad
    batches.append(np.concatenate(current) if offset else np.zeros(64, np.uint8))
    return batches, places


@pytest.mark.parametrize("batch_bytes", [64 << 20, 1000, 1])
def test_batches_hold_the_values_back_to_back_as_the_reference_layout(batch_bytes):
    values = [
        np.arange(5, dtype=np.float32),
        np.zeros((0, 3), np.float32),  # empty: takes no bytes
        np.arange(40, dtype=np.float32)[::2],  # strided
        np.asfortranarray(np.arange(12, dtype=np.float64).reshape(3, 4)),
        np.arange(7).astype(ml_dtypes.bfloat16),
        np.array(True),
        jax.numpy.arange(300, dtype=jax.numpy.int32),
        np.int64(9),
    ]
    tree, meta = _orbax_layout.layout({f"k{i}": v for i, v in enumerate(values)}, TrackableObjectGraph(),
                                      batch_bytes=batch_bytes)
    batches, places = _reference_batches(values, batch_bytes)
    assert sorted(tree) == [f"p{i}" for i in range(len(batches))]
    for i, batch in enumerate(batches):
        assert tree[f"p{i}"].dtype == np.uint8 and tree[f"p{i}"].tobytes() == batch.tobytes(), i
    assert meta["packs"] == [p.size for p in batches]
    for i, (batch, offset, crc) in enumerate(places):
        entry = meta["entries"][f"k{i}"]
        assert (entry["pack"], entry["offset"], entry["crc32c"]) == (batch, offset, crc), i


@pytest.mark.parametrize("batch_bytes", [64 << 20, 100, 1])
def test_a_batch_holds_nothing_of_what_its_memory_held_before(monkeypatch, batch_bytes):
    """Batches are not zeroed before the values are copied in: every byte around them is set instead. Given
    memory full of 0xAA, the batches are still the reference layout, zero padding and all."""
    monkeypatch.setattr(_orbax_layout, "_fresh", lambda size: np.full(size, 0xAA, np.uint8))
    values = [np.arange(5, dtype=np.int8), np.zeros(0, np.float32), np.array(True), np.arange(3, dtype=np.float64),
              np.zeros((2, 0), np.int8)]
    tree, _ = _orbax_layout.layout({f"k{i}": v for i, v in enumerate(values)}, TrackableObjectGraph(),
                                      batch_bytes=batch_bytes)
    batches, _ = _reference_batches(values, batch_bytes)
    assert [tree[f"p{i}"].tobytes() for i in range(len(batches))] == [b.tobytes() for b in batches]
    only_empty, _ = _orbax_layout.layout({"a": np.zeros(0, np.float32)}, TrackableObjectGraph())
    assert only_empty["p0"].tobytes() == bytes(64)


def test_only_empty_values_make_one_batch_of_padding():
    tree, meta = _orbax_layout.layout({"a": np.zeros(0, np.float32), "b": np.zeros((2, 0), np.int8)},
                                      TrackableObjectGraph())
    assert tree["p0"].tobytes() == bytes(64) and meta["packs"] == [64]
    assert [meta["entries"][k]["crc32c"] for k in "ab"] == [0, 0]


def test_crc32c_spans_equals_the_checksum_of_each_slice_and_refuses_what_is_not_a_byte_buffer():
    buf = np.random.default_rng(0).integers(0, 256, 300_000, dtype=np.uint8)
    spans = [(0, 0), (0, 1), (3, 70_000), (100_000, 200_000), (299_999, 1)]
    want = [crc32c(buf[s:s + n].tobytes()) for s, n in spans]
    assert crc32c_spans(buf, spans) == want
    check = np.frombuffer(b"xx123456789", np.uint8).copy()
    assert crc32c_spans(check, [(2, 9)]) == [0xE3069283]  # crc32c's published check value
    with pytest.raises(ValueError, match=r"^crc32c_spans: range \[299999, \+2\) lies outside the 300000 bytes$"):
        crc32c_spans(buf, [(299_999, 2)])
    with pytest.raises(ValueError, match=r"^crc32c_spans: range \[-1, \+1\) lies outside the 300000 bytes$"):
        crc32c_spans(buf, [(-1, 1)])
    with pytest.raises(TypeError, match=r"^crc32c_spans needs a contiguous 1-D uint8 array, got float32 \(4,\)$"):
        crc32c_spans(np.zeros(4, np.float32), [(0, 1)])
    with pytest.raises(TypeError, match=r"^crc32c_spans needs a contiguous 1-D uint8 array, got uint8 \(5,\)$"):
        crc32c_spans(buf[::2][:5], [(0, 1)])


def _large(n, count):
    return {f"w{i}": np.full(n, i, np.float32) + np.arange(n, dtype=np.float32) for i in range(count)}


def test_many_large_values_stream_onto_their_shardings_in_order(tmp_path, monkeypatch):
    # Read-ahead of one value and opening batches of two: every branch of the read loop runs.
    monkeypatch.setattr(_orbax, "_READ_AHEAD", 1)
    monkeypatch.setattr(_orbax, "_OPEN_AHEAD", 2)
    values = _large(300_000, 5)  # 1.2 MB each: each its own orbax array
    path = checkpoint.Checkpoint(**values).write(str(tmp_path / "c"))
    mesh = Mesh(np.array(jax.devices()), ("x",))
    shardings = {k: NamedSharding(mesh, P("x")) if i % 2 else jax.devices()[i] for i, k in enumerate(values)}
    reader = checkpoint.read_checkpoint(path)
    got = reader.get_many({f"{k}/.ATTRIBUTES/VARIABLE_VALUE": s for k, s in shardings.items()})
    assert list(got) == [f"{k}/.ATTRIBUTES/VARIABLE_VALUE" for k in values]
    for k, value in values.items():
        out = got[f"{k}/.ATTRIBUTES/VARIABLE_VALUE"]
        assert isinstance(out, jax.Array) and out.sharding.is_equivalent_to(
            shardings[k] if isinstance(shardings[k], NamedSharding) else
            jax.sharding.SingleDeviceSharding(shardings[k]), 1)
        np.testing.assert_array_equal(np.asarray(out), value)
    assert reader._cache == {}  # values placed on devices are not kept on the host
    restored = checkpoint.Checkpoint(**{k: np.zeros_like(v) for k, v in values.items()}).restore(path)
    for k, value in values.items():
        np.testing.assert_array_equal(np.asarray(restored.roots[k]), value)


def test_a_large_value_read_onto_a_sharding_fails_its_checksum_before_it_is_placed(tmp_path, monkeypatch):
    values = _large(300_000, 3)
    path = checkpoint.Checkpoint(**values).write(str(tmp_path / "c"))
    meta_file = os.path.join(path, _orbax.META_FILE)
    with open(meta_file) as f:
        meta = json.load(f)
    key = "w1/.ATTRIBUTES/VARIABLE_VALUE"
    meta["entries"][key]["crc32c"] ^= 1
    with open(meta_file, "w") as f:
        json.dump(_orbax.seal(meta), f)
    placed = []
    real_put = jax.device_put
    monkeypatch.setattr(jax, "device_put", lambda x, *a, **k: placed.extend(  # one host or a list (place_many)
        np.asarray(h)[:1] for h in (x if isinstance(x, list) else [x])) or real_put(x, *a, **k))
    mesh = Mesh(np.array(jax.devices()), ("x",))
    want = crc32c(values["w1"]) ^ 1
    with pytest.raises(checkpoint.DataLossError, match=rf"^Checkpoint '{path}': checksum mismatch for '{key}' \(crc32c "
                                                       rf"{crc32c(values['w1']):#010x}, expected {want:#010x}\); the "
                                                       r"checkpoint is corrupted\. Restore an older checkpoint\.$"):
        checkpoint.read_checkpoint(path).get_many(
            {f"{k}/.ATTRIBUTES/VARIABLE_VALUE": NamedSharding(mesh, P("x")) for k in values})
    assert [p.tolist() for p in placed] == [[0.0]]  # w0 was placed; w1 was refused before it reached a device


def test_a_value_file_cut_short_names_the_value_being_streamed(tmp_path):
    values = _large(300_000, 2)
    path = checkpoint.Checkpoint(**values).write(str(tmp_path / "c"))
    # Orbax may write both arrays into one file, in either order: cut the one stored last in its file, so that
    # only its final bytes go missing (cutting the first would take the other's bytes too).
    ends = []
    for root, _, names in os.walk(os.path.join(path, "values")):
        for name in names:
            with open(os.path.join(root, name), "rb") as f:
                content = f.read()
            ends += [(content.index(v.tobytes()) + v.nbytes, k, os.path.join(root, name))
                     for k, v in values.items() if v.tobytes() in content]
    assert sorted(k for _, k, _ in ends) == ["w0", "w1"]
    end, cut, file = max(ends)
    os.truncate(file, end - 8)
    mesh = Mesh(np.array(jax.devices()), ("x",))
    with pytest.raises(checkpoint.DataLossError, match=rf"^Checkpoint '{path}': cannot read stored values "
                                                       rf"\('{cut}/\.ATTRIBUTES/VARIABLE_VALUE'\): OUT_OF_RANGE: Error "
                                                       rf"reading \"a{cut[1]}/0\" .*\. The value files are damaged; "
                                                       r"restore an older checkpoint\.$"):
        checkpoint.read_checkpoint(path).get_many(
            {f"{k}/.ATTRIBUTES/VARIABLE_VALUE": NamedSharding(mesh, P("x")) for k in values})


def test_large_values_are_spread_over_data_files_of_the_stated_size(tmp_path, monkeypatch, plain_orbax):
    # One unbounded data file was written and synced as one: the orbax format saved 1.9x slower than the TF format.
    monkeypatch.setattr(_orbax_layout, "DATA_FILE_BYTES", 4 << 20)
    rng = np.random.default_rng(0)
    values = {f"w{i}": rng.standard_normal((1 << 20) // 4 * 3, dtype=np.float32) for i in range(4)}  # 3 MiB each
    path = checkpoint.Checkpoint(**values).write(str(tmp_path / "c"))
    data = os.path.join(path, "values", "ocdbt.process_0", "d")
    holding = [name for name in os.listdir(data) if os.path.getsize(os.path.join(data, name)) >= 3 << 20]
    # A file is closed once it holds 4 MiB: at most two values each (one before the limit, one past it)
    assert 2 <= len(holding) <= 4
    assert all(os.path.getsize(os.path.join(data, name)) < 2 * (3 << 20) + (1 << 20) for name in holding)
    reader = checkpoint.read_checkpoint(path)
    assert all(np.array_equal(reader.get(f"{k}/.ATTRIBUTES/VARIABLE_VALUE"), v) for k, v in values.items())
    # orbax itself reads the multi-file store as it reads one it wrote
    tree = plain_orbax(path)
    assert sorted(tree) == ["a0", "a1", "a2", "a3"]
