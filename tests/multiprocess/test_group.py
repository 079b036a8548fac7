"""varstate and checkpoint in a 2-process jax.distributed group (2 x 4 CPU devices, gloo), against one process.

Each launch costs seconds of JAX start-up, so one launch checks several
points: see the child scripts for what each process does.
"""

from __future__ import annotations

import os
import re
import sys
import threading
import time

import jax
import numpy as np
import pytest

import checkpoint
import varstate

sys.path.insert(0, os.path.dirname(__file__))  # the model the children build
import model as sm

# One worker for the whole module under `--dist loadgroup`: its module-scoped fixture then runs once.
pytestmark = pytest.mark.xdist_group("multiprocess_group")


def _chunks(store: str) -> set[str]:
    """The chunk keys in one process's OCDBT store (metadata entries left out)."""
    import tensorstore as ts

    kv = ts.KvStore.open({"driver": "ocdbt", "base": f"file://{store}"}).result()
    return {k.decode() for k in kv.list().result() if not k.decode().rsplit("/", 1)[-1].startswith(".")}


def _flat(tree) -> dict:
    leaves = jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, varstate.Variable))
    return {v.name: v for v in varstate.expand_variables(leaves)}


@pytest.fixture(scope="module")
def reference():
    """The same training run in this one process, on a mesh of its 8 devices."""
    registry = varstate.Registry()
    params, opt, state, losses = sm.train(sm.mesh(), registry)
    return {"params": params, "opt": opt, "state": state, "losses": losses,
            "values": {n: np.asarray(v.value) for n, v in _flat(params).items()}}


def _templates(devices, zeros=True):
    mesh = sm.mesh(devices)
    model = sm.make(mesh, varstate.Registry(), zeros=zeros)
    return model, sm.Adam(1e-2).init(model)


def _close(got, want, err_msg=""):
    """Equal up to the order in which gradients are summed over devices.

    One process sums a gradient over its 8 devices in one order, two processes
    of 4 in another. Reordering a float32 sum of n terms moves it by up to about
    n * eps * (the sum of the terms' magnitudes), a bound relative to the
    magnitudes summed, not to the result: where terms nearly cancel, the result's
    own relative error is unbounded, and Adam's m / sqrt(v) carries that into
    the values. So the bound is relative to the array's largest element: with
    n = 8 and eps = 6e-8, a few 1e-7 per step over the run's 3 steps; 1e-5 of
    the largest element leaves a factor of 50 over the largest seen (1.8e-7). Elements away
    from zero keep the tighter 1e-5 relative bound of each element.
    """
    got, want = np.asarray(got), np.asarray(want)
    scale = float(np.max(np.abs(want))) if want.size else 0.0
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * scale, err_msg=err_msg)


class _Evaluator(threading.Thread):
    """A process outside the group: reads whatever `latest_checkpoint` names while the group saves."""

    def __init__(self, directory: str) -> None:
        super().__init__(daemon=True)
        self.directory, self.seen, self.errors, self.done = directory, set(), [], threading.Event()

    def run(self) -> None:
        while True:
            last = self.done.is_set()  # one look after the group ended: its latest checkpoint is always read
            path = checkpoint.latest_checkpoint(self.directory) if os.path.isdir(self.directory) else None
            if path and path not in self.seen:
                try:
                    reader = checkpoint.read_checkpoint(path)
                    reader.get("model/dense0/kernel/.ATTRIBUTES/VARIABLE_VALUE")
                    self.seen.add(path)
                except Exception as e:  # deleted since (max_to_keep) is fine; anything else is a torn read
                    if os.path.exists(path):
                        self.errors.append(f"{path}: {e!r}")
            if last:
                return
            time.sleep(0.05)


