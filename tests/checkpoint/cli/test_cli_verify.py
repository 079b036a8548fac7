"""`varstate-ckpt verify PATH`: every checksum checked, damage reported with its key, exit 0 / 1 / 2.

References: checkpoints written here and by TensorFlow (tests/data/tf_checkpoints, tf_name_based), Keras
files written by Keras (tests/data/keras_weights), each counted through its own reader (read_checkpoint, h5py,
the safetensors package); damage is one flipped bit at a place found independently of the verifier.
"""

import glob
import json
import os
import pathlib
import re
import zipfile

import h5py
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
import safetensors.numpy

import checkpoint
import checkpoint.safetensors as st
import varstate
from checkpoint import read_checkpoint
from checkpoint._cli import _verify
from checkpoint._storage import BundleReader
from varstate.optimizers import Adam

DATA = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(__file__))), "data")
KERAS = os.path.join(DATA, "keras_weights")
CHECKSUMS = "every checksum matches (the metadata's and each value's)"
KERNEL = "model/kernel/.ATTRIBUTES/VARIABLE_VALUE"
BIG = np.arange(16384, dtype=np.float32) * 1.2345  # 64 KiB: stored in a data file, not inlined in orbax's b-tree


def _save(tmp_path, fmt, packed=True):
    model = {"kernel": varstate.Variable(jnp.asarray(BIG.reshape(128, 128)), name="kernel"),
             "bias": varstate.Variable(jnp.arange(3.0), name="bias")}
    ckpt = checkpoint.Checkpoint(model=model, optimizer=Adam(0.1).init(model), step=7)
    return ckpt.write(str(tmp_path / f"ckpt_{fmt}"), format=fmt, packed=packed)


def _reference(path):
    """(values, bytes) of a checkpoint, through read_checkpoint."""
    r = read_checkpoint(path)
    sizes = [sum(map(len, v.ravel())) if v.dtype == object else v.nbytes for v in map(np.asarray, map(r.get, r.keys()))]
    return len(sizes), sum(sizes)


def _summary(n, size):
    return f"{n} values, {size} B" if size < 1024 else f"{n} values, {size / 1024:.1f} KiB"


def _flip_everywhere(root, pattern):
    """Flips one bit of `pattern` in every file under `root` that holds it; returns how many files."""
    hits = 0
    for f in glob.glob(os.path.join(root, "**"), recursive=True):
        if os.path.isfile(f):
            data = bytearray(pathlib.Path(f).read_bytes())
            if pattern in data:
                data[data.index(pattern) + 3] ^= 0x10
                pathlib.Path(f).write_bytes(bytes(data))
                hits += 1
    return hits


# --- formats with checksums -------------------------------------------------------
@pytest.mark.parametrize("fmt,packed", [("tf", True), ("orbax", True), ("orbax", False)])
def test_intact_checkpoint_of_ours_passes(run, tmp_path, fmt, packed):
    path = _save(tmp_path, fmt, packed)
    code, out, err = run("verify", path)
    kind = "TF" if fmt == "tf" else "orbax"
    assert (code, err) == (0, "")
    assert out.splitlines() == [f"{path}: {kind} object-based checkpoint",
                                f"{_summary(*_reference(path))}: {CHECKSUMS}", "OK"]


@pytest.mark.parametrize("name", ["tf_object/ckpt-1", "tf_name/model.ckpt-2", "tf_sharded/ckpt", "tf_sharded_variable",
                                  "tf_low_precision/ckpt"])
def test_tf_written_checkpoints_pass(run, name):
    path = os.path.join(DATA, "tf_checkpoints", name)
    code, out, err = run("verify", path, "--json")
    assert (code, err) == (0, "")
    report = json.loads(out)
    n, size = _reference(path)
    assert (report["ok"], report["checksums"], report["values"], report["bytes"], report["damaged"]) == (
        True, True, n, size, None)


