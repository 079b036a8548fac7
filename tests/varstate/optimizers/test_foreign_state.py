"""A state whose slots belong to other Variables is refused, not silently replaced by fresh slots (issue 24 item 2).

Reference: TF's optimizers key their slots by variable, so a slot made for
one variable is never handed to another; a step over variables that have no
slot creates one only because none exists. Here a state loaded or built for
other Variables (a model rebuilt after a restore; `from_nnx(model)` params
with a state read from a Keras-layout file) has slots, just not linked to
these params: completing it with zeros would drop the loaded state without a
word. So it raises, naming the first param on each side and the fixes; the
fixed runs continue exactly where an uninterrupted run is. A param that
merely has no slot yet (never stepped, a grown model) still gets one.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import checkpoint
import varstate
from checkpoint import keras
from varstate import Variable
from varstate.mixed_precision import LossScaleOptimizer
from varstate.nnx import from_nnx
from varstate.optimizers import Adam, Momentum, from_optax
from varstate.optimizers import keras as keras_opt


def _model(prefix, registry=None):
    return {"w": Variable(jnp.arange(6.0).reshape(3, 2), name=f"{prefix}w", registry=registry),
            "b": Variable(jnp.ones(2), name=f"{prefix}b", registry=registry)}


def _grads(t):
    return {"w": jnp.full((3, 2), 0.5 + t), "b": jnp.array([1.0, -2.0]) * (t + 1)}


def _values(params, state):
    return [np.asarray(x) for x in jax.tree.leaves(varstate.values((params, state)))]


def _foreign(param, param_path, slot, where, other):
    """The refusal's message, for a param and the first slot of another Variable."""
    return (
        rf"The optimizer state holds slots of other Variables: '{param}' \(params{param_path}\) has no slot "
        rf"'{slot}' in it, while state\.slots\['{slot}'\]{where} is '{other}/{slot}', the slot of the Variable "
        rf"'{other}', which is not among the params\. Making fresh slots here would drop that state \(a model "
        r"rebuilt after a restore, or from_nnx\(model\) params with a state loaded for other Variables\)\. Build "
        r"the state on these params: state = opt\.init\(params\), or restore the saved state into "
        r"opt\.init\(params\) \(for a Keras file, checkpoint\.keras\.load_optimizer_state\(path, opt, params\)\); "
        r"or pass reinitialize_slots=True to apply_gradients or init to start these params' slots from their "
        r"initial values\."
    )


def test_params_rebuilt_after_a_restore_raise_and_restoring_into_their_own_state_continues(tmp_path):
    opt = Adam(0.1)
    registry = varstate.Registry()
    params = _model("", registry)
    params, state = opt.apply_gradients(_grads(0), params, opt.init(params))
    path = checkpoint.Checkpoint(model=params, opt=state).write(str(tmp_path / "c"), format="tf")
    straight, straight_state = opt.apply_gradients(_grads(1), params, state)

    template = _model("r/", varstate.Registry())
    restored = checkpoint.Checkpoint(model=template, opt=opt.init(template)).restore(path)
    rebuilt = _model("", varstate.Registry())  # the model built again after the restore: other Variables
    with pytest.raises(ValueError, match=_foreign("b", r"\['b'\]", "m", r"\['b'\]", "r/b")):
        opt.apply_gradients(_grads(1), rebuilt, restored.opt)
    with pytest.raises(ValueError, match=_foreign("b", r"\['b'\]", "m", r"\['b'\]", "r/b")):
        opt.init(rebuilt, restored.opt)
    # Nothing was donated by the refusal: the restored state still steps its own params.
    assert restored.opt.get_slot(restored.model["w"], "m") is not None

    # The fix: restore into opt.init(params) of the params that go on training.
    fixed = checkpoint.Checkpoint(model=rebuilt, opt=opt.init(rebuilt)).restore(path)
    params, state = opt.apply_gradients(_grads(1), fixed.model, fixed.opt)
    for a, b in zip(_values(params, state), _values(straight, straight_state), strict=True):
        np.testing.assert_array_equal(a, b)


