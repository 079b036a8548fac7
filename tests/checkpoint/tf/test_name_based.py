"""restore_by_name against a TF1 Saver checkpoint and what TF's init_from_checkpoint did with it.

Fixtures: tests/data/make_tf_name_based_fixtures.py (TensorFlow, run by hand).
"""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import checkpoint
import varstate
from checkpoint._storage import write_bundle

DATA = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(__file__))), "data", "tf_name_based")
PREFIX = os.path.join(DATA, "model.ckpt-1234")
with open(os.path.join(DATA, "expected.json")) as f:
    EXPECTED = json.load(f)
with open(os.path.join(DATA, "init_from_checkpoint.json")) as f:
    TF_CASES = json.load(f)


def expected(name):
    e = EXPECTED[name]
    return np.array(e["values"], dtype=e["dtype"]).reshape(e["shape"])


def make(spec):
    """varstate variables as TF created them in the fixture script (zeros, or ones)."""
    registry = varstate.Registry()
    out = {}
    for name, s in spec.items():
        fill = jnp.ones if s.get("init") == "ones" else jnp.zeros
        value = fill(s["shape"], s["dtype"])
        if s.get("parts"):
            out[name] = varstate.PartitionedVariable(value, name=name, num_shards=s["parts"], registry=registry)
        else:
            out[name] = varstate.Variable(value, name=name, registry=registry)
    return out


def value_of(v):
    return np.asarray(v.as_array() if isinstance(v, varstate.PartitionedVariable) else v.value)


def ids(tree):
    leaves = jax.tree_util.tree_leaves(tree, is_leaf=lambda x: isinstance(x, varstate.Variable))
    return [v.resource_id for v in leaves if isinstance(v, varstate.Variable)]


@pytest.mark.parametrize("case", sorted(c for c, s in TF_CASES.items() if "result" in s))
def test_assignment_map_matches_tf_init_from_checkpoint(case):
    spec = TF_CASES[case]
    params = make(spec["variables"])
    before = {n: value_of(v) for n, v in params.items()}
    status = checkpoint.restore_by_name(PREFIX, params, [tuple(p) for p in spec["map"]])
    assert jax.tree_util.tree_structure(status.params) == jax.tree_util.tree_structure(params)
    assert ids(status.params) == ids(params)
    changed = set()
    for name, v in status.params.items():
        want = np.array(spec["result"][name], dtype=spec["variables"][name]["dtype"])
        got = value_of(v)
        np.testing.assert_array_equal(got.ravel(), want)
        if not np.array_equal(got, before[name]):
            changed.add(name)
    # The report: what TF initialized from the checkpoint is what we say matched.
    assert set(status.matched) == changed
    assert set(status.missing_in_checkpoint) == set(params) - changed
    assert set(status.unused_in_checkpoint) == set(EXPECTED) - set(status.matched.values())


ERRORS = {
    "error_shape_mismatch": r"Shape of variable 'w' \(2, 4\) does not match the shape of tensor 'cls/weights' \(4, 2\)",
    "error_tensor_missing": r"Tensor 'bert/encoder/layer_9/kernel' is not found in checkpoint .*model.ckpt-1234",
    "error_scope_tensor_missing": r"Tensor 'bert/extra' is not found .* scope 'enc/' to 'bert/'.* 'enc/extra'",
    "error_scope_to_name": r"assignment_map\['bert'\] = 'enc/': a scope must map to a checkpoint scope ending in '/'",
}


@pytest.mark.parametrize("case", sorted(ERRORS))
def test_errors_where_tf_raises_value_error(case):
    spec = TF_CASES[case]
    assert spec["error"]["type"] == "ValueError"
    with pytest.raises(ValueError, match=ERRORS[case]):
        checkpoint.restore_by_name(PREFIX, make(spec["variables"]), [tuple(p) for p in spec["map"]])


def test_dtype_mismatch_is_an_error_as_in_tf():
    # TF: "expected dtype double does not equal original dtype float" (float64 needs x64 here: use int32).
    assert "expected dtype double does not equal original dtype float" in TF_CASES["error_dtype_mismatch"]["error"][
        "message"]
    params = make({"w": {"shape": [4, 2], "dtype": "int32"}})
    with pytest.raises(TypeError, match=r"Dtype of variable 'w' \(int32\) does not match the dtype of tensor "
                                        r"'cls/weights' \(float32\).*Create the variable with dtype float32"):
        checkpoint.restore_by_name(PREFIX, params, {"cls/weights": "w"})


