"""Keras 3 functional-model fixtures: a BERT-like encoder and MobileNetV3Small, trained with three optimizers.

Run by hand from the repository root in the TensorFlow venv (TF 2.21, Keras 3.15, TF backend, CPU):

    /tmp/tfvenv/bin/python tests/data/make_keras_functional_fixtures.py

then `.venv/bin/python tests/data/keras_functional_readback.py ours` and
`/tmp/tfvenv/bin/python tests/data/keras_functional_readback.py keras` (the round trip's second half).

Models (`build`): "encoder", a functional BERT-like block whose layer names sort otherwise than Keras's order
(tok_embed, self_attn (MultiHeadAttention: EinsumDense query/key/value/output), attn_norm, ffn_in_0, ffn_out_0,
ffn_norm, then two Dense(8) layers of equal shapes, z_proj before a_proj, then head); "mobilenet",
`keras.applications.MobileNetV3Small(weights=None, input_shape=(32, 32, 3), alpha=0.1, include_top=False,
pooling="avg")` (no 1000-class head: the fixtures stay a few hundred KB).

Per run (RUNS: the encoder with each optimizer config of CONFIGS, MobileNet with Adam only, as its files are the
bulk of the bytes), compiled and trained N_FIRST batches (`train_on_batch`):
  <model>_<config>.weights.h5   `model.save_weights`: the layers and Keras 3's optimizer/vars/N.
  encoder_adam.keras            `model.save` of that run (weights inside the archive, config.json).
Then STEPS more steps by `optimizer.apply_gradients` with `gradient(shape, k, step)` (exact integer arithmetic,
the same in both venvs, so no gradient is stored).

meta.json, per "<model>/<config>": "weights": [Keras path, shape, dtype, sha256 of the value's bytes] in
`model.weights` order; "trainable": the Keras paths of `model.trainable_variables` (the optimizer's order);
"optimizer": [path, shape, dtype, sha256] of `optimizer.variables` after training; "after/<s>": the same two
lists ("weights", "optimizer") of sha256 after s of the STEPS steps. Hashes (their first 16 hex digits) keep the
record small; a value is compared bit for bit by hashing ours the same way (`digest`).

Keras runs eagerly, op by op (no tf.function, no XLA), so each value is TF's kernels' result.
"""

import hashlib
import json
import os
import shutil

import numpy as np

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "keras_functional")
CONFIGS = {
    "adam": ("Adam", {"learning_rate": 0.01}),
    "sgd_momentum": ("SGD", {"learning_rate": 0.1, "momentum": 0.9}),
    "rmsprop": ("RMSprop", {"learning_rate": 0.01}),
}
RUNS = (("encoder", "adam"), ("encoder", "sgd_momentum"), ("encoder", "rmsprop"), ("mobilenet", "adam"))
N_FIRST = 2  # train_on_batch steps before saving
STEPS = 3  # apply_gradients steps after saving: 2 in varstate, then 1 in Keras after reading ours
BATCH = 4
SEQ, VOCAB, DIM = 6, 20, 8


def _keras():
    # Imported where used, and the environment set only then: the readback's varstate half and the tests import
    # `gradient` and `digest` from here without TensorFlow.
    os.environ["KERAS_BACKEND"] = "tensorflow"
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import keras

    return keras


