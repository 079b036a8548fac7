"""``packed=False``: every value its own orbax array named by its checkpoint key, read by plain orbax."""

import os

import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

import checkpoint
import varstate
from varstate.optimizers import Adam


def _roots():
    registry = varstate.Registry()
    model = {"kernel": varstate.Variable(jnp.arange(6.0).reshape(2, 3), name="kernel", registry=registry),
             "params": varstate.Variable(jnp.full(4, 2.5), name="params", registry=registry),
             "emb": varstate.PartitionedVariable(jnp.arange(10.0).reshape(5, 2), name="emb", num_shards=2,
                                                 registry=registry)}
    return {"model": model, "optimizer": Adam(0.1).init(model), "epochs": 7}


def test_plain_orbax_restores_every_value_by_checkpoint_key(tmp_path, plain_orbax):
    roots = _roots()
    path = checkpoint.Checkpoint(**roots).save(str(tmp_path / "ckpt"), packed=False)
    ours = checkpoint.read_checkpoint(path)

    plain = plain_orbax(path)

    for key in ours.keys():
        if key.startswith("model/emb/"):
            continue
        assert key in plain, key
        np.testing.assert_array_equal(np.asarray(plain[key]), ours.get(key), err_msg=key)
    np.testing.assert_array_equal(plain["model/kernel/.ATTRIBUTES/VARIABLE_VALUE"], np.arange(6.0).reshape(2, 3))
    (epochs,) = [k for k in ours.keys() if k.startswith("epochs/")]  # a Python value: its py_state key
    assert int(plain[epochs]) == 7 and int(plain["save_counter/.ATTRIBUTES/VARIABLE_VALUE"]) == 1
    emb = "model/emb/.ATTRIBUTES/VARIABLE_VALUE"
    np.testing.assert_array_equal(np.concatenate([plain[f"{emb}@slice_0"], plain[f"{emb}@slice_1"]]),
                                  np.arange(10.0).reshape(5, 2))

    # And this package restores it as any checkpoint, the default staying packed.
    template = _roots()
    status = checkpoint.Checkpoint(**template).restore(path).assert_consumed()
    assert status.model["params"].value.tolist() == [2.5] * 4 and status.epochs == 7
    packed = checkpoint.Checkpoint(**roots).save(str(tmp_path / "ckpt"))
    assert "p0" in ocp.PyTreeCheckpointer().metadata(os.path.join(packed, "values")).item_metadata.tree


def test_manager_writes_unpacked_checkpoints(tmp_path, plain_orbax):
    with checkpoint.CheckpointManager(str(tmp_path), packed=False) as mgr:
        mgr.save(3, w=jnp.arange(3.0))
    plain = plain_orbax(os.path.join(str(tmp_path), "ckpt-3"))
    assert plain["w/.ATTRIBUTES/VARIABLE_VALUE"].tolist() == [0.0, 1.0, 2.0]
    assert int(plain["save_counter/.ATTRIBUTES/VARIABLE_VALUE"]) == 3


def test_an_unpacked_entry_may_only_name_its_own_array(tmp_path):
    import json

    import pytest

    from checkpoint._storage import _orbax

    path = checkpoint.Checkpoint(a=jnp.zeros(2), b=jnp.ones(2)).write(str(tmp_path / "c"), packed=False)
    meta_path = os.path.join(path, _orbax.META_FILE)
    with open(meta_path) as f:
        meta = json.load(f)
    meta["entries"]["a/.ATTRIBUTES/VARIABLE_VALUE"]["array"] = "b/.ATTRIBUTES/VARIABLE_VALUE"  # b's bytes for a
    with open(meta_path, "w") as f:
        json.dump(_orbax.seal(meta), f)
    with pytest.raises(checkpoint.DataLossError, match=r"entry 'a/\.ATTRIBUTES/VARIABLE_VALUE': bad array name "
                                                       r"'b/\.ATTRIBUTES/VARIABLE_VALUE'"):
        checkpoint.read_checkpoint(path)
