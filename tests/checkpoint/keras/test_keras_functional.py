"""Keras functional models (issue 24 item 5): Keras's layer order, optimizer state and the round trip through Keras.

Fixtures (tests/data/keras_functional/, make_keras_functional_fixtures.py): a BERT-like encoder trained with
Adam, SGD with momentum and RMSprop, and MobileNetV3Small with Adam, each `model.save_weights` (and the
encoder's Adam run `model.save`); meta.json, Keras's own record (paths and sha256 of `model.weights`,
`model.trainable_variables`, `optimizer.variables`, and after each further step); readback.json, what Keras
held after `model.load_weights` of the file varstate wrote (keras_functional_readback.py).
"""

import io
import json
import os
import re
import sys
import zipfile

import h5py
import jax
import numpy as np
import pytest

import varstate
from checkpoint import keras
from checkpoint.keras._optimizer import h5_values
from varstate.optimizers import keras as keras_opt

HERE = os.path.join(os.path.dirname(__file__), "..", "..", "data")
DATA = os.path.join(HERE, "keras_functional")
sys.path.insert(0, HERE)
from keras_functional_readback import file_digest, ours_continue  # noqa: E402
from make_keras_functional_fixtures import CONFIGS, RUNS, STEPS, digest  # noqa: E402

sys.path.remove(HERE)
with open(os.path.join(DATA, "meta.json")) as _f:
    META = json.load(_f)
with open(os.path.join(DATA, "readback.json")) as _f:
    READBACK = json.load(_f)
FILES = [(f"{m}_{c}.weights.h5", m, c) for m, c in RUNS] + [("encoder_adam.keras", "encoder", "adam")]


def _optimizer(config):
    cls, kwargs = CONFIGS[config]
    return getattr(keras_opt, cls)(**kwargs)


def _paths_in_order(w):
    return ["/".join((*lay.path, name)) for lay in w.layout for name in lay.weights]


def _walk(tree, path=()):
    """(path, Variable) in the dicts' own order (jax.tree.leaves would sort the plain dicts inside)."""
    for key, value in tree.items():
        yield from _walk(value, (*path, key)) if isinstance(value, dict) else [("/".join((*path, key)), value)]


@pytest.mark.parametrize(("name", "model", "config"), FILES)
def test_load_weights_in_keras_order(name, model, config):
    run = META["runs"][f"{model}/{config}"]
    w = keras.load_weights(os.path.join(DATA, name))
    keras_paths = [p for p, *_ in run["weights"]]
    assert _paths_in_order(w) == keras_paths  # encoder: tok_embed first, z_proj before a_proj
    walked = list(_walk(w))
    assert [p for p, _ in walked] == keras_paths
    assert [digest(v.value) for _, v in walked] == [h for *_, h in run["weights"]]
    assert [v.name for _, v in walked] == keras_paths


def test_multi_head_attention_weights_are_named():
    w = keras.load_weights(os.path.join(DATA, "encoder_adam.weights.h5"))
    assert list(w["self_attn"]) == ["query", "key", "value", "attention_output"]
    for proj in w["self_attn"].values():
        assert list(proj) == ["kernel", "bias"]
    assert w["self_attn"]["attention_output"]["kernel"].shape == (2, 4, 8)


@pytest.mark.parametrize(("name", "model", "config"), FILES)
def test_load_optimizer_state_of_functional_models(name, model, config):
    run = META["runs"][f"{model}/{config}"]
    opt = _optimizer(config)
    weights, state = keras.load_optimizer_state(os.path.join(DATA, name), opt)
    _, values = h5_values(opt, weights, state)
    assert [digest(v) for v in values] == [h for *_, h in run["optimizer"]]
    assert [np.shape(v) for v in values] == [tuple(s) for _, s, *_ in run["optimizer"]]


