"""Traced hyperparameters (`varstate.optimizers.traced`): the static path's numbers, one compile, vmap, errors."""

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import checkpoint
import varstate
from varstate import IndexedSlices, Variable
from varstate.optimizers import Adagrad, Adam, GradientDescent, Momentum, keras, traced
from varstate.optimizers._core._slots import StateMismatchError
from varstate.optimizers._core._traced import Live

sys.path.insert(0, os.path.dirname(__file__))
from optimizer_cases import CASES, all_traced

TRACEABLE = sorted(n for n, make in CASES.items() if all_traced(make()) is not None)


def _model():
    return {"w": Variable(jnp.array([[0.5, -1.0], [2.0, 0.25]]), name="w"),
            "emb": Variable(jnp.array([[1.0, 2.0], [-3.0, 0.5], [0.75, -0.25]]), name="emb")}


def _grads(step):
    g = jnp.array([[0.3, -0.7], [1.1, 0.05]]) * (step + 1)
    return {"w": g, "emb": IndexedSlices(jnp.array([[0.5, -1.5], [2.0, 0.1]]) / (step + 1), jnp.array([2, 0]),
                                         (3, 2))}


def _run(opt, steps=3, jit=True):
    params = _model()
    state = opt.init(params)
    for step in range(steps):
        if jit:
            params, state = opt.apply_gradients(_grads(step), params, state)
        else:
            params, state = opt.update(_grads(step), params, state)
    leaves = [np.asarray(x) for x in jax.tree.leaves((params, state.slots, state.non_slots))]
    return leaves, state


def test_a_traced_hyperparameter_is_no_part_of_the_config_key():
    assert Adam(traced(0.01)) == Adam(traced(0.02)) and hash(Adam(traced(0.01))) == hash(Adam(traced(0.02)))
    assert Adam(traced(0.01)) != Adam(0.01) and Adam(traced(0.01)) != Adam(traced(0.01), beta1=traced(0.9))
    assert repr(traced(0.5)) == "traced(0.5)" and traced(traced(0.5)).value == 0.5 and traced(np.float32(2)).value == 2
    state = Adam(traced(0.01), beta2=traced(0.99)).init([jnp.zeros(2)])
    assert repr(state).endswith("traced=['beta2', 'learning_rate'])")
    assert {k: float(v) for k, v in state.hyperparameters.items()} == {
        "learning_rate": float(np.float32(0.01)), "beta2": float(np.float32(0.99))}


@pytest.mark.parametrize("name", TRACEABLE)
def test_every_traced_hyperparameter_gives_the_static_numbers_op_by_op(name):
    # Op by op (each jnp op rounds on its own) the traced step is the static one's arithmetic, bit for bit: a
    # float hyperparameter is rounded to float32 either way, and Keras's host constants (1 - beta_1) are kept
    # from the double in the state.
    static, twin = CASES[name](), all_traced(CASES[name]())
    with jax.disable_jit():
        want, _ = _run(static, jit=False)
        got, state = _run(twin, jit=False)
    assert state.hyperparameters  # every traceable float of the case is in the state
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(g, w)


@pytest.mark.parametrize("name", TRACEABLE)
def test_jitted_traced_steps_equal_the_static_ones_within_an_ulp_of_the_largest_element(name):
    # Jitted, XLA may fold a static constant into its neighbours (a division by a constant becomes a
    # multiplication, a*b+c one rounding) where a traced value stays an operand: the two programs round
    # differently, by at most 2 ulps of the array's largest element over three steps here.
    want, _ = _run(CASES[name]())
    got, _ = _run(all_traced(CASES[name]()))
    for g, w in zip(got, want, strict=True):
        if w.dtype.kind == "f" and w.size:
            assert np.abs(g.astype(np.float64) - w).max() <= 2 * np.spacing(np.abs(w).max().astype(w.dtype)), name
        else:
            np.testing.assert_array_equal(g, w)


