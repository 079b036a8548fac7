"""TensorBundle reader and writer against TF-written fixtures (tests/data/make_tf_checkpoint_fixtures.py)."""

import json
import os
import shutil

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from google.protobuf import text_format

import checkpoint
import varstate
from checkpoint import CheckpointFormatError
from checkpoint._storage import write_bundle
from checkpoint._storage._bundle import GRAPH_KEY, BundleReader, slice_key
from checkpoint._storage._crc import crc32c, mask
from checkpoint._storage._table import _block, _entries, read_table, write_table
from checkpoint.protos import tensor_bundle_pb2

DATA = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(__file__))), "data", "tf_checkpoints")
with open(os.path.join(DATA, "expected.json")) as _f:
    EXPECTED = json.load(_f)
PREFIXES = {
    "tf_object": "tf_object/ckpt-1", "tf_name": "tf_name/model.ckpt-2", "tf_sharded": "tf_sharded/ckpt",
    "ours_bundle": "ours_bundle/ckpt-1", "ours_bundle_tf_resaved": "ours_bundle_tf_resaved/ckpt",
    "ours_checkpoint": "ours_checkpoint/ckpt-1", "ours_checkpoint_tf_resaved": "ours_checkpoint_tf_resaved/ckpt",
    "tf_low_precision": "tf_low_precision/ckpt", "ours_low_precision": "ours_low_precision/ckpt-1",
}
NUMPY_DTYPE = {"bfloat16": ml_dtypes.bfloat16, "bool": np.bool_, "float8_e4m3fn": ml_dtypes.float8_e4m3fn,
               "float8_e5m2": ml_dtypes.float8_e5m2, "int4": ml_dtypes.int4, "uint4": ml_dtypes.uint4}


def _tf_value(entry: dict) -> np.ndarray:
    """What TF's reader returned, rebuilt from its raw bytes."""
    if "strings" in entry:
        values = [bytes.fromhex(s) for s in entry["strings"]]
        return np.array(values, dtype=object).reshape(entry["shape"])
    dtype = np.dtype(NUMPY_DTYPE.get(entry["dtype"], entry["dtype"]))
    return np.frombuffer(bytes.fromhex(entry["hex"]), dtype).reshape(entry["shape"])


def _reader(name: str) -> BundleReader:
    return BundleReader(os.path.join(DATA, PREFIXES[name]))


@pytest.mark.parametrize("name", sorted(PREFIXES))
def test_every_tensor_equals_what_tensorflow_read(name):
    reader = _reader(name)
    expected = EXPECTED[name]["tensors"]
    assert reader.keys() == sorted(expected)
    for key, entry in expected.items():
        want = _tf_value(entry)
        got = reader.get(key)
        assert reader.shape(key) == tuple(entry["shape"]) == got.shape, key
        assert reader.dtype(key) == want.dtype == got.dtype, key
        assert got.tobytes() == want.tobytes() if want.dtype != object else got.tolist() == want.tolist(), key


@pytest.mark.parametrize(
    "name", ["tf_object", "tf_sharded", "ours_bundle", "ours_checkpoint_tf_resaved", "tf_low_precision"])
def test_object_graph_equals_tensorflows_parse(name):
    graph = _reader(name).object_graph
    assert text_format.MessageToString(graph) == EXPECTED[name]["object_graph"]


def test_tf_object_covers_every_dtype_and_tf_layout():
    reader = _reader("tf_object")
    dtypes = {reader.dtype(k).name for k in reader.keys() if k.startswith("model/dtypes/")}
    assert dtypes == {
        "float16", "float32", "float64", "bfloat16", "int8", "int16", "int32", "int64", "uint8", "uint16",
        "uint32", "uint64", "bool", "complex64", "complex128", "object",
    }
    strings = reader.get("model/dtypes/string/.ATTRIBUTES/VARIABLE_VALUE").tolist()
    assert strings == [b"", b"a", b"x" * 200, "h\u00e9llo".encode(), b"nul\x00byte"]
    assert GRAPH_KEY not in reader.keys() and GRAPH_KEY not in reader
    assert "model/tied/.OPTIMIZER_SLOT/optimizer/m/.ATTRIBUTES/VARIABLE_VALUE" in reader  # reachable twice: once
    assert not any(k.startswith("model/dense/kernel/") for k in reader.keys())
    assert reader.get_slices("model/tied/.ATTRIBUTES/VARIABLE_VALUE") == []


