"""CheckpointManager, latest_checkpoint and TF's `checkpoint` state file."""

import json
import os

import jax.numpy as jnp
import numpy as np
import pytest
from google.protobuf import text_format

import checkpoint
import varstate
from checkpoint import _storage
from checkpoint._storage import _publish
from checkpoint.protos.checkpoint_state_pb2 import CheckpointState

TF_DIR = os.path.join(os.path.dirname(os.path.dirname(__file__)), "data", "tf_object_graph")


def model(x):
    return {"w": varstate.Variable(jnp.full(3, float(x))), "big": jnp.full(300_000, float(x))}


def template():
    return {"w": varstate.Variable(jnp.zeros(3)), "big": jnp.zeros(300_000)}


def state_file(directory):
    with open(os.path.join(directory, "checkpoint")) as f:
        return text_format.Parse(f.read(), CheckpointState())


def test_latest_checkpoint_reads_tensorflows_state_file():
    assert checkpoint.latest_checkpoint(TF_DIR) == os.path.join(os.path.abspath(TF_DIR), "ckpt-1")


def test_latest_checkpoint_is_none_without_a_state_file_or_when_the_files_are_gone(tmp_path):
    assert checkpoint.latest_checkpoint(str(tmp_path)) is None
    path = checkpoint.Checkpoint(m=model(1)).save(str(tmp_path / "ckpt"))
    assert checkpoint.latest_checkpoint(str(tmp_path)) == path
    os.remove(os.path.join(path, "meta", "metadata"))
    assert checkpoint.latest_checkpoint(str(tmp_path)) is None
    (tmp_path / "checkpoint").write_text("model_checkpoint_path: [not a string")
    with pytest.raises(checkpoint.CheckpointFormatError, match="checkpoint: not a text CheckpointState"):
        checkpoint.latest_checkpoint(str(tmp_path))
    (tmp_path / "checkpoint").write_text('model_checkpoint_path: "../elsewhere/ckpt-1"')
    with pytest.raises(checkpoint.CheckpointFormatError, match=r"names checkpoint '../elsewhere/ckpt-1', which is "
                                                               r"outside .*; a state file may only name"):
        checkpoint.latest_checkpoint(str(tmp_path))


def test_max_to_keep_deletes_the_oldest_and_keeps_the_state_file_in_tf_format(tmp_path):
    mgr = checkpoint.CheckpointManager(str(tmp_path), max_to_keep=2)
    for step in (10, 20, 30):
        assert mgr.save(step, m=model(step)) == str(tmp_path / f"ckpt-{step}")
    assert mgr.checkpoints == [str(tmp_path / "ckpt-20"), str(tmp_path / "ckpt-30")]
    assert sorted(p for p in os.listdir(tmp_path)) == ["checkpoint", "ckpt-20", "ckpt-30"]
    state = state_file(str(tmp_path))
    assert state.model_checkpoint_path == "ckpt-30"
    assert list(state.all_model_checkpoint_paths) == ["ckpt-20", "ckpt-30"]
    assert len(state.all_model_checkpoint_timestamps) == 2
    assert checkpoint.latest_checkpoint(str(tmp_path)) == mgr.latest_checkpoint
    status = mgr.restore(m=template()).assert_consumed()
    assert status.m["w"].value.tolist() == [30.0] * 3 and float(status.m["big"][-1]) == 30.0
    assert mgr.restore(20, m=template()).m["w"].value.tolist() == [20.0] * 3
    reopened = checkpoint.CheckpointManager(str(tmp_path), max_to_keep=2)
    assert reopened.checkpoints == mgr.checkpoints
    ckpt = checkpoint.Checkpoint(m=template())
    ckpt.restore(mgr.latest_checkpoint)
    assert ckpt.save_counter == 30  # the manager saves its step as save_counter


def test_keep_every_n_steps_preserves_checkpoints_outside_the_kept_list(tmp_path):
    mgr = checkpoint.CheckpointManager(str(tmp_path), max_to_keep=1, keep_every_n_steps=2)
    for step in (1, 2, 3, 4):
        mgr.save(step, m=model(step))
    assert mgr.checkpoints == [str(tmp_path / "ckpt-4")]
    assert sorted(p for p in os.listdir(tmp_path) if p.startswith("ckpt")) == ["ckpt-2", "ckpt-4"]
    state = state_file(str(tmp_path))
    assert list(state.all_model_checkpoint_paths) == ["ckpt-4"]
    assert 0 < state.last_preserved_timestamp <= state.all_model_checkpoint_timestamps[0]  # set when ckpt-2 left
    restored = checkpoint.Checkpoint(m=template()).restore(str(tmp_path / "ckpt-2")).m
    assert restored["w"].value.tolist() == [2.0] * 3


