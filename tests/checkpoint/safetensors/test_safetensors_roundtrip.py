"""checkpoint.safetensors: round trips, names, shards, placement, and the safetensors package both ways."""

import json
import os

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import safetensors
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from safetensors import safe_open
from safetensors.flax import save_file
from safetensors.numpy import save_file as numpy_save_file

import checkpoint
import checkpoint.safetensors as st
import varstate
from checkpoint import _keys
from checkpoint._storage import _host
from checkpoint._storage import _safetensors as storage
from varstate.optimizers import Adam

DTYPES = [np.float32, np.float64, np.float16, ml_dtypes.bfloat16, ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2,
          np.int8, np.int16, np.int32, np.uint8, np.uint16, np.uint32, np.bool_, np.complex64]


def _values(n=6):
    rng = np.random.default_rng(0)
    return {np.dtype(d).name: (rng.normal(size=n) * 4).astype(d) for d in DTYPES}


def _raw(path):
    """Each tensor as (dtype name, shape, bytes), read by the safetensors package without a framework."""
    with open(path, "rb") as f:
        tensors = safetensors.deserialize(f.read())
    return {name: (t["dtype"], tuple(t["shape"]), bytes(t["data"])) for name, t in tensors}


def test_every_dtype_round_trips_bitwise_and_the_package_reads_it(tmp_path):
    values = _values()
    path = st.save(tmp_path / "m.safetensors", values)
    back = st.load(path)
    assert set(back) == set(values)
    for name, v in values.items():
        assert back[name].dtype == v.dtype and back[name].tobytes() == v.tobytes(), name
    raw = _raw(path)
    for name, v in values.items():
        assert raw[name] == (storage.NAMES[v.dtype], v.shape, v.tobytes()), name
    with safe_open(path, framework="flax") as f:  # its flax reader (it has no float8 there)
        for name in ("bfloat16", "int32", "float32", "bool"):
            np.testing.assert_array_equal(np.asarray(f.get_tensor(name)), values[name])


def test_what_the_package_writes_loads(tmp_path):
    values = _values(5)
    path = str(tmp_path / "hf.safetensors")
    numpy_save_file(values, path, metadata={"format": "np"})
    flax_path = str(tmp_path / "flax.safetensors")
    save_file({"bf16": jnp.ones(3, jnp.bfloat16), "e5m2": jnp.full(2, 1.5, jnp.float8_e5m2)}, flax_path)
    flax_back = st.load(flax_path)
    assert flax_back["bf16"].dtype == ml_dtypes.bfloat16 and flax_back["e5m2"].tolist() == [1.5, 1.5]
    back = st.load(path)
    assert set(back) == set(values)
    for name, v in values.items():
        assert back[name].dtype == v.dtype and back[name].tobytes() == v.tobytes(), name
    template = {k: varstate.Variable(jnp.zeros_like(v)) for k, v in values.items() if k in ("bfloat16", "int8")}
    into = st.load(path, template)
    assert into["bfloat16"].handle is template["bfloat16"].handle
    np.testing.assert_array_equal(np.asarray(into["int8"].value), values["int8"])


def test_template_keeps_identity_python_values_and_prng_keys(tmp_path):
    w = varstate.Variable(jnp.arange(6.0).reshape(2, 3), name="w")
    tree = {"model": {"w": w, "b": jnp.ones(3, jnp.bfloat16)}, "step": 7, "lr": 0.5, "tag": "run-1",
            "flag": True, "key": jax.random.key(3)}
    path = st.save(tmp_path / "m.safetensors", tree)
    template = {"model": {"w": varstate.Variable(jnp.zeros((2, 3)), name="w2"), "b": jnp.zeros(3, jnp.bfloat16)},
                "step": 0, "lr": 0.0, "tag": "", "flag": False, "key": jax.random.key(0)}
    back = st.load(path, template)
    assert back["model"]["w"].handle is template["model"]["w"].handle
    np.testing.assert_array_equal(back["model"]["w"].value, w.value)
    assert (back["step"], back["lr"], back["tag"], back["flag"]) == (7, 0.5, "run-1", True)
    np.testing.assert_array_equal(jax.random.key_data(back["key"]), jax.random.key_data(tree["key"]))
    meta = safe_open(path, framework="flax").metadata()
    assert json.loads(meta["varstate.python"]) == {"flag": True, "lr": 0.5, "step": 7, "tag": "run-1"}
    assert json.loads(meta["varstate.prng_impl"]) == {"key": "threefry2x32"}