def test_name_based_partitioned_variables_reassemble_and_list_their_slices():
    reader = _reader("tf_name")
    assert reader.object_graph is None
    for name, specs in EXPECTED["tf_name"]["slices"].items():
        full = tuple(int(d) for d in specs[0].split()[:-1])
        want = []
        for spec in specs:
            extents = [e.split(",") for e in spec.split()[-1].split(":")]
            want.append(tuple(slice(int(s), int(s) + int(n)) for s, n in extents))
        assert sorted(reader.get_slices(name), key=str) == sorted(want, key=str), name
        assert reader.shape(name) == full
        value = reader.get(name)
        tf_value = _tf_value(EXPECTED["tf_name"]["tensors"][name])
        np.testing.assert_array_equal(value, tf_value)
        for index in reader.get_slices(name):  # each slice is what its own entry holds
            assert value[index].shape == tuple(s.stop - s.start for s in index)


def test_slice_keys_are_tfs_ordered_code():
    # The example in TF_FORMAT.md: rows 3-4, all 3 columns of `emb`, written with explicit lengths.
    assert slice_key(b"emb", [(3, 2), (0, 3)]) == b"\x00emb\x00\x01\x01\x02\x83\x82\x80\x83"
    reader = _reader("tf_name")
    with open(os.path.join(DATA, PREFIXES["tf_name"]) + ".index", "rb") as f:
        items = dict(read_table(f.read(), "x"))
    for index in reader.get_slices("emb"):
        assert slice_key(b"emb", [(s.start, s.stop - s.start) for s in index]) in items
    # A full extent (length -1), big and negative numbers, and escaped bytes keep their order.
    keys = [slice_key(b"a\x00\xff", [(s, n)]) for s, n in [(0, -1), (0, 1), (63, 64), (64, 1 << 20), (1 << 62, 2)]]
    assert keys == sorted(keys) and len(set(keys)) == len(keys)
    assert slice_key(b"a\x00\xff", [(0, -1)]).startswith(b"\x00a\x00\xff\xff\x00\x00\x01\x01\x01\x80\x7f")


def test_several_data_shards():
    reader = _reader("tf_sharded")
    assert reader.num_shards == 3
    shards = {reader.entry(k).shard_id for k in reader.keys()}
    assert len(shards) > 1
    np.testing.assert_array_equal(reader.get("v2/.ATTRIBUTES/VARIABLE_VALUE"), np.arange(64, dtype=np.float32) * 3)


def _rewrite_ours_bundle(tmp_path):
    """Writes ours_bundle's values again and asserts both files are byte for byte the committed ones."""
    src = _reader("ours_bundle")
    tensors = {k: src.get(k) for k in src.keys()}
    tensors[GRAPH_KEY] = src.get(GRAPH_KEY).item()
    write_bundle(tmp_path / "ckpt-1", tensors)
    for suffix in (".index", ".data-00000-of-00001"):
        with open(os.path.join(DATA, PREFIXES["ours_bundle"]) + suffix, "rb") as a, open(
            str(tmp_path / "ckpt-1") + suffix, "rb"
        ) as b:
            assert a.read() == b.read(), suffix


def test_writer_reproduces_the_checkpoint_tensorflow_verified_byte_for_byte(tmp_path):
    # ours_bundle was restored by tf.train.Checkpoint (assert_consumed) and read by tf.train.load_checkpoint;
    # today's writer must still write exactly those bytes.
    _rewrite_ours_bundle(tmp_path)


@pytest.mark.parametrize("how", ["short writes", "no writev"])
def test_writes_cut_short_or_without_writev_still_write_those_bytes(tmp_path, monkeypatch, how):
    # A write may return having written part of what it was given (a signal arrived); the writer goes on from
    # there, mid-buffer. Where the platform has no writev, values are written one by one.
    from checkpoint._storage import _bundle_writer

    calls = []
    if how == "short writes":
        def at_most_1000_bytes(file, views):  # across the boundaries of the values it was given
            calls.append(len(views))
            return file.write(b"".join(bytes(v) for v in views[:40])[:1000])

        monkeypatch.setattr(_bundle_writer, "_writev", at_most_1000_bytes)
    else:
        monkeypatch.delattr(os, "writev")
    _rewrite_ours_bundle(tmp_path)
    assert how == "no writev" or max(calls) > 1  # several values were handed to one call