# The compile-counting tests use shapes no other test steps: jit's cache is per process (an xdist worker).
def test_runs_that_differ_only_in_traced_values_share_one_compiled_step(compiles):
    results = []
    for lr in (0.1, 0.01, 0.5):
        opt = Adam(traced(lr), beta1=traced(0.8))
        params = [Variable(jnp.ones((3, 7, 2)), name="w")]
        params, state = opt.apply_gradients([jnp.ones((3, 7, 2))], params, opt.init(params))
        params, state = opt.apply_gradients([jnp.ones((3, 7, 2))], params, state)
        results.append(params[0].value)
    assert compiles("_flat_step") == 1
    solo = Adam(0.5, beta1=0.8)
    params = [Variable(jnp.ones((3, 7, 2)), name="w")]
    params, state = solo.apply_gradients([jnp.ones((3, 7, 2))], params, solo.init(params))
    params, _ = solo.apply_gradients([jnp.ones((3, 7, 2))], params, state)
    assert compiles("_flat_step") == 2
    np.testing.assert_array_max_ulp(np.asarray(results[2]), np.asarray(params[0].value), maxulp=2)


def test_kerass_learning_rate_is_the_states_value_and_no_part_of_the_compile_key(compiles):
    for lr in (0.1, 0.2):
        opt = keras.Adam(lr)
        params = [Variable(jnp.ones((2, 9, 2)), name="k")]
        state = opt.init(params)
        assert float(state.hyperparameters["learning_rate"]) == float(np.float32(lr))
        params, state = opt.apply_gradients([jnp.ones((2, 9, 2))], params, state)
        state = state.with_hyperparameters(learning_rate=0.3)
        params, state = opt.apply_gradients([jnp.ones((2, 9, 2))], params, state)
        assert float(state.non_slot("learning_rate").value) == float(np.float32(0.3))
    assert compiles("_flat_step") == 1


def test_a_schedule_still_gets_the_step_as_a_traced_value(compiles):
    opt = keras.Adam(lambda it: 0.1 / (1.0 + it.astype(jnp.float32)), beta_1=traced(0.8))
    params = [Variable(jnp.ones((2, 9, 2)), name="k")]
    state = opt.init(params)
    assert "learning_rate" not in state.hyperparameters  # a schedule keeps no variable, as in Keras
    for _ in range(4):
        params, state = opt.apply_gradients([jnp.ones((2, 9, 2))], params, state)
    assert compiles("_flat_step") == 1
    with jax.disable_jit():
        solo = keras.Adam(lambda it: 0.1 / (1.0 + it.astype(jnp.float32)), beta_1=0.8)
        p = [Variable(jnp.ones((2, 9, 2)), name="k")]
        s = solo.init(p)
        for _ in range(4):
            p, s = solo.update([jnp.ones((2, 9, 2))], p, s)
    np.testing.assert_array_max_ulp(np.asarray(params[0].value), np.asarray(p[0].value), maxulp=2)


LRS = np.array([0.001, 0.003, 0.01, 0.03, 0.1, 0.2, 0.3, 0.5])


def test_vmap_over_learning_rates_then_over_the_stacked_runs_matches_each_run_alone(compiles):
    # Each vmapped run is a different XLA program from the run alone (one vectorised over the batch): they agree
    # within 2 ulps of each array's largest element over three steps.
    opt = Adam(traced(0.01))
    params = {"w": jnp.array([[0.5, -1.0], [2.0, 0.25]])}
    state = opt.init(params)

    def first(lr, grads, params, state):
        return opt.update(grads, params, state.with_hyperparameters(learning_rate=lr))

    first_b = jax.jit(jax.vmap(first, in_axes=(0, None, None, None)))
    params_b, state_b = first_b(LRS, {"w": _grads(0)["w"]}, params, state)
    assert state_b.non_slot("beta1_power").value.shape == (8,)  # every leaf has the run axis now
    assert state_b.hyperparameters["learning_rate"].shape == (8,)
    step = jax.jit(jax.vmap(opt.update, in_axes=(None, 0, 0)))
    for i in (1, 2):
        params_b, state_b = step({"w": _grads(i)["w"]}, params_b, state_b)
    assert compiles("first") == 1 and compiles("update") == 1
    for run, lr in enumerate(LRS):
        solo = Adam(float(lr))
        p, s = {"w": params["w"]}, solo.init(params)
        for i in range(3):
            p, s = jax.jit(solo.update)({"w": _grads(i)["w"]}, p, s)
        for got, want in ((params_b["w"][run], p["w"]), (state_b.slots["m"]["w"][run], s.slots["m"]["w"])):
            scale = np.spacing(np.abs(np.asarray(want)).max())
            assert np.abs(np.asarray(got, np.float64) - np.asarray(want)).max() <= 2 * scale, (run, lr)


