"""A function file whose StableHLO module crashes or hangs MLIR's reader: `checkpoint.load` reads each module in a
child process first, so the file is refused with CheckpointFormatError and the caller's process lives on.

The fixtures (tests/data/hostile_exports/, made by tests/data/make_hostile_modules.py) are valid exports with two
bytes of the module changed and their checksums sealed again; read in-process, as jax reads them when a function
runs, each ends the process (SIGSEGV, SIGABRT) or never returns. Without the child, these tests kill pytest's worker.
"""

import os
import pathlib
import subprocess

import jax
import jax.numpy as jnp
import pytest

import checkpoint
import varstate
from checkpoint import CheckpointFormatError
from checkpoint._export import _sandbox

HOSTILE = pathlib.Path(__file__).parents[2] / "data" / "hostile_exports"


def module_of(name):
    (function,) = os.listdir(HOSTILE / name / "functions")
    path = HOSTILE / name / "functions" / function
    return str(path), jax.export.deserialize(bytearray(path.read_bytes())).mlir_module_serialized


@pytest.mark.parametrize(("name", "status"), [("segv", -11), ("abort", -6)])
def test_a_module_that_crashes_the_reader_is_refused_by_load(name, status):
    function, _ = module_of(name)
    with pytest.raises(CheckpointFormatError, match=(
            rf"^{function}: reading its StableHLO module ended the process that read it \(exit status {status}; "
            r"MLIR's reader crashes on some damaged modules, so load reads a module in a separate process first\); "
            r"the file is damaged or crafted: export the model again\. Its last output: ")):
        checkpoint.load(str(HOSTILE / name))


def test_a_module_that_hangs_the_reader_is_refused_within_the_time_limit(monkeypatch):
    monkeypatch.setattr(_sandbox, "TIME_LIMIT_S", 3.0)
    function, module = module_of("hang")
    limit = 3.0 + len(module) / 10e6
    with pytest.raises(CheckpointFormatError, match=(
            rf"^{function}: reading its StableHLO module did not finish in {limit:.0f} s \(MLIR's reader loops on "
            r"some damaged modules\); the file is damaged or crafted: export the model again\.$")):
        checkpoint.load(str(HOSTILE / "hang"))


def test_a_module_is_read_in_a_child_once_per_process(monkeypatch, tmp_path):
    root = {"w": varstate.Variable(jnp.arange(3.0), name="w")}
    path = checkpoint.export(str(tmp_path / "e"), root, {"f": (lambda r, x: jnp.cos(r["w"].value * x),
                                                               (jnp.zeros(3),))})
    runs = []
    real_run = subprocess.run
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: runs.append(a) or real_run(*a, **k))
    first = checkpoint.load(path)
    second = checkpoint.load(path)
    assert len(runs) == 1 and runs[0][0][-1] == _sandbox.CHILD
    x = jnp.array([1.0, 2.0, 3.0])
    want = jnp.cos(jnp.arange(3.0) * x).tolist()
    assert first.signatures["f"](x).tolist() == second.signatures["f"](x).tolist() == want


def test_a_module_that_is_not_stablehlo_is_refused():
    with pytest.raises(CheckpointFormatError, match=r"^here: its StableHLO module cannot be read \(.*StableHLO.*\)\.$"):
        _sandbox.module_targets(b"ML\xefR not a module", "here")
