"""Optimizers against TF v1 fixtures (tests/data/make_tf_optimizer_fixtures.py), closed forms and optax."""

import os
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import checkpoint
import varstate
from varstate import IndexedSlices, Variable
from varstate.optimizers import (
    Adagrad,
    Adam,
    GradientDescent,
    Momentum,
    Optimizer,
    RMSProp,
    from_optax,
)

sys.path.insert(0, os.path.dirname(__file__))
from optimizer_cases import CASES, all_traced

DATA = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "data")  # tests/data
FIXTURES = np.load(os.path.join(DATA, "tf_optimizer_fixtures.npz"))
NAMES = ("w", "b", "emb", "vec")  # w, b dense; emb (2-D) and vec (1-D) get IndexedSlices with duplicates

TF_CASES = {
    "gd": GradientDescent(0.1),
    "momentum": Momentum(0.1, momentum=0.9),
    "momentum_nesterov": Momentum(0.1, momentum=0.9, use_nesterov=True),
    "adam": Adam(0.01),
    "adam_eps": Adam(0.1, beta1=0.8, beta2=0.99, epsilon=0.1),
    "adagrad": Adagrad(0.1),
    "adagrad_init": Adagrad(0.3, initial_accumulator_value=2.0),
    "rmsprop": RMSProp(0.01),
    "rmsprop_momentum": RMSProp(0.02, decay=0.8, momentum=0.5, epsilon=1e-6),
    "rmsprop_centered": RMSProp(0.02, decay=0.8, momentum=0.5, epsilon=1e-6, centered=True),
}


def _is_var(x):
    return isinstance(x, Variable)


def assert_tf_close(got, want, what):
    # XLA evaluates a*b+c with one rounding (FMA) where TF's Eigen kernels round the product first;
    # that is a few ulps, more on elements that nearly cancel (hence atol of 1e-7 of the array's scale).
    want = np.asarray(want)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-6, atol=1e-7 * np.abs(want).max(), err_msg=what)


def _fixture_params():
    return {k: Variable(jnp.asarray(FIXTURES[f"init/{k}"]), name=k) for k in NAMES}


def _fixture_grads(step):
    grads = {}
    for k in NAMES:
        if f"grad/{step}/{k}" in FIXTURES:
            grads[k] = jnp.asarray(FIXTURES[f"grad/{step}/{k}"])
        else:
            values, indices = FIXTURES[f"grad/{step}/{k}/values"], FIXTURES[f"grad/{step}/{k}/indices"]
            grads[k] = IndexedSlices(jnp.asarray(values), jnp.asarray(indices), FIXTURES[f"init/{k}"].shape)
    return grads


# --- TF numerics --------------------------------------------------------------------------------
@pytest.mark.parametrize("case", sorted(TF_CASES))
def test_matches_tf_v1_dense_and_sparse(case):
    opt = TF_CASES[case]
    params = _fixture_params()
    state = opt.init(params)
    assert state.get_slot_names() == sorted(FIXTURES[f"{case}/slot_names"].tolist())
    for step in (1, 2, 3):
        params, state = opt.apply_gradients(_fixture_grads(step), params, state)
        for k in NAMES:
            assert_tf_close(params[k].value, FIXTURES[f"{case}/{step}/{k}"], f"{case} step {step} {k}")
            for slot in state.get_slot_names():
                got = state.get_slot(params[k], slot).value
                assert_tf_close(got, FIXTURES[f"{case}/{step}/{k}/{slot}"], f"{case} step {step} {k}/{slot}")
        for name, var in state.non_slots.items():
            assert_tf_close(var.value, FIXTURES[f"{case}/{step}/{name}"], f"{case} step {step} {name}")


@pytest.mark.parametrize("case", sorted(TF_CASES))
def test_variables_are_exactly_those_of_a_tf_checkpoint(case):
    params = _fixture_params()
    state = TF_CASES[case].init(params)
    ours = set()
    for slot_name, tree in state.slots.items():
        for slot in jax.tree.leaves(tree, is_leaf=_is_var):
            key, primary = next((k, p) for k, p in params.items() if p.resource_id == slot.handle.slot_of)
            assert slot.name == f"{primary.name}/{slot_name}" and slot.handle.slot_name == slot_name
            assert not slot.trainable
            ours.add(f"model/{key}/.OPTIMIZER_SLOT/optimizer/{slot_name}/.ATTRIBUTES/VARIABLE_VALUE")
    ours |= {f"optimizer/{name}/.ATTRIBUTES/VARIABLE_VALUE" for name in state.non_slots}
    assert ours == set(FIXTURES[f"{case}/checkpoint_keys"].tolist())


