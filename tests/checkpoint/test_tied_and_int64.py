"""Tied weights and int64 values against TensorFlow (fixtures of tests/data/make_tf_tied_int64_fixtures.py).

- Tied weights (TF's testAnonymousVarsInInit): a model holding `w` and `b`
  twice with an Adam state saves (it raised AttributeError in the graph
  builder), restores, restores TF's checkpoint, and TF restores ours with
  assert_consumed().
- int64: TF's int64 and float64 values, restored while JAX's 64-bit types are
  off, save back with their stored dtypes (TF refused our int32: "expected
  dtype int64 does not equal original dtype int32"); TF restores the result.
"""

import importlib.util
import json
import os

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from google.protobuf import text_format

import checkpoint
import varstate
from varstate.optimizers import Adam

DATA = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data")
TF_DIR = os.path.join(DATA, "tf_checkpoints")
with open(os.path.join(TF_DIR, "tied_int64.json")) as f:
    TF = json.load(f)
_spec = importlib.util.spec_from_file_location("ours_for_tf", os.path.join(DATA, "write_ours_tied_int64_for_tf.py"))
OURS = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(OURS)  # the definitions the committed ours_* checkpoints were written with
KEY = "/.ATTRIBUTES/VARIABLE_VALUE"


def _decode(entry: dict) -> np.ndarray:
    dtype = np.dtype(ml_dtypes.bfloat16 if entry["dtype"] == "bfloat16" else entry["dtype"])
    return np.frombuffer(bytes.fromhex(entry["hex"]), dtype.newbyteorder("<")).reshape(entry["shape"])


def _restored_by_tf(name: str, path: str) -> np.ndarray:
    dtype, hexed = TF[name]["restored_by_tf"][path]
    return np.frombuffer(bytes.fromhex(hexed), np.dtype(dtype).newbyteorder("<"))


def _tied_template():
    w, b = varstate.Variable(jnp.float32(9.0), name="w"), varstate.Variable(jnp.float32(9.0), name="b")
    model = {"w": w, "b": b, "vars": [w, b]}
    return model, Adam(OURS.TIED_LR).init(model)


def _graph_text(path: str) -> str:
    return text_format.MessageToString(checkpoint.read_checkpoint(path).object_graph)


# --- tied weights ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", ["orbax", "tf"])
def test_a_tied_model_with_its_optimizer_state_saves_and_restores(tmp_path, fmt):
    model, state = OURS.tied_training()
    path = checkpoint.Checkpoint(model=model, optimizer=state).write(str(tmp_path / "c"), format=fmt)
    reader = checkpoint.read_checkpoint(path)
    # One value per variable and per slot, under the first path (breadth-first), as TF stores them.
    assert sorted(reader.keys()) == sorted(k for k in TF["tf_tied"]["tensors"] if k != "save_counter" + KEY)
    template, template_state = _tied_template()
    got = checkpoint.Checkpoint(model=template, optimizer=template_state).restore(path).assert_consumed()
    for k in ("w", "b"):
        np.testing.assert_array_equal(got.model[k].value, model[k].value)
        for slot in ("m", "v"):
            np.testing.assert_array_equal(got.optimizer.get_slot(got.model[k], slot).value,
                                          state.get_slot(model[k], slot).value)
    assert got.model["vars"][0].resource_id == got.model["w"].resource_id == template["w"].resource_id
    np.testing.assert_array_equal(got.model["vars"][1].value, got.model["b"].value)
    assert got.optimizer.slots["m"]["vars"][0].handle is got.optimizer.slots["m"]["w"].handle


def test_our_tied_checkpoint_is_the_one_tf_restored_with_assert_consumed(tmp_path):
    model, state = OURS.tied_training()
    path = checkpoint.Checkpoint(model=model, optimizer=state).save(str(tmp_path / "ckpt"), format="tf")
    record = TF["ours_tied"]
    assert _graph_text(path) == record["object_graph"]  # the graph TF read and matched
    reader = checkpoint.read_checkpoint(path)
    for key, entry in record["tensors"].items():
        assert np.dtype(reader.dtype(key)).name == entry["dtype"] and list(reader.shape(key)) == entry["shape"], key
        np.testing.assert_allclose(np.asarray(reader.get(key)), _decode(entry), rtol=1e-6, err_msg=key)
    # What TF restored into its model (both places of w) and its v1 Adam slots is what we saved.
    for where, value in [("model/w", model["w"]), ("model/vars/0", model["w"]), ("model/b", model["b"]),
                         ("model/w/.OPTIMIZER_SLOT/optimizer/m", state.get_slot(model["w"], "m")),
                         ("model/b/.OPTIMIZER_SLOT/optimizer/v", state.get_slot(model["b"], "v")),
                         ("optimizer/beta1_power", state.non_slot("beta1_power"))]:
        np.testing.assert_allclose(_restored_by_tf("ours_tied", where), np.ravel(value.value), rtol=1e-6,
                                   err_msg=where)


def test_tfs_tied_checkpoint_restores_consumed_and_matches_our_training():
    template, template_state = _tied_template()
    path = os.path.join(TF_DIR, "tf_tied", "ckpt-1")
    got = checkpoint.Checkpoint(model=template, optimizer=template_state).restore(path).assert_consumed()
    tensors = TF["tf_tied"]["tensors"]
    for k in ("w", "b"):
        np.testing.assert_array_equal(got.model[k].value, _decode(tensors[f"model/{k}{KEY}"]))
        for slot in ("m", "v"):
            np.testing.assert_array_equal(got.optimizer.get_slot(got.model[k], slot).value,
                                          _decode(tensors[f"model/{k}/.OPTIMIZER_SLOT/optimizer/{slot}{KEY}"]))
    # TF's training of the tied model (the gradient of each variable, whatever places it is read at) is ours.
    ours, ours_state = OURS.tied_training()
    for k in ("w", "b"):
        np.testing.assert_allclose(ours[k].value, got.model[k].value, rtol=1e-6)
        np.testing.assert_allclose(ours_state.get_slot(ours[k], "v").value,
                                   got.optimizer.get_slot(got.model[k], "v").value, rtol=1e-6)