def test_train_save_and_restore_across_process_counts(group, tmp_path, reference):
    evaluator = _Evaluator(str(tmp_path / "managed"))
    evaluator.start()
    try:
        out = group("child_train.py")
    finally:
        evaluator.done.set()
        evaluator.join()
    r0, r1 = out[0].results, out[1].results

    # 1. Identity: the same names and resource ids on both processes, as in one process.
    assert r0["names"] == r1["names"] == sorted(reference["values"])
    assert r0["ids"] == r1["ids"]
    # 2. The variables are split across processes, and the SPMD step gives the single-process numbers.
    assert not any(r0["addressable"].values())
    np.testing.assert_allclose(r0["losses"], reference["losses"], rtol=1e-5)
    for name, want in reference["values"].items():
        _close(np.asarray(r0["values"][name]), want, err_msg=name)
        _close(np.asarray(r1["values"][name]), want, err_msg=name)
    # Adam's slots live where their primaries do: split over the processes' devices too.
    assert sum("'x'" in s for s in r0["slot_shardings"].values()) >= 8

    # 3. Each process wrote its own shards: orbax's per-process stores hold disjoint chunks (process 0 those
    # of its devices 0-3, process 1 those of 4-7), and nothing was gathered to one host.
    _, second, counter = r0["saved"]
    chunks = [_chunks(os.path.join(second, "values", f"ocdbt.process_{p}")) for p in (0, 1)]
    assert chunks[0] and chunks[1] and not chunks[0] & chunks[1]
    arrays = {k.split("/")[0] for k in chunks[1]}
    assert len(arrays) == 12  # 2 kernels and emb's 2 shards, each with Adam's m and v
    for name in arrays:
        mine = sorted(k for k in chunks[1] if k.startswith(name + "/"))
        assert len(mine) == 4, mine  # half of the 8 shards
    assert counter == 2 and second.endswith("model-2") and r1["saved"] == r0["saved"]
    assert checkpoint.latest_checkpoint(os.path.dirname(second)) == second
    reader = checkpoint.read_checkpoint(second)
    _close(reader.get("model/dense0/kernel/.ATTRIBUTES/VARIABLE_VALUE"),
                               reference["values"]["dense0/kernel"])

    # 4. Restored onto one process: 8 devices and 2 devices, by the templates' shardings.
    for devices in (jax.devices(), jax.devices()[:2]):
        model, state = _templates(devices)
        status = checkpoint.Checkpoint(model=model, optimizer=state).restore(second).assert_consumed()
        for name, v in _flat(status.model).items():
            _close(np.asarray(v.value), reference["values"][name])
            assert v.value.sharding == _flat(model)[name].value.sharding
        for got, want in zip(jax.tree.leaves(status.optimizer), jax.tree.leaves(reference["state"]), strict=True):
            _close(np.asarray(got), np.asarray(want))

    # 6. CheckpointManager, sync and async: the same steps on every process; one state file, old ones deleted.
    for name in ("managed", "managed_async"):
        assert r0[name] == r1[name] == [[2, 3], 3]
        directory = tmp_path / name
        assert checkpoint.latest_checkpoint(str(directory)) == str(directory / "ckpt-3")
        assert sorted(p for p in os.listdir(directory) if not p.endswith(".json")) == ["checkpoint", "ckpt-2",
                                                                                        "ckpt-3"]
    for name, want in reference["values"].items():
        _close(np.asarray(r0["restored_2x4"][name]), want)
    # The evaluator never saw a checkpoint that was not complete, and read the final one.
    assert not evaluator.errors, evaluator.errors
    assert str(tmp_path / "managed" / "ckpt-3") in evaluator.seen

    # 1. A process whose program differs: both fail before writing, naming the processes.
    for i, r in enumerate((r0, r1)):
        kind, message = r["mismatch"]
        assert kind == "ProcessGroupError"
        assert f"Process {i}: the object graph of the saved roots differs between processes" in message
        assert f"processes [{i}] have one version, processes [{1 - i}] another" in message
    assert checkpoint.latest_checkpoint(str(tmp_path / "mismatch")) is None
    for i, r in enumerate((r0, r1)):  # and restoring into templates that differ, before anything is read
        kind, message = r["mismatch_restore"]
        assert kind == "ProcessGroupError"
        assert f"Process {i}: the object graph of the restore templates differs between processes" in message
    # 5. The TF format: a data file per process, one merged index listing every key with its shard.
    tf_path = r0["tf"]
    assert r1["tf"] == tf_path and checkpoint.latest_checkpoint(str(tmp_path / "tf")) == tf_path
    assert sorted(n for n in os.listdir(tmp_path / "tf") if n.startswith("model")) == [
        "model-1.data-00000-of-00002", "model-1.data-00001-of-00002", "model-1.index"]
    from checkpoint._storage import BundleReader

    bundle = BundleReader(tf_path)
    assert bundle.num_shards == 2
    kernel = "model/dense0/kernel/.ATTRIBUTES/VARIABLE_VALUE"
    slices = bundle.get_slices(kernel)
    assert len(slices) == 8  # one per device's shard, 4 in each process's data file
    _close(bundle.get(kernel), reference["values"]["dense0/kernel"])
    model, state = _templates(jax.devices())
    status = checkpoint.Checkpoint(model=model, optimizer=state).restore(tf_path).assert_consumed()
    for name, v in _flat(status.model).items():
        _close(np.asarray(v.value), reference["values"][name])
    assert not [n for n in os.listdir(tmp_path / "mismatch") if n.startswith("model")]


