"""Optimizer state that does not belong to the params: missing slots are created (as TF does), others kept.

Reference: TF's optimizers create a slot with its initial value the first time
they step a variable that has none (`_zeros_slot` / `_create_slots` only where
missing), and keep every existing slot. So a re-created model stepped with an
old state and ``reinitialize_slots=True`` must get fresh slots (not the old
model's, and not none), the checkpoint must hold them, and the step after
matches a fresh state's step. Without the option that state is refused
(test_foreign_state.py): its slots belong to other Variables.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import checkpoint
from varstate import IndexedSlices, Variable
from varstate.mixed_precision import LossScaleOptimizer
from varstate.optimizers import Adagrad, Adam, GradientDescent, Momentum, OptimizerState, RMSProp, from_optax

OPTIMIZERS = {
    "gd": lambda: GradientDescent(0.1),
    "momentum": lambda: Momentum(0.1, 0.9),
    "adam": lambda: Adam(0.1),
    "lazy_adam": lambda: Adam(0.1, lazy=True),
    "adagrad": lambda: Adagrad(0.1, initial_accumulator_value=0.5),
    "rmsprop": lambda: RMSProp(0.1, momentum=0.5, centered=True),
    "optax_adam": lambda: from_optax(optax.adam(0.1)),
    "loss_scale_adam": lambda: LossScaleOptimizer(Adam(0.1), initial_scale=4.0),
}


def _is_var(x):
    return isinstance(x, Variable)


def _values(tree):
    return jax.tree.map(lambda x: np.asarray(x.value) if isinstance(x, Variable) else np.asarray(x), tree,
                        is_leaf=_is_var)


def _model(scale=1.0):
    return {"w": Variable(jnp.arange(6.0).reshape(3, 2) * scale, name="w"), "b": Variable(jnp.ones(2), name="b")}


GRADS = {"w": jnp.full((3, 2), 0.5), "b": jnp.array([1.0, -2.0])}


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_a_re_created_model_gets_fresh_slots_that_a_checkpoint_holds(name, tmp_path):
    opt = OPTIMIZERS[name]()
    old = _model()
    old_params, old_state = opt.apply_gradients(GRADS, old, opt.init(old))
    # The reference: fresh slots and the old state's non-slots (TF's non-slots, such as Adam's beta powers,
    # belong to the optimizer, not to a variable: they go on counting). Copies, as the step donates the state.
    reference = _model()
    copied = {k: Variable(v.value, trainable=False) for k, v in old_state.non_slots.items()}
    ref_state = opt.init(reference, OptimizerState(slots={}, non_slots=copied))
    # The model is built again (same structure, new Variables) and stepped with the old state.
    params = _model()
    new_params, state = opt.apply_gradients(GRADS, params, old_state, reinitialize_slots=True)
    reference, ref_state = opt.apply_gradients(GRADS, reference, ref_state)
    for k in ("w", "b"):
        np.testing.assert_array_equal(new_params[k].value, reference[k].value)  # as from a fresh state
        for slot_name in state.get_slot_names():
            slot = state.get_slot(new_params[k], slot_name)
            assert slot is not None and slot.handle.slot_of == params[k].resource_id, slot_name
            np.testing.assert_array_equal(slot.value, ref_state.get_slot(reference[k], slot_name).value)
            assert slot.resource_id != old_state.get_slot(old_params[k], slot_name).resource_id
    # The old model's slots stay the old model's: untouched by the new model's step.
    for slot_name in old_state.get_slot_names():
        assert not old_state.get_slot(old_params["w"], slot_name).handle.slot_of == params["w"].resource_id
    path = checkpoint.Checkpoint(model=new_params, optimizer=state).write(str(tmp_path / "c"), format="tf")
    keys = checkpoint.read_checkpoint(path).keys()
    for slot_name in state.get_slot_names():
        assert f"model/w/.OPTIMIZER_SLOT/optimizer/{slot_name}/.ATTRIBUTES/VARIABLE_VALUE" in keys


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_a_grown_model_keeps_its_slots_and_gets_new_ones_without_a_recompile_after(name, compiles):
    opt = OPTIMIZERS[name]()
    params = _model()
    params, state = opt.apply_gradients(GRADS, params, opt.init(params))
    kept = {n: state.get_slot(params["w"], n).resource_id for n in state.get_slot_names()}
    # A head is added: the old variables keep their slots (ids and values), the new one gets fresh slots.
    grown = {**params, "head": Variable(jnp.ones(4), name="head")}
    grads = {**GRADS, "head": jnp.ones(4)}
    stepped, grown_state = opt.apply_gradients(grads, grown, state)
    reference = _model()
    ref_state = opt.init(reference)
    for _ in range(2):  # the same two steps without the head
        reference, ref_state = opt.apply_gradients(GRADS, reference, ref_state)
    for n, rid in kept.items():
        again = grown_state.get_slot(stepped["w"], n)
        assert again.resource_id == rid
        np.testing.assert_array_equal(again.value, ref_state.get_slot(reference["w"], n).value)
    np.testing.assert_array_equal(stepped["w"].value, reference["w"].value)
    for n in grown_state.get_slot_names():
        assert grown_state.get_slot(stepped["head"], n).name.startswith("head/")
    compiled = compiles("_flat_step")
    for _ in range(3):
        stepped, grown_state = opt.apply_gradients(grads, stepped, grown_state)
    assert compiles("_flat_step") == compiled


def test_a_kept_slot_continues_where_it_was_and_the_new_one_starts_from_its_initial_value():
    # Adam's m after one step is (1 - beta1) * g; a kept m after two steps is beta1 * m1 + (1 - beta1) * g.
    opt = Adam(0.1, beta1=0.5)
    w = Variable(jnp.zeros(2), name="w")
    (w,), state = opt.apply_gradients([jnp.ones(2)], [w], opt.init([w]))
    v = Variable(jnp.zeros(2), name="v")
    (w, v), state = opt.apply_gradients([jnp.ones(2), jnp.ones(2)], [w, v], state)
    np.testing.assert_allclose(state.get_slot(w, "m").value, [0.75, 0.75])
    np.testing.assert_allclose(state.get_slot(v, "m").value, [0.5, 0.5])


def test_a_state_of_another_structure_finds_slots_by_identity():
    opt = Momentum(0.1, 0.9)
    w, b = Variable(jnp.ones(2), name="w"), Variable(jnp.ones(3), name="b")
    (w, b), state = opt.apply_gradients([jnp.ones(2), jnp.ones(3)], [w, b], opt.init([w, b]))
    before = np.asarray(state.get_slot(b, "momentum").value)
    # The same variables in a dict, in another order: their slots are the list state's, found by identity.
    new, new_state = opt.apply_gradients({"b": jnp.ones(3), "w": jnp.ones(2)}, {"b": b, "w": w}, state)
    assert new_state.slots["momentum"]["b"].resource_id == state.get_slot(b, "momentum").resource_id
    np.testing.assert_allclose(new_state.get_slot(new["b"], "momentum").value, before * 0.9 + 1.0)


def test_missing_non_slots_are_created_and_other_optimizers_slots_pass_through():
    w = Variable(jnp.ones(2), name="w")
    momentum_state = Momentum(0.1, 0.9).init([w])
    (w2,), state = Adam(0.1).apply_gradients([jnp.ones(2)], [w], momentum_state)
    assert sorted(state.non_slots) == ["beta1_power", "beta2_power"]
    np.testing.assert_allclose(state.non_slot("beta1_power").value, 0.81)
    assert state.get_slot_names() == ["m", "momentum", "v"]
    carried = state.slots["momentum"][0]  # another optimizer's slot: carried through the step unchanged
    assert carried.handle is w.handle.registry[carried.resource_id] and carried.name.startswith("w/momentum")
    np.testing.assert_array_equal(carried.value, np.zeros(2))
    fresh = Variable(jnp.ones(2))
    ref, _ = Adam(0.1).apply_gradients([jnp.ones(2)], [fresh], Adam(0.1).init([fresh]))
    np.testing.assert_array_equal(w2.value, ref[0].value)


def test_init_with_a_state_keeps_its_slots_and_makes_the_rest():
    opt = Adam(0.1)
    w, b = Variable(jnp.ones(2), name="w"), Variable(jnp.ones(3), name="b")
    state = opt.init([w])
    grown = opt.init([w, b], state)
    assert grown.get_slot(w, "m") is state.get_slot(w, "m")
    assert grown.non_slot("beta1_power") is state.non_slot("beta1_power")
    assert grown.get_slot(b, "v").name.startswith("b/v") and grown.get_slot(b, "v").shape == (3,)


def test_update_under_a_callers_jit_names_the_missing_slot_and_the_fix():
    opt = Adam(0.1)
    old = Variable(jnp.ones(2), name="old")
    state = opt.init({"w": old})
    params = {"w": Variable(jnp.ones(2), name="new")}
    want = (r"Adam.update: no slot 'm' for 'new(_\d+)?' \(params\['w'\]\): the state holds the slot of another "
            r"variable \('old(_\d+)?/m'\) there\. The state was made for other params \(a grown model, another "
            r"model's state\)\. apply_gradients creates the missing state, as TF's optimizers do, unless the state "
            r"holds slots of other Variables \(then it raises; reinitialize_slots=True makes fresh slots\); inside "
            r"your own jit, call `state = opt\.init\(params, state\)` first \(outside jit\): it keeps the state's "
            r"slots for these params and creates the others\.")
    with pytest.raises(ValueError, match=want):
        jax.jit(opt.update)({"w": jnp.ones(2)}, params, state)
    new, new_state = jax.jit(opt.update)({"w": jnp.ones(2)}, params, opt.init(params, state, reinitialize_slots=True))
    assert new_state.get_slot(new["w"], "m") is not None
    no_non_slots = OptimizerState(slots=opt.init(params).slots, non_slots={})
    with pytest.raises(ValueError, match=r"Adam.update: the state has no non-slot variable 'beta1_power' \(it "
                                         r"has \[\]\); it was made by another optimizer\. apply_gradients creates "
                                         r"it; inside your own jit, call `state = opt\.init\(params, state\)` first"):
        opt.update({"w": jnp.ones(2)}, params, no_non_slots)
    with pytest.raises(ValueError, match=r"Adam.update: the state has no 'm' slots \(it has \[\]\)\. The state "
                                         r"was made for other params"):
        opt.update({"w": jnp.ones(2)}, params, GradientDescent(0.1).init(params))
    with pytest.raises(ValueError, match=r"Adam.update: state\.slots\['m'\] does not have the structure of "
                                         r"params\."):
        opt.update({"w": jnp.ones(2), "b": jnp.ones(2)}, {**params, "b": jnp.ones(2)}, opt.init(params))


def test_a_slot_that_does_not_fit_its_param_is_an_error_naming_both():
    opt = Adam(0.1)
    # Plain arrays have no identity: a state made for other shapes is found by position and refused.
    state = opt.init({"w": jnp.ones(3)})
    want = (r"The optimizer state does not fit the params: slot 'm' of params\['w'\] is the plain array there with "
            r"shape \(3,\) and dtype float32, but the param needs shape \(4,\) and dtype float32\. Make a state for "
            r"these params with opt\.init\(params\), or restore the state saved with them\.")
    with pytest.raises(ValueError, match=want):
        opt.apply_gradients({"w": jnp.ones(4)}, {"w": jnp.ones(4)}, state)
    with pytest.raises(ValueError, match=r"slot 'm' of params\['w'\] is the plain array there with shape \(3,\) and "
                                         r"dtype float32, but the param needs shape \(3,\) and dtype bfloat16"):
        opt.apply_gradients({"w": jnp.ones(3, jnp.bfloat16)}, {"w": jnp.ones(3, jnp.bfloat16)}, state)
    # A slot Variable linked to its param but holding another shape (a state edited by hand).
    from varstate import _seam

    w = Variable(jnp.ones(2), name="w")
    state = opt.init([w])
    bad = _seam.with_value(state.get_slot(w, "m"), jnp.zeros(5))
    broken = OptimizerState(slots={**state.slots, "m": [bad]}, non_slots=state.non_slots)
    with pytest.raises(ValueError, match=r"slot 'm' of 'w(_\d+)?' \(params\[0\]\) is 'w(_\d+)?/m' with shape \(5,\) "
                                         r"and dtype float32, but the param needs shape \(2,\) and dtype float32"):
        opt.apply_gradients([jnp.ones(2)], [w], broken)


def test_sparse_and_tied_params_with_a_foreign_state():
    opt = Adam(0.1)
    old = Variable(jnp.ones((4, 2)), name="emb")
    state = opt.init({"a": old, "b": old})
    e = Variable(jnp.ones((4, 2)), name="emb")
    grads = {"a": IndexedSlices(jnp.ones((1, 2)), jnp.array([1]), (4, 2)), "b": jnp.ones((4, 2))}
    new, new_state = opt.apply_gradients(grads, {"a": e, "b": e}, state, reinitialize_slots=True)
    assert new_state.slots["m"]["a"].handle is new_state.slots["m"]["b"].handle
    assert new_state.get_slot(new["a"], "m").handle.slot_of == e.resource_id
