"""TF v1's Adadelta, AdagradDA, Ftrl, ProximalAdagrad and ProximalGradientDescent against TF's own numbers.

Fixtures: tests/data/make_tf_v1_family_fixtures.py (TF 2.21 on CPU). Tolerance policy, as for the other
optimizers: op by op (no jit) every jnp op rounds once, as each Eigen expression in TF's kernels does, so
results are compared bit for bit; under jit XLA fuses a*b+c into one rounding (and a division by a scalar
into a multiplication by its reciprocal), so they are compared to a few ulps (rtol 1e-6, atol 1e-7 of the
array's scale).
"""

import contextlib
import doctest
import importlib
import logging
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import checkpoint
import varstate
from varstate import IndexedSlices, Variable

# Until varstate.optimizers exports them, the classes come from their modules.
from varstate.optimizers._adadelta import Adadelta
from varstate.optimizers._adagrad_da import AdagradDA
from varstate.optimizers._ftrl import Ftrl
from varstate.optimizers._proximal_adagrad import ProximalAdagrad
from varstate.optimizers._proximal_gradient_descent import ProximalGradientDescent
from varstate.optimizers._proximal_math import _div_one_plus

DATA = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "data")  # tests/data
FIXTURES = np.load(os.path.join(DATA, "tf_v1_family_fixtures.npz"))
NAMES = ("w", "b", "emb", "vec")  # w, b dense; emb (2-D) and vec (1-D) get IndexedSlices with a repeated index

# The optimizers of make_tf_v1_family_fixtures.py, argument for argument; a case ending in _f64 runs its
# namesake in float64.
CASES = {
    "adadelta": lambda: Adadelta(),
    "adadelta_lr": lambda: Adadelta(1.0, rho=0.9, epsilon=1e-6),
    "adagrad_da": lambda: AdagradDA(0.1),
    "adagrad_da_l1": lambda: AdagradDA(0.1, l1_regularization_strength=0.5),
    "adagrad_da_l2": lambda: AdagradDA(
        0.1, initial_gradient_squared_accumulator_value=0.5, l2_regularization_strength=0.3),
    "adagrad_da_l1_l2": lambda: AdagradDA(0.2, l1_regularization_strength=0.3, l2_regularization_strength=0.2),
    "ftrl": lambda: Ftrl(0.1),
    "ftrl_l1": lambda: Ftrl(0.1, l1_regularization_strength=2.0),
    "ftrl_l2": lambda: Ftrl(0.1, initial_accumulator_value=0.5, l2_regularization_strength=0.3),
    "ftrl_zero_accum": lambda: Ftrl(0.2, initial_accumulator_value=0.0),
    "ftrl_shrinkage": lambda: Ftrl(
        0.1, l1_regularization_strength=0.5, l2_regularization_strength=0.2, l2_shrinkage_regularization_strength=0.3),
    "ftrl_power": lambda: Ftrl(0.1, learning_rate_power=-0.7, l1_regularization_strength=0.5),
    "ftrl_power_zero": lambda: Ftrl(0.3, learning_rate_power=0.0),
    "ftrl_power_shrinkage": lambda: Ftrl(0.1, learning_rate_power=-0.6, l2_shrinkage_regularization_strength=0.2),
    "ftrl_beta": lambda: Ftrl(0.1, l2_regularization_strength=0.1, beta=0.4),
    "proximal_adagrad": lambda: ProximalAdagrad(0.1),
    "proximal_adagrad_l1": lambda: ProximalAdagrad(0.1, l1_regularization_strength=2.0),
    "proximal_adagrad_l2": lambda: ProximalAdagrad(0.1, initial_accumulator_value=0.3, l2_regularization_strength=0.5),
    "proximal_adagrad_l1_l2": lambda: ProximalAdagrad(
        0.3, l1_regularization_strength=1.0, l2_regularization_strength=0.5),
    "proximal_gd": lambda: ProximalGradientDescent(0.1),
    "proximal_gd_l1": lambda: ProximalGradientDescent(0.1, l1_regularization_strength=2.0),
    "proximal_gd_l2": lambda: ProximalGradientDescent(0.1, l2_regularization_strength=0.5),
    "proximal_gd_l1_l2": lambda: ProximalGradientDescent(
        0.2, l1_regularization_strength=1.0, l2_regularization_strength=0.5),
    "proximal_gd_negative_l1": lambda: ProximalGradientDescent(0.1, l1_regularization_strength=-0.5),
}
ALL_CASES = sorted({*CASES, *(k.removesuffix("/dtype") for k in FIXTURES.files if k.endswith("_f64/dtype"))})
ONE_PER_CLASS = ["adadelta_lr", "adagrad_da_l1_l2", "ftrl_shrinkage", "proximal_adagrad_l1_l2", "proximal_gd_l1_l2"]


