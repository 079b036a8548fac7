"""read_checkpoint's path handling and state files; TF-written checkpoints restored into varstate pytrees."""

import json
import os
import shutil

import jax.numpy as jnp
import numpy as np
import pytest

import checkpoint
import varstate
from checkpoint import CheckpointFormatError, read_checkpoint
from checkpoint._storage import BundleReader, read_checkpoint_state, write_checkpoint_state
from varstate.optimizers import Adam

DATA = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(__file__))), "data", "tf_checkpoints")
with open(os.path.join(DATA, "expected.json")) as _f:
    EXPECTED = json.load(_f)
KEY = "/.ATTRIBUTES/VARIABLE_VALUE"


def _tf(name: str, key: str) -> np.ndarray:
    entry = EXPECTED[name]["tensors"][key]
    dtype = {"bool": np.bool_}.get(entry["dtype"], entry["dtype"])
    return np.frombuffer(bytes.fromhex(entry["hex"]), dtype).reshape(entry["shape"])


def _copy(tmp_path, name: str) -> str:
    return shutil.copytree(os.path.join(DATA, name), tmp_path / name)


def test_a_prefix_its_index_a_directory_and_its_state_file_open_the_same_checkpoint():
    prefix = os.path.join(DATA, "tf_object", "ckpt-1")
    want = read_checkpoint(prefix).keys()
    assert want == sorted(EXPECTED["tf_object"]["tensors"])
    for path in (prefix + ".index", os.path.join(DATA, "tf_object"), os.path.join(DATA, "tf_object", "checkpoint")):
        reader = read_checkpoint(path)
        assert isinstance(reader, BundleReader) and reader.keys() == want, path
    assert read_checkpoint(prefix).object_graph.nodes[0].children[0].local_name == "model"


def test_name_based_checkpoint_has_no_object_graph_and_tf1_absolute_state_paths_survive_a_move(tmp_path):
    # TF1's Saver wrote absolute paths into the state file; the copy lives elsewhere now.
    directory = _copy(tmp_path, "tf_name")
    state = read_checkpoint_state(directory)
    assert os.path.isabs(state.model_checkpoint_path) and not state.model_checkpoint_path.startswith(str(tmp_path))
    reader = read_checkpoint(directory)
    assert reader.prefix == os.path.join(os.path.realpath(directory), "model.ckpt-2")
    assert reader.object_graph is None
    assert "emb" in reader.keys() and "global_step" in reader.keys()
    np.testing.assert_array_equal(reader.get("global_step"), _tf("tf_name", "global_step"))


@pytest.mark.parametrize("latest", ["../elsewhere/ckpt", "/etc/passwd", "sub/../../ckpt"])
def test_state_file_paths_never_escape_their_directory(tmp_path, latest):
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    shutil.copy(os.path.join(DATA, "tf_sharded", "ckpt.index"), outside / "ckpt.index")
    directory = tmp_path / "ckpts"
    directory.mkdir()
    (directory / "checkpoint").write_text(f'model_checkpoint_path: "{latest}"\n')
    with pytest.raises(CheckpointFormatError, match=r"ckpts/checkpoint names checkpoint .*, which is outside .*ckpts; "
                       r"a state file may only name checkpoints in its own directory\. Pass the checkpoint prefix"):
        read_checkpoint(directory)


def test_a_symlink_out_of_the_directory_is_refused(tmp_path):
    directory = _copy(tmp_path, "tf_object")
    os.symlink(os.path.join(DATA, "tf_sharded"), os.path.join(directory, "link"))
    with open(os.path.join(directory, "checkpoint"), "w") as f:
        f.write('model_checkpoint_path: "link/ckpt"\n')
    with pytest.raises(CheckpointFormatError, match=r"names checkpoint 'link/ckpt', which is outside"):
        read_checkpoint(directory)


