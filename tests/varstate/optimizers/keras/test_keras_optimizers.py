"""varstate.optimizers.keras against Keras 3.15 (TF backend), step by step, bit for bit.

Fixtures: tests/data/keras_optimizers/steps.npz from make_keras_optimizer_fixtures.py: 14 configs of the
10 optimizers, 7 steps of dense (kernel, bias) and sparse (emb, a duplicate index each step) gradients.
"""

import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import varstate
from varstate import IndexedSlices
from varstate.optimizers import keras
from varstate.optimizers._core._slots import StateMismatchError

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from optimizer_cases import all_traced

DATA = os.path.join(os.path.dirname(__file__), "..", "..", "..", "data", "keras_optimizers")
with open(os.path.join(DATA, "meta.json")) as _f:
    META = json.load(_f)
STEPS = np.load(os.path.join(DATA, "steps.npz"))
NAMES = ("kernel", "bias", "emb")


def assert_keras(got, want, config, what):
    """Bit for bit; Ftrl within 4 ulp of the largest element (Keras's array pow is Eigen's, not correctly rounded)."""
    if config.startswith("ftrl") and want.dtype.kind == "f":
        # an element within 4 ulp of the array's largest magnitude (more ulp of itself where it nearly cancels)
        assert np.abs(got.astype(np.float64) - want).max() <= 4 * np.spacing(np.abs(want).max()), what
    else:
        np.testing.assert_array_equal(got, want, err_msg=what)


def keras_order(opt, n):
    lead, groups, trail = opt.keras_layout()
    order = [(x, None) for x in lead]
    for group in groups:
        for i in range(n):
            order += [(s, i) for s in group]
    return order + [(x, None) for x in trail]


def _fresh(keras_readback, config, traced=False):
    opt = keras_readback.ours_optimizer(config, META)
    if traced:
        opt = all_traced(opt) or opt
    params = [varstate.Variable(STEPS[f"init/{n}"], name=n) for n in NAMES]
    return opt, params, opt.init(params)


def _state_values(opt, state):
    out = []
    for name, p in keras_order(opt, len(NAMES)):
        v = state.non_slots[name] if p is None else state.slots[name][p]
        out.append(np.asarray(v.value))
    return out


@pytest.mark.parametrize("traced", [False, True], ids=["static", "traced"])
@pytest.mark.parametrize("config", sorted(META["configs"]))
def test_op_by_op_equals_keras_bit_for_bit(config, traced, keras_readback):
    # Traced: every float hyperparameter (varstate.optimizers.traced) read from the state, Keras's host-rounded
    # constants (1 - beta_1) included: the same bits.
    opt, params, state = _fresh(keras_readback, config, traced)
    assert [v[1].rsplit("/", 1)[-1] for v in META["configs"][config]["variables"]] == [
        "variable" if n == "u_product" else (n if p is None else f"{NAMES[p]}_{n}") for n, p in keras_order(opt, 3)
    ]
    for step in range(META["steps"]):
        params, state = opt.update(keras_readback.ours_gradients(STEPS, step), params, state)
        for name, p in zip(NAMES, params, strict=True):
            assert_keras(np.asarray(p.value), STEPS[f"{config}/{step}/param/{name}"], config, f"step {step} {name}")
        for i, got in enumerate(_state_values(opt, state)):
            want = STEPS[f"{config}/{step}/opt/{i}"]
            assert got.dtype == (np.int32 if want.dtype == np.int64 and not jax.config.jax_enable_x64 else want.dtype)
            assert_keras(got, want, config, f"step {step} optimizer variable {i}")


@pytest.mark.parametrize("config", sorted(META["configs"]))
def test_jitted_within_an_ulp_or_two_of_the_largest_element(config, keras_readback):
    # XLA:CPU fuses multiply-adds and turns a division by a scalar into a multiplication: an element may move
    # by a few ulp of itself (hundreds on a nearly cancelled one), never more than 4 ulp of the variable's largest.
    opt, params, state = _fresh(keras_readback, config)
    for step in range(META["steps"]):
        params, state = opt.apply_gradients(keras_readback.ours_gradients(STEPS, step), params, state)
        for name, p in zip(NAMES, params, strict=True):
            want = STEPS[f"{config}/{step}/param/{name}"]
            scale = np.spacing(np.abs(want).max())
            assert np.abs(np.asarray(p.value, np.float64) - want).max() <= 4 * scale, (config, step, name)
    assert state.non_slot("iteration").value.item() == META["steps"]


