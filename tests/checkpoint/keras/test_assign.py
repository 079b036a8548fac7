"""checkpoint.keras.assign_weights: Keras weights into pytrees, varstate Variables and flax nnx Modules.

Reference: the outputs Keras computed for the fixture models (tests/data/keras_weights/expected.json);
the same forward passes written in JAX with the assigned weights give them again.
"""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import varstate
from checkpoint import keras

DATA = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(__file__))), "data", "keras_weights")
with open(os.path.join(DATA, "expected.json")) as f:
    EXPECTED = json.load(f)


def _probe(model):
    return np.array(EXPECTED["models"][model]["probe"], np.float32)


def _keras_outputs(model):
    return np.array(EXPECTED["models"][model]["outputs"], np.float32)


class MLP(nnx.Module):
    """The fixture's Keras mlp: Dense(3, relu) -> Dense(3, no bias) -> Dense(2), attribute names = layer names."""

    def __init__(self, rngs):
        self.dense = nnx.Linear(4, 3, rngs=rngs)
        self.proj = nnx.Linear(3, 3, use_bias=False, rngs=rngs)
        self.out = nnx.Linear(3, 2, rngs=rngs)

    def __call__(self, x):
        return self.out(self.proj(jax.nn.relu(self.dense(x))))


@pytest.mark.parametrize("source,model", [
    ("keras3/mlp.weights.h5", "keras3/mlp"),
    ("keras3/mlp.keras", "keras3/mlp"),
    ("tf_keras/mlp", "tf_keras/mlp"),
    ("tf_keras/mlp.h5", "tf_keras/mlp"),
])
def test_nnx_module_by_name_computes_what_keras_computed(source, model):
    net = MLP(nnx.Rngs(0))
    before = np.asarray(net(_probe(model)))
    net = keras.assign_weights(net, keras.load_weights(os.path.join(DATA, source)))
    assert isinstance(net, MLP)
    out = np.asarray(net(_probe(model)))
    assert not np.allclose(before, out)
    np.testing.assert_allclose(out, _keras_outputs(model), rtol=1e-5, atol=1e-6)


def test_by_structure_takes_weights_in_keras_order():
    weights = keras.load_weights(os.path.join(DATA, "keras3", "mlp.weights.h5"))
    params = ((np.zeros((4, 3), np.float32), np.zeros(3, np.float32)), (np.zeros((3, 3), np.float32),),
              (np.zeros((3, 2), np.float32), np.zeros(2, np.float32)))
    (k1, b1), (k2,), (k3, b3) = keras.assign_weights(params, weights)
    x = _probe("keras3/mlp")
    out = jax.nn.relu(x @ k1 + b1) @ k2 @ k3 + b3
    np.testing.assert_allclose(np.asarray(out), _keras_outputs("keras3/mlp"), rtol=1e-5, atol=1e-6)
    # After jax.tree.map the inner dicts are sorted, but KerasWeights keep Keras's order through their layout.
    shifted = jax.tree.map(lambda v: v + 0, weights)
    (k1b, b1b), _, _ = keras.assign_weights(params, shifted)
    assert np.array_equal(k1b, k1) and np.array_equal(b1b, b1)


def test_name_map_into_a_list_of_layers_and_varstate_variables():
    weights = keras.load_weights(os.path.join(DATA, "keras3", "conv.weights.h5"))
    params = {
        "conv": {"w": varstate.Variable(jnp.zeros((3, 3, 2, 3))), "b": varstate.Variable(jnp.zeros(3))},
        "norm": [jnp.zeros(3), jnp.zeros(3), jnp.zeros(3), jnp.zeros(3)],
        "head": {"w": jnp.zeros((3, 2)), "b": jnp.zeros(2)},
    }
    name_map = {
        "conv/w": "conv/kernel", "conv/b": "conv/bias",
        "norm/0": "bn/gamma", "norm/1": "bn/beta", "norm/2": "bn/moving_mean", "norm/3": "bn/moving_variance",
        "head/w": "head/kernel", "head/b": "head/bias",
    }
    new = keras.assign_weights(params, weights, name_map)
    # Variables keep their identity (resource) and take the value.
    assert new["conv"]["w"].resource_id == params["conv"]["w"].resource_id
    assert np.asarray(new["conv"]["w"].value).tobytes() == np.asarray(weights["conv"]["kernel"].value).tobytes()
    x = jnp.asarray(_probe("keras3/conv"))
    y = jax.lax.conv_general_dilated(x, new["conv"]["w"].value, (1, 1), "VALID",
                                     dimension_numbers=("NHWC", "HWIO", "NHWC")) + new["conv"]["b"].value
    gamma, beta, mean, var = new["norm"]
    y = (y - mean) / jnp.sqrt(var + 1e-3) * gamma + beta  # Keras BatchNormalization in inference, epsilon 1e-3
    out = y.mean(axis=(1, 2)) @ new["head"]["w"] + new["head"]["b"]
    np.testing.assert_allclose(np.asarray(out), _keras_outputs("keras3/conv"), rtol=1e-5, atol=1e-5)


def _lstm(x, cell):
    kernel, recurrent, bias = cell["kernel"], cell["recurrent_kernel"], cell["bias"]
    units = recurrent.shape[0]
    h = c = jnp.zeros((x.shape[0], units))
    for t in range(x.shape[1]):  # Keras's gate order: input, forget, cell, output
        z = x[:, t] @ kernel + h @ recurrent + bias
        i, f, g, o = (z[:, k * units : (k + 1) * units] for k in range(4))
        c = jax.nn.sigmoid(f) * c + jax.nn.sigmoid(i) * jnp.tanh(g)
        h = jax.nn.sigmoid(o) * jnp.tanh(c)
    return h