@pytest.mark.parametrize(("model", "config"), RUNS)
def test_round_trip_through_keras_is_bit_exact(model, config, tmp_path):
    run, back = META["runs"][f"{model}/{config}"], READBACK[f"{model}/{config}"]
    out = str(tmp_path / "ours.weights.h5")
    opt, weights, state = ours_continue(model, config, out)
    # varstate's STEPS - 1 steps are Keras's, bit for bit...
    ours = dict((p, digest(v.value)) for p, v in _walk(weights))
    assert [ours[p] for p, *_ in run["weights"]] == run[f"after/{STEPS - 1}"]["weights"]
    assert [digest(v) for v in h5_values(opt, weights, state)[1]] == run[f"after/{STEPS - 1}"]["optimizer"]
    # ...Keras read this very file (model.load_weights) and held the same, and its next step is its own run's.
    assert file_digest(out) == back["file"]
    assert back["loaded"] == run[f"after/{STEPS - 1}"]
    assert back["stepped"] == run[f"after/{STEPS}"]


# --- two layers with equal shapes: never loaded silently wrong ---------------------------------------------------
_KERNELS = {"proj_b": np.arange(9, dtype=np.float32).reshape(3, 3), "proj_a": -np.arange(9, dtype=np.float32)}


def _twin_file(path, config=None):
    """An EinsumDense "proj_b" then a Dense "proj_a" of equal shapes, with SGD momentum state: Keras's file names
    (layers/dense, layers/einsum_dense) say nothing of their order; `config` (a .keras archive) does."""
    buf = io.BytesIO() if config else path
    with h5py.File(buf, "w") as f:
        f.create_group("vars").attrs["name"] = "model"
        for group, name in (("dense", "proj_a"), ("einsum_dense", "proj_b")):  # written in the other order
            g = f.create_group(f"layers/{group}/vars")
            g.attrs["name"] = name
            g["0"], g["1"] = _KERNELS[name].reshape(3, 3), np.full(3, len(name), np.float32)
        g = f.create_group("optimizer/vars")
        g.attrs["name"] = "sgd"
        g["0"], g["1"] = np.int64(2), np.float32(0.1)
        for i, name in enumerate(("proj_b", "proj_a")):  # Keras's order: proj_b's momentum slots first
            g[str(2 + 2 * i)], g[str(3 + 2 * i)] = _KERNELS[name].reshape(3, 3) * 10, np.full(3, i, np.float32)
    if config:
        with zipfile.ZipFile(path, "w") as z:
            z.writestr("config.json", json.dumps(config))
            z.writestr("model.weights.h5", buf.getvalue())
    return str(path)


def test_equal_shapes_of_two_classes_are_refused_without_the_order(tmp_path):
    path = _twin_file(tmp_path / "twins.weights.h5")
    with pytest.raises(ValueError, match=r"twins.weights.h5: a .weights.h5 does not record the order of a model's "
                                         r"layers, and more than one order of the model's layers gives the shapes of "
                                         r"the optimizer's variables \(layers of different classes with equal "
                                         r"shapes\); "
                                         r"load the .keras archive \(model.save\), whose config records it, or pass "
                                         r"params= a list of the weights in Keras's order of "
                                         r"model.trainable_variables"):
        keras.load_optimizer_state(path, keras_opt.SGD(0.1, momentum=0.9))
    w = keras.load_weights(path)  # the weights alone read; their order is unknown, not guessed
    np.testing.assert_array_equal(np.asarray(w["proj_b"]["kernel"].value), _KERNELS["proj_b"].reshape(3, 3))
    # The fix the message gives: a list in Keras's order.
    params = [w["proj_b"]["kernel"], w["proj_b"]["bias"], w["proj_a"]["kernel"], w["proj_a"]["bias"]]
    params, state = keras.load_optimizer_state(path, keras_opt.SGD(0.1, momentum=0.9), params)
    np.testing.assert_array_equal(np.asarray(state.slots["momentum"][0].value), _KERNELS["proj_b"].reshape(3, 3) * 10)