def test_leftovers_of_a_crashed_save_are_removed_by_the_next_save_only(tmp_path):
    mgr = checkpoint.CheckpointManager(str(tmp_path))
    mgr.save(1, m=model(1))
    leftover = tmp_path / "ckpt-2.orbax-checkpoint-tmp-1234"
    (leftover / "values").mkdir(parents=True)
    (tmp_path / ".checkpoint.tmp-1-2").write_text("half")
    # An evaluator's manager beside a trainer that is saving: it must not touch the save in progress.
    reader = checkpoint.CheckpointManager(str(tmp_path))
    assert reader.latest_checkpoint == str(tmp_path / "ckpt-1")
    assert reader.restore(m=model(0)).m["w"].value.tolist() == [1.0] * 3
    assert sorted(os.listdir(tmp_path)) == [".checkpoint.tmp-1-2", "checkpoint", "ckpt-1", leftover.name]
    writer = checkpoint.CheckpointManager(str(tmp_path))
    writer.save(3, m=model(3))
    assert sorted(os.listdir(tmp_path)) == ["checkpoint", "ckpt-1", "ckpt-3"]


def test_async_save_commits_in_the_background(tmp_path):
    mgr = checkpoint.CheckpointManager(str(tmp_path), async_save=True, max_to_keep=1)
    for step in (1, 2):
        path = mgr.save(step, m=model(step))
    mgr.wait_until_finished()
    assert mgr.checkpoints == [path] and checkpoint.latest_checkpoint(str(tmp_path)) == path
    assert sorted(os.listdir(tmp_path)) == ["checkpoint", "ckpt-2"]
    np.testing.assert_array_equal(mgr.restore(m=template()).m["big"], np.full(300_000, 2.0, np.float32))
    mgr.close()


def test_manager_errors(tmp_path):
    mgr = checkpoint.CheckpointManager(str(tmp_path))
    with pytest.raises(FileNotFoundError, match=r"no checkpoint in .* yet"):
        mgr.restore(m=template())
    with pytest.raises(ValueError, match="step must be >= 0, got -1"):
        mgr.save(-1, m=model(0))
    with pytest.raises(ValueError, match="max_to_keep must be a positive int or None, got 0"):
        checkpoint.CheckpointManager(str(tmp_path), max_to_keep=0)
    with pytest.raises(ValueError, match="keep_every_n_steps must be a positive int or None, got -2"):
        checkpoint.CheckpointManager(str(tmp_path), keep_every_n_steps=-2)
    with pytest.raises(ValueError, match="invalid checkpoint_name 'a/b'"):
        checkpoint.CheckpointManager(str(tmp_path), checkpoint_name="a/b")


def test_checkpoint_save_lists_only_what_it_wrote_like_tf(tmp_path):
    # TF's Checkpoint.save records all_model_checkpoint_paths=[file_path]: a CheckpointManager opened on the
    # directory later manages (and may delete) that one only, never the earlier saves.
    ckpt = checkpoint.Checkpoint(m=model(0))
    first, second = ckpt.save(str(tmp_path / "ckpt")), ckpt.save(str(tmp_path / "ckpt"))
    state = state_file(str(tmp_path))
    assert state.model_checkpoint_path == "ckpt-2"
    assert list(state.all_model_checkpoint_paths) == ["ckpt-2"]
    elsewhere = tmp_path.parent / "elsewhere" / "ckpt-9"
    _storage.record_latest(str(tmp_path), str(elsewhere))
    assert state_file(str(tmp_path)).model_checkpoint_path == str(elsewhere)  # outside: absolute
    assert os.path.isdir(first) and os.path.isdir(second)
    _storage.record_latest(str(tmp_path), second)
    mgr = checkpoint.CheckpointManager(str(tmp_path), max_to_keep=1)
    assert mgr.checkpoints == [second]
    mgr.save(3, m=model(3))
    assert os.path.isdir(first) and not os.path.exists(second) and mgr.checkpoints == [str(tmp_path / "ckpt-3")]
    mgr.close()


