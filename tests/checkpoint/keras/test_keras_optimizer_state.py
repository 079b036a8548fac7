"""Keras 3 optimizer checkpoints: read Keras's, continue in varstate, write ours, Keras continues.

Fixtures (tests/data/keras_optimizers/): keras3/<config>/ckpt, written by Keras after N steps; ours/<config>/ckpt,
written by `save_optimizer_state` after varstate's M steps (keras_roundtrip_readback.py ours); readback.npz,
what Keras held after reading ours and taking K more steps (keras_roundtrip_readback.py keras); steps.npz,
Keras's uninterrupted N+M+K steps.
"""

import json
import os

import jax.numpy as jnp
import numpy as np
import pytest

import checkpoint
import varstate
from checkpoint import keras
from varstate.optimizers import keras as keras_opt

DATA = os.path.join(os.path.dirname(__file__), "..", "..", "data", "keras_optimizers")
with open(os.path.join(DATA, "meta.json")) as _f:
    META = json.load(_f)
STEPS = np.load(os.path.join(DATA, "steps.npz"))
READBACK = np.load(os.path.join(DATA, "readback.npz"))
NAMES = ("kernel", "bias", "emb")
CONFIGS = sorted(META["configs"])


def _order(opt, n=3):
    lead, groups, trail = opt.keras_layout()
    order = [(x, None) for x in lead]
    for group in groups:
        for i in range(n):
            order += [(s, i) for s in group]
    return order + [(x, None) for x in trail]


def _same(got, want, config, what=""):
    """Bit for bit; Ftrl within a few ulp of the largest element (Keras uses Eigen's pow, not correctly rounded)."""
    if config.startswith("ftrl") and want.dtype.kind == "f":
        # an element within 8 ulp of the array's largest magnitude (more ulp of itself where it nearly cancels)
        assert np.abs(got.astype(np.float64) - want).max() <= 8 * np.spacing(np.abs(want).max()), what
    else:
        np.testing.assert_array_equal(got, want, err_msg=what)


def _assert_state(opt, params, state, step, config):
    for name, p in zip(NAMES, params, strict=True):
        _same(np.asarray(p.value), STEPS[f"{config}/{step}/param/{name}"], config, name)
    for i, (name, p) in enumerate(_order(opt)):
        v = state.non_slots[name] if p is None else state.slots[name][p]
        _same(np.asarray(v.value), STEPS[f"{config}/{step}/opt/{i}"], config, f"{i} {name}")


@pytest.mark.parametrize("config", CONFIGS)
def test_reads_keras3_checkpoint(config, keras_readback):
    opt = keras_readback.ours_optimizer(config, META)
    params, state = keras.load_optimizer_state(os.path.join(DATA, "keras3", config, "ckpt"), opt)
    assert [p.name for p in params] == list(NAMES)
    _assert_state(opt, params, state, META["n_first"] - 1, config)
    assert state.non_slot("iteration").value.item() == META["n_first"]


@pytest.mark.parametrize("config", CONFIGS)
def test_round_trip_equals_keras_alone(config, tmp_path, keras_readback):
    # Keras N steps -> varstate M steps (op by op) -> Keras K steps == Keras N+M+K steps, bit for bit.
    params, state = keras_readback.ours_continue(config, STEPS, META, str(tmp_path))
    opt = keras_readback.ours_optimizer(config, META)
    _assert_state(opt, params, state, META["n_first"] + keras_readback.M - 1, config)
    # Our writer still writes what was handed to Keras: same files, byte for byte.
    for suffix in (".index", ".data-00000-of-00001"):
        with open(os.path.join(tmp_path, config, "ckpt" + suffix), "rb") as a, \
                open(os.path.join(DATA, "ours", config, "ckpt" + suffix), "rb") as b:
            assert a.read() == b.read(), suffix
    last = META["steps"] - 1
    for name in NAMES:
        _same(READBACK[f"{config}/param/{name}"], STEPS[f"{config}/{last}/param/{name}"], config, name)
    for i in range(len(META["configs"][config]["variables"])):
        _same(READBACK[f"{config}/opt/{i}"], STEPS[f"{config}/{last}/opt/{i}"], config, str(i))