def test_iteration_is_keras_int64_counter_and_schedule_reads_it():
    seen = []

    def schedule(it):
        seen.append(it.dtype)
        return 0.5 / (1.0 + it.astype(jnp.float32))

    opt = keras.SGD(schedule)
    w = varstate.Variable(jnp.ones(1), name="w")
    state = opt.init([w])
    it = state.non_slot("iteration")
    from varstate import _seam
    assert _seam.saved_dtype(it) == np.int64 and it.trainable is False and "learning_rate" not in state.non_slots
    for _ in range(3):
        (w,), state = opt.update([jnp.ones(1)], [w], state)
    # 1 - 0.5 - 0.25 - 0.5/3 (each in float32)
    want = np.float32(1) - np.float32(0.5) - np.float32(0.25) - (np.float32(0.5) / np.float32(3))
    assert w.value.tolist() == [float(want)] and state.non_slot("iteration").value.item() == 3
    assert all(np.issubdtype(d, np.integer) for d in seen)


def test_learning_rate_is_state_as_in_keras():
    # Keras keeps a float learning rate in a variable: a restored value wins over the constructor's.
    opt = keras.SGD(0.1)
    w = varstate.Variable(jnp.ones(1), name="w")
    state = opt.init([w])
    assert state.non_slot("learning_rate").value.item() == np.float32(0.1)
    from varstate import _seam
    state = varstate.optimizers.OptimizerState(
        slots=state.slots,
        non_slots={**state.non_slots, "learning_rate": _seam.with_value(state.non_slot("learning_rate"),
                                                                        jnp.float32(0.5))})
    (w,), _ = opt.update([jnp.ones(1)], [w], state)
    assert w.value.tolist() == [0.5]


def test_adamw_decays_before_the_step_and_only_with_weight_decay():
    w0 = np.array([2.0, -4.0], np.float32)
    for opt, decay in ((keras.AdamW(0.1, weight_decay=0.25), 0.25), (keras.Adam(0.1), None)):
        p = [jnp.asarray(w0)]
        p, _ = opt.update([jnp.zeros(2)], p, opt.init(p))
        decayed = w0 - w0 * np.float32(decay) * np.float32(0.1) if decay else w0
        np.testing.assert_array_equal(np.asarray(p[0]), decayed)  # zero gradient: Adam's step is 0


def test_slot_layouts_follow_keras():
    assert keras.SGD().keras_layout() == (("iteration", "learning_rate"), (), ())
    assert keras.RMSprop(momentum=0.5).keras_layout()[1] == (("velocity",), ("momentum",))
    assert keras.Nadam().keras_layout()[2] == ("u_product",)
    assert keras.Adam(lambda it: 0.1).keras_layout()[0] == ("iteration",)


def test_ftrl_checks_its_arguments_as_keras():
    with pytest.raises(ValueError, match=r"Ftrl: learning_rate_power must be negative or zero \(as Keras requires\)"):
        keras.Ftrl(learning_rate_power=0.5)
    with pytest.raises(ValueError, match=r"Ftrl: l1_regularization_strength must be positive or zero"):
        keras.Ftrl(l1_regularization_strength=-1.0)


def test_errors():
    with pytest.raises(TypeError, match=r"Adam: beta_1 must be a float, got str"):
        keras.Adam(beta_1="0.9")
    with pytest.raises(TypeError, match=r"SGD: learning_rate must be a float or a callable of the step"):
        keras.SGD(jnp.ones(2))
    w = varstate.Variable(jnp.ones(2), name="w")
    state = varstate.optimizers.Adam().init([w])  # a TF v1 Adam's state: no iteration
    with pytest.raises(StateMismatchError, match=r"no non-slot variable 'iteration'"):
        keras.Adam().update([jnp.ones(2)], [w], state)
    # apply_gradients creates what is missing, as Keras builds on first use
    (_w2,), state = keras.Adam().apply_gradients([jnp.ones(2)], [w], keras.Adam().init([w]))
    assert state.non_slot("iteration").value.item() == 1


# The conformance suite (tests/varstate/optimizers/test_optimizers.py) runs over these optimizers too; here only what is
# Keras's own: sparse gradients keep the dtype, `iteration` counts steps, and the slots are Keras's.
# Muon: a velocity for AdamW's variables only; test_keras_matrix_optimizers.py checks its sparse steps.
@pytest.mark.parametrize("name", sorted(set(keras.__all__) - {"KerasOptimizer", "Muon"}))
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
def test_sparse_steps_keep_the_dtype_count_iterations_and_make_kerass_slots(name, dtype):
    opt = getattr(keras, name)(0.1)
    w = varstate.Variable(jnp.ones((4, 2), dtype), name="w")
    state = opt.init([w])
    assert set(state.get_slot_names()) == {s for group in opt.keras_layout()[1] for s in group}
    grads = [IndexedSlices(jnp.full((2, 2), 0.5, dtype), jnp.array([1, 1]), (4, 2))]
    params = [w]
    for _ in range(2):
        params, state = opt.apply_gradients(grads, params, state)
    assert params[0].dtype == dtype  # values may be NaN: Keras's Nadam in bfloat16 divides by 1 - 0.999 == 0
    assert all(state.get_slot(params[0], n).dtype == dtype for n in state.get_slot_names())
    assert state.non_slot("iteration").value.item() == 2
