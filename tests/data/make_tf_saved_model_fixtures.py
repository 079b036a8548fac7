"""Writes the SavedModel fixtures under tests/data/tf_saved_model/.

Run by hand with TensorFlow 2.21 and Keras 3 (never imported by the package or the tests):

    /tmp/tfvenv/bin/python tests/data/make_tf_saved_model_fixtures.py

Two SavedModels, each with what TF itself reads back from it:

- module/: a tf.Module saved with tf.saved_model.save: a float32 matrix `w`, an int64
  vector `b`, a submodule holding a scalar `s` (non-trainable), a string variable `tag`,
  an Asset `vocab` (assets/vocab.txt), a tf.function `__call__` exported under two
  signatures ("serving_default" and "scaled", dict outputs of two dtypes).
- keras_export/: a Keras 3 functional model (Dense, BatchNormalization with non-trivial
  moving statistics, Dense) exported with `model.export(path)`.

Outputs, per SavedModel, in expected.json (everything recorded from TF's own view):
- "nodes": per node id its first breadth-first path (parts escaped as in checkpoint keys),
  its kind (SavedObject's oneof), the user object's identifier, and a variable's name,
  dtype, shape and trainable flag;
- "variables": per variable path, dtype, shape and values read from the restored object
  (`tf.saved_model.load`), strings as text;
- "signatures": per name, method name and inputs / outputs (name -> dtype, shape with
  null for an unknown dimension, graph tensor name);
- "assets": per asset path, the file name under assets/ and the file's text;
- "tags", "tensorflow_version".
"""

import json
import os
import shutil
import tempfile

import numpy as np

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
import keras
import tensorflow as tf
from tensorflow.core.protobuf import saved_model_pb2

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tf_saved_model")


class Module(tf.Module):
    def __init__(self, vocab_path):
        super().__init__()
        self.w = tf.Variable(np.arange(6, dtype=np.float32).reshape(2, 3) / 8 - 0.25, name="w")
        self.b = tf.Variable(np.array([3, -1, 7], np.int64), name="b")
        self.sub = tf.Module()
        self.sub.s = tf.Variable(1.5, name="s", trainable=False)
        self.tag = tf.Variable("v1", name="tag")
        self.vocab = tf.saved_model.Asset(vocab_path)

    @tf.function(input_signature=[tf.TensorSpec([None, 2], tf.float32, name="x")])
    def __call__(self, x):
        return {"y": tf.matmul(x, self.w) * self.sub.s, "rows": tf.shape(x)[0] + tf.cast(self.b[0], tf.int32)}


def _escape(name):
    return name.replace(".", "..").replace("/", ".S")


def _paths(nodes):
    paths, queue = {0: ""}, [0]
    while queue:
        i = queue.pop(0)
        for ref in nodes[i].children:
            if ref.node_id not in paths:
                paths[ref.node_id] = (paths[i] + "/" if paths[i] else "") + _escape(ref.local_name)
                queue.append(ref.node_id)
    return paths


def _follow(obj, path):
    for part in path.split("/"):
        part = part.replace(".S", "/").replace("..", ".")
        obj = obj[int(part)] if isinstance(obj, (list, tuple)) else getattr(obj, part)
    return obj


def _spec(info):
    shape = None if info.tensor_shape.unknown_rank else [d.size if d.size >= 0 else None for d in info.tensor_shape.dim]
    return {"dtype": tf.as_dtype(info.dtype).name if info.dtype else None, "shape": shape, "tensor": info.name}