@pytest.mark.parametrize("traced", [False, True], ids=["static", "traced"])
@pytest.mark.parametrize("case", sorted(TF_CASES))
def test_op_by_op_the_arithmetic_is_tfs_bit_for_bit(case, traced):
    # Without jit every jnp op rounds on its own, as each Eigen expression in TF's kernels does, so
    # the order of operations is checked exactly. (Under jit XLA fuses a*b+c into one rounding.)
    # TF's vectorized rsqrt (dense Adagrad, 8-wide packets) is a hardware estimate: a few ulps there.
    # Traced: every float hyperparameter read from the state (varstate.optimizers.traced), the same bits.
    max_ulp = 16 if case.startswith("adagrad") else 0
    opt = all_traced(TF_CASES[case]) if traced else TF_CASES[case]
    params = _fixture_params()
    state = opt.init(params)
    with jax.disable_jit():
        for step in (1, 2, 3):
            params, state = opt.update(_fixture_grads(step), params, state)
            for k in NAMES:
                got = [params[k].value] + [state.get_slot(params[k], n).value for n in state.get_slot_names()]
                want = [FIXTURES[f"{case}/{step}/{k}"]]
                want += [FIXTURES[f"{case}/{step}/{k}/{n}"] for n in state.get_slot_names()]
                for g, w in zip(got, want, strict=True):
                    np.testing.assert_array_max_ulp(np.asarray(g), w, maxulp=max_ulp)


@pytest.mark.parametrize("fused", [False, True], ids=["unfused", "fused"])
@pytest.mark.parametrize("case", ["adam", "momentum", "rmsprop_centered"])
def test_a_tf_v1_checkpoint_restores_consumed_and_training_continues_as_in_tf(case, fused):
    # Fused: TF's per-variable slots restore into the packed buffers, and the sparse steps of packed params
    # (emb, vec get IndexedSlices) write into their slices.
    opt = TF_CASES[case]
    params = {k: Variable(jnp.zeros(FIXTURES[f"init/{k}"].shape), name=k) for k in NAMES}
    prefix = os.path.join(DATA, "tf_optimizer_ckpt", case)
    status = checkpoint.Checkpoint(model=params, optimizer=opt.init(params, fused=fused)).restore(prefix)
    status.assert_consumed()  # exactly TF's variables: every slot and non-slot matched, nothing left over
    assert status.optimizer.fused == fused
    params, state = opt.apply_gradients(_fixture_grads(3), status.model, status.optimizer)
    for k in NAMES:
        assert_tf_close(params[k].value, FIXTURES[f"{case}/3/{k}"], f"{case} step 3 after restore, {k}")
    for name, var in state.non_slots.items():
        assert_tf_close(var.value, FIXTURES[f"{case}/3/{name}"], f"{case} step 3 after restore, {name}")


@pytest.mark.parametrize("fused", [False, True], ids=["unfused", "fused"])
def test_a_tf_format_checkpoint_of_the_state_has_tf_keys(tmp_path, fused):
    params = _fixture_params()
    state = TF_CASES["rmsprop_centered"].init(params, fused=fused)
    path = checkpoint.Checkpoint(model=params, optimizer=state).write(str(tmp_path / "ckpt"), format="tf")
    keys = {k for k in checkpoint.read_checkpoint(path).keys() if "optimizer" in k.split("/.ATTRIBUTES")[0]}
    assert keys == set(FIXTURES["rmsprop_centered/checkpoint_keys"].tolist())


def test_negative_learning_rate_is_accepted_as_tf_does():
    w = Variable(jnp.asarray(FIXTURES["init/w"]), name="w")
    opt = GradientDescent(-0.1)
    (w,), _ = opt.apply_gradients([jnp.asarray(FIXTURES["grad/1/w"])], [w], opt.init([w]))
    assert_tf_close(w.value, FIXTURES["negative_lr/w"], "negative lr")


def test_adagrad_rejects_a_non_positive_initial_accumulator_like_tf():
    tf_message = str(FIXTURES["adagrad_zero_accumulator_error"])
    with pytest.raises(ValueError, match=re.escape(tf_message)):
        Adagrad(0.1, initial_accumulator_value=0.0)


def _lazy_adam_reference(var, m, v, grad_values, indices, t, lr=0.1, b1=0.9, b2=0.999, eps=1e-8):
    # Hyperparameters are float32 tensors in TF (1 - float32(0.999) is 1.3e-5 off 0.001); the rest in float64.
    lr, b1, b2, eps = (float(np.float32(x)) for x in (lr, b1, b2, eps))
    var, m, v = var.copy(), m.copy(), v.copy()
    uniq = sorted(set(indices.tolist()))
    summed = {i: grad_values[indices == i].sum(axis=0) for i in uniq}
    alpha = lr * np.sqrt(1 - b2**t) / (1 - b1**t)
    for i in uniq:
        m[i] = b1 * m[i] + (1 - b1) * summed[i]
        v[i] = b2 * v[i] + (1 - b2) * summed[i] ** 2
        var[i] -= alpha * m[i] / (np.sqrt(v[i]) + eps)
    return var, m, v


