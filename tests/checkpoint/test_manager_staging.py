"""Asynchronous saves with bounded staging (`max_staging_bytes`): snapshot semantics, the bound, failures."""

import os
import threading
import weakref

import jax.numpy as jnp
import numpy as np
import pytest

import checkpoint
from checkpoint import _manager
from checkpoint._storage import _bundle_writer, _publish

N = 100_000  # float32: 400,000 bytes a value
KEY = "m/{}/.ATTRIBUTES/VARIABLE_VALUE"


def _roots():
    return {"a": jnp.full(N, 1.0), "b": jnp.full(N, 2.0), "c": jnp.full(N, 3.0), "n": np.full(N, 4.0, np.float32)}


class Gate:
    """Holds every background write until `open()`: what the save call did is then all there is on disk."""

    def __init__(self, monkeypatch):
        self.event = threading.Event()
        start_write = _manager.start_write

        def gated(*args, **kwargs):
            finish = start_write(*args, **kwargs)

            def later():
                assert self.event.wait(60)
                finish()
            return later

        monkeypatch.setattr(_manager, "start_write", gated)

    def open(self):
        self.event.set()


def _clobber(roots):
    """What a training step that donates its inputs does to them: every array is gone or changed."""
    for v in roots.values():
        if isinstance(v, np.ndarray):
            v[...] = -1
        else:
            v.delete()


def _check(path):
    reader = checkpoint.read_checkpoint(path)
    for name, value in (("a", 1.0), ("b", 2.0), ("c", 3.0), ("n", 4.0)):
        np.testing.assert_array_equal(reader.get(KEY.format(name)), np.full(N, value, np.float32))


@pytest.mark.parametrize("bound", [None, 500_000, 0])
def test_tf_format_stages_only_what_fits_and_saves_the_values_at_the_call(tmp_path, monkeypatch, bound):
    copies = []
    snapshot = _bundle_writer._snapshot
    monkeypatch.setattr(_bundle_writer, "_snapshot", lambda v: copies.append(_bundle_writer._nbytes(v)) or snapshot(v))
    gate = Gate(monkeypatch)
    mgr = checkpoint.CheckpointManager(str(tmp_path), async_save=True, format="tf", max_staging_bytes=bound)
    roots = _roots()
    path = mgr.save(1, m=roots)
    _clobber(roots)
    staged = sum(n for n in copies if n >= N)  # the values' copies (the graph and the counter are a few bytes)
    # Written in order by key (a, b, c, n): the values that do not fit are in the data file already.
    assert staged == {None: 4 * 4 * N, 500_000: 4 * N, 0: 0}[bound]
    assert sum(copies) <= (bound if bound is not None else float("inf"))
    gate.open()
    mgr.wait_until_finished()
    _check(path)
    assert checkpoint.latest_checkpoint(str(tmp_path)) == path
    mgr.close()


@pytest.mark.parametrize("bound", [None, 10_000_000, 100])
def test_orbax_format_copies_within_the_bound_and_writes_before_returning_past_it(tmp_path, monkeypatch, bound):
    gate = Gate(monkeypatch)
    mgr = checkpoint.CheckpointManager(str(tmp_path), async_save=True, max_staging_bytes=bound)
    roots = _roots()
    path = mgr.save(1, m=roots)
    _clobber(roots)
    temps = [n for n in os.listdir(tmp_path) if ".varstate-new-" in n]
    # Past the bound the checkpoint is complete under its temporary name when save returns; only the commit waits.
    written = [n for n in temps if _publish.exists(os.path.join(tmp_path, n))]
    assert len(written) == (1 if bound == 100 else 0), os.listdir(tmp_path)
    gate.open()
    mgr.wait_until_finished()
    _check(path)
    mgr.close()


def test_orbax_format_holds_its_batch_of_small_values_once(tmp_path, monkeypatch):
    # orbax deep-copies every numpy array before an asynchronous save returns. A batch of small values is a copy
    # made at the call already: its deep copy is itself, so the save holds those values once, not twice.
    from checkpoint._storage import _orbax_layout

    asked = []
    deepcopy = _orbax_layout._Batch.__deepcopy__

    def spy(self, memo=None):
        out = deepcopy(self, memo)
        asked.append((self.nbytes, out is self))
        return out

    monkeypatch.setattr(_orbax_layout._Batch, "__deepcopy__", spy)
    gate = Gate(monkeypatch)
    mgr = checkpoint.CheckpointManager(str(tmp_path), async_save=True)
    roots = _roots()
    path = mgr.save(1, m=roots)
    _clobber(roots)  # the values at the call are in the batch
    # one batch: the four values (400,000 bytes each, 64-byte aligned) and the step counter, padded to 64 bytes
    assert asked == [(4 * 4 * N + 64, True)]
    gate.open()
    mgr.wait_until_finished()
    _check(path)
    mgr.close()