def build(model: str):
    """The model, made from fixed seeds (the same architecture and names each time)."""
    keras = _keras()

    keras.utils.set_random_seed(7)
    if model == "mobilenet":
        return keras.applications.MobileNetV3Small(weights=None, input_shape=(32, 32, 3), alpha=0.1,
                                                   include_top=False, pooling="avg")
    layers = keras.layers
    tokens = keras.Input((SEQ,), dtype="int32", name="tokens")
    x = layers.Embedding(VOCAB, DIM, name="tok_embed")(tokens)
    a = layers.MultiHeadAttention(num_heads=2, key_dim=4, name="self_attn")(x, x)
    x = layers.LayerNormalization(name="attn_norm")(layers.Add(name="attn_add")([x, a]))
    h = layers.Dense(16, activation="gelu", name="ffn_in_0")(x)
    h = layers.Dense(DIM, name="ffn_out_0")(h)
    x = layers.LayerNormalization(name="ffn_norm")(layers.Add(name="ffn_add")([x, h]))
    x = layers.GlobalAveragePooling1D(name="pool")(x)
    x = layers.Dense(DIM, activation="tanh", name="z_proj")(x)  # equal shapes, z_ before a_ in Keras's order
    x = layers.Dense(DIM, activation="tanh", name="a_proj")(x)
    return keras.Model(tokens, layers.Dense(3, name="head")(x), name="encoder")


def batch(model: str):
    rng = np.random.default_rng(3)
    if model == "mobilenet":
        return rng.normal(size=(BATCH, 32, 32, 3)).astype(np.float32), rng.normal(size=(BATCH, 96)).astype(np.float32)
    return rng.integers(0, VOCAB, size=(BATCH, SEQ)).astype(np.int32), rng.integers(0, 3, size=BATCH)


def compile_model(model: str, config: str):
    keras = _keras()

    m = build(model)
    cls, kwargs = CONFIGS[config]
    loss = "mse" if model == "mobilenet" else "sparse_categorical_crossentropy"
    m.compile(optimizer=getattr(keras.optimizers, cls)(**kwargs), loss=loss)
    return m


def gradient(shape, k: int, step: int) -> np.ndarray:
    """A gradient for the k-th trainable variable at `step`: small integers over 1000, exact in float32."""
    n = int(np.prod(shape, dtype=np.int64))
    ints = (np.arange(n, dtype=np.int64) * 7919 + k * 104729 + step * 1299709) % 2001 - 1000
    return (ints.astype(np.float32) / np.float32(1000)).reshape(shape)


def digest(value) -> str:
    """sha256 of a value's bytes (C order, little-endian), its first 16 hex digits."""
    a = np.ascontiguousarray(np.asarray(value))
    return hashlib.sha256(a.astype(a.dtype.newbyteorder("<")).tobytes()).hexdigest()[:16]


def record(variables) -> list:
    return [[v.path, list(v.shape), str(v.dtype), digest(v.numpy())] for v in variables]


def main() -> None:
    keras = _keras()
    import tensorflow as tf

    shutil.rmtree(OUT, ignore_errors=True)
    os.makedirs(OUT)
    meta = {"keras": keras.__version__, "tensorflow": tf.__version__, "n_first": N_FIRST, "steps": STEPS,
            "configs": CONFIGS, "runs": {}}
    for model, config in RUNS:
        x, y = batch(model)
        m = compile_model(model, config)
        for _ in range(N_FIRST):
            m.train_on_batch(x, y)
        m.save_weights(os.path.join(OUT, f"{model}_{config}.weights.h5"))
        if (model, config) == ("encoder", "adam"):
            m.save(os.path.join(OUT, f"{model}_{config}.keras"))
        run = {"layers": [layer.name for layer in m.layers], "weights": record(m.weights),
               "trainable": [v.path for v in m.trainable_variables], "optimizer": record(m.optimizer.variables)}
        for step in range(STEPS):
            grads = [tf.constant(gradient(v.shape, k, step)) for k, v in enumerate(m.trainable_variables)]
            m.optimizer.apply_gradients(zip(grads, m.trainable_variables, strict=True))
            run[f"after/{step + 1}"] = {"weights": [r[3] for r in record(m.weights)],
                                        "optimizer": [r[3] for r in record(m.optimizer.variables)]}
        meta["runs"][f"{model}/{config}"] = run
    with open(os.path.join(OUT, "meta.json"), "w") as f:
        json.dump(meta, f, separators=(",", ":"), sort_keys=True)
    print("wrote", OUT)


if __name__ == "__main__":
    main()