def test_lazy_adam_touches_only_the_given_rows_and_matches_its_closed_form():
    rng = np.random.default_rng(0)
    table = rng.standard_normal((10, 3)).astype(np.float32)
    emb = Variable(jnp.asarray(table), name="emb")
    opt = Adam(0.1, lazy=True)
    params, state = [emb], opt.init([emb])
    ref = (table.astype(np.float64), np.zeros((10, 3)), np.zeros((10, 3)))
    for t, indices in enumerate([np.array([1, 4, 1]), np.array([4, 7, 7, 7])], start=1):
        values = rng.standard_normal((len(indices), 3)).astype(np.float32)
        before = np.asarray(params[0].value)
        params, state = opt.apply_gradients([IndexedSlices(jnp.asarray(values), jnp.asarray(indices))], params, state)
        ref = _lazy_adam_reference(*ref, values.astype(np.float64), indices, t)
        after = np.asarray(params[0].value)
        untouched = np.setdiff1d(np.arange(10), indices)
        np.testing.assert_array_equal(after[untouched], before[untouched])
        np.testing.assert_allclose(after, ref[0], rtol=1e-6)
        np.testing.assert_allclose(np.asarray(state.get_slot(emb, "m").value), ref[1], rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(np.asarray(state.get_slot(emb, "v").value), ref[2], rtol=1e-6, atol=1e-9)


def test_dense_adam_moves_every_row_on_a_sparse_gradient_as_tf():
    emb = Variable(jnp.ones((4, 2)), name="emb")
    opt = Adam(0.1)
    params, state = [emb], opt.init([emb])
    params, state = opt.apply_gradients([IndexedSlices(jnp.ones((1, 2)), jnp.array([0]))], params, state)
    params, state = opt.apply_gradients([IndexedSlices(jnp.ones((1, 2)), jnp.array([1]))], params, state)
    # Step 2 decays m of row 0 and still moves it, although row 0 had no gradient in step 2.
    assert float(params[0].value[0, 0]) < float(np.asarray(emb_after_one_step())[0, 0])
    assert float(state.get_slot(emb, "m").value[0, 0]) == pytest.approx(0.1 * 0.9, rel=1e-6)


def emb_after_one_step():
    emb = Variable(jnp.ones((4, 2)), name="emb")
    opt = Adam(0.1)
    (emb,), _ = opt.apply_gradients([IndexedSlices(jnp.ones((1, 2)), jnp.array([0]))], [emb], opt.init([emb]))
    return emb.value


# --- conformance over every optimizer -----------------------------------------------------------
ALL = {n: make for n, make in CASES.items() if n != "loss_scale_adam"}  # LossScaleOptimizer: test_loss_scale.py
# Keras's Muon keeps a velocity for its AdamW variables only (test_keras_matrix_optimizers.py checks its slots)
EVERY_SLOT = {n: make for n, make in ALL.items() if n != "keras_muon"}
# Slots not shaped like their param (3, 2), or split otherwise: Keras's Adafactor's row and column accumulators
SLOT_SHAPES = {"keras_adafactor": {"r": (3,), "c": (2,)}}
SLOT_SPECS = {"keras_adafactor": {"r": ("x",), "c": (None,)}}


def _slot_vars(state):
    return jax.tree.leaves(state.slots, is_leaf=_is_var)


@pytest.mark.parametrize("name", sorted(EVERY_SLOT))
def test_dtype_is_preserved(name):
    dtypes = [jnp.bfloat16, jnp.float16, jnp.float32]  # in one step: one compilation, not three
    opt = ALL[name]()
    ws = [Variable(jnp.ones((4, 2), dtype), name=f"w{i}") for i, dtype in enumerate(dtypes)]
    params, state = opt.apply_gradients([jnp.full((4, 2), 0.5, dtype) for dtype in dtypes], ws, opt.init(ws))
    assert [p.dtype for p in params] == dtypes
    for p, dtype in zip(params, dtypes, strict=True):
        slots = [state.get_slot(p, n) for n in state.get_slot_names()]
        assert all(s.dtype == dtype for s in slots if s is not None)
    assert len(_slot_vars(state)) == 3 * len(state.get_slot_names())


@pytest.mark.parametrize("name", sorted(ALL))
def test_sharding_is_preserved_across_steps(name):
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("x",))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("x", None))
    opt = ALL[name]()
    params = [Variable(jax.device_put(jnp.ones((16, 4)), sharding), name=n) for n in ("dense", "sparse")]
    state = opt.init(params)

    def split_as_wanted(s):
        spec = SLOT_SPECS.get(name, {}).get(s.handle.slot_name)
        want = sharding if spec is None else jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*spec))
        return s.sharding.is_equivalent_to(want, s.ndim)

    assert all(map(split_as_wanted, _slot_vars(state)))
    grads = [jnp.ones((16, 4)), IndexedSlices(jnp.ones((3, 4)), jnp.array([1, 9, 1]), (16, 4))]
    for _ in range(2):
        params, state = opt.apply_gradients(grads, params, state)
    assert all(p.sharding.is_equivalent_to(sharding, 2) for p in params)
    assert all(map(split_as_wanted, _slot_vars(state)))


