"""LossScaleOptimizer: Keras's dynamic loss scale (fixture traces), skipped steps, scaling, errors."""

import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import checkpoint
import varstate
from varstate.mixed_precision import LossScaleOptimizer
from varstate.optimizers import Adam, GradientDescent, Momentum

DATA = pathlib.Path(__file__).resolve().parent.parent.parent / "data"  # tests/data
LS = json.loads((DATA / "tf_custom_gradient.json").read_text())["loss_scale"]


def test_defaults_and_variable_names_as_keras():
    opt = LossScaleOptimizer(GradientDescent(0.1))
    assert opt.initial_scale == LS["defaults"]["initial_scale"]
    assert opt.growth_interval == LS["defaults"]["growth_steps"]
    state = opt.init([varstate.Variable(jnp.ones(2), name="ls_defaults")])
    assert sorted(state.non_slots) == sorted(LS["names"])
    assert state.non_slot("current_loss_scale").value.dtype == jnp.float32
    assert state.non_slot("current_loss_scale").value.item() == 2.0**15
    assert state.non_slot("good_steps").value.item() == 0


@pytest.mark.parametrize("case", ["basic", "floor_at_one", "no_growth_to_inf"])
def test_scale_trace_matches_keras(case):
    c = LS[case]
    opt = LossScaleOptimizer(GradientDescent(1.0), initial_scale=c["initial"], growth_interval=c["growth_steps"])
    w = varstate.Variable(jnp.zeros(2), name="ls_trace")
    params, state = [w], opt.init([w])
    trace = []
    for kind in c["grads"]:
        g = jnp.array([1.0, {"finite": 2.0, "inf": jnp.inf, "nan": jnp.nan}[kind]])
        before = np.asarray(params[0].value)  # a copy: apply_gradients donates params
        params, state = opt.apply_gradients([g], params, state)
        applied = not np.array_equal(params[0].value, before)
        trace.append([state.non_slot("current_loss_scale").value.item(), state.non_slot("good_steps").value.item(),
                      applied])
    assert trace == c["trace"]


def test_skipped_step_leaves_params_and_inner_state_unchanged():
    w = varstate.Variable(jnp.array([1.0, -1.0]), name="ls_skip")
    for inner in (Adam(0.1), Momentum(0.1, momentum=0.9)):
        opt = LossScaleOptimizer(inner, initial_scale=4.0)
        params, state = opt.update([jnp.ones(2)], [w], opt.init([w]))
        skipped_params, skipped = jax.jit(opt.update)([jnp.array([jnp.nan, 1.0])], params, state)
        np.testing.assert_array_equal(skipped_params[0].value, params[0].value)
        for name in state.get_slot_names():
            np.testing.assert_array_equal(skipped.get_slot(w, name).value, state.get_slot(w, name).value)
        for name in inner.init([w]).non_slots:  # Adam's beta powers do not advance
            assert skipped.non_slot(name).value.item() == state.non_slot(name).value.item()
        assert skipped.non_slot("current_loss_scale").value.item() == 2.0


def test_finite_step_equals_the_inner_optimizer_step():
    w = varstate.Variable(jnp.array([1.0, -1.0]), name="ls_same")
    g = [jnp.array([0.3, -0.7])]
    inner = Adam(0.1)
    ref_params, ref_state = inner.update(g, [w], inner.init([w]))
    opt = LossScaleOptimizer(inner)
    params, state = opt.update(g, [w], opt.init([w]))
    np.testing.assert_array_equal(params[0].value, ref_params[0].value)
    np.testing.assert_array_equal(state.get_slot(w, "m").value, ref_state.get_slot(w, "m").value)
    assert state.non_slot("good_steps").value.item() == 1


