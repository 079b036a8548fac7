"""Keras files of Adafactor and Muon, both ways: Keras trains and saves, we restore, step and save, Keras continues.

Fixtures: tests/data/keras_optimizers_3/ (make_keras_optimizer_fixtures_3.py). TF checkpoints
(`tf.train.Checkpoint(optimizer=opt)`, keras3/<config>/ckpt) of six variables after 3 steps, and `.weights.h5` of a
compiled Sequential model (Dense 4 -> 3 -> 2, keras3_h5/<config>.weights.h5) after 3 steps; ours/ and ours_h5/ are
what `ours_continue` / `ours_continue_h5` wrote after 2 more steps of ours; readback.npz holds what Keras computed
after reading ours (`assert_consumed`, `model.load_weights`) and taking the last step.

Keras's layouts: Adafactor numbers r, c and velocity for every variable (r and c int32 placeholders below 2-D);
Muon a momentum for every variable and a velocity only for those AdamW steps (`Muon.keras_slots`).

Bounds: reading is exact (every value equals Keras's at that step). Our steps and Keras's continuation from ours are
within the optimizer's op-by-op bound of Keras's uninterrupted run, per element in ulp of the array's largest
element: Adafactor 4 (its means sum in another order than Eigen's), Muon 2 (its Newton-Schulz matmuls); the
int64 iteration and int32 placeholders exactly.
"""

import importlib.util
import json
import os

import jax
import numpy as np
import pytest

import checkpoint
from checkpoint import _storage, keras
from checkpoint.keras import _read
from checkpoint.keras._optimizer import _trainable, h5_values, keras_order

DATA = os.path.join(os.path.dirname(__file__), "..", "..", "data")
_spec = importlib.util.spec_from_file_location("fixtures3", os.path.join(DATA, "make_keras_optimizer_fixtures_3.py"))
FX = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(FX)
with open(os.path.join(FX.OUT, "meta.json")) as _f:
    META = json.load(_f)
STEPS = np.load(os.path.join(FX.OUT, "steps.npz"))
READBACK = np.load(os.path.join(FX.OUT, "readback.npz"))
ULPS = {"Adafactor": 4, "Muon": 2}
PARAMS = [["", "", "float32", list(s)] for s in FX.SHAPES.values()]


def assert_within(got, want, what, ulps):
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape, what
    if want.dtype.kind != "f" or ulps == 0:
        np.testing.assert_array_equal(got, want, err_msg=what)
        return
    assert got.dtype == want.dtype, what
    err = np.abs(got.astype(np.float64) - want).max() / np.spacing(np.abs(want).max())
    assert err <= ulps, f"{what}: {err} ulp of the largest element"


def full_names(path):
    """The names the checkpoint records for the optimizer's _variables/N, in order."""
    g = _read._Graph(_storage.open_reader(path), path)
    listed = g.named(g.named(g.find("optimizer", None))["_variables"])
    return [g.read(listed[str(i)], path)[1] for i in range(len(listed))]


def opt_values(opt, params, state):
    """The optimizer's variables in Keras's order (what `save_weights` writes as optimizer/vars/N)."""
    return h5_values(opt, params, state)[1]


def check(opt, params, state, params_want, opt_want, what, ulps):
    leaves, _, idx = _trainable(params)
    for k, (i, want) in enumerate(zip(idx, params_want, strict=True)):
        assert_within(leaves[i].value, want, f"{what} param {k}", ulps)
    got = opt_values(opt, params, state)
    assert len(got) == len(opt_want), what
    for i, (g, want) in enumerate(zip(got, opt_want, strict=True)):
        assert_within(g, want, f"{what} optimizer variable {i}", ulps)


