"""mixed_precision: Policy (TF's names, dtypes and errors), autocast_variables (the example: test_small_examples)."""

import jax.numpy as jnp
import pytest

import varstate
from varstate import mixed_precision


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


@pytest.mark.parametrize(("alias", "dtype"), [("float", "float32"), ("half", "float16"), ("double", "float64")])
def test_policy_accepts_tfs_dtype_aliases(alias, dtype):
    # TF names the policy's dtypes with tf.as_dtype(name).name: "float" is float32 (numpy's would be float64).
    p = mixed_precision.Policy(alias)
    assert (p.name, p.compute_dtype, p.variable_dtype) == (alias, dtype, dtype)
