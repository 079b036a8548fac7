"""varstate.optimizers.keras's `Lamb` and `Muon` against Keras 3.15 (TF backend), step by step, within stated bounds.

Fixtures: tests/data/keras_optimizers_2/ from make_keras_optimizer_fixtures_2.py: Lamb's and Muon's configs over the
first set's 7 steps of dense (kernel, bias) and sparse (emb, a duplicate index each step) gradients; for Lamb,
Keras's checkpoint after 3 steps, ours after 2 more, and what Keras computes resumed from ours.

Bounds: op by op the slots equal Keras's bit for bit (element-wise ops, Keras's order), and each param element is
within PARAM_ULPS ulp of the largest element of Keras's param: Lamb's two norms (measured 0.25 ulp) and Muon's
Newton-Schulz matmuls and Frobenius norm (measured 1 ulp; its AdamW variables: bit for bit) sum in another order
than Eigen's. Under jit XLA fuses multiply-adds, within JIT_ULPS (measured 3.25, a momentum).
"""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import varstate
from varstate import IndexedSlices
from varstate.optimizers import keras

HERE = os.path.join(os.path.dirname(__file__), "..", "..", "..", "data")
DATA = os.path.join(HERE, "keras_optimizers_2")
with open(os.path.join(DATA, "meta.json")) as _f:
    META = json.load(_f)
INPUTS = np.load(os.path.join(HERE, "keras_optimizers", "steps.npz"))
STEPS = np.load(os.path.join(DATA, "steps.npz"))
READBACK = np.load(os.path.join(DATA, "readback.npz"))
NAMES = ("kernel", "bias", "emb")
PARAM_ULPS = {"Lamb": 1, "Muon": 2}
JIT_ULPS = 4


def assert_within(got, want, what, ulps):
    got, want = np.asarray(got), np.asarray(want)
    assert got.dtype == want.dtype and got.shape == want.shape, what
    err = np.abs(got.astype(np.float64) - want).max() / np.spacing(np.abs(want).max())
    assert err <= ulps, f"{what}: {err} ulp of the largest element"


def keras_order(opt, params):
    """Keras's optimizer variables: Lamb's by its layout; Muon's momentum per variable, then velocity for AdamW's."""
    if isinstance(opt, keras.Muon):
        return [("iteration", None), ("learning_rate", None)] + [
            (s, i) for i, p in enumerate(params) for s in ("momentum", "velocity")[:1 + opt.uses_adamw(p)]]
    lead, groups, trail = opt.keras_layout()
    order = [(x, None) for x in lead]
    for group in groups:
        for i in range(len(params)):
            order += [(s, i) for s in group]
    return order + [(x, None) for x in trail]


def _fresh(keras_readback, config):
    c = META["configs"][config]
    opt = getattr(keras, c["class"])(**c["kwargs"])
    params = [varstate.Variable(INPUTS[f"init/{n}"], name=n) for n in NAMES]
    return opt, params, opt.init(params)


def _check_state(opt, params, state, want_param, want_opt, what, jitted=False):
    for name, p in zip(NAMES, params, strict=True):
        assert_within(p.value, want_param(name), f"{what} {name}",
                      JIT_ULPS if jitted else PARAM_ULPS[type(opt).__name__])
    for i, (name, p) in enumerate(keras_order(opt, params)):
        got = (state.non_slots[name] if p is None else state.slots[name][p]).value
        if name == "iteration":
            assert got.item() == want_opt(i).item(), what
        elif jitted:
            assert_within(got, want_opt(i), f"{what} optimizer variable {i} ({name})", JIT_ULPS)
        else:
            np.testing.assert_array_equal(got, want_opt(i), err_msg=f"{what} optimizer variable {i} ({name})")


