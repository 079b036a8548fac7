"""Test setup: 8 fake CPU devices, set before jax is imported anywhere."""

import gc
import importlib.util
import os
import sys

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# XLA compilation is about 60% of the suite's CPU time: keep the compiled programs (keyed by program, jax version
# and flags, so a hit is the very executable a compile would give) for the workers, the example subprocesses and
# later runs. Measured on 2 cores: 283 s without, 245 s the first run, 115 s once warm (2026-12-03, 1,600 tests;
# 3,034 tests on 2026-12-07: 435 s the first run, 198-227 s warm).
os.environ.setdefault(
    "JAX_COMPILATION_CACHE_DIR", os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".jax_cache")
)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")

import jax

assert jax.device_count() == 8, "XLA_FLAGS was set too late: jax was imported before conftest"

import pytest  # noqa: E402

import varstate  # noqa: E402

# jax's persistent compilation cache (shared by the xdist workers and the example subprocesses) writes an entry
# in place: a process that reads it while another writes it finds it truncated, warns, and compiles for itself,
# which is the right outcome. As an error, it failed a random test about once per cold run.
CACHE_ENTRY_MID_WRITE = "ignore:Error reading persistent compilation cache entry:UserWarning"


# Modules of few tests that take long (child processes, a barrier's timeout), run before the others (below).
LONG_FEW = (
    "multiprocess/test_group.py", "test_small_examples.py", "checkpoint/storage/test_restore_memory.py",
    "checkpoint/keras/test_keras_hdf5_bounded.py", "multiprocess/test_example.py", "test_train_example.py",
    "multiprocess/test_dead_peer.py", "checkpoint/keras/test_keras_adafactor_muon_files.py", "test_export_example.py",
    "test_from_keras_example.py",
)


def pytest_configure(config):
    config.addinivalue_line("filterwarnings", CACHE_ENTRY_MID_WRITE)  # after pyproject's "error": it wins
    # xdist's `--dist loadfile` hands out modules by their number of tests, most first: a module of four tests
    # that runs 30 s of child processes went out near the end and ended the run alone. The order is ours instead.
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(config, items):
    """Modules in `LONG_FEW` first, in its order, then the others by their number of tests, most first (xdist's
    own order)."""
    here = os.path.dirname(os.path.abspath(__file__))
    missing = [m for m in LONG_FEW if not os.path.isfile(os.path.join(here, m))]
    assert not missing, f"tests/conftest.py's LONG_FEW names modules that are gone: {missing}"
    rank = {os.path.join(here, m): i for i, m in enumerate(LONG_FEW)}
    modules: dict[str, list] = {}
    for item in items:
        modules.setdefault(str(item.path), []).append(item)
    order = sorted(modules.items(), key=lambda m: (rank.get(m[0], len(rank)), -len(m[1])))
    items[:] = [item for _, its in order for item in its]


@pytest.hookimpl(optionalhook=True)  # xdist's hook: a run with -p no:xdist has none
def pytest_xdist_auto_num_workers(config):
    """`-n auto`: one worker more than the cores this process may run on (xdist's own count when
    PYTEST_XDIST_AUTO_NUM_WORKERS is set).

    A core per worker leaves cores idle: many tests wait on subprocesses (the examples, the multi-process groups,
    all of a guide's examples in one child) or on a barrier's timeout. On 2 cores (2026-12-07) the whole suite
    used 1.73 cores on average with 2 workers; warm, 2 workers took 176-184 s, 3 workers 155-162 s and 4 workers
    164 s; cold (compiling everything, so every core busy), 355 s with 2 and 357 s with 3.
    """
    if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS"):
        return None
    return len(os.sched_getaffinity(0)) + 1 if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1) + 1


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    """An xdist worker leaves without the interpreter's exit: its results are sent by now (xdist writes its last
    message, "workerfinished", to the pipe and flushes it in `pytest_sessionfinish`, before this hook).

    That exit spent 4-5 s of every run's end doing nothing useful: jax's atexit hook destroys each worker's
    thousands of compiled programs (about 1.5 ms each) and the interpreter then frees the worker's 800,000
    objects, while the controller waits for all three workers. Measured on 2 cores, warm (2026-12-08): the last
    worker's end to the controller's 5.3 s before, 0.7 s after. A run without xdist exits as usual.
    """
    if hasattr(config, "workerinput"):
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