def test_a_stacked_state_steps_under_vmap_and_unstacks_into_a_checkpointable_run(tmp_path):
    # Stacking: every leaf broadcast to a run axis (jax.tree.map keeps each Variable's identity); one run is
    # `jax.tree.map(lambda x: x[i], ...)`, a state like any other, saved and restored with TF's keys.
    opt = keras.Adam(0.01, beta_1=traced(0.9))
    params = [Variable(jnp.array([1.0, -2.0, 0.5]), name="k")]
    state = opt.init(params)
    n = 4
    stack = jax.tree.map(lambda x: jnp.broadcast_to(x, (n, *jnp.shape(x))), (params, state))
    params_b, state_b = stack[0], stack[1].with_hyperparameters(learning_rate=LRS[:n], beta_1=[0.9, 0.8, 0.7, 0.6])
    step = jax.jit(jax.vmap(opt.update))
    for i in range(3):
        params_b, state_b = step([jnp.broadcast_to(jnp.array([0.3, -1.0, 2.0]) * (i + 1), (n, 3))], params_b, state_b)
    assert state_b.non_slot("iteration").value.tolist() == [3] * n
    run = 3
    params_r, state_r = jax.tree.map(lambda x: x[run], (params_b, state_b))
    solo = keras.Adam(float(LRS[run]), beta_1=0.6)
    p = [Variable(jnp.array([1.0, -2.0, 0.5]), name="k")]
    s = solo.init(p)
    for i in range(3):
        p, s = jax.jit(solo.update)([jnp.array([0.3, -1.0, 2.0]) * (i + 1)], p, s)
    scale = np.spacing(np.abs(np.asarray(p[0].value)).max())
    assert np.abs(np.asarray(params_r[0].value, np.float64) - np.asarray(p[0].value)).max() <= 2 * scale
    # The unstacked run checkpoints as any state; its traced beta_1 is config, not checkpointed (see below).
    path = checkpoint.Checkpoint(model=params_r, optimizer=state_r).write(str(tmp_path / "run3"))
    fresh = [Variable(jnp.zeros(3), name="k")]
    restored = checkpoint.Checkpoint(model=fresh, optimizer=opt.init(fresh)).restore(path)
    restored.assert_consumed()
    np.testing.assert_array_equal(restored.model[0].value, params_r[0].value)
    np.testing.assert_array_equal(restored.optimizer.slots["momentum"][0].value, state_r.slots["momentum"][0].value)
    # Keras's learning_rate is a non-slot: restored, and it wins, as in Keras.
    assert float(restored.optimizer.hyperparameters["learning_rate"]) == float(np.float32(LRS[run]))
    assert float(restored.optimizer.hyperparameters["beta_1"]) == float(np.float32(0.9))


