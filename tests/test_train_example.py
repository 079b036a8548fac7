"""examples/train.py: stopped (--stop-after, SIGTERM) and resumed runs end bit-identical to an uninterrupted one."""

import importlib.util
import os
import signal

import numpy as np

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")
spec = importlib.util.spec_from_file_location("train_example", os.path.join(EXAMPLES, "train.py"))
train = importlib.util.module_from_spec(spec)
spec.loader.exec_module(train)

STEPS = ["--steps", "60", "--save-every", "20", "--log-every", "20"]


def params(path):
    with np.load(path) as f:
        return {k: f[k] for k in f.files}


def assert_bit_identical(a, b):
    assert sorted(a) == sorted(b) == [f"dense{i}/{k}" for i in range(3) for k in ("bias", "kernel")]
    for k in a:
        assert a[k].tobytes() == b[k].tobytes(), k


def test_stop_after_and_resume_is_bit_identical(tmp_path, capsys):
    assert train.main(["--dir", str(tmp_path / "a"), *STEPS, "--out", str(tmp_path / "a.npz")]) == 0
    assert train.main(["--dir", str(tmp_path / "b"), *STEPS, "--stop-after", "25", "--async-save"]) == 0
    out = capsys.readouterr().out
    assert "stopped after 25 steps at step 25: checkpoint saved" in out
    assert sorted(os.listdir(tmp_path / "b")) == ["checkpoint", "ckpt-20", "ckpt-25"]
    assert train.main(["--dir", str(tmp_path / "b"), *STEPS, "--async-save", "--out", str(tmp_path / "b.npz")]) == 0
    assert "at step 25" in capsys.readouterr().out
    assert_bit_identical(params(tmp_path / "a.npz"), params(tmp_path / "b.npz"))
    full = params(tmp_path / "a.npz")
    first = train.make_model(0)
    assert not np.array_equal(full["dense0/kernel"], np.asarray(first["dense0"]["kernel"].value))  # it trained


def test_sigterm_saves_and_exits_then_resumes_bit_identical(tmp_path, capsys, monkeypatch):
    directory = tmp_path / "run"
    real_batch, sent = train.batch, []

    # SIGTERM is sent by the process to itself while step 30's batch is made, as a scheduler's kill arrives
    # between two steps: deterministic, where a thread watching for ckpt-20 raced the 40 remaining steps on a
    # loaded machine (and, had training ended first, would have killed the test process).
    def batch_then_sigterm(seed, step):
        if int(step) == 30 and not sent:
            assert (directory / "ckpt-20").exists()
            sent.append(step)
            os.kill(os.getpid(), signal.SIGTERM)
        return real_batch(seed, step)

    monkeypatch.setattr(train, "batch", batch_then_sigterm)
    before = signal.getsignal(signal.SIGTERM)
    assert train.main(["--dir", str(directory), *STEPS]) == 0
    assert signal.getsignal(signal.SIGTERM) is before  # the handler is put back
    out = capsys.readouterr().out
    assert "SIGTERM at step 31: checkpoint saved, exiting" in out and (directory / "ckpt-31").exists()
    assert train.main(["--dir", str(directory), *STEPS, "--out", str(tmp_path / "resumed.npz")]) == 0
    assert train.main(["--dir", str(tmp_path / "ref"), *STEPS, "--out", str(tmp_path / "ref.npz")]) == 0
    assert_bit_identical(params(tmp_path / "ref.npz"), params(tmp_path / "resumed.npz"))


def test_nnx_example_resumes_bit_identical(newcomer_env):
    import subprocess
    import sys

    out = subprocess.run([sys.executable, os.path.join(EXAMPLES, "nnx_train_resume.py")], env=newcomer_env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "resumed at step 30" in out.stdout and out.stdout.strip().endswith("OK: bit-identical after resuming")