@pytest.mark.parametrize("ours", ["ours_bundle", "ours_checkpoint"])
def test_tensorflows_resave_of_ours_matches_key_by_key(ours):
    a, b = _reader(ours), _reader(ours + "_tf_resaved")
    assert a.keys() == b.keys()
    for key in a.keys():
        assert a.dtype(key) == b.dtype(key) and a.shape(key) == b.shape(key), key
        assert a.get(key).tolist() == b.get(key).tolist(), key
    for path, (dtype, value) in EXPECTED[ours]["restored_by_tf"].items():  # TF's variables after restore
        got = a.get(path + "/.ATTRIBUTES/VARIABLE_VALUE")
        if isinstance(value, list):
            assert got.tolist() == [bytes.fromhex(s) for s in value], path
        else:
            assert got.dtype.name == dtype and got.tobytes() == bytes.fromhex(value), path


def test_a_filesystem_without_fsync_still_saves_but_an_io_error_fails(tmp_path, monkeypatch):
    import errno

    def no_fsync(code):
        def fsync(fd):
            raise OSError(code, os.strerror(code))
        return fsync

    monkeypatch.setattr(os, "fsync", no_fsync(errno.EINVAL))  # some FUSE and network mounts
    write_bundle(tmp_path / "ok", {"a": np.arange(3.0)})
    assert BundleReader(tmp_path / "ok").get("a").tolist() == [0.0, 1.0, 2.0]
    # The `checkpoint` state file is synced the same way: saves and the manager work there too.
    w = varstate.Variable(jnp.arange(3.0))
    saved = checkpoint.Checkpoint(w=w).save(str(tmp_path / "tf" / "ckpt"), format="tf")
    assert checkpoint.latest_checkpoint(str(tmp_path / "tf")) == saved
    manager = checkpoint.CheckpointManager(str(tmp_path / "managed"))
    assert manager.save(1, w=w) == checkpoint.latest_checkpoint(str(tmp_path / "managed"))
    monkeypatch.setattr(os, "fsync", no_fsync(errno.EIO))
    with pytest.raises(OSError, match="Input/output error"):
        write_bundle(tmp_path / "bad", {"a": np.arange(3.0)})
    assert not [p for p in os.listdir(tmp_path) if p.startswith("bad")]  # nothing half-written is left


LOW_PRECISION = {  # the values of tests/data/make_tf_checkpoint_fixtures.py
    "float8_e4m3fn": [[1.0, -2.0, 3.0], [0.5, -1.0, 448.0]], "float8_e5m2": [[1.0, -2.0, 3.0], [0.5, -1.0, 57344.0]],
    "int4": [[1, -2, 3], [-8, 7, 0]], "uint4": [[1, 2, 3], [0, 15, 7]],
}


@pytest.mark.parametrize("fmt", ["orbax", "tf"])
def test_float8_and_int4_variables_from_tensorflow_restore_and_save_again(tmp_path, fmt):
    # TF 2.21 wrote tf_low_precision; the same values, written by us, TF restored (restored_by_tf).
    template = {name: varstate.Variable(jnp.zeros((2, 3), NUMPY_DTYPE[name]), name=name) for name in LOW_PRECISION}
    got = checkpoint.Checkpoint(model=template).restore(os.path.join(DATA, PREFIXES["tf_low_precision"]))
    model = got.expect_partial().model
    for name, values in LOW_PRECISION.items():
        want = np.array(values).astype(NUMPY_DTYPE[name])
        assert model[name].dtype == want.dtype and np.asarray(model[name].value).tobytes() == want.tobytes(), name
        dtype, hexed = EXPECTED["ours_low_precision"]["restored_by_tf"][f"model/{name}"]
        assert (dtype, hexed) == (name, want.tobytes().hex()), name
    path = checkpoint.Checkpoint(model=model).write(str(tmp_path / "again"), format=fmt)
    again = checkpoint.Checkpoint(model=template).restore(path).model
    assert all(np.asarray(again[n].value).tobytes() == np.asarray(model[n].value).tobytes() for n in LOW_PRECISION)


