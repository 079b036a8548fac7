"""Restore TensorFlow checkpoints into flax nnx models, without TensorFlow.

    .venv/bin/python examples/tf_checkpoint_into_nnx.py

1. A tf-keras model's `save_weights` checkpoint (a TF TensorBundle) into an nnx MLP whose attributes are
   the Keras layer names: the nnx model then gives the outputs Keras recorded for a probe batch.
2. A `tf.train.Checkpoint` of a `tf.Module` into an nnx Module of the same structure, matched by
   object-graph path (`model/kernel`, `model/layers/0`), as TF itself restores.
"""

import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import checkpoint
from checkpoint import keras

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "data")


class MLP(nnx.Module):  # tf_keras: Dense(3, relu, "dense") -> Dense(3, no bias, "proj") -> Dense(2, "out")
    def __init__(self, rngs: nnx.Rngs):
        self.dense = nnx.Linear(4, 3, rngs=rngs)
        self.proj = nnx.Linear(3, 3, use_bias=False, rngs=rngs)
        self.out = nnx.Linear(3, 2, rngs=rngs)

    def __call__(self, x):
        return self.out(self.proj(jax.nn.relu(self.dense(x))))


class Model(nnx.Module):  # the tf.Module: kernel, bias, a list holding `scale`, `nested` reaching kernel again
    def __init__(self):
        self.kernel = nnx.Param(jnp.zeros((2, 3)))
        self.bias = nnx.Param(jnp.zeros(3))
        self.layers = nnx.List([nnx.Param(jnp.zeros(()))])
        self.nested = nnx.Dict(deep=self.kernel)


def keras_checkpoint() -> bool:
    weights = keras.load_weights(os.path.join(DATA, "keras_weights", "tf_keras", "mlp"))
    model = keras.assign_weights(MLP(nnx.Rngs(0)), weights)  # by name: dense/kernel, proj/kernel, out/bias...
    with open(os.path.join(DATA, "keras_weights", "expected.json")) as f:
        recorded = json.load(f)["models"]["tf_keras/mlp"]
    got = model(jnp.asarray(recorded["probe"]))
    print(f"   layers {list(weights)}; outputs {np.asarray(got, np.float64).round(4).tolist()}")
    return bool(np.allclose(got, recorded["outputs"], atol=1e-6))


def object_graph_checkpoint() -> bool:
    status = checkpoint.Checkpoint(model=Model()).restore(os.path.join(DATA, "tf_object_graph", "ckpt-1"))
    status.assert_existing_objects_matched().expect_partial()  # the optimizer's slots stay in the file
    model = status.model
    with open(os.path.join(DATA, "tf_object_graph", "graph.json")) as f:
        tf_values = json.load(f)["values"]
    want = tf_values["model/kernel/.ATTRIBUTES/VARIABLE_VALUE"]["values"]
    print(f"   kernel {np.asarray(model.kernel[...], np.float64).ravel().round(4).tolist()}, "
          f"scale {float(model.layers[0][...]):.4f}")
    return bool(np.array_equal(np.asarray(model.kernel[...]).ravel(), np.float32(want))
                and model.nested["deep"] is model.kernel)


if __name__ == "__main__":
    print("== a tf-keras save_weights checkpoint into an nnx MLP")
    a = keras_checkpoint()
    print("== a tf.train.Checkpoint of a tf.Module into an nnx Module")
    b = object_graph_checkpoint()
    print("OK: the nnx models hold TF's values" if a and b else "MISMATCH")
    sys.exit(0 if a and b else 1)
