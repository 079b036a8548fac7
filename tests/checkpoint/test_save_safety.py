"""Nothing lost: overwrites that are never a moment without a checkpoint (SIGKILL at every step of the swap),
asynchronous saves committed at interpreter exit, and leftovers removed without touching a live save."""

import errno
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import jax.numpy as jnp
import numpy as np
import pytest

import checkpoint
import varstate
from checkpoint import _manager
from checkpoint._storage import _journal, _publish

# One worker for the whole module under `--dist loadgroup`: its module-scoped fixture then runs once.
pytestmark = pytest.mark.xdist_group("save_safety")

ENV = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="")

def model(x):
    return {"w": varstate.Variable(jnp.full(4, float(x))), "big": jnp.full(300_000, float(x))}


def template():
    return {"w": varstate.Variable(jnp.zeros(4)), "big": jnp.zeros(300_000)}


def restored_value(path):
    """The one value every array of the checkpoint at `path` holds (they all come from one save)."""
    got = checkpoint.Checkpoint(m=template()).restore(path).assert_consumed().m
    w, big = np.asarray(got["w"].value), np.asarray(got["big"])
    assert (w == w[0]).all() and (big == w[0]).all(), (w, big[:3])
    return float(w[0])


def leftovers(directory):
    return sorted(n for n in os.listdir(directory)
                  if ".varstate-" in n or ".orbax-checkpoint-tmp" in n or ".tempstate" in n or ".tmp-" in n)


# ---------------------------------------------------------------------------
# overwrites, in one process
# ---------------------------------------------------------------------------
@pytest.mark.parametrize("first, second", [("orbax", "orbax"), ("tf", "tf"), ("orbax", "tf"), ("tf", "orbax")])
def test_a_fresh_checkpoints_save_replaces_ckpt_1_and_the_state_file_names_the_new_one(tmp_path, first, second):
    prefix = str(tmp_path / "ckpt")
    path = checkpoint.Checkpoint(m=model(1)).save(prefix, format=first)
    again = checkpoint.Checkpoint(m=model(2))  # a new process: its save_counter starts at 0 again
    assert again.save(prefix, format=second) == path
    assert checkpoint.latest_checkpoint(str(tmp_path)) == path and restored_value(path) == 2.0
    expected = ["checkpoint", "ckpt-1"] if second == "orbax" else ["checkpoint", "ckpt-1.data-00000-of-00001",
                                                                   "ckpt-1.index"]
    assert sorted(os.listdir(tmp_path)) == expected  # the other format's files went with the old checkpoint


def test_write_replaces_a_checkpoint_but_not_a_directory_that_is_none(tmp_path):
    path = str(tmp_path / "weights")
    checkpoint.Checkpoint(m=model(1)).write(path)
    checkpoint.Checkpoint(m=model(2)).write(path)
    assert restored_value(path) == 2.0 and sorted(os.listdir(tmp_path)) == ["weights"]
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    with pytest.raises(ValueError, match=r"Checkpoint.write: .*mine is a directory that is not a checkpoint \(it has "
                                         r"no meta/metadata\); refusing to replace it\. Remove it or choose another"):
        checkpoint.Checkpoint(m=model(3)).write(str(mine))
    (tmp_path / "afile").write_text("x")
    with pytest.raises(ValueError, match=r"Checkpoint.save: .*afile-1 exists and is not a directory, so an orbax "
                                         r"checkpoint cannot be written there.*format='tf'"):
        (tmp_path / "afile-1").write_text("x")
        checkpoint.Checkpoint(m=model(3)).save(str(tmp_path / "afile"))
    assert (mine / "notes.txt").read_text() == "keep me" and not leftovers(tmp_path)
    (tmp_path / "empty").mkdir()  # an empty directory is replaced
    checkpoint.Checkpoint(m=model(4)).write(str(tmp_path / "empty"))
    assert restored_value(str(tmp_path / "empty")) == 4.0