def test_scaled_loss_and_unscaled_gradients():
    w = varstate.Variable(jnp.array([0.5, 2.0]), name="ls_scale")
    opt = LossScaleOptimizer(GradientDescent(0.1), initial_scale=1024.0)
    state = opt.init({"w": w})

    def loss(p):
        return (p["w"].value ** 2).sum()

    assert opt.get_scaled_loss(jnp.float32(3.0), state).item() == 3072.0
    assert opt.get_scaled_loss(jnp.bfloat16(3.0), state).dtype == jnp.bfloat16
    scaled = jax.grad(lambda p: opt.get_scaled_loss(loss(p), state))({"w": w})
    unscaled = opt.get_unscaled_gradients(scaled, state)
    np.testing.assert_array_equal(unscaled["w"].value, jax.grad(loss)({"w": w})["w"].value)
    sparse = varstate.IndexedSlices(jnp.full((1, 2), 2048.0), jnp.array([1]), (3, 2))
    out = opt.get_unscaled_gradients([None, sparse, jnp.float32(512.0)], state)
    assert out[0] is None and out[1].values.tolist() == [[2.0, 2.0]] and out[1].indices.tolist() == [1]
    assert out[2].item() == 0.5


def test_sparse_non_finite_gradient_is_skipped():
    emb = varstate.Variable(jnp.zeros((3, 2)), name="ls_emb")
    opt = LossScaleOptimizer(GradientDescent(1.0), initial_scale=8.0)
    state = opt.init([emb])
    bad = varstate.IndexedSlices(jnp.array([[jnp.inf, 1.0]]), jnp.array([2]), (3, 2))
    (new,), state = opt.apply_gradients([bad], [emb], state)
    assert new.value.tolist() == [[0.0, 0.0]] * 3 and state.non_slot("current_loss_scale").value.item() == 4.0


def test_fixed_scale():
    w = varstate.Variable(jnp.ones(2), name="ls_fixed")
    opt = LossScaleOptimizer(GradientDescent(0.5), dynamic=False, initial_scale=128.0)
    state = opt.init([w])
    assert state.non_slots == {}
    assert opt.get_scaled_loss(1.0, state).item() == 128.0
    (w2,), _ = opt.apply_gradients([jnp.ones(2)], [w], state)
    assert w2.value.tolist() == [0.5, 0.5]


def test_loss_scale_follows_keras_closed_form():
    # Keras: 2**15 at first; halved by a step with a non-finite gradient (not below 1); doubled after
    # growth_interval finite steps in a row. Fixed: initial_scale whatever the state.
    w = varstate.Variable(jnp.ones(2), name="ls_w")
    opt = LossScaleOptimizer(GradientDescent(0.5), growth_interval=2)
    params, state = [w], opt.init([w])
    seen = [opt.loss_scale(state).item()]  # read now: the next step donates the state's arrays
    for grad in (jnp.inf, 1.0, 1.0, 1.0, jnp.nan, 1.0, 1.0):
        params, state = opt.apply_gradients([jnp.full(2, grad)], params, state)
        seen.append(opt.loss_scale(state).item())
    assert seen == [2.0**15, 2.0**14, 2.0**14, 2.0**15, 2.0**15, 2.0**14, 2.0**14, 2.0**15]
    assert opt.loss_scale(state).dtype == jnp.float32 and opt.loss_scale(state).shape == ()
    assert jax.jit(opt.loss_scale)(state).item() == 2.0**15
    ones = LossScaleOptimizer(GradientDescent(0.5), initial_scale=1.0)
    u = varstate.Variable(jnp.ones(2), name="ls_u")
    _, one_state = ones.apply_gradients([jnp.full(2, jnp.inf)], [u], ones.init([u]))
    assert ones.loss_scale(one_state).item() == 1.0  # never below 1
    fixed = LossScaleOptimizer(GradientDescent(0.5), dynamic=False, initial_scale=3)
    assert fixed.loss_scale(fixed.init([w])).dtype == jnp.float32 and fixed.loss_scale(None).item() == 3.0


