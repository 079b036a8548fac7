"""varstate.optimizers.keras.Adafactor against Keras 3.15 (TF backend): Keras's golden tests, and step by step.

Fixtures: tests/data/keras_optimizers_3/ from make_keras_optimizer_fixtures_3.py: three Adafactor configs (Keras's
defaults; its golden test's setup with weight decay; a schedule) over 6 steps on a 2-D, a 1-D, a 3-D and an 8 x 12
variable with dense gradients and a 2-D and a 1-D one with sparse gradients (a duplicate index each step).

Bound: each param and slot element within ULPS ulp of the largest element of Keras's, op by op and under jit
(measured: params 2, slots 3, both ways): Keras's means (`r`, `c`, the rms of the variable and of the update) sum in
Eigen's vectorized order, ours in XLA's; `velocity`, the ratio of two means times a third, compounds them. Each
config's iteration, learning rate and int32 placeholders equal Keras's exactly.
"""

import importlib.util
import json
import os

import jax.numpy as jnp
import numpy as np
import pytest

import varstate
from varstate import IndexedSlices
from varstate.optimizers import keras

DATA = os.path.join(os.path.dirname(__file__), "..", "..", "..", "data")
_spec = importlib.util.spec_from_file_location("fixtures3", os.path.join(DATA, "make_keras_optimizer_fixtures_3.py"))
FX = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(FX)
with open(os.path.join(FX.OUT, "meta.json")) as _f:
    META = json.load(_f)
STEPS = np.load(os.path.join(FX.OUT, "steps.npz"))
ULPS = 4
PARAMS = [["", "", "float32", list(s)] for s in FX.SHAPES.values()]


def assert_within(got, want, what, ulps=ULPS):
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape, what
    if want.dtype.kind != "f":  # iteration (int64 in Keras, JAX's widest int here), the int32 placeholders
        np.testing.assert_array_equal(got, want, err_msg=what)
        return
    assert got.dtype == want.dtype, what
    err = np.abs(got.astype(np.float64) - want).max() / np.spacing(np.abs(want).max())
    assert err <= ulps, f"{what}: {err} ulp of the largest element"


def state_in_keras_order(state, params):
    lead = [n for n in ("iteration", "learning_rate") if n in state.non_slots]
    return [state.non_slots[n].value for n in lead] + [
        state.slots[n][i].value for i in range(len(params)) for n in ("r", "c", "velocity")]


@pytest.mark.parametrize("config", [c for c in FX.CONFIGS if c.startswith("adafactor")])
@pytest.mark.parametrize("jitted", [False, True])
def test_steps_within_the_bound_of_keras(config, jitted):
    opt = FX.ours_optimizer(config)
    params = FX.ours_params(STEPS)
    state = opt.init(params)
    variables = META["configs"][config]["variables"]
    # Keras's layout: per variable r, c (int32 scalars below 2-D, named as the variable), velocity
    got = state_in_keras_order(state, params)
    assert [(list(np.shape(g)), "int64" if v[2] == "int64" else str(np.asarray(g).dtype)) for g, v in
            zip(got, variables, strict=True)] == [(v[3], v[2]) for v in variables]
    step_fn = opt.apply_gradients if jitted else opt.update
    for step in range(META["steps"]):
        params, state = step_fn(FX.ours_gradients(STEPS, step), params, state)
        what = f"{config} step {step}"
        for name, p, want in zip(FX.SHAPES, params, FX.unpack(STEPS[f"{config}/{step}/params"], PARAMS), strict=True):
            assert_within(p.value, want, f"{what} {name}")
        wants = FX.unpack(STEPS[f"{config}/{step}/opt"], variables)
        for i, (g, want) in enumerate(zip(state_in_keras_order(state, params), wants, strict=True)):
            assert_within(g, want, f"{what} optimizer variable {i} ({variables[i][0]})")