def test_saving_an_existing_step_raises_unless_overwrite_and_the_old_one_stays_latest_until_replaced(
        tmp_path, monkeypatch):
    mgr = checkpoint.CheckpointManager(str(tmp_path))
    mgr.save(1, m=model(1))
    with pytest.raises(checkpoint._manager.StepAlreadyExistsError,
                       match=r"step 1 is already saved \(.*ckpt-1\)\. Pass overwrite=True to replace it"):
        mgr.save(1, m=model(11))
    assert issubclass(checkpoint._manager.StepAlreadyExistsError, ValueError)
    assert mgr.restore(m=template()).m["w"].value.tolist() == [1.0] * 3  # nothing was written
    seen = []

    def watch(original):
        def spy(*args, **kwargs):
            latest = checkpoint.latest_checkpoint(str(tmp_path))
            seen.append((original.__name__, os.path.basename(latest),
                         checkpoint.Checkpoint(m=template()).restore(latest).assert_consumed().m["w"].value.tolist()))
            return original(*args, **kwargs)
        return spy

    for name in ("publish", "retire", "move_into_place", "remove"):
        monkeypatch.setattr(_publish, name, watch(getattr(_publish, name)))
    mgr.save(1, overwrite=True, m=model(11))
    # While the new one is written and swapped in, the latest is the old one (under a stand-in's name
    # while the path itself is being replaced); then the new one.
    assert [(name, where.split(".")[0], w[0]) for name, where, w in seen] == [
        ("publish", "ckpt-1", 1.0), ("retire", "ckpt-1", 1.0), ("move_into_place", "ckpt-1", 1.0),
        ("remove", "ckpt-1", 11.0)]
    assert ".varstate-standin-" in seen[2][1] and seen[3][1] == "ckpt-1"
    monkeypatch.undo()
    assert mgr.checkpoints == [str(tmp_path / "ckpt-1")] and mgr.all_steps() == [1]
    assert mgr.restore(m=template()).assert_consumed().m["w"].value.tolist() == [11.0] * 3
    assert sorted(os.listdir(tmp_path)) == ["checkpoint", "ckpt-1"]
    # A step on disk that the manager does not list (preserved, or written by Checkpoint.save) is refused too.
    checkpoint.Checkpoint(m=model(7)).write(str(tmp_path / "ckpt-7"))
    with pytest.raises(checkpoint._manager.StepAlreadyExistsError, match="step 7 is already saved"):
        mgr.save(7, m=model(8))
    assert mgr.should_save(7) is False


@pytest.mark.parametrize("fmt", ["orbax", "tf"])
def test_overwriting_the_latest_step_of_a_reopened_manager(tmp_path, fmt):
    first = checkpoint.CheckpointManager(str(tmp_path), max_to_keep=2, format=fmt)
    for step in (1, 2):
        first.save(step, m=model(step))
    mgr = checkpoint.CheckpointManager(str(tmp_path), max_to_keep=2, format=fmt)
    mgr.save(2, overwrite=True, m=model(22))
    mgr.save(1, overwrite=True, m=model(11))  # saved again, it is the latest: saving order, as TF's manager
    assert mgr.checkpoints == [str(tmp_path / "ckpt-2"), str(tmp_path / "ckpt-1")]
    assert checkpoint.latest_checkpoint(str(tmp_path)) == str(tmp_path / "ckpt-1")
    assert mgr.restore(m=template()).assert_consumed().m["w"].value.tolist() == [11.0] * 3
    assert mgr.restore(2, m=template()).assert_consumed().m["w"].value.tolist() == [22.0] * 3
    assert not [n for n in os.listdir(tmp_path) if "varstate" in n or "tmp" in n]


def test_a_reopened_manager_keeps_the_saving_order_of_the_state_file(tmp_path):
    # Resumed from an earlier step (training diverged after step 30) and saved step 20 again: as in TF's
    # CheckpointManager, "latest" is the most recently saved, also for a manager reopened on the directory.
    mgr = checkpoint.CheckpointManager(str(tmp_path), max_to_keep=2)
    for step in (10, 30, 20):
        mgr.save(step, m=model(step))
    assert mgr.checkpoints == [str(tmp_path / "ckpt-30"), str(tmp_path / "ckpt-20")]
    assert mgr.latest_checkpoint == checkpoint.latest_checkpoint(str(tmp_path)) == str(tmp_path / "ckpt-20")
    reopened = checkpoint.CheckpointManager(str(tmp_path), max_to_keep=2)
    assert reopened.checkpoints == mgr.checkpoints
    assert reopened.restore(m=template()).m["w"].value.tolist() == [20.0] * 3
    reopened.save(40, m=model(40))  # the oldest saved (30) goes, not the smallest step
    assert reopened.checkpoints == [str(tmp_path / "ckpt-20"), str(tmp_path / "ckpt-40")]


