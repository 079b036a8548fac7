"""Keras 3 optimizer fixtures: every optimizer's steps on dense and sparse gradients, and Keras checkpoints.

Run by hand from the repository root in the TensorFlow venv (TF 2.21, Keras 3.15, TF backend, CPU):

    /tmp/tfvenv/bin/python tests/data/make_keras_optimizer_fixtures.py

then `.venv/bin/python tests/data/keras_roundtrip_readback.py ours` and
`/tmp/tfvenv/bin/python tests/data/keras_roundtrip_readback.py keras` (the round trip's second half).

Writes under tests/data/keras_optimizers/:
  steps.npz     the gradients of STEPS steps (dense kernel/bias, sparse rows of emb with a duplicate index)
                and, per optimizer config, the initial values and, after every step, the params and every
                optimizer variable, by Keras's index: "<config>/<step>/param/<name>", "<config>/<step>/opt/<i>".
  meta.json     per config: the constructor's arguments, and each optimizer variable's path, name and dtype.
  keras3/<config>/ckpt   `tf.train.Checkpoint(optimizer=opt).write` after N_FIRST steps (Keras 3's
                layout: optimizer/_iterations, _learning_rate, _variables/N, _trainable_variables/i).
  keras3_h5/adam.weights.h5   a compiled Sequential (Dense, BatchNormalization, Dense) after N_FIRST
                Adam(amsgrad) steps, `model.save_weights`: Keras 3's optimizer/vars/N; values "h5/adam/opt/<i>";
                adam.keras: the same model's `model.save` (weights inside the archive);
                then 2 steps of the gradients "h5/grad/<step>/<i>": "h5/adam/after/{opt,weight}/<i>".
  tf_keras2/<config>/ckpt   tf.keras 2 (tf-keras optimizer_v2) `tf.train.Checkpoint(model={kernel, bias, emb},
                optimizer=opt).write` after N_FIRST steps; its values in steps.npz as "v2/<config>/...".

Keras runs eagerly, op by op (no tf.function, no XLA), so each value is TF's kernels' result.
"""

import json
import os
import shutil

os.environ["KERAS_BACKEND"] = "tensorflow"
os.environ["CUDA_VISIBLE_DEVICES"] = ""

import keras
import numpy as np
import tensorflow as tf

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "keras_optimizers")
STEPS = 7  # N_FIRST in Keras, then M in varstate, then the rest in Keras again
N_FIRST = 3
SHAPES = {"kernel": (3, 2), "bias": (2,), "emb": (5, 3)}
ROWS = 4  # sparse rows per step for emb; the first and third share an index

CONFIGS = {
    "sgd": ("SGD", {"learning_rate": 0.1}),
    "sgd_momentum": ("SGD", {"learning_rate": 0.1, "momentum": 0.9}),
    "sgd_nesterov": ("SGD", {"learning_rate": 0.05, "momentum": 0.8, "nesterov": True}),
    "adam": ("Adam", {"learning_rate": 0.01}),
    "adam_amsgrad": ("Adam", {"learning_rate": 0.02, "beta_1": 0.8, "amsgrad": True}),
    "adam_schedule": ("Adam", {"learning_rate": "exponential_decay"}),
    "adamw": ("AdamW", {"learning_rate": 0.01, "weight_decay": 0.1}),
    "rmsprop": ("RMSprop", {"learning_rate": 0.01}),
    "rmsprop_centered": ("RMSprop", {"learning_rate": 0.01, "rho": 0.8, "momentum": 0.5, "centered": True}),
    "adagrad": ("Adagrad", {"learning_rate": 0.1}),
    "adadelta": ("Adadelta", {"learning_rate": 1.0, "rho": 0.9}),
    "adamax": ("Adamax", {"learning_rate": 0.01}),
    "nadam": ("Nadam", {"learning_rate": 0.01}),
    "lion": ("Lion", {"learning_rate": 0.01}),
    "ftrl": ("Ftrl", {"learning_rate": 0.1}),
    "ftrl_regularized": ("Ftrl", {"learning_rate": 0.1, "learning_rate_power": -0.6, "l1_regularization_strength": 0.01,
                                  "l2_regularization_strength": 0.02, "l2_shrinkage_regularization_strength": 0.03,
                                  "beta": 0.5}),
}
# learning_rate="exponential_decay": ExponentialDecay(0.01, decay_steps=2, decay_rate=0.5)

# tf.keras 2 (tf-keras's optimizer_v2, "legacy"): slots under .OPTIMIZER_SLOT, counter "iter".
V2_CONFIGS = {
    "adam": ("Adam", {"learning_rate": 0.01, "amsgrad": True}),
    "sgd_momentum": ("SGD", {"learning_rate": 0.1, "momentum": 0.9}),
    "rmsprop_centered": ("RMSprop", {"learning_rate": 0.01, "rho": 0.8, "momentum": 0.5, "centered": True}),
    "adadelta": ("Adadelta", {"learning_rate": 1.0, "rho": 0.9}),
}


def make_optimizer(config: str):
    cls, kwargs = CONFIGS[config]
    kwargs = dict(kwargs)
    if kwargs["learning_rate"] == "exponential_decay":
        kwargs["learning_rate"] = keras.optimizers.schedules.ExponentialDecay(0.01, decay_steps=2, decay_rate=0.5)
    return getattr(keras.optimizers, cls)(**kwargs)


def gradients(data: dict, step: int) -> list:
    return [
        tf.constant(data[f"grad/{step}/kernel"]),
        tf.constant(data[f"grad/{step}/bias"]),
        tf.IndexedSlices(
            tf.constant(data[f"grad/{step}/emb/values"]),
            tf.constant(data[f"grad/{step}/emb/indices"]),
            tf.constant(SHAPES["emb"], tf.int64),
        ),
    ]


