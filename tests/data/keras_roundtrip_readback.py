"""The Keras 3 optimizer round trip's second half: varstate continues Keras's training, Keras continues ours.

Run by hand from the repository root, after make_keras_optimizer_fixtures.py:

    .venv/bin/python tests/data/keras_roundtrip_readback.py ours
    /tmp/tfvenv/bin/python tests/data/keras_roundtrip_readback.py keras

`ours` (varstate, no TensorFlow): for every config, restores keras_optimizers/keras3/<config>/ckpt
(N_FIRST steps of Keras), takes M steps op by op with the same gradients, and writes
keras_optimizers/ours/<config>/ckpt with `checkpoint.keras.save_optimizer_state` (Keras 3's layout).

`keras` (TF 2.21 + Keras 3.15): for every config, builds a fresh optimizer on fresh variables, restores
ours/<config>/ckpt with `tf.train.Checkpoint(optimizer=opt).read(...).assert_consumed()`, takes the
remaining steps and stores every param and optimizer variable in keras_optimizers/readback.npz
("<config>/param/<name>", "<config>/opt/<i>"), to compare with Keras's uninterrupted run (steps.npz).

tf.keras 2: `ours` also reads tf_keras2/<config>/ckpt (tf-keras optimizer_v2) into the Keras 3 optimizer,
takes M steps and writes tf_keras2_ours/<config>/ckpt in tf.keras 2's layout; `keras` reads that into a
tf-keras legacy optimizer (assert_consumed) and stores what it holds ("v2/<config>/...") in readback.npz.

.weights.h5: `ours` reads keras3_h5/adam.weights.h5 (a compiled model's weights and Adam state), takes the
fixture's 2 steps and writes keras3_h5_ours/adam.weights.h5 with `save_weights(..., optimizer=...)`;
`keras` loads it into the compiled model (`model.load_weights`) and stores its weights and optimizer
variables ("h5/weight/<i>", "h5/opt/<i>").
"""

import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
DATA = os.path.join(HERE, "keras_optimizers")
M = 2  # steps varstate takes, after make_keras_optimizer_fixtures.N_FIRST steps in Keras
NAMES = ("kernel", "bias", "emb")


def ours_optimizer(config: str, meta: dict):
    import jax.numpy as jnp

    from varstate.optimizers import keras

    c = meta["configs"][config]
    kwargs = dict(c["kwargs"])
    if kwargs["learning_rate"] == "exponential_decay":  # Keras's ExponentialDecay(0.01, 2, 0.5), its float32 ops
        def schedule(it):
            return jnp.float32(0.01) * jnp.power(jnp.float32(0.5), it.astype(jnp.float32) / jnp.float32(2))
        kwargs["learning_rate"] = schedule
    return getattr(keras, c["class"])(**kwargs)


def ours_gradients(data, step: int) -> list:
    import jax.numpy as jnp

    import varstate

    return [
        jnp.asarray(data[f"grad/{step}/kernel"]),
        jnp.asarray(data[f"grad/{step}/bias"]),
        varstate.IndexedSlices(jnp.asarray(data[f"grad/{step}/emb/values"]),
                               jnp.asarray(data[f"grad/{step}/emb/indices"]), data["init/emb"].shape),
    ]


def ours_continue(config: str, data, meta: dict, out_dir: str | None = None):
    """Restores Keras's checkpoint of `config`, takes M steps op by op; writes ours when `out_dir` is given."""
    from checkpoint import keras

    opt = ours_optimizer(config, meta)
    params, state = keras.load_optimizer_state(os.path.join(DATA, "keras3", config, "ckpt"), opt)
    for step in range(meta["n_first"], meta["n_first"] + M):
        params, state = opt.update(ours_gradients(data, step), params, state)
    if out_dir is not None:
        keras.save_optimizer_state(os.path.join(out_dir, config, "ckpt"), opt, params, state)
    return params, state


def ours_continue_v2(config: str, data, meta: dict, out_dir: str | None = None):
    """tf.keras 2's checkpoint of `config` read into the Keras 3 optimizer, M steps, written in tf.keras 2's layout."""
    from checkpoint import keras
    from varstate.optimizers import keras as keras_opt

    c = meta["v2_configs"][config]
    opt = getattr(keras_opt, c["class"])(**c["kwargs"])
    params, state = keras.load_optimizer_state(os.path.join(DATA, "tf_keras2", config, "ckpt"), opt)
    for step in range(meta["n_first"], meta["n_first"] + M):
        params, state = opt.update(ours_gradients(data, step), params, state)
    model = dict(zip(NAMES, params, strict=True))
    if out_dir is not None:
        keras.save_optimizer_state(os.path.join(out_dir, config, "ckpt"), opt, model, state, layout="tf_keras2")
    return opt, model, state


