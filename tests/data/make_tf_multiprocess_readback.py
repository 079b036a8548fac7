"""Step 2 of the multi-process TF fixture, run in the TensorFlow venv: what TF reads from our 2-process bundle.

    /tmp/tfvenv/bin/python tests/data/make_tf_multiprocess_readback.py

Reads every key of tests/data/tf_multiprocess/ckpt with tf.train.load_checkpoint
(TF's BundleReader: the merged index, both data files, slices assembled) and
writes the values and shapes it saw to tests/data/tf_multiprocess/tf_read.json.
"""

import json
import os

import tensorflow as tf

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tf_multiprocess")

if __name__ == "__main__":
    reader = tf.train.load_checkpoint(os.path.join(OUT, "ckpt"))
    seen = {}
    for key, shape in sorted(reader.get_variable_to_shape_map().items()):
        if key == "_CHECKPOINTABLE_OBJECT_GRAPH":
            continue
        value = reader.get_tensor(key)
        seen[key] = {"shape": list(shape), "dtype": str(value.dtype), "value": value.tolist()}
    with open(os.path.join(OUT, "tf_read.json"), "w") as f:
        json.dump({"tensorflow": tf.__version__, "tensors": seen}, f, indent=1, sort_keys=True)
    print(sorted(seen))
