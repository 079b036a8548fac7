"""Bounded work and bounded reads for files from someone else, in both formats.

- tens of thousands of slices of one tensor are read in linear time (they were quadratic: minutes);
- the slice-tiling check is exact (against painting every element) and bounded for any layout;
- the state file and every data file must be regular files, and data files may not link out of their directory.
"""

import itertools
import json
import os
import shutil
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import checkpoint
from checkpoint import CheckpointFormatError, DataLossError, _keys
from checkpoint._storage import BundleReader, Sliced, _orbax, _state_file, read_checkpoint_state, write_bundle
from checkpoint._storage._bundle import slice_key
from checkpoint._storage._crc import crc32c, mask
from checkpoint._storage._table import write_table
from checkpoint.protos import tensor_bundle_pb2, tensor_shape_pb2
from checkpoint.protos.trackable_object_graph_pb2 import TrackableObjectGraph
from varstate import SaveSliceInfo

MANY = 30_000
BOUND_S = 10.0  # for a loaded CI machine: the slowest, TF get of 30,000 slices, takes 1.6 s unloaded (2 cores)
DATA = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(__file__))), "data", "tf_checkpoints")


def _timed(what, fn, *args):
    start = time.perf_counter()
    out = fn(*args)
    took = time.perf_counter() - start
    print(f"{what}: {took:.3f} s")
    assert took < BOUND_S, (what, took)
    return out


def _parts():
    return [((i, 0), np.full((1, 3), i, np.float32)) for i in range(MANY)]


def _want():
    return np.repeat(np.arange(MANY, dtype=np.float32)[:, None], 3, axis=1)


def test_30000_slices_of_one_tensor_in_a_tf_index_read_in_linear_time(tmp_path):
    prefix = str(tmp_path / "c")
    write_bundle(prefix, {"x": Sliced((MANY, 3), _parts())})
    print(f"index: {os.path.getsize(prefix + '.index')} bytes")
    reader = _timed("TF open (30,000 slices)", BundleReader, prefix)
    got = _timed("TF get (30,000 slices: checked, read, assembled)", reader.get, "x")
    assert np.array_equal(got, _want())
    assert len(_timed("TF get_slices", reader.get_slices, "x")) == MANY


def test_30000_slices_of_one_tensor_in_orbax_metadata_read_in_linear_time(tmp_path):
    values = {"x": [(SaveSliceInfo("x", (MANY, 3), offset, part.shape), part) for offset, part in _parts()]}
    tree, meta = _orbax.layout(values, TrackableObjectGraph())
    path = str(tmp_path / "c")
    saver = _orbax.checkpointer()
    saver.save(path, args=_orbax.save_args(tree, meta))
    saver.close()
    print(f"metadata: {os.path.getsize(os.path.join(path, _orbax.META_FILE))} bytes")
    reader = _timed("orbax open (30,000 slices: checksum and every slice checked)", _orbax.OrbaxReader, path)
    assert np.array_equal(_timed("orbax get (30,000 slices)", reader.get, "x"), _want())


def _grid(g):
    return [[(i, 1), (j, 1)] for i in range(g) for j in range(g)]


def _bricks(rows, per_row, width):
    # Each row of bricks shifted by its own offset: no two rows share a boundary (the sweep's worst case).
    boxes = []
    for r in range(rows):
        cuts = sorted({0, width * (per_row + 1), *(r % width + k * width for k in range(1, per_row + 1))})
        boxes += [[(r, 1), (a, b - a)] for a, b in itertools.pairwise(cuts)]
    return (rows, width * (per_row + 1)), boxes