def test_written_layout_is_keras3s():
    reader = checkpoint.read_checkpoint(os.path.join(DATA, "ours", "adam_amsgrad", "ckpt"))
    keras_reader = checkpoint.read_checkpoint(os.path.join(DATA, "keras3", "adam_amsgrad", "ckpt"))
    ours = {k: reader.dtype(k) for k in reader.keys() if k.startswith("optimizer/")}
    theirs = {k: keras_reader.dtype(k) for k in keras_reader.keys() if k.startswith("optimizer/")}
    assert ours == theirs and ours["optimizer/_iterations/.ATTRIBUTES/VARIABLE_VALUE"] == np.int64
    names = {a.checkpoint_key: a.full_name for n in reader.object_graph.nodes for a in n.attributes}
    keras_names = {a.checkpoint_key: a.full_name for n in keras_reader.object_graph.nodes for a in n.attributes}
    assert {k: v for k, v in names.items() if "/_variables/" in k} == {
        k: v.replace("adam_1/", "adam/") for k, v in keras_names.items() if "/_variables/" in k}


def test_params_given_get_the_checkpoint_values(keras_readback):
    opt = keras_readback.ours_optimizer("sgd_momentum", META)
    template = {"a": varstate.Variable(jnp.zeros((3, 2)), name="dense/kernel"),
                "b": varstate.Variable(jnp.zeros(2), name="dense/bias"),
                "c": varstate.Variable(jnp.zeros((5, 3)), name="emb/embeddings"),
                "frozen": varstate.Variable(jnp.zeros(4), name="bn/moving_mean", trainable=False)}
    params, state = keras.load_optimizer_state(os.path.join(DATA, "keras3", "sgd_momentum", "ckpt"), opt, template)
    assert params["a"].resource_id == template["a"].resource_id and params["frozen"] is template["frozen"]
    np.testing.assert_array_equal(np.asarray(params["c"].value), STEPS[f"sgd_momentum/{META['n_first'] - 1}/param/emb"])
    assert state.get_slot(params["a"], "momentum").name == "dense/kernel/momentum"


def test_int64_iteration_beyond_int32_is_refused(tmp_path):
    w = varstate.Variable(jnp.ones(2), name="w")
    opt = keras_opt.SGD(0.1)
    state = opt.init([w])
    path = keras.save_optimizer_state(str(tmp_path / "ckpt"), opt, [w], state)
    reader = checkpoint.read_checkpoint(path)
    assert reader.dtype("optimizer/_iterations/.ATTRIBUTES/VARIABLE_VALUE") == np.int64
    # A counter past int32 (written by hand as TF would store it).
    big = checkpoint.Checkpoint(optimizer={
        "_iterations": np.int64(2**40), "_learning_rate": np.float32(0.1),
        "_trainable_variables": [np.ones(2, np.float32)],
        "_variables": [np.int64(2**40), np.float32(0.1)]}).write(str(tmp_path / "big"), format="tf")
    with pytest.raises(ValueError, match=r"big: optimizer/_variables/0 is 1099511627776, beyond int32; enable jax_en"):
        keras.load_optimizer_state(big, opt)


def test_errors(tmp_path):
    ckpt = os.path.join(DATA, "keras3", "adam", "ckpt")
    with pytest.raises(ValueError, match=r"_variables holds 8 variables, but Adam with these settings on 3 trainable "
                                         r"variables has 11 \(iteration, learning_rate, momentum\[0\]"):
        keras.load_optimizer_state(ckpt, keras_opt.Adam(amsgrad=True))
    with pytest.raises(ValueError, match=r"optimizer/_variables/2 is Keras's 'adam/kernel_momentum', where Adamax "
                                         r"expects slot 'momentum'|optimizer/_variables/3 is Keras's "
                                         r"'adam/kernel_velocity', where Adamax expects slot 'norm' of trainable "
                                         r"variable 0"):
        keras.load_optimizer_state(ckpt, keras_opt.Adamax())
    with pytest.raises(TypeError, match=r"optimizer must be one of varstate.optimizers.keras's optimizers"):
        keras.load_optimizer_state(ckpt, varstate.optimizers.Adam())
    with pytest.raises(ValueError, match=r"the object graph has no 'model/optimizer' \(no child 'model'"):
        keras.load_optimizer_state(ckpt, keras_opt.Adam(), node="model/optimizer")
    with pytest.raises(ValueError, match=r"built on 3 trainable variables, but params has 2; pass the model's"):
        keras.load_optimizer_state(ckpt, keras_opt.Adam(), [jnp.zeros((3, 2)), jnp.zeros(2)])
    with pytest.raises(ValueError, match=r"_trainable_variables/1 has shape \(2,\) in the checkpoint, but \(3,\) here"):
        keras.load_optimizer_state(ckpt, keras_opt.Adam(), [jnp.zeros((3, 2)), jnp.zeros(3), jnp.zeros((5, 3))])
    with pytest.raises(ValueError, match=r"'optimizer' is not a Keras optimizer \(it has neither"):
        path = checkpoint.Checkpoint(optimizer={"x": np.ones(1)}).write(str(tmp_path / "other"), format="tf")
        keras.load_optimizer_state(path, keras_opt.Adam())
    w = varstate.Variable(jnp.ones(2), name="w")
    with pytest.raises(ValueError, match=r"state has no non-slot 'iteration', which Adam keeps"):
        keras.save_optimizer_state(str(tmp_path / "x"), keras_opt.Adam(), [w], varstate.optimizers.Adam().init([w]))
    with pytest.raises(ValueError, match=r"state has no slot 'momentum', which SGD keeps"):
        keras.save_optimizer_state(str(tmp_path / "x"), keras_opt.SGD(momentum=0.9), [w], keras_opt.SGD().init([w]))
    with pytest.raises(TypeError, match=r"state must be the OptimizerState of the optimizer, got dict"):
        keras.save_optimizer_state(str(tmp_path / "x"), keras_opt.SGD(), [w], {})


