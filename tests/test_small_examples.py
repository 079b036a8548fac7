"""`make demo` (examples/demo.py, the README's main example) and examples/custom_gradient.py, run as written."""

import importlib.util
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")


def test_demo_interrupts_twice_resumes_and_ends_bit_identical():
    # As `make demo` runs it: train.py in separate processes, stopped after 60 steps, sent SIGTERM, resumed.
    proc = subprocess.run([sys.executable, os.path.join(EXAMPLES, "demo.py")], capture_output=True, text=True,
                          timeout=300, env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    sections = re.findall(r"^== (\S+)", out, re.MULTILINE)
    assert sections == ["1.", "2a.", "2b.", "2c.", "3."], out
    assert "stopped after 60 steps at step 60: checkpoint saved" in out
    stopped = int(re.search(r"SIGTERM at step (\d+): checkpoint saved, exiting", out)[1])
    assert 120 <= stopped < 200 and f"/ckpt-{stopped} at step {stopped}" in out  # 2c resumed from its save
    rows = re.findall(r"^   (dense\d/\w+)\s+\(.*\)\s+(\S+)\s+(yes|NO)$", out, re.MULTILINE)
    assert [(name, diff, same) for name, diff, same in rows] == [
        (f"dense{i}/{k}", "0", "yes") for i in range(3) for k in ("bias", "kernel")], out
    assert re.search(r"^OK: the resumed run ends with exactly the parameters of the uninterrupted one \(\d+s\)\.$",
                     out, re.MULTILINE), out


def test_custom_gradient_example(capsys):
    spec = importlib.util.spec_from_file_location("custom_gradient_example",
                                                  os.path.join(EXAMPLES, "custom_gradient.py"))
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    example.main()
    out = capsys.readouterr().out.splitlines()
    # d/dx log(1 + e^x) = sigmoid(x): 1.0 at x = 100 in float32, where the plain rule gives inf/inf = nan.
    assert out[0] == "d/dx log1pexp at x=100: 1.0"
    assert np.isnan(jax.grad(lambda x: jnp.log1p(jnp.exp(x)))(100.0))
    steps = [re.fullmatch(r"step (\d): loss (\d+\.\d{4}), max \|kernel grad\| (\d+\.\d\d)", line) for line in out[1:]]
    assert [int(m[1]) for m in steps] == [0, 1, 2, 3, 4]
    losses = [float(m[2]) for m in steps]
    assert losses == sorted(losses, reverse=True) and losses[-1] < 0.6 * losses[0]  # it trains
    assert {m[3] for m in steps} == {"0.10"}  # the custom rule clips the kernel's gradient at 0.1