def test_the_tiling_check_is_bounded_for_layouts_that_were_slow():
    # 173 x 173 took 3 s and the bricks 38 s with the sweep this replaces; each is linear now.
    assert _timed("tiling check: a 173 x 173 grid", _keys.covers_exactly, (173, 173), _grid(173))
    shape, bricks = _bricks(1000, 30, 1000)
    assert len(bricks) > MANY
    assert _timed("tiling check: 31,000 staggered bricks", _keys.covers_exactly, shape, bricks)
    cube = [[(i >> a & 1, 1) for a in range(15)] for i in range(1 << 15)]  # 2**15 corners each: painted instead
    assert _timed("tiling check: 32,768 cells of 15 dimensions", _keys.covers_exactly, (2,) * 15, cube)
    assert not _keys.covers_exactly((2,) * 15, [cube[2], *cube[1:]])  # one twice, one missing: the volume matches


def _paint_count(shape, boxes):
    counts = np.zeros(shape, np.int64)
    for box in boxes:
        if len(box) != len(shape) or any(o < 0 or n < 0 or o + n > d for (o, n), d in zip(box, shape, strict=True)):
            return False
        counts[tuple(slice(o, o + n) for o, n in box)] += 1
    return bool((counts == 1).all())


_boxes = st.integers(1, 3).flatmap(lambda rank: st.tuples(
    st.lists(st.integers(0, 4), min_size=rank, max_size=rank),
    st.lists(st.lists(st.tuples(st.integers(-1, 4), st.integers(-1, 4)), min_size=rank, max_size=rank), max_size=8),
))


def _tilings(draw_shape, cuts):
    """Boxes that tile `draw_shape` (a grid of cuts per dimension, with neighbouring cells merged at random)."""
    grids = [sorted({0, d, *(c % (d + 1) for c in cut)}) for d, cut in zip(draw_shape, cuts, strict=True)]
    return [[(a, b - a) for a, b in cell] for cell in _cells(grids)]


def _cells(grids):
    if not grids:
        return [[]]
    return [[pair, *rest] for pair in zip(grids[0], grids[0][1:], strict=False) for rest in _cells(grids[1:])]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)
@given(_boxes, st.booleans())
def test_the_tiling_check_agrees_with_painting_every_element(case, painted):
    shape, boxes = case
    boxes = [[tuple(p) for p in b] for b in boxes]
    budget = _keys._CORNER_BUDGET
    _keys._CORNER_BUDGET = 0 if painted else budget  # both methods: corners, and the painted grid
    try:
        assert _keys.covers_exactly(shape, boxes) == _paint_count(shape, boxes), (shape, boxes)
    finally:
        _keys._CORNER_BUDGET = budget


@settings(max_examples=200, deadline=None, derandomize=True)
@given(st.lists(st.integers(1, 5), min_size=1, max_size=3), st.data(), st.booleans())
def test_tilings_are_recognised_and_any_change_to_one_is_not(shape, data, painted):
    cuts = [data.draw(st.lists(st.integers(0, 5), max_size=3)) for _ in shape]
    boxes = _tilings(shape, cuts)
    budget = _keys._CORNER_BUDGET
    _keys._CORNER_BUDGET = 0 if painted else budget
    try:
        assert _keys.covers_exactly(shape, boxes) and _paint_count(shape, boxes)
        i = data.draw(st.integers(0, len(boxes) - 1))
        a = data.draw(st.integers(0, len(shape) - 1))
        o, n = boxes[i][a]
        for changed in ((o, n + 1), (o - 1, n), (o + 1, n), (o, n - 1)):  # grown, moved or shrunk: no tiling
            moved = [list(b) for b in boxes]
            moved[i][a] = changed
            assert not _keys.covers_exactly(shape, moved) and not _paint_count(shape, moved), moved
        assert not _keys.covers_exactly(shape, [*boxes, boxes[i]])  # one twice
        if len(boxes) > 1:  # one twice in place of another (the volumes may well still add up)
            j = (i + 1) % len(boxes)
            assert not _keys.covers_exactly(shape, [boxes[i] if k == j else b for k, b in enumerate(boxes)])
    finally:
        _keys._CORNER_BUDGET = budget


