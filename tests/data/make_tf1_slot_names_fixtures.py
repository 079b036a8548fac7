"""Writes the TF1 slot-name fixtures under tests/data/tf1_slot_names/.

Run by hand with TensorFlow (never imported by the package or the tests):

    /tmp/tfvenv/bin/python tests/data/make_tf1_slot_names_fixtures.py

Outputs:
- <config>/model.ckpt-3.{index,data-00000-of-00001}: for each TF1 optimizer config, a graph-mode
  `tf.compat.v1.train.Saver` checkpoint of `dense/kernel`, `dense/bias`, a 2-way partitioned `emb`,
  `global_step` and the optimizer's slot and non-slot variables (TF's own names: `<var>/Adam`,
  `<var>/Adam_1`, `beta1_power`, ...), saved after 3 steps of fed gradients. adam_scoped ran
  `apply_gradients` under `variable_scope("train")`: `train/dense/kernel/Adam`, `train/beta1_power`.
- expected.json: per config, the optimizer's arguments, the checkpoint's keys, the gradients of
  step 4 and every saved variable's value after TF ran step 4 from that checkpoint.
- keras/ckpt-1.*: a tf_keras model named `lstm_model` (one Dense layer named `dense`) saved
  object-based by `tf.train.Checkpoint`; its object graph carries the `full_name` attributes
  `lstm_model/dense/kernel` and `lstm_model/dense/bias`. keras.json: the values and full names.
"""

import json
import os
import shutil

import numpy as np
import tensorflow as tf

v1 = tf.compat.v1
OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tf1_slot_names")

SHAPES = {"dense/kernel": (3, 2), "dense/bias": (2,), "emb": (5, 2)}
PARTS = {"emb": 2}

CONFIGS = {
    "adam": ("AdamOptimizer", {"learning_rate": 0.1, "beta1": 0.8, "beta2": 0.9, "epsilon": 1e-3}),
    "momentum": ("MomentumOptimizer", {"learning_rate": 0.1, "momentum": 0.9}),
    "rmsprop": ("RMSPropOptimizer", {"learning_rate": 0.05, "decay": 0.8, "momentum": 0.5, "epsilon": 1e-3}),
    "rmsprop_centered": ("RMSPropOptimizer", {"learning_rate": 0.05, "decay": 0.8, "momentum": 0.5,
                                              "epsilon": 1e-3, "centered": True}),
    "adagrad": ("AdagradOptimizer", {"learning_rate": 0.1, "initial_accumulator_value": 0.2}),
    "adadelta": ("AdadeltaOptimizer", {"learning_rate": 0.5, "rho": 0.9, "epsilon": 1e-3}),
    "ftrl": ("FtrlOptimizer", {"learning_rate": 0.1, "initial_accumulator_value": 0.2,
                               "l1_regularization_strength": 0.01, "l2_regularization_strength": 0.02}),
    "adagrad_da": ("AdagradDAOptimizer", {"learning_rate": 0.1, "initial_gradient_squared_accumulator_value": 0.2,
                                          "l2_regularization_strength": 0.01}),
    "proximal_adagrad": ("ProximalAdagradOptimizer", {"learning_rate": 0.1, "initial_accumulator_value": 0.2,
                                                      "l1_regularization_strength": 0.01}),
    # Slots and non-slots made under a variable scope take its name: train/dense/kernel/Adam, train/beta1_power.
    "adam_scoped": ("AdamOptimizer", {"learning_rate": 0.1, "beta1": 0.8, "beta2": 0.9, "epsilon": 1e-3}),
}
SCOPES = {"adam_scoped": "train"}


def _grads(rng):
    return {n: rng.standard_normal(s).astype(np.float32) for n, s in SHAPES.items()}