# --- tf.keras 2 (tf-keras optimizer_v2): iter, slots under .OPTIMIZER_SLOT --------------------------------------
V2_SLOTS = {"m": "momentum", "v": "velocity", "vhat": "velocity_hat", "rms": "velocity", "mg": "average_gradient",
            "momentum": "momentum", "accum_grad": "accumulated_grad", "accum_var": "accumulated_delta_var"}
V2_CONFIGS = sorted(META["v2_configs"])


def _v2_optimizer(config):
    c = META["v2_configs"][config]
    return getattr(keras_opt, c["class"])(**c["kwargs"])


@pytest.mark.parametrize("config", V2_CONFIGS)
def test_reads_tf_keras2_checkpoint(config):
    opt = _v2_optimizer(config)
    # params given in another order and structure: matched by their Keras names
    template = {n: varstate.Variable(jnp.zeros(STEPS[f"init/{n}"].shape), name=f"dense/{n}") for n in NAMES[::-1]}
    params, state = keras.load_optimizer_state(os.path.join(DATA, "tf_keras2", config, "ckpt"), opt, template)
    assert state.non_slot("iteration").value.item() == STEPS[f"v2/{config}/iter"] == META["n_first"]
    for n in NAMES:
        np.testing.assert_array_equal(np.asarray(params[n].value), STEPS[f"v2/{config}/param/{n}"])
        for slot in META["v2_configs"][config]["slots"]:
            got = state.get_slot(params[n], V2_SLOTS[slot])
            np.testing.assert_array_equal(np.asarray(got.value), STEPS[f"v2/{config}/slot/{n}/{slot}"], err_msg=slot)
    lr = META["v2_configs"][config]["kwargs"]["learning_rate"]
    assert state.non_slot("learning_rate").value.item() == np.float32(lr)


@pytest.mark.parametrize("config", V2_CONFIGS)
def test_tf_keras2_round_trip(config, tmp_path, keras_readback):
    # tf.keras 2 -> varstate (Keras 3 numerics, M steps) -> tf.keras 2 layout -> tf-keras reads it, assert_consumed.
    _, model, state = keras_readback.ours_continue_v2(config, STEPS, META, str(tmp_path))
    for suffix in (".index", ".data-00000-of-00001"):
        with open(os.path.join(tmp_path, config, "ckpt" + suffix), "rb") as a, \
                open(os.path.join(DATA, "tf_keras2_ours", config, "ckpt" + suffix), "rb") as b:
            assert a.read() == b.read(), suffix
    assert READBACK[f"v2/{config}/iter"] == META["n_first"] + keras_readback.M
    assert READBACK[f"v2/{config}/iter"].dtype == np.int64
    for n in NAMES:
        np.testing.assert_array_equal(READBACK[f"v2/{config}/param/{n}"], np.asarray(model[n].value))
        for slot in META["v2_configs"][config]["slots"]:
            np.testing.assert_array_equal(READBACK[f"v2/{config}/slot/{n}/{slot}"],
                                          np.asarray(state.get_slot(model[n], V2_SLOTS[slot]).value), err_msg=slot)