def test_layouts_too_fragmented_to_check_are_refused_in_both_formats(tmp_path, monkeypatch):
    monkeypatch.setattr(_keys, "_CORNER_BUDGET", 0)
    monkeypatch.setattr(_keys, "_CELL_BUDGET", 8)
    with pytest.raises(ValueError, match=r"^9 slices cut 2 dimensions into 9 pieces, more than the 8 this reader "
                                         r"checks: too fragmented for a partitioned variable$"):
        _keys.covers_exactly((3, 3), _grid(3))
    parts = [((i, j), np.full((1, 1), 3 * i + j, np.float32)) for i in range(3) for j in range(3)]
    monkeypatch.setattr(_keys, "_CELL_BUDGET", 1 << 24)
    write_bundle(str(tmp_path / "c"), {"x": Sliced((3, 3), parts)})
    values = {"x": [(SaveSliceInfo("x", (3, 3), o, p.shape), p) for o, p in parts]}
    tree, meta = _orbax.layout(values, TrackableObjectGraph())
    saver = _orbax.checkpointer()
    saver.save(str(tmp_path / "o"), args=_orbax.save_args(tree, meta))
    saver.close()
    monkeypatch.setattr(_keys, "_CELL_BUDGET", 8)
    with pytest.raises(CheckpointFormatError, match=rf"^{tmp_path}/c\.index: the saved slices of key 'x': 9 slices cut "
                                                    r"2 dimensions into 9 pieces, more than the 8 this reader checks: "
                                                    r"too fragmented for a partitioned variable$"):
        BundleReader(str(tmp_path / "c")).get("x")
    with pytest.raises(DataLossError, match=rf"^Checkpoint '{tmp_path}/o': meta/metadata is corrupted \(ValueError: "
                                            r"entry 'x': 9 slices cut 2 dimensions into 9 pieces, more than the 8 .*"):
        _orbax.OrbaxReader(str(tmp_path / "o"))


# --- the state file ----------------------------------------------------------------------------------------------
def _state_dir(tmp_path):
    directory = shutil.copytree(os.path.join(DATA, "tf_object"), tmp_path / "tf_object")
    state = os.path.join(directory, "checkpoint")
    os.remove(state)
    return directory, state


def test_a_state_file_linked_to_a_device_or_a_fifo_is_refused_not_read_forever(tmp_path):
    directory, state = _state_dir(tmp_path)
    os.symlink("/dev/zero", state)  # read until memory ran out
    for read in (checkpoint.read_checkpoint, read_checkpoint_state):
        with pytest.raises(CheckpointFormatError, match=rf"^{state}: the checkpoint state file is not a regular file "
                                                        r"\(it is a character device\); a checkpoint's files must be "
                                                        r"plain files$"):
            read(directory)
    os.remove(state)
    os.mkfifo(state)  # blocked forever
    with pytest.raises(CheckpointFormatError, match=rf"^{state}: the checkpoint state file is not a regular file "
                                                    r"\(it is a FIFO\); a checkpoint's files must be plain files$"):
        checkpoint.read_checkpoint(directory)


def test_a_state_file_is_read_up_to_a_bound(tmp_path, monkeypatch):
    directory, state = _state_dir(tmp_path)
    with open(state, "w") as f:
        f.write('model_checkpoint_path: "ckpt-1"\n' + " " * 200)
    assert checkpoint.read_checkpoint(directory).keys()  # whitespace is fine under the bound
    assert _state_file.STATE_FILE_LIMIT == 16 << 20
    monkeypatch.setattr(_state_file, "STATE_FILE_LIMIT", 100)
    with pytest.raises(CheckpointFormatError, match=rf"^{state}: the checkpoint state file is 232 bytes, more than the "
                                                    r"100 this reader accepts; it is not one this library wrote$"):
        checkpoint.read_checkpoint(directory)