@pytest.mark.parametrize("source", ["keras3/lstm.weights.h5", "keras3_tf/lstm/ckpt-1"])
def test_lstm_weights_by_name_reproduce_keras(source):
    cell = {"kernel": jnp.zeros((3, 16)), "recurrent_kernel": jnp.zeros((4, 16)), "bias": jnp.zeros(16)}
    target = {"lstm": {"lstm_cell": cell}, "head": {"kernel": jnp.zeros((4, 2)), "bias": jnp.zeros(2)}}
    p = keras.assign_weights(target, keras.load_weights(os.path.join(DATA, source)))
    out = _lstm(jnp.asarray(_probe("keras3/lstm")), p["lstm"]["lstm_cell"]) @ p["head"]["kernel"] + p["head"]["bias"]
    np.testing.assert_allclose(np.asarray(out), _keras_outputs("keras3/lstm"), rtol=1e-5, atol=1e-6)


def test_tf_keras_lstm_with_batch_norm():
    w = keras.load_weights(os.path.join(DATA, "tf_keras", "lstm_bn"))
    p = keras.assign_weights(jax.tree.map(lambda v: jnp.zeros(v.shape), w), w)  # a target of the same structure
    h = _lstm(jnp.asarray(_probe("tf_keras/lstm_bn")), p["lstm"]["lstm_cell"])
    bn = p["bn"]
    h = (h - bn["moving_mean"]) / jnp.sqrt(bn["moving_variance"] + 1e-3) * bn["gamma"] + bn["beta"]
    out = h @ p["head"]["kernel"] + p["head"]["bias"]
    np.testing.assert_allclose(np.asarray(out), _keras_outputs("tf_keras/lstm_bn"), rtol=1e-5, atol=1e-5)


def test_values_take_the_leaf_dtype_and_sharding():
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("x",))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("x"))
    leaf = jax.device_put(jnp.zeros(2, jnp.bfloat16), sharding)
    new = keras.assign_weights({"b": leaf}, {"b": np.array([1.0, 2.0], np.float32)})
    assert new["b"].dtype == jnp.bfloat16 and new["b"].sharding == sharding
    assert new["b"].tolist() == [1.0, 2.0]


def test_strict_false_leaves_unmapped_leaves_and_unused_weights():
    weights = {"dense": {"kernel": np.ones((2, 2), np.float32), "bias": np.ones(2, np.float32)}}
    target = {"w": np.zeros((2, 2), np.float32), "extra": np.full(3, 7.0, np.float32)}
    new = keras.assign_weights(target, weights, {"w": "dense/kernel"}, strict=False)
    assert new["w"].tolist() == [[1, 1], [1, 1]] and new["extra"].tolist() == [7, 7, 7]
    new = keras.assign_weights(target, weights, lambda name: "dense/kernel" if name == "w" else None, strict=False)
    assert new["w"].sum() == 4


def test_errors_name_the_first_mismatch():
    weights = {"dense": {"kernel": np.ones((4, 3), np.float32), "bias": np.ones(3, np.float32)}}
    with pytest.raises(TypeError, match=r"weights must be a dict of layers \(as load_weights returns\), got list"):
        keras.assign_weights({}, [])
    with pytest.raises(ValueError, match="target has no leaves to assign \\(got dict\\)"):
        keras.assign_weights({}, weights)
    # by structure: dict keys sort "b" before "w", so the first leaf meets the kernel.
    with pytest.raises(ValueError, match=r"target leaf 'layer/b' has shape \(3,\), but Keras weight 'dense/kernel' has "
                                         r"\(4, 3\); the order of leaves differs from Keras's: pass a name_map"):
        keras.assign_weights({"layer": {"w": np.zeros((4, 3)), "b": np.zeros(3)}}, weights)
    with pytest.raises(ValueError, match=r"target has 1 leaves but there are 2 Keras weights, and the names "
                                         r"differ \(target: \['w'\]; Keras: \['dense/kernel', 'dense/bias'\]\): "
                                         "pass a name_map"):
        keras.assign_weights({"w": np.zeros(3)}, weights)
    with pytest.raises(ValueError, match=r"target leaf 'b' is not in name_map; map it to a Keras weight \(one of "
                                         r"\['dense/kernel', 'dense/bias'\]\), or pass strict=False"):
        keras.assign_weights({"w": np.zeros((4, 3)), "b": np.zeros(3)}, weights, {"w": "dense/kernel"})
    with pytest.raises(ValueError, match=r"name_map maps target leaf 'w' to 'dense/kernl', which is not a Keras "
                                         "weight"):
        keras.assign_weights({"w": np.zeros((4, 3))}, weights, {"w": "dense/kernl"})
    with pytest.raises(ValueError, match=r"Keras weight 'dense/bias' is not assigned to any target leaf \(1 unused\); "
                                         r"map it in name_map, or pass strict=False"):
        keras.assign_weights({"w": np.zeros((4, 3))}, weights, {"w": "dense/kernel"})
    with pytest.raises(ValueError, match=r"target leaf 'dense/kernel' is int32, but Keras weight 'dense/kernel' is "
                                         "float32"):
        keras.assign_weights({"dense": {"kernel": np.zeros((4, 3), np.int32), "bias": np.zeros(3, np.float32)}},
                             weights)