def _opt(case):
    return CASES[case.removesuffix("_f64")]()


def _dtype(case):
    return jnp.dtype(str(FIXTURES[f"{case}/dtype"]))


def _precision(case):
    """float64 cases run with jax_enable_x64 (JAX has no float64 without it)."""
    return jax.enable_x64(True) if _dtype(case) == jnp.float64 else contextlib.nullcontext()


def _is_var(x):
    return isinstance(x, Variable)


def assert_tf_close(got, want, what, atol=1e-7):
    want = np.asarray(want)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-6, atol=atol * np.abs(want).max(), err_msg=what)


def _jit_atol(opt):
    # FTRL's var is (l1 - |linear|) / y, and linear moved by (sqrt(new_accum) - sqrt(accum)) / lr * var: two
    # near-cancellations that magnify the ulp an FMA moves new_accum = accum + g * g by. Seen: 1.6e-7 (relative
    # 8e-6) on ftrl_shrinkage's emb[3, 1] at step 2, where |linear| = 0.57 is near l1 = 0.5.
    return 1e-6 if isinstance(opt, Ftrl) else 1e-7


def assert_same_bits(got, want, what):
    # Bit patterns, so that -0.0 and +0.0 differ (TF's L1 shrinkage stores -0.0 for shrunk negatives).
    got, want = np.asarray(got), np.asarray(want)
    assert got.dtype == want.dtype, what
    uint = np.dtype(f"uint{8 * want.dtype.itemsize}")
    bad = np.flatnonzero(got.view(uint) != want.view(uint))
    bad = bad[:8]
    assert bad.size == 0, f"{what}: elements {bad.tolist()}... differ: {got.ravel()[bad]} vs TF's {want.ravel()[bad]}"


def _params(case, zeros=False):
    dtype = _dtype(case)
    make = np.zeros_like if zeros else np.asarray
    return {k: Variable(jnp.asarray(make(FIXTURES[f"init/{k}"])).astype(dtype), name=k) for k in NAMES}


def _grads(step, dtype):
    grads = {}
    for k in NAMES:
        if f"grad/{step}/{k}" in FIXTURES:
            grads[k] = jnp.asarray(FIXTURES[f"grad/{step}/{k}"]).astype(dtype)
        else:
            values = jnp.asarray(FIXTURES[f"grad/{step}/{k}/values"]).astype(dtype)
            indices = jnp.asarray(FIXTURES[f"grad/{step}/{k}/indices"])
            grads[k] = IndexedSlices(values, indices, FIXTURES[f"init/{k}"].shape)
    return grads


def _values(params, state, k):
    """{name: array} of param `k` and each of its slots (``var`` for the variable itself)."""
    out = {"var": params[k].value}
    out.update({n: state.get_slot(params[k], n).value for n in state.get_slot_names()})
    return out


def _want(case, step, k, name):
    return FIXTURES[f"{case}/{step}/{k}" + ("" if name == "var" else f"/{name}")]


# Every step passes step=: the global step before the update (TF's apply_gradients(global_step=) adds one
# after it). AdagradDA needs it; the others ignore it (their hyperparameters are floats).
# --- TF numerics ------------------------------------------------------------------------------------
@pytest.mark.parametrize("case", ALL_CASES)
def test_matches_tf_v1_dense_and_sparse_under_jit(case):
    with _precision(case):
        opt = _opt(case)
        params = _params(case)
        state = opt.init(params)
        assert state.get_slot_names() == FIXTURES[f"{case}/slot_names"].tolist()
        assert not state.non_slots  # TF's v1 family keeps no non-slot variables (AdagradDA's step is the caller's)
        for step in (1, 2, 3):
            params, state = opt.apply_gradients(_grads(step, _dtype(case)), params, state, step=step - 1)
            for k in NAMES:
                for name, got in _values(params, state, k).items():
                    assert got.dtype == _dtype(case)
                    assert_tf_close(got, _want(case, step, k, name), f"{case} step {step} {k} {name}", _jit_atol(opt))