def _record(path):
    sm = saved_model_pb2.SavedModel()
    with open(os.path.join(path, "saved_model.pb"), "rb") as f:
        sm.ParseFromString(f.read())
    mg = sm.meta_graphs[0]
    nodes = mg.object_graph_def.nodes
    paths = _paths(nodes)
    loaded = tf.saved_model.load(path)
    out = {"tags": list(mg.meta_info_def.tags), "tensorflow_version": mg.meta_info_def.tensorflow_version}
    out["nodes"], out["variables"], out["assets"] = [], {}, {}
    for i, node in enumerate(nodes):
        kind = node.WhichOneof("kind")
        entry = {"path": paths.get(i), "kind": kind}
        if kind == "user_object":
            entry["identifier"] = node.user_object.identifier
        if kind == "variable":
            v = node.variable
            entry.update(name=v.name, dtype=tf.as_dtype(v.dtype).name, shape=[d.size for d in v.shape.dim],
                         trainable=v.trainable)
            value = np.asarray(_follow(loaded, paths[i]).numpy())
            if value.dtype.kind in "OS":
                values = [x.decode() for x in value.ravel()]
            else:
                values = value.ravel().tolist()
            out["variables"][paths[i]] = {"dtype": tf.as_dtype(v.dtype).name, "shape": list(value.shape),
                                          "values": values}
        if kind == "asset":
            asset_file = mg.asset_file_def[node.asset.asset_file_def_index].filename
            restored = _follow(loaded, paths[i]).asset_path.numpy().decode()
            with open(restored) as f:
                out["assets"][paths[i]] = {"filename": asset_file, "text": f.read()}
        out["nodes"].append(entry)
    out["signatures"] = {
        name: {
            "method_name": sig.method_name,
            "inputs": {k: _spec(v) for k, v in sorted(sig.inputs.items())},
            "outputs": {k: _spec(v) for k, v in sorted(sig.outputs.items())},
        }
        for name, sig in sorted(mg.signature_def.items())
    }
    # TF's own loader agrees on the signature names it serves (the init op is not one of them).
    assert set(loaded.signatures) == {n for n in out["signatures"] if n != "__saved_model_init_op"}
    return out


def main():
    shutil.rmtree(OUT, ignore_errors=True)
    os.makedirs(OUT)
    expected = {}

    src_dir = tempfile.mkdtemp()
    vocab_src = os.path.join(src_dir, "vocab.txt")
    with open(vocab_src, "w") as f:
        f.write("alpha\nbeta\n")
    module = Module(vocab_src)
    path = os.path.join(OUT, "module")
    tf.saved_model.save(module, path, signatures={
        "serving_default": module.__call__,
        "scaled": module.__call__.get_concrete_function(),
    })
    shutil.rmtree(src_dir)
    expected["module"] = _record(path)

    keras.utils.set_random_seed(3)
    inp = keras.Input((4,), name="features")
    x = keras.layers.Dense(3, name="dense")(inp)
    x = keras.layers.BatchNormalization(name="bn")(x)
    model = keras.Model(inp, keras.layers.Dense(2, name="out")(x))
    bn = model.get_layer("bn")
    bn.set_weights([np.array([1.5, 0.5, 2.0], np.float32), np.array([0.1, -0.2, 0.3], np.float32),
                    np.array([0.25, -0.5, 1.0], np.float32), np.array([2.0, 0.5, 4.0], np.float32)])
    path = os.path.join(OUT, "keras_export")
    model.export(path, verbose=False)
    expected["keras_export"] = _record(path)
    probe = np.linspace(-1, 1, 8, dtype=np.float32).reshape(2, 4)
    expected["keras_export"]["probe"] = {"inputs": probe.tolist(), "outputs": model(probe).numpy().tolist()}

    for name in ("module", "keras_export"):
        fingerprint = os.path.join(OUT, name, "fingerprint.pb")
        if os.path.exists(fingerprint):
            os.remove(fingerprint)  # not read by our reader; one file fewer to commit
    with open(os.path.join(OUT, "expected.json"), "w") as f:
        json.dump(expected, f, indent=1, sort_keys=True)
    for name in expected:
        print(name, len(expected[name]["nodes"]), "nodes,", len(expected[name]["variables"]), "variables")


if __name__ == "__main__":
    main()
