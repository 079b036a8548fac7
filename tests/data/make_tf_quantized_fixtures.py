"""TF's quantized dtypes, both ways: TF writes checkpoints for us to read, and checks the ones we write back.

Run by hand, in three steps (TensorFlow only in steps 1 and 3; never imported by the package or tests):

    /tmp/tfvenv/bin/python tests/data/make_tf_quantized_fixtures.py write   # 1: TF's checkpoints
    .venv/bin/python tests/data/write_quantized_ours.py                     # 2: ours, from what we read
    /tmp/tfvenv/bin/python tests/data/make_tf_quantized_fixtures.py check   # 3: TF reads ours

Outputs under tests/data/tf_quantized/:
- tf_object-1.*: `tf.train.Checkpoint` of tf.Variables of dtype qint8, quint8 and qint32 (TF has no
  AssignVariableOp for qint16/quint16) and a float32 one.
- tf_name.*: the five quantized types (qint8, quint8, qint16, quint16, qint32) written by `SaveV2`,
  as a name-based checkpoint.
- expected.json: each key's TF dtype, shape and integer values.
- ours_object-1.*, ours_name.*: step 2's files (read by `read_checkpoint`, written back by `write_bundle`).
- tf_readback.json: step 3, what TF saw in ours: `load_checkpoint`'s dtypes and values, `RestoreV2`
  with the quantized dtypes (it refuses a dtype that differs), and `tf.train.Checkpoint.restore` into
  quantized tf.Variables with `assert_consumed()`.
"""

import json
import os
import sys

import numpy as np
import tensorflow as tf

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tf_quantized")
TYPES = {"qint8": tf.qint8, "quint8": tf.quint8, "qint16": tf.qint16, "quint16": tf.quint16, "qint32": tf.qint32}
VARIABLE_TYPES = ("qint8", "quint8", "qint32")  # the ones a resource variable can hold in TF 2.21


def values(name):
    info = np.iinfo(TYPES[name].as_numpy_dtype[0])  # the storage of TF's structured numpy dtype
    return np.array([[info.min, -1 if info.min else 0, 0], [1, 7, info.max]], info.dtype)


def _plain(a):
    a = np.asarray(a)
    return a.view(a.dtype[0]) if a.dtype.names else a  # TF's quantized numpy dtypes are structured


def variables():
    out = {n: tf.Variable(tf.constant(values(n).view(TYPES[n].as_numpy_dtype), dtype=TYPES[n]))
           for n in VARIABLE_TYPES}
    out["f"] = tf.Variable([0.5, -2.0])
    return out


def write():
    os.makedirs(OUT, exist_ok=True)
    ckpt = tf.train.Checkpoint(**variables())
    path = ckpt.write(os.path.join(OUT, "tf_object-1"))
    names = list(TYPES)
    tensors = [tf.constant(values(n).view(TYPES[n].as_numpy_dtype), dtype=TYPES[n]) for n in names]
    tf.raw_ops.SaveV2(prefix=os.path.join(OUT, "tf_name"), tensor_names=names, shape_and_slices=[""] * len(names),
                      tensors=tensors)
    expected = {}
    for prefix in (path, os.path.join(OUT, "tf_name")):
        reader = tf.train.load_checkpoint(prefix)
        for key, dtype in reader.get_variable_to_dtype_map().items():
            if dtype == tf.string:
                continue
            v = _plain(reader.get_tensor(key))
            expected[f"{os.path.basename(prefix)}:{key}"] = {
                "dtype": dtype.name, "shape": list(v.shape), "values": v.ravel().tolist()}
    with open(os.path.join(OUT, "expected.json"), "w") as f:
        json.dump(expected, f, indent=1, sort_keys=True)


def check():
    seen = {}
    for prefix in ("ours_object-1", "ours_name"):
        reader = tf.train.load_checkpoint(os.path.join(OUT, prefix))
        for key, dtype in reader.get_variable_to_dtype_map().items():
            if dtype == tf.string:
                continue
            v = _plain(reader.get_tensor(key))
            seen[f"load_checkpoint {prefix}:{key}"] = {"dtype": dtype.name, "values": v.ravel().tolist()}
    names = list(TYPES)
    restored = tf.raw_ops.RestoreV2(prefix=os.path.join(OUT, "ours_name"), tensor_names=names,
                                    shape_and_slices=[""] * len(names), dtypes=[TYPES[n] for n in names])
    for n, t in zip(names, restored, strict=True):
        seen[f"RestoreV2 ours_name:{n}"] = {"dtype": t.dtype.name, "values": _plain(t.numpy()).ravel().tolist()}
    target = variables()
    for v in target.values():
        v.assign(tf.zeros_like(v)) if v.dtype == tf.float32 else None
    tf.train.Checkpoint(**target).read(os.path.join(OUT, "ours_object-1")).assert_consumed()
    for n, v in target.items():
        seen[f"Checkpoint.read ours_object-1:{n}"] = {
            "dtype": v.dtype.name, "values": _plain(v.numpy()).ravel().tolist()}
    with open(os.path.join(OUT, "tf_readback.json"), "w") as f:
        json.dump(seen, f, indent=1, sort_keys=True)


if __name__ == "__main__":
    {"write": write, "check": check}[sys.argv[1]]()
