"""Step 1 of the write_name_based fixture: a name-based checkpoint written by OUR code, for TensorFlow to read.

Run by hand from the repository root, then step 2 in the TensorFlow venv:

    .venv/bin/python tests/data/write_name_based_for_tf.py
    /tmp/tfvenv/bin/python tests/data/make_tf_name_based_readback.py

Writes tests/data/tf_name_based_ours/model.ckpt.{index,data-00000-of-00001}: `checkpoint.write_name_based`
of a plain float32 kernel, an int64 global step, and a PartitionedVariable of 3 shards (TF1 Saver's slices).
"""

import os

import jax.numpy as jnp
import numpy as np

import checkpoint
import varstate

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tf_name_based_ours")


def tensors() -> dict:
    emb = varstate.PartitionedVariable(jnp.arange(28, dtype=jnp.float32).reshape(7, 4) / 8, name="model/emb",
                                       num_shards=3, registry=varstate.Registry())
    return {
        "model/dense/kernel": np.linspace(-1, 1, 6, dtype=np.float32).reshape(2, 3),
        "global_step": np.int64(1234),
        "model/emb": emb,
    }


if __name__ == "__main__":
    os.makedirs(OUT, exist_ok=True)
    checkpoint.write_name_based(os.path.join(OUT, "model.ckpt"), tensors())
    print("wrote", OUT)