# --- int64 ---------------------------------------------------------------------------------------------------
def test_tfs_int64_and_float64_values_save_back_with_their_stored_dtypes(tmp_path):
    assert not jax.config.jax_enable_x64
    source = os.path.join(TF_DIR, "tf_int64", "ckpt-1")
    roots = checkpoint.Checkpoint(**OURS.int64_templates()).restore(source).assert_consumed().roots
    tensors = TF["tf_int64"]["tensors"]
    model, opt = roots["model"], roots["optimizer"]
    assert model["step"].dtype == jnp.int32 and int(model["step"]) == 7  # JAX's widest integer while x64 is off
    np.testing.assert_array_equal(model["counts"].value, _decode(tensors["model/counts" + KEY]))
    assert opt["_iterations"].dtype == jnp.int32 and int(opt["_iterations"]) == 2
    assert opt["_variables"][0].resource_id == opt["_iterations"].resource_id
    # A plain array has no handle to remember the stored dtype on: it comes back as numpy, in that dtype.
    plain = model["plain"]
    assert type(plain) is np.ndarray and plain.dtype == np.int64 and plain.tolist() == [3, 4]
    for fmt in ("orbax", "tf"):
        path = checkpoint.Checkpoint(**roots).write(str(tmp_path / fmt), format=fmt)
        reader = checkpoint.read_checkpoint(path)
        stored = {k for k in tensors if k != "save_counter" + KEY}
        assert set(reader.keys()) == stored
        for key in stored:
            assert np.dtype(reader.dtype(key)).name == tensors[key]["dtype"], (fmt, key)
            np.testing.assert_array_equal(np.asarray(reader.get(key)), _decode(tensors[key]), err_msg=key)


def test_our_int64_round_trip_is_the_one_tf_restored_with_assert_consumed(tmp_path):
    source = os.path.join(TF_DIR, "tf_int64", "ckpt-1")
    roots = checkpoint.Checkpoint(**OURS.int64_templates()).restore(source).assert_consumed().roots
    path = checkpoint.Checkpoint(**roots).save(str(tmp_path / "ckpt"), format="tf")
    record = TF["ours_int64"]
    assert _graph_text(path) == record["object_graph"]
    reader = checkpoint.read_checkpoint(path)
    for key, entry in record["tensors"].items():
        assert np.dtype(reader.dtype(key)).name == entry["dtype"], key  # int64 where TF wants int64
        np.testing.assert_array_equal(np.asarray(reader.get(key)), _decode(entry), err_msg=key)
    restored = record["restored_by_tf"]
    assert restored["optimizer/_iterations"][0] == "int64" and restored["model/step"][0] == "int64"
    assert _restored_by_tf("ours_int64", "optimizer/_iterations").tolist() == [2]
    assert _restored_by_tf("ours_int64", "model/counts").tolist() == [1, -2, 2**31 - 1]
    assert _restored_by_tf("ours_int64", "model/x").dtype == np.float64


def test_a_restored_int64_variable_keeps_its_dtype_through_further_steps(tmp_path):
    # The stored dtype belongs to the variable (its handle): every later version saves as it was stored.
    source = os.path.join(TF_DIR, "tf_int64", "ckpt-1")
    got = checkpoint.Checkpoint(**OURS.int64_templates()).restore(source).expect_partial().model
    step = got["step"].assign_add(jnp.int32(5))
    path = checkpoint.Checkpoint(model={"step": step}).write(str(tmp_path / "c"), format="tf")
    reader = checkpoint.read_checkpoint(path)
    assert reader.dtype("model/step" + KEY) == np.int64 and np.asarray(reader.get("model/step" + KEY)).item() == 12


def test_restore_leaves_the_templates_handle_as_it_was(tmp_path):
    # The handle is shared by every version of a variable, the template's too, and immutable: a restore that
    # records an int64 stored dtype gives the restored version a handle of its own (same resource id and name).
    source = os.path.join(TF_DIR, "tf_int64", "ckpt-1")
    templates = OURS.int64_templates()
    template = templates["model"]["step"]
    before = {k: getattr(template.handle, k) for k in varstate.ResourceHandle.__annotations__}
    got = checkpoint.Checkpoint(**templates).restore(source).expect_partial().model["step"]
    assert {k: getattr(template.handle, k) for k in varstate.ResourceHandle.__annotations__} == before
    assert template.handle.saved_dtype is None and got.handle.saved_dtype == np.int64
    assert (got.resource_id, got.name) == (template.resource_id, template.name)
    assert template.handle.registry[template.resource_id] is template.handle
    for fmt, var in (("template", template), ("restored", got)):
        path = checkpoint.Checkpoint(model={"step": var}).write(str(tmp_path / fmt), format="tf")
        want = np.int32 if var is template else np.int64
        assert checkpoint.read_checkpoint(path).dtype("model/step" + KEY) == want, fmt
    with pytest.raises(AttributeError, match="ResourceHandle 'step' is immutable: saved_dtype is fixed at creation"):
        template.handle.saved_dtype = np.dtype(np.int64)
