"""The functional-model round trip's second half: varstate continues Keras's training, Keras reads ours and continues.

Run by hand from the repository root, after make_keras_functional_fixtures.py:

    .venv/bin/python tests/data/keras_functional_readback.py ours
    /tmp/tfvenv/bin/python tests/data/keras_functional_readback.py keras

`ours` (varstate, no TensorFlow): for every run of make_keras_functional_fixtures.RUNS, reads
keras_functional/<model>_<config>.weights.h5 with `checkpoint.keras.load_optimizer_state` (weights and optimizer
state), takes STEPS - 1 steps op by op with the fixture's gradients, and writes the weights and state with
`checkpoint.keras.save_weights(..., optimizer=...)` to OURS/<model>_<config>.weights.h5 (a scratch folder: the
test writes the same file again and compares its sha256 with the one recorded here).

`keras` (TF 2.21 + Keras 3.15): builds and compiles each model afresh, builds its optimizer, reads ours with
`model.load_weights`, records what it holds, takes the last of the STEPS steps and records again, in
keras_functional/readback.json: per run, "file" (sha256 of the file read, first 16 hex digits) and "loaded" and
"stepped", each {"weights": [...], "optimizer": [...]} of digests in `model.weights` and `optimizer.variables`
order, to compare with Keras's uninterrupted run (meta.json "after/<STEPS - 1>" and "after/<STEPS>").
"""

import hashlib
import json
import os
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
DATA = os.path.join(HERE, "keras_functional")
OURS = os.path.join(tempfile.gettempdir(), "keras_functional_ours")
sys.path.insert(0, HERE)

from make_keras_functional_fixtures import CONFIGS, RUNS, STEPS, _keras, compile_model, digest, gradient  # noqa: E402


def file_digest(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()[:16]


def ours_continue(model: str, config: str, out_path: str | None = None):
    """Keras's file of the run read, STEPS - 1 steps taken with the fixture's gradients; written when `out_path`."""
    import jax
    import jax.numpy as jnp

    import varstate
    from checkpoint import keras
    from varstate.optimizers import keras as keras_opt

    with open(os.path.join(DATA, "meta.json")) as f:
        trainable = json.load(f)["runs"][f"{model}/{config}"]["trainable"]
    cls, kwargs = CONFIGS[config]
    opt = getattr(keras_opt, cls)(**kwargs)
    weights, state = keras.load_optimizer_state(os.path.join(DATA, f"{model}_{config}.weights.h5"), opt)

    def is_variable(x):
        return isinstance(x, varstate.Variable)

    for step in range(STEPS - 1):
        # Each gradient by its variable's Keras path, whatever order the weights are in.
        grads = jax.tree.map(lambda v, step=step: jnp.asarray(gradient(v.shape, trainable.index(v.name), step))
                             if v.trainable else None, weights, is_leaf=is_variable)
        weights, state = opt.update(grads, weights, state)
    if out_path is not None:
        keras.save_weights(out_path, weights, optimizer=opt, optimizer_state=state)
    return opt, weights, state


def main_ours() -> None:
    os.makedirs(OURS, exist_ok=True)
    for model, config in RUNS:
        ours_continue(model, config, os.path.join(OURS, f"{model}_{config}.weights.h5"))
    print("wrote", OURS)


def main_keras() -> None:
    _keras()  # the environment it sets, before TensorFlow is imported
    import tensorflow as tf

    out = {}
    for model, config in RUNS:
        m = compile_model(model, config)
        m.optimizer.build(m.trainable_variables)
        path = os.path.join(OURS, f"{model}_{config}.weights.h5")
        m.load_weights(path)
        run = {"file": file_digest(path),
               "loaded": {"weights": [digest(v.numpy()) for v in m.weights],
                          "optimizer": [digest(v.numpy()) for v in m.optimizer.variables]}}
        grads = [tf.constant(gradient(v.shape, k, STEPS - 1)) for k, v in enumerate(m.trainable_variables)]
        m.optimizer.apply_gradients(zip(grads, m.trainable_variables, strict=True))
        run["stepped"] = {"weights": [digest(v.numpy()) for v in m.weights],
                          "optimizer": [digest(v.numpy()) for v in m.optimizer.variables]}
        out[f"{model}/{config}"] = run
    with open(os.path.join(DATA, "readback.json"), "w") as f:
        json.dump(out, f, separators=(",", ":"), sort_keys=True)
    print("wrote", os.path.join(DATA, "readback.json"))


if __name__ == "__main__":
    if sys.argv[1:] == ["ours"]:
        main_ours()
    elif sys.argv[1:] == ["keras"]:
        main_keras()
    else:
        sys.exit(f"usage: {sys.argv[0]} ours|keras")