def test_large_uint4_values_survive_orbax_which_has_no_uint4(tmp_path):
    # tensorstore (under orbax) lacks uint4: large ones are stored as uint8 and narrowed back, also onto a mesh.
    values = (np.arange(3_000_000) % 16).astype(ml_dtypes.uint4)
    path = checkpoint.Checkpoint(w=varstate.Variable(jnp.asarray(values))).write(str(tmp_path / "c"))
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("x",))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("x"))
    template = varstate.uninitialized(values.shape, ml_dtypes.uint4, sharding=sharding)
    got = checkpoint.Checkpoint(w=template).restore(path).assert_consumed().w
    assert got.dtype == ml_dtypes.uint4 and got.sharding == sharding
    assert np.asarray(got.value).tobytes() == values.tobytes()
    assert checkpoint.read_checkpoint(path).get("w/.ATTRIBUTES/VARIABLE_VALUE").tobytes() == values.tobytes()


def test_round_trip_of_every_dtype_and_layout(tmp_path):
    rng = np.random.default_rng(0)
    tensors = {
        "f32": rng.normal(size=(3, 4)).astype(np.float32),
        "bf16": rng.normal(size=5).astype(ml_dtypes.bfloat16),
        "c128": (rng.normal(size=2) + 1j).astype(np.complex128),
        "bool": np.array([True, False, True]),
        "u64": np.array([0, 2**64 - 1], np.uint64),
        "i8": np.array(-3, np.int8),
        "empty": np.zeros((0, 7), np.float16),
        "big_endian": np.arange(6, dtype=">i4").reshape(2, 3),
        "strided": np.arange(20.0).reshape(4, 5)[:, ::2],
        "jax": jnp.arange(4, dtype=jnp.int32),
        "bytes": b"\x00\xff graph",
        "str": "h\u00e9llo",
        "object": np.array([[b"a", "b\u00e9"], [b"", b"x" * 300]], dtype=object),
        "fixed_bytes": np.array([b"ab", b"c"]),
        "unicode": np.array(["\u00e9", "zz"]),
        "no_strings": np.array([], dtype=object),
    }
    write_bundle(tmp_path / "ckpt", tensors)
    reader = BundleReader(tmp_path / "ckpt")
    assert reader.keys() == sorted(tensors)
    for key, value in tensors.items():
        got = reader.get(key)
        if isinstance(value, (bytes, str)) or np.asarray(value).dtype.kind in "OSU":
            encode = lambda s: s.encode() if isinstance(s, str) else s
            want = np.vectorize(encode, otypes=[object])(np.asarray(value, dtype=object))
            assert got.dtype == object and got.shape == want.shape and got.tolist() == want.tolist(), key
        else:
            want = np.asarray(value)
            assert got.dtype == want.dtype.newbyteorder("=") and got.shape == want.shape, key
            np.testing.assert_array_equal(got, want)
            assert got.flags.writeable and got.flags.c_contiguous


def test_write_is_atomic(tmp_path, monkeypatch):
    prefix = tmp_path / "ckpt"
    with pytest.raises(TypeError, match=r"write_bundle: key 'z' has dtype datetime64\[s\], which a TF checkpoint "
                       r"cannot hold \(supported: \[.*bfloat16.*\], strings\)\."):
        write_bundle(prefix, {"a": np.ones(3), "z": np.array(["2020-01-01"], "datetime64[s]")})
    assert os.listdir(tmp_path) == []  # nothing half-written, no temporary left
    renamed = []
    real_replace = os.replace

    def replace(src, dst):
        renamed.append(os.path.basename(dst))
        if dst.endswith(".index"):
            raise OSError("disk full")  # a crash between the two renames
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(OSError, match="disk full"):
        write_bundle(prefix, {"a": np.ones(3)})
    assert renamed == ["ckpt.data-00000-of-00001", "ckpt.index"]  # data first, then the index
    assert sorted(os.listdir(tmp_path)) == ["ckpt.data-00000-of-00001"]  # no index: not a readable checkpoint
    with pytest.raises(FileNotFoundError):
        BundleReader(prefix)


def test_both_files_reach_the_disk_before_they_are_renamed_into_place(tmp_path, monkeypatch):
    events = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        events.append(("fsync", os.path.basename(os.readlink(f"/proc/self/fd/{fd}"))))
        real_fsync(fd)

    def replace(src, dst):
        events.append(("rename", os.path.basename(dst)))
        real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    write_bundle(tmp_path / "ckpt", {"a": np.arange(3.0)})
    synced = [name.split(".tempstate")[0] for kind, name in events[:2]]
    assert [kind for kind, _ in events] == ["fsync", "fsync", "rename", "rename", "fsync"]
    assert synced == ["ckpt.data-00000-of-00001", "ckpt.index"]
    assert events[2:] == [("rename", "ckpt.data-00000-of-00001"), ("rename", "ckpt.index"),
                          ("fsync", tmp_path.name)]  # the directory: the renames are durable too
    assert BundleReader(tmp_path / "ckpt").get("a").tolist() == [0.0, 1.0, 2.0]


