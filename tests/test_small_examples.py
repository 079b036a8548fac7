"""`make demo` (examples/demo.py, the README's main example), examples/custom_gradient.py and
examples/mixed_precision.py, run as written."""

import importlib.util
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np

import checkpoint
import varstate
from varstate.optimizers import Adam, traced

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")


def _example(name):
    spec = importlib.util.spec_from_file_location(f"{name}_example", os.path.join(EXAMPLES, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


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
    _example("custom_gradient").main()
    out = capsys.readouterr().out.splitlines()
    # d/dx log(1 + e^x) = sigmoid(x): 1.0 at x = 100 in float32, where the plain rule gives inf/inf = nan.
    assert out[0] == "d/dx log1pexp at x=100: 1.0"
    assert np.isnan(jax.grad(lambda x: jnp.log1p(jnp.exp(x)))(100.0))
    steps = [re.fullmatch(r"step (\d): loss (\d+\.\d{4}), max \|kernel grad\| (\d+\.\d\d)", line) for line in out[1:]]
    assert [int(m[1]) for m in steps] == [0, 1, 2, 3, 4]
    losses = [float(m[2]) for m in steps]
    assert losses == sorted(losses, reverse=True) and losses[-1] < 0.6 * losses[0]  # it trains
    assert {m[3] for m in steps} == {"0.10"}  # the custom rule clips the kernel's gradient at 0.1


def test_the_example_trains_in_every_policy_and_low_precision_tracks_float32(capsys):
    # examples/mixed_precision.py as the README runs it: one MLP trained in float32, mixed_bfloat16 and
    # mixed_float16 with loss scaling; its printed summary, then the runs it returns.
    runs = _example("mixed_precision").main()
    out = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0].strip() for line in out] == ["float32", "mixed_bfloat16", "mixed_float16"]
    assert out[2].endswith(", loss scale 32768")
    f32 = np.array(runs["float32"][0])
    for name, (losses, params, _) in runs.items():
        losses = np.array(losses)
        assert losses[-1] < 1e-3 * losses[0], name  # each learns (measured: 1.1e-4 to 1.7e-4 of the start)
        kernel = params[0]["kernel"]
        if name == "float32":
            assert type(kernel) is varstate.Variable
            continue
        assert all(isinstance(layer["kernel"], varstate.AutoCastVariable) for layer in params), name
        assert kernel.__varstate_variable__().value.dtype == jnp.float32 and kernel.dtype == jnp.float32
        # Stated tolerance: at every step within 0.005 (absolute; the loss starts near 0.52) or 5% of the
        # float32 loss (measured: bf16 at most 0.0005 apart, fp16 0.00007).
        np.testing.assert_allclose(losses, f32, rtol=0.05, atol=0.005, err_msg=name)
    # float16: TF's dynamic loss scale starts at 2**15 and grows only after 2,000 finite steps; 150 finite
    # steps leave it there (an overflow would have halved it).
    state = runs["mixed_float16"][2]
    assert state.non_slots["current_loss_scale"].value.item() == 2.0**15
    assert state.non_slots["good_steps"].value.item() == 150


def test_sweep_example_compiles_once_and_each_vmapped_run_follows_its_solo_run():
    out = _example("sweep").main()
    assert out["vm_compiles"] == 1 and out["loop_compiles"] == 8
    # A stable run (every learning rate but 1.0, whose loss oscillates) stays within a few ulps of the loop's
    # run over 100 steps (measured 1 to 6); a wrong traced value would be off by orders of magnitude.
    assert max(out["ulps"][:-1]) <= 16, out["ulps"]
    assert out["best"] == 5 and np.all(np.isfinite(out["losses"]))
    # The unstacked best run restores as any run's checkpoint (TF's keys: params, slots, beta powers).
    template = {"hidden": jnp.zeros((8, 16)), "out": jnp.zeros((16, 1))}
    status = checkpoint.Checkpoint(model=template, optimizer=Adam(traced(0.1)).init(template)).restore(out["path"])
    status.assert_consumed()
    for name, value in out["params_best"].items():
        np.testing.assert_array_equal(status.model[name], value)
