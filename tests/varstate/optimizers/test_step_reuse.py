"""The jitted step is keyed by structure, not identity: a freshly built, identical model reuses the compiled step.

A Variable's treedef holds its `ResourceHandle`, so a jit over Variables traced
and compiled again for every new model. `apply_gradients` now jits over the
arrays with an identity-free signature (the layout, and per Variable its
trainability and slot link as positions) and rebuilds the outputs around the
caller's own identities.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from varstate import Registry, Variable
from varstate.optimizers import Adam, GradientDescent

TRACES: list = []


@dataclasses.dataclass(frozen=True)
class CountingAdam(Adam):
    """Adam that records each trace of its update (a Python side effect runs only while tracing)."""

    def update(self, grads, params, state, step=None):
        TRACES.append(1)
        return super().update(grads, params, state, step)


def _model(registry, frozen=False, tie=False):
    w = Variable(jnp.arange(6.0).reshape(3, 2), name="dense/kernel", registry=registry)
    b = Variable(jnp.ones(2), name="dense/bias", trainable=not frozen, registry=registry)
    return {"w": w, "b": b, "w2": w if tie else Variable(jnp.zeros((3, 2)), name="w2", registry=registry)}


def _grads():
    return {"w": jnp.full((3, 2), 0.5), "b": jnp.full(2, 0.25), "w2": jnp.full((3, 2), 1.0)}


def _adam_closed_form(x, g, lr=0.1, b1=0.9, b2=0.999, eps=1e-8):
    # TF v1 Adam, first step from zero slots: m = (1-b1) g, v = (1-b2) g^2, alpha = lr sqrt(1-b2)/(1-b1).
    m, v = (1 - b1) * g, (1 - b2) * g * g
    return x - lr * np.sqrt(1 - b2) / (1 - b1) * m / (np.sqrt(v) + eps)


def test_a_freshly_built_identical_model_reuses_the_compiled_step_and_keeps_its_own_identity(compiles):
    opt = CountingAdam(0.1)
    first = _model(Registry())
    params, _ = opt.apply_gradients(_grads(), first, opt.init(first))
    traces, compiled = len(TRACES), compiles("_flat_step")
    assert traces >= 1
    for _ in range(2):
        fresh = _model(Registry())  # same names, shapes and links; new identities
        fresh_state = opt.init(fresh)
        new, new_state = opt.apply_gradients(_grads(), fresh, fresh_state)
        assert len(TRACES) == traces and compiles("_flat_step") == compiled  # neither traced nor compiled
        for k in fresh:
            assert new[k].resource_id == fresh[k].resource_id and new[k].name == fresh[k].name
            for n in ("m", "v"):
                slot = new_state.get_slot(new[k], n)
                assert slot.resource_id == fresh_state.get_slot(fresh[k], n).resource_id
                assert slot.handle.slot_of == fresh[k].resource_id
        for k, g in _grads().items():
            np.testing.assert_allclose(new[k].value, _adam_closed_form(np.asarray(_model(Registry())[k].value), g),
                                       rtol=1e-6)
            np.testing.assert_array_equal(new[k].value, params[k].value)  # same executable, same numbers
        assert new_state.non_slot("beta1_power").resource_id == fresh_state.non_slot("beta1_power").resource_id


def test_a_new_model_in_the_same_registry_with_other_names_reuses_it_too():
    opt = CountingAdam(0.1)
    reg = Registry()
    a = _model(reg)
    opt.apply_gradients(_grads(), a, opt.init(a))
    traces = len(TRACES)
    b = _model(reg)  # names made unique: dense/kernel_1, ...
    assert b["w"].name == "dense/kernel_1"
    new, state = opt.apply_gradients(_grads(), b, opt.init(b))
    assert len(TRACES) == traces
    assert state.get_slot(new["w"], "m").name == "dense/kernel_1/m"


@pytest.mark.parametrize("change", ["frozen", "tie"])
def test_a_model_with_other_links_or_trainability_is_traced_again_and_steps_by_its_own_rules(change):
    opt = CountingAdam(0.1)
    base = _model(Registry())
    opt.apply_gradients(_grads(), base, opt.init(base))
    traces = len(TRACES)
    other = _model(Registry(), frozen=change == "frozen", tie=change == "tie")
    new, _ = opt.apply_gradients(_grads(), other, opt.init(other))
    assert len(TRACES) > traces  # same shapes, but the signature differs: its own trace
    g = _grads()
    if change == "frozen":
        np.testing.assert_array_equal(new["b"].value, np.ones(2))  # non-trainable: untouched
    else:  # one variable at two places: one update with the summed gradient, the same version at both
        assert new["w"].resource_id == new["w2"].resource_id == other["w"].resource_id
        np.testing.assert_array_equal(new["w"].value, new["w2"].value)
        np.testing.assert_allclose(new["w"].value, _adam_closed_form(np.arange(6.0).reshape(3, 2), g["w"] + g["w2"]),
                                   rtol=1e-6)


class Restructuring(GradientDescent):
    """An update that returns params as a tuple when given a list: another layout than the step was given."""

    def update(self, grads, params, state, step=None):
        new, state = super().update(grads, params, state, step)
        return tuple(new), state


def test_an_update_that_changes_the_layout_is_refused_naming_the_first_difference():
    opt = dataclasses.dataclass(frozen=True)(Restructuring)(0.5)
    w = Variable(jnp.ones(2), name="w", registry=Registry())
    state = opt.init([w])
    with pytest.raises(ValueError, match=(
            r"^apply_gradients: Restructuring\.update returned params laid out otherwise than it was given; first "
            r"difference: returned params is a tuple where given params is a list\. The jitted step hands its "
            r"outputs back in the caller's own layout: return params in the containers given \(a list for a "
            r"list\) and each Variable's new version in its place, or call update under your own jax\.jit\.")):
        opt.apply_gradients([jnp.ones(2)], [w], state)
    np.testing.assert_array_equal(w.value, np.ones(2))  # refused while traced: nothing donated
    new, _ = jax.jit(opt.update)([jnp.ones(2)], [w], state)  # the fix the message gives
    assert isinstance(new, tuple) and new[0].resource_id == w.resource_id
    np.testing.assert_array_equal(new[0].value, np.full(2, 0.5))


def test_outputs_of_a_reused_step_stay_on_the_fresh_params_devices():
    opt = GradientDescent(0.5)
    dev = jax.devices()[1]

    def fresh():
        return [Variable(jax.device_put(jnp.ones(4), dev), name="w", registry=Registry())]

    a = fresh()
    opt.apply_gradients([jnp.ones(4)], a, opt.init(a))
    b = fresh()
    (nb,), _ = opt.apply_gradients([jnp.ones(4)], b, opt.init(b))
    assert nb.sharding == b[0].sharding and nb.resource_id == b[0].resource_id
    np.testing.assert_array_equal(nb.value, np.full(4, 0.5))
