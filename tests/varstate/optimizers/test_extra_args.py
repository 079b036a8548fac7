"""Extra keyword arguments of `apply_gradients`/`update` reach `update` as traced arguments (optax's `value=`)."""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from varstate import Registry, Variable
from varstate.optimizers import Adam, GradientDescent


@dataclasses.dataclass(frozen=True)
class ScaledDescent(GradientDescent):
    """Gradient descent whose gradients are multiplied by `scale` and shifted by `extra['shift']` per step."""

    def update(self, grads, params, state, step=None, *, scale, extra=None):
        shift = 0.0 if extra is None else extra["shift"]
        grads = {k: g * scale + shift for k, g in grads.items()}
        return super().update(grads, params, state, step)


def _params():
    return {"w": Variable(jnp.ones(3), name="w", registry=Registry())}


def test_extra_args_are_traced_into_update_without_recompiling(compiles):
    opt = ScaledDescent(0.5)
    params = _params()
    state = opt.init(params)
    params, state = opt.apply_gradients({"w": jnp.ones(3)}, params, state, scale=jnp.float32(2.0))
    np.testing.assert_array_equal(params["w"].value, np.ones(3) - 0.5 * 2.0)
    compiled = compiles("_flat_step")
    params, state = opt.apply_gradients({"w": jnp.ones(3)}, params, state, scale=jnp.float32(0.5),
                                        extra={"shift": jnp.float32(1.0)})
    params, state = opt.apply_gradients({"w": jnp.ones(3)}, params, state, scale=jnp.float32(4.0),
                                        extra={"shift": jnp.float32(-1.0)})
    # 0 - 0.5 * (0.5 + 1) - 0.5 * (4 - 1): the values arrive traced (a Python side never sees them)
    np.testing.assert_allclose(params["w"].value, np.full(3, 0.0 - 0.75 - 1.5))
    assert compiles("_flat_step") == compiled + 1  # once for the new `extra` structure, not per value


def test_update_takes_them_too():
    opt = ScaledDescent(0.5)
    params = _params()
    new, _ = opt.update({"w": jnp.ones(3)}, params, opt.init(params), scale=3.0)
    np.testing.assert_array_equal(new["w"].value, np.full(3, -0.5))


@pytest.mark.parametrize("opt", [Adam(0.1), GradientDescent(0.1)], ids=["Adam", "GradientDescent"])
def test_built_in_optimizers_refuse_an_extra_argument_by_name(opt):
    name = type(opt).__name__
    params = _params()
    state = opt.init(params)
    want = (rf"^{name}\.update\(\) got an unexpected keyword argument 'value': {name} takes grads, params, state "
            r"and step only \(extra keyword arguments of apply_gradients/update are for optimizers whose update "
            r"accepts them, e\.g\. from_optax\)\.$")
    with pytest.raises(TypeError, match=want):
        opt.apply_gradients({"w": jnp.ones(3)}, params, state, value=jnp.float32(1.0))
    np.testing.assert_array_equal(params["w"].value, np.ones(3))  # refused before anything was donated
    with pytest.raises(TypeError, match=want):
        opt.update({"w": jnp.ones(3)}, params, state, value=1.0)
