"""CheckpointManager, latest_checkpoint and TF's `checkpoint` state file."""

import os

import jax.numpy as jnp
import numpy as np
import pytest
from google.protobuf import text_format

import checkpoint
import varstate
from checkpoint import _storage
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


def test_saving_a_step_again_unlists_it_while_it_is_rewritten(tmp_path, monkeypatch):
    mgr = checkpoint.CheckpointManager(str(tmp_path))
    mgr.save(1, m=model(1))
    mgr.save(2, m=model(2))
    seen = []
    original = checkpoint.Checkpoint.write

    def spy(self, path, *args, **kwargs):
        seen.append(checkpoint.latest_checkpoint(os.path.dirname(path)))
        return original(self, path, *args, **kwargs)

    monkeypatch.setattr(checkpoint.Checkpoint, "write", spy)
    mgr.save(2, m=model(22))
    assert seen == [str(tmp_path / "ckpt-1")]  # while ckpt-2 is rewritten, ckpt-1 is the latest
    assert mgr.checkpoints == [str(tmp_path / "ckpt-1"), str(tmp_path / "ckpt-2")]
    assert mgr.restore(m=template()).m["w"].value.tolist() == [22.0] * 3
    only = checkpoint.CheckpointManager(str(tmp_path / "only"))
    only.save(5, m=model(5))
    monkeypatch.setattr(checkpoint.Checkpoint, "write", spy)
    only.save(5, m=model(6))
    assert seen[-1] is None and only.restore(m=template()).m["w"].value.tolist() == [6.0] * 3


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


def test_a_root_named_step(tmp_path):
    # `step` (the checkpoint number) is positional-only, so a root may be called step, as in TF's Checkpoint.
    mgr = checkpoint.CheckpointManager(str(tmp_path))
    mgr.save(7, m=model(7), step=np.int64(7))
    mgr.save(8, m=model(8), step=np.int64(8))
    assert mgr.restore(step=np.int64(0)).expect_partial().step == 8
    assert mgr.restore(7, step=np.int64(0)).expect_partial().step == 7
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