@pytest.mark.parametrize(
    "tensors, error, message",
    [
        ({"": np.ones(1)}, ValueError, r"write_bundle: keys must be non-empty str, got ''\."),
        ({3: np.ones(1)}, ValueError, r"write_bundle: keys must be non-empty str, got 3\."),
        ({"\x00a": np.ones(1)}, ValueError, r"key '\\x00a' starts with a NUL byte, reserved for slice keys"),
        ({"s": np.array([b"a", 3], dtype=object)}, TypeError,
         r"write_bundle: key 's' holds int, expected bytes or str elements\."),
        ({"c": np.array([1], np.clongdouble)}, TypeError, r"key 'c' has dtype complex256, which a TF checkpoint"),
    ],
)
def test_writer_errors(tmp_path, tensors, error, message):
    with pytest.raises(error, match=message):
        write_bundle(tmp_path / "ckpt", tensors)


# --- bad input: bundles built by hand around one bad field ------------------------------------------


def _bundle(tmp_path, entries, data=b"", header=None, num_files=1, slices=()):
    """Writes prefix.index from raw entry protos (and extra raw slice entries) and the data shards."""
    header = header or tensor_bundle_pb2.BundleHeaderProto(num_shards=num_files, version={"producer": 1})
    items = [(b"", header.SerializeToString())]
    items += [(k, v) for k, v in slices]
    items += [(k.encode(), e.SerializeToString()) for k, e in entries.items()]
    prefix = str(tmp_path / "bad")
    with open(prefix + ".index", "wb") as f:
        f.write(write_table(sorted(items)))
    for i in range(num_files):
        with open(f"{prefix}.data-{i:05d}-of-{header.num_shards:05d}", "wb") as f:
            f.write(data)
    return prefix


def _entry(dtype=1, shape=(2,), offset=0, size=8, crc=None, data=b"\0" * 8, shard=0):
    e = tensor_bundle_pb2.BundleEntryProto(dtype=dtype, offset=offset, size=size, shard_id=shard)
    e.crc32c = mask(crc32c(data[offset : offset + size])) if crc is None else crc
    for d in shape:
        e.shape.dim.add(size=d)
    return e


@pytest.mark.parametrize(
    "entry, message",
    [
        (_entry(size=1 << 40), r"bad\.data-00000-of-00001: key 'w': value at offset 0 with 1099511627776 bytes "
         r"runs past the end of the file \(8 bytes\): the file is truncated or the index is corrupt"),
        (_entry(offset=4), r"key 'w': value at offset 4 with 8 bytes runs past the end of the file"),
        (_entry(offset=-1), r"key 'w': value at offset -1"),
        (_entry(shape=(1 << 40,)), r"key 'w': stored size 8 bytes, expected 4398046511104 for shape "
         r"\(1099511627776,\) of float32"),
        (_entry(crc=123), r"bad\.data-00000-of-00001: key 'w': checksum mismatch \(the data file is corrupt\)"),
        (_entry(dtype=21), r"bad\.index: key 'w' has DT_VARIANT \(21\), which this reader does not support "
         r"\(supported: \["),
        (_entry(dtype=99), r"key 'w' has an unknown dtype \(99\), which this reader does not support"),
        (_entry(shape=(-1,)), r"bad\.index: key 'w' has an invalid shape \(-1,\)"),
        (_entry(shape=(0, 1 << 62), size=0), r"key 'w' has an invalid shape \(0, 4611686018427387904\)"),  # fuzz
        (_entry(shape=(1,) * 65), r"key 'w' has an invalid shape \(1, 1,"),
        (_entry(shard=3), r"bad\.index: key 'w' is in shard 3, but the bundle has 1"),
        (_entry(dtype=7, shape=(9,)), r"key 'w': 8 bytes cannot hold 9 strings"),
        (_entry(dtype=7, shape=(), size=6), r"key 'w': checksum mismatch in the string lengths \(the data file is"),
    ],
)
def test_bad_entries_name_file_and_key(tmp_path, entry, message):
    prefix = _bundle(tmp_path, {"w": entry}, data=b"\0" * 8)
    with pytest.raises(CheckpointFormatError, match=message):
        reader = BundleReader(prefix)
        reader.shape("w")
        reader.dtype("w")
        reader.get("w")


