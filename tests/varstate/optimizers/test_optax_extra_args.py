"""`from_optax` hosts transformations whose update needs more than grads (``value=``, ``grad=``, ``value_fn=``).

The reference is optax itself, run on plain arrays with `optax.apply_updates`.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import varstate
from varstate.optimizers import GradientDescent, LossScaleOptimizer, from_optax

LOSSES = (1.0, 2.0, 3.0, 0.5, 0.7, 0.9)


def _plateau():
    return optax.chain(optax.sgd(1.0), optax.contrib.reduce_on_plateau(factor=0.5, patience=1))


def _reference(tx, grads, losses):
    params = [jnp.ones(2)]
    state = tx.init(params)
    out = []
    update = jax.jit(tx.update)
    for loss, g in zip(losses, grads, strict=True):
        updates, state = update([g], state, params, value=loss)
        params = optax.apply_updates(params, updates)
        out.append((params[0], state[1].scale))
    return out


def test_reduce_on_plateau_gets_value_through_update_under_jit():
    grads = [jnp.asarray(np.random.default_rng(i).normal(size=2), jnp.float32) for i in range(len(LOSSES))]
    opt = from_optax(_plateau())
    w = varstate.Variable(jnp.ones(2), name="w")
    params = [w]
    state = opt.init(params)
    step = jax.jit(opt.update)
    for (ref_w, ref_scale), loss, g in zip(_reference(_plateau(), grads, LOSSES), LOSSES, grads, strict=True):
        params, state = step([g], params, state, value=jnp.float32(loss))
        np.testing.assert_array_equal(params[0].value, ref_w)
        assert state.non_slot("scale").value == ref_scale
    assert params[0].resource_id == w.resource_id
    # Losses 1, 2, 3, 0.5, 0.7, 0.9 with patience 1: no improvement at 2, 3, 0.7 and 0.9: four halvings.
    assert state.non_slot("scale").value == 0.5**4


def test_loss_scale_optimizer_passes_extra_args_to_its_inner_optimizer():
    grads = [jnp.asarray(np.random.default_rng(i).normal(size=2), jnp.float32) for i in range(len(LOSSES))]
    for dynamic in (True, False):
        opt = LossScaleOptimizer(from_optax(_plateau()), dynamic=dynamic, initial_scale=4.0)
        params = [jnp.ones(2)]
        state = opt.init(params)
        step = jax.jit(opt.update)
        for (ref_w, ref_scale), loss, g in zip(_reference(_plateau(), grads, LOSSES), LOSSES, grads, strict=True):
            params, state = step([g], params, state, value=loss)
            np.testing.assert_array_equal(params[0], ref_w)
            assert state.non_slot("scale").value == ref_scale


@pytest.mark.parametrize("via", ["update in a jit", "apply_gradients"])
def test_lbfgs_gets_value_grad_and_value_fn(via):
    # apply_gradients takes the function value_fn as part of its compiled step's key (a static jit argument).
    target = jnp.array([1.0, -2.0])

    def f(p):  # value_fn sees the params as arrays, with the params' structure
        return jnp.sum((p["w"] - target) ** 2 * jnp.array([1.0, 10.0]))

    opt = from_optax(optax.lbfgs())
    params = {"w": varstate.Variable(jnp.zeros(2), name="w")}
    state = opt.init(params)
    ref_tx = optax.lbfgs()
    ref = {"w": jnp.zeros(2)}
    ref_state = ref_tx.init(ref)

    @jax.jit
    def step(params, state):
        value, grad = jax.value_and_grad(f)({"w": params["w"].value})
        return opt.update(grad, params, state, value=value, grad=grad, value_fn=f)

    @jax.jit
    def ref_step(ref, ref_state):
        value, grad = jax.value_and_grad(f)(ref)
        updates, ref_state = ref_tx.update(grad, ref_state, ref, value=value, grad=grad, value_fn=f)
        return optax.apply_updates(ref, updates), ref_state

    for _ in range(5):
        if via == "apply_gradients":
            value, grad = jax.value_and_grad(f)(varstate.values(params))
            params, state = opt.apply_gradients(grad, params, state, value=value, grad=grad, value_fn=f)
        else:
            params, state = step(params, state)
        ref, ref_state = ref_step(ref, ref_state)
        np.testing.assert_array_equal(params["w"].value, ref["w"])
    np.testing.assert_allclose(params["w"].value, target, atol=1e-5)


def test_missing_or_unexpected_extra_args_are_optax_errors():
    opt = from_optax(_plateau())
    p = [jnp.ones(2)]
    with pytest.raises(TypeError, match="value"):  # reduce_on_plateau requires value=
        opt.update([jnp.ones(2)], p, opt.init(p))
    plain = from_optax(optax.scale_by_adam())  # a GradientTransformation without extra-args support
    with pytest.raises(TypeError, match="unexpected keyword argument 'value'"):
        plain.update([jnp.ones(2)], p, plain.init(p), value=1.0)
    # The TF optimizers take none (Optimizer.update's own message).
    gd = GradientDescent(0.1)
    with pytest.raises(TypeError, match="unexpected keyword argument 'value'"):
        gd.update([jnp.ones(2)], p, gd.init(p), value=1.0)