@pytest.mark.parametrize("config", sorted(META["configs"]))
@pytest.mark.parametrize("jitted", [False, True])
def test_steps_within_the_bound_of_keras(config, jitted, keras_readback):
    opt, params, state = _fresh(keras_readback, config)
    assert [v[1].rsplit("/", 1)[-1] for v in META["configs"][config]["variables"]] == [
        n if p is None else f"{NAMES[p]}_{n}" for n, p in keras_order(opt, params)]
    step_fn = opt.apply_gradients if jitted else opt.update
    for step in range(META["steps"]):
        params, state = step_fn(keras_readback.ours_gradients(INPUTS, step), params, state)
        _check_state(opt, params, state, lambda n, s=step: STEPS[f"{config}/{s}/param/{n}"],
                     lambda i, s=step: STEPS[f"{config}/{s}/opt/{i}"], f"{config} step {step}", jitted)


@pytest.mark.parametrize("config", sorted({k.split("/")[0] for k in READBACK.files}))
def test_keras_checkpoint_round_trip(config, tmp_path, keras_readback):
    # Keras trained N_FIRST steps and saved; we restore, step M and save (ours/, made by the fixture script from
    # this same code); Keras restored ours and finished: each stage within the bound of Keras's uninterrupted run.
    from checkpoint import keras as ckpt_keras

    c = META["configs"][config]
    opt = getattr(keras, c["class"])(**c["kwargs"])
    params, state = ckpt_keras.load_optimizer_state(os.path.join(DATA, "keras3", config, "ckpt"), opt)
    n_first, m, last = META["n_first"], META["m"], META["steps"] - 1
    _check_state(opt, params, state, lambda n: STEPS[f"{config}/{n_first - 1}/param/{n}"],
                 lambda i: STEPS[f"{config}/{n_first - 1}/opt/{i}"], "restored")
    for step in range(n_first, n_first + m):
        params, state = opt.update(keras_readback.ours_gradients(INPUTS, step), params, state)
    ckpt_keras.save_optimizer_state(str(tmp_path / "ckpt"), opt, params, state)
    # what we save now reads back as the committed file Keras resumed from
    saved = ckpt_keras.load_optimizer_state(str(tmp_path / "ckpt"), opt)
    committed = ckpt_keras.load_optimizer_state(os.path.join(DATA, "ours", config, "ckpt"), opt)
    for a, b in zip(jax.tree.leaves(saved), jax.tree.leaves(committed), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    _check_state(opt, params, state, lambda n: STEPS[f"{config}/{n_first + m - 1}/param/{n}"],
                 lambda i: STEPS[f"{config}/{n_first + m - 1}/opt/{i}"], "ours after M steps")
    for name in NAMES:
        assert_within(READBACK[f"{config}/param/{name}"], STEPS[f"{config}/{last}/param/{name}"], f"Keras's {name}",
                      PARAM_ULPS[c["class"]])
    for i in range(len(keras_order(opt, params))):
        np.testing.assert_array_equal(READBACK[f"{config}/opt/{i}"], STEPS[f"{config}/{last}/opt/{i}"])


def test_lamb_kerass_golden_values():
    # keras/src/optimizers/lamb_test.py's test_correctness_with_golden, its tolerance
    opt = keras.Lamb()
    x = [jnp.ones(10, jnp.float32)]
    state = opt.init(x)
    golden = np.tile([[0.999], [0.9982], [0.9974], [0.9965], [0.9955]], (1, 10))
    x, state = opt.update([jnp.full((10,), 0.01)], x, state)
    for i in range(5):
        np.testing.assert_allclose(np.asarray(x[0]), golden[i], rtol=5e-4, atol=5e-4)
        x, state = opt.update([jnp.arange(1, 11, dtype=jnp.float32) / 10], x, state)


def test_lamb_ratio_is_one_where_a_norm_is_zero():
    # a zero variable (|w| = 0) takes Adam's bias-corrected step unscaled; a zero gradient (|u| = 0) leaves it
    g = np.array([0.5, -2.0, 0.0], np.float32)
    f = np.float32
    m, v = g * f(1 - 0.9), np.square(g) * f(1 - 0.999)
    u = (m / (f(1) - f(0.9))) / (np.sqrt(v / (f(1) - f(0.999))) + f(1e-7))
    opt = keras.Lamb(0.1)
    p = [jnp.zeros(3, jnp.float32), jnp.full((2,), 3.0, jnp.float32)]
    p, _ = opt.update([jnp.asarray(g), jnp.zeros(2, jnp.float32)], p, opt.init(p))
    np.testing.assert_array_equal(np.asarray(p[0]), f(0) - f(1) * f(0.1) * u)
    np.testing.assert_array_equal(np.asarray(p[1]), [3.0, 3.0])


@pytest.mark.parametrize("make", [lambda: keras.Lamb(0.1), lambda: keras.Muon(0.1), lambda: keras.Adafactor(0.1)])
def test_steps_compile_once_and_fused_is_refused(make, compiles, keras_readback):
    opt = make()
    name = type(opt).__name__
    params = [varstate.Variable(INPUTS[f"init/{n}"], name=n) for n in NAMES]
    with pytest.raises(ValueError, match=rf"{name}.init: fused=True \(or a fused state\) packs many params into one "
                                         rf"buffer, but {name}'s step reduces over each whole variable .* pass "
                                         "fused=False"):
        opt.init(params, fused=True)
    state = opt.init(params)
    params, state = opt.apply_gradients(keras_readback.ours_gradients(INPUTS, 0), params, state)
    compiled = compiles("_flat_step")
    for step in range(1, 3):  # new gradient values and a new iteration: traced, not baked in
        params, state = opt.apply_gradients(keras_readback.ours_gradients(INPUTS, step), params, state)
    assert compiles("_flat_step") == compiled and state.non_slot("iteration").value.item() == 3


# --- Muon: keras/src/optimizers/muon_test.py's setups and tolerances, and its variable rules -------------------
def test_muon_kerass_golden_values():
    from varstate.optimizers.keras._muon import _MatrixPart

    ns = _MatrixPart()._newton_schulz(jnp.array([[0.2499, 0.9105], [0.2655, 0.8824]]))
    np.testing.assert_allclose(np.asarray(ns), [[-0.4422, 0.6457], [0.7285, 0.2968]], rtol=1e-3, atol=1e-3)
    # update_step at learning rate 0.5, without weight decay (Keras calls update_step directly)
    opt, q = keras.Muon(0.5, adam_weight_decay=None), [jnp.array([1.0, 2.0, 3.0, 4.0])]
    p, _ = opt.update([jnp.array([1.0, 6.0, 7.0, 2.0])], q, opt.init(q))
    np.testing.assert_allclose(np.asarray(p[0]), [0.5, 1.5, 2.5, 3.5], rtol=1e-4, atol=1e-4)
    opt, q = keras.Muon(0.5, weight_decay=0.0), [jnp.array([[1.0, 2.0], [3.0, 4.0]])]
    p, state = opt.update([jnp.array([[1.0, 6.0], [7.0, 2.0]])], q, opt.init(q))
    np.testing.assert_allclose(np.asarray(p[0]), [[0.988775, 1.887053], [2.873428, 3.97035]], rtol=1e-2, atol=1e-2)
    assert state.slots["velocity"][0] is None


def test_muon_weight_decays_as_keras():
    # a zero gradient: Muon's and AdamW's steps are 0, what is left is each one's own decay, var -= var * wd * lr
    f = np.float32
    w2, w0 = np.array([[1.0, 2.0], [3.0, 4.0]], f), np.array(2.0, f)
    opt = keras.Muon(1.0, weight_decay=0.01, adam_weight_decay=0.03)
    p, _ = opt.update([jnp.zeros((2, 2)), jnp.zeros(())], [jnp.asarray(w2), jnp.asarray(w0)],
                      opt.init([jnp.asarray(w2), jnp.asarray(w0)]))
    np.testing.assert_array_equal(np.asarray(p[0]), w2 - w2 * f(0.01) * f(1.0))
    np.testing.assert_array_equal(np.asarray(p[1]), w0 - w0 * f(0.03) * f(1.0))


def test_muon_chooses_adamw_by_kerass_rules():
    def var(name, shape):
        return varstate.Variable(jnp.zeros(shape), name=name)

    default, excluding = keras.Muon(), keras.Muon(exclude_layers=["variable", "^out/"], exclude_embeddings=False)
    cases = [  # (name, shape, default's choice, excluding's choice)
        ("dense/kernel", (2, 2), False, False), ("dense/bias", (2,), True, True),
        ("conv/kernel", (3, 3, 2, 2), True, True),
        ("embedding/embeddings", (4, 2), True, False), ("My_Embedding/w", (4, 2), True, False),
        ("variable", (2, 2), False, True), ("out/kernel", (2, 1), False, True),
        ("dense_out/kernel", (2, 1), False, False),
    ]
    for name, shape, want_default, want_excluding in cases:
        assert default.uses_adamw(var(name, shape)) is want_default, name
        assert excluding.uses_adamw(var(name, shape)) is want_excluding, name
    assert not default.uses_adamw(jnp.zeros((2, 2))) and default.uses_adamw(jnp.zeros(2))  # arrays: no name


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
def test_muon_slots_sparse_steps_and_dtypes(dtype):
    opt = keras.Muon(0.1, weight_decay=None, adam_weight_decay=None)
    k = varstate.Variable(jnp.ones((4, 2), dtype), name="dense/kernel")
    e = varstate.Variable(jnp.ones((4, 2), dtype), name="embedding/embeddings")
    b = varstate.Variable(jnp.ones(2, dtype), name="dense/bias")
    params, state = [k, e, b], opt.init([k, e, b])
    assert state.get_slot_names() == ["momentum", "velocity"] and state.get_slot(k, "velocity") is None
    for p in params:
        m = state.get_slot(p, "momentum")
        assert m.name == f"{p.name}/momentum" and m.handle.slot_of == p.resource_id
    sparse = IndexedSlices(jnp.full((2, 2), 0.5, dtype), jnp.array([1, 1]), (4, 2))
    for _ in range(2):
        params, state = opt.apply_gradients([sparse, sparse, jnp.ones(2, dtype)], params, state)
    assert [p.dtype for p in params] == [dtype] * 3 and state.non_slot("iteration").value.item() == 2
    assert state.get_slot(params[0], "velocity") is None and state.get_slot(params[1], "velocity").dtype == dtype
    # rows without a gradient stay (AdamW: zero moments; Muon: Newton-Schulz keeps the gradient's row space)
    for p in params[:2]:
        value = np.asarray(p.value, np.float32)
        np.testing.assert_array_equal(value[[0, 2, 3]], 1.0)
        # (AdamW in bfloat16 stands still: beta_2 = 0.999 rounds to 1, so Keras's alpha is 0)
        assert np.all(value[1] < 1.0) or (dtype == jnp.bfloat16 and p is params[1]), p.name


def test_muon_errors():
    with pytest.raises(TypeError, match=r"Muon: exclude_layers must be a list of regular expressions \(str\), "
                                        "got 'out'"):
        keras.Muon(exclude_layers="out")
    with pytest.raises(TypeError, match=r"Muon: rms_rate must be a float or None, got str"):
        keras.Muon(rms_rate="0.2")
    with pytest.raises(TypeError, match=r"Muon: momentum must be a float, got NoneType"):
        keras.Muon(momentum=None)
    with pytest.raises(TypeError, match=r"Muon: ns_steps must be a non-negative int \(Newton-Schulz iterations\), "
                                        "got 2.5"):
        keras.Muon(ns_steps=2.5)
    w = varstate.Variable(jnp.ones((2, 2)), name="dense/kernel")
    opt = keras.Muon()
    with pytest.raises(ValueError, match=r"no gradients provided for any variable"):
        opt.update([None], [w], opt.init([w]))
    with pytest.raises(ValueError, match=r"Muon.update: gradient for 'dense/kernel' \(params\[0\]\) has shape "
                                         r"\(3, 2\), the variable has shape \(2, 2\)"):
        opt.update([jnp.ones((3, 2))], [w], opt.init([w]))
