"""Crash safety (SIGKILL at several points of a save) and async saves followed by donated updates."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import checkpoint
import varstate
from varstate.optimizers import Adam

# One worker for the whole module under `--dist loadgroup`: its module-scoped fixture then runs once.
pytestmark = pytest.mark.xdist_group("checkpoint_safety")

# The child saves steps 1, 2, 3, ... with a CheckpointManager (max_to_keep=2); at save 3 it kills itself
# with SIGKILL at the point named by argv[2] (or it is killed from outside). The points are the steps of a
# save, each one small function of checkpoint._storage._publish or checkpoint._manager (the seams), not orbax's.
CHILD = textwrap.dedent(
    """
    import os, signal, sys
    import jax.numpy as jnp
    import checkpoint, varstate
    from checkpoint import _manager
    from checkpoint._storage import _files, _publish

    directory, point = sys.argv[1], sys.argv[2]
    step = 0
    calls = {}

    def wrap(module, name, nth=1, when=lambda *args: True):
        original = getattr(module, name)
        def patched(*args, **kwargs):
            if step == 3 and when(*args):
                calls[name] = calls.get(name, 0) + 1
                if calls[name] == nth:
                    os.kill(os.getpid(), signal.SIGKILL)
            return original(*args, **kwargs)
        setattr(module, name, patched)

    if point == "before-commit":
        wrap(_publish, "move_into_place")  # values written under the temporary name, not moved in
    elif point == "before-state":
        wrap(_manager, "record_latest")  # moved in, not yet recorded as the latest
    elif point == "mid-state-write":
        # the state file half written beside the real one
        wrap(_files, "sync_path", when=lambda path: os.path.basename(path).startswith(".checkpoint.tmp-"))
    elif point == "before-delete":
        wrap(_publish, "retire")  # recorded as the latest; the oldest still listed, not deleted
    elif point == "mid-delete":
        wrap(_publish, "delete_tree")  # the oldest renamed away, being deleted
    elif point == "before-unlist":
        wrap(_manager, "record_latest", 2)  # the oldest deleted, still listed
    mgr = checkpoint.CheckpointManager(directory, max_to_keep=2)
    while True:
        step += 1
        model = {"w": varstate.Variable(jnp.full(4, float(step))), "big": jnp.full(300_000, float(step))}
        mgr.save(step, model=model)
        print("saved", step, flush=True)
    """
)


def run_child(directory, point, forked_python):
    if point != "timed":  # it kills itself: a child forked from an interpreter that has imported jax will do
        proc = forked_python(CHILD, directory, point)
        assert proc.returncode == -signal.SIGKILL, proc.stdout + proc.stderr
        return proc.stdout
    # Killed from outside, somewhere inside save 4: a process of its own, whose pid and output the test watches.
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="")
    proc = subprocess.Popen([sys.executable, "-c", CHILD, directory, point], stdout=subprocess.PIPE, text=True, env=env)
    for line in proc.stdout:
        if line.strip() == "saved 3":
            time.sleep(0.05)  # somewhere inside save 4
            proc.send_signal(signal.SIGKILL)
            break
    proc.wait(timeout=120)
    out = proc.stdout.read() if not proc.stdout.closed else ""
    proc.stdout.close()
    assert proc.returncode == -signal.SIGKILL, out
    return out


POINTS = ["before-commit", "before-state", "mid-state-write", "before-delete", "mid-delete", "before-unlist", "timed"]


@pytest.mark.parametrize("point", POINTS)
def test_a_killed_save_leaves_the_last_good_checkpoint(tmp_path, forked_python, point):
    directory = str(tmp_path)
    run_child(directory, point, forked_python)
    latest = checkpoint.latest_checkpoint(directory)
    assert latest is not None
    step = int(latest.rsplit("-", 1)[1])
    # Recorded as the latest from the first write of the state file on.
    assert step == (3 if point in ("before-delete", "mid-delete", "before-unlist") else 2) or point == "timed"
    assert step >= (3 if point == "timed" else 2)
    template = {"w": varstate.Variable(jnp.zeros(4)), "big": jnp.zeros(300_000)}
    got = checkpoint.Checkpoint(model=template).restore(latest).assert_consumed().model
    assert got["w"].value.tolist() == [float(step)] * 4
    np.testing.assert_array_equal(got["big"], np.full(300_000, float(step), np.float32))
    # A new manager carries on from the last good checkpoint; its first save removes the leftovers.
    mgr = checkpoint.CheckpointManager(directory, max_to_keep=2)
    assert mgr.latest_checkpoint == latest
    mgr.save(step + 1, model=template)
    assert not [p for p in os.listdir(directory) if "tmp" in p or "varstate" in p]
    assert checkpoint.latest_checkpoint(directory).endswith(f"ckpt-{step + 1}")
    # max_to_keep holds again: a checkpoint the kill left listed, or on disk and unlisted, is gone.
    assert sorted(p for p in os.listdir(directory) if p.startswith("ckpt")) == [f"ckpt-{step}", f"ckpt-{step + 1}"]


def test_async_save_then_donated_optimizer_steps_keep_the_values_at_save_time(tmp_path):
    mgr = checkpoint.CheckpointManager(str(tmp_path), async_save=True, max_to_keep=None)
    params = {"big": varstate.Variable(jnp.ones(600_000)), "small": varstate.Variable(jnp.ones(8))}
    opt = Adam(0.5)
    state = opt.init(params)
    grads = {"big": jnp.ones(600_000), "small": jnp.ones(8)}
    params, state = opt.apply_gradients(grads, params, state)
    # The step right after `save` donates the saved buffers. While orbax still reads a buffer,
    # XLA refuses the donation (and copies); once it has its copy, the donation goes through.
    # Both must leave the checkpoint with the values of the time of `save`: the first save steps at once
    # (either may happen), the second once the save is committed, so orbax has let go and the donation must happen.
    outcomes = []
    for attempt in range(1, 3):
        expected = jax.tree.map(lambda x: np.asarray(x.copy()), (params, state))
        mgr.save(attempt, model=params, optimizer=state)
        if attempt == 2:
            mgr.wait_until_finished()
        saved_big, saved_m = params["big"].value, state.get_slot(params["big"], "m").value
        params, state = opt.apply_gradients(grads, params, state)
        params, state = opt.apply_gradients(grads, params, state)
        outcomes.append(saved_big.is_deleted() and saved_m.is_deleted())
        mgr.wait_until_finished()
        t_params = {"big": varstate.Variable(jnp.zeros(600_000)), "small": varstate.Variable(jnp.zeros(8))}
        got = mgr.restore(attempt, model=t_params, optimizer=opt.init(t_params)).assert_consumed()
        restored = jax.tree.map(np.asarray, (got.model, got.optimizer))
        for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(expected), strict=True):
            np.testing.assert_array_equal(a, b)
    assert outcomes[-1], f"the saved buffers were not donated once the save was committed: {outcomes}"
    assert not np.array_equal(np.asarray(params["big"].value), expected[0]["big"])  # training moved on
    mgr.close()