# --- one symlink rule for both formats ---------------------------------------------------------------------------
def test_tf_files_linking_out_of_their_directory_are_refused_as_orbax_files_are(tmp_path):
    outside = shutil.copytree(os.path.join(DATA, "tf_object"), tmp_path / "outside")
    inside = tmp_path / "ckpts"
    inside.mkdir()
    os.symlink(outside / "ckpt-1.index", inside / "ckpt-1.index")
    with pytest.raises(CheckpointFormatError, match=rf"^{inside}/ckpt-1\.index: a symlink to {outside}/ckpt-1\.index, "
                                                    rf"outside the checkpoint's directory {inside}; a checkpoint may "
                                                    r"only use files in its own directory\. Copy the file into it "
                                                    r"instead of linking\.$"):
        checkpoint.read_checkpoint(str(inside / "ckpt-1"))
    os.remove(inside / "ckpt-1.index")
    shutil.copy(outside / "ckpt-1.index", inside / "ckpt-1.index")
    data = "ckpt-1.data-00000-of-00001"
    os.symlink(outside / data, inside / data)
    reader = checkpoint.read_checkpoint(str(inside / "ckpt-1"))  # the index reads; the data file is refused on use
    with pytest.raises(CheckpointFormatError, match=rf"^{inside}/{data}: a symlink to {outside}/{data}, outside the "
                                                    rf"checkpoint's directory {inside}; .*"):
        reader.get(reader.keys()[0])
    os.remove(inside / data)
    os.symlink("/dev/zero", inside / data)
    with pytest.raises(CheckpointFormatError, match=rf"^{inside}/{data}: a symlink to /dev/zero, outside .*"):
        checkpoint.read_checkpoint(str(inside / "ckpt-1")).get(reader.keys()[0])
    os.remove(inside / data)
    os.mkfifo(inside / data)
    with pytest.raises(CheckpointFormatError, match=rf"^{inside}/{data}: data shard 0 is not a regular file \(it is a "
                                                    r"FIFO\); a checkpoint's files must be plain files$"):
        checkpoint.read_checkpoint(str(inside / "ckpt-1")).get(reader.keys()[0])
    os.remove(inside / data)
    shutil.copy(outside / data, inside / "real-data")
    os.symlink("real-data", inside / data)  # links within the directory are followed
    os.remove(inside / "ckpt-1.index")
    os.symlink("sub/../ckpt-1.idx", inside / "ckpt-1.index")
    os.mkdir(inside / "sub")
    shutil.copy(outside / "ckpt-1.index", inside / "ckpt-1.idx")
    reader = checkpoint.read_checkpoint(str(inside / "ckpt-1"))
    want = BundleReader(str(outside / "ckpt-1"))
    assert all(np.array_equal(reader.get(k), want.get(k)) for k in want.keys())


def test_a_checkpoint_directory_reached_through_a_symlink_still_reads(tmp_path):
    # The rule is about files leaving the checkpoint, not about how the caller reaches it.
    real = shutil.copytree(os.path.join(DATA, "tf_object"), tmp_path / "real")
    os.symlink(real, tmp_path / "link", target_is_directory=True)
    assert checkpoint.read_checkpoint(str(tmp_path / "link" / "ckpt-1")).keys()
    path = checkpoint.Checkpoint(w=np.ones(3, np.float32)).write(str(tmp_path / "o" / "c"))
    os.symlink(path, tmp_path / "olink", target_is_directory=True)
    assert checkpoint.read_checkpoint(str(tmp_path / "olink")).get("w/.ATTRIBUTES/VARIABLE_VALUE").tolist() == [1] * 3