def test_constructor_errors_as_keras():
    with pytest.raises(TypeError, match=r"inner_optimizer must be a varstate.optimizers.Optimizer, got str"):
        LossScaleOptimizer("sgd")
    with pytest.raises(TypeError, match=r"dynamic must be a bool, got 'dynamic'"):
        LossScaleOptimizer(GradientDescent(0.1), "dynamic")
    with pytest.raises(TypeError, match=r"cannot wrap another LossScaleOptimizer"):
        LossScaleOptimizer(LossScaleOptimizer(GradientDescent(0.1)))
    with pytest.raises(ValueError, match=r"initial_scale must be given when dynamic=False"):
        LossScaleOptimizer(GradientDescent(0.1), dynamic=False)
    with pytest.raises(ValueError, match=r"growth_interval must be None when dynamic=False, got 10"):
        LossScaleOptimizer(GradientDescent(0.1), dynamic=False, initial_scale=2.0, growth_interval=10)
    with pytest.raises(ValueError, match=r"growth_interval must be a positive integer, got 0"):
        LossScaleOptimizer(GradientDescent(0.1), growth_interval=0)


def test_state_checkpoints_with_keras_names(tmp_path):
    reg = varstate.Registry()
    w = varstate.Variable(jnp.ones(2), name="w", registry=reg)
    opt = LossScaleOptimizer(Adam(0.1), initial_scale=64.0)
    params, state = opt.apply_gradients([jnp.array([jnp.inf, 1.0])], [w], opt.init([w]))
    params, state = opt.apply_gradients([jnp.ones(2)], params, state)
    path = checkpoint.Checkpoint(model=params, optimizer=state).write(str(tmp_path / "ckpt"), format="tf")
    reader = checkpoint.read_checkpoint(path)
    keys = set(reader.keys())
    # Keras's good_steps is int64: saved so even when JAX holds it as int32.
    assert reader.dtype("optimizer/good_steps/.ATTRIBUTES/VARIABLE_VALUE") == np.int64
    assert {"optimizer/current_loss_scale/.ATTRIBUTES/VARIABLE_VALUE",
            "optimizer/good_steps/.ATTRIBUTES/VARIABLE_VALUE",
            "model/0/.OPTIMIZER_SLOT/optimizer/m/.ATTRIBUTES/VARIABLE_VALUE"} <= keys
    fresh_w = varstate.Variable(jnp.zeros(2), name="w_fresh")
    status = checkpoint.Checkpoint(model=[fresh_w], optimizer=opt.init([fresh_w])).restore(path)
    restored = status.optimizer
    assert restored.non_slot("current_loss_scale").value.item() == 32.0
    assert restored.non_slot("good_steps").value.item() == 1
    np.testing.assert_array_equal(restored.get_slot(status.model[0], "m").value, state.get_slot(w, "m").value)


def test_float16_step_with_autocast_variables():
    params = varstate.mixed_precision.autocast_variables({"w": varstate.Variable(jnp.ones(2), name="ls_fp16")})
    opt = LossScaleOptimizer(GradientDescent(0.1))
    state = opt.init(params)

    def loss(p):
        with varstate.autocast(jnp.float16):
            y = p["w"] * jnp.array([0.5, 0.25], jnp.float16)
        return (y.astype(jnp.float32) ** 2).sum()

    scaled = jax.grad(lambda p: opt.get_scaled_loss(loss(p), state))(params)
    grads = opt.get_unscaled_gradients(scaled, state)
    assert isinstance(grads["w"], varstate.AutoCastVariable)
    np.testing.assert_array_equal(grads["w"].__varstate_variable__().value, [0.5, 0.125])  # 2 w c^2, exact
    params, state = opt.apply_gradients(grads, params, state)
    assert params["w"].__varstate_variable__().value.tolist() == [np.float32(0.95), np.float32(0.9875)]
    # an overflowing float16 backward pass (scale 2**15 * 4 > 65504) is skipped and halves the scale
    big = jax.grad(lambda p: opt.get_scaled_loss(4.0 * loss(p), state))(params)
    assert not np.isfinite(np.asarray(big["w"].__varstate_variable__().value)).all()
    params2, state2 = opt.apply_gradients(opt.get_unscaled_gradients(big, state), params, state)
    assert params2["w"].__varstate_variable__().value.tolist() == [np.float32(0.95), np.float32(0.9875)]
    assert state2.non_slot("current_loss_scale").value.item() == 2.0**14