# What jax offers no public way to ask, read from private JAX: the tests' one door to jax._src (tests/test_layout.py
# holds the library to varstate/_jax_compat.py and the _jax_private.py of checkpoint/_export and checkpoint/_storage).
# Source text, so that a child process runs it too.
JAX_PRIVATE = {
    "backends_started": "__import__('jax._src.xla_bridge')._src.xla_bridge.backends_are_initialized()",
}


@pytest.fixture(scope="session")
def jax_private():
    """`JAX_PRIVATE`: {what: a Python expression that reads it}."""
    return dict(JAX_PRIVATE)


@pytest.fixture(scope="module", autouse=True)
def earlier_modules_objects_frozen():
    """Objects made before this module's tests are left out of the cyclic collector's full collections.

    A worker accumulates jax's caches (jaxprs, source infos, tree definitions: 300,000-500,000 objects after a
    few optimizer modules); each full collection walks all of them, 0.25-0.7 s apiece, and the tests that check
    finalizers call `gc.collect()` dozens of times. Freezing at each module's start (after collecting the young
    garbage) keeps every full collection to the objects of the module running, which are the ones its tests
    make and drop. Garbage that reached the oldest generation in an earlier module waits for the end of the
    session (`frozen_garbage_collected_at_the_end`).
    """
    gc.collect(1)
    gc.freeze()


@pytest.fixture(scope="session", autouse=True)
def frozen_garbage_collected_at_the_end():
    """Collects what the freezes held, so that a finalizer's failure or ResourceWarning in it is still reported
    (as an error of the session's last test) rather than lost with the frozen garbage."""
    yield
    gc.unfreeze()
    gc.collect()


@pytest.fixture(autouse=True)
def fresh_default_registry(monkeypatch):
    """Each test sees a new default registry, so unique names do not depend on test order."""
    monkeypatch.setattr(varstate.Registry, "_default", varstate.Registry())


@pytest.fixture(scope="session")
def newcomer_env():
    """The environment of a subprocess that runs an example as a newcomer would: one CPU device (no XLA_FLAGS),
    warnings as errors, except jax's for a cache entry read mid-write. Do not change it in place."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONWARNINGS": f"error,{CACHE_ENTRY_MID_WRITE}"}
    env.pop("XLA_FLAGS", None)
    return env


class CompileCounter:
    """Counts the programs jax lowers (each one a compile, or a load from the persistent cache), through jax's
    public monitoring events; `counter("name")` counts those of the function with that ``__name__`` only (jax
    records ``jit(name)``), so eager ops such as ``jnp.ones`` do not count."""

    # jax records this event once per program it lowers to MLIR, whether XLA then compiles it or a persistent
    # cache entry supplies the executable, so it counts what a user pays for on a cache miss of jit's own cache.
    EVENT = "/jax/core/compile/jaxpr_to_mlir_module_duration"

    def __init__(self) -> None:
        self.names: list[str] = []

    def _listen(self, event: str, _duration: float, *, fun_name: str = "", **_kwargs) -> None:
        if event == self.EVENT:
            self.names.append(fun_name)

    def __call__(self, name: str | None = None) -> int:
        return len(self.names) if name is None else sum(n == f"jit({name})" for n in self.names)


@pytest.fixture
def compiles():
    """A CompileCounter listening for the duration of the test."""
    counter = CompileCounter()
    jax.monitoring.register_event_duration_secs_listener(counter._listen)
    yield counter
    jax.monitoring.unregister_event_duration_listener(counter._listen)


@pytest.fixture(scope="session")
def keras_readback():
    """tests/data/keras_roundtrip_readback.py as a module: the script that made the Keras fixtures, whose functions
    run the same steps with our optimizers."""
    path = os.path.join(os.path.dirname(__file__), "data", "keras_roundtrip_readback.py")
    spec = importlib.util.spec_from_file_location("keras_roundtrip_readback", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