def test_tf_v1_checkpoints_hold_no_hyperparameters_so_a_restore_keeps_the_templates(tmp_path):
    opt = Adam(traced(0.01))
    params = [Variable(jnp.ones(2), name="w")]
    state = opt.with_hyperparameters(opt.init(params), learning_rate=0.5)
    params, state = opt.apply_gradients([jnp.ones(2)], params, state)
    path = checkpoint.Checkpoint(model=params, optimizer=state).write(str(tmp_path / "ckpt"), format="tf")
    keys = {k for k in checkpoint.read_checkpoint(path).keys() if "optimizer" in k.split("/.ATTRIBUTES")[0]}
    assert keys == {"optimizer/beta1_power/.ATTRIBUTES/VARIABLE_VALUE",
                    "optimizer/beta2_power/.ATTRIBUTES/VARIABLE_VALUE",
                    "model/0/.OPTIMIZER_SLOT/optimizer/m/.ATTRIBUTES/VARIABLE_VALUE",
                    "model/0/.OPTIMIZER_SLOT/optimizer/v/.ATTRIBUTES/VARIABLE_VALUE"}  # TF's, nothing else
    fresh = [Variable(jnp.zeros(2), name="w")]
    restored = checkpoint.Checkpoint(model=fresh, optimizer=opt.init(fresh)).restore(path)
    restored.assert_consumed()
    assert float(restored.optimizer.hyperparameters["learning_rate"]) == float(np.float32(0.01))  # the template's
    np.testing.assert_array_equal(restored.optimizer.slots["m"][0].value, state.slots["m"][0].value)


def test_a_state_without_a_traced_value_gets_it_from_init_or_apply_gradients():
    params = [Variable(jnp.ones(2), name="w")]
    static_state = Adam(0.1).init(params)
    opt = Adam(traced(0.1))
    with pytest.raises(StateMismatchError, match=r"Adam.update: the state holds no value of the traced "
                                                 r"hyperparameter 'learning_rate' \(it holds \[\]\)"):
        jax.jit(opt.update)([jnp.ones(2)], params, static_state)
    assert float(opt.init(params, static_state).hyperparameters["learning_rate"]) == float(np.float32(0.1))
    params, state = opt.apply_gradients([jnp.ones(2)], params, static_state)
    assert sorted(state.hyperparameters) == ["learning_rate"]
    added = opt.with_hyperparameters(Adam(0.1).init(params), learning_rate=0.25)
    assert float(added.hyperparameters["learning_rate"]) == 0.25


def test_errors_name_the_hyperparameter_and_the_fix():
    with pytest.raises(TypeError, match=r"Adam: lazy cannot be traced: only a float the step reads can "
                                        r"\(learning_rate, beta1, beta2, epsilon\); pass lazy as a plain value"):
        Adam(lazy=traced(1.0))
    with pytest.raises(TypeError, match=r"Adagrad: initial_accumulator_value cannot be traced: .*\(learning_rate\)"):
        Adagrad(0.1, initial_accumulator_value=traced(0.1))
    with pytest.raises(TypeError, match=r"traced: expected a real number, got str 'x'"):
        traced("x")
    with pytest.raises(TypeError, match=r"A schedule \(a callable of the step\) is passed as it is"):
        traced(lambda step: 0.1)
    state = Adam(traced(0.1)).init([jnp.zeros(2)])
    with pytest.raises(TypeError, match=r"OptimizerState.with_hyperparameters: the state holds no value of 'beta1' "
                                        r"\(it holds \['learning_rate'\]\). Declare the hyperparameter traced"):
        state.with_hyperparameters(beta1=0.5)
    with pytest.raises(TypeError, match=r"with_hyperparameters\(learning_rate=...\): expected a real number or an "
                                        r"array of them, got str 'fast'"):
        state.with_hyperparameters(learning_rate="fast")
    with pytest.raises(TypeError, match=r"Adam.with_hyperparameters: beta1 is static in this Adam .* "
                                        r"Adam\(beta1=varstate.optimizers.traced\(0.9\)\)"):
        Adam(traced(0.1)).with_hyperparameters(state, beta1=0.5)
    with pytest.raises(TypeError, match=r"Adam.with_hyperparameters: Adam has no hyperparameter 'lr'; those that "
                                        r"can be traced are \['learning_rate', 'beta1', 'beta2', 'epsilon'\]"):
        Adam(traced(0.1)).with_hyperparameters(state, lr=0.5)
    with pytest.raises(TypeError, match=r"to_optax\(Momentum\): \['momentum'\] are traced, .*inject_hyperparams"):
        Momentum(0.1, momentum=traced(0.9)).to_optax()