def _vectorized_transcendental(opt):
    """What TF's dense kernel computes with Eigen's vectorized (CPU-dependent) approximation, if anything.

    Adadelta and ProximalAdagrad say rsqrt: on a packet Eigen refines a hardware estimate, on the elements
    after the last whole packet it divides 1 by sqrt, which is what we do everywhere. FTRL's general power
    is pow: Eigen's vectorized pow on packets, the C library's on the rest, which XLA's pow matches.
    """
    if isinstance(opt, Adadelta | ProximalAdagrad):
        return "rsqrt"
    if isinstance(opt, Ftrl) and np.float32(opt.learning_rate_power) not in (np.float32(-0.5), np.float32(0)):
        return "pow"
    return None


@pytest.mark.parametrize("case", ALL_CASES)
def test_op_by_op_the_arithmetic_is_tfs_bit_for_bit(case):
    # Sparse kernels, dense kernels without rsqrt/pow, and float32 rows of one element (where TF computes in
    # double and we in float32 pairs) match bit for bit. In a dense kernel that vectorizes rsqrt or pow, TF's
    # whole AVX packets (8 floats, 4 doubles: the first 8 of w's 15 floats, the first 12 of its doubles) use
    # Eigen's approximations: up to 4 ulps apart in the function, 125 ulps (1.5e-8) on one ProximalAdagrad
    # element where the update nearly cancels. There we hold to the jit tolerance; the elements after the
    # last packet are still bit for bit.
    with _precision(case):
        opt = _opt(case)
        vectorized = _vectorized_transcendental(opt)
        params = _params(case)
        state = opt.init(params)
        with jax.disable_jit():
            for step in (1, 2, 3):
                params, state = opt.update(_grads(step, _dtype(case)), params, state, step=step - 1)
                for k in NAMES:
                    for name, got in _values(params, state, k).items():
                        want, what = _want(case, step, k, name), f"{case} step {step} {k} {name}"
                        if vectorized and k in ("w", "b"):
                            packet = 32 // want.dtype.itemsize
                            whole = want.size // packet * packet
                            assert_tf_close(got, want, what)
                            assert_same_bits(np.asarray(got).ravel()[whole:], want.ravel()[whole:], what)
                        else:
                            assert_same_bits(got, want, what)


@pytest.mark.parametrize("case", ALL_CASES)
def test_variables_are_exactly_those_of_a_tf_checkpoint(case):
    with _precision(case):
        params = _params(case)
        state = _opt(case).init(params)
    ours = set()
    for slot_name, tree in state.slots.items():
        for slot in jax.tree.leaves(tree, is_leaf=_is_var):
            key, primary = next((k, p) for k, p in params.items() if p.resource_id == slot.handle.slot_of)
            assert slot.name == f"{primary.name}/{slot_name}" and slot.handle.slot_name == slot_name
            assert not slot.trainable and slot.dtype == primary.dtype
            ours.add(f"model/{key}/.OPTIMIZER_SLOT/optimizer/{slot_name}/.ATTRIBUTES/VARIABLE_VALUE")
    assert ours == set(FIXTURES[f"{case}/checkpoint_keys"].tolist())