def test_a_failed_write_leaves_the_old_checkpoint_and_no_temporary(tmp_path, monkeypatch):
    path = checkpoint.Checkpoint(m=model(1)).save(str(tmp_path / "ckpt"))

    def fail(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(_publish, "move_into_place", fail)
    with pytest.raises(OSError, match="No space left on device"):
        checkpoint.Checkpoint(m=model(2)).save(str(tmp_path / "ckpt"))
    # The swap stopped with the old checkpoint gone and the new one not in: the state file names the stand-in.
    latest = checkpoint.latest_checkpoint(str(tmp_path))
    assert ".varstate-standin-" in latest and restored_value(latest) == 1.0
    monkeypatch.undo()
    checkpoint.Checkpoint(m=model(3)).write(str(tmp_path / "other"))  # the next save in the directory resolves it
    assert checkpoint.latest_checkpoint(str(tmp_path)) == path and restored_value(path) == 1.0
    assert sorted(os.listdir(tmp_path)) == ["checkpoint", "ckpt-1", "other"]


# ---------------------------------------------------------------------------
# SIGKILL at every step of the swap
# ---------------------------------------------------------------------------
# The child replaces ckpt-1 (the only checkpoint, value 1) by a checkpoint of value 2: a Checkpoint whose
# counter starts again (a new process), or a CheckpointManager with overwrite=True. It kills itself at the
# point named by argv[4].
SWAP_CHILD = textwrap.dedent(
    """
    import os, signal, sys
    import jax.numpy as jnp
    import checkpoint, varstate
    from checkpoint._storage import _publish

    directory, who, fmt, point = sys.argv[1:5]
    calls = {}
    in_retire = [False]

    def die():
        os.kill(os.getpid(), signal.SIGKILL)

    def before(name, nth=1):
        original = getattr(_publish, name)
        def patched(*args, **kwargs):
            calls[name] = calls.get(name, 0) + 1
            if calls[name] == nth:
                die()
            return original(*args, **kwargs)
        setattr(_publish, name, patched)

    if point == "mid-retire":  # the old checkpoint unpublished (renamed away, or its index gone), not deleted
        original_retire, original_sync = _publish.retire, _publish.sync_directory
        def retire(path):
            in_retire[0] = True
            original_retire(path)
        def sync(directory):
            original_sync(directory)
            if in_retire[0]:
                die()
        _publish.retire, _publish.sync_directory = retire, sync
    elif point == "mid-delete":  # deleting the old checkpoint's files
        def delete_tree(path):
            for root, _, files in os.walk(path):
                for f in files[:2]:
                    os.remove(os.path.join(root, f))
            die()
        _publish.delete_tree = delete_tree
    elif point != "none":
        name, nth = {
            "before-stand-in": ("link_stand_in", 1),
            "before-state-names-stand-in": ("point_state", 1),
            "before-retire": ("retire", 1),
            "before-move-in": ("move_into_place", 1),
            "before-state-names-path": ("point_state", 2),
            "before-stand-in-removed": ("remove", 1),
        }[point]
        before(name, nth)
    m = {"w": varstate.Variable(jnp.full(4, 2.0)), "big": jnp.full(300_000, 2.0)}
    if who == "checkpoint":
        checkpoint.Checkpoint(m=m).save(os.path.join(directory, "ckpt"), format=fmt)
    else:
        checkpoint.CheckpointManager(directory, format=fmt).save(1, overwrite=True, m=m)
    print("done", flush=True)
    """
)
POINTS = ["before-stand-in", "before-state-names-stand-in", "before-retire", "mid-retire", "mid-delete",
          "before-move-in", "before-state-names-path", "before-stand-in-removed", "none"]
CASES = [("checkpoint", fmt, p) for fmt in ("orbax", "tf") for p in POINTS if not (fmt == "tf" and p == "mid-delete")]
CASES += [("manager", "orbax", p) for p in ("before-state-names-stand-in", "mid-retire", "before-move-in")]
CASES += [("manager", "tf", p) for p in ("mid-retire", "before-state-names-path")]


@pytest.mark.parametrize("who, fmt, point", CASES)
def test_a_kill_at_any_step_of_an_overwrite_leaves_a_complete_latest_checkpoint(tmp_path, forked_python, who, fmt,
                                                                                 point):
    directory = str(tmp_path)
    if who == "checkpoint":
        checkpoint.Checkpoint(m=model(1)).save(os.path.join(directory, "ckpt"), format=fmt)
    else:
        checkpoint.CheckpointManager(directory, format=fmt).save(1, m=model(1))
    proc = forked_python(SWAP_CHILD, directory, who, fmt, point)
    if point == "none":
        assert proc.returncode == 0, proc.stderr
    else:
        assert proc.returncode == -signal.SIGKILL, proc.stderr
    latest = checkpoint.latest_checkpoint(directory)
    assert latest is not None, os.listdir(directory)
    value = restored_value(latest)
    # Before the new checkpoint is moved in, the latest is the old one; once it is in, the new one.
    late = POINTS.index(point) >= POINTS.index("before-state-names-path")
    assert value == (2.0 if late else 1.0), (point, value)
    if who == "manager":  # a reopened manager finds it too, under its step
        mgr = checkpoint.CheckpointManager(directory, format=fmt)
        assert mgr.all_steps() == [1] and restored_value(mgr.latest_checkpoint) == value
        mgr.save(2, m=model(3))
        assert mgr.all_steps() == [1, 2]
    else:  # the next save in the directory, by any Checkpoint, resolves the stand-in and removes the rest
        checkpoint.Checkpoint(m=model(3)).write(os.path.join(directory, "other"), format=fmt)
    assert leftovers(directory) == []
    assert restored_value(os.path.join(directory, "ckpt-1")) == value
    assert checkpoint.latest_checkpoint(directory).endswith("ckpt-2" if who == "manager" else "ckpt-1")


# ---------------------------------------------------------------------------
# an asynchronous save still running when the program ends
# ---------------------------------------------------------------------------
EXIT_CHILD = textwrap.dedent(
    """
    import sys
    import jax.numpy as jnp
    import checkpoint, varstate
    from checkpoint._storage import _publish

    directory, fmt, mode = sys.argv[1:4]
    if mode == "fail":
        def move_into_place(src, dst):
            raise OSError(28, "No space left on device")
        _publish.move_into_place = move_into_place
    mgr = checkpoint.CheckpointManager(directory, async_save=True, format=fmt)
    m = {"w": varstate.Variable(jnp.full(4, 2.0)), "big": jnp.full(3_000_000, 2.0)}
    mgr.save(2, m=m)
    print("saved, exiting", flush=True)
    # The program ends here: no wait_until_finished(), no close().
    """
)


@pytest.mark.parametrize("fmt", ["orbax", "tf"])
def test_an_async_save_pending_at_exit_is_committed_before_the_interpreter_exits(tmp_path, forked_python, fmt):
    proc = forked_python(EXIT_CHILD, str(tmp_path), fmt, "ok")
    assert proc.returncode == 0 and "saved, exiting" in proc.stdout, proc.stderr
    assert checkpoint.latest_checkpoint(str(tmp_path)) == str(tmp_path / "ckpt-2")
    got = checkpoint.Checkpoint(m={"w": varstate.Variable(jnp.zeros(4)), "big": jnp.zeros(3_000_000)}).restore(
        str(tmp_path / "ckpt-2")).assert_consumed().m
    assert got["w"].value.tolist() == [2.0] * 4
    np.testing.assert_array_equal(got["big"], np.full(3_000_000, 2.0, np.float32))
    assert leftovers(tmp_path) == []


def test_an_async_save_that_fails_at_exit_ends_the_process_with_an_error_naming_it(tmp_path, forked_python):
    proc = forked_python(EXIT_CHILD, str(tmp_path), "orbax", "fail")
    assert proc.returncode == 1 and "saved, exiting" in proc.stdout, proc.stderr
    assert (f"checkpoint: an asynchronous save still running when the program ended failed and was not committed: "
            f"{tmp_path / 'ckpt-2'}: OSError: [Errno 28] No space left on device. The previous checkpoint is still "
            "the latest.") in proc.stderr
    assert checkpoint.latest_checkpoint(str(tmp_path)) is None  # never committed
    checkpoint.CheckpointManager(str(tmp_path)).save(3, m=model(3))
    assert leftovers(tmp_path) == [] and sorted(os.listdir(tmp_path)) == ["checkpoint", "ckpt-3"]


# ---------------------------------------------------------------------------
# leftovers
# ---------------------------------------------------------------------------
def make_leftovers(directory):
    """One of each temporary a dead save leaves; returns their names."""
    names = ["ckpt-4.orbax-checkpoint-tmp", "ckpt-5.varstate-new-0123456789abcdef",
             "ckpt-5.varstate-new-0123456789abcdef.orbax-checkpoint-tmp", "ckpt-6.varstate-old-0123456789abcdef"]
    for name in names:
        os.makedirs(os.path.join(directory, name, "values"))
    files = [".checkpoint.tmp-0123456789abcdef", ".checkpoint_manager.json.tmp-0123456789abcdef",
             "ckpt-7.index.tempstate0123456789abcdef", "ckpt-7.data-00000-of-00001.tempstate0123456789abcdef",
             "ckpt-8.varstate-new-0123456789abcdef.index", "ckpt-8.varstate-new-0123456789abcdef.data-00000-of-00001",
             "ckpt-9.data-00000-of-00001"]  # the data of a TF checkpoint whose index was already deleted
    for name in files:
        with open(os.path.join(directory, name), "w") as f:
            f.write("half")
    return sorted(names + files)


@pytest.mark.parametrize("saver", ["manager", "checkpoint.save", "checkpoint.write"])
def test_the_next_save_in_the_directory_removes_every_leftover(tmp_path, saver):
    directory = str(tmp_path)
    keep = ["unrelated.txt", "ckpt-3.index", "ckpt-3.data-00000-of-00001"]
    (tmp_path / "unrelated.txt").write_text("mine")
    checkpoint.Checkpoint(w=jnp.ones(2)).write(str(tmp_path / "ckpt-3"), format="tf")
    made = make_leftovers(directory)
    assert leftovers(directory) == [n for n in made if n != "ckpt-9.data-00000-of-00001"]
    checkpoint.CheckpointManager(directory)  # one that only restores removes nothing
    if saver == "manager":
        checkpoint.CheckpointManager(directory).save(10, m=model(10))
        new = ["checkpoint", "ckpt-10"]
    elif saver == "checkpoint.save":
        checkpoint.Checkpoint(m=model(10)).save(str(tmp_path / "x"), format="tf")
        new = ["checkpoint", "x-1.data-00000-of-00001", "x-1.index"]
    else:
        checkpoint.Checkpoint(m=model(10)).write(str(tmp_path / "x"))
        new = ["x"]
    assert sorted(os.listdir(directory)) == sorted(keep + new)


LIVE_SAVE = textwrap.dedent(
    """
    import os, sys
    from checkpoint._storage import _publish

    directory = sys.argv[1]
    lock = _publish.begin(directory)  # what every save holds while its temporaries exist
    os.makedirs(os.path.join(directory, "ckpt-9.varstate-new-0123456789abcdef", "values"))
    print("saving", flush=True)
    sys.stdin.read()  # until the test closes stdin
    """
)


def test_a_save_never_touches_the_temporaries_of_another_live_save(tmp_path):
    directory = str(tmp_path)
    proc = subprocess.Popen([sys.executable, "-c", LIVE_SAVE, directory], env=ENV, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "saving"
        os.makedirs(tmp_path / "ckpt-8.orbax-checkpoint-tmp")  # as if the live process's orbax wrote it
        mgr = checkpoint.CheckpointManager(directory)
        mgr.save(1, m=model(1))  # beside it: both saves proceed, nothing of the other's is removed
        checkpoint.Checkpoint(m=model(2)).save(str(tmp_path / "ckpt"))
        assert leftovers(directory) == ["ckpt-8.orbax-checkpoint-tmp", "ckpt-9.varstate-new-0123456789abcdef"]
    finally:
        proc.stdin.close()
        proc.wait(timeout=60)
        proc.stdout.close()
    mgr.save(3, m=model(3))  # the other process has gone: its temporaries are now leftovers
    assert leftovers(directory) == []


def test_a_save_holding_the_lock_in_this_process_is_alive_too(tmp_path):
    other = _publish.begin(str(tmp_path))  # an asynchronous save of another manager, say
    os.makedirs(tmp_path / "ckpt-9.varstate-new-0123456789abcdef")
    checkpoint.Checkpoint(m=model(1)).save(str(tmp_path / "ckpt"))
    assert leftovers(tmp_path) == ["ckpt-9.varstate-new-0123456789abcdef"]
    other.release()
    other.release()  # idempotent
    checkpoint.Checkpoint(m=model(2)).write(str(tmp_path / "x"))
    assert leftovers(tmp_path) == []


def test_without_flock_only_temporaries_unchanged_for_an_hour_are_removed(tmp_path, monkeypatch):
    def no_flock(fd, operation):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(_publish, "_flock", no_flock)
    made = make_leftovers(str(tmp_path))
    old = time.time() - _publish.STALE_AFTER_S - 60
    stale = ["ckpt-6.varstate-old-0123456789abcdef", ".checkpoint.tmp-0123456789abcdef"]
    for name in stale:
        for root, dirs, files in os.walk(tmp_path / name):
            for n in dirs + files:
                os.utime(os.path.join(root, n), (old, old))
        os.utime(tmp_path / name, (old, old))
    os.utime(tmp_path / "ckpt-4.orbax-checkpoint-tmp", (old, old))  # but its values/ changed recently
    checkpoint.Checkpoint(m=model(1)).write(str(tmp_path / "x"))
    assert leftovers(tmp_path) == sorted(set(made) - set(stale) - {"ckpt-9.data-00000-of-00001"})
    assert os.path.exists(tmp_path / "ckpt-9.data-00000-of-00001")  # recent too


def test_a_kill_between_the_state_file_and_the_deletion_orphans_nothing(tmp_path, monkeypatch):
    # The oldest stays listed until it is deleted: killed in between (here: its deletion fails), the next
    # commit deletes it, so max_to_keep holds; deleted but still listed, it is dropped on reopening.
    mgr = checkpoint.CheckpointManager(str(tmp_path), max_to_keep=2)
    for step in (1, 2):
        mgr.save(step, m=model(step))
    real_retire = _publish.retire

    def broken(path):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(_publish, "retire", broken)
    with pytest.raises(OSError, match="Input/output error"):
        mgr.save(3, m=model(3))
    assert checkpoint.latest_checkpoint(str(tmp_path)) == str(tmp_path / "ckpt-3")
    reopened = checkpoint.CheckpointManager(str(tmp_path), max_to_keep=2)
    assert reopened.all_steps() == [1, 2, 3]
    monkeypatch.setattr(_publish, "retire", real_retire)
    reopened.save(4, m=model(4))
    assert reopened.all_steps() == [3, 4]
    assert sorted(os.listdir(tmp_path)) == ["checkpoint", "ckpt-3", "ckpt-4"]


def test_a_checkpoint_moved_in_but_never_recorded_is_an_orphan_the_next_save_deletes(tmp_path, monkeypatch):
    directory = str(tmp_path)
    mgr = checkpoint.CheckpointManager(directory, best_fn=lambda m: m["acc"])
    mgr.save(1, metrics={"acc": 0.5}, m=model(1))
    real_record = _manager.record_latest

    def killed(*args, **kwargs):  # the process dies after the checkpoint is in place, before it is recorded
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(_manager, "record_latest", killed)
    for step in (2, 3):
        with pytest.raises(OSError, match="Input/output error"):
            checkpoint.CheckpointManager(directory, best_fn=lambda m: m["acc"]).save(
                step, metrics={"acc": 0.9}, m=model(step))
    monkeypatch.setattr(_manager, "record_latest", real_record)
    assert checkpoint.latest_checkpoint(directory) == str(tmp_path / "ckpt-1")
    # The save of step 3 deleted the orphan of step 2; its own is on disk, unlisted.
    assert not os.path.exists(tmp_path / "ckpt-2") and os.path.isdir(tmp_path / "ckpt-3")
    # Resumed from step 1, the run saves step 3 again: no StepAlreadyExistsError, since step 3 was never
    # recorded. (Had it not reached step 3, its next save would have deleted it all the same.)
    resumed = checkpoint.CheckpointManager(directory, best_fn=lambda m: m["acc"])
    assert resumed.all_steps() == [1] and resumed.should_save(3) is False  # on disk until the next save
    resumed.save(3, metrics={"acc": 0.7}, m=model(22))
    assert resumed.all_steps() == [1, 3] and restored_value(str(tmp_path / "ckpt-3")) == 22.0
    assert sorted(os.listdir(directory)) == ["checkpoint", "checkpoint_manager.json", "ckpt-1", "ckpt-3"]
    with open(tmp_path / "checkpoint_manager.json") as f:
        assert json.load(f) == {"format": "varstate-checkpoint-manager", "version": 1, "saving": {},
                                "metrics": {"ckpt-1": {"acc": 0.5}, "ckpt-3": {"acc": 0.7}}}


def test_a_save_killed_after_recording_its_checkpoint_committed_with_its_metrics(tmp_path, monkeypatch):
    directory = str(tmp_path)
    calls = []
    real_store = _journal.Journal.store

    def store(self):
        calls.append(dict(self.saving))
        if len(calls) == 2:  # the one after recording: the process dies before it
            raise OSError(errno.EIO, "Input/output error")
        real_store(self)

    monkeypatch.setattr(_journal.Journal, "store", store)
    with pytest.raises(OSError, match="Input/output error"):
        checkpoint.CheckpointManager(directory, max_to_keep=1, best_fn=lambda m: -m["loss"]).save(
            1, metrics={"loss": 0.25}, m=model(1))
    monkeypatch.undo()
    assert list(calls[0]) == ["ckpt-1"] and checkpoint.latest_checkpoint(directory) == str(tmp_path / "ckpt-1")
    reopened = checkpoint.CheckpointManager(directory, max_to_keep=1, best_fn=lambda m: -m["loss"])
    assert reopened.all_steps() == [1] and reopened._metrics_of(1) == {"loss": 0.25}
    reopened.save(2, metrics={"loss": 0.5}, m=model(2))
    reopened.save(3, metrics={"loss": 0.75}, m=model(3))
    assert reopened.all_steps() == [1, 3]  # ckpt-1 is the best: its metrics were kept


def test_an_interrupted_overwrite_of_a_checkpoint_kept_for_good_leaves_one_there(tmp_path, monkeypatch):
    directory = str(tmp_path)
    mgr = checkpoint.CheckpointManager(directory, max_to_keep=1, keep_every_n_steps=2)
    for step in (2, 3):
        mgr.save(step, m=model(step))
    assert mgr.all_steps() == [3] and os.path.isdir(tmp_path / "ckpt-2")  # preserved: unlisted, kept for good

    def killed(*args, **kwargs):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(_manager, "record_latest", killed)
    with pytest.raises(OSError, match="Input/output error"):
        mgr.save(2, overwrite=True, m=model(22))
    monkeypatch.undo()
    checkpoint.CheckpointManager(directory, max_to_keep=1, keep_every_n_steps=2).save(5, m=model(5))
    assert restored_value(str(tmp_path / "ckpt-2")) == 22.0  # not taken for an orphan: it replaced one
    assert sorted(os.listdir(directory)) == ["checkpoint", "ckpt-2", "ckpt-5"]