# --- keras/src/optimizers/adafactor_test.py: its setups and tolerances -------------------------------------------
def test_kerass_single_steps():
    opt = keras.Adafactor(learning_rate=0.5)
    p = [jnp.array([1.0, 2.0, 3.0, 4.0])]
    p, _ = opt.update([jnp.array([1.0, 6.0, 7.0, 2.0])], p, opt.init(p))
    np.testing.assert_allclose(np.asarray(p[0]), [-0.3693, 0.6307, 1.6307, 2.6307], rtol=1e-4, atol=1e-4)
    p = [jnp.array([[1.0, 2.0], [3.0, 4.0]])]
    p, _ = opt.update([jnp.array([[1.0, 6.0], [7.0, 2.0]])], p, opt.init(p))
    np.testing.assert_allclose(np.asarray(p[0]), [[0.7007, -0.0081], [1.2492, 3.4407]], rtol=1e-4, atol=1e-4)


def test_kerass_weight_decay():
    # Keras's var1 is stepped by three fresh optimizers (its excluded variables stay at 2.0, not modelled here)
    opt = keras.Adafactor(learning_rate=1.0, weight_decay=0.004)
    p = [jnp.asarray(2.0, jnp.float32)]
    for _ in range(3):
        p, _ = opt.update([jnp.zeros(())], p, opt.init(p))
    assert round(float(p[0]), 6) == round(1.9760959, 6)


def test_kerass_golden_values():
    opt = keras.Adafactor(learning_rate=0.5, beta_2_decay=-0.65, epsilon_1=1e-15, epsilon_2=1e-4,
                          clip_threshold=0.9, relative_step=False)
    x = [jnp.ones(10, jnp.float32)]
    state = opt.init(x)
    golden = np.array([
        [0.55] * 10,
        [0.3031, 0.3026, 0.3025, 0.3024, 0.3024, 0.3024, 0.3024, 0.3024, 0.3024, 0.3024],
        [0.1671, 0.1665, 0.1663, 0.1663, 0.1663, 0.1663, 0.1663, 0.1663, 0.1663, 0.1663],
        [0.0923, 0.0916, 0.0915, 0.0914, 0.0914, 0.0914, 0.0914, 0.0914, 0.0914, 0.0914],
        [0.0554, 0.0548, 0.0546, 0.0546, 0.0546, 0.0546, 0.0546, 0.0545, 0.0545, 0.0545]])
    x, state = opt.update([jnp.full((10,), 0.01)], x, state)
    for i in range(5):
        np.testing.assert_allclose(np.asarray(x[0]), golden[i], rtol=5e-4, atol=5e-4)
        x, state = opt.update([jnp.arange(1, 11, dtype=jnp.float32) / 10], x, state)


# --- slots, dtypes, sparse rows, errors ---------------------------------------------------------------------------
# Keras 3.15's params after 2 steps of the setup below: kernel[0, 0, :3] and bias (float16: epsilon_1 = 1e-30 is 0,
# the bias row without gradient has velocity 0, and 0 / sqrt(0) = NaN joins the rows and their rms)
KERAS_TWO_STEPS = {
    "float16": ([0.81005859375] * 3, [np.nan] * 3),
    "bfloat16": ([0.80859375] * 3, [0.8046875, 0.8046875, 1.0]),
    "float32": ([0.8100000023841858] * 3, [0.8065476417541504, 0.8065476417541504, 1.0]),
}


