"""examples/multihost_train.py: launches itself as 2 local processes, trains, saves; a second run resumes."""

import os
import subprocess
import sys

import checkpoint

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HANG_GUARD_S = 600  # a hang guard only: each run takes well under a minute on 2 idle cores


def _run(directory: str, steps: int) -> str:
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["PYTHONPATH"] = ROOT
    done = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "multihost_train.py"), "--dir", directory,
                           "--steps", str(steps)], capture_output=True, text=True, timeout=HANG_GUARD_S, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


def test_multihost_example_trains_saves_and_resumes(tmp_path):
    directory = str(tmp_path / "run")
    first = _run(directory, 10)
    assert "2 processes, 8 devices; starting at step 0" in first
    assert "step 10: loss" in first and checkpoint.latest_checkpoint(directory).endswith("ckpt-10")
    second = _run(directory, 15)
    assert "starting at step 10" in second and "step 15: loss" in second
    assert sorted(n for n in os.listdir(directory) if n.startswith("ckpt-")) == ["ckpt-10", "ckpt-15"]
    reader = checkpoint.read_checkpoint(checkpoint.latest_checkpoint(directory))
    assert int(reader.get("global_step/.ATTRIBUTES/VARIABLE_VALUE")) == 15