def test_inside_a_step_a_traced_value_refuses_what_float32_cannot_reproduce():
    live = Live(jnp.float32(0.9), jnp.float32(1 - 0.9))
    assert float(1 - live) == float(np.float32(1 - 0.9)) != float(1 - jnp.float32(0.9))  # the double's rounding
    assert float(live - 1) == -float(np.float32(1 - 0.9)) and float(2 * live) == float(np.float32(1.8))
    with pytest.raises(TypeError, match=r"host arithmetic \(- 0.5\) that float32 cannot reproduce"):
        _ = 0.5 - live
    with pytest.raises(TypeError, match=r"cannot be compared inside a step"):
        _ = live > 0
    with pytest.raises(TypeError, match=r"has no truth value inside a step"):
        bool(live)


def test_traced_momentum_keeps_kerass_momentum_slot_and_traced_l1_chooses_tfs_kernel_per_value():
    # A traced value may change, so the code path that serves every value is taken: Keras's momentum slot
    # exists even at 0, and TF's `l1 > 0` choice of kernel is made per value inside the step.
    assert keras.SGD(0.1, momentum=traced(0.0)).init([jnp.zeros(2)]).get_slot_names() == ["momentum"]
    from varstate.optimizers import ProximalGradientDescent

    for l1 in (0.0, 0.05):
        want, _ = _run(ProximalGradientDescent(0.1, l1_regularization_strength=l1), jit=False)
        opt = ProximalGradientDescent(0.1, l1_regularization_strength=traced(0.3))
        params = _model()
        state = opt.with_hyperparameters(opt.init(params), l1_regularization_strength=l1)
        with jax.disable_jit():
            for step in range(3):
                params, state = opt.update(_grads(step), params, state)
        for g, w in zip([np.asarray(x) for x in jax.tree.leaves(params)], want, strict=True):
            np.testing.assert_array_equal(g, w)


def test_gradient_descent_sweep_in_one_vmapped_program_equals_the_closed_form():
    opt = GradientDescent(traced(0.1))
    w = jnp.array([1.0, -2.0])
    new, _ = jax.vmap(lambda lr: opt.update([jnp.ones(2)], [w], opt.init([w]).with_hyperparameters(
        learning_rate=lr)))(jnp.asarray(LRS, jnp.float32))
    np.testing.assert_array_equal(new[0], np.asarray(w) - np.float32(LRS)[:, None] * np.float32(1.0))
    assert varstate  # the public namespace exposes the same function
    assert varstate.optimizers.traced is traced


def test_a_fused_state_carries_its_traced_values_through_the_step():
    opt = Momentum(traced(0.1), momentum=traced(0.9))
    results = []
    for fused in (False, True):
        params = {"a": Variable(jnp.ones((2, 3)), name="a"), "b": Variable(jnp.full(4, 2.0), name="b")}
        state = opt.with_hyperparameters(opt.init(params, fused=fused), learning_rate=0.25, momentum=0.5)
        assert state.fused == fused
        for _ in range(2):
            params, state = opt.apply_gradients({"a": jnp.ones((2, 3)), "b": jnp.ones(4)}, params, state)
        assert {k: float(v) for k, v in state.hyperparameters.items()} == {"learning_rate": 0.25, "momentum": 0.5}
        results.append(jax.tree.leaves(params))
    for unfused, fused in zip(*results, strict=True):  # the closed form: 1 - 0.25 * (1 + 1.5)
        np.testing.assert_array_max_ulp(np.asarray(fused), np.asarray(unfused), maxulp=1)
    np.testing.assert_allclose(np.asarray(results[0][0]), 1 - 0.25 * 2.5)


