"""mixed_precision: Policy (TF's names, dtypes and errors), autocast_variables, the example in every policy."""

import importlib.util
import os

import jax.numpy as jnp
import numpy as np
import pytest

import varstate
from varstate import mixed_precision

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "examples")


@pytest.mark.parametrize(
    ("name", "compute", "variable"),
    [("mixed_float16", "float16", "float32"), ("mixed_bfloat16", "bfloat16", "float32"),
     ("float32", "float32", "float32"), ("float16", "float16", "float16"), ("bfloat16", "bfloat16", "bfloat16")],
)
def test_policy_dtypes_as_tf(name, compute, variable):
    p = mixed_precision.Policy(name)
    assert (p.name, p.compute_dtype, p.variable_dtype, repr(p)) == (name, compute, variable, f'<Policy "{name}">')
    assert p == mixed_precision.Policy(name) and hash(p) == hash(mixed_precision.Policy(name))


def test_policy_errors_as_tf():
    with pytest.raises(TypeError, match=r"must be a string, got .*dtype\('float32'\) \(a dtype: pass its name"):
        mixed_precision.Policy(jnp.dtype("float32"))
    with pytest.raises(TypeError, match=r"Policy name must be a string, got int 3"):
        mixed_precision.Policy(3)
    with pytest.raises(ValueError, match=r"'float16_with_float32_vars'.*removed from TensorFlow; use 'mixed_float16'"):
        mixed_precision.Policy("float16_with_float32_vars")
    with pytest.raises(ValueError, match=r"'mixed_int8'.*expected 'mixed_float16', 'mixed_bfloat16' or a dtype"):
        mixed_precision.Policy("mixed_int8")


def test_autocast_variables_wraps_float_variables_only():
    params = {
        "w": varstate.Variable(jnp.ones(2), name="mp_w"),
        "already": varstate.AutoCastVariable(varstate.Variable(jnp.ones(1), name="mp_a")),
        "count": varstate.Variable(0, name="mp_count"),
        "raw": jnp.ones(3),
    }
    out = mixed_precision.autocast_variables(params)
    assert isinstance(out["w"], varstate.AutoCastVariable) and out["w"].resource_id == params["w"].resource_id
    assert out["already"] is params["already"]
    assert type(out["count"]) is varstate.Variable and out["raw"] is params["raw"]


def _example():
    path = os.path.join(EXAMPLES, "mixed_precision.py")
    spec = importlib.util.spec_from_file_location("mixed_precision_example", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_example_trains_in_every_policy_and_low_precision_tracks_float32(capsys):
    # examples/mixed_precision.py as the README runs it: one MLP trained in float32, mixed_bfloat16 and
    # mixed_float16 with loss scaling; its printed summary, then the runs it returns.
    runs = _example().main()
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


@pytest.mark.parametrize(("alias", "dtype"), [("float", "float32"), ("half", "float16"), ("double", "float64")])
def test_policy_accepts_tfs_dtype_aliases(alias, dtype):
    # TF names the policy's dtypes with tf.as_dtype(name).name: "float" is float32 (numpy's would be float64).
    p = mixed_precision.Policy(alias)
    assert (p.name, p.compute_dtype, p.variable_dtype) == (alias, dtype, dtype)