def test_names_are_the_checkpoint_keys_node_paths(tmp_path):
    params = {"dense/kernel": varstate.Variable(jnp.ones((2, 2))), "v.1": varstate.Variable(jnp.zeros(2))}
    opt = Adam(0.1).init(params)
    tree = {"model": params, "optimizer": opt}
    path = st.save(tmp_path / "m.safetensors", tree)
    prefix = checkpoint.Checkpoint(**tree).write(str(tmp_path / "ckpt"), format="tf")
    keys = checkpoint.read_checkpoint(prefix).keys()
    expected = {_keys.node_path(k) for k in keys if k.endswith(_keys.value_suffix())}
    assert set(_raw(path)) == expected
    assert "model/dense.Skernel/.OPTIMIZER_SLOT/optimizer/m" in expected
    # As a dict: escapes undone, a slot under its optimizer, slot name, variable path (restore_arrays' nesting).
    arrays, restored = st.load(path), checkpoint.restore_arrays(prefix)
    assert sorted(arrays["model"]) == ["dense/kernel", "v.1"]
    np.testing.assert_array_equal(arrays["optimizer"]["m"]["model"]["dense/kernel"],
                                  restored["optimizer"]["m"]["model"]["dense/kernel"])
    back = st.load(path, tree)
    assert jax.tree.structure(back) == jax.tree.structure(tree)
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(tree), strict=True))


def test_name_map_both_ways(tmp_path):
    tree = {"model": {"layers": [{"weight": jnp.ones((2, 2))}, {"weight": jnp.full((2, 2), 2.0)}]}}
    to_hf = lambda path: path.replace("/", ".")
    path = st.save(tmp_path / "m.safetensors", tree, name_map=to_hf)
    assert set(_raw(path)) == {"model.layers.0.weight", "model.layers.1.weight"}
    assert st.load(path)["model.layers.1.weight"][0, 0] == 2.0  # names that are not paths: a flat dict
    back = st.load(path, tree, name_map={"model/layers/0/weight": "model.layers.0.weight",
                                         "model/layers/1/weight": "model.layers.1.weight"})
    np.testing.assert_array_equal(back["model"]["layers"][1]["weight"], tree["model"]["layers"][1]["weight"])
    with pytest.raises(ValueError, match=r"name_map gives 'model/layers/1/weight' the name 'x', which "
                                         r"'model/layers/0/weight' has too"):
        st.save(tmp_path / "n.safetensors", tree, name_map=lambda p: "x")
    with pytest.raises(TypeError, match="name_map must be a mapping or a function"):
        st.save(tmp_path / "n.safetensors", tree, name_map=3)
    assert not os.path.exists(tmp_path / "n.safetensors")


def test_sharded_layout(tmp_path):
    tree = {f"w{i}": np.full((10,), i, np.float32) for i in range(5)}  # 40 bytes each
    index = st.save(tmp_path / "model.safetensors", tree, max_shard_size=100)
    assert index == str(tmp_path / "model.safetensors.index.json")
    files = sorted(os.listdir(tmp_path))
    assert files == ["model-00001-of-00003.safetensors", "model-00002-of-00003.safetensors",
                     "model-00003-of-00003.safetensors", "model.safetensors.index.json"]
    with open(index) as f:
        meta = json.load(f)
    assert meta["metadata"]["total_size"] == 200
    assert meta["weight_map"] == {"w0": "model-00001-of-00003.safetensors", "w1": "model-00001-of-00003.safetensors",
                                  "w2": "model-00002-of-00003.safetensors", "w3": "model-00002-of-00003.safetensors",
                                  "w4": "model-00003-of-00003.safetensors"}
    for name, file in meta["weight_map"].items():
        with safe_open(str(tmp_path / file), framework="flax") as f:
            np.testing.assert_array_equal(np.asarray(f.get_tensor(name)), tree[name])
    for where in (index, tmp_path):  # the index, or its directory
        back = st.load(where)
        assert all(np.array_equal(back[k], v) for k, v in tree.items()) and set(back) == set(tree)
    assert st.save(tmp_path / "one.safetensors", tree, max_shard_size="1KB").endswith("one.safetensors")
    with pytest.raises(ValueError, match="max_shard_size 'lots' is not a positive number of bytes"):
        st.save(tmp_path / "x.safetensors", tree, max_shard_size="lots")
    with pytest.raises(ValueError, match=r"a sharded save needs a path ending in \.safetensors"):
        st.save(tmp_path / "weights.bin", tree, max_shard_size=100)
    assert storage.parse_size("2MiB", "") == 2 << 20 and storage.parse_size("5GB", "") == 5 * 10**9