class _MLP(nnx.Module):
    def __init__(self, rngs):
        self.layers = nnx.List([nnx.Linear(3, 4, rngs=rngs), nnx.Linear(4, 1, rngs=rngs)])


def test_from_nnx_params_with_a_state_read_from_a_keras_file_raise_and_loading_into_them_continues(tmp_path):
    opt = keras_opt.Adam(0.01)
    model = _MLP(nnx.Rngs(0))
    params = from_nnx(model, registry=varstate.Registry())
    grads = jax.tree.map(lambda v: jnp.full(v.shape, 0.25), varstate.values(params))
    params, state = opt.apply_gradients(grads, params, opt.init(params))
    path = keras.save_optimizer_state(str(tmp_path / "ckpt"), opt, params, state)
    straight, straight_state = opt.apply_gradients(grads, params, state)

    _, loaded = keras.load_optimizer_state(path, opt)  # the state, with the file's own Variables
    fresh = from_nnx(model, registry=varstate.Registry())
    with pytest.raises(ValueError, match=_foreign("layers/0/bias", r"\['layers'\]\[0\]\['bias'\]", "momentum",
                                                  r"\[0\]", "layers/0/bias")):
        opt.apply_gradients(grads, fresh, loaded)

    # The fix: the file's state loaded into these params (their values come from the file too).
    fresh, loaded = keras.load_optimizer_state(path, opt, fresh)
    params, state = opt.apply_gradients(grads, fresh, loaded)
    for a, b in zip(_values(params, state), _values(straight, straight_state), strict=True):
        np.testing.assert_array_equal(a, b)


OPTIMIZERS = {
    "momentum": lambda: Momentum(0.1, 0.9),
    "keras_adam": lambda: keras_opt.Adam(0.1),
    "optax_adam": lambda: from_optax(optax.adam(0.1)),
    "loss_scale_adam": lambda: LossScaleOptimizer(Adam(0.1), initial_scale=4.0),
}


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_every_optimizer_refuses_a_foreign_state_unless_asked_to_reinitialize(name):
    opt = OPTIMIZERS[name]()
    old = _model("old/", varstate.Registry())
    old, state = opt.apply_gradients(_grads(0), old, opt.init(old))
    new = _model("new/", varstate.Registry())
    slot = state.get_slot_names()[0]
    with pytest.raises(ValueError, match=r"'new/b' \(params\['b'\]\) has no slot '\w+' in it, while "
                                         r"state\.slots\['\w+'\]\['b'\] is 'old/b/\w+', the slot of the Variable "
                                         r"'old/b', which is not among the params"):
        opt.apply_gradients(_grads(0), new, state)
    # Asked for: fresh slots, the step of a state made for the new params (the old non-slots are carried on).
    stepped, got = opt.apply_gradients(_grads(0), new, state, reinitialize_slots=True)
    assert got.get_slot(stepped["w"], slot).handle.slot_of == new["w"].resource_id
    grown = opt.init(new, state, reinitialize_slots=True)
    assert grown.get_slot(new["b"], slot).name.startswith("new/b")


def test_a_param_never_stepped_or_added_still_gets_its_slots_on_its_first_gradient():
    opt = Adam(0.1)
    params = _model("")
    state = opt.init(params, stepped={"w": True, "b": False})
    assert state.slots["m"]["b"] is None
    params, state = opt.apply_gradients({"w": jnp.ones((3, 2)), "b": None}, params, state)
    params, state = opt.apply_gradients(_grads(0), params, state)  # b's first gradient: its slots are made
    assert state.get_slot(params["b"], "m").name.startswith("b")
    head = Variable(jnp.zeros(3), name="head")  # a grown model: only the new param lacks slots
    grown = {**params, "head": head}
    grown, state = opt.apply_gradients({**_grads(0), "head": jnp.ones(3)}, grown, state)
    # A fresh m after one step: (1 - beta1) * g, in float32.
    np.testing.assert_array_equal(state.get_slot(grown["head"], "m").value, np.full(3, 1 - np.float32(0.9)))