def test_a_step_root_is_named_otherwise(tmp_path):
    # `step=` is the checkpoint's number (issue 24.1): a root holding the training step needs another name.
    mgr = checkpoint.CheckpointManager(str(tmp_path))
    mgr.save(7, m=model(7), global_step=np.int64(7))
    mgr.save(8, m=model(8), global_step=np.int64(8))
    assert mgr.restore(global_step=np.int64(0)).expect_partial().global_step == 8
    assert mgr.restore(7, global_step=np.int64(0)).expect_partial().global_step == 7
    mgr.close()


def test_latest_checkpoint_keeps_the_directory_as_given_through_a_symlink(tmp_path):
    # TF joins the state file's path to the directory given; a symlinked directory must not turn into its target.
    (tmp_path / "real").mkdir()
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "real", target_is_directory=True)
    mgr = checkpoint.CheckpointManager(str(link))
    mgr.save(1, m=model(1))
    assert checkpoint.latest_checkpoint(str(link)) == mgr.latest_checkpoint == str(link / "ckpt-1")
    assert checkpoint.read_checkpoint(str(link)).path == str(link / "ckpt-1")
    mgr.close()


def small(x):
    return {"w": jnp.full(2, float(x))}


def test_latest_step_all_steps_and_should_save(tmp_path):
    mgr = checkpoint.CheckpointManager(str(tmp_path), max_to_keep=2, save_interval_steps=10)
    assert mgr.latest_step() is None and mgr.all_steps() == []
    assert [s for s in range(0, 41, 5) if mgr.should_save(s)] == [0, 10, 20, 30, 40]
    for step in (30, 10, 20):  # resumed from step 10 after step 30 diverged: saving order, not step order
        mgr.save(step, m=small(step))
    assert mgr.latest_step() == 20 and mgr.all_steps() == [10, 20]
    assert mgr.should_save(20) is False and mgr.should_save(30) is True and mgr.should_save(25) is False
    reopened = checkpoint.CheckpointManager(str(tmp_path))
    assert reopened.latest_step() == 20 and reopened.all_steps() == [10, 20]
    with pytest.raises(ValueError, match=r"CheckpointManager\.should_save: step must be an int, got 2\.5"):
        mgr.should_save(2.5)
    with pytest.raises(ValueError, match=r"CheckpointManager\.save: step must be an int, got '3'"):
        mgr.save("3", m=small(3))
    with pytest.raises(ValueError, match=r"CheckpointManager\.restore: step must be >= 0, got -1"):
        mgr.restore(-1, m=small(0))
    with pytest.raises(ValueError, match="save_interval_steps must be a positive int, got 0"):
        checkpoint.CheckpointManager(str(tmp_path), save_interval_steps=0)
    assert mgr.save(np.int64(40), m=small(40)).endswith("ckpt-40")  # numpy integers are steps


def test_async_steps_count_from_save_and_the_context_manager_waits_and_closes(tmp_path):
    with checkpoint.CheckpointManager(str(tmp_path), async_save=True) as mgr:
        path = mgr.save(5, m=model(5))
        assert mgr.latest_step() == 5 and mgr.all_steps() == [5] and mgr.should_save(5) is False
    assert mgr._thread is None and mgr._checkpointer is None  # waited, and orbax's threads released
    assert checkpoint.latest_checkpoint(str(tmp_path)) == path == mgr.latest_checkpoint
    mgr.save(6, m=model(6))  # a closed manager saves again (it starts orbax's threads anew)
    mgr.close()
    assert mgr.all_steps() == [5, 6]


def test_the_context_manager_waits_even_when_the_block_raises(tmp_path):
    with pytest.raises(RuntimeError, match="boom"):
        with checkpoint.CheckpointManager(str(tmp_path), async_save=True) as mgr:
            mgr.save(1, m=model(1))
            raise RuntimeError("boom")
    assert checkpoint.latest_checkpoint(str(tmp_path)) == str(tmp_path / "ckpt-1")


def metrics_file(directory):
    with open(os.path.join(directory, "checkpoint_manager.json")) as f:
        return json.load(f)


