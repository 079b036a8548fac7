"""Writes the name-based (TF1 Saver) fixtures under tests/data/tf_name_based/.

Run by hand with TensorFlow (never imported by the package or the tests):

    /work/tfvenv/bin/python tests/data/make_tf_name_based_fixtures.py

Outputs:
- model.ckpt-1234.{index,data-00000-of-00001} and `checkpoint`: a `tf.compat.v1.train.Saver`
  checkpoint with scoped names, a partitioned variable (stored as slices), `global_step` and
  several dtypes.
- expected.json: every saved tensor's dtype, shape and values (flattened).
- init_from_checkpoint.json: what `tf.compat.v1.train.init_from_checkpoint` did for a set of
  assignment maps: the variables created (zeros, or ones when noted), and either every
  variable's value after initialization or the exception TF raised.
"""

import json
import os
import shutil

import numpy as np
import tensorflow as tf

v1 = tf.compat.v1
OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tf_name_based")
PREFIX = os.path.join(OUT, "model.ckpt")

rng = np.random.default_rng(5)
SAVED = {
    "bert/embeddings/word_embeddings": rng.standard_normal((6, 4)).astype(np.float32),
    "bert/embeddings/position_embeddings": np.arange(30, dtype=np.float32).reshape(10, 3) / 4,  # 3 partitions
    "bert/encoder/layer_0/kernel": rng.standard_normal((4, 4)).astype(np.float32),
    "bert/encoder/layer_0/bias": rng.standard_normal(4).astype(np.float32),
    "cls/weights": rng.standard_normal((4, 2)).astype(np.float32),
    "counts": np.array([3, -1, 7], np.int32),
    "scale": np.array([0.5, 1e-3], np.float64),
    "global_step": np.array(1234, np.int64),
}
PARTITIONED = {"bert/embeddings/position_embeddings": 3}


def _create(spec):
    """Variables from {name: {shape, dtype, parts, init}}; returns {name: variable or list of shards}."""
    out = {}
    for name, s in spec.items():
        init = v1.ones_initializer() if s.get("init") == "ones" else v1.zeros_initializer()
        part = v1.fixed_size_partitioner(s["parts"]) if s.get("parts") else None
        v = v1.get_variable(name, shape=s["shape"], dtype=s["dtype"], initializer=init, partitioner=part)
        out[name] = list(v) if part else v
    return out


def write_checkpoint():
    shutil.rmtree(OUT, ignore_errors=True)
    os.makedirs(OUT)
    with tf.Graph().as_default(), v1.Session() as sess:
        for name, value in SAVED.items():
            part = v1.fixed_size_partitioner(PARTITIONED[name]) if name in PARTITIONED else None
            v1.get_variable(name, initializer=tf.constant(value), partitioner=part,
                            trainable=name != "global_step")
        sess.run(v1.global_variables_initializer())
        v1.train.Saver().save(sess, PREFIX, global_step=1234, write_meta_graph=False)
    # TF's `checkpoint` file holds absolute paths; keep it relative so the fixture moves.
    with open(os.path.join(OUT, "checkpoint"), "w") as f:
        f.write('model_checkpoint_path: "model.ckpt-1234"\nall_model_checkpoint_paths: "model.ckpt-1234"\n')
    reader = tf.train.load_checkpoint(PREFIX + "-1234")
    expected = {}
    for name, value in SAVED.items():
        got = reader.get_tensor(name)
        assert got.dtype == value.dtype and np.array_equal(got, value), name
        expected[name] = {"dtype": str(value.dtype), "shape": list(value.shape), "values": value.ravel().tolist()}
    return expected


