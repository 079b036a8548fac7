"""Partitioned variables: saved as slices of the full variable; restored into any partitioning."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import checkpoint
import varstate
from checkpoint._storage import _orbax
from varstate.optimizers import Adagrad, Adam

FULL = np.arange(70, dtype=np.float32).reshape(10, 7) / 7
KEY = "m/emb/.ATTRIBUTES/VARIABLE_VALUE"


def pv(value, shards, name="emb"):
    return varstate.PartitionedVariable(value, name=name, num_shards=shards)


def test_shards_are_stored_as_slices_of_the_full_variable(tmp_path):
    path = checkpoint.Checkpoint(m={"emb": pv(FULL, 3)}).write(str(tmp_path / "c"))
    reader = _orbax.OrbaxReader(path)
    assert reader.keys() == [KEY] and reader.shape(KEY) == (10, 7)
    entry = reader._entries[KEY]
    assert [s["spec"] for s in entry["slices"]] == ["10 7 0,4:0,7", "10 7 4,3:0,7", "10 7 7,3:0,7"]
    np.testing.assert_array_equal(reader.get(KEY), FULL)
    node = reader.object_graph.nodes[2]
    assert node.attributes[0].full_name == "emb" and node.attributes[0].checkpoint_key == KEY


@pytest.mark.parametrize("saved", [3, 2, 1, "array"])
def test_restore_into_other_partitionings_and_a_sharded_array(tmp_path, saved):
    source = varstate.Variable(jnp.asarray(FULL)) if saved == "array" else pv(FULL, saved)
    path = checkpoint.Checkpoint(m={"emb": source}).write(str(tmp_path / "c"))
    for shards in (3, 2, 1):
        template = pv(np.zeros_like(FULL), shards, name=f"t{shards}")
        got = checkpoint.Checkpoint(m={"emb": template}).restore(path).assert_consumed().m["emb"]
        assert isinstance(got, varstate.PartitionedVariable) and len(got) == shards
        assert [v.resource_id for v in got] == [v.resource_id for v in template]
        np.testing.assert_array_equal(got.as_array(), FULL)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("x",))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("x"))
    template = varstate.uninitialized((10, 7), jnp.float32, sharding=sharding)
    got = checkpoint.Checkpoint(m={"emb": template}).restore(path).assert_consumed().m["emb"]
    assert got.sharding == sharding
    np.testing.assert_array_equal(got.value, FULL)


def test_partitioned_slots_are_resliced_with_their_primary(tmp_path):
    params = {"emb": pv(FULL, 3)}
    opt = Adam(0.1)
    state = opt.init(params)
    grads = jax.tree.map(lambda v: jnp.ones_like(v.value), params, is_leaf=lambda x: isinstance(x, varstate.Variable))
    params, state = opt.apply_gradients(grads, params, state)
    path = checkpoint.Checkpoint(m=params, opt=state).write(str(tmp_path / "c"))
    m_full = np.concatenate([np.asarray(state.get_slot(v, "m").value) for v in params["emb"]])
    reader = _orbax.OrbaxReader(path)
    np.testing.assert_array_equal(reader.get("m/emb/.OPTIMIZER_SLOT/opt/m/.ATTRIBUTES/VARIABLE_VALUE"), m_full)
    template = {"emb": pv(np.zeros_like(FULL), 2, name="other")}
    status = checkpoint.Checkpoint(m=template).restore(path)
    restored_state = status.restore(opt=opt.init(status.m)).assert_consumed().opt
    got = np.concatenate([np.asarray(restored_state.get_slot(v, "m").value) for v in status.m["emb"]])
    np.testing.assert_array_equal(got, m_full)
    np.testing.assert_array_equal(status.m["emb"].as_array(), np.concatenate([v.value for v in params["emb"]]))


def test_partitioned_shape_mismatch_names_the_path(tmp_path):
    path = checkpoint.Checkpoint(m={"emb": pv(FULL, 3)}).write(str(tmp_path / "c"))
    with pytest.raises(ValueError, match=r"\(root\)\.m\.emb: .*has shape \(10, 7\), the object has shape \(12, 7\)"):
        checkpoint.Checkpoint(m={"emb": pv(np.zeros((12, 7), np.float32), 2)}).restore(path)


def test_tf_format_stores_the_assembled_variable_and_restores_into_shards(tmp_path):
    prefix = checkpoint.Checkpoint(m={"emb": pv(FULL, 3)}).write(str(tmp_path / "tf"), format="tf")
    reader = checkpoint.read_checkpoint(prefix)
    np.testing.assert_array_equal(reader.get(KEY), FULL)
    got = checkpoint.Checkpoint(m={"emb": pv(np.zeros_like(FULL), 2)}).restore(prefix).assert_consumed().m["emb"]
    np.testing.assert_array_equal(got.as_array(), FULL)


@pytest.mark.parametrize("fmt", ["orbax", "tf"])
def test_slots_for_only_some_shards_are_refused_not_zero_filled(tmp_path, fmt):
    # One full-tensor key holds a partitioned variable's slot: the missing shards' part would be invented zeros
    # (an Adagrad accumulator of 0 where it must be 0.5).
    emb = varstate.PartitionedVariable(jnp.ones((6, 2)), name="emb", num_shards=2)
    state = Adagrad(0.1, initial_accumulator_value=0.5).init({"first": emb[0]})
    with pytest.raises(ValueError, match=r"Cannot checkpoint the 'accumulator' slots of \(root\)\.m\.emb: the "
                                         r"optimizer \(root\)\.o has them for 1 of its 2 shards\. "):
        checkpoint.Checkpoint(m={"emb": emb}, o=state).write(str(tmp_path / "c"), format=fmt)


TF_DIR = os.path.join(os.path.dirname(os.path.dirname(__file__)), "data", "tf_checkpoints")
with open(os.path.join(TF_DIR, "expected.json")) as _f:
    TF_EXPECTED = json.load(_f)
TABLE = np.arange(10, dtype=np.float32).reshape(5, 2) / 4  # make_tf_checkpoint_fixtures.SHARDED_TABLE


@pytest.mark.parametrize("shards", [1, 2, 3, "variable"])
def test_tf2_sharded_variable_restores_into_any_partitioning(shards):
    # TF 2.21 saved a ShardedVariable (parts of 3 and 2 rows) as one node whose value is stored as slices.
    prefix = os.path.join(TF_DIR, "tf_sharded_variable", "ckpt-1")
    key = "model/emb/.ATTRIBUTES/VARIABLE_VALUE"
    assert checkpoint.read_checkpoint(prefix).get_slices(key) == [
        (slice(0, 3), slice(0, 2)), (slice(3, 5), slice(0, 2))]
    template = varstate.Variable(jnp.zeros((5, 2))) if shards == "variable" else pv(np.zeros((5, 2)), shards)
    got = checkpoint.Checkpoint(model={"emb": template}).restore(prefix).assert_consumed().model["emb"]
    value = got.value if shards == "variable" else got.as_array()
    tf_bytes = bytes.fromhex(TF_EXPECTED["tf_sharded_variable"]["tensors"][key]["hex"])
    assert np.asarray(value).tobytes() == tf_bytes == TABLE.tobytes()


def test_tensorflow_restored_our_partitioned_variable_into_sharded_variables_of_any_split(tmp_path):
    # ours_partitioned: a PartitionedVariable of 3 shards, saved in the TF format; TF restored it into
    # ShardedVariables of [3, 2] and [2, 2, 1] rows and a plain variable (assert_consumed each time).
    restored = TF_EXPECTED["ours_partitioned"]["restored_by_tf"]
    assert restored == dict.fromkeys(["2,2,1", "3,2", "5"], TABLE.tobytes().hex())
    emb = varstate.PartitionedVariable(TABLE, name="emb", num_shards=3)
    path = checkpoint.Checkpoint(model={"emb": emb}).save(str(tmp_path / "ckpt"), format="tf")
    now = checkpoint.read_checkpoint(path)
    verified = checkpoint.read_checkpoint(os.path.join(TF_DIR, "ours_partitioned", "ckpt-1"))
    assert now.keys() == verified.keys() and now.object_graph == verified.object_graph
    key = "model/emb/.ATTRIBUTES/VARIABLE_VALUE"
    assert now.get_slices(key) == verified.get_slices(key)
    np.testing.assert_array_equal(now.get(key), verified.get(key))
