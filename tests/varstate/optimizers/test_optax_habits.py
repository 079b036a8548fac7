"""An optax user's habits on varstate's optimizers: optax's argument order, one API's state given to the other.

Each mistake raises a TypeError naming the call, what it got and the fix (it was an AttributeError on a private
attribute, or a structure mismatch naming the slots); the fix then runs.
"""

import re

import jax.numpy as jnp
import numpy as np
import pytest

import varstate
from varstate.optimizers import Adam, GradientDescent
from varstate.optimizers import keras as keras_opt


def _setup(opt):
    params = {"w": varstate.Variable(jnp.ones(3), name="w")}
    return params, opt.init(params), {"w": jnp.full(3, 0.5)}


@pytest.mark.parametrize("opt", [Adam(0.1), keras_opt.SGD(0.1)], ids=["Adam", "keras.SGD"])
@pytest.mark.parametrize("verb", ["update", "apply_gradients"])
def test_optax_argument_order_is_named(opt, verb):
    params, state, grads = _setup(opt)
    name = type(opt).__name__
    with pytest.raises(TypeError, match="^" + re.escape(
            f"{name}.{verb}: params is an OptimizerState: the arguments are (grads, params, state), where optax's "
            f"update takes (grads, state, params). Call opt.{verb}(grads, params, state).") + "$"):
        getattr(opt, verb)(grads, state, params)
    getattr(opt, verb)(grads, params, state)  # the fix; nothing was donated by the refused call


def test_the_optax_forms_state_and_ours_do_not_mix():
    opt = GradientDescent(0.5)
    params, state, grads = _setup(opt)
    tx = opt.to_optax()
    opt_state = tx.init(varstate.values(params))
    with pytest.raises(TypeError, match="^" + re.escape(
            "GradientDescent.apply_gradients: state is the optax state of GradientDescent(...).to_optax() (a "
            "TFOptimizerState), where apply_gradients takes the OptimizerState that GradientDescent.init(params) "
            "makes. Keep to one form: tx.update(grads, opt_state, params) with the optax state, or state = "
            "opt.init(params).") + "$"):
        opt.apply_gradients(grads, params, opt_state)
    with pytest.raises(TypeError, match="^" + re.escape(
            "GradientDescent.init: state is a dict, not the OptimizerState that GradientDescent.init(params) makes. "
            "Call state = opt.init(params) once, then pass the state each step returns.") + "$"):
        opt.init(params, {"w": jnp.zeros(3)})
    with pytest.raises(TypeError, match="^" + re.escape(
            "to_optax(GradientDescent).update: state is an OptimizerState (an OptimizerState is "
            "GradientDescent.init's, for apply_gradients and update); the optax form takes the state its own init "
            "makes: opt_state = tx.init(params), then the one each update returns.") + "$"):
        tx.update(grads, state, varstate.values(params))
    updates, _ = tx.update(grads, opt_state, varstate.values(params))  # the fix: -learning_rate * grad
    np.testing.assert_array_equal(updates["w"], np.full(3, -0.25, np.float32))