F32 = "float32"
CASES = {
    "scope_to_scope": {
        "map": [["bert/", "encoder/"]],
        "variables": {
            "encoder/embeddings/word_embeddings": {"shape": [6, 4], "dtype": F32},
            # Saved in 3 slices, restored into 2 shards: re-sliced from the reassembled tensor.
            "encoder/embeddings/position_embeddings": {"shape": [10, 3], "dtype": F32, "parts": 2},
            "encoder/encoder/layer_0/kernel": {"shape": [4, 4], "dtype": F32},
            "head/w": {"shape": [4, 2], "dtype": F32, "init": "ones"},  # outside the map: untouched
        },
    },
    "single_names": {
        "map": [["bert/encoder/layer_0/kernel", "dense/kernel"], ["cls/weights", "out/w"]],
        "variables": {
            "dense/kernel": {"shape": [4, 4], "dtype": F32},
            "out/w": {"shape": [4, 2], "dtype": F32},
            "dense/bias": {"shape": [4], "dtype": F32, "init": "ones"},
        },
    },
    "root_to_scope": {
        "map": [["/", "model/"]],
        "variables": {
            "model/cls/weights": {"shape": [4, 2], "dtype": F32},
            "model/counts": {"shape": [3], "dtype": "int32"},
        },
    },
    "scope_to_root": {
        "map": [["bert/", "/"]],
        "variables": {
            "embeddings/word_embeddings": {"shape": [6, 4], "dtype": F32},
            "encoder/layer_0/bias": {"shape": [4], "dtype": F32},
        },
    },
    "partitioned_by_name": {
        "map": [["bert/embeddings/position_embeddings", "pos"]],
        "variables": {"pos": {"shape": [10, 3], "dtype": F32, "parts": 4}},
    },
    "one_tensor_two_variables": {
        "map": [["cls/weights", "a/w"], ["cls/weights", "b/w"]],
        "variables": {"a/w": {"shape": [4, 2], "dtype": F32}, "b/w": {"shape": [4, 2], "dtype": F32}},
    },
    "error_shape_mismatch": {
        "map": [["cls/weights", "w"]],
        "variables": {"w": {"shape": [2, 4], "dtype": F32}},
    },
    "error_tensor_missing": {
        "map": [["bert/encoder/layer_9/kernel", "k"]],
        "variables": {"k": {"shape": [4, 4], "dtype": F32}},
    },
    "error_scope_tensor_missing": {
        "map": [["bert/", "enc/"]],
        "variables": {
            "enc/encoder/layer_0/bias": {"shape": [4], "dtype": F32},
            "enc/extra": {"shape": [2], "dtype": F32},
        },
    },
    "error_scope_to_name": {
        "map": [["bert", "enc/"]],
        "variables": {"enc/encoder/layer_0/bias": {"shape": [4], "dtype": F32}},
    },
    "error_dtype_mismatch": {
        "map": [["cls/weights", "w"]],
        "variables": {"w": {"shape": [4, 2], "dtype": "float64"}},
    },
}


def run_cases():
    results = {}
    for case, spec in CASES.items():
        out = dict(spec)
        with tf.Graph().as_default(), v1.Session() as sess:
            created = _create(spec["variables"])
            try:
                v1.train.init_from_checkpoint(PREFIX + "-1234", spec["map"])
                sess.run(v1.global_variables_initializer())
            except Exception as e:  # recorded: the tests check our error for the same case
                lines = [ln for ln in str(e).replace(OUT, "<dir>").splitlines() if ln.strip()]
                line = next((ln for ln in lines if "expected dtype" in ln), lines[0])
                out["error"] = {"type": type(e).__name__, "message": line.strip()[:300]}
            else:
                values = {}
                for name, v in created.items():
                    value = np.concatenate(sess.run(v)) if isinstance(v, list) else sess.run(v)
                    values[name] = value.ravel().tolist()
                out["result"] = values
        results[case] = out
    return results


if __name__ == "__main__":
    expected = write_checkpoint()
    with open(os.path.join(OUT, "expected.json"), "w") as f:
        json.dump(expected, f, indent=1)
    with open(os.path.join(OUT, "init_from_checkpoint.json"), "w") as f:
        json.dump(run_cases(), f, indent=1)
    print("wrote", sorted(os.listdir(OUT)))