def test_the_keras_config_gives_the_order(tmp_path):
    config = {"class_name": "Functional", "config": {"name": "model", "layers": [
        {"class_name": "InputLayer", "name": "x", "config": {"name": "x"}},
        {"class_name": "EinsumDense", "name": "proj_b", "config": {"name": "proj_b"}},
        {"class_name": "Dense", "name": "proj_a", "config": {"name": "proj_a"}}]}}
    path = _twin_file(tmp_path / "twins.keras", config)
    w, state = keras.load_optimizer_state(path, keras_opt.SGD(0.1, momentum=0.9))
    assert list(w) == ["proj_b", "proj_a"]
    np.testing.assert_array_equal(np.asarray(state.slots["momentum"]["proj_b"]["kernel"].value),
                                  _KERNELS["proj_b"].reshape(3, 3) * 10)
    np.testing.assert_array_equal(np.asarray(state.slots["momentum"]["proj_a"]["bias"].value), np.ones(3))


def test_config_entries_of_another_kind_are_passed_over(tmp_path):
    # A crafted config: a layer whose "config" is a list or a string (not a dict) names no layer; it was an
    # AttributeError. The layers the config does name still give the order.
    config = {"class_name": "Functional", "config": {"name": "model", "layers": [
        {"class_name": "Dense", "config": ["junk"]}, {"class_name": "Dense", "config": "junk"},
        {"class_name": "EinsumDense", "name": "proj_b", "config": {"name": "proj_b"}},
        {"class_name": "Dense", "config": {"name": "proj_a"}}]}}
    path = _twin_file(tmp_path / "crafted.keras", config)
    w, state = keras.load_optimizer_state(path, keras_opt.SGD(0.1, momentum=0.9))
    assert list(w) == ["proj_b", "proj_a"]
    np.testing.assert_array_equal(np.asarray(state.slots["momentum"]["proj_b"]["kernel"].value),
                                  _KERNELS["proj_b"].reshape(3, 3) * 10)


def test_shapes_that_fit_no_order_are_refused(tmp_path):
    path = str(tmp_path / "frozen.weights.h5")
    with h5py.File(path, "w") as f:
        f.create_group("vars").attrs["name"] = "model"
        for group, shape in (("dense", (2, 3)), ("dense_1", (3, 4))):
            g = f.create_group(f"layers/{group}/vars")
            g.attrs["name"], g["0"], g["1"] = group, np.ones(shape, np.float32), np.ones(shape[1], np.float32)
        g = f.create_group("optimizer/vars")
        g["0"], g["1"] = np.int64(1), np.float32(0.1)
        for i, shape in enumerate(((3, 4), (4,), (2, 3), (3,))):  # dense_1 before dense: not Keras's
            g[str(2 + i)] = np.zeros(shape, np.float32)
    with pytest.raises(ValueError, match=r"frozen.weights.h5: a .weights.h5 does not record the order of a model's "
                                         r"layers, and no order of the model's layers gives the shapes of the "
                                         r"optimizer's variables \(a frozen layer, trainable=False"):
        keras.load_optimizer_state(path, keras_opt.SGD(0.1, momentum=0.9))


# --- one structure both ways: load_optimizer_state's weights go to save_weights ----------------------------------
def test_a_tf_checkpoint_of_a_model_gives_the_dict_save_weights_takes(tmp_path):
    weights_dir = os.path.join(HERE, "keras_weights")
    prefix = os.path.join(weights_dir, "keras3_tf", "conv", "ckpt-1")
    opt = keras_opt.Adam(0.001)
    params, state = keras.load_optimizer_state(prefix, opt, node="model/optimizer")
    assert isinstance(params, keras.KerasWeights)
    model = keras.load_weights(prefix)
    assert [(p, v.name) for p, v in _walk(params)] == [(p, v.name) for p, v in _walk(model)]
    out = keras.save_weights(str(tmp_path / "conv.weights.h5"), params,
                             like=os.path.join(weights_dir, "keras3", "conv.weights.h5"),
                             optimizer=opt, optimizer_state=state)
    back, state2 = keras.load_optimizer_state(out, opt)

    def values(tree):
        return [np.asarray(v.value) for v in jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, varstate.Variable))]

    for a, b in zip(values((params, state)), values((back, state2)), strict=True):
        np.testing.assert_array_equal(a, b)
    assert int(state2.non_slot("iteration").value) == 1