def test_string_tensor_with_bad_lengths_wrong_total_size_or_value_crc(tmp_path):
    prefix = _bundle(tmp_path, {"w": _entry(dtype=7, shape=(2,))}, data=b"\xff" * 8)  # varints never end
    with pytest.raises(CheckpointFormatError, match=r"bad\.data-00000-of-00001: key 'w': bad string length"):
        BundleReader(prefix).get("w")
    for huge in (b"\x80" * 9 + b"\x7f", b"\xff\xff\xff\xff\x0f"):  # 2**69-ish (found by fuzzing), 4 GiB
        prefix = _bundle(tmp_path, {"w": _entry(dtype=7, shape=(), size=len(huge) + 4)}, data=huge + bytes(8))
        with pytest.raises(CheckpointFormatError, match=r"key 'w': bad string length"):
            BundleReader(prefix).get("w")
    lengths_crc = mask(crc32c(b"\x02\x00\x00\x00"))
    raw = b"\x02" + lengths_crc.to_bytes(4, "little") + b"ab"
    good_crc = mask(crc32c(b"ab", crc32c(raw[1:5], crc32c(b"\x02\x00\x00\x00"))))
    prefix = _bundle(tmp_path, {"w": _entry(dtype=7, shape=(), size=7, crc=good_crc)}, data=raw + b"!")
    assert BundleReader(prefix).get("w").item() == b"ab"
    prefix = _bundle(tmp_path, {"w": _entry(dtype=7, shape=(), size=8, crc=good_crc)}, data=raw + b"!")
    with pytest.raises(CheckpointFormatError, match=r"key 'w': string lengths add up to 2 bytes, but 3 are stored"):
        BundleReader(prefix).get("w")
    prefix = _bundle(tmp_path, {"w": _entry(dtype=7, shape=(), size=7, crc=good_crc ^ 1)}, data=raw)
    with pytest.raises(CheckpointFormatError, match=r"key 'w': checksum mismatch \(the data file is corrupt\)"):
        BundleReader(prefix).get("w")


def test_header_checks(tmp_path):
    def header(**kw):
        return tensor_bundle_pb2.BundleHeaderProto(**kw)

    for h, message in [
        (header(num_shards=1, version={"producer": 1, "min_consumer": 2}),
         r"bad\.index: bundle version 1 \(min consumer 2, bad consumers \[\]\) cannot be read by this reader "
         r"\(version 1\)"),
        (header(num_shards=1, version={"producer": 1, "bad_consumers": [1]}), r"bad consumers \[1\]\)"),
        (header(num_shards=0, version={"producer": 1}), r"bad\.index: header claims 0 data shards"),
        (header(num_shards=1, endianness=7, version={"producer": 1}), r"bad\.index: header has an unknown endianness"),
    ]:
        prefix = _bundle(tmp_path, {"w": _entry()}, data=bytes(8), header=h, num_files=0)
        with pytest.raises(CheckpointFormatError, match=message):
            BundleReader(prefix)
    prefix = str(tmp_path / "nohdr")
    with open(prefix + ".index", "wb") as f:
        f.write(write_table([(b"w", _entry().SerializeToString())]))
    with pytest.raises(CheckpointFormatError, match=r"nohdr\.index: no bundle header \(the entry under the empty key"):
        BundleReader(prefix)
    with open(prefix + ".index", "wb") as f:
        f.write(write_table([(b"", b"\xff\xff\xff")]))
    with pytest.raises(CheckpointFormatError, match=r"nohdr\.index: the header is not a valid BundleHeaderProto"):
        BundleReader(prefix)
    with open(prefix + ".index", "wb") as f:
        f.write(write_table([(b"", b"\x08\x01"), (b"w", b"\x0a\xff")]))  # num_shards=1; a truncated field
    with pytest.raises(CheckpointFormatError, match=r"nohdr\.index: key 'w' is not a valid BundleEntryProto"):
        BundleReader(prefix)