@pytest.mark.parametrize("case", ONE_PER_CLASS)
def test_a_tf_format_checkpoint_has_tf_keys_and_training_continues_after_restore(case, tmp_path):
    opt = _opt(case)
    params = _params(case)
    state = opt.init(params)
    for step in (1, 2):
        params, state = opt.apply_gradients(_grads(step, jnp.float32), params, state, step=step - 1)
    path = checkpoint.Checkpoint(model=params, optimizer=state).write(str(tmp_path / "ckpt"), format="tf")
    keys = {k for k in checkpoint.read_checkpoint(path).keys() if "optimizer" in k.split("/.ATTRIBUTES")[0]}
    assert keys == set(FIXTURES[f"{case}/checkpoint_keys"].tolist())
    template = _params(case, zeros=True)
    status = checkpoint.Checkpoint(model=template, optimizer=opt.init(template)).restore(path)
    status.assert_consumed()
    params, state = opt.apply_gradients(_grads(3, jnp.float32), status.model, status.optimizer, step=2)
    for k in NAMES:
        for name, got in _values(params, state, k).items():
            assert_tf_close(got, _want(case, 3, k, name), f"{case} step 3 after restore {k} {name}", _jit_atol(opt))


# --- sparse gradients, compiling ----------------------------------------------------------------------
@pytest.mark.parametrize("case", ONE_PER_CLASS)
def test_duplicate_indices_are_summed_before_the_update(case):
    # TF's apply_gradients sums an IndexedSlices' repeated rows before its kernel sees them: row 4 twice
    # is row 4 once with the sum (exact here), in the row loop (emb) and in the one-element loop (vec).
    opt = _opt(case)

    def step(emb_grad, vec_grad):
        params = [Variable(jnp.asarray(FIXTURES[f"init/{k}"]), name=k) for k in ("emb", "vec")]
        params, state = opt.apply_gradients([emb_grad, vec_grad], params, opt.init(params), step=4)
        return [np.asarray(x) for x in (*(p.value for p in params), *jax.tree.leaves(state.slots))]

    rows = jnp.arange(1.0, 10.0).reshape(3, 3)
    repeated = step(IndexedSlices(rows, jnp.array([4, 1, 4]), (6, 3)),
                    IndexedSlices(rows[:, 0], jnp.array([4, 1, 4]), (6,)))
    summed = step(IndexedSlices(jnp.stack([rows[0] + rows[2], rows[1]]), jnp.array([4, 1]), (6, 3)),
                  IndexedSlices(jnp.array([8.0, 4.0]), jnp.array([4, 1]), (6,)))
    for got, want in zip(repeated, summed, strict=True):
        assert_same_bits(got, want, case)


@pytest.mark.parametrize("case", ONE_PER_CLASS)
def test_no_recompile_after_the_first_step_and_donation_honoured(case, caplog):
    # The global step is a traced argument: a new step value reuses the executable.
    opt = _opt(case)
    params = {"w": Variable(jnp.ones((3, 2)), name="w"), "emb": Variable(jnp.ones((5, 2)), name="emb"),
              "vec": Variable(jnp.ones(5), name="vec")}
    state = opt.init(params)
    grads = {"w": jnp.ones((3, 2)), "emb": IndexedSlices(jnp.ones((3, 2)), jnp.array([0, 4, 0]), (5, 2)),
             "vec": IndexedSlices(jnp.ones(2), jnp.array([1, 1]), (5,))}
    old = [params["w"].value, *(s.value for s in jax.tree.leaves(state.slots, is_leaf=_is_var))]
    params, state = opt.apply_gradients(grads, params, state, step=jnp.int32(0))
    assert all(x.is_deleted() for x in old)
    with caplog.at_level(logging.WARNING, logger="jax"), jax.log_compiles(True):
        for step in (1, 2, 3):
            params, state = opt.apply_gradients(grads, params, state, step=jnp.int32(step))
    assert not [r.getMessage() for r in caplog.records if r.getMessage().startswith("Compiling")]


def _tf_double(f):
    """f's float64 result stored as float32, as TF's scalar loops store theirs."""
    return np.asarray(f, np.float64).astype(np.float32)