def test_without_map_every_name_is_matched_and_the_rest_reported():
    registry = varstate.Registry()
    params = {
        "bert": [varstate.Variable(jnp.zeros(e["shape"], e["dtype"]), name=n, registry=registry)
                 for n, e in EXPECTED.items() if n.startswith("bert/") and "position" not in n],
        "pos": varstate.PartitionedVariable(jnp.zeros((10, 3)), name="bert/embeddings/position_embeddings",
                                            num_shards=4, registry=registry),
        "step": varstate.get_or_create_global_step(registry),
        "extra": varstate.uninitialized((2,), jnp.float32, name="extra/w", registry=registry),
        "not_a_variable": jnp.ones(3),
    }
    status = checkpoint.restore_by_name(DATA, params)  # a directory: its `checkpoint` file's latest
    restored = status.params
    for v in restored["bert"]:
        np.testing.assert_array_equal(v.value, expected(v.name))
    np.testing.assert_array_equal(restored["pos"].as_array(), expected("bert/embeddings/position_embeddings"))
    # Each shard holds its own slice of the reassembled tensor.
    np.testing.assert_array_equal(restored["pos"][1].value, expected("bert/embeddings/position_embeddings")[3:6])
    # TF's int64 global_step lands in JAX's 32-bit integer when x64 is off.
    assert restored["step"].dtype == jnp.int32 and int(restored["step"].value) == int(expected("global_step"))
    assert not restored["extra"].is_initialized
    assert restored["not_a_variable"] is params["not_a_variable"]
    assert ids(restored) == ids(params)
    assert status.matched == {n: n for n in EXPECTED if n.startswith("bert/") or n == "global_step"}
    assert status.missing_in_checkpoint == ("extra/w",)
    assert status.unused_in_checkpoint == ("cls/weights", "counts", "scale")
    with pytest.raises(AssertionError, match=r"Variables not found in the checkpoint: \['extra/w'\]"):
        status.assert_existing_objects_matched()
    with pytest.raises(AssertionError, match=r"Variables not found in the checkpoint"):
        status.assert_consumed()


def test_assert_consumed_passes_when_both_sides_are_used():
    registry = varstate.Registry()
    # int64 and float64 values land in JAX's 32-bit dtypes (x64 is off).
    params = [varstate.Variable(jnp.zeros(e["shape"], jax.dtypes.canonicalize_dtype(e["dtype"])), name=n,
                                registry=registry) for n, e in EXPECTED.items()]
    status = checkpoint.restore_by_name(PREFIX, params)
    assert status.assert_consumed() is status
    for v in status.params:
        np.testing.assert_array_equal(v.value, expected(v.name).astype(v.dtype))
    partial = checkpoint.restore_by_name(PREFIX, params[:1])
    assert partial.assert_existing_objects_matched() is partial
    with pytest.raises(AssertionError, match=r"Unused checkpoint values: \[.*'global_step'.*\]"):
        partial.assert_consumed()


def test_variables_and_partitioned_variables_as_map_values():
    registry = varstate.Registry()
    w = varstate.Variable(jnp.zeros((4, 2)), name="head/w", registry=registry)
    pos = varstate.PartitionedVariable(jnp.zeros((10, 3)), name="p", num_shards=3, registry=registry)
    params = {"w": w, "pos": pos}
    status = checkpoint.restore_by_name(PREFIX, params, {
        "cls/weights": w,
        "bert/embeddings/position_embeddings": list(pos),  # TF's list-of-shards form
    })
    np.testing.assert_array_equal(status.params["w"].value, expected("cls/weights"))
    np.testing.assert_array_equal(status.params["pos"].as_array(), expected("bert/embeddings/position_embeddings"))
    assert status.matched == {"head/w": "cls/weights", "p": "bert/embeddings/position_embeddings"}
    stranger = varstate.Variable(jnp.zeros((4, 2)), name="stranger", registry=registry)
    with pytest.raises(ValueError, match=r"\['cls/weights'\]: .*'stranger'.* is not a Variable of params"):
        checkpoint.restore_by_name(PREFIX, params, {"cls/weights": stranger})
    with pytest.raises(ValueError, match=r"slices must all be from the same variable, got \['head/w', 'p'\]"):
        checkpoint.restore_by_name(PREFIX, params, {"cls/weights": [w, pos[0]]})


def _restore_from(directory, tensors, params, assignment_map=None):
    prefix = os.path.join(directory, "ckpt")
    write_bundle(prefix, tensors)
    return checkpoint.restore_by_name(prefix, params, assignment_map)


def test_restore_keeps_a_mesh_sharding(tmp_path):
    mesh = jax.make_mesh((8,), ("x",))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("x"))
    v = varstate.uninitialized((8, 2), jnp.float32, name="emb", sharding=sharding, registry=varstate.Registry())
    value = np.arange(16, dtype=np.float32).reshape(8, 2)
    status = _restore_from(tmp_path, {"emb": value}, {"e": v})
    assert status.params["e"].value.sharding == sharding
    np.testing.assert_array_equal(status.params["e"].value, value)