def test_big_endian_bundles_are_byte_swapped(tmp_path):
    value = np.array([[1.5, -2.0], [3.25, 1e30]], ">f4")
    cvalue = np.array([1 + 2j], ">c8")
    data = value.tobytes() + cvalue.tobytes()
    header = tensor_bundle_pb2.BundleHeaderProto(num_shards=1, endianness=1, version={"producer": 1})
    entries = {"w": _entry(shape=(2, 2), size=16, data=data), "c": _entry(dtype=8, shape=(1,), offset=16, data=data)}
    reader = BundleReader(_bundle(tmp_path, entries, data=data, header=header))
    np.testing.assert_array_equal(reader.get("w"), value)
    np.testing.assert_array_equal(reader.get("c"), cvalue)
    assert reader.get("w").dtype == np.float32


def test_missing_shard_and_missing_key(tmp_path):
    prefix = _bundle(tmp_path, {"w": _entry(shard=1)}, data=bytes(8), num_files=1,
                     header=tensor_bundle_pb2.BundleHeaderProto(num_shards=2, version={"producer": 1}))
    with pytest.raises(CheckpointFormatError, match=r"bad\.data-00001-of-00002: data shard missing \(needed for key "
                       r"'w' of .*bad\.index\); copy every bad\.data-\* file with the \.index"):
        BundleReader(prefix).get("w")
    with pytest.raises(KeyError, match=r"Key 'nope' not found in checkpoint .*bad \(1 keys; list them with "):
        BundleReader(prefix).get("nope")
    shutil.copytree(os.path.join(DATA, "tf_sharded"), tmp_path / "sharded")
    os.remove(tmp_path / "sharded" / "ckpt.data-00001-of-00003")
    reader = BundleReader(tmp_path / "sharded" / "ckpt")
    missing = [k for k in reader.keys() if reader.entry(k).shard_id == 1]
    with pytest.raises(CheckpointFormatError, match=r"ckpt\.data-00001-of-00003: data shard missing \(needed for key"):
        reader.get(missing[0])


def _sliced(tmp_path, extents, full=(4,), slice_entries=None, data=None):
    """A name-based bundle: full entry `w` with `extents` [(start, length)], each slice 4 bytes a row."""
    full_entry = tensor_bundle_pb2.BundleEntryProto(dtype=1)
    for d in full:
        full_entry.shape.dim.add(size=d)
    data = np.arange(16, dtype=np.float32).tobytes() if data is None else data
    slices = []
    offset = 0
    for start, length in extents:
        s = full_entry.slices.add()
        s.extent.add(start=start, length=length)
        n = 4 * length
        e = _entry(shape=(length,), offset=offset, size=n, data=data)
        slices.append((slice_key(b"w", [(start, length)]), e.SerializeToString()))
        offset += n
    return _bundle(tmp_path, {"w": full_entry}, data=data, slices=slice_entries or slices)


def test_sliced_entries_reassemble_and_bad_slices_are_refused(tmp_path):
    reader = BundleReader(_sliced(tmp_path, [(2, 2), (0, 2)]))
    np.testing.assert_array_equal(reader.get("w"), np.array([2, 3, 0, 1], np.float32))
    assert reader.get_slices("w") == [(slice(2, 4),), (slice(0, 2),)]
    for extents, message in [
        ([(0, 2), (1, 2)], r"the saved slices of key 'w' overlap or do not cover its shape \(4,\)"),
        ([(0, 2)], r"the saved slices of key 'w' overlap or do not cover its shape \(4,\)"),
        ([(3, 2)], r"key 'w' has a slice \(start 3, length 2\) outside its shape \(4,\)"),
    ]:
        with pytest.raises(CheckpointFormatError, match=message):
            BundleReader(_sliced(tmp_path, extents)).get("w")
    with pytest.raises(CheckpointFormatError, match=r"the entry of slice \[\(0, 4\)\] of key 'w' is missing"):
        BundleReader(_sliced(tmp_path, [(0, 4)], slice_entries=[(b"\x00other", b"")])).get("w")
    shared = [(slice_key(b"w", [(i, 1)]), _entry(shape=(1,), size=4, data=bytes(4)).SerializeToString())
              for i in range(4)]  # every slice of `w` pointing at the same 4 bytes
    with pytest.raises(CheckpointFormatError, match=r"the slices of key 'w' claim 16 bytes, but their data files hold"):
        BundleReader(_sliced(tmp_path, [(0, 1), (1, 1), (2, 1), (3, 1)], slice_entries=shared, data=bytes(4))).get("w")
    # A full tensor "of a terabyte" made of slices: refused before anything is allocated.
    with pytest.raises(CheckpointFormatError, match=r"overlap or do not cover its shape \(1099511627776,\)"):
        BundleReader(_sliced(tmp_path, [(0, 2)], full=(1 << 40,))).get("w")