@pytest.mark.parametrize("config", FX.ROUND_TRIP)
def test_tf_checkpoint_round_trip(config, tmp_path):
    variables = META["configs"][config]["variables"]
    n_first, m, last = META["n_first"], META["m"], META["steps"] - 1
    opt = FX.ours_optimizer(config)
    ulps = ULPS[type(opt).__name__]

    def at(step):
        return (FX.unpack(STEPS[f"{config}/{step}/params"], PARAMS),
                FX.unpack(STEPS[f"{config}/{step}/opt"], variables))

    params, state = keras.load_optimizer_state(os.path.join(FX.OUT, "keras3", config, "ckpt"), opt)
    check(opt, params, state, *at(n_first - 1), "restored", 0)
    # Keras's variable names, in Keras's order: the layout we read by is the one Keras wrote
    names = list(FX.SHAPES)
    assert [v[1] for v in variables] == [n if p is None else names[p] if n in ("r", "c") else f"{names[p]}_{n}"
                                         for n, p in keras_order(opt, params)]
    _, params, state = FX.ours_continue(config, STEPS)
    check(opt, params, state, *at(n_first + m - 1), "ours after M steps", ulps)
    keras.save_optimizer_state(str(tmp_path / "ckpt"), opt, params, state)
    saved = keras.load_optimizer_state(str(tmp_path / "ckpt"), opt)
    committed = keras.load_optimizer_state(os.path.join(FX.OUT, "ours", config, "ckpt"), opt)
    # The committed file holds our jitted steps as run on the machine that wrote it: XLA vectorises Muon's
    # matmuls by the CPU's vector width, so another CPU's steps differ within the same ulps as against Keras's.
    for i, (a, b) in enumerate(zip(jax.tree.leaves(saved), jax.tree.leaves(committed), strict=True)):
        assert_within(a, b, f"saved vs committed leaf {i}", ulps)
    # the object graph Keras wrote (the same _variables/N, _trainable_variables/i), with Keras's variable names
    keys = checkpoint.read_checkpoint(str(tmp_path / "ckpt")).keys()
    assert sorted(keys) == sorted(checkpoint.read_checkpoint(os.path.join(FX.OUT, "keras3", config, "ckpt")).keys())
    assert full_names(str(tmp_path / "ckpt")) == full_names(os.path.join(FX.OUT, "keras3", config, "ckpt"))
    want_params, want_opt = at(last)
    for got, want in zip(FX.unpack(READBACK[f"{config}/params"], PARAMS), want_params, strict=True):
        assert_within(got, want, "Keras resumed from ours", ulps)
    for i, (got, want) in enumerate(zip(FX.unpack(READBACK[f"{config}/opt"], variables), want_opt, strict=True)):
        assert_within(got, want, f"Keras resumed from ours, optimizer variable {i}", ulps)


@pytest.mark.parametrize("config", sorted(FX.H5))
def test_weights_h5_round_trip(config, tmp_path):
    meta = META["configs"][f"h5/{config}"]
    n_first, m, last = META["n_first"], META["m"], META["steps"] - 1
    opt = FX.ours_optimizer(config, FX.H5)
    ulps = ULPS[type(opt).__name__]

    def at(step):
        return (FX.unpack(STEPS[f"h5/{config}/{step}/weights"], meta["weights"]),
                FX.unpack(STEPS[f"h5/{config}/{step}/opt"], meta["variables"]))

    weights, state = keras.load_optimizer_state(os.path.join(FX.OUT, "keras3_h5", f"{config}.weights.h5"), opt)
    check(opt, weights, state, *at(n_first - 1), "restored", 0)
    _, weights, state = FX.ours_continue_h5(config, STEPS, str(tmp_path / "ours.weights.h5"))
    check(opt, weights, state, *at(n_first + m - 1), "ours after M steps", ulps)
    # what we write now is the file Keras resumed from
    with open(tmp_path / "ours.weights.h5", "rb") as a, \
            open(os.path.join(FX.OUT, "ours_h5", f"{config}.weights.h5"), "rb") as b:
        assert a.read() == b.read()
    want_weights, want_opt = at(last)
    for got, want in zip(FX.unpack(READBACK[f"h5/{config}/weights"], meta["weights"]), want_weights, strict=True):
        assert_within(got, want, "Keras resumed from ours", ulps)
    for i, (got, want) in enumerate(zip(FX.unpack(READBACK[f"h5/{config}/opt"], meta["variables"]), want_opt,
                                        strict=True)):
        assert_within(got, want, f"Keras resumed from ours, optimizer variable {i}", ulps)


def test_a_layout_that_does_not_fit_is_refused():
    # Muon's h5 read as Adafactor's: 2 + 3 per variable is not Muon's 2 + momentum per variable + velocity per bias
    from varstate.optimizers import keras as keras_opt

    with pytest.raises(ValueError, match=r"muon.weights.h5: optimizer/vars holds 8 variables, but Adafactor with "
                                         r"these settings on 4 trainable variables has 14 \(iteration, "
                                         r"learning_rate, r\[0\], c\[0\], velocity\[0\], r\[1\], c\[1\], "
                                         r"velocity\[1\], r\[2\], c\[2\], \.\.\.\)"):
        keras.load_optimizer_state(os.path.join(FX.OUT, "keras3_h5", "muon.weights.h5"), keras_opt.Adafactor(0.01))
    with pytest.raises(ValueError, match=r"adafactor.weights.h5: optimizer/vars holds 14 variables, but Muon with "
                                         r"these settings on 4 trainable variables has 8 \(iteration, learning_rate, "
                                         r"momentum\[0\], momentum\[1\], velocity\[1\], momentum\[2\]"):
        keras.load_optimizer_state(os.path.join(FX.OUT, "keras3_h5", "adafactor.weights.h5"), keras_opt.Muon(0.01))