@pytest.mark.parametrize("name", sorted(ALL))
def test_none_gradients_and_non_trainable_variables_are_skipped(name):
    opt = ALL[name]()
    params = {
        "a": Variable(jnp.ones(3), name="a"),
        "b": Variable(jnp.full(3, 2.0), name="b"),
        "frozen": Variable(jnp.full(3, 3.0), name="frozen", trainable=False),
    }
    state = opt.init(params)
    assert all(s.handle.slot_of != params["frozen"].resource_id for s in _slot_vars(state))
    params, state = opt.apply_gradients({"a": jnp.ones(3), "b": jnp.ones(3), "frozen": None}, params, state)
    b_before = np.asarray(params["b"].value)
    b_slots = {n: np.asarray(state.get_slot(params["b"], n).value) for n in state.get_slot_names()}
    params, state = opt.apply_gradients({"a": jnp.ones(3), "b": None, "frozen": jnp.ones(3)}, params, state)
    np.testing.assert_array_equal(np.asarray(params["b"].value), b_before)
    for n, before in b_slots.items():
        np.testing.assert_array_equal(np.asarray(state.get_slot(params["b"], n).value), before)
    np.testing.assert_array_equal(np.asarray(params["frozen"].value), np.full(3, 3.0))
    assert not np.array_equal(np.asarray(params["a"].value), np.ones(3))


@pytest.mark.parametrize("name", sorted(ALL))
def test_no_recompile_after_the_first_step_and_donation_honoured(name, compiles):
    opt = ALL[name]()
    params = {"w": Variable(jnp.ones((3, 2)), name="w"), "b": Variable(jnp.zeros(2), name="b")}
    state = opt.init(params)
    grads = {"w": jnp.ones((3, 2)), "b": jnp.ones(2)}
    old_value, old_slots = params["w"].value, {s.name: s.value for s in _slot_vars(state)}
    params, state = opt.apply_gradients(grads, params, state)
    # Keras's Adafactor overwrites a matrix's velocity without reading it: jit prunes that input, which is then not
    # donated (its buffer is freed when the old state is dropped)
    unread = {"w/velocity"} if name == "keras_adafactor" else set()
    assert old_value.is_deleted() and all(v.is_deleted() for n, v in old_slots.items() if n not in unread)
    compiled = compiles("_flat_step")
    for _ in range(3):
        params, state = opt.apply_gradients(grads, params, state)
    assert compiles("_flat_step") == compiled


@pytest.mark.parametrize("name", sorted(EVERY_SLOT))
def test_slots_are_named_linked_and_keep_their_identity(name):
    opt = ALL[name]()
    # The params and gradients of the no-recompile test above: its compiled step serves this one.
    w = Variable(jnp.ones((3, 2)), name="dense/kernel")
    given = {"w": w, "b": Variable(jnp.zeros(2), name="dense/bias")}
    state = opt.init(given)
    slot_ids = {n: state.get_slot(w, n).resource_id for n in state.get_slot_names()}
    for n in state.get_slot_names():
        slot = state.get_slot(w, n)
        assert slot.name == f"{w.name}/{n}" and w.name.startswith("dense/kernel")
        assert slot.handle.slot_of == w.resource_id and slot.shape == SLOT_SHAPES.get(name, {}).get(n, w.shape)
    params, state = opt.apply_gradients({"w": jnp.ones((3, 2)), "b": jnp.ones(2)}, given, state)
    assert {n: state.get_slot(params["w"], n).resource_id for n in state.get_slot_names()} == slot_ids
    assert params["w"].resource_id == w.resource_id
    assert state.get_slot(Variable(0.0), state.get_slot_names()[0] if slot_ids else "m") is None


@pytest.mark.parametrize("name", sorted(ALL))
def test_update_inside_a_callers_jit_equals_apply_gradients(name):
    opt = ALL[name]()

    def fresh():
        return {"w": Variable(jnp.arange(6.0).reshape(3, 2), name="w")}

    grads = {"w": IndexedSlices(jnp.ones((2, 2)), jnp.array([0, 0]), (3, 2))}
    p1 = fresh()
    p1, _ = jax.jit(opt.update)(grads, p1, opt.init(p1))
    p2 = fresh()
    p2, _ = opt.apply_gradients(grads, p2, opt.init(p2))
    np.testing.assert_array_equal(np.asarray(p1["w"].value), np.asarray(p2["w"].value))


@pytest.mark.parametrize("name", sorted(ALL))
def test_plain_array_params_get_plain_array_slots(name):
    opt = ALL[name]()
    # The shapes of the no-recompile test above: the Variables' step is compiled once for both tests.
    def fresh():  # the step donates plain array params: each path its own
        return {"w": jnp.arange(6.0).reshape(3, 2), "b": jnp.arange(2.0)}

    grads = {"w": jnp.ones((3, 2)), "b": jnp.ones(2)}
    arrays = fresh()
    state = opt.init(arrays)
    assert not any(_is_var(x) for x in jax.tree.leaves(state.slots, is_leaf=_is_var))
    new, _ = opt.apply_gradients(grads, arrays, state)
    vs = {k: Variable(x, name=k) for k, x in fresh().items()}
    via_var, _ = opt.apply_gradients(grads, vs, opt.init(vs))
    for k in vs:
        np.testing.assert_array_equal(np.asarray(new[k]), np.asarray(via_var[k].value))