def test_layers_of_many_classes_with_equal_shapes_are_refused_in_bounded_time(tmp_path):
    # 200 classes of one layer each, all of one shape: every order fits, and counting them would never end.
    path = str(tmp_path / "many.weights.h5")
    with h5py.File(path, "w") as f:
        f.create_group("vars").attrs["name"] = "model"
        for i in range(200):
            g = f.create_group(f"layers/custom{i}/vars")
            g.attrs["name"], g["0"] = f"custom{i}", np.ones(2, np.float32)
        g = f.create_group("optimizer/vars")
        g["0"], g["1"] = np.int64(1), np.float32(0.1)
        for i in range(200):
            g[str(2 + i)] = np.zeros(2, np.float32)
    with pytest.raises(ValueError, match=r"many.weights.h5: a .weights.h5 does not record the order of a model's "
                                         r"layers, and the order of the model's layers could not be worked out from "
                                         r"the optimizer's variables; load the .keras archive"):
        keras.load_optimizer_state(path, keras_opt.SGD(0.1, momentum=0.9))


def test_params_given_keep_what_the_file_does_not_hold():
    path = os.path.join(DATA, "encoder_sgd_momentum.weights.h5")
    w = keras.load_weights(path)
    w["counter"] = {"seen": varstate.Variable(np.int32(7), name="counter/seen", trainable=False)}
    params, _ = keras.load_optimizer_state(path, keras_opt.SGD(0.1, momentum=0.9), w)
    assert params["counter"]["seen"].value == 7
    assert [p for p, _ in _walk(params)][-1] == "counter/seen"


@pytest.mark.parametrize(("config", "kwargs"), [
    ("Adam", {"amsgrad": True}), ("Adam", {"learning_rate": lambda it: 0.1}),
    ("RMSprop", {"centered": True, "momentum": 0.5}), ("Nadam", {}), ("SGD", {}), ("Adadelta", {}),
])
def test_the_trainable_shapes_show_through_any_optimizer_layout(config, kwargs):
    # What a .weights.h5's optimizer/vars shows of the model without the optimizer being known (load_weights).
    from checkpoint.keras import _order
    from checkpoint.keras._optimizer import keras_order

    shapes = [(2, 3), (3,), (3, 4), (4,)]
    order = keras_order(getattr(keras_opt, config)(**kwargs), [np.zeros(s, np.float32) for s in shapes])
    listed = [() if p is None else shapes[p] for _, p in order]
    want = shapes if any(p is not None for _, p in order) else None  # plain SGD keeps no slots: nothing shows
    assert _order.optimizer_shapes(listed, len(shapes)) == want
    assert _order.optimizer_shapes(listed, len(shapes) + 1) is None


def test_without_optimizer_state_each_class_keeps_keras_order(tmp_path):
    # h5py's copy writes the groups in name order: layers/batch_normalization_10 before _2.
    path = str(tmp_path / "no_optimizer.weights.h5")
    with h5py.File(os.path.join(DATA, "mobilenet_adam.weights.h5")) as f, h5py.File(path, "w") as g:
        for key in f:
            if key != "optimizer":
                f.copy(key, g)
    w = keras.load_weights(path)
    keras_layers = META["runs"]["mobilenet/adam"]["layers"]
    classes: dict[str, list[str]] = {}
    for lay in w.layout:
        if len(lay.path) == 1:
            classes.setdefault(re.sub(r"_\d+$", "", lay.group.split("/")[1]), []).append(lay.path[0])
    assert len(classes["batch_normalization"]) > 10
    for names in classes.values():
        assert names == sorted(names, key=keras_layers.index)