@pytest.mark.parametrize("dtype", sorted(KERAS_TWO_STEPS))
def test_slots_and_dtypes(dtype):
    k = varstate.Variable(jnp.ones((2, 4, 3), dtype), name="conv/kernel")
    b = varstate.Variable(jnp.ones(3, dtype), name="conv/bias")
    opt = keras.Adafactor(0.1)
    params, state = [k, b], opt.init([k, b])
    want = {("r", 0): ((2, 4), dtype), ("c", 0): ((2, 3), dtype), ("velocity", 0): ((2, 4, 3), dtype),
            ("r", 1): ((), jnp.int32), ("c", 1): ((), jnp.int32), ("velocity", 1): ((3,), dtype)}
    for (name, i), (shape, dt) in want.items():
        s = state.get_slot(params[i], name)
        assert (s.shape, s.dtype, s.name, s.handle.slot_of) == (shape, dt, f"{params[i].name}/{name}",
                                                                 params[i].resource_id)
    grads = [jnp.full((2, 4, 3), 0.5, dtype), IndexedSlices(jnp.array([1.0, 1.0], dtype), jnp.array([1, 0]), (3,))]
    for _ in range(2):
        params, state = opt.update(grads, params, state)
    assert [p.dtype for p in params] == [jnp.dtype(dtype)] * 2 and state.non_slot("iteration").value.item() == 2
    assert state.get_slot(params[1], "r").value.item() == 0  # Keras's placeholder is never updated
    kernel, bias = KERAS_TWO_STEPS[dtype]
    np.testing.assert_array_equal(np.asarray(params[0].value, np.float32).ravel()[:3], kernel)
    np.testing.assert_array_equal(np.asarray(params[1].value, np.float32), bias)


def test_sparse_rows_follow_kerass_rules():
    # A duplicate row: g2 sums the rows' squares (1 + 1, not (1 + 1)**2); u stays on the rows, its rms sums their
    # squares over the dense size; the rows are scattered in turn. Keras 3.15 gives [1, 0.9985858, 1] and
    # velocity [1e-30, 2, 1e-30] for this step (its default settings).
    opt = keras.Adafactor()
    p = [jnp.ones(3, jnp.float32)]
    p, state = opt.update([IndexedSlices(jnp.ones(2), jnp.array([1, 1]), (3,))], p, opt.init(p))
    f = np.float32
    u = f(1) / np.sqrt(f(2) + f(1e-30))
    scale = max(f(1), np.sqrt((u * u + u * u) / f(3)) / f(1))
    step = f(0.001) * (u / scale)
    np.testing.assert_array_equal(np.asarray(p[0]), [1, (f(1) - step) - step, 1])
    np.testing.assert_array_equal(np.asarray(state.slots["velocity"][0]), np.array([1e-30, 2, 1e-30], f))


def test_errors():
    with pytest.raises(TypeError, match=r"Adafactor: relative_step must be a bool, got str 'yes'\."):
        keras.Adafactor(relative_step="yes")
    with pytest.raises(TypeError, match=r"Adafactor: clip_threshold must be a float, got NoneType None\."):
        keras.Adafactor(clip_threshold=None)
    k = varstate.Variable(jnp.ones((3, 2)), name="dense/kernel")
    opt = keras.Adafactor()
    with pytest.raises(ValueError, match=r"Adafactor.init: fused=True \(or a fused state\) packs many params into "
                                         r"one buffer, but Adafactor's step reduces over each whole variable"):
        opt.init([k], fused=True)
    # a state made for another shape: its r does not fit this param's rows
    other = varstate.Variable(jnp.ones((4, 2)), name="other/kernel")
    state = opt.init([other])
    with pytest.raises(ValueError, match=r"The optimizer state does not fit the params: slot 'r' of 'other/kernel' "
                                         r"\(params\[0\]\) is 'other/kernel/r' with shape \(4,\) and dtype float32, "
                                         r"but the param needs shape \(3,\) and dtype float32"):
        opt.init([other._with_value(jnp.ones((3, 2)))], state)
    with pytest.raises(ValueError, match=r"Adafactor.update: the optimizer state does not fit the params: slot 'r' "
                                         r"of params\[0\] is the plain array there with shape \(4,\)"):
        opt.update([jnp.ones((3, 2))], [jnp.ones((3, 2))], opt.init([jnp.ones((4, 2))]))
