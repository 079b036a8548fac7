"""Step 2 of the write_name_based fixture: TensorFlow reads our name-based checkpoint (run in the TF venv).

    /tmp/tfvenv/bin/python tests/data/make_tf_name_based_readback.py

Records in tests/data/tf_name_based_ours/tf_readback.json what TF 2.21 saw:
  load_checkpoint: every key's dtype, shape and values through `tf.train.load_checkpoint`;
  saver_same / saver_other: the values TF1's `Saver.restore` put into variables partitioned as saved
  (3 shards) and otherwise (2 shards), read back as full tensors.
"""

import json
import os

import numpy as np
import tensorflow as tf

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tf_name_based_ours")
PREFIX = os.path.join(HERE, "model.ckpt")
v1 = tf.compat.v1


def saver_restore(shards: int) -> dict:
    graph = tf.Graph()
    with graph.as_default():
        kernel = v1.get_variable("model/dense/kernel", shape=(2, 3), dtype=tf.float32)
        step = v1.get_variable("global_step", shape=(), dtype=tf.int64)
        emb = v1.get_variable("model/emb", shape=(7, 4), dtype=tf.float32,
                              partitioner=v1.fixed_size_partitioner(shards))
        with v1.Session(graph=graph) as sess:
            v1.train.Saver().restore(sess, PREFIX)
            k, s, e = sess.run([kernel, step, tf.concat(list(emb), axis=0)])
    return {"model/dense/kernel": k.tolist(), "global_step": int(s), "model/emb": e.tolist()}


def main() -> None:
    reader = tf.train.load_checkpoint(PREFIX)
    shapes, dtypes = reader.get_variable_to_shape_map(), reader.get_variable_to_dtype_map()
    out = {"tensorflow": tf.__version__, "load_checkpoint": {
        k: {"dtype": dtypes[k].name, "shape": list(shapes[k]), "value": np.asarray(reader.get_tensor(k)).tolist()}
        for k in sorted(shapes)}}
    out["saver_same"] = saver_restore(3)
    out["saver_other"] = saver_restore(2)
    with open(os.path.join(HERE, "tf_readback.json"), "w") as f:
        json.dump(out, f, indent=1)
    print(json.dumps(out)[:300])


if __name__ == "__main__":
    main()