def test_setting_tf_adams_betas_on_a_fresh_state_restarts_the_powers_as_a_run_made_with_them():
    # TF's Adam starts beta1_power at beta1: a state that has not stepped takes the new beta as its power too,
    # so the run is the static one made with it, bit for bit, alone and per run of a vmapped sweep.
    p, g = {"w": jnp.array([1.0, -2.0])}, {"w": jnp.array([0.5, 3.0])}
    opt = Adam(traced(0.1), beta1=traced(0.9), beta2=traced(0.999))
    for b1, b2 in [(0.5, 0.99), (0.8, 0.95)]:
        static = Adam(0.1, beta1=b1, beta2=b2)
        want_p, want_s = static.update(g, p, static.init(p))
        want_p, want_s = static.update(g, want_p, want_s)
        for state in (opt.init(p).with_hyperparameters(beta1=b1, beta2=b2),
                      opt.with_hyperparameters(opt.init(p), beta1=b1, beta2=b2)):
            assert float(state.non_slot("beta1_power").value) == np.float32(b1)
            got_p, got_s = opt.update(g, p, state)
            got_p, got_s = opt.update(g, got_p, got_s)
            np.testing.assert_array_equal(got_p["w"], want_p["w"])
            for name in ("beta1_power", "beta2_power"):
                np.testing.assert_array_equal(got_s.non_slot(name).value, want_s.non_slot(name).value)
    betas = jnp.array([0.5, 0.9])
    runs = jax.tree.map(lambda a: jnp.broadcast_to(a, (2, *jnp.shape(a))), (p, opt.init(p)))
    stacked = runs[1].with_hyperparameters(beta1=betas)
    np.testing.assert_array_equal(stacked.non_slot("beta1_power").value, np.float32([0.5, 0.9]))
    out = jax.vmap(lambda p_, s_: opt.update(g, p_, s_))(runs[0], stacked)[0]["w"]
    for i, b1 in enumerate([0.5, 0.9]):
        static = Adam(0.1, beta1=b1, beta2=0.999)
        np.testing.assert_allclose(out[i], static.update(g, p, static.init(p))[0]["w"], rtol=3e-7)
    # After a step the power is the product of the betas used, as in TF when a fed beta changes.
    _, stepped = opt.update(g, p, opt.init(p))
    moved = stepped.with_hyperparameters(beta1=0.5)
    assert moved.non_slot("beta1_power").value == stepped.non_slot("beta1_power").value == np.float32(0.9) ** 2


def test_a_value_set_has_the_shape_it_replaces_and_passes_the_constructors_checks():
    from varstate.optimizers import Ftrl, LossScaleOptimizer

    opt = Adam(traced(0.01))
    state = opt.init([jnp.zeros(2)])
    with pytest.raises(ValueError, match=r"OptimizerState.with_hyperparameters: learning_rate has shape \(2,\), but "
                                         r"the state holds it with shape \(\) \(one value\). Give a scalar; to run "
                                         r"several values at once, stack the state"):
        state.with_hyperparameters(learning_rate=jnp.array([0.1, 0.2]))
    stacked = jax.tree.map(lambda a: jnp.broadcast_to(a, (3, *jnp.shape(a))), state)
    np.testing.assert_array_equal(stacked.with_hyperparameters(learning_rate=0.5).hyperparameters["learning_rate"],
                                  np.float32([0.5] * 3))
    with pytest.raises(ValueError, match=r"learning_rate has shape \(2,\), but the state holds it with shape \(3,\) "
                                         r"\(one value per run of a stacked state\). Give a scalar or an array of "
                                         r"shape \(3,\)"):
        stacked.with_hyperparameters(learning_rate=jnp.array([0.1, 0.2]))
    ftrl = Ftrl(traced(0.1))
    with pytest.raises(ValueError, match=r"Ftrl: learning_rate must be positive, got traced\(-0.1\)"):
        ftrl.with_hyperparameters(ftrl.init([jnp.zeros(2)]), learning_rate=-0.1)
    scaled = LossScaleOptimizer(Adam(traced(0.1)))  # the inner optimizer's values, through the wrapper
    new = scaled.with_hyperparameters(scaled.init([jnp.zeros(2)]), learning_rate=0.5)
    assert float(new.hyperparameters["learning_rate"]) == 0.5
    with pytest.raises(TypeError, match=r"the state holds no value of 'momentum' \(it holds \['learning_rate'\]\). "
                                        r"Declare the hyperparameter traced when making the optimizer "
                                        r"\(momentum=varstate.optimizers.traced\(value\)"):
        state.with_hyperparameters(momentum=0.5)