@pytest.mark.parametrize("jit", [True, False])
def test_float32_pairs_round_like_tfs_double(jit):
    # Rows of one element: TF divides by 1.0 + l2 * lr in double (Proximal*), and computes all of AdagradDA's
    # update in double but sqrt (a float: std::sqrt of a float). Random inputs, against numpy's float64.
    rng = np.random.default_rng(7)
    n = 20_000
    x = (rng.standard_normal(n) * np.exp(rng.uniform(-5, 5, n))).astype(np.float32)
    c = np.exp(rng.uniform(-12, 2, n)).astype(np.float32)
    ga0 = (3 * rng.standard_normal(n)).astype(np.float32)
    gg0 = (5 * np.abs(rng.standard_normal(n)) + 0.1).astype(np.float32)
    g = rng.standard_normal(n).astype(np.float32)
    run = jax.jit if jit else (lambda f: f)
    with contextlib.nullcontext() if jit else jax.disable_jit():
        f64 = np.float64
        assert_same_bits(run(_div_one_plus)(x, c), _tf_double(f64(x) / (1.0 + f64(c))), "x / (1 + c)")
        ga = _tf_double(f64(ga0) + g)
        gg = _tf_double(f64(gg0) + f64(g) * g)
        for l1, l2, step in [(0.0, 0.0, 0), (0.5, 0.0, 6), (0.3, 0.2, 2), (0.0, 0.7, 123455)]:
            opt = AdagradDA(0.1, l1_regularization_strength=l1, l2_regularization_strength=l2)
            lr, l1, l2, t = (np.float32(v) for v in (0.1, l1, l2, step + 1))
            denom = f64(t) * f64(l2) * f64(lr) + f64(np.sqrt(gg))
            if l1 > 0:
                shrunk = np.maximum(np.abs(f64(ga)) - f64(t) * f64(l1), 0)
                want = _tf_double(np.sign(-f64(ga)) * f64(lr) * shrunk / denom)
            else:
                want = _tf_double(-f64(ga) * f64(lr) / denom)
            got = run(opt._float32_scalar_rows)(lr, l1, l2, t, g, ga0, gg0)
            for name, a, b in zip(("var", "ga", "gg"), got, (want, ga, gg), strict=True):
                assert_same_bits(a, b, f"AdagradDA l1={l1} l2={l2} step={step} {name}")


@pytest.mark.parametrize("case", ONE_PER_CLASS)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_sixteen_bit_variables_keep_their_dtype_in_every_kernel(case, dtype):
    # TF has no 16-bit kernels for most of these; ours compute in the variable's dtype (the float32-pair
    # arithmetic is for float32 only), dense, sparse rows and rows of one element alike.
    opt = _opt(case)
    params = {k: Variable(jnp.asarray(FIXTURES[f"init/{k}"]).astype(dtype), name=k) for k in NAMES}
    state = opt.init(params)
    for step in (1, 2):
        params, state = opt.apply_gradients(_grads(step, dtype), params, state, step=step - 1)
    for k in NAMES:
        for name, got in _values(params, state, k).items():
            assert got.dtype == dtype and np.all(np.isfinite(np.asarray(got, np.float32))), (k, name)


# --- AdagradDA's global step ----------------------------------------------------------------------------
def test_adagrad_da_reads_the_global_step_from_a_variable_and_tf_gets_step_plus_one():
    case = "adagrad_da_l1_l2"
    opt = _opt(case)
    params = _params(case)
    state = opt.init(params)
    for step in (1, 2, 3):
        global_step = Variable(jnp.int32(step - 1), name="global_step", trainable=False)
        params, state = opt.apply_gradients(_grads(step, jnp.float32), params, state, step=global_step)
    assert_tf_close(params["w"].value, FIXTURES[f"{case}/3/w"], "step from a Variable")
    # One step later is another result: the step is not ignored.
    fresh = _params(case)
    other, _ = opt.apply_gradients(_grads(1, jnp.float32), fresh, opt.init(fresh), step=1)
    assert not np.allclose(np.asarray(other["w"].value), FIXTURES[f"{case}/1/w"])