# --- hyperparameters and step ---------------------------------------------------------------------
def test_callable_learning_rate_uses_the_step_without_recompiling(compiles):
    opt = GradientDescent(lambda step: 1.0 / (1.0 + step))
    w = Variable(jnp.zeros(2), name="w")
    params, state = [w], opt.init([w])
    params, state = opt.apply_gradients([jnp.ones(2)], params, state, step=jnp.int32(0))
    compiled = compiles("_flat_step")
    params, state = opt.apply_gradients([jnp.ones(2)], params, state, step=jnp.int32(1))
    assert compiles("_flat_step") == compiled
    np.testing.assert_allclose(np.asarray(params[0].value), [-1.5, -1.5])
    step = varstate.Variable(jnp.int32(3), name="global_step", trainable=False)
    params, state = opt.apply_gradients([jnp.ones(2)], params, state, step=step)
    np.testing.assert_allclose(np.asarray(params[0].value), [-1.75, -1.75])


def test_callable_hyperparameter_without_step_is_an_error():
    opt = Momentum(0.1, momentum=lambda step: 0.9)
    w = Variable(jnp.zeros(2), name="w")
    with pytest.raises(TypeError, match=r"Momentum.momentum is a callable of the step.*pass step="):
        opt.apply_gradients([jnp.ones(2)], [w], opt.init([w]))


def test_adam_betas_must_be_floats_as_they_seed_the_beta_powers():
    with pytest.raises(TypeError, match=r"Adam: beta1 and beta2 must be floats"):
        Adam(beta1=lambda step: 0.9).init([Variable(jnp.zeros(2))])


def test_optimizers_are_hashable_static_configs():
    assert hash(Adam(0.1)) == hash(Adam(np.float64(0.1))) and Adam(0.1) == Adam(np.float64(0.1))
    assert Adam(jnp.asarray(0.5)) == Adam(0.5)
    with pytest.raises(TypeError, match=r"Adam: learning_rate must be a float or a callable of the step, got str"):
        Adam("fast")
    assert isinstance(Adam(), Optimizer)


# --- bad input --------------------------------------------------------------------------------------
def _wb():
    registry = varstate.Registry()  # unsuffixed names for the messages
    return {
        "w": Variable(jnp.ones((3, 2)), name="w", registry=registry),
        "b": Variable(jnp.ones(2), name="b", registry=registry),
    }


def test_grads_with_another_structure_name_the_first_difference():
    params = _wb()
    opt = Adam()
    state = opt.init(params)
    fix = r"\. Pass grads with exactly the structure of params \(None for a param without gradient\)\."
    with pytest.raises(ValueError, match=r"^apply_gradients: grads do not have the structure of params; first "
                                         r"difference: grads\['c'\] vs params\['w'\]" + fix):
        opt.apply_gradients({"b": jnp.ones(2), "c": jnp.ones((3, 2))}, params, state)
    with pytest.raises(ValueError, match=r"first difference: params\['w'\] has no matching gradient" + fix):
        opt.apply_gradients({"b": jnp.ones(2)}, params, state)
    # A missing entry before the end: named as missing, not as a mismatched pair of the entries after it.
    with pytest.raises(ValueError, match=r"first difference: params\['b'\] has no matching gradient" + fix):
        opt.apply_gradients({"w": jnp.ones((3, 2))}, params, state)
    with pytest.raises(ValueError, match=r"first difference: grads\['a'\] has no matching param" + fix):
        opt.apply_gradients({"a": jnp.ones(2), "b": jnp.ones(2), "w": jnp.ones((3, 2))}, params, state)
    # Same key paths, other containers: the first one whose type differs is named.
    with pytest.raises(ValueError, match=r"first difference: grads is a list where params is a tuple" + fix):
        opt.apply_gradients([jnp.ones((3, 2)), jnp.ones(2)], (params["w"], params["b"]), opt.init((params["w"],
                                                                                                  params["b"])))
    nested = {"layer": (params["w"], params["b"])}
    with pytest.raises(ValueError, match=r"first difference: grads\['layer'\] is a list where params\['layer'\] "
                                         r"is a tuple" + fix):
        opt.apply_gradients({"layer": [jnp.ones((3, 2)), jnp.ones(2)]}, nested, opt.init(nested))


