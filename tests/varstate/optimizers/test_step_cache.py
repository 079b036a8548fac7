"""The step's host path for a structure seen before (issue 25): recognised without a flatten per Variable.

`apply_gradients` recognises params, state and global step it has stepped
before by their containers and, per leaf, the Variable's identity
(`_step._Seen`), and returns the new state as its flat values, whose slot
Variables are made when read (`OptimizerState._from_flat`). Nothing of this
may show: the numbers are the pure `update`'s under the caller's own jit,
the state reads, flattens and checkpoints as one made by `init`, and every
refusal of the first call (a donated version, params that became arrays, a
state of other Variables) is raised the same on a later call over a
structure already seen, with the same message.
"""

import collections
import copy
import re
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import varstate
from varstate import DonatedVariableError, Registry, Variable, mixed_precision
from varstate.optimizers import Adam, OptimizerState
from varstate.optimizers._core._state import LeafLayout


def _model(prefix, registry, tie=False):
    w = Variable(jnp.arange(6.0).reshape(3, 2), name=f"{prefix}w", registry=registry)
    return {"w": w, "b": Variable(jnp.ones(2), name=f"{prefix}b", registry=registry),
            "frozen": Variable(jnp.zeros(2), name=f"{prefix}frozen", trainable=False, registry=registry),
            "tied": w if tie else Variable(jnp.zeros((3, 2)), name=f"{prefix}w2", registry=registry)}


def _grads(t):
    return {"w": jnp.full((3, 2), 0.5 + t), "b": jnp.array([1.0, -2.0]) * (t + 1), "frozen": None,
            "tied": jnp.full((3, 2), 0.25 * t)}


def _reference(opt, params, steps):
    """The pure update under the caller's own jit, one call per step (no cache of ours in the way)."""
    state = opt.init(params)
    update = jax.jit(opt.update)
    for t in range(steps):
        params, state = update(_grads(t), params, state)
    return params, state


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_steps_over_a_seen_structure_give_the_pure_updates_numbers(tie):
    opt = Adam(0.1)
    params = _model("", Registry(), tie)
    ref_params, ref_state = _reference(opt, params, 4)
    state = opt.init(params)
    for t in range(4):
        params, state = opt.apply_gradients(_grads(t), params, state)
    assert state._flat is not None  # the last three steps took the cached path
    for k in params:
        np.testing.assert_array_equal(params[k].value, ref_params[k].value, err_msg=k)
        assert params[k].resource_id == ref_params[k].resource_id
    for name in ("m", "v"):
        for k in ("w", "b"):
            np.testing.assert_array_equal(state.get_slot(params[k], name).value,
                                          ref_state.get_slot(ref_params[k], name).value)
    for name in ("beta1_power", "beta2_power"):
        np.testing.assert_array_equal(state.non_slot(name).value, ref_state.non_slot(name).value)


def test_a_returned_state_reads_and_flattens_as_one_made_by_init():
    opt = Adam(0.1)
    params = _model("", Registry())
    ref, _ = _reference(opt, _model("r/", Registry()), 3)
    params, state = opt.apply_gradients(_grads(0), params, opt.init(params))
    params, state = opt.apply_gradients(_grads(1), params, state)
    assert state._parts is None  # nothing read yet: the slot Variables are not made
    made = OptimizerState(state.slots, state.non_slots)
    assert state.slots is state.slots and state.slots["m"]["w"] is state.get_slot(params["w"], "m")
    assert jax.tree.structure(state) == jax.tree.structure(made)
    assert all(x is y for x, y in zip(jax.tree.leaves(state), jax.tree.leaves(made), strict=True))
    slot = state.get_slot(params["b"], "v")
    assert slot.name == "b/v" and slot.handle.slot_of == params["b"].resource_id and not slot.trainable
    assert state.slots["m"]["frozen"] is None and state.get_slot_names() == ["m", "v"]
    assert repr(state) == "OptimizerState(slots={'m': 3, 'v': 3}, non_slots=['beta1_power', 'beta2_power'], " \
                          "fused=False)"
    # A state of this layout made otherwise (its Variables compared, not its flat values taken) steps the same.
    params, _ = opt.apply_gradients(_grads(2), params, made)
    for k in params:
        np.testing.assert_array_equal(params[k].value, ref[k].value, err_msg=k)