def ours_continue_h5(data, out_path: str | None = None):
    """Keras's adam.weights.h5 (a compiled model's weights and optimizer) read, 2 steps, written back."""
    import jax.numpy as jnp

    from checkpoint import keras
    from checkpoint.keras._optimizer import _trainable
    from varstate.optimizers import keras as keras_opt

    opt = keras_opt.Adam(0.01, amsgrad=True)
    weights, state = keras.load_optimizer_state(os.path.join(DATA, "keras3_h5", "adam.weights.h5"), opt)
    leaves, treedef, idx = _trainable(weights)
    for step in range(2):
        grads = [None] * len(leaves)
        for k, i in enumerate(idx):
            grads[i] = jnp.asarray(data[f"h5/grad/{step}/{k}"])
        weights, state = opt.update(treedef.unflatten(grads), weights, state)
    if out_path is not None:
        keras.save_weights(out_path, weights, optimizer=opt, optimizer_state=state)
    return opt, weights, state


def main_ours() -> None:
    import numpy as np

    with open(os.path.join(DATA, "meta.json")) as f:
        meta = json.load(f)
    data = np.load(os.path.join(DATA, "steps.npz"))
    for config in meta["configs"]:
        ours_continue(config, data, meta, os.path.join(DATA, "ours"))
    for config in meta["v2_configs"]:
        ours_continue_v2(config, data, meta, os.path.join(DATA, "tf_keras2_ours"))
    os.makedirs(os.path.join(DATA, "keras3_h5_ours"), exist_ok=True)
    ours_continue_h5(data, os.path.join(DATA, "keras3_h5_ours", "adam.weights.h5"))
    print("wrote", os.path.join(DATA, "ours"), os.path.join(DATA, "tf_keras2_ours"))


def main_keras() -> None:
    sys.path.insert(0, HERE)
    import numpy as np
    import tensorflow as tf
    from make_keras_optimizer_fixtures import gradients, make_optimizer, make_params

    with open(os.path.join(DATA, "meta.json")) as f:
        meta = json.load(f)
    data = dict(np.load(os.path.join(DATA, "steps.npz")))
    out = {}
    for config in meta["configs"]:
        params = make_params(data)
        opt = make_optimizer(config)
        opt.build(params)
        tf.train.Checkpoint(optimizer=opt).read(os.path.join(DATA, "ours", config, "ckpt")).assert_consumed()
        for step in range(meta["n_first"] + M, meta["steps"]):
            opt.apply_gradients(zip(gradients(data, step), params, strict=True))
        for name, p in zip(NAMES, params, strict=True):
            out[f"{config}/param/{name}"] = p.numpy()
        for i, v in enumerate(opt.variables):
            out[f"{config}/opt/{i}"] = v.numpy()
    import tf_keras

    for config, c in meta["v2_configs"].items():
        model = {name: tf.Variable(tf.zeros_like(data[f"init/{name}"]), name=f"dense/{name}") for name in NAMES}
        opt = getattr(tf_keras.optimizers.legacy, c["class"])(**c["kwargs"])
        opt._create_all_weights(list(model.values()))  # slots exist before the read, so all are matched
        ckpt = os.path.join(DATA, "tf_keras2_ours", config, "ckpt")
        tf.train.Checkpoint(model=model, optimizer=opt).read(ckpt).assert_consumed()
        for name, v in model.items():
            out[f"v2/{config}/param/{name}"] = v.numpy()
            for slot in opt.get_slot_names():
                out[f"v2/{config}/slot/{name}/{slot}"] = opt.get_slot(v, slot).numpy()
        out[f"v2/{config}/iter"] = opt.iterations.numpy()
    import keras

    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2, name="dense"),
                              keras.layers.BatchNormalization(name="bn"), keras.layers.Dense(1, name="out")])
    model.compile(optimizer=keras.optimizers.Adam(0.01, amsgrad=True), loss="mse")
    model.optimizer.build(model.trainable_variables)
    model.load_weights(os.path.join(DATA, "keras3_h5_ours", "adam.weights.h5"))
    for i, v in enumerate(model.optimizer.variables):
        out[f"h5/opt/{i}"] = v.numpy()
    for i, v in enumerate(model.weights):
        out[f"h5/weight/{i}"] = v.numpy()
    np.savez_compressed(os.path.join(DATA, "readback.npz"), **out)
    print("wrote", os.path.join(DATA, "readback.npz"))


if __name__ == "__main__":
    if sys.argv[1:] == ["ours"]:
        main_ours()
    elif sys.argv[1:] == ["keras"]:
        main_keras()
    else:
        sys.exit(f"usage: {sys.argv[0]} ours|keras")
