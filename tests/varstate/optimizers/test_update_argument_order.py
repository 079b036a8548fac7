"""optax's two-argument habit, ``opt.update(grads, state)``, and an uninitialized param: messages naming the class."""

import jax.numpy as jnp
import optax
import pytest

import varstate
from varstate.optimizers import Adam, GradientDescent, from_optax
from varstate.optimizers import keras as keras_opt

_FIX = (r"The arguments are update\(grads, params, state\), params between grads and state; optax's "
        r"update\(grads, state, params\) order is opt\.to_optax\(\)'s\. Call opt\.update\(grads, params, state\), "
        r"or step with tx = opt\.to_optax\(\): tx\.update\(grads, tx_state, params\)")


@pytest.mark.parametrize(("opt", "name"), [(Adam(0.1), "Adam"), (GradientDescent(0.1), "GradientDescent"),
                                           (keras_opt.Adam(0.1), "Adam")])
def test_update_without_params_names_the_class_and_the_order(opt, name):
    params = {"w": varstate.Variable(jnp.ones(2), name="w")}
    state = opt.init(params)
    with pytest.raises(TypeError, match=rf"^{name}\.update\(grads, state\): missing the state\. {_FIX}"):
        opt.update({"w": jnp.ones(2)}, state)
    with pytest.raises(TypeError, match=rf"^{name}\.update\(\) missing its argument 'state' \(1 positional given\)"):
        opt.update({"w": jnp.ones(2)})
    new, _ = opt.update({"w": jnp.ones(2)}, params, state=state)  # state by keyword passes
    assert new["w"].resource_id == params["w"].resource_id


def test_from_optax_points_at_the_hosted_transformation():
    opt = from_optax(optax.sgd(0.1))
    p = [jnp.ones(2)]
    with pytest.raises(TypeError, match=r"^from_optax\(tx\)\.update\(grads, state\): missing the state\. .*order is "
                                        r"the hosted tx's\. .*or step with tx itself"):
        opt.update([jnp.ones(2)], opt.init(p))


def test_uninitialized_param_names_the_class():
    with pytest.raises(ValueError, match=r"^Adam\.init: 'u(_\d+)?' is uninitialized; initialize or restore it"):
        Adam(0.1).init([varstate.uninitialized((2,), jnp.float32, name="u")])