def run(config, cls, kwargs):
    rng = np.random.default_rng(sorted(CONFIGS).index(config))
    out = os.path.join(OUT, config)
    os.makedirs(out)
    init = {n: rng.standard_normal(s).astype(np.float32) for n, s in SHAPES.items()}
    # Under a variable scope TF1 misnames a partitioned variable's slots (`emb/art_0/Adam`: slot_creator cuts
    # the primary's name off the scoped slot name), each shard's its own partial tensor: not partitioned there.
    parts = {} if config in SCOPES else PARTS
    with tf.Graph().as_default(), v1.Session() as sess:
        gs = v1.train.get_or_create_global_step()
        variables = {}
        for name, value in init.items():
            part = v1.fixed_size_partitioner(parts[name]) if name in parts else None
            variables[name] = v1.get_variable(name, initializer=tf.constant(value), partitioner=part)
        args = dict(kwargs)
        if cls == "AdagradDAOptimizer":
            args["global_step"] = gs
        opt = getattr(v1.train, cls)(**args)
        feeds, pairs = {}, []
        for name, var in variables.items():
            if name in parts:
                rows = [0, *np.cumsum([int(s.shape[0]) for s in var])]
                for k, shard in enumerate(var):
                    ph = v1.placeholder(tf.float32, shard.shape)
                    feeds[ph] = (name, slice(rows[k], rows[k + 1]))
                    pairs.append((ph, shard))
            else:
                ph = v1.placeholder(tf.float32, var.shape)
                feeds[ph] = (name, slice(None))
                pairs.append((ph, var))
        with v1.variable_scope(SCOPES.get(config, "")):
            train = opt.apply_gradients(pairs, global_step=gs)
        sess.run(v1.global_variables_initializer())

        def step(grads):
            sess.run(train, {ph: grads[n][s] for ph, (n, s) in feeds.items()})

        for _ in range(3):
            step(_grads(rng))
        saver = v1.train.Saver()
        prefix = saver.save(sess, os.path.join(out, "model.ckpt"), global_step=gs, write_meta_graph=False)
        keys = sorted(tf.train.load_checkpoint(prefix).get_variable_to_shape_map())
        next_grads = _grads(rng)
        step(next_grads)
        after = {}
        by_name = {}
        for v in v1.global_variables():
            info = v._save_slice_info
            name = info.full_name if info is not None else v.op.name
            by_name.setdefault(name, []).append(v)
        for name, found in by_name.items():
            values = sess.run(found)
            value = values[0] if len(values) == 1 else np.concatenate(values, axis=0)
            after[name] = {"dtype": str(value.dtype), "shape": list(np.shape(value)),
                           "values": np.ravel(value).tolist()}
        assert sorted(after) == keys, (sorted(after), keys)
    os.remove(os.path.join(out, "checkpoint"))  # absolute paths; the tests name the prefix
    return {
        "optimizer": cls, "kwargs": kwargs, "keys": keys, "scope": SCOPES.get(config, ""),
        "next_grads": {n: g.ravel().tolist() for n, g in next_grads.items()},
        "shapes": {n: list(s) for n, s in SHAPES.items()}, "parts": parts, "after": after,
    }


def keras_fixture():
    import tf_keras
    from tensorflow.core.protobuf import trackable_object_graph_pb2

    class LstmModel(tf_keras.Model):
        def __init__(self):
            super().__init__(name="lstm_model")
            self.dense = tf_keras.layers.Dense(2, name="dense")

        def call(self, x):
            return self.dense(x)

    tf.random.set_seed(3)
    model = LstmModel()
    model(tf.ones((1, 3)))
    out = os.path.join(OUT, "keras")
    os.makedirs(out)
    prefix = tf.train.Checkpoint(model=model).save(os.path.join(out, "ckpt"))
    os.remove(os.path.join(out, "checkpoint"))
    reader = tf.train.load_checkpoint(prefix)
    graph = trackable_object_graph_pb2.TrackableObjectGraph()
    graph.ParseFromString(reader.get_tensor("_CHECKPOINTABLE_OBJECT_GRAPH"))
    full_names = {a.full_name: a.checkpoint_key for n in graph.nodes for a in n.attributes}
    assert {"lstm_model/dense/kernel", "lstm_model/dense/bias"} <= set(full_names), full_names
    values = {v.name.removesuffix(":0"): v.numpy().ravel().tolist() for v in model.weights}
    return {"prefix": os.path.basename(prefix), "full_names": full_names, "values": values}


def main():
    shutil.rmtree(OUT, ignore_errors=True)
    os.makedirs(OUT)
    expected = {config: run(config, cls, kwargs) for config, (cls, kwargs) in CONFIGS.items()}
    with open(os.path.join(OUT, "expected.json"), "w") as f:
        json.dump(expected, f, indent=1, sort_keys=True)
    with open(os.path.join(OUT, "keras.json"), "w") as f:
        json.dump(keras_fixture(), f, indent=1, sort_keys=True)


if __name__ == "__main__":
    main()
