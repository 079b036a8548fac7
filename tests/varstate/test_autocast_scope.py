"""AutoCastVariable reads follow the autocast scope active at each call, for every jnp/lax entry point.

A jitted `jnp` function (`jnp.multiply`, `jnp.dot`) caches its trace by the
arguments' pytree structure and avals; the autocast dtype must take part in
that key, or whichever scope the first call happened in fixes the dtype of
every later one.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import varstate

VALUES = [1.25, -2.5, 3.0]

# Each entry point as a function of the wrapper; the second operand is in the read's dtype where lax needs it.
ENTRY_POINTS = {
    "jnp.multiply": lambda a: jnp.multiply(a, 2.0),
    "jnp.dot": lambda a: jnp.dot(a, a),
    "lax.add": lambda a: lax.add(a, jnp.ones(3, a.dtype)),
    "jnp.asarray": lambda a: jnp.asarray(a),
    "operator": lambda a: a * 2.0,
}


def _acv(name):
    return varstate.AutoCastVariable(varstate.Variable(jnp.asarray(VALUES, jnp.float32), name=name))


def _expected(name, dtype):
    x = jnp.asarray(VALUES, dtype)
    return np.asarray(ENTRY_POINTS[name](x))


@pytest.mark.parametrize("jitted", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("first_inside", [True, False], ids=["inside_first", "outside_first"])
@pytest.mark.parametrize("name", list(ENTRY_POINTS))
def test_each_call_reads_in_the_scope_it_is_made_in(name, first_inside, jitted):
    fn = ENTRY_POINTS[name]
    if jitted:
        fn = jax.jit(fn)
    a = _acv(f"scope_{name}_{first_inside}_{jitted}")
    order = [jnp.bfloat16, None] if first_inside else [None, jnp.bfloat16]
    for _ in range(2):  # and back again: every call, not only the first two
        for dtype in order:
            with varstate.autocast(dtype):
                out = fn(a)
            want = _expected(name, dtype or jnp.float32)
            assert out.dtype == want.dtype, (name, dtype)
            np.testing.assert_array_equal(np.asarray(out), want)


def test_a_function_traced_outside_a_scope_is_traced_again_inside_one():
    traces = []

    @jax.jit
    def f(a):
        traces.append(a.dtype)
        return jnp.multiply(a, 2.0)

    a = _acv("retrace")
    assert f(a).dtype == jnp.float32
    with varstate.autocast(jnp.bfloat16):
        assert f(a).dtype == jnp.bfloat16
        assert f(a).dtype == jnp.bfloat16  # cached within the scope
    with varstate.autocast(jnp.float16):
        assert f(a).dtype == jnp.float16
    assert f(a).dtype == jnp.float32  # the first trace, reused
    assert traces == [jnp.float32, jnp.bfloat16, jnp.float16]


def test_a_scope_entered_inside_the_jitted_function_reaches_inner_jnp_calls():
    a = _acv("inner_scope")
    assert jnp.multiply(a, 2.0).dtype == jnp.float32  # jnp.multiply's own cache now holds a float32 trace

    @jax.jit
    def f(a):
        with varstate.autocast(jnp.bfloat16):
            inside = jnp.multiply(a, 2.0)
        return inside, jnp.multiply(a, 2.0)

    inside, outside = f(a)
    assert (inside.dtype, outside.dtype) == (jnp.bfloat16, jnp.float32)
    np.testing.assert_array_equal(np.asarray(inside), np.asarray(jnp.asarray(VALUES, jnp.bfloat16) * 2))


def test_gradient_through_a_cached_jnp_call_lands_in_float32():
    a = _acv("grad_scope")
    jnp.multiply(a, 3.0)  # a float32 trace first

    def loss(a):
        with varstate.autocast(jnp.bfloat16):
            y = jnp.multiply(a, 3.0)
        assert y.dtype == jnp.bfloat16
        return y.astype(jnp.float32).sum()

    g = jax.grad(loss)(a).__varstate_variable__().value
    assert g.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(g), np.full(3, 3.0, np.float32))