def test_tf_keras2_errors(tmp_path):
    ckpt = os.path.join(DATA, "tf_keras2", "adam", "ckpt")
    with pytest.raises(ValueError, match=r"tf.keras 2 has no Lion whose slots map to Keras 3's"):
        keras.load_optimizer_state(ckpt, keras_opt.Lion())
    with pytest.raises(ValueError, match=r"'dense/kernel' has no tf.keras slot 'momentum' \(Keras 3's 'momentum'\); "
                                         r"its slots are \['m', 'v', 'vhat'\]"):
        keras.load_optimizer_state(ckpt, keras_opt.SGD(momentum=0.9))
    w = varstate.Variable(jnp.ones(2), name="w")
    with pytest.raises(ValueError, match=r"tf.keras 2 layout: Lion has no tf.keras 2 counterpart written here"):
        keras.save_optimizer_state(str(tmp_path / "x"), keras_opt.Lion(), [w], keras_opt.Lion().init([w]),
                                   layout="tf_keras2")
    sched = keras_opt.SGD(lambda it: 0.1)
    with pytest.raises(ValueError, match=r"tf.keras 2 layout: a learning-rate schedule is not a variable"):
        keras.save_optimizer_state(str(tmp_path / "x"), sched, [w], sched.init([w]), layout="tf_keras2")
    with pytest.raises(ValueError, match=r"layout must be 'keras3' or 'tf_keras2', got 'keras2'"):
        keras.save_optimizer_state(str(tmp_path / "x"), keras_opt.SGD(), [w], keras_opt.SGD().init([w]),
                                   layout="keras2")


# --- Keras 3 .weights.h5 of a compiled model: optimizer/vars/N ----------------------------------------------------
def test_weights_h5_round_trip(tmp_path, keras_readback):
    # Keras trains 3 steps, saves weights + Adam(amsgrad) state; varstate reads it, takes 2 steps op by op (equal to
    # Keras's own 2 steps, bit for bit), writes it back; Keras's model.load_weights reads exactly those values.
    from checkpoint.keras._optimizer import _trainable, h5_values

    opt, weights, state = keras_readback.ours_continue_h5(STEPS, str(tmp_path / "ours.weights.h5"))
    assert list(weights) == ["dense", "bn", "out"] and weights["bn"]["moving_mean"].trainable is False
    leaves, _, idx = _trainable(weights)
    assert [leaves[i].name for i in idx] == ["dense/kernel", "dense/bias", "bn/gamma", "bn/beta", "out/kernel",
                                             "out/bias"]
    _, values = h5_values(opt, weights, state)
    n = len(values)
    assert n == 2 + 3 * len(idx) and values[0].dtype == np.int64 and values[0] == META["n_first"] + 2
    for i in range(n):
        np.testing.assert_array_equal(values[i], STEPS[f"h5/adam/after/opt/{i}"], err_msg=str(i))
        np.testing.assert_array_equal(READBACK[f"h5/opt/{i}"], values[i], err_msg=str(i))
    order = [leaf for lay in weights.layout for leaf in (weights[lay.path[0]][w] for w in lay.weights)]
    for i, leaf in enumerate(order):
        np.testing.assert_array_equal(np.asarray(leaf.value), STEPS[f"h5/adam/after/weight/{i}"])
        np.testing.assert_array_equal(READBACK[f"h5/weight/{i}"], np.asarray(leaf.value))
    with open(tmp_path / "ours.weights.h5", "rb") as a, \
            open(os.path.join(DATA, "keras3_h5_ours", "adam.weights.h5"), "rb") as b:
        assert a.read() == b.read()


def test_keras_archive_optimizer_state():
    from checkpoint.keras._optimizer import h5_values

    opt = keras_opt.Adam(0.01, amsgrad=True)
    weights, state = keras.load_optimizer_state(os.path.join(DATA, "keras3_h5", "adam.keras"), opt)
    _, values = h5_values(opt, weights, state)
    for i, value in enumerate(values):
        np.testing.assert_array_equal(value, STEPS[f"h5/adam/opt/{i}"], err_msg=str(i))


def test_weights_h5_errors(tmp_path):
    h5 = os.path.join(DATA, "keras3_h5", "adam.weights.h5")
    with pytest.raises(ValueError, match=r"optimizer/vars holds 20 variables, but Adam with these settings on 6 "
                                         r"trainable variables has 14"):
        keras.load_optimizer_state(h5, keras_opt.Adam(0.01))
    weights = keras.load_weights(h5)
    plain = str(tmp_path / "plain.weights.h5")
    keras.save_weights(plain, weights)
    with pytest.raises(ValueError, match=r"plain.weights.h5: no optimizer state \(no 'optimizer/vars' group\)"):
        keras.load_optimizer_state(plain, keras_opt.Adam(0.01))
    with pytest.raises(ValueError, match=r"from both optimizer= and optimizer_state=; pass both"):
        keras.save_weights(plain, weights, optimizer=keras_opt.Adam())
    with pytest.raises(ValueError, match=r"optimizer_state has no slot 'velocity_hat', which Adam keeps"):
        keras.save_weights(plain, weights, optimizer=keras_opt.Adam(amsgrad=True),
                           optimizer_state=keras_opt.Adam().init(weights))