def test_best_fn_keeps_the_best_k_and_the_latest(tmp_path):
    mgr = checkpoint.CheckpointManager(str(tmp_path), max_to_keep=2, best_fn=lambda m: m["acc"])
    for step, acc in ((1, 0.5), (2, 0.9), (3, 0.7), (4, 0.6), (5, 0.95)):
        mgr.save(step, metrics={"acc": acc}, m=small(step))
    # After step 4: the best two (2, 3) and the latest (4). After step 5: 5 and 2 are the best; 3 and 4 go.
    assert mgr.all_steps() == [2, 5] and mgr.latest_step() == 5
    assert sorted(n for n in os.listdir(tmp_path) if n.startswith("ckpt")) == ["ckpt-2", "ckpt-5"]
    assert metrics_file(tmp_path) == {"format": "varstate-checkpoint-manager", "version": 1, "saving": {},
                                      "metrics": {"ckpt-2": {"acc": 0.9}, "ckpt-5": {"acc": 0.95}}}
    # Reopened, the manager knows the metrics of the checkpoints it keeps: 6 is worse than both, so it is
    # kept only as the latest, and leaves when 7 comes.
    reopened = checkpoint.CheckpointManager(str(tmp_path), max_to_keep=2, best_fn=lambda m: m["acc"])
    reopened.save(6, metrics={"acc": 0.1}, m=small(6))
    assert reopened.all_steps() == [2, 5, 6]
    reopened.save(7, metrics={"acc": 0.2}, m=small(7))
    assert reopened.all_steps() == [2, 5, 7]
    assert reopened.restore(2, m=small(0)).assert_consumed().m["w"].tolist() == [2.0, 2.0]


def test_best_fn_ties_missing_metrics_and_min_mode(tmp_path):
    def loss(m):
        return m["loss"]

    mgr = checkpoint.CheckpointManager(str(tmp_path / "min"), max_to_keep=2, best_fn=loss, best_mode="min")
    saves = [(1, {"loss": 0.3}), (2, None), (3, {"loss": 0.3}), (4, {"other": 1.0}), (5, {"loss": float("nan")}),
             (6, {"loss": 0.5})]
    kept = []
    for step, metrics in saves:
        mgr.save(step, metrics=metrics, m=small(step))
        kept.append(mgr.all_steps())
    # Without a score (no metrics, no "loss", NaN) ranks below every scored one, more recent first among
    # them; equal scores: the more recent is kept. The latest is always kept.
    assert kept == [[1], [1, 2], [1, 3], [1, 3, 4], [1, 3, 5], [1, 3, 6]]
    best = checkpoint.CheckpointManager(str(tmp_path / "max"), max_to_keep=1, best_fn=loss)
    for step, value in ((1, 2.0), (2, 2.0), (3, 1.0)):
        best.save(step, metrics={"loss": value}, m=small(step))
    assert best.all_steps() == [2, 3]  # 2 beats 1 on the tie, by recency
    plain = checkpoint.CheckpointManager(str(tmp_path / "plain"), max_to_keep=1)
    plain.save(1, metrics={"acc": np.float32(0.5), "epoch": jnp.int32(3)}, m=small(1))  # kept without best_fn
    assert metrics_file(tmp_path / "plain")["metrics"] == {"ckpt-1": {"acc": 0.5, "epoch": 3}}
    plain.save(2, m=small(2))  # ckpt-1 and its metrics go: the file goes with the last metrics
    assert sorted(os.listdir(tmp_path / "plain")) == ["checkpoint", "ckpt-2"]


def test_metrics_of_a_step_saved_again_replace_the_old_ones(tmp_path):
    mgr = checkpoint.CheckpointManager(str(tmp_path), best_fn=lambda m: m["acc"])
    mgr.save(1, metrics={"acc": 0.1}, m=small(1))
    mgr.save(1, overwrite=True, metrics={"acc": 0.2}, m=small(1))
    assert metrics_file(tmp_path)["metrics"] == {"ckpt-1": {"acc": 0.2}}
    mgr.save(1, overwrite=True, m=small(1))
    assert not os.path.exists(tmp_path / "checkpoint_manager.json")