def test_int64_out_of_32_bit_range_is_an_error(tmp_path):
    step = varstate.get_or_create_global_step(varstate.Registry())
    with pytest.raises(ValueError, match=r"Tensor 'global_step' \(int64\) holds 1099511627776, out of range for "
                                         r"variable 'global_step' \(int32; .*jax_enable_x64"):
        _restore_from(tmp_path / "a", {"global_step": np.array(2**40, np.int64)}, step)
    assert int(_restore_from(tmp_path / "b", {"global_step": np.array(-7, np.int64)}, step).params.value) == -7


def test_float64_beyond_float32_range_is_an_error(tmp_path):
    w = varstate.Variable(jnp.zeros(3), name="w", registry=varstate.Registry())
    with pytest.raises(ValueError, match=r"Tensor 'w' \(float64\) holds 1e\+300, out of range for variable 'w' "
                                         r"\(float32; .*jax_enable_x64"):
        _restore_from(tmp_path / "a", {"w": np.array([1.0, 1e300, 2.0])}, w)
    # Values within range, and infinities and NaNs that were already there, restore.
    got = _restore_from(tmp_path / "b", {"w": np.array([0.5, np.inf, np.nan])}, w).params.value
    np.testing.assert_array_equal(np.asarray(got), np.array([0.5, np.inf, np.nan], np.float32))


def test_bad_assignment_maps():
    params = make({"enc/w": {"shape": [4, 2], "dtype": "float32"}})
    with pytest.raises(TypeError, match=r"assignment_map must be a dict or a list of .* pairs, got int"):
        checkpoint.restore_by_name(PREFIX, params, 3)
    with pytest.raises(TypeError, match=r"assignment_map keys must be checkpoint names or scopes .* got 1"):
        checkpoint.restore_by_name(PREFIX, params, {1: "enc/w"})
    with pytest.raises(TypeError, match=r"assignment_map\['cls/weights'\]: expected a variable name, .* got float"):
        checkpoint.restore_by_name(PREFIX, params, {"cls/weights": 1.5})
    with pytest.raises(ValueError, match=r"params have no variable named 'enc'; to map a scope, end both sides "
                                         r"with '/' \(e.g. 'cls/': 'enc/'\)"):
        checkpoint.restore_by_name(PREFIX, params, {"cls/": "enc"})



def test_tf1_adam_checkpoint_with_partitions_on_both_axes_into_params_and_optimizer_state():
    """TF's own Saver checkpoint (tests/data/tf_checkpoints/tf_name): model, v1 Adam slots, global_step."""
    from varstate import optimizers

    with open(os.path.join(os.path.dirname(DATA), "tf_checkpoints", "expected.json")) as f:
        record = json.load(f)["tf_name"]["tensors"]
    prefix = os.path.join(os.path.dirname(DATA), "tf_checkpoints", "tf_name")

    def tf_value(key):
        return np.frombuffer(bytes.fromhex(record[key]["hex"]), record[key]["dtype"]).reshape(record[key]["shape"])

    r = varstate.Registry()
    params = {
        "dense": {"kernel": varstate.Variable(jnp.zeros((3, 2)), name="dense/kernel", registry=r),
                  "bias": varstate.Variable(jnp.zeros(2), name="dense/bias", registry=r)},
        # Saved in 3 row slices and 2 column slices; restored into other layouts.
        "emb": varstate.PartitionedVariable(jnp.zeros((10, 4)), name="emb", num_shards=2, registry=r),
        "proj": varstate.PartitionedVariable(jnp.zeros((4, 5)), name="proj", num_shards=3, axis=1, registry=r),
    }
    state = optimizers.Adam(0.1).init(params)
    # TF1's Adam names its slots <var>/Adam and <var>/Adam_1; ours are <var>/m and <var>/v.
    slot_map = {f"{v}/Adam{suffix}": f"{v}/{ours}" for v in ("dense/kernel", "dense/bias", "emb", "proj")
                for suffix, ours in (("", "m"), ("_1", "v"))}
    status = checkpoint.restore_by_name(prefix, state, {**slot_map, "beta1_power": "beta1_power",
                                                        "beta2_power": "beta2_power"})
    restored = checkpoint.restore_by_name(prefix, params)
    for name in ("dense/kernel", "dense/bias"):
        scope, leaf = name.split("/")
        np.testing.assert_array_equal(restored.params[scope][leaf].value, tf_value(name))
        np.testing.assert_array_equal(status.params.get_slot(restored.params[scope][leaf], "m").value,
                                      tf_value(name + "/Adam"))
    for name in ("emb", "proj"):
        np.testing.assert_array_equal(restored.params[name].as_array(), tf_value(name))
        slot_v = jnp.concatenate([status.params.get_slot(s, "v").value for s in params[name]],
                                 axis=1 if name == "proj" else 0)
        np.testing.assert_array_equal(slot_v, tf_value(name + "/Adam_1"))
    assert float(status.params.non_slot("beta2_power").value) == float(tf_value("beta2_power"))
    assert restored.missing_in_checkpoint == ()
    assert set(restored.unused_in_checkpoint) == {"global_step", "beta1_power", "beta2_power", *slot_map}