def test_gradient_shape_and_dtype_mismatch():
    params = _wb()
    opt = Momentum(0.1, 0.9)
    state = opt.init(params)
    with pytest.raises(ValueError, match=r"for 'b' \(params\['b'\]\) has shape \(3,\), the variable has shape \(2,\)"):
        opt.apply_gradients({"w": jnp.ones((3, 2)), "b": jnp.ones(3)}, params, state)
    with pytest.raises(TypeError, match=r"gradient for 'b' .* has dtype int32, the variable has dtype float32"):
        opt.apply_gradients({"w": jnp.ones((3, 2)), "b": jnp.ones(2, jnp.int32)}, params, state)
    with pytest.raises(TypeError, match=r"for 'w' .* must be convertible to a Tensor or IndexedSlices, or None"):
        opt.apply_gradients({"w": "grad", "b": jnp.ones(2)}, params, state)


def test_indexed_slices_bad_indices_and_shapes():
    params = _wb()
    opt = Adagrad(0.1)
    state = opt.init(params)

    def step(g):
        return opt.apply_gradients({"w": g, "b": None}, params, state)

    with pytest.raises(IndexError, match=r"'w' .*index 7 at offset 1 in indices is out of range .*size 3"):
        step(IndexedSlices(jnp.ones((2, 2)), jnp.array([0, 7])))
    with pytest.raises(IndexError, match=r"index -1 at offset 0 in indices is out of range"):
        step(IndexedSlices(jnp.ones((1, 2)), np.array([-1])))
    with pytest.raises(ValueError, match=r"values have shape \(2, 3\), expected \(2, 2\)"):
        step(IndexedSlices(jnp.ones((2, 3)), jnp.array([0, 1])))
    with pytest.raises(ValueError, match=r"dense_shape \(4, 2\) differs from the variable's shape \(3, 2\)"):
        step(IndexedSlices(jnp.ones((2, 2)), jnp.array([0, 1]), (4, 2)))
    with pytest.raises(TypeError, match=r"indices must be a 1-D integer array, got shape \(2,\) dtype float32"):
        step(IndexedSlices(jnp.ones((2, 2)), jnp.array([0.0, 1.0])))
    with pytest.raises(IndexError, match=r"index 3 at offset 0"):  # also checked by the pure update
        opt.update({"w": IndexedSlices(jnp.ones((1, 2)), jnp.array([3])), "b": None}, params, state)


def test_all_gradients_none_is_an_error_as_in_tf():
    params = _wb()
    opt = GradientDescent(0.1)
    with pytest.raises(ValueError, match=r"no gradients provided for any variable.*'w'"):
        opt.apply_gradients({"w": None, "b": None}, params, opt.init(params))


def test_state_from_other_params_and_uninitialized_variables():
    opt = Adam()
    state = opt.init({"w": Variable(jnp.ones(2), name="w", trainable=False)})
    with pytest.raises(ValueError, match=r"no slot 'm' for 'w2(_\d+)?' \(params\['w'\]\): the state holds nothing "
                                         r"there\. The state was made for other params .*call `state = "
                                         r"opt\.init\(params, state\)` first \(outside jit\)"):
        opt.update({"w": jnp.ones(2)}, {"w": Variable(jnp.ones(2), name="w2")}, state)
    with pytest.raises(ValueError, match=r"'u(_\d+)?' is uninitialized"):
        opt.init([varstate.uninitialized((2,), jnp.float32, name="u")])


# --- from_optax ----------------------------------------------------------------------------------------
def test_from_optax_matches_optax_and_names_its_state():
    tx = optax.adam(0.05)
    rng = np.random.default_rng(1)
    init = {"w": rng.standard_normal((3, 2)).astype(np.float32), "b": rng.standard_normal(2).astype(np.float32)}
    params = {k: Variable(jnp.asarray(x), name=k) for k, x in init.items()}
    opt = from_optax(tx)
    state = opt.init(params)
    assert state.get_slot_names() == ["mu", "nu"] and sorted(state.non_slots) == ["count"]
    assert state.get_slot(params["w"], "mu").name == params["w"].name + "/mu"
    ref_params = {k: jnp.asarray(x) for k, x in init.items()}
    ref_state = tx.init(ref_params)
    for _ in range(3):
        grads = {k: jnp.asarray(rng.standard_normal(x.shape).astype(np.float32)) for k, x in init.items()}
        params, state = opt.apply_gradients(grads, params, state)
        updates, ref_state = tx.update(grads, ref_state, ref_params)
        ref_params = optax.apply_updates(ref_params, updates)
    for k in init:
        np.testing.assert_allclose(np.asarray(params[k].value), np.asarray(ref_params[k]), rtol=1e-6)
        np.testing.assert_allclose(np.asarray(state.get_slot(params[k], "nu").value), np.asarray(ref_state[0].nu[k]))
    assert int(state.non_slot("count").value) == 3


def test_from_optax_disambiguates_repeated_field_names_and_rejects_non_transformations():
    tx = optax.chain(optax.scale_by_adam(), optax.scale_by_schedule(lambda count: -0.1))
    state = from_optax(tx).init([Variable(jnp.ones(2), name="w")])
    assert sorted(state.non_slots) == ["0_count", "1_count"]
    with pytest.raises(TypeError, match=r"from_optax: expected an optax GradientTransformation.*got int"):
        from_optax(3)