def test_flipped_bit_in_a_tf_value_names_its_key(run, tmp_path):
    path = _save(tmp_path, "tf")
    with BundleReader(path) as reader:
        entry = reader.entry(KERNEL)
    data = path + ".data-00000-of-00001"
    raw = bytearray(pathlib.Path(data).read_bytes())
    raw[entry.offset + 100] ^= 0x01
    pathlib.Path(data).write_bytes(bytes(raw))
    code, out, err = run("verify", path)
    assert (code, err) == (1, "")
    lines = out.splitlines()
    assert lines[0] == f"{path}: TF object-based checkpoint"
    assert re.fullmatch(rf"DAMAGED: '{re.escape(KERNEL)}': {re.escape(data)}: key '{re.escape(KERNEL)}': checksum "
                        r"mismatch \(the data file is corrupt\); copy it again from its source", lines[1]), lines[1]
    assert re.fullmatch(r"\d+ values read intact before it", lines[2])


def test_flipped_bit_in_an_orbax_value_names_its_key(run, tmp_path):
    path = _save(tmp_path, "orbax")
    assert _flip_everywhere(os.path.join(path, "values"), BIG.tobytes()[4096:4112]) >= 1
    code, out, err = run("verify", path, "--json")
    assert (code, err) == (1, "")
    report = json.loads(out)
    assert report["ok"] is False and report["damaged"]["key"] == KERNEL
    assert re.match(rf"Checkpoint '{re.escape(path)}': checksum mismatch for '{re.escape(KERNEL)}' \(crc32c 0x",
                    report["damaged"]["error"])


def test_flipped_bit_in_a_tf_index_is_metadata_damage(run, tmp_path):
    path = _save(tmp_path, "tf")
    index = pathlib.Path(path + ".index")
    raw = bytearray(index.read_bytes())
    raw[20] ^= 0x01  # inside the first data block of the table, which its crc32c covers
    index.write_bytes(bytes(raw))
    code, out, err = run("verify", path)
    assert (code, err) == (1, "")
    assert re.fullmatch(rf"DAMAGED: found on opening it, before any value was read: {re.escape(path)}\.index: data "
                        r"block 0 at offset 0: checksum mismatch .*", out.splitlines()[1]), out


def test_flipped_bit_in_orbax_metadata_is_metadata_damage(run, tmp_path):
    path = _save(tmp_path, "orbax")
    meta = pathlib.Path(path, "meta", "metadata")
    text = meta.read_text()
    graph = json.loads(text)["object_graph"]
    # One base64 letter of the object graph changed for another, the JSON still valid.
    at = text.index(graph) + len(graph) // 2
    text = text[:at] + ("A" if text[at] != "A" else "B") + text[at + 1:]
    meta.write_text(text)
    code, out, err = run("verify", path)
    assert (code, err) == (1, "")
    assert out.splitlines()[0] == path
    assert out.splitlines()[1].startswith("DAMAGED: found on opening it, before any value was read: Checkpoint ")
    assert "crc32c" in out


@pytest.mark.parametrize("what", ["directory", "file", "missing"])
def test_not_a_checkpoint_is_a_usage_error(run, tmp_path, what):
    path = tmp_path / "x"
    if what == "directory":
        path.mkdir()
        (path / "notes.txt").write_text("hello")
    elif what == "file":
        path.write_text("hello")
    code, out, err = run("verify", str(path))
    assert (code, out) == (2, "")
    assert re.fullmatch(rf"varstate-ckpt: error: No checkpoint (at|in directory) {re.escape(str(path))}.*\n", err)


# --- formats without checksums -------------------------------------------------------
def _no_checksums(run, path, fmt, n, size):
    code, out, err = run("verify", path)
    assert (code, err) == (0, "")
    assert out.splitlines() == [f"{path}: {fmt}", f"{_summary(n, size)}: {_verify.NO_CHECKSUMS}", "OK"]


def _datasets(f):
    found = []
    f.visititems(lambda _, obj: found.append(obj[()]) if isinstance(obj, h5py.Dataset) else None)
    return len(found), sum(np.asarray(v).nbytes for v in found)


@pytest.mark.parametrize("name", ["keras3/mlp.weights.h5", "keras3/conv.weights.h5", "tf_keras/mlp.h5"])
def test_keras_hdf5_is_read_whole(run, name):
    path = os.path.join(KERAS, name)
    with h5py.File(path, "r") as f:
        _no_checksums(run, path, "Keras HDF5 weights", *_datasets(f))


