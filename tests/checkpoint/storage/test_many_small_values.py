"""What a save or restore of many small values costs besides its bytes: the collector and the reading threads.

Issue 27's small row (1,500 values / 24 MiB) spent 10-25 ms of a 100 ms save or restore in Python's cyclic
collector and, on a busy machine, milliseconds starting a fresh pool of reading threads per restore.
"""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import textwrap
import threading
import time
import types

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import checkpoint
import checkpoint.safetensors
import varstate
from checkpoint._storage import _host, _jax_private


@pytest.fixture
def collections():
    """The number of collector runs so far, as a function: read it before and after."""
    runs = [0]

    def count(phase, info):
        if phase == "start":
            runs[0] += 1

    gc.callbacks.append(count)
    yield lambda: runs[0]
    gc.callbacks.remove(count)


def _model(n=400):
    return {f"v{i:03d}": varstate.Variable(jnp.full((4,), float(i))) for i in range(n)}


@pytest.mark.parametrize("fmt", ["orbax", "tf"])
def test_the_collector_runs_once_after_a_save_or_restore_not_during_it(tmp_path, fmt, collections):
    model = _model()
    templates = {k: varstate.uninitialized((4,), jnp.float32) for k in model}
    path = str(tmp_path / "ckpt")
    gc.collect()
    before = collections()
    checkpoint.Checkpoint(model=model).write(path, format=fmt)
    saved = collections()
    restored = checkpoint.Checkpoint(model=templates).restore(path).model
    # One each, deferred to the end (the allocations counted meanwhile); 400 values allocate enough objects to
    # run it several times in each otherwise.
    assert saved - before <= 1 and collections() - saved <= 1
    assert gc.isenabled()
    assert restored["v123"].value.tolist() == [123.0] * 4


@pytest.mark.parametrize("asynchronous", [False, True])
def test_a_manager_save_pauses_the_collector_in_the_callers_thread(tmp_path, collections, asynchronous):
    model = _model()
    with checkpoint.CheckpointManager(str(tmp_path), async_save=asynchronous) as manager:
        gc.collect()
        before = collections()
        manager.save(1, model=model)
        assert collections() - before <= 1 and gc.isenabled()
        manager.wait_until_finished()
    assert gc.isenabled()


def test_the_collector_is_on_again_after_a_restore_that_fails(tmp_path):
    path = checkpoint.Checkpoint(model=_model(2)).write(str(tmp_path / "ckpt"))
    with pytest.raises(ValueError, match="shape"):
        checkpoint.Checkpoint(model={"v000": varstate.uninitialized((5,), jnp.float32)}).restore(path)
    assert gc.isenabled()


def test_a_collector_the_user_turned_off_stays_off(tmp_path):
    gc.disable()
    try:
        path = checkpoint.Checkpoint(model=_model(2)).write(str(tmp_path / "ckpt"))
        checkpoint.Checkpoint(model=_model(2)).restore(path)
        checkpoint.safetensors.save(str(tmp_path / "m.safetensors"), _model(2))
        checkpoint.safetensors.load(str(tmp_path / "m.safetensors"))
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_restores_share_one_pool_of_reading_threads(tmp_path):
    path = checkpoint.Checkpoint(model=_model(50)).write(str(tmp_path / "ckpt"), format="tf")
    templates = {k: varstate.uninitialized((4,), jnp.float32) for k in _model(50)}
    checkpoint.Checkpoint(model=templates).restore(path)
    readers = {t.ident for t in threading.enumerate() if t.name.startswith("checkpoint-read")}
    for _ in range(3):
        checkpoint.Checkpoint(model=templates).restore(path)
    assert readers and {t.ident for t in threading.enumerate() if t.name.startswith("checkpoint-read")} == readers


def test_read_ahead_left_early_returns_once_the_reads_running_have_ended():
    running, ended = [], []

    def read(x):
        running.append(x)
        time.sleep(0.05)
        ended.append(x)
        return x

    reads = _host.read_ahead(range(100), read, lambda x: 1)
    assert next(reads) == (0, 0)
    reads.close()  # the caller closes the files the reads use next: none may still be reading
    assert sorted(running) == sorted(ended)


def test_a_forked_child_reads_with_threads_of_its_own():
    # The parent's pool is made before the fork; the child has none of its threads and must make its own pool
    # (a pool copied over would count the parent's threads as its own and never run a read: a hang).
    script = textwrap.dedent("""
        import os, signal, sys
        from checkpoint._storage import _host
        assert [r for _, r in _host.read_ahead([1, 2], lambda x: x * 10, lambda x: 1)] == [10, 20]
        pid = os.fork()
        if pid == 0:
            signal.alarm(20)
            ok = [r for _, r in _host.read_ahead([3, 4], lambda x: x * 10, lambda x: 1)] == [30, 40]
            sys.exit(0 if ok else 3)  # a normal exit: the exit hooks join no thread of the parent's
        assert os.waitpid(pid, 0)[1] == 0
        print("child read")
    """)
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0 and out.stdout == "child read\n", out.stderr[-2000:]