def test_missing_and_malformed_paths_and_state_files(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"No checkpoint in directory .*: it holds no 'checkpoint' state "
                       r"file and is not an orbax checkpoint\. Pass a checkpoint prefix"):
        read_checkpoint(tmp_path)
    with pytest.raises(FileNotFoundError, match=r"No checkpoint at .*nope: expected a prefix with a nope\.index file"):
        read_checkpoint(tmp_path / "nope")
    (tmp_path / "checkpoint").write_text('all_model_checkpoint_paths: "a"\n')
    with pytest.raises(FileNotFoundError, match=r"checkpoint names no checkpoint \(model_checkpoint_path is empty\)"):
        read_checkpoint(tmp_path)
    (tmp_path / "checkpoint").write_text("model_checkpoint_path: 'ckpt-9'\n")
    with pytest.raises(FileNotFoundError, match=r"No checkpoint at .*ckpt-9: expected a prefix with a ckpt-9\.index"):
        read_checkpoint(tmp_path / "checkpoint")
    (tmp_path / "checkpoint").write_text("import os; os.system('x')\n")
    with pytest.raises(CheckpointFormatError, match=r"checkpoint: not a text CheckpointState: "):
        read_checkpoint(tmp_path)
    (tmp_path / "checkpoint").write_bytes(b"\xff\xfe")
    with pytest.raises(CheckpointFormatError, match=r"checkpoint: not a text CheckpointState \(not UTF-8\)"):
        read_checkpoint(tmp_path)


def test_orbax_checkpoints_are_read_through_the_orbax_reader(tmp_path):
    params = {"w": varstate.Variable(jnp.arange(3.0), registry=varstate.Registry())}
    path = checkpoint.Checkpoint(model=params).save(str(tmp_path / "ckpt"))
    for p in (path, tmp_path):
        reader = read_checkpoint(p)
        assert reader.keys() == ["model/w" + KEY, "save_counter" + KEY]
        assert reader.get("model/w" + KEY).tolist() == [0.0, 1.0, 2.0]
        assert reader.object_graph.nodes[0].children[0].local_name == "model"


def test_write_checkpoint_state_writes_relative_paths_tf_reads(tmp_path):
    # ours_bundle/checkpoint was written by this function and accepted by tf.train.latest_checkpoint.
    written = write_checkpoint_state(tmp_path, str(tmp_path / "ckpt-1"))
    with open(os.path.join(DATA, "ours_bundle", "checkpoint")) as a:
        assert (tmp_path / "checkpoint").read_text() == a.read()
    assert written.model_checkpoint_path == "ckpt-1" and list(written.all_model_checkpoint_paths) == ["ckpt-1"]
    state = write_checkpoint_state(tmp_path, "ckpt-3", ["ckpt-1", str(tmp_path / "ckpt-2")], [1.0, 2.0, 3.0], 0.5)
    assert read_checkpoint_state(tmp_path) == state
    assert list(state.all_model_checkpoint_paths) == ["ckpt-1", "ckpt-2", "ckpt-3"]
    assert list(state.all_model_checkpoint_timestamps) == [1.0, 2.0, 3.0] and state.last_preserved_timestamp == 0.5
    assert write_checkpoint_state(tmp_path, "/abs/other").model_checkpoint_path == "/abs/other"  # outside: kept
    with pytest.raises(ValueError, match=r"write_checkpoint_state: 1 timestamps for 2 checkpoint paths; give one"):
        write_checkpoint_state(tmp_path, "b", ["a"], [1.0])
    assert sorted(os.listdir(tmp_path)) == ["checkpoint"]  # no temporary left behind
    assert read_checkpoint_state(tmp_path / "none") is None


# --- TF-written object-based checkpoints restored through checkpoint.Checkpoint --------------------------


def _template():
    reg = varstate.Registry()
    kernel = varstate.Variable(jnp.zeros((3, 2)), registry=reg)
    model = {
        "dense": {"kernel": kernel, "bias": varstate.Variable(jnp.zeros(2), registry=reg)},
        "tied": kernel,
        "blocks": [{"w": varstate.Variable(jnp.zeros(4), registry=reg)} for _ in range(2)],
        "table": {"a.b/c": varstate.Variable(jnp.zeros(3, jnp.int32), registry=reg),
                  "plain": varstate.Variable(jnp.zeros(()), registry=reg)},
    }
    trained = [kernel, model["dense"]["bias"], model["blocks"][0]["w"], model["blocks"][1]["w"]]
    return model, trained