def test_partitioned_variables_get_partitioned_slots_and_grads_from_jax_grad():
    registry = varstate.Registry()
    emb = varstate.PartitionedVariable(jnp.arange(10.0).reshape(5, 2), name="emb", num_shards=2, registry=registry)
    params = {"emb": emb, "b": Variable(jnp.zeros(2), name="b", registry=registry)}
    opt = Adam(0.1)
    state = opt.init(params)
    m0 = state.get_slot(emb[0], "m")
    assert m0.name == "emb/part_0/m" and m0.shape == (3, 2)
    assert m0.save_slice_info == varstate.SaveSliceInfo("emb/m", (5, 2), (0, 0), (3, 2))

    def loss(p):
        return jnp.sum(p["emb"].as_array() ** 2) + jnp.sum(p["b"].value)

    grads = jax.grad(loss)(params)  # Variables holding gradients, structured like params
    new, state = opt.apply_gradients(grads, params, state)
    # Adam's first step moves every coordinate by lr * sign(grad) (up to epsilon); row 0 of emb has grad 0.
    expected = np.arange(10.0).reshape(5, 2) - 0.1 * np.sign(np.arange(10.0).reshape(5, 2))
    np.testing.assert_allclose(np.asarray(new["emb"].as_array()), expected, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(new["b"].value), [-0.1, -0.1], rtol=1e-5)
    assert [v.resource_id for v in new["emb"]] == [v.resource_id for v in emb]


def test_a_variable_at_two_places_shares_slots_and_gets_the_summed_gradient():
    # Tied weights: TF's tape adds the contributions of both reads; one slot set, one update.
    e = Variable(jnp.ones((3, 2)), name="tied")
    params = {"embed": e, "out": e}
    opt = Adam(0.1)
    state = opt.init(params)
    assert state.slots["m"]["embed"] is state.slots["m"]["out"]
    dense = jnp.full((3, 2), 0.5)
    sparse = IndexedSlices(jnp.ones((2, 2)), jnp.array([0, 0]), (3, 2))
    new, new_state = opt.apply_gradients({"embed": dense, "out": sparse}, params, state)
    ref = {"w": Variable(jnp.ones((3, 2)))}
    ref_p, ref_s = opt.apply_gradients({"w": dense + sparse.to_dense()}, ref, opt.init(ref))
    np.testing.assert_array_equal(new["embed"].value, ref_p["w"].value)
    np.testing.assert_array_equal(new["out"].value, new["embed"].value)
    assert new["out"].resource_id == new["embed"].resource_id == e.resource_id
    np.testing.assert_array_equal(new_state.get_slot(new["embed"], "m").value, ref_s.slots["m"]["w"].value)
    v_out, v_embed = new_state.slots["v"]["out"], new_state.slots["v"]["embed"]
    assert v_out.handle is v_embed.handle
    np.testing.assert_array_equal(v_out.value, v_embed.value)


@pytest.mark.parametrize("shape", [(8,), (8, 1), (8, 1, 1)])
def test_sparse_adagrad_rows_of_one_element_divide_as_tfs_kernel(shape):
    # TF's SparseApplyAdagrad takes its scalar path (lr * g / sqrt(accum)) when a row has one element
    # (inner_dim = product of the dimensions after the first), whatever the rank; op by op, bit for bit.
    rng = np.random.default_rng(0)
    g = rng.standard_normal(8).astype(np.float32).reshape(shape)
    w = Variable(jnp.zeros(shape), name="w")  # zero: the update's last bit is not rounded away
    opt = Adagrad(0.1)
    with jax.disable_jit():
        (w2,), state = opt.update([IndexedSlices(jnp.asarray(g), jnp.arange(8), shape)], [w], opt.init([w]))
    accum = np.float32(0.1) + g * g
    np.testing.assert_array_equal(np.asarray(state.get_slot(w, "accumulator").value), accum)
    np.testing.assert_array_equal(np.asarray(w2.value), np.float32(0) - np.float32(0.1) * g / np.sqrt(accum))


def test_from_optax_a_variable_at_two_places_gets_one_update_with_the_summed_gradient():
    # As the base optimizers do (and TF's tape): one slot set, one optax update of the summed gradient.
    # It crashed: both places fed optax, so jit was asked to donate the same buffer twice.
    tx = optax.adam(0.1)
    e = Variable(jnp.ones((3, 2)), name="tied")
    params = {"embed": e, "out": e}
    opt = from_optax(tx)
    state = opt.init(params)
    assert state.slots["mu"]["embed"] is state.slots["mu"]["out"]
    assert state.slots["mu"]["embed"].name == "tied/mu"
    dense = jnp.full((3, 2), 0.5)
    sparse = IndexedSlices(jnp.ones((2, 2)), jnp.array([0, 0]), (3, 2))
    new, new_state = opt.apply_gradients({"embed": dense, "out": sparse}, params, state)
    summed = dense + sparse.to_dense()

    @jax.jit
    def reference(w, g):
        return optax.apply_updates(w, tx.update(g, tx.init(w), w)[0])

    np.testing.assert_array_equal(new["embed"].value, reference(jnp.ones((3, 2)), summed))
    np.testing.assert_array_equal(new["out"].value, new["embed"].value)
    assert new_state.slots["nu"]["out"].handle is new_state.slots["nu"]["embed"].handle
    np.testing.assert_array_equal(new_state.slots["nu"]["out"].value, summed * summed * (1 - 0.999))