def test_restore_onto_more_processes_and_a_process_dying_in_a_save(group, tmp_path, reference):
    one = str(tmp_path / "one_process")
    checkpoint.Checkpoint(model=reference["params"], optimizer=reference["state"]).write(one)
    out = group("child_resume.py", one, "8", all_succeed=False)
    assert [o.returncode for o in out] == [0, 17], "\n".join(map(str, out))
    r0 = out[0].results

    # 4. Saved by one process (8 devices), restored split over two (2 x 4), by the templates' shardings.
    for name, want in reference["values"].items():
        np.testing.assert_array_equal(np.asarray(r0["restored"][name]), want)
        np.testing.assert_array_equal(np.asarray(out[1].results["restored"][name]), want)
    assert r0["restored_sharding"]["dense0/kernel"] == [False, "P(None, 'x')"]
    assert r0["restored_sharding"]["dense1/kernel"] == [False, "P('x', None)"]

    # 8. Lazy Adam from IndexedSlices on a table split over both processes: the single-process numbers, only
    # rows 1 and 40 change, and the only traffic is those rows (3 per array: table, m, v), never the table.
    lazy = r0["lazy"]
    table, slots, collectives = sm.lazy_embedding_step(sm.mesh())
    np.testing.assert_allclose(np.asarray(lazy["table"]), np.asarray(table.value), rtol=1e-6)
    for got, want in zip(lazy["slots"], jax.tree.leaves(slots), strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6)
    start = np.arange(64 * 16, dtype=np.float32).reshape(64, 16) / 100
    changed = np.nonzero(np.any(np.asarray(lazy["table"]) != start, axis=1))[0].tolist()
    assert changed == [1, 40]
    assert lazy["addressable"] is False and lazy["spec"] == "P('x', None)"
    assert lazy["collectives"] == collectives == ["f32[3,16] all-reduce"]

    # 7. Process 1 died after writing its shards: process 0 fails within the barrier timeout, naming it;
    # the save is not published and the last good checkpoint stays the latest.
    kind, message = r0["dying_save"]
    assert kind == "ProcessGroupError", message
    assert "Process 0 of 2: process 1 did not reach the barrier" in message
    assert "barrier 'varstate-written:" in message and "within 8 s (it died or is stuck" in message
    assert "the checkpoint being written is not published and the latest checkpoint is unchanged" in message
    directory = str(tmp_path / "dying")
    assert checkpoint.latest_checkpoint(directory) == os.path.join(directory, "ckpt-1")
    assert not os.path.exists(os.path.join(directory, "ckpt-2"))
    model, _ = _templates(jax.devices())
    status = checkpoint.Checkpoint(model=model).restore(checkpoint.latest_checkpoint(directory))
    for name, v in _flat(status.assert_consumed().model).items():
        np.testing.assert_array_equal(np.asarray(v.value), reference["values"][name])


def test_a_process_dying_inside_a_collective_is_named_at_once(group, tmp_path):
    out = group("child_die_in_collective.py", all_succeed=False, env={"VARSTATE_BARRIER_TIMEOUT_S": "60"})
    assert [o.returncode for o in out] == [0, 17], "\n".join(map(str, out))
    kind, message = out[0].results["dying_save"]
    assert kind == "ProcessGroupError", message
    assert message.startswith("Process 0 of 2: exchanging metadata (checksums, index entries, digests) with "
                              "process [1] failed (")
    assert "it died or left the group. The save was abandoned" in message
    # the transport noticed the dead peer (no barrier or gloo timeout was needed: either would say so)
    assert re.search(r"\(UNKNOWN: Gloo \w+ failed: .*Connection (closed|reset) by peer", message), message
    directory = str(tmp_path / "dying_collective")
    assert checkpoint.latest_checkpoint(directory) == os.path.join(directory, "model-1")
    assert not os.path.exists(os.path.join(directory, "model-2"))


def test_a_save_only_process_0_calls_and_graphs_that_differ_say_what_to_fix(group, tmp_path):
    out = group("child_lone_save.py", env={"VARSTATE_BARRIER_TIMEOUT_S": "20"})
    for i, r in enumerate(out):
        kind, message = r.results["mismatch"]
        assert kind == "ProcessGroupError", message
        assert f"the first Variable that differs: process {i} has " in message and "'stray/" in message, message
    kind, message = out[0].results["lone_save"]
    assert kind == "ProcessGroupError", message
    assert "every process must call it, not only process 0" in message, message
    assert checkpoint.latest_checkpoint(str(tmp_path / "lone")) is None