def test_a_failed_background_save_is_raised_by_the_next_call_which_then_works(tmp_path, monkeypatch):
    mgr = checkpoint.CheckpointManager(str(tmp_path), async_save=True, format="tf", max_staging_bytes=1 << 20)
    move = _publish.move_into_place
    calls = []

    def full_disk(src, dst):
        calls.append(dst)
        if len(calls) == 1:
            raise OSError(28, "No space left on device")
        move(src, dst)

    monkeypatch.setattr(_publish, "move_into_place", full_disk)
    mgr.save(1, m=_roots())
    with pytest.raises(OSError, match=r"\[Errno 28\] No space left on device"):
        mgr.save(2, m=_roots())
    assert checkpoint.latest_checkpoint(str(tmp_path)) is None  # the failed save never became the latest
    path = mgr.save(2, m=_roots())  # raised once: the manager goes on
    mgr.wait_until_finished()
    _check(path)
    assert checkpoint.latest_checkpoint(str(tmp_path)) == path
    assert sorted(os.listdir(tmp_path)) == ["checkpoint", "ckpt-2.data-00000-of-00001", "ckpt-2.index"]
    mgr.close()


def test_max_staging_bytes_errors(tmp_path):
    with pytest.raises(ValueError, match=r"^CheckpointManager: max_staging_bytes must be a non-negative int "
                                         r"\(bytes\) or None, got -1\.$"):
        checkpoint.CheckpointManager(str(tmp_path), async_save=True, max_staging_bytes=-1)
    with pytest.raises(ValueError, match=r"got 1.5\.$"):
        checkpoint.CheckpointManager(str(tmp_path), async_save=True, max_staging_bytes=1.5)
    with pytest.raises(ValueError, match=r"^CheckpointManager: max_staging_bytes=1024 bounds the copies an "
                                         r"asynchronous save holds, and async_save is False \(a save then copies "
                                         r"nothing\); pass async_save=True, or leave max_staging_bytes out\.$"):
        checkpoint.CheckpointManager(str(tmp_path), max_staging_bytes=1024)


class _DeviceArray:
    """Stands for an accelerator's jax.Array: each read to the host makes a new host copy, and `host` records
    the bytes of copies alive at each read (on CPU a jax.Array shares its buffer: no copy to see)."""

    def __init__(self, value, host):
        self.value, self.host = value, host
        self.shape, self.dtype, self.nbytes = value.shape, value.dtype, value.nbytes

    def __array__(self, dtype=None, copy=None):
        alive = [c for c in (r() for r in self.host["copies"]) if c is not None]
        self.host["peaks"].append(sum(c.nbytes for c in alive))
        out = np.array(self.value, dtype=dtype)
        self.host["copies"].append(weakref.ref(out))
        return out


@pytest.mark.parametrize("staging", [None, 2 * 4 * N])
def test_tf_format_reads_each_array_to_the_host_as_it_writes_it(tmp_path, staging):
    # Before, every value was copied to the host before the first was written: the whole checkpoint at once.
    host: dict = {"copies": [], "peaks": []}
    values = {KEY.format(i): _DeviceArray(np.full(N, float(i), np.float32), host) for i in range(6)}
    tensors = _bundle_writer.tf_tensors(values, b"graph")
    _bundle_writer.start_bundle(str(tmp_path / "ckpt"), tensors, staging)()
    # Alive as a value is read: the staged copies, the small values gathered for one write (at most
    # _GATHER_BYTES of them, 2 of these) and the value written just before it (bound until the next).
    assert 4 * N < _bundle_writer._GATHER_BYTES < 6 * 4 * N
    assert len(host["peaks"]) >= 6 and max(host["peaks"]) <= (staging or 0) + 4 * N + _bundle_writer._GATHER_BYTES
    reader = checkpoint.read_checkpoint(str(tmp_path / "ckpt"))
    for i in range(6):
        np.testing.assert_array_equal(reader.get(KEY.format(i)), np.full(N, float(i), np.float32))