class _Counting:
    """Counts the bytes the reader preads (a block of a tensor, or whole tensors stored back to back)."""

    def __init__(self, monkeypatch):
        self.bytes = 0
        real = storage.pread_into

        def counted(fd, buf, offset, where):
            self.bytes += sum(b.nbytes for b in ([buf] if isinstance(buf, np.ndarray) else buf))
            real(fd, buf, offset, where)

        for module in (storage, _host):
            monkeypatch.setattr(module, "pread_into", counted)


@pytest.mark.parametrize("spec", [P("x", "y"), P("x", None), P(None, "x"), P()])
def test_each_shard_reads_its_own_bytes_once(tmp_path, monkeypatch, spec):
    value = np.arange(8 * 12, dtype=np.float32).reshape(8, 12)
    path = st.save(tmp_path / "m.safetensors", {"a": value, "b": np.ones(1000, np.float32)})
    mesh = jax.make_mesh((4, 2), ("x", "y"))
    sharding = NamedSharding(mesh, spec)
    count = _Counting(monkeypatch)
    back = st.load(path, {"a": varstate.Variable(jnp.zeros((8, 12)))}, sharding=sharding)
    assert back["a"].value.sharding == sharding
    np.testing.assert_array_equal(np.asarray(back["a"].value), value)
    assert count.bytes == value.nbytes  # distinct shards once each; "b" not at all
    for shard in back["a"].value.addressable_shards:
        np.testing.assert_array_equal(np.asarray(shard.data), value[shard.index])


def test_sharding_trees_and_template_placement(tmp_path):
    mesh = jax.make_mesh((8,), ("x",))
    row, rep = NamedSharding(mesh, P("x")), NamedSharding(mesh, P())
    tree = {"a": jnp.arange(16.0), "b": varstate.Variable(jnp.ones(8)), "n": 2}
    path = st.save(tmp_path / "m.safetensors", tree)
    back = st.load(path, tree, sharding={"a": row, "b": rep, "n": rep})
    assert back["a"].sharding == row and back["b"].value.sharding == rep and back["n"] == 2
    placed = {"a": jax.device_put(jnp.zeros(16), row), "b": tree["b"], "n": 0}
    assert st.load(path, placed)["a"].sharding == row  # the template's own placement
    assert st.load(path, sharding=row)["a"].sharding == row
    with pytest.raises(ValueError, match="the sharding tree does not match the template"):
        st.load(path, tree, sharding={"a": row})
    with pytest.raises(TypeError, match=r"sharding must be a jax\.sharding\.Sharding or a tree of them"):
        st.load(path, tree, sharding={"a": row, "b": "rows", "n": rep})
    with pytest.raises(TypeError, match=r"without a template, sharding must be one jax\.sharding\.Sharding"):
        st.load(path, sharding={"a": row})


def test_host_arrays_are_aligned_and_own_their_memory(tmp_path):
    path = st.save(tmp_path / "m.safetensors", {"a": np.arange(1000, dtype=np.int16), "b": np.ones(3, np.int8)})
    back = st.load(path)
    for v in back.values():
        assert v.ctypes.data % 64 == 0 and v.flags.c_contiguous
    os.truncate(path, 0)  # an mmap-backed array would fault here; these are copies
    np.testing.assert_array_equal(back["a"], np.arange(1000, dtype=np.int16))


def test_subset_reads_only_its_bytes(tmp_path, monkeypatch):
    tree = {"small": np.ones(100, np.float32), "big": np.zeros(10_000, np.float32)}
    path = st.save(tmp_path / "m.safetensors", tree)
    count = _Counting(monkeypatch)
    back = st.load(path, {"small": varstate.Variable(jnp.zeros(100))})
    assert count.bytes == 400 and float(back["small"].value.sum()) == 100