def test_metrics_and_best_fn_errors(tmp_path):
    mgr = checkpoint.CheckpointManager(str(tmp_path), best_fn=lambda m: m.get("acc", "high"))
    with pytest.raises(ValueError, match=r"metrics must be a dict of str to numbers, got list\. The keyword "
                                         r"'metrics' is reserved"):
        mgr.save(1, metrics=[0.5], m=small(1))
    with pytest.raises(ValueError, match=r"metrics\['acc'\] must be a real number, got 'high'; pass a scalar"):
        mgr.save(1, metrics={"acc": "high"}, m=small(1))
    with pytest.raises(ValueError, match=r"metrics\['acc'\] must be a real number, got Array\(\[1\., 2\.\]"):
        mgr.save(1, metrics={"acc": jnp.ones(2) * jnp.array([1.0, 2.0])}, m=small(1))
    with pytest.raises(ValueError, match="metric names must be str, got 3"):
        mgr.save(1, metrics={3: 1.0}, m=small(1))
    with pytest.raises(ValueError, match=r"best_fn returned 'high' for the metrics \{'loss': 1\.0\} of .*ckpt-1; "
                                         r"it must return a number"):
        mgr.save(1, metrics={"loss": 1.0}, m=small(1))
    assert os.listdir(tmp_path) == []  # refused before anything was written
    with pytest.raises(ValueError, match="best_mode must be 'max' or 'min', got 'best'"):
        checkpoint.CheckpointManager(str(tmp_path), best_fn=len, best_mode="best")
    with pytest.raises(ValueError, match=r"best_fn must be callable \(metrics -> number\), got 'acc'"):
        checkpoint.CheckpointManager(str(tmp_path), best_fn="acc")
    with pytest.raises(ValueError, match="unknown format 'zip'; expected 'orbax' or 'tf'"):
        checkpoint.CheckpointManager(str(tmp_path), format="zip")
    journal = tmp_path / "checkpoint_manager.json"
    journal.write_text('{"format": "varstate-checkpoint-manager", "version": 1, "metrics": {"ckpt-1": {"acc": "x"}}}')
    with pytest.raises(checkpoint.CheckpointFormatError,
                       match=r"checkpoint_manager.json: not a CheckpointManager file \(the metrics of 'ckpt-1' are "
                             r"not an object of numbers\)\. Delete it to forget the metrics; the checkpoints"):
        checkpoint.CheckpointManager(str(tmp_path))
    journal.write_text('{"format": "varstate-checkpoint-manager", "version": 1, "saving": {"ckpt-1": {}}}')
    with pytest.raises(checkpoint.CheckpointFormatError, match=r"the save in flight 'ckpt-1' is not \{'since'"):
        checkpoint.CheckpointManager(str(tmp_path))
    journal.write_text('{"format": "varstate-checkpoint-manager", "version": 2}')
    with pytest.raises(checkpoint.CheckpointFormatError, match="version 2; this reader knows version 1"):
        checkpoint.CheckpointManager(str(tmp_path))
    journal.write_text("{not json")
    with pytest.raises(checkpoint.CheckpointFormatError, match="not a CheckpointManager file"):
        checkpoint.CheckpointManager(str(tmp_path))


@pytest.mark.parametrize("async_save", [False, True])
def test_tf_format_manager_writes_tensorbundles(tmp_path, async_save):
    mgr = checkpoint.CheckpointManager(str(tmp_path), max_to_keep=2, format="tf", async_save=async_save)
    for step in (1, 2, 3):
        mgr.save(step, m=model(step))
    mgr.wait_until_finished()
    assert sorted(os.listdir(tmp_path)) == ["checkpoint", "ckpt-2.data-00000-of-00001", "ckpt-2.index",
                                            "ckpt-3.data-00000-of-00001", "ckpt-3.index"]
    assert state_file(str(tmp_path)).model_checkpoint_path == "ckpt-3"
    reader = _storage.BundleReader(str(tmp_path / "ckpt-3"))  # TF's TensorBundle: what TensorFlow restores
    assert reader.get("save_counter/.ATTRIBUTES/VARIABLE_VALUE") == 3
    assert reader.get("m/w/.ATTRIBUTES/VARIABLE_VALUE").tolist() == [3.0] * 3
    status = mgr.restore(m=template()).assert_consumed()
    np.testing.assert_array_equal(status.m["big"], np.full(300_000, 3.0, np.float32))
    mgr.close()


def test_manager_restore_strict(tmp_path):
    mgr = checkpoint.CheckpointManager(str(tmp_path))
    mgr.save(1, m=model(1), extra=jnp.ones(2))
    assert mgr.restore(m=template(), extra=jnp.zeros(2), strict=True).extra.tolist() == [1.0, 1.0]
    with pytest.raises(ValueError, match=r"strict=True\): Unresolved object in checkpoint \(root\)\.extra"):
        mgr.restore(1, m=template(), strict=True)
    assert mgr.restore(m=template()).m["w"].value.tolist() == [1.0] * 3  # TF's default: a partial match is fine