def test_truncated_tf_files_name_the_file_and_key(tmp_path):
    directory = shutil.copytree(os.path.join(DATA, "tf_object"), tmp_path / "t")
    data = os.path.join(directory, "ckpt-1.data-00000-of-00001")
    reader = BundleReader(os.path.join(directory, "ckpt-1"))
    last = max(reader.keys(), key=lambda k: reader.entry(k).offset)
    end = reader.entry(last).offset + reader.entry(last).size
    os.truncate(data, end - 1)
    reader = BundleReader(os.path.join(directory, "ckpt-1"))
    with pytest.raises(CheckpointFormatError, match=rf"ckpt-1\.data-00000-of-00001: key '{last}': value at offset "
                       rf"\d+ with \d+ bytes runs past the end of the file \({end - 1} bytes\)"):
        reader.get(last)
    first = min(reader.keys(), key=lambda k: reader.entry(k).offset)
    assert reader.get(first).tobytes() == _tf_value(EXPECTED["tf_object"]["tensors"][first]).tobytes()
    index = os.path.join(directory, "ckpt-1.index")
    os.truncate(index, os.path.getsize(index) - 1)
    with pytest.raises(CheckpointFormatError, match=r"ckpt-1\.index: not a checkpoint index \(bad magic number"):
        BundleReader(os.path.join(directory, "ckpt-1"))


def test_a_two_block_index_that_tensorflow_read_is_still_what_we_write(tmp_path):
    # ours_many: 5,000 keys, index cut into two data blocks; TF read every key (expected.json).
    assert EXPECTED["ours_many"] == {"keys_read_by_tf": 5000, "every_value_matched_its_key": True}
    prefix = os.path.join(DATA, "ours_many", "many")
    with open(prefix + ".index", "rb") as f:
        index = f.read()
    footer = index[-48:]
    handles, pos = [], 0
    while len(handles) < 4:
        value = shift = 0
        while footer[pos] & 0x80:
            value |= (footer[pos] & 0x7F) << shift
            pos, shift = pos + 1, shift + 7
        handles.append(value | footer[pos] << shift)
        pos += 1
    index_block = _entries(index, *_block(index, handles[2:], len(index) - 48, "index"), "index")
    assert len(index_block) == 2  # two data blocks
    reader = BundleReader(prefix)
    tensors = {k: reader.get(k) for k in reader.keys()}
    assert len(tensors) == 5000 and all(int(k.rsplit("/v", 1)[1]) == v for k, v in tensors.items())
    write_bundle(tmp_path / "many", tensors)
    with open(str(tmp_path / "many") + ".index", "rb") as f:
        assert f.read() == index


def test_small_values_stored_back_to_back_are_read_in_one_pread_and_checked_each(tmp_path, monkeypatch):
    # Values of odd sizes and mixed dtypes, so most start off a 64-byte boundary inside the shared read.
    rng = np.random.default_rng(0)
    values = {f"v{i:02d}": rng.standard_normal(i + 1).astype(dtype)
              for i, dtype in enumerate([np.float32, np.int16, np.int8, np.complex64, np.float16] * 8)}
    values["flag"] = np.array([True, False, True])
    prefix = str(tmp_path / "ckpt")
    write_bundle(prefix, values)
    reader = BundleReader(prefix)
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    reads = []
    real = os.preadv
    monkeypatch.setattr(os, "preadv", lambda fd, bufs, offset: reads.append(offset) or real(fd, bufs, offset))
    got = reader.get_many({k: one for k in values})
    assert len(reads) == 1  # 41 values, under 2 KB: one group, stored back to back
    for k, v in values.items():
        assert isinstance(got[k], jax.Array) and got[k].dtype == v.dtype
        np.testing.assert_array_equal(np.asarray(got[k]), v)
    # A flipped byte in one value of the run is caught as that value's, and nothing is returned.
    entry = reader.entry("v17")
    with open(prefix + ".data-00000-of-00001", "r+b") as f:
        f.seek(entry.offset + 1)
        byte = f.read(1)
        f.seek(entry.offset + 1)
        f.write(bytes([byte[0] ^ 0x10]))
    with pytest.raises(CheckpointFormatError, match=r"data-00000-of-00001: key 'v17': checksum mismatch \(the data "
                                                   r"file is corrupt\); copy it again from its source$"):
        BundleReader(prefix).get_many({k: one for k in values})