def test_template_errors_name_the_file_and_the_value(tmp_path):
    path = st.save(tmp_path / "m.safetensors", {"w": varstate.Variable(jnp.ones((2, 3)))})
    with pytest.raises(ValueError, match=r"m.safetensors holds no tensor 'v' for \(root\).v .*pass name_map"):
        st.load(path, {"v": jnp.zeros(1)})
    with pytest.raises(ValueError, match=r"m.safetensors: Cannot restore \(root\).w: the checkpoint value 'w' has "
                                         r"shape \(2, 3\), the object has shape \(3, 2\)"):
        st.load(path, {"w": varstate.Variable(jnp.zeros((3, 2)))})
    with pytest.raises(TypeError, match=r"m.safetensors: Cannot restore \(root\).w: the checkpoint value 'w' has "
                                        "dtype float32, the object has dtype int32"):
        st.load(path, {"w": varstate.Variable(jnp.zeros((2, 3), jnp.int32))})
    with pytest.raises(ValueError, match=r"holds no Python value for \(root\).n"):
        st.load(path, {"w": varstate.Variable(jnp.zeros((2, 3))), "n": 1})
    with pytest.raises(TypeError, match="the template must be a pytree of Variables and arrays"):
        st.load(path, varstate.Variable(jnp.zeros((2, 3))))
    with pytest.raises(ValueError, match=r"tensor 'c': dtype complex128 has no safetensors equivalent"):
        st.save(tmp_path / "c.safetensors", {"c": np.ones(2, np.complex128)})
    assert sorted(os.listdir(tmp_path)) == ["m.safetensors"]  # nothing written, no temporary left
    with pytest.raises(FileNotFoundError, match="No safetensors file or index at"):
        st.load(tmp_path / "absent.safetensors")


def test_partitioned_variable_is_stored_whole(tmp_path):
    pv = varstate.PartitionedVariable(jnp.arange(10.0), name="pv", num_shards=2)
    path = st.save(tmp_path / "m.safetensors", {"pv": pv})
    np.testing.assert_array_equal(st.load(path)["pv"], np.arange(10.0))
    back = st.load(path, {"pv": pv})
    np.testing.assert_array_equal(np.concatenate([np.asarray(v.value) for v in back["pv"]]), np.arange(10.0))


def test_the_storage_layer_names_the_prng_attribute_as_the_graph_does():
    from checkpoint._graph import _build

    assert storage.PRNG_ATTRIBUTE == _build.PRNG_KEY_IMPL  # one attribute name, spelled twice to keep jax out


def test_many_small_tensors_are_read_with_one_call_each_into_its_own_aligned_buffer(tmp_path, monkeypatch):
    tree = {f"w{i:02d}": np.arange(i + 1, dtype=np.float32) * (i + 1) for i in range(40)}
    tree["flags"] = np.array([True, False, True])  # odd sizes: most tensors start off a 64-byte boundary in the file
    path = st.save(tmp_path / "m.safetensors", tree)
    calls = []
    real = os.preadv
    monkeypatch.setattr(os, "preadv", lambda fd, bufs, offset: calls.append(len(bufs)) or real(fd, bufs, offset))
    back = st.load(path)
    assert calls == [1, 1, 41]  # the header's size, the header; the tensors: back to back, one read, a buffer each
    for k, v in tree.items():
        assert back[k].ctypes.data % 64 == 0 and back[k].dtype == v.dtype
        np.testing.assert_array_equal(back[k], v)
    calls.clear()
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    placed = st.load(path, {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=one) for k, v in tree.items()})
    assert calls == [1, 1, 41]
    for k, v in tree.items():
        assert placed[k].sharding == one
        np.testing.assert_array_equal(np.asarray(placed[k]), v)


def test_a_read_cut_short_by_the_system_goes_on_across_the_buffers(tmp_path, monkeypatch):
    tree = {f"w{i}": np.arange(10, dtype=np.int8) + 10 * i for i in range(5)}
    path = st.save(tmp_path / "m.safetensors", tree)
    real = os.preadv

    def short(fd, bufs, offset):  # at most 7 bytes a call: ends inside a buffer and spans two
        head, rest = memoryview(bufs[0]).cast("B")[:7], [memoryview(b).cast("B") for b in bufs[1:]]
        return real(fd, [head, *rest][:2] if len(head) < 7 else [head], offset)

    monkeypatch.setattr(os, "preadv", short)
    back = st.load(path)
    for k, v in tree.items():
        np.testing.assert_array_equal(back[k], v)
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - 3)
    with pytest.raises(checkpoint.CheckpointFormatError, match=r"m\.safetensors"):
        st.load(path)
