"""A killed save's unrecorded checkpoint is removed whatever the clock says, once no save holds the lock."""

import json
import os
import textwrap
import time

import jax.numpy as jnp
import pytest

import checkpoint
import varstate
from checkpoint._storage import _publish

# Shares the forked interpreter of tests/checkpoint/conftest.py with the other crash-safety tests.
pytestmark = pytest.mark.xdist_group("save_safety")

KILLED_BEFORE_RECORDING = textwrap.dedent(
    """
    import os, signal, sys
    import jax.numpy as jnp
    import checkpoint, varstate
    from checkpoint import _manager

    mgr = checkpoint.CheckpointManager(sys.argv[1])
    mgr.save(1, m={"w": varstate.Variable(jnp.full(4, 1.0))})
    # Killed after step 2 is in place and in the journal's saves in flight, before the state file lists it.
    _manager.record_latest = lambda *args, **kwargs: os.kill(os.getpid(), signal.SIGKILL)
    mgr.save(2, m={"w": varstate.Variable(jnp.full(4, 2.0))})
    """
)


def killed_save_from_the_future(forked_python, directory):
    """Leaves ckpt-2 unrecorded by a killed save, dated a day ahead: the clock has gone back since."""
    proc = forked_python(KILLED_BEFORE_RECORDING, directory)
    assert proc.returncode == -9, proc.stderr
    journal = os.path.join(directory, _publish.MANAGER_FILE)
    with open(journal) as f:
        state = json.load(f)
    future = time.time() + 86400
    assert list(state["saving"]) == ["ckpt-2"]
    state["saving"]["ckpt-2"]["since"] = future
    with open(journal, "w") as f:
        json.dump(state, f)
    for root, dirs, files in os.walk(os.path.join(directory, "ckpt-2")):
        for name in [root, *(os.path.join(root, n) for n in dirs + files)]:
            os.utime(name, (future, future))


def test_a_killed_saves_unrecorded_checkpoint_dated_in_the_future_is_removed(tmp_path, forked_python):
    directory = str(tmp_path)
    killed_save_from_the_future(forked_python, directory)
    resumed = checkpoint.CheckpointManager(directory)
    assert resumed.all_steps() == [1]
    resumed.save(2, m={"w": varstate.Variable(jnp.full(4, 22.0))})  # no StepAlreadyExistsError
    assert resumed.all_steps() == [1, 2]
    got = checkpoint.Checkpoint(m={"w": varstate.Variable(jnp.zeros(4))}).restore(str(tmp_path / "ckpt-2")).m
    assert float(got["w"].value[0]) == 22.0
    assert sorted(os.listdir(directory)) == ["checkpoint", "ckpt-1", "ckpt-2"]  # no journal: nothing in flight


def test_while_another_save_holds_the_lock_the_unrecorded_checkpoint_is_left_alone(tmp_path, forked_python):
    directory = str(tmp_path)
    killed_save_from_the_future(forked_python, directory)
    other = _publish.begin(directory)  # a live save, whose checkpoint step 2 might be
    try:
        with pytest.raises(checkpoint.StepAlreadyExistsError, match="step 2 is already saved"):
            checkpoint.CheckpointManager(directory).save(2, m={"w": varstate.Variable(jnp.full(4, 22.0))})
    finally:
        other.release()
    assert os.path.isdir(tmp_path / "ckpt-2")