def test_adagrad_da_needs_an_integer_step_and_takes_none_in_its_constructor():
    w = Variable(jnp.ones(2), name="w")
    opt = AdagradDA(0.1)
    with pytest.raises(TypeError, match=re.escape(
            "AdagradDA needs the global step: pass step= to apply_gradients/update (the global step before this "
            "update, e.g. step=global_step; TF's kernel gets step + 1).")):
        opt.apply_gradients([jnp.ones(2)], [w], opt.init([w]))
    with pytest.raises(TypeError, match=re.escape(
            "AdagradDA: step= is the global step: global_step must have an integer dtype, got float32.")):
        opt.apply_gradients([jnp.ones(2)], [w], opt.init([w]), step=jnp.float32(3))
    with pytest.raises(TypeError, match=re.escape(
            "AdagradDA: step= is the global step: global_step must be a scalar, got shape (2,).")):
        opt.apply_gradients([jnp.ones(2)], [w], opt.init([w]), step=jnp.array([1, 2]))
    with pytest.raises(TypeError, match=re.escape(
            "AdagradDA takes the global step with each update, not in the constructor: pass step=global_step to "
            "apply_gradients/update (a jitted step cannot read a Variable kept in the optimizer's static config).")):
        AdagradDA(0.1, varstate.get_or_create_global_step())


# --- argument checks ------------------------------------------------------------------------------------
# TF's error (fixture error/<name>) and ours: TF raises ValueError in a constructor, InvalidArgumentError in a
# kernel; ours are ValueErrors at construction, whose text is our own.
ERRORS = {
    "ftrl_initial_accumulator_value": (
        lambda: Ftrl(0.1, initial_accumulator_value=-0.1),
        "Ftrl: initial_accumulator_value must be positive or zero, got -0.1."),
    "ftrl_learning_rate_power": (
        lambda: Ftrl(0.1, learning_rate_power=0.5), "Ftrl: learning_rate_power must be negative or zero, got 0.5."),
    "ftrl_l1": (
        lambda: Ftrl(0.1, l1_regularization_strength=-1.0),
        "Ftrl: l1_regularization_strength must be positive or zero, got -1.0."),
    "ftrl_l2": (
        lambda: Ftrl(0.1, l2_regularization_strength=-1.0),
        "Ftrl: l2_regularization_strength must be positive or zero, got -1.0."),
    "ftrl_l2_shrinkage": (
        lambda: Ftrl(0.1, l2_shrinkage_regularization_strength=-1.0),
        "Ftrl: l2_shrinkage_regularization_strength must be positive or zero, got -1.0."),
    "ftrl_learning_rate_sparse": (lambda: Ftrl(0.0), "Ftrl: learning_rate must be positive, got 0.0."),
    "proximal_adagrad_initial_accumulator_value": (
        lambda: ProximalAdagrad(0.1, initial_accumulator_value=0.0),
        "ProximalAdagrad: initial_accumulator_value must be positive, got 0.0."),
    "proximal_adagrad_learning_rate": (
        lambda: ProximalAdagrad(0.0), "ProximalAdagrad: learning_rate must be positive, got 0.0."),
    "proximal_adagrad_l1": (
        lambda: ProximalAdagrad(0.1, l1_regularization_strength=-1.0),
        "ProximalAdagrad: l1_regularization_strength must be non-negative, got -1.0."),
    "proximal_adagrad_l2": (
        lambda: ProximalAdagrad(0.1, l2_regularization_strength=-1.0),
        "ProximalAdagrad: l2_regularization_strength must be non-negative, got -1.0."),
    "adagrad_da_initial_gradient_squared_accumulator_value": (
        lambda: AdagradDA(0.1, initial_gradient_squared_accumulator_value=0.0),
        "AdagradDA: initial_gradient_squared_accumulator_value must be positive, got 0.0."),
}


KERNEL_CHECKED = {"ftrl_learning_rate_sparse", "proximal_adagrad_learning_rate", "proximal_adagrad_l1",
                  "proximal_adagrad_l2"}  # TF checks these when its (sparse, for FTRL) kernel runs


@pytest.mark.parametrize("name", sorted(ERRORS))
def test_arguments_tf_refuses_are_refused_with_a_value_error(name):
    assert str(FIXTURES[f"error/{name}/type"]) == ("InvalidArgumentError" if name in KERNEL_CHECKED else "ValueError")
    make, message = ERRORS[name]
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        make()


def test_tf_takes_any_proximal_gradient_descent_strength_and_so_do_we():
    # TF checks none: a negative l1 fails `l1 > 0` and is ignored (case proximal_gd_negative_l1 matches TF).
    assert ProximalGradientDescent(0.1, l1_regularization_strength=-0.5).l1_regularization_strength == -0.5
    np.testing.assert_array_equal(FIXTURES["proximal_gd_negative_l1/3/w"], FIXTURES["proximal_gd/3/w"])