@pytest.mark.parametrize("name", sorted(ALL))
def test_an_integer_variable_with_a_gradient_is_refused_not_left_unchanged(name):
    # lr 0.1 cast to int32 is 0: the step silently did nothing. TF has no integer kernels for its
    # optimizers and its Optimizer lists the float and complex dtypes it accepts (ValueError).
    opt = ALL[name]()
    counts = Variable(jnp.array([3, 4]), name="counts")
    with pytest.raises(ValueError, match=r"apply_gradients: 'counts' \(params\[0\]\) has dtype int32; optimizers "
                                         r"update floating-point or complex variables only.*trainable=False"):
        opt.apply_gradients([jnp.array([1, 1])], [counts], opt.init([counts]))


def test_slots_are_named_after_their_primary_whatever_the_name_scope():
    # make_slot names a slot `<primary name>/<slot>` (TF's slot_creator scopes it under the primary);
    # an enclosing name_scope was prepended a second time.
    w = Variable(jnp.zeros(2), name="dense/kernel")
    with varstate.name_scope("train"):
        state = Adam().init({"w": w})
    assert [state.get_slot(w, n).name for n in ("m", "v")] == ["dense/kernel/m", "dense/kernel/v"]


def test_tied_dense_and_sparse_gradients_under_jit_drop_a_negative_index():
    # Inside a caller's jit indices cannot be checked; an out-of-range row is dropped everywhere
    # (add_rows), so also when a tied variable's sparse gradient is summed into a dense one.
    w = Variable(jnp.zeros(3), name="tied_neg")
    params = {"a": w, "b": w}
    opt = GradientDescent(1.0)
    grads = {"a": jnp.ones(3), "b": IndexedSlices(jnp.array([5.0]), jnp.array([-1]), (3,))}
    new, _ = jax.jit(opt.update)(grads, params, opt.init(params))
    assert new["a"].value.tolist() == [-1.0, -1.0, -1.0]


def test_from_optax_with_mesh_sharded_params_a_restored_state_steps(tmp_path):
    # optax's `count` was left on device 0; restored committed there, the next step failed
    # ("incompatible devices"). Non-slots are replicated over the first variable's mesh, as the base's.
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("x",))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("x"))
    opt = from_optax(optax.adam(0.1))

    def fresh():
        return {"w": Variable(jax.device_put(jnp.ones(16), sharding), name="optax_mesh")}

    params = fresh()
    state = opt.init(params)
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    assert state.non_slot("count").sharding.is_equivalent_to(replicated, 0)
    params, state = opt.apply_gradients({"w": jnp.ones(16)}, params, state)
    path = checkpoint.Checkpoint(model=params, optimizer=state).write(str(tmp_path / "ckpt"))
    template = fresh()
    status = checkpoint.Checkpoint(model=template, optimizer=opt.init(template)).restore(path)
    params, state = opt.apply_gradients({"w": jnp.ones(16)}, status.model, status.optimizer)
    assert state.non_slot("count").value.item() == 2


def test_apply_gradients_leaves_the_garbage_collector_as_it_found_it():
    import gc

    w = Variable(jnp.zeros(2), name="w")
    opt = GradientDescent(0.1)
    params, state = {"w": w}, opt.init({"w": w})
    assert gc.isenabled()
    params, state = opt.apply_gradients({"w": jnp.ones(2)}, params, state)
    assert gc.isenabled()
    gc.disable()
    try:
        params, state = opt.apply_gradients({"w": jnp.ones(2)}, params, state)
        assert not gc.isenabled()
        with pytest.raises(TypeError, match="must be convertible to a Tensor or IndexedSlices"):
            opt.apply_gradients({"w": "text"}, params, state)
        assert not gc.isenabled()
    finally:
        gc.enable()
    np.testing.assert_allclose(params["w"].value, [-0.2, -0.2])


def test_get_slot_of_a_plain_array_param_says_where_its_slot_is():
    params = {"w": jnp.zeros(2)}
    state = Adam(0.1).init(params)
    with pytest.raises(TypeError, match=r"get_slot finds slots by their variable's identity; got ArrayImpl, which has "
                                        r"none. A plain-array param's slot sits at the param's position in "
                                        r"state.slots\['m'\]"):
        state.get_slot(params["w"], "m")
    np.testing.assert_array_equal(state.slots["m"]["w"], np.zeros(2))