def test_two_models_of_one_layout_taking_turns_each_keep_their_identities_and_numbers():
    opt = Adam(0.1)
    a, b = _model("a/", Registry()), _model("b/", Registry())
    ref, _ = _reference(opt, _model("r/", Registry()), 3)
    sa, sb = opt.init(a), opt.init(b)
    for t in range(3):
        a, sa = opt.apply_gradients(_grads(t), a, sa)
        b, sb = opt.apply_gradients(_grads(t), b, sb)
    for params, state, prefix in ((a, sa, "a/"), (b, sb, "b/")):
        assert params["w"].name == f"{prefix}w" and state.get_slot(params["w"], "m").name == f"{prefix}w/m"
        np.testing.assert_array_equal(params["w"].value, ref["w"].value)


class _Pair(NamedTuple):
    first: Variable
    second: Variable


def test_containers_the_cache_cannot_stand_for_still_step_right(compiles):
    # An OrderedDict is a node of jax's default registry only (registered in Python): such a structure takes the
    # default flatten on every call. A named tuple is a container of both registries.
    opt = Adam(0.1)
    for make in (lambda w, b: collections.OrderedDict(w=w, b=b), lambda w, b: _Pair(w, b)):
        registry = Registry()
        params = make(Variable(jnp.ones(2), name="w", registry=registry),
                      Variable(jnp.zeros(3), name="b", registry=registry))
        grads = make(jnp.ones(2), jnp.ones(3))
        params, state = opt.apply_gradients(grads, params, opt.init(params))
        compiled = compiles("_flat_step")
        for _ in range(2):
            params, state = opt.apply_gradients(grads, params, state)
        assert compiles("_flat_step") == compiled  # neither traced nor compiled again
        w, b = jax.tree.leaves(params, is_leaf=lambda x: isinstance(x, Variable))
        assert type(params) is type(grads) and (w.name, b.name) == ("w", "b")
        # TF's Adam with a constant gradient moves a param by lr (within eps) a step: 3 steps of 0.1.
        np.testing.assert_allclose(w.value, np.full(2, 0.7), rtol=1e-5)
        np.testing.assert_allclose(b.value, np.full(3, -0.3), rtol=1e-5)
        assert state.get_slot(b, "m").name == "b/m"


def test_a_global_step_on_the_cached_path_counts_every_step():
    opt = Adam(0.1)
    params = _model("", Registry())
    gs = varstate.get_or_create_global_step(Registry())
    state = opt.init(params)
    for _ in range(3):
        params, state, gs = opt.apply_gradients(_grads(0), params, state, global_step=gs)
    assert int(gs.value) == 3 and gs.name == "global_step"


def _donated(what):
    return rf"^{re.escape(what)}: this version's buffer was donated to a jitted step and deleted"


def test_spent_versions_given_again_raise_naming_them_on_a_seen_structure():
    opt = Adam(0.1)
    params = _model("", Registry())
    params, state = opt.apply_gradients(_grads(0), params, opt.init(params))
    new, new_state = opt.apply_gradients(_grads(1), params, state)  # the structure is seen: the cached path
    assert new_state._flat is not None and state._flat is not None
    with pytest.raises(DonatedVariableError, match=_donated("Variable 'b' (params['b'])")):
        opt.apply_gradients(_grads(2), params, new_state)
    with pytest.raises(DonatedVariableError, match=_donated("Variable 'b/m' (state.slots['m']['b'])")):
        opt.apply_gradients(_grads(2), new, state)  # a spent state that was never read
    newer, _ = opt.apply_gradients(_grads(2), new, new_state)  # the versions returned still step
    assert newer["w"].value.shape == (3, 2)


def test_params_that_became_arrays_are_refused_on_a_seen_structure():
    opt = Adam(0.1)
    registry = Registry()
    params = {"w": Variable(jnp.ones(3), name="pba/w", registry=registry)}
    state = opt.init(params)
    for _ in range(2):
        params, state = opt.apply_gradients({"w": jnp.ones(3)}, params, state)
    want = re.escape(
        "apply_gradients: params['w'] is a plain array (float32[3]), but the state holds the slot 'm' 'pba/w/m' of "
        "a Variable there: expected that Variable, found an array, so the step and the checkpoint would go on "
        "without its slots. Change a Variable's value and keep the Variable: `v.assign(v * 2)`, or "
        "`varstate.with_values(params, new_arrays)` for a tree.")
    with pytest.raises(ValueError, match=f"^{want}$"):
        opt.apply_gradients({"w": jnp.ones(3)}, {"w": params["w"] * 2}, state)
    params, state = opt.apply_gradients({"w": jnp.ones(3)}, params, state)  # the Variables still step
    assert state.get_slot(params["w"], "m").name == "pba/w/m"