def test_object_based_checkpoint_keys_through_an_assignment_map():
    """As init_from_checkpoint, explicit keys of a TF2 checkpoint work too (here TF's tf_object fixture)."""
    data = os.path.join(os.path.dirname(DATA), "tf_checkpoints")
    with open(os.path.join(data, "expected.json")) as f:
        rec = json.load(f)["tf_object"]["tensors"]["model/tied/.ATTRIBUTES/VARIABLE_VALUE"]
    w = varstate.Variable(jnp.zeros(rec["shape"]), name="w", registry=varstate.Registry())
    status = checkpoint.restore_by_name(os.path.join(data, "tf_object"), [w],
                                        {"model/tied/.ATTRIBUTES/VARIABLE_VALUE": "w"})
    assert np.asarray(status.params[0].value).tobytes().hex() == rec["hex"]
    assert "_CHECKPOINTABLE_OBJECT_GRAPH" not in status.unused_in_checkpoint
    assert "save_counter/.ATTRIBUTES/VARIABLE_VALUE" in status.unused_in_checkpoint


def test_write_name_based_is_read_by_tensorflow(tmp_path):
    """Our name-based writer against TF 2.21 (fixture from tests/data/make_tf_name_based_readback.py)."""
    import importlib.util

    here = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(__file__))), "data")
    spec = importlib.util.spec_from_file_location("writer", os.path.join(here, "write_name_based_for_tf.py"))
    writer = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(writer)
    with open(os.path.join(here, "tf_name_based_ours", "tf_readback.json")) as f:
        tf = json.load(f)
    # What we write today is byte for byte what TF read.
    prefix = checkpoint.write_name_based(str(tmp_path / "model.ckpt"), writer.tensors())
    for suffix in (".index", ".data-00000-of-00001"):
        with open(prefix + suffix, "rb") as a, open(os.path.join(here, "tf_name_based_ours", "model.ckpt" + suffix),
                                                    "rb") as b:
            assert a.read() == b.read(), suffix
    reader = checkpoint.read_checkpoint(prefix)
    assert sorted(tf["load_checkpoint"]) == reader.keys() == ["global_step", "model/dense/kernel", "model/emb"]
    for key, seen in tf["load_checkpoint"].items():
        assert seen["dtype"] == reader.dtype(key).name and seen["shape"] == list(reader.shape(key))
        assert np.array_equal(np.asarray(seen["value"], reader.dtype(key)), reader.get(key))
    for restored in (tf["saver_same"], tf["saver_other"]):  # TF1's Saver, partitioned as saved and otherwise
        for key, value in restored.items():
            assert np.array_equal(np.asarray(value, reader.dtype(key)), reader.get(key))
    assert [(s[0].start, s[0].stop) for s in reader.get_slices("model/emb")] == [(0, 3), (3, 5), (5, 7)]


def test_write_name_based_errors(tmp_path):
    pv = varstate.PartitionedVariable(jnp.ones((4, 2)), name="emb", num_shards=2, registry=varstate.Registry())
    shards = list(pv)
    bare = varstate.PartitionedVariable.__new__(varstate.PartitionedVariable)
    for slot in type(pv).__slots__:
        object.__setattr__(bare, slot, getattr(pv, slot))
    object.__setattr__(bare, "_variables", (shards[0], varstate.Variable(jnp.ones((2, 2)))))
    with pytest.raises(ValueError, match=r"write_name_based: a shard of 'emb' has no SaveSliceInfo"):
        checkpoint.write_name_based(str(tmp_path / "a"), {"emb": bare})
    from checkpoint._storage import Sliced

    with pytest.raises(ValueError, match=r"the slices of 'x' overlap or do not cover its shape \(4,\)"):
        write_bundle(str(tmp_path / "b"), {"x": Sliced((4,), [((0,), np.ones(3)), ((2,), np.ones(2))])})
    with pytest.raises(ValueError, match=r"a slice of 'x' at \(3,\) with shape \(2,\) does not fit its full shape"):
        write_bundle(str(tmp_path / "c"), {"x": Sliced((4,), [((3,), np.ones(2))])})
    with pytest.raises(ValueError, match=r"the slices of 'x' have different dtypes \['float32', 'float64'\]"):
        write_bundle(str(tmp_path / "d"), {"x": Sliced((4,), [((0,), np.ones(2)), ((2,), np.ones(2, np.float32))])})
    assert not os.listdir(tmp_path)  # refused before anything was written