# --- issue 24 items 1 and 7, issue 26 item 11 -----------------------------------
def test_step_is_the_step_however_it_is_passed_and_no_root_is_named_as_a_parameter(tmp_path):
    mgr = checkpoint.CheckpointManager(str(tmp_path))
    assert mgr.save(step=10, w=jnp.full(2, 10.0)) == str(tmp_path / "ckpt-10")
    mgr.save(20, w=jnp.full(2, 20.0))
    assert mgr.restore(step=10, w=jnp.zeros(2)).w.tolist() == [10.0, 10.0]
    assert mgr.restore(10, w=jnp.zeros(2)).w.tolist() == [10.0, 10.0]
    with pytest.raises(ValueError) as e:
        mgr.save(30, step=jnp.int32(3), w=jnp.zeros(2))
    assert str(e.value) == ("CheckpointManager.save: a root named 'step' collides with the parameter step (given as "
                            "30); rename the root, e.g. global_step=...")
    for name in ("strict", "expect_partial"):
        with pytest.raises(ValueError) as e:
            mgr.save(30, **{name: jnp.zeros(2)})
        assert str(e.value) == (f"CheckpointManager.save: a root named {name!r} collides with the parameter {name} "
                                f"of CheckpointManager.restore, which could not restore it; rename the root, e.g. "
                                f"{name}_=...")
    with pytest.raises(ValueError, match=r"^CheckpointManager.restore: a root named 'step' collides with the "
                                         r"parameter step \(given as 10\)"):
        mgr.restore(10, step=jnp.int32(0))
    assert mgr.all_steps() == [10, 20]


def test_options_must_be_bools_and_steps_ints_not_bools(tmp_path):
    for name in ("async_save", "packed"):
        with pytest.raises(TypeError) as e:
            checkpoint.CheckpointManager(str(tmp_path), **{name: "no"})
        assert str(e.value) == (f"CheckpointManager: {name} must be a bool (True or False), got 'no' (str); pass "
                                f"{name}=True if that is what you mean.")
    mgr = checkpoint.CheckpointManager(str(tmp_path))
    with pytest.raises(ValueError) as e:
        mgr.save(True, w=jnp.zeros(2))
    assert str(e.value) == ("CheckpointManager.save: step must be an int, got True (bool); pass the step number, "
                            "e.g. 100.")
    with pytest.raises(TypeError, match=r"^CheckpointManager.save: overwrite must be a bool"):
        mgr.save(1, overwrite=1, w=jnp.zeros(2))
    with pytest.raises(TypeError, match=r"^CheckpointManager.restore: strict must be a bool"):
        mgr.restore(strict="yes", w=jnp.zeros(2))
    assert os.listdir(tmp_path) == []


def test_best_step_and_metrics(tmp_path):
    mgr = checkpoint.CheckpointManager(str(tmp_path), max_to_keep=2, best_fn=lambda m: m["loss"], best_mode="min")
    assert mgr.best_step() is None
    mgr.save(1, w=jnp.zeros(2))  # no metrics: no score
    assert mgr.best_step() is None and mgr.metrics(1) is None
    for step, loss in ((2, 0.3), (3, 0.1), (4, 0.1), (5, 0.9)):
        mgr.save(step, metrics={"loss": loss}, w=jnp.zeros(2))
    assert mgr.all_steps() == [3, 4, 5]
    assert mgr.best_step() == 4  # ties go to the more recent
    assert mgr.metrics(3) == {"loss": 0.1}
    assert checkpoint.CheckpointManager(str(tmp_path), best_fn=lambda m: m["loss"], best_mode="min").best_step() == 4
    assert checkpoint.CheckpointManager(str(tmp_path)).best_step() is None  # without best_fn nothing is ranked
    with pytest.raises(KeyError) as e:
        mgr.metrics(2)
    assert e.value.args[0] == (f"CheckpointManager.metrics: no kept checkpoint of step 2 in {str(tmp_path)!r}; the "
                               "kept steps are [3, 4, 5]. Ask for one of them (all_steps()).")


def adam_manager(tmp_path):
    from varstate.optimizers import Adam

    model = {"w": varstate.Variable(jnp.array([1.0, 2.0])), "b": varstate.Variable(jnp.array([3.0]))}
    opt = Adam(0.1)
    model, state = opt.apply_gradients({"w": jnp.ones(2), "b": jnp.ones(1)}, model, opt.init(model))
    mgr = checkpoint.CheckpointManager(str(tmp_path))
    mgr.save(7, model=model, optimizer=state)
    return mgr, model, state


