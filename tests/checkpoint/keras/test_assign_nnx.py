"""Keras weights into flax nnx models whose names are not Keras's: layers paired, weights by name within each.

Reference: the outputs Keras computed for the fixture models (tests/data/keras_weights/expected.json). JAX sorts
an nnx.Linear's ``bias`` before its ``kernel``, so only matching by name within a layer can give them.
"""

import json
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from checkpoint import keras

DATA = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(__file__))), "data", "keras_weights")
with open(os.path.join(DATA, "expected.json")) as f:
    EXPECTED = json.load(f)["models"]


class ListMLP(nnx.Module):
    """The fixture's Keras mlp (dense -> proj, no bias -> out) as an nnx.List: no Keras name anywhere."""

    def __init__(self, rngs):
        self.layers = nnx.List([nnx.Linear(4, 3, rngs=rngs), nnx.Linear(3, 3, use_bias=False, rngs=rngs),
                                nnx.Linear(3, 2, rngs=rngs)])

    def __call__(self, x):
        return self.layers[2](self.layers[1](jax.nn.relu(self.layers[0](x))))


class ConvNet(nnx.Module):
    """The fixture's Keras conv model with its layer names; nnx.BatchNorm spells gamma/beta/moving_* its own way."""

    def __init__(self, rngs):
        self.conv = nnx.Conv(2, 3, (3, 3), padding="VALID", rngs=rngs)
        self.bn = nnx.BatchNorm(3, epsilon=1e-3, use_running_average=True, rngs=rngs)
        self.head = nnx.Linear(3, 2, rngs=rngs)

    def __call__(self, x):
        return self.head(self.bn(self.conv(x)).mean(axis=(1, 2)))


@pytest.mark.parametrize("source", ["keras3/mlp.weights.h5", "keras3/mlp.keras", "tf_keras/mlp"])
def test_an_nnx_list_of_linears_takes_keras_weights_by_name_within_each_layer(source):
    model = "tf_keras/mlp" if source.startswith("tf_keras") else "keras3/mlp"
    net = keras.assign_weights(ListMLP(nnx.Rngs(0)), keras.load_weights(os.path.join(DATA, source)))
    out = net(jnp.asarray(EXPECTED[model]["probe"], jnp.float32))
    np.testing.assert_allclose(np.asarray(out), np.float32(EXPECTED[model]["outputs"]), rtol=1e-5, atol=1e-6)


def test_nnx_batchnorm_takes_keras_gamma_beta_and_moving_statistics():
    weights = keras.load_weights(os.path.join(DATA, "keras3", "conv.weights.h5"))
    net = keras.assign_weights(ConvNet(nnx.Rngs(0)), weights)
    out = net(jnp.asarray(EXPECTED["keras3/conv"]["probe"], jnp.float32))
    np.testing.assert_allclose(np.asarray(out), np.float32(EXPECTED["keras3/conv"]["outputs"]), rtol=1e-5, atol=1e-5)


def test_a_shape_that_does_not_fit_says_how_its_weight_was_found():
    weights = {"dense": {"kernel": np.ones((4, 3), np.float32), "bias": np.ones(3, np.float32)}}
    # Same names: no name_map can help; the model differs.
    with pytest.raises(ValueError, match="^" + re.escape(
            "target leaf 'dense/kernel' has shape (3, 3), but Keras weight 'dense/kernel' has (4, 3); the names "
            "match, so the model is not the one that wrote the file: build it with the file's shapes") + "$"):
        keras.assign_weights({"dense": {"kernel": np.zeros((3, 3)), "bias": np.zeros(3)}}, weights)
    # Layers paired by position, weights by name: the layer order may be wrong, which a name_map fixes.
    with pytest.raises(ValueError, match="^" + re.escape(
            "target leaf '0/kernel' has shape (3, 3), but Keras weight 'dense/kernel' has (4, 3); layers "
            "pair by position where their names differ (target layer '0', number 1 in JAX's order, with "
            "Keras layer 'dense'): if the order differs, pass a name_map") + "$"):
        keras.assign_weights(nnx.List([nnx.Linear(3, 3, rngs=nnx.Rngs(0))]), weights)
    # A layer of another count of weights: leaf by leaf in order, as before.
    flat = [np.zeros((4, 3), np.float32), np.zeros(3, np.float32)]
    got = keras.assign_weights(flat, weights)
    assert got[0].shape == (4, 3) and float(got[1].sum()) == 3.0