def test_a_state_of_other_variables_is_refused_on_a_seen_structure():
    opt = Adam(0.1)
    old = _model("old/", Registry())
    old, state = opt.apply_gradients(_grads(0), old, opt.init(old))
    old, state = opt.apply_gradients(_grads(1), old, state)  # seen, and its state returned flat
    new = _model("new/", Registry())  # the same layout, other Variables
    with pytest.raises(ValueError, match=r"^The optimizer state holds slots of other Variables: 'new/b' "
                                         r"\(params\['b'\]\) has no slot 'm' in it, while state\.slots\['m'\]\['b'\] "
                                         r"is 'old/b/m', the slot of the Variable 'old/b', which is not among the "
                                         r"params\."):
        opt.apply_gradients(_grads(2), new, state)
    one_new = {**old, "b": Variable(jnp.ones(2), name="other/b")}  # a single param swapped for another Variable
    with pytest.raises(ValueError, match=r"'other/b' \(params\['b'\]\) has no slot 'm' in it, while "
                                         r"state\.slots\['m'\]\['b'\] is 'old/b/m'"):
        opt.apply_gradients(_grads(2), one_new, state)
    grown = {**old, "head": Variable(jnp.zeros(4), name="old/head")}  # a grown model: only its new param lacks slots
    grown, state = opt.apply_gradients({**_grads(2), "head": jnp.ones(4)}, grown, state)
    np.testing.assert_array_equal(state.get_slot(grown["head"], "m").value, np.full(4, 1 - np.float32(0.9)))


@pytest.mark.parametrize("fused", [False, True], ids=["unfused", "fused"])
def test_copies_of_a_stepped_state(fused):
    # copy.copy is the state itself (it is immutable); a deep copy holds copied values under the same identities,
    # so it steps like the original and leaves the original's buffers alive (a step donates the copy's).
    params = {"w": varstate.Variable(jnp.ones(2), name="w"), "b": varstate.Variable(jnp.ones(3), name="b")}
    opt = Adam(0.1)
    grads = {"w": jnp.full(2, 0.5), "b": jnp.full(3, -1.0)}
    params, state = opt.apply_gradients(grads, params, opt.init(params, fused=fused))
    assert copy.copy(state) is state
    twin = copy.deepcopy(state)
    assert twin.fused == fused and twin.get_slot_names() == state.get_slot_names()
    for name in ("m", "v"):
        for key in params:
            a, b = twin.get_slot(params[key], name), state.get_slot(params[key], name)
            assert a.resource_id == b.resource_id and a.name == b.name
            np.testing.assert_array_equal(np.asarray(a.value), np.asarray(b.value))
    m = np.asarray(state.get_slot(params["w"], "m").value)
    from_twin, _ = opt.apply_gradients(grads, copy.deepcopy(params), twin)
    # The original is still alive: the twin's buffers were the ones donated.
    np.testing.assert_array_equal(np.asarray(state.get_slot(params["w"], "m").value), m)
    from_state, _ = opt.apply_gradients(grads, params, state)
    np.testing.assert_array_equal(np.asarray(from_twin["b"].value), np.asarray(from_state["b"].value))


def test_mixed_precision_params_take_the_seen_structures_path_and_step_as_the_pure_update():
    # AutoCastVariable is a node of the step's container registry too: before, a layout holding one could not be
    # recognised, and every step went the full way (1,000 params of 16x4: 9 -> 3 ms of host time a step, profiled).
    opt = Adam(0.1)
    runs = []
    for how in ("apply_gradients", "update"):
        params = mixed_precision.autocast_variables(_model(f"{how}/", Registry()))
        state = opt.init(params)
        assert LeafLayout.of(params) is not None and LeafLayout.of(state._made()) is not None
        step = opt.apply_gradients if how == "apply_gradients" else jax.jit(opt.update)
        for t in range(3):
            grads = jax.tree.map(lambda x, t=t: jnp.full(x.shape, 0.5 + t), params)
            params, state = step(grads, params, state)
        assert type(params["w"]) is varstate.AutoCastVariable and params["w"].name == f"{how}/w"
        assert state.get_slot(params["w"], "m").name == f"{how}/w/m"
        runs.append([np.asarray(x) for x in jax.tree.leaves((params, state))])
    for a, b in zip(*runs, strict=True):
        np.testing.assert_array_equal(a, b)
