"""TF fixtures for tied weights and int64 values (TensorFlow, keras and numpy only; run by hand in the TF venv).

    /tmp/tfvenv/bin/python tests/data/make_tf_tied_int64_fixtures.py

It runs three steps, the middle one with OUR code in the repository's venv (VARSTATE_PYTHON, default
.venv/bin/python), because our int64 checkpoint is TF's checkpoint restored and saved back by us:

  1. TF writes, under tests/data/tf_checkpoints/:
     tf_tied/   TF's testAnonymousVarsInInit: a tf.Module holding `w` and `b` twice (as attributes and in the
                list `vars`), tf.compat.v1.train.AdamOptimizer(0.05), two steps of (1 - (w + b)) ** 2,
                tf.train.Checkpoint(model=..., optimizer=...).save().
     tf_int64/  int64 counters (a scalar `step` and a vector `counts`), a float64 `x`, a float32 `w`, an int64
                `plain`, and a Keras Adam that stepped `w` twice (its `iterations` is int64).
  2. write_ours_tied_int64_for_tf.py writes ours_tied/ (the same tied model trained by varstate's Adam) and
     ours_int64/ (tf_int64 restored into JAX's 32-bit Variables and saved back).
  3. TF restores ours_tied into a fresh model and v1 Adam, and ours_int64 into fresh int64/float64 variables and
     a built Keras Adam, each with assert_consumed(), and records what it got.

Writes tests/data/tf_checkpoints/tied_int64.json: for each checkpoint, per key dtype, shape and raw
little-endian bytes (hex), the object graph in text format, and for ours_* the values TF restored
("restored_by_tf": object path -> [dtype, hex]).
"""

import json
import os
import shutil
import subprocess
import sys

import keras
import numpy as np
import tensorflow as tf
from google.protobuf import text_format
from tensorflow.core.protobuf import trackable_object_graph_pb2

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
OUT = os.path.join(HERE, "tf_checkpoints")
OURS = os.environ.get("VARSTATE_PYTHON", os.path.join(REPO, ".venv", "bin", "python"))
TIED_LR, TIED_STEPS = 0.05, 2  # the same in write_ours_tied_int64_for_tf.py


def record(prefix: str) -> dict:
    """Everything tf.train.load_checkpoint sees in the checkpoint at `prefix`."""
    reader = tf.train.load_checkpoint(prefix)
    dtypes = reader.get_variable_to_dtype_map()
    out = {"tensors": {}, "object_graph": None}
    for key, shape in sorted(reader.get_variable_to_shape_map().items()):
        value = reader.get_tensor(key)
        if key == "_CHECKPOINTABLE_OBJECT_GRAPH":
            graph = trackable_object_graph_pb2.TrackableObjectGraph.FromString(value)
            out["object_graph"] = text_format.MessageToString(graph)
            continue
        value = np.asarray(value)
        out["tensors"][key] = {"dtype": dtypes[key].name, "shape": list(shape),
                               "hex": np.ascontiguousarray(value).astype(value.dtype.newbyteorder("<")).tobytes().hex()}
    return out


def fresh(name: str) -> str:
    path = os.path.join(OUT, name)
    shutil.rmtree(path, ignore_errors=True)
    os.makedirs(path)
    return path


def values(named: dict) -> dict:
    # tf.as_dtype: a Keras variable's dtype is a string.
    return {k: [tf.as_dtype(v.dtype).name, np.asarray(v.numpy()).tobytes().hex()] for k, v in named.items()}


def tied_model() -> tf.Module:
    model = tf.Module()
    model.w = tf.Variable(0.0)
    model.b = tf.Variable(0.0)
    model.vars = [model.w, model.b]
    return model


def tf_tied(expected: dict) -> None:
    model = tied_model()
    opt = tf.compat.v1.train.AdamOptimizer(learning_rate=TIED_LR)
    for _ in range(TIED_STEPS):
        with tf.GradientTape() as tape:
            loss = (tf.constant(1.0) - (tf.constant(1.0) * model.w + model.b)) ** 2
        grads = tape.gradient(loss, model.vars)
        opt.apply_gradients(zip(grads, model.vars, strict=True))
    path = tf.train.Checkpoint(model=model, optimizer=opt).save(os.path.join(fresh("tf_tied"), "ckpt"))
    expected["tf_tied"] = record(path)


