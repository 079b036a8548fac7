"""`opt.init(params, stepped=mask)`: no slots for params never stepped, as TF creates slots only on a gradient.

Fixtures: tests/data/make_tf_unstepped_fixtures.py (TensorFlow 2.21, run by hand): for Adam, Momentum
and Adagrad (tf.compat.v1), `tf.train.Checkpoint(model=, optimizer=)` after 3 steps in which `u` got no
gradient (TF made no slot for it), and TF's values after a 4th step that gives `u` a gradient.
"""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import checkpoint
import varstate
from varstate import optimizers

DATA = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(__file__))), "data", "tf_unstepped")
with open(os.path.join(DATA, "expected.json")) as f:
    EXPECTED = json.load(f)


def _array(e):
    return np.asarray(e["values"], e["dtype"]).reshape(e["shape"])


def _setup(case):
    spec = EXPECTED[case]
    r = varstate.Registry()
    params = {n: varstate.Variable(jnp.zeros(e["shape"]), name=n, registry=r) for n, e in spec["init"].items()}
    opt = getattr(optimizers, spec["optimizer"].removesuffix("Optimizer"))(**spec["kwargs"])
    return spec, params, opt


def _grads(spec, step, params):
    return {n: (jnp.asarray(_array(spec["grads"][step][n])) if n in spec["grads"][step] else None) for n in params}


@pytest.mark.parametrize("case", sorted(EXPECTED))
def test_tf_checkpoint_with_an_unstepped_variable_restores_matched_and_steps_as_tf(case):
    spec, params, opt = _setup(case)
    stepped = {n: bool(spec["slots_after_step_3"][n]) for n in params}
    assert stepped == {"w": True, "b": True, "u": False}  # what TF did: no slot for `u`
    state = opt.init(params, stepped=stepped)
    assert all(state.get_slot(params["u"], n) is None for n in state.get_slot_names())
    assert all(state.get_slot(params["w"], n) is not None for n in state.get_slot_names())
    status = checkpoint.Checkpoint(model=params, optimizer=state).restore(os.path.join(DATA, case))
    assert status.assert_existing_objects_matched() is status
    status.assert_consumed()  # and every value in TF's checkpoint found its variable

    # Step 4 gives `u` its first gradient: its slots are created (initial values) and stepped, as in TF.
    new_params, new_state = opt.apply_gradients(_grads(spec, 3, params), status.model, status.optimizer)
    after = spec["after_step_4"]
    for n, v in new_params.items():
        np.testing.assert_allclose(v.value, _array(after[n]), rtol=2e-6, atol=1e-7, err_msg=f"{case}: {n}")
        for slot in new_state.get_slot_names():
            got = new_state.get_slot(v, slot)
            assert got is not None and got.name == f"{n}/{slot}"
            np.testing.assert_allclose(got.value, _array(after[f"{n}/{slot}"]), rtol=2e-6, atol=1e-7,
                                       err_msg=f"{case}: {n}/{slot}")
    for name, var in new_state.non_slots.items():
        np.testing.assert_allclose(var.value, _array(after[name]), rtol=2e-6, err_msg=f"{case}: {name}")


def test_without_the_mask_tf_checkpoint_leaves_slots_unmatched():
    # The problem `stepped=` solves: opt.init(params) makes slots TF never made.
    _, params, opt = _setup("adam")
    status = checkpoint.Checkpoint(model=params, optimizer=opt.init(params)).restore(os.path.join(DATA, "adam"))
    with pytest.raises(AssertionError, match=r"u/m|u/v"):
        status.assert_existing_objects_matched()


def test_unstepped_params_keep_no_slots_until_their_first_gradient(tmp_path):
    spec, params, opt = _setup("adam")
    for n, e in spec["init"].items():
        params[n] = params[n].assign(_array(e))
    state = opt.init(params, stepped=lambda path: path != "u")  # the callable form: path -> bool
    # Steps 1-3 as TF ran them (no gradient for `u`): `u` stays without slots.
    for step in range(3):
        params, state = opt.apply_gradients(_grads(spec, step, params), params, state)
        assert state.get_slot(params["u"], "m") is None and state.slots["m"]["u"] is None
    keys = {k for k in spec["keys"] if "OPTIMIZER_SLOT" in k}
    saved = checkpoint.Checkpoint(model=params, optimizer=state)
    assert {k for k in checkpoint.read_checkpoint(saved.write(str(tmp_path / "c"), format="tf")).keys()
            if "OPTIMIZER_SLOT" in k} == keys
    params, state = opt.apply_gradients(_grads(spec, 3, params), params, state)
    for key in ("u", "u/m", "u/v", "w", "w/m", "beta1_power"):
        n, _, slot = key.partition("/")
        got = (state.non_slots[n] if n.startswith("beta") else state.get_slot(params[n], slot) if slot
               else params[n]).value
        np.testing.assert_allclose(got, _array(spec["after_step_4"][key]), rtol=2e-6, atol=1e-7, err_msg=key)


