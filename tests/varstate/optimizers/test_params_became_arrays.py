"""A param that became a plain array (`v * 2` instead of `v.assign(v * 2)`) is refused where its slots would be lost."""

import re

import jax
import jax.numpy as jnp
import pytest

import varstate
from varstate.optimizers import Adam


def _message(where: str) -> str:
    return re.escape(
        f"{where}: params['w'] is a plain array (float32[3]), but the state holds the slot 'm' 'pba/w/m' of a "
        "Variable there: expected that Variable, found an array, so the step and the checkpoint would go on without "
        "its slots. Change a Variable's value and keep the Variable: `v.assign(v * 2)`, or "
        "`varstate.with_values(params, new_arrays)` for a tree.")


@pytest.fixture
def setup():
    registry = varstate.Registry()
    params = {"w": varstate.Variable(jnp.ones(3), name="pba/w", registry=registry)}
    opt = Adam(0.1)
    state = opt.init(params)
    params, state = opt.apply_gradients({"w": jnp.ones(3)}, params, state)
    return opt, params, state


@pytest.mark.parametrize("fused", [False, True])
def test_apply_gradients_refuses_params_that_became_arrays(setup, fused):
    opt, params, state = setup
    if fused:
        state = opt.init(params, state, fused=True)
    arrays = {k: v * 2 for k, v in params.items()}
    with pytest.raises(ValueError, match=_message("apply_gradients") + "$"):  # before the trace: no JAX frames
        opt.apply_gradients({"w": jnp.ones(3)}, arrays, state)


def test_init_and_update_refuse_params_that_became_arrays(setup):
    opt, params, state = setup
    arrays = {k: v * 2 for k, v in params.items()}
    with pytest.raises(ValueError, match=_message("Optimizer.init")):
        opt.init(arrays, state)
    with pytest.raises(ValueError, match=_message("apply_gradients")):
        jax.jit(opt.update)({"w": jnp.ones(3)}, arrays, state)


def test_the_fixes_keep_the_slots(setup):
    opt, params, state = setup
    m = state.get_slot(params["w"], "m").value
    kept = varstate.with_values(params, {k: v * 2 for k, v in params.items()})
    assert opt.init(kept, state).get_slot(kept["w"], "m").value.tolist() == m.tolist()
    params["w"].assign(params["w"] * 2)
    _, after = opt.apply_gradients({"w": jnp.ones(3)}, params, state)
    assert after.get_slot(params["w"], "m").value.tolist() != [0.0] * 3


def test_plain_arrays_that_never_had_slots_still_step():
    opt = Adam(0.1)
    params = {"w": jnp.ones(3)}
    state = opt.init(params)
    params, state = opt.apply_gradients({"w": jnp.ones(3)}, params, state)
    params, state = opt.apply_gradients({"w": jnp.ones(3)}, {k: v * 2 for k, v in params.items()}, state)
    assert jnp.all(params["w"] < 2)