def test_many_small_values_round_trip_in_both_formats(tmp_path):
    rng = np.random.default_rng(0)
    model = {f"v{i:04d}": varstate.Variable(jnp.asarray(rng.standard_normal(7, dtype=np.float32)))
             for i in range(1500)}
    templates = {k: varstate.uninitialized((7,), jnp.float32) for k in model}
    for fmt in ("orbax", "tf"):
        path = checkpoint.Checkpoint(model=model).write(str(tmp_path / fmt), format=fmt)
        restored = checkpoint.Checkpoint(model=templates).restore(path).model
        assert all(np.array_equal(restored[k].value, model[k].value) for k in model)


DTYPES = [np.float32, np.float16, ml_dtypes.bfloat16, ml_dtypes.float8_e4m3fn, ml_dtypes.int4, np.int8, np.uint32,
          np.bool_, np.complex64]


@pytest.mark.parametrize("shape", [(), (0,), (3,), (2, 5)])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_placing_on_one_device_gives_what_jax_device_put_gives_without_calling_it(shape, dtype, monkeypatch):
    # `place_many` puts a value bound for one device through the call jax.device_put ends in (JAX internals): the
    # array must be jax.device_put's (abstract value, sharding, committed, bits, the host buffer shared).
    assert _jax_private.host_put() is not None, "this JAX lacks the internals: small restores place through device_put"
    host = _host.aligned_empty(shape, dtype)
    host[...] = np.arange(host.size).reshape(shape).astype(dtype)
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[3])
    want = jax.device_put(host, sharding)
    calls = []
    monkeypatch.setattr(jax, "device_put", lambda *a, **k: calls.append(a))
    (got,) = _host.place_many([host], [sharding])
    assert calls == []
    assert (got.aval, got.sharding, got.committed, got.dtype) == (want.aval, want.sharding, True, np.dtype(dtype))
    assert np.asarray(got).tobytes() == host.tobytes()
    if host.size:  # the host buffer is shared where jax.device_put shares it (all but int4, packed two a byte)
        shares = got.unsafe_buffer_pointer() == host.ctypes.data
        assert shares == (want.unsafe_buffer_pointer() == host.ctypes.data) and shares == (dtype != ml_dtypes.int4)


def test_values_the_fast_path_leaves_to_jax_device_put(compiles):
    # int64 (JAX makes it int32 without 64-bit types), a mesh, host memory, no sharding, an unaligned buffer.
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("d",))
    one = jax.devices()[0]
    cases = [(np.arange(4, dtype=np.int64), jax.sharding.SingleDeviceSharding(one)),
             (np.arange(16, dtype=np.float32), jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("d"))),
             (np.arange(4, dtype=np.float32), jax.sharding.SingleDeviceSharding(one, memory_kind="pinned_host")),
             (np.arange(4, dtype=np.float32), None),
             (np.arange(9, dtype=np.float32)[1:5], jax.sharding.SingleDeviceSharding(one))]
    placed = _host.place_many([h for h, _ in cases], [s for _, s in cases])
    for (host, sharding), got in zip(cases, placed, strict=True):
        want = jax.device_put(host, sharding)
        assert (got.aval, got.sharding, got.committed) == (want.aval, want.sharding, want.committed)
        assert np.array_equal(np.asarray(got), np.asarray(want))
    # Asked directly: a dtype JAX has not, and a device without memory kinds, are left to jax.device_put.
    put = _jax_private.host_put()
    one_device = jax.sharding.SingleDeviceSharding(one)
    assert put(np.array(["ab"]), one_device) is None

    class NoMemories:
        def default_memory(self):
            raise RuntimeError("this backend has no memory kinds")

    assert put(_host.aligned_empty((2,), np.float32), types.SimpleNamespace(device_set={NoMemories()})) is None
    # A program compiled for jax.device_put's arrays runs on the fast path's without compiling again.
    double = jax.jit(lambda x: x * 2)
    host = _host.aligned_empty((5,), np.float32)
    host[:] = 1.5
    sharding = jax.sharding.SingleDeviceSharding(one)
    double(jax.device_put(host, sharding))
    before = compiles()
    assert np.array_equal(np.asarray(double(_host.place_many([host], [sharding])[0])), np.full(5, 3.0, np.float32))
    assert compiles() == before


def test_internals_that_place_otherwise_are_not_used(monkeypatch):
    shaped, batched = (_jax_private.internal(*where) for where in _jax_private.INTERNALS)

    def elsewhere(aval, sharding, xs, *args):  # places other values: the check against jax.device_put catches it
        return batched(aval, sharding, [np.zeros_like(x) for x in xs], *args)

    assert _jax_private.checked_put(shaped, batched) is not None
    assert _jax_private.checked_put(shaped, elsewhere) is None
    assert _jax_private.checked_put(lambda *a: 1 / 0, batched) is None
    monkeypatch.setattr(_jax_private, "_PUT", [None])  # as on a JAX whose internals failed the check
    host = np.arange(3, dtype=np.float32)
    (got,) = _host.place_many([host], [jax.sharding.SingleDeviceSharding(jax.devices()[0])])
    assert np.array_equal(np.asarray(got), host) and got.committed
    monkeypatch.setattr(_jax_private, "_PUT", [])
    monkeypatch.setattr(_jax_private, "INTERNALS", (*_jax_private.INTERNALS, ("numpy", "not_there")))  # a JAX without
    assert _jax_private.host_put() is None