def test_a_variable_at_two_places_steps_and_skips_without_donating_its_buffer_twice():
    # Tied weights: the skipped branch returns every place, so each place used to be read and
    # donated: XLA refused ("donate the same buffer twice"). One update with the summed gradient.
    w = varstate.Variable(jnp.ones(2), name="ls_tied")
    params = {"embed": w, "out": w}
    opt = LossScaleOptimizer(Momentum(1.0, 0.5), initial_scale=4.0)
    state = opt.init(params)
    params, state = opt.apply_gradients({"embed": jnp.ones(2), "out": jnp.full(2, 2.0)}, params, state)
    assert params["embed"].value.tolist() == params["out"].value.tolist() == [-2.0, -2.0]
    params, state = opt.apply_gradients({"embed": jnp.full(2, jnp.inf), "out": jnp.ones(2)}, params, state)
    assert params["embed"].value.tolist() == params["out"].value.tolist() == [-2.0, -2.0]
    assert state.get_slot(params["out"], "momentum").value.tolist() == [3.0, 3.0]
    assert state.non_slot("current_loss_scale").value.item() == 2.0


def test_good_steps_is_int64_with_x64_as_keras_and_the_readme_say():
    # Keras's counter is int64; JAX without x64 has no int64, so int32 there (README's stated difference).
    with jax.enable_x64(True):
        state = LossScaleOptimizer(GradientDescent(0.1)).init([varstate.Variable(jnp.ones(2), name="ls_x64")])
        assert state.non_slot("good_steps").dtype == jnp.int64
    state = LossScaleOptimizer(GradientDescent(0.1)).init([varstate.Variable(jnp.ones(2), name="ls_x32")])
    assert state.non_slot("good_steps").dtype == jnp.int32


def test_with_mesh_sharded_params_its_variables_are_replicated_and_a_restored_state_steps(tmp_path):
    # current_loss_scale/good_steps lived on device 0 (the base optimizer replicates its non-slots over
    # the first variable's mesh); restored committed there, the next step failed ("incompatible devices").
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("x",))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("x"))
    opt = LossScaleOptimizer(Adam(0.1), initial_scale=8.0)

    def fresh():
        return {"w": varstate.Variable(jax.device_put(jnp.ones(16), sharding), name="ls_mesh")}

    params = fresh()
    state = opt.init(params)
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    assert all(state.non_slot(n).sharding.is_equivalent_to(replicated, 0) for n in ("current_loss_scale", "good_steps"))
    params, state = opt.apply_gradients({"w": jnp.ones(16)}, params, state)
    path = checkpoint.Checkpoint(model=params, optimizer=state).write(str(tmp_path / "ckpt"))
    template = fresh()
    status = checkpoint.Checkpoint(model=template, optimizer=opt.init(template)).restore(path)
    params, state = opt.apply_gradients({"w": jnp.ones(16)}, status.model, status.optimizer)
    assert state.non_slot("good_steps").value.item() == 2


# --- value_and_grad: scaling and unscaling with one scale, the state's ---------------------------------------------
def _quadratic(p, x):
    return jnp.sum(p[0].value ** 2 * x)


def test_value_and_grad_gives_unscaled_loss_and_gradients_in_closed_form():
    # loss = sum(w^2 x), dloss/dw = 2 w x; the scale (2^10) and its reciprocal are powers of two: exact.
    w = varstate.Variable(jnp.array([1.5, -2.0, 0.25]), name="vg_w")
    x = jnp.array([3.0, 0.5, 8.0])
    opt = LossScaleOptimizer(GradientDescent(0.1), initial_scale=1024.0)
    state = opt.init([w])
    for f in (opt.value_and_grad(_quadratic), jax.jit(opt.value_and_grad(_quadratic))):
        loss, grads, finite = f(state, [w], x)
        assert loss.item() == float(np.sum(np.array([1.5, -2.0, 0.25]) ** 2 * np.array([3.0, 0.5, 8.0])))
        assert isinstance(grads[0], varstate.Variable) and grads[0].resource_id == w.resource_id
        assert grads[0].value.tolist() == [9.0, -2.0, 4.0] and finite.dtype == jnp.bool_ and bool(finite)