def test_mask_forms_and_errors():
    r = varstate.Registry()
    params = {"enc": {"k": varstate.Variable(jnp.zeros(2), name="enc/k", registry=r),
                      "b": varstate.Variable(jnp.zeros(2), name="enc/b", registry=r)},
              "head": [varstate.Variable(jnp.zeros(3), name="head/w", registry=r), jnp.zeros(2)]}
    opt = optimizers.Momentum(0.1, 0.9)
    # A prefix of params' structure: one bool for a whole subtree; a plain-array param gets no slot either.
    state = opt.init(params, stepped={"enc": False, "head": True})
    slots = state.slots["momentum"]
    assert slots["enc"] == {"k": None, "b": None}
    assert slots["head"][0].name == "head/w/momentum" and slots["head"][1].shape == (2,)
    state = opt.init(params, stepped={"enc": True, "head": [False, False]})
    assert slots is not state.slots["momentum"] and state.slots["momentum"]["head"] == [None, None]
    seen = []
    opt.init(params, stepped=lambda path: seen.append(path) or True)
    assert seen == ["enc/b", "enc/k", "head/0", "head/1"]
    # Growing a state: what it holds is kept, stepped=False adds nothing, True adds the missing slots.
    base = opt.init(params, stepped={"enc": False, "head": True})
    kept = opt.init(params, base, stepped=False)
    assert kept.slots["momentum"]["enc"] == {"k": None, "b": None}
    assert kept.get_slot(params["head"][0], "momentum") is base.get_slot(params["head"][0], "momentum")
    grown = opt.init(params, base, stepped=True)
    assert grown.get_slot(params["head"][0], "momentum") is base.get_slot(params["head"][0], "momentum")
    assert grown.get_slot(params["enc"]["k"], "momentum").name.startswith("enc/k/momentum")
    with pytest.raises(ValueError, match=r"Optimizer.init: stepped= must be a pytree of bools with the structure "
                                         r"of params \(or a prefix of it\), or a callable of a param's path"):
        opt.init(params, stepped={"enc": True})
    with pytest.raises(TypeError, match=r"Optimizer.init: stepped\['enc'\]\['k'\] must be a bool \(True: the "
                                        r"param has been stepped\), got int 1"):
        opt.init(params, stepped={"enc": {"k": 1, "b": True}, "head": True})
    with pytest.raises(TypeError, match=r"Optimizer.init: stepped\('head/0'\) must be a bool .* got str 'yes'"):
        opt.init(params, stepped=lambda path: "yes" if path == "head/0" else True)


def test_tied_weights_share_one_slot_made_if_any_place_is_stepped():
    r = varstate.Registry()
    w = varstate.Variable(jnp.zeros(2), name="tied", registry=r)
    x = varstate.Variable(jnp.ones(2), name="x", registry=r)
    opt = optimizers.Momentum(0.1, 0.9)
    state = opt.init({"a": w, "b": w}, stepped={"a": False, "b": True})
    assert state.slots["momentum"]["a"] is state.slots["momentum"]["b"] is not None
    none = opt.init({"a": w, "b": w, "x": x}, stepped={"a": False, "b": False, "x": True})
    assert none.slots["momentum"]["a"] is None and none.slots["momentum"]["b"] is None
    params, after = opt.apply_gradients({"a": None, "b": None, "x": jnp.ones(2)}, {"a": w, "b": w, "x": x}, none)
    assert after.slots["momentum"]["a"] is None and after.slots["momentum"]["b"] is None
    np.testing.assert_allclose(params["x"].value, [0.9, 0.9])
    assert jax.tree_util.tree_structure(params) == jax.tree_util.tree_structure({"a": w, "b": w, "x": x})
