"""`apply_gradients(..., global_step=gs)` increments TF's global step in the same jitted step, as TF v1 does."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import varstate
from varstate import Registry, Variable
from varstate.optimizers import GradientDescent


def _setup(lr=0.5):
    reg = Registry()
    w = Variable(jnp.zeros(2), name="w", registry=reg)
    opt = GradientDescent(lr)
    return reg, [w], opt, opt.init([w])


def test_the_global_step_is_incremented_and_returned_third(compiles):
    reg, params, opt, state = _setup()
    gs = varstate.get_or_create_global_step(reg)
    out = opt.apply_gradients([jnp.ones(2)], params, state, global_step=gs)
    assert len(out) == 3
    params, state, gs2 = out
    assert int(gs2.value) == 1 and gs2.resource_id == gs.resource_id and gs2.name == "global_step"
    assert gs2.dtype == gs.dtype and gs2.handle.saved_dtype == np.dtype(np.int64)  # still saved as TF's int64
    with pytest.raises(varstate.DonatedVariableError, match="'global_step'"):
        gs.value + 1  # the given version was donated, as params and state are
    compiled = compiles("_flat_step")
    for _ in range(3):
        params, state, gs2 = opt.apply_gradients([jnp.ones(2)], params, state, global_step=gs2)
    assert int(gs2.value) == 4 and compiles("_flat_step") == compiled
    np.testing.assert_array_equal(params[0].value, np.full(2, -2.0))
    assert len(opt.apply_gradients([jnp.ones(2)], params, state)) == 2  # without global_step: (params, state)


def test_a_callable_learning_rate_sees_the_global_step_before_the_increment():
    reg, params, opt, state = _setup(lr=lambda step: 1.0 / (1.0 + step))
    gs = varstate.get_or_create_global_step(reg)
    params, state, gs = opt.apply_gradients([jnp.ones(2)], params, state, global_step=gs)  # lr 1 / (1 + 0)
    params, state, gs = opt.apply_gradients([jnp.ones(2)], params, state, global_step=gs)  # lr 1 / (1 + 1)
    np.testing.assert_allclose(params[0].value, np.full(2, -1.5))
    # step= given explicitly wins; the counter still counts
    params, state, gs = opt.apply_gradients([jnp.ones(2)], params, state, step=jnp.int32(3), global_step=gs)
    np.testing.assert_allclose(params[0].value, np.full(2, -1.75))
    assert int(gs.value) == 3


def test_a_global_step_that_is_not_an_integer_scalar_variable_is_refused():
    _, params, opt, state = _setup()
    with pytest.raises(TypeError, match=r"apply_gradients: global_step must be the global step Variable "
                                        r"\(varstate\.get_or_create_global_step\(\)\), got ArrayImpl"):
        opt.apply_gradients([jnp.ones(2)], params, state, global_step=jnp.int32(0))
    with pytest.raises(TypeError, match="global_step must have an integer dtype, got float32"):
        opt.apply_gradients([jnp.ones(2)], params, state, global_step=Variable(0.0, registry=Registry()))
    with pytest.raises(TypeError, match=r"global_step must be a scalar, got shape \(2,\)"):
        opt.apply_gradients([jnp.ones(2)], params, state, global_step=Variable(jnp.zeros(2, jnp.int32),
                                                                                registry=Registry()))
    np.testing.assert_array_equal(params[0].value, np.zeros(2))  # nothing was stepped


def test_under_a_callers_jit_the_global_step_is_threaded_too():
    reg, params, opt, state = _setup()
    gs = varstate.get_or_create_global_step(reg)
    step = jax.jit(lambda p, s, g: opt.apply_gradients([jnp.ones(2)], p, s, global_step=g))
    params, state, gs = step(params, state, gs)
    params, state, gs = step(params, state, gs)
    assert int(gs.value) == 2
    np.testing.assert_array_equal(params[0].value, np.full(2, -1.0))