def test_tf_object_based_checkpoint_restores_into_varstate_with_v1_adam_slots():
    model, trained = _template()
    opt = Adam(0.1)
    prefix = os.path.join(DATA, "tf_object", "ckpt-1")
    status = checkpoint.Checkpoint(model=model, optimizer=opt.init(trained)).restore(prefix)
    status.assert_existing_objects_matched()
    with pytest.raises(AssertionError, match=r"model\.dtypes"):  # the template has no `dtypes` module
        status.assert_consumed()
    got = status.model
    assert got["tied"].resource_id == got["dense"]["kernel"].resource_id == model["tied"].resource_id
    expected = {
        ("dense", "kernel"): "model/tied", ("dense", "bias"): "model/dense/bias",
        ("blocks", 0): "model/blocks/0/w", ("blocks", 1): "model/blocks/1/w",
    }
    for (a, b), path in expected.items():
        var = got[a][b] if a == "dense" else got[a][b]["w"]
        np.testing.assert_array_equal(var.value, _tf("tf_object", path + KEY))
        for slot in ("m", "v"):
            value = status.optimizer.get_slot(var, slot).value
            np.testing.assert_array_equal(value, _tf("tf_object", f"{path}/.OPTIMIZER_SLOT/optimizer/{slot}{KEY}"))
    for name in ("beta1_power", "beta2_power"):
        np.testing.assert_array_equal(status.optimizer.non_slot(name).value, _tf("tf_object", f"optimizer/{name}{KEY}"))
    np.testing.assert_array_equal(got["table"]["a.b/c"].value, _tf("tf_object", "model/table/a..b.Sc" + KEY))
    assert got["table"]["plain"].value == _tf("tf_object", "model/table/plain" + KEY)


def test_tf_slots_restore_deferred_into_an_optimizer_made_after_the_model():
    model, _ = _template()
    status = checkpoint.Checkpoint(model=model).restore(os.path.join(DATA, "tf_object", "ckpt-1"))
    restored = status.model
    trained = [restored["dense"]["kernel"], restored["dense"]["bias"], *(b["w"] for b in restored["blocks"])]
    opt_state = status.restore(optimizer=Adam(0.1).init(trained)).optimizer
    m = opt_state.get_slot(restored["blocks"][1]["w"], "m").value
    np.testing.assert_array_equal(m, _tf("tf_object", "model/blocks/1/w/.OPTIMIZER_SLOT/optimizer/m" + KEY))


def test_checkpoint_save_format_tf_still_writes_what_tensorflow_restored(tmp_path):
    # ours_checkpoint was restored by tf.train.Checkpoint (assert_consumed) from the same code path;
    # today's Checkpoint.save(format="tf") must write the same graph, keys, dtypes and shapes.
    import importlib.util

    spec = importlib.util.spec_from_file_location("write_ours", os.path.join(DATA, "..", "write_ours_for_tf.py"))
    write_ours = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(write_ours)
    now = read_checkpoint(write_ours.ours_checkpoint(str(tmp_path)))
    verified = read_checkpoint(os.path.join(DATA, "ours_checkpoint", "ckpt-1"))
    assert now.object_graph == verified.object_graph
    assert now.keys() == verified.keys()
    for key in verified.keys():
        assert (now.dtype(key), now.shape(key)) == (verified.dtype(key), verified.shape(key)), key
        np.testing.assert_allclose(now.get(key), verified.get(key), rtol=1e-6, err_msg=key)


def test_the_one_open_reader_reads_the_variables_of_a_saved_model_and_of_an_export(tmp_path):
    saved_model = os.path.join(os.path.dirname(DATA), "tf_saved_model", "module")
    reader = read_checkpoint(saved_model)
    assert reader.path == os.path.join(saved_model, "variables", "variables") and reader.keys()
    assert reader.format_name == "TF object-based checkpoint" and reader.get_slices(reader.keys()[0]) == []
    exported = checkpoint.export(str(tmp_path / "m"), {"w": varstate.Variable(jnp.arange(3.0))})
    assert read_checkpoint(exported).get("w" + KEY).tolist() == [0.0, 1.0, 2.0]
    shutil.copytree(saved_model, tmp_path / "bare", ignore=shutil.ignore_patterns("variables"))
    with pytest.raises(FileNotFoundError, match=r"bare: the SavedModel has no variables \(variables/variables\.index "
                                                r"is missing\)"):
        read_checkpoint(str(tmp_path / "bare"))
