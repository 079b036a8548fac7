"""restore(strict=True), deferred restores that keep the earlier roots, and a save_counter that is not an integer."""

import os

import jax.numpy as jnp
import numpy as np
import pytest

import checkpoint
import varstate
from checkpoint import _storage
from varstate.optimizers import Adam

KEY = "/.ATTRIBUTES/VARIABLE_VALUE"


def saved(tmp_path, fmt="orbax"):
    params = {"w": varstate.Variable(jnp.arange(3.0))}
    opt = Adam(0.1)
    state = opt.init(params)
    ckpt = checkpoint.Checkpoint(model=params, optimizer=state, step=jnp.int32(7))
    return ckpt.save(str(tmp_path / "ckpt"), format=fmt), opt


def templates(opt):
    params = {"w": varstate.Variable(jnp.zeros(3))}
    return params, opt.init(params)


@pytest.mark.parametrize("fmt", ["orbax", "tf"])
def test_strict_restore_needs_every_value_on_both_sides(tmp_path, fmt):
    path, opt = saved(tmp_path, fmt)
    params, state = templates(opt)
    status = checkpoint.Checkpoint(model=params, optimizer=state, step=jnp.int32(0)).restore(path, strict=True)
    assert status.model["w"].value.tolist() == [0.0, 1.0, 2.0] and int(status.step) == 7
    # A checkpoint value nothing received (the optimizer was not given):
    with pytest.raises(ValueError, match=r"Checkpoint.restore\('.*ckpt-1', strict=True\): Unresolved object in "
                                         r"checkpoint \(root\)\.optimizer.*restore with strict=False to accept"):
        checkpoint.Checkpoint(model=params, step=jnp.int32(0)).restore(path, strict=True)
    # A template value the checkpoint lacks:
    with pytest.raises(ValueError, match=r"strict=True\): Found 1 Python objects that were not bound to "
                                         r"checkpointed values.*\(root\)\.model\.b"):
        checkpoint.Checkpoint(model={**params, "b": varstate.Variable(jnp.zeros(1))}, optimizer=state,
                              step=jnp.int32(0)).restore(path, strict=True)
    with pytest.raises(ValueError, match=r"restore\(None, strict=True\): No checkpoint specified"):
        checkpoint.Checkpoint(model=params).restore(None, strict=True)
    # The default stays TF's: a partial restore, checked (or not) by the status's assertions.
    partial = checkpoint.Checkpoint(model=params).restore(path).expect_partial()
    assert partial.model["w"].value.tolist() == [0.0, 1.0, 2.0]
    with pytest.raises(AssertionError, match=r"Unresolved object in checkpoint \(root\)\.step"):
        partial.assert_consumed()


def test_a_deferred_restore_returns_every_root_restored_so_far(tmp_path):
    path, opt = saved(tmp_path)
    params, state = templates(opt)
    status = checkpoint.Checkpoint(model=params).restore(path)
    later = status.restore(optimizer=state)
    assert sorted(later.roots) == ["model", "optimizer"]
    assert later.model["w"].value.tolist() == [0.0, 1.0, 2.0]
    assert later.optimizer.get_slot(later.model["w"], "m") is not None
    last = status.restore(step=jnp.int32(0))  # from the first status: still sees the optimizer restored before
    assert sorted(last.roots) == ["model", "optimizer", "step"] and int(last.step) == 7
    assert sorted(status.roots) == ["model"]  # a status keeps what it held
    last.assert_consumed()
    none = checkpoint.Checkpoint(model=params).restore(None)
    assert sorted(none.restore(step=1).restore(optimizer=state).roots) == ["model", "optimizer", "step"]


def rewrite_counter(path, value):
    reader = checkpoint.read_checkpoint(path)
    tensors = {k: reader.get(k) for k in reader.keys()}
    tensors["save_counter" + KEY] = value
    tensors["_CHECKPOINTABLE_OBJECT_GRAPH"] = reader.object_graph.SerializeToString()
    for f in os.listdir(os.path.dirname(path)):
        if f.startswith(os.path.basename(path) + "."):
            os.remove(os.path.join(os.path.dirname(path), f))
    _storage.write_bundle(path, tensors)


@pytest.mark.parametrize("value, found", [(np.float32(3.9), r"float32 with shape \(\)"),
                                          (np.array([3], np.int64), r"int64 with shape \(1,\)"),
                                          (np.bool_(True), r"bool with shape \(\)")])
def test_a_save_counter_that_is_not_a_scalar_integer_is_refused(tmp_path, value, found):
    path = checkpoint.Checkpoint(w=jnp.ones(2)).save(str(tmp_path / "ckpt"), format="tf")
    rewrite_counter(path, value)
    ckpt = checkpoint.Checkpoint(w=jnp.zeros(2))
    with pytest.raises(checkpoint.DataLossError,
                       match=rf"Checkpoint '.*ckpt-1': save_counter \('save_counter{KEY}'\) holds {found}; expected "
                             r"a scalar integer \(TF saves an int64\)\..*read_checkpoint\(path\) and save them again"):
        ckpt.restore(path)
    assert ckpt.save_counter == 0  # nothing taken from it
    rewrite_counter(path, np.int32(3))  # any integer type restores, as its value
    ckpt.restore(path).assert_consumed()
    assert ckpt.save_counter == 3