def test_value_and_grad_argnums_has_aux_and_kwargs():
    opt = LossScaleOptimizer(GradientDescent(0.1), initial_scale=8.0)
    state = opt.init([varstate.Variable(jnp.zeros(1), name="vg_aux")])

    def loss_fn(a, b, *, c):
        return jnp.sum(a * b * c), {"c": c}

    (loss, aux), (ga, gb), finite = opt.value_and_grad(loss_fn, argnums=(0, 1), has_aux=True)(
        state, jnp.array([2.0]), jnp.array([5.0]), c=3.0)
    assert loss.item() == 30.0 and aux == {"c": 3.0} and ga.tolist() == [15.0] and gb.tolist() == [6.0]
    assert bool(finite)


def test_value_and_grad_overflow_then_the_halved_scale():
    # d/dw sum(w * c) = c; scaled by 2^15, c = 1.5e34 overflows float32 (4.9e38 > 3.4e38); by 2^14 it does not.
    c = jnp.float32(1.5e34)
    w = varstate.Variable(jnp.ones(2), name="vg_overflow")
    opt = LossScaleOptimizer(GradientDescent(1e-40), initial_scale=2.0**15)
    state = opt.init([w])
    vg = opt.value_and_grad(lambda p: jnp.sum(p[0].value * c))
    loss, grads, finite = vg(state, [w])
    assert loss.item() == float(np.float32(2 * np.float32(1.5e34)))  # the loss itself is finite: unscaled
    assert not bool(finite) and np.isinf(grads[0].value).all()
    params, new_state = opt.apply_gradients(grads, [w], state)
    assert new_state.non_slot("current_loss_scale").value.item() == 2.0**14
    # With the state of the next step (the halved scale) the gradients are finite and exact.
    loss, grads, finite = vg(new_state, params)
    assert bool(finite) and grads[0].value.tolist() == [float(c), float(c)]


def test_value_and_grad_uses_the_scale_of_the_state_it_is_given():
    # The scale doubles after growth_interval good steps: gradients made with the old state must be unscaled by
    # the old scale. value_and_grad does both with the scale of the state passed, so they stay exact.
    w = varstate.Variable(jnp.array([1.0, 2.0]), name="vg_growth")
    opt = LossScaleOptimizer(GradientDescent(0.0), initial_scale=4.0, growth_interval=1)
    state = opt.init([w])
    vg = opt.value_and_grad(lambda p: jnp.sum(p[0].value ** 2))
    _, grads, _ = vg(state, [w])
    # The mistake value_and_grad prevents: scaled with this step's state, unscaled with the next one's.
    scaled = jax.grad(lambda p: opt.get_scaled_loss(jnp.sum(p[0].value ** 2), state))([w])
    params, new_state = opt.apply_gradients(grads, [w], state)
    assert new_state.non_slot("current_loss_scale").value.item() == 8.0
    assert grads[0].value.tolist() == [2.0, 4.0]
    assert opt.get_unscaled_gradients(scaled, new_state)[0].value.tolist() == [1.0, 2.0]  # off by the growth
    _, grads, _ = vg(new_state, params)
    assert grads[0].value.tolist() == [2.0, 4.0]


def test_value_and_grad_float16_loss():
    # Mixed precision: a float16 loss is scaled in float16 (Keras's get_scaled_loss); its gradients overflow
    # float16 at 2^15 for a large loss, and the loss itself stays the unscaled float16 value.
    w = varstate.Variable(jnp.array([4.0], jnp.float32), name="vg_f16")
    opt = LossScaleOptimizer(GradientDescent(0.1), initial_scale=2.0**15)
    state = opt.init([w])
    vg = opt.value_and_grad(lambda p: (p[0].value.astype(jnp.float16) * jnp.float16(8.0)).sum())
    loss, grads, finite = vg(state, [w])
    # d/dw = 8, scaled 8 * 2^15 = 2^18 > float16's 65504: inf in float16, cast back to the float32 param.
    assert loss.dtype == jnp.float16 and loss.item() == 32.0
    assert not bool(finite) and np.isinf(grads[0].value).all()