def test_restoring_the_model_alone_logs_one_line_or_nothing_with_expect_partial(tmp_path, caplog):
    import gc
    import logging

    mgr, model, _ = adam_manager(tmp_path)
    gc.collect()
    fresh = {"w": varstate.Variable(jnp.zeros(2)), "b": varstate.Variable(jnp.zeros(1))}
    with caplog.at_level(logging.WARNING, logger="checkpoint"):
        mgr.restore(model=fresh)
        gc.collect()
        assert [r.getMessage() for r in caplog.records] == [
            "Some values in the checkpoint were not restored: (root).optimizer.beta1_power and 5 more (under "
            "(root).optimizer). Call expect_partial() on the status (CheckpointManager.restore: "
            "expect_partial=True) if this is intended."]
        caplog.clear()
        restored = mgr.restore(model=fresh, expect_partial=True).model["w"].value
        np.testing.assert_array_equal(restored, model["w"].value)
        gc.collect()
        assert caplog.text == ""


def test_restore_arrays_reads_a_checkpoint_without_templates(tmp_path):
    import jax

    mgr, model, state = adam_manager(tmp_path)
    arrays = checkpoint.restore_arrays(mgr.latest_checkpoint)
    assert sorted(arrays) == ["model", "optimizer", "save_counter"]
    assert isinstance(arrays["model"]["w"], np.ndarray)
    np.testing.assert_array_equal(arrays["model"]["w"], model["w"].value)
    np.testing.assert_array_equal(arrays["optimizer"]["m"]["model"]["b"], state.get_slot(model["b"], "m").value)
    assert int(arrays["save_counter"]) == 7
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[1])
    placed = checkpoint.restore_arrays(mgr.latest_checkpoint, sharding=sharding)
    assert placed["model"]["w"].sharding == sharding
    prefix = checkpoint.write_name_based(str(tmp_path / "tf1"), {"w": np.ones(2, np.float32)})
    with pytest.raises(ValueError) as e:
        checkpoint.restore_arrays(prefix)
    assert str(e.value) == (f"checkpoint.restore_arrays: {prefix!r} is a name-based checkpoint (no object graph); "
                            "read its values by name with checkpoint.read_checkpoint(path).get(key).")


def test_restore_arrays_of_crafted_object_graphs(tmp_path):
    # Graphs TF never writes, each an IndexError before: no nodes at all, a root that is itself a value, a slot
    # reference past the last node.
    from checkpoint.protos.trackable_object_graph_pb2 import TrackableObjectGraph

    def written(name, nodes):
        graph = TrackableObjectGraph()
        for attributes, slots in nodes:
            node = graph.nodes.add()
            for key in attributes:
                node.attributes.add(name="VARIABLE_VALUE", checkpoint_key=key, full_name=key)
            for original, slot in slots:
                node.slot_variables.add(original_variable_node_id=original, slot_variable_node_id=slot, slot_name="m")
        prefix = str(tmp_path / name)
        _storage.write_bundle(prefix, {"_CHECKPOINTABLE_OBJECT_GRAPH": graph.SerializeToString(),
                                       "x": np.ones(2, np.float32)})
        return prefix

    prefix = written("empty", [])
    with pytest.raises(checkpoint.CheckpointFormatError) as e:
        checkpoint.restore_arrays(prefix)
    assert str(e.value) == (f"{prefix}.index: its object graph (_CHECKPOINTABLE_OBJECT_GRAPH) has no nodes; TF's "
                            "always holds the root object, node 0")
    with pytest.raises(checkpoint.CheckpointFormatError, match="has no nodes"):  # restore reads the same graph
        checkpoint.Checkpoint(w=varstate.Variable(jnp.zeros(2))).restore(prefix)
    prefix = written("root_value", [(["x"], [])])
    with pytest.raises(ValueError) as e:
        checkpoint.restore_arrays(prefix)
    assert str(e.value) == (f"checkpoint.restore_arrays: the root object of {prefix!r} is itself a value ('x'), "
                            "which has no path below the root; read it by key with "
                            "checkpoint.read_checkpoint(path).get(key).")
    assert checkpoint.read_checkpoint(prefix).get("x").tolist() == [1.0, 1.0]  # the fix the message gives
    prefix = written("slot", [([], [(0, 99)])])
    with pytest.raises(checkpoint.CheckpointFormatError) as e:
        checkpoint.restore_arrays(prefix)
    assert str(e.value) == (f"checkpoint.restore_arrays: {prefix!r}: a slot variable reference of node 0 refers to "
                            "node 99, but the object graph has 1 nodes")