def make_params(data: dict) -> list:
    return [keras.Variable(data[f"init/{name}"], name=name) for name in SHAPES]


def tf_keras2(data: dict) -> dict:
    """tf.keras 2 optimizers' checkpoints after N_FIRST steps: tf_keras2/<config>/ckpt, values in `data`."""
    import tf_keras

    shutil.rmtree(os.path.join(OUT, "tf_keras2"), ignore_errors=True)
    meta = {}
    for config, (cls, kwargs) in V2_CONFIGS.items():
        model = {name: tf.Variable(data[f"init/{name}"], name=f"dense/{name}") for name in SHAPES}
        opt = getattr(tf_keras.optimizers.legacy, cls)(**kwargs)
        for step in range(N_FIRST):
            opt.apply_gradients(zip(gradients(data, step), model.values(), strict=True))
        tf.train.Checkpoint(model=model, optimizer=opt).write(os.path.join(OUT, "tf_keras2", config, "ckpt"))
        for name, v in model.items():
            data[f"v2/{config}/param/{name}"] = v.numpy()
            for slot in opt.get_slot_names():
                data[f"v2/{config}/slot/{name}/{slot}"] = opt.get_slot(v, slot).numpy()
        data[f"v2/{config}/iter"] = opt.iterations.numpy()
        meta[config] = {"class": cls, "kwargs": kwargs, "slots": opt.get_slot_names()}
    return meta


def h5_fixture(data: dict) -> None:
    """A compiled model's `save_weights` after N_FIRST Adam steps: keras3_h5/adam.weights.h5 (optimizer/vars/N)."""
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2, name="dense"),
                              keras.layers.BatchNormalization(name="bn"), keras.layers.Dense(1, name="out")])
    model.compile(optimizer=keras.optimizers.Adam(0.01, amsgrad=True), loss="mse")
    rng = np.random.default_rng(5)
    x, y = rng.normal(size=(8, 3)).astype(np.float32), rng.normal(size=(8, 1)).astype(np.float32)
    for _ in range(N_FIRST):
        model.train_on_batch(x, y)
    os.makedirs(os.path.join(OUT, "keras3_h5"), exist_ok=True)
    model.save_weights(os.path.join(OUT, "keras3_h5", "adam.weights.h5"))
    model.save(os.path.join(OUT, "keras3_h5", "adam.keras"))
    for i, v in enumerate(model.optimizer.variables):
        data[f"h5/adam/opt/{i}"] = v.numpy()
    # M more steps with given gradients, as varstate takes them after reading the file (keras_roundtrip_readback)
    for step in range(2):
        grads = [rng.normal(size=v.shape).astype(np.float32) for v in model.trainable_variables]
        for i, g in enumerate(grads):
            data[f"h5/grad/{step}/{i}"] = g
        model.optimizer.apply_gradients(zip([tf.constant(g) for g in grads], model.trainable_variables, strict=True))
    for i, v in enumerate(model.optimizer.variables):
        data[f"h5/adam/after/opt/{i}"] = v.numpy()
    for i, v in enumerate(model.weights):
        data[f"h5/adam/after/weight/{i}"] = v.numpy()


def main() -> None:
    rng = np.random.default_rng(13)
    data = {f"init/{n}": rng.normal(size=s).astype(np.float32) for n, s in SHAPES.items()}
    for step in range(STEPS):
        data[f"grad/{step}/kernel"] = rng.normal(size=SHAPES["kernel"]).astype(np.float32)
        data[f"grad/{step}/bias"] = (rng.normal(size=SHAPES["bias"]) * 0.1).astype(np.float32)
        data[f"grad/{step}/emb/values"] = rng.normal(size=(ROWS, SHAPES["emb"][1])).astype(np.float32)
        idx = rng.choice(SHAPES["emb"][0], size=ROWS - 1, replace=False)
        data[f"grad/{step}/emb/indices"] = np.array([idx[0], idx[1], idx[0], idx[2]], np.int64)
    data["grad/0/kernel"][0, 0] = 0.0  # a zero gradient element (Lion's sign, Adamax's |g|)
    meta = {}
    shutil.rmtree(os.path.join(OUT, "keras3"), ignore_errors=True)
    for config in CONFIGS:
        params = make_params(data)
        opt = make_optimizer(config)
        for step in range(STEPS):
            opt.apply_gradients(zip(gradients(data, step), params, strict=True))
            for name, p in zip(SHAPES, params, strict=True):
                data[f"{config}/{step}/param/{name}"] = p.numpy()
            for i, v in enumerate(opt.variables):
                data[f"{config}/{step}/opt/{i}"] = v.numpy()
            if step + 1 == N_FIRST:
                prefix = os.path.join(OUT, "keras3", config, "ckpt")
                tf.train.Checkpoint(optimizer=opt).write(prefix)
        meta[config] = {
            "class": CONFIGS[config][0],
            "kwargs": CONFIGS[config][1],
            "variables": [[v.path, v.name, str(v.dtype)] for v in opt.variables],
        }
    v2_meta = tf_keras2(data)
    h5_fixture(data)
    np.savez_compressed(os.path.join(OUT, "steps.npz"), **data)
    with open(os.path.join(OUT, "meta.json"), "w") as f:
        json.dump({"keras": keras.__version__, "tensorflow": tf.__version__, "steps": STEPS, "n_first": N_FIRST,
                   "configs": meta, "v2_configs": v2_meta}, f, indent=1, sort_keys=True)
    print("wrote", OUT)


if __name__ == "__main__":
    main()