def test_keras_archive_is_read_whole(run):
    path = os.path.join(KERAS, "keras3", "mlp.keras")
    with zipfile.ZipFile(path) as z, h5py.File(z.open("model.weights.h5"), "r") as f:
        _no_checksums(run, path, "Keras archive (.keras)", *_datasets(f))


def test_truncated_keras_file_is_damage(run, tmp_path):
    data = pathlib.Path(KERAS, "keras3", "mlp.weights.h5").read_bytes()
    path = tmp_path / "cut.weights.h5"
    path.write_bytes(data[: len(data) - 100])
    code, out, err = run("verify", str(path))
    assert (code, err) == (1, "")
    assert out.splitlines()[0] == f"{path}: Keras HDF5 weights"
    assert re.match(r"DAMAGED: found on opening it, before any value was read: .*truncated file", out.splitlines()[1])


def test_orbax_written_tree_is_read_whole(run, tmp_path):
    path = str(tmp_path / "tree")
    tree = {"dense": {"kernel": np.ones((2, 3), np.float32), "bias": np.arange(3, dtype=np.int64)}}
    with ocp.StandardCheckpointer() as c:
        c.save(path, tree)
    _no_checksums(run, path, "orbax PyTree checkpoint (written by orbax)", 2, 24 + 24)


def test_safetensors_is_read_whole_and_a_cut_file_is_damage(run, tmp_path):
    path = str(tmp_path / "m.safetensors")
    st.save(path, {"a": np.arange(300, dtype=np.int8), "b": np.ones((4, 5), np.float32)})
    loaded = safetensors.numpy.load_file(path)  # the package's own reader: the reference
    _no_checksums(run, path, "safetensors", len(loaded), sum(v.nbytes for v in loaded.values()))
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - 8)
    code, out, err = run("verify", path)
    assert (code, err) == (1, "")
    assert out.splitlines()[0] == f"{path}: safetensors"
    assert out.splitlines()[1].startswith("DAMAGED: found on opening it, before any value was read: ")


def test_orbax_verify_keeps_at_most_one_batch_in_memory(tmp_path, monkeypatch):
    # Small values in several batches and values stored on their own: after each batch, and after each value
    # stored on its own, the reader's cached copy is dropped.
    from checkpoint._storage import _orbax, _orbax_layout

    monkeypatch.setattr(_orbax_layout, "BATCH_BYTES", 64)
    monkeypatch.setattr(_orbax_layout, "BATCH_LIMIT", 40)
    values = {f"v{i}": jnp.full(4 if i % 3 else 16, float(i)) for i in range(10)}  # 16 bytes or 64
    path = checkpoint.Checkpoint(**values).write(str(tmp_path / "c"))
    reader = _orbax.OrbaxReader(path)
    assert len(reader._batches) > 2 and any("array" in e for e in reader._entries.values())
    held = [len(reader._cache) for _ in _verify._values(reader)]
    assert len(held) == 10 and max(held) == 1 and len(reader._cache) == 0


def test_verify_of_an_orbax_written_tree_keeps_no_value_it_has_read(tmp_path):
    # orbax's own trees are read a value at a time and the reader keeps each copy for later restores: verify lets
    # each go once checked (it kept every value, the whole checkpoint, before).
    from checkpoint._storage._orbax_native import OrbaxTreeReader

    path = str(tmp_path / "tree")
    with ocp.StandardCheckpointer() as c:
        c.save(path, {f"w{i}": np.full(3, float(i), np.float32) for i in range(4)})
    reader = OrbaxTreeReader(path)
    assert reader.stored_together(reader.keys()) == [["w0"], ["w1"], ["w2"], ["w3"]]
    held = [len(reader._cache) for _ in _verify._values(reader)]
    assert held == [1, 1, 1, 1] and reader._cache == {}
    assert reader.get("w2").tolist() == [2.0, 2.0, 2.0]  # still readable: it reads again