def int64_model() -> tf.Module:
    m = tf.Module()
    m.step = tf.Variable(7, dtype=tf.int64)
    m.counts = tf.Variable([1, -2, 2**31 - 1], dtype=tf.int64)  # int32's largest: still held exactly
    m.x = tf.Variable(2.5, dtype=tf.float64)  # exact in float32, so the round trip keeps the value too
    m.w = tf.Variable([1.0, 2.0])
    m.plain = tf.Variable([3, 4], dtype=tf.int64)
    return m


def tf_int64(expected: dict) -> None:
    model = int64_model()
    opt = keras.optimizers.Adam(0.1)
    for _ in range(2):
        opt.apply_gradients([(tf.constant([0.5, -1.0]), model.w)])
    path = tf.train.Checkpoint(model=model, optimizer=opt).save(os.path.join(fresh("tf_int64"), "ckpt"))
    expected["tf_int64"] = record(path)


def restore_ours_tied(expected: dict) -> None:
    path = tf.train.latest_checkpoint(os.path.join(OUT, "ours_tied"))
    expected["ours_tied"] = record(path)
    model = tied_model()
    opt = tf.compat.v1.train.AdamOptimizer(learning_rate=TIED_LR)
    status = tf.train.Checkpoint(model=model, optimizer=opt).restore(path)
    status.assert_existing_objects_matched()
    opt._create_slots(model.vars)  # v1 Adam makes its slots on first use; a deferred restore fills them
    status.assert_consumed()
    beta1_power, beta2_power = opt._get_beta_accumulators()
    expected["ours_tied"]["restored_by_tf"] = values({
        "model/w": model.w, "model/b": model.b, "model/vars/0": model.vars[0],
        "model/w/.OPTIMIZER_SLOT/optimizer/m": opt.get_slot(model.w, "m"),
        "model/w/.OPTIMIZER_SLOT/optimizer/v": opt.get_slot(model.w, "v"),
        "model/b/.OPTIMIZER_SLOT/optimizer/m": opt.get_slot(model.b, "m"),
        "model/b/.OPTIMIZER_SLOT/optimizer/v": opt.get_slot(model.b, "v"),
        "optimizer/beta1_power": beta1_power, "optimizer/beta2_power": beta2_power,
    })


def restore_ours_int64(expected: dict) -> None:
    """TF refuses an int32 value for an int64 variable: this restore needs every dtype kept."""
    path = tf.train.latest_checkpoint(os.path.join(OUT, "ours_int64"))
    expected["ours_int64"] = record(path)
    model = int64_model()
    for v in model.trainable_variables:
        v.assign(tf.zeros_like(v))
    opt = keras.optimizers.Adam(0.1)
    opt.build([model.w])
    tf.train.Checkpoint(model=model, optimizer=opt).restore(path).assert_consumed()
    expected["ours_int64"]["restored_by_tf"] = values({
        "model/step": model.step, "model/counts": model.counts, "model/x": model.x, "model/w": model.w,
        "model/plain": model.plain, "optimizer/_iterations": opt.iterations,
        "optimizer/_learning_rate": opt.learning_rate,
        "optimizer/_variables/2": opt.variables[2], "optimizer/_variables/3": opt.variables[3],
    })


def main() -> None:
    expected = {"tensorflow_version": tf.__version__, "keras_version": keras.__version__}
    tf_tied(expected)
    tf_int64(expected)
    subprocess.run([OURS, os.path.join(HERE, "write_ours_tied_int64_for_tf.py")], check=True, cwd=REPO)
    restore_ours_tied(expected)
    restore_ours_int64(expected)
    with open(os.path.join(OUT, "tied_int64.json"), "w") as f:
        json.dump(expected, f, indent=1, sort_keys=True)
    print(f"wrote {os.path.join(OUT, 'tied_int64.json')}", file=sys.stderr)


if __name__ == "__main__":
    main()
