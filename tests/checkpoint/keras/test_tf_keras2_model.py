"""One structure both ways for tf.keras 2 (issue 24 item 5): a tf.keras 2 model checkpoint's optimizer state comes
with the model's weights as the dict `load_weights` returns and `save_weights` takes.

Fixture (tests/data/tf_keras2_model/, make_tf_keras2_model_fixtures.py): a tf-keras functional mlp trained two steps
with the legacy Adam and written with ``model.save_weights(prefix)``; expected.npz holds tf.keras's own values.
"""

import os

import jax
import numpy as np

import varstate
from checkpoint import keras
from varstate.optimizers import keras as keras_opt

HERE = os.path.join(os.path.dirname(__file__), "..", "..", "data")
PREFIX = os.path.join(HERE, "tf_keras2_model", "mlp_adam")
EXPECTED = dict(np.load(os.path.join(HERE, "tf_keras2_model", "expected.npz")))
SLOTS = {"momentum": "m", "velocity": "v"}  # Keras 3's Adam slots, tf.keras 2's names


def _weights():
    return {k.removeprefix("weight/"): v for k, v in EXPECTED.items() if k.startswith("weight/")}


def _check(params, state):
    assert isinstance(params, keras.KerasWeights)
    assert list(params) == EXPECTED["layers"].tolist()  # tf.keras's layer order: dense, proj, out (not sorted)
    assert sorted(f"{layer}/{name}" for layer, ws in params.items() for name in ws) == sorted(_weights())
    for key, value in _weights().items():
        layer, name = key.split("/")
        np.testing.assert_array_equal(np.asarray(params[layer][name].value), value)
        for ours, theirs in SLOTS.items():
            np.testing.assert_array_equal(np.asarray(state.slots[ours][layer][name].value),
                                          EXPECTED[f"slot/{key}/{theirs}"])
    assert int(state.non_slot("iteration").value) == int(EXPECTED["iter"])


def test_a_tf_keras2_model_checkpoint_gives_the_dict_load_weights_returns():
    params, state = keras.load_optimizer_state(PREFIX, keras_opt.Adam(0.01))
    _check(params, state)
    model = keras.load_weights(PREFIX)
    assert [(layer, list(ws)) for layer, ws in params.items()] == [(layer, list(ws)) for layer, ws in model.items()]


def test_the_dict_round_trips_through_save_weights_with_its_state(tmp_path):
    opt = keras_opt.Adam(0.01)
    params, state = keras.load_optimizer_state(PREFIX, opt)
    out = keras.save_weights(str(tmp_path / "mlp.weights.h5"), params,
                             like=os.path.join(HERE, "keras_weights", "keras3", "mlp.weights.h5"),
                             optimizer=opt, optimizer_state=state)
    back, state2 = keras.load_optimizer_state(out, opt)
    _check(back, state2)


def test_an_optimizer_saved_beside_no_keras_model_still_gives_a_list():
    # tf.train.Checkpoint(model={kernel, bias, emb}, optimizer=opt): a dict of Variables, not a Keras model.
    params, _ = keras.load_optimizer_state(os.path.join(HERE, "keras_optimizers", "tf_keras2", "adam", "ckpt"),
                                           keras_opt.Adam(amsgrad=True))
    assert isinstance(params, list)
    assert [v.name for v in params] == ["dense/kernel", "dense/bias", "dense/emb"]
    assert all(isinstance(v, varstate.Variable) for v in jax.tree.leaves(
        params, is_leaf=lambda x: isinstance(x, varstate.Variable)))