def test_a_callable_learning_rate_is_not_checked_and_is_called_with_the_step():
    # Only a float can be checked at construction; a callable gets the step, as for the other optimizers.
    # Op by op: under jit a float rate is a constant XLA folds into the arithmetic, a callable's is not.
    def step(opt, step):
        params = _params("ftrl")
        with jax.disable_jit():
            params, state = opt.update(_grads(1, jnp.float32), params, opt.init(params), step=step)
        return [np.asarray(x) for x in (*(p.value for p in params.values()), *jax.tree.leaves(state.slots))]

    for cls in (Ftrl, ProximalAdagrad, ProximalGradientDescent, AdagradDA, Adadelta):
        scheduled = cls(lambda step: 0.1 * (step + 1))
        for got, want in zip(step(scheduled, 1), step(cls(0.2), 1), strict=True):
            assert_same_bits(got, want, cls.__name__)
    scheduled = Adadelta(1.0, rho=lambda step: 0.9, epsilon=lambda step: 1e-6)
    for got, want in zip(step(scheduled, 0), step(Adadelta(1.0, rho=0.9, epsilon=1e-6), 0), strict=True):
        assert_same_bits(got, want, "Adadelta")


@pytest.mark.parametrize(("make", "message"), [
    (lambda: Ftrl(0.1, l1_regularization_strength=lambda step: 0.1),
     "Ftrl: l1_regularization_strength must be a float, got function"),
    (lambda: Ftrl(0.1, learning_rate_power="-0.5"), "Ftrl: learning_rate_power must be a float, got str '-0.5'."),
    (lambda: ProximalGradientDescent(0.1, l2_regularization_strength=jnp.ones(2)),
     "ProximalGradientDescent: l2_regularization_strength must be a float, got ArrayImpl"),
    (lambda: AdagradDA(0.1, l1_regularization_strength=None),
     "AdagradDA: l1_regularization_strength must be a float, got NoneType None."),
    (lambda: Adadelta("fast"), "Adadelta: learning_rate must be a float or a callable of the step, got str 'fast'."),
])
def test_options_that_pick_code_paths_must_be_floats(make, message):
    # l1/l2, FTRL's power and the initial values choose branches or fill slots: floats, not callables.
    with pytest.raises(TypeError, match=f"^{re.escape(message)}"):
        make()


def test_ftrl_takes_tfs_first_five_arguments_by_position_and_the_rest_by_keyword():
    # TF's sixth positional argument is use_locking: a value there must not become a shrinkage strength.
    assert Ftrl(0.1, -0.6, 0.2, 0.3, 0.4) == Ftrl(
        learning_rate=0.1, learning_rate_power=-0.6, initial_accumulator_value=0.2,
        l1_regularization_strength=0.3, l2_regularization_strength=0.4)
    with pytest.raises(TypeError, match=r"takes from 2 to 6 positional arguments but 7 were given"):
        Ftrl(0.1, -0.5, 0.1, 0.0, 0.0, 0.3)
    assert Ftrl(0.1) == Ftrl(0.1, beta=0.0) and hash(Ftrl(0.1)) == hash(Ftrl(0.1, beta=0.0))


# --- docs ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("module", ["_adadelta", "_adagrad_da", "_ftrl", "_proximal_adagrad",
                                    "_proximal_gradient_descent"])
def test_docstring_examples(module, monkeypatch):
    # The examples import from varstate.optimizers; until its __init__ exports the classes, put them there.
    for cls in (Adadelta, AdagradDA, Ftrl, ProximalAdagrad, ProximalGradientDescent):
        monkeypatch.setattr(varstate.optimizers, cls.__name__, cls, raising=False)
    monkeypatch.setattr(varstate.Registry, "_default", varstate.Registry())
    mod = importlib.import_module(f"varstate.optimizers.{module}")
    result = doctest.testmod(mod, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE, verbose=False)
    assert result.attempted and result.failed == 0