def test_orbax_metadata_naming_a_million_packs_or_missing_arrays_costs_little(tmp_path):
    path = checkpoint.Checkpoint(w=np.arange(3, dtype=np.float32)).write(str(tmp_path / "c"))
    meta_file = os.path.join(path, _orbax.META_FILE)
    with open(meta_file) as f:
        meta = json.load(f)
    # json.dumps, not json.dump: dump streams through json's pure-Python encoder (3 s for these files, 0.3 s).
    with open(meta_file, "w") as f:  # packs no value lies in are never read
        f.write(json.dumps(_orbax.seal(dict(meta, packs=meta["packs"] + [0] * 1_000_000))))
    reader = _timed("orbax open (1,000,000 unused packs)", _orbax.OrbaxReader, path)
    assert reader.get("w/.ATTRIBUTES/VARIABLE_VALUE").tolist() == [0.0, 1.0, 2.0]
    lies = {f"k{i}": {"dtype": "float32", "shape": [0], "array": f"a{i}", "crc32c": 0} for i in range(100_000)}
    with open(meta_file, "w") as f:  # arrays that are not there: the first batch of them fails
        f.write(json.dumps(_orbax.seal(dict(meta, entries={**meta["entries"], **lies}))))
    start = time.perf_counter()
    with pytest.raises(DataLossError, match=rf"^Checkpoint '{path}': cannot read stored values \('k0'\): NOT_FOUND: "
                                            r"Error opening \"zarr\" driver: Metadata at \"a0/\.zarray\" .* does not "
                                            r"exist.*\. The value files are damaged; restore an older checkpoint\.$"):
        _orbax.OrbaxReader(path)
    took = time.perf_counter() - start
    print(f"orbax open (100,000 arrays that are not there, refused): {took:.3f} s")
    assert took < BOUND_S


def _sliced_bundle(path, parts, endian="<", gap=0):
    """A bundle of one sliced float32 tensor `x` of shape (len(parts), 3); `gap` bytes between stored slices."""
    header = tensor_bundle_pb2.BundleHeaderProto(num_shards=1, endianness=0 if endian == "<" else 1,
                                                 version={"producer": 1})
    full = tensor_bundle_pb2.BundleEntryProto(dtype=1)
    full.shape.dim.extend([tensor_shape_pb2.TensorShapeProto.Dim(size=len(parts)),
                           tensor_shape_pb2.TensorShapeProto.Dim(size=3)])
    items, data = [(b"", header.SerializeToString()), (b"x", None)], b""
    for row, value in parts:
        raw = np.asarray(value, f"{endian}f4").tobytes()
        entry = tensor_bundle_pb2.BundleEntryProto(dtype=1, offset=len(data), size=len(raw),
                                                   crc32c=mask(crc32c(raw)))
        entry.shape.dim.extend([tensor_shape_pb2.TensorShapeProto.Dim(size=1),
                                tensor_shape_pb2.TensorShapeProto.Dim(size=3)])
        s = full.slices.add()
        s.extent.add(start=row, length=1)
        s.extent.add(start=0, length=3)
        items.append((slice_key(b"x", [(row, 1), (0, 3)]), entry.SerializeToString()))
        data += raw + bytes(gap)
    items[1] = (b"x", full.SerializeToString())
    with open(path + ".index", "wb") as f:
        f.write(write_table(sorted(items)))
    with open(path + ".data-00000-of-00001", "wb") as f:
        f.write(data)
    return path


@pytest.mark.parametrize("endian", ["<", ">"])
@pytest.mark.parametrize("gap", [0, 1 << 20], ids=["side-by-side", "scattered"])
def test_slices_read_together_are_each_checked_and_byte_swapped(tmp_path, endian, gap):
    # Side by side: one read for all slices; scattered: one read each. Either way every crc32c is checked.
    rows = [np.array([r, -r, r / 4], np.float32) for r in range(4)]
    prefix = _sliced_bundle(str(tmp_path / "c"), list(enumerate(rows))[::-1], endian, gap)  # stored last row first
    got = BundleReader(prefix).get("x")
    assert got.dtype == np.float32 and np.array_equal(got, np.stack(rows))
    data = prefix + ".data-00000-of-00001"
    with open(data, "r+b") as f:
        f.seek(2 * (12 + gap) + 5)  # in the third slice stored: row 1
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0x10]))
    with pytest.raises(CheckpointFormatError, match=rf"^{data}: key 'x': checksum mismatch \(the data file is "
                                                    r"corrupt\); copy it again from its source$"):
        BundleReader(prefix).get("x")
