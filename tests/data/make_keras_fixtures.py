"""Writes the Keras weight fixtures under tests/data/keras_weights/.

Run by hand with TensorFlow 2.21, Keras 3 and tf-keras 2.21 installed (never imported by the
package or the tests), from the repository root:

    /tmp/tfvenv/bin/python tests/data/make_keras_fixtures.py [--ours-python .venv/bin/python]

Three small Keras 3 models with named layers, weights drawn from fixed seeds:
- mlp (functional): Dense(3, "dense") -> Dense(3, use_bias=False, "proj") -> Dense(2, "out");
- lstm (Sequential "seq_lstm"): LSTM(4, "lstm") -> Dense(2, "head");
- conv (Sequential "seq_conv"): Conv2D(3, 3, "conv") -> BatchNormalization("bn") ->
  GlobalAveragePooling2D("pool") -> Dense(2, "head"), compiled and fitted one step (so the
  files hold optimizer state too, and BN's moving statistics are not their initial values).
And two tf-keras 2 models with the same layer names:
- mlp (functional, as above) and lstm_bn (Sequential "seq": LSTM(4, "lstm") ->
  BatchNormalization("bn") -> Dense(2, "head"), fitted one step).

Step 1 (Keras/TF write): keras3/{mlp,lstm,conv}.weights.h5 and keras3/mlp.keras
(model.save_weights / model.save); keras3_tf/{lstm,conv}/ckpt-1.* (tf.train.Checkpoint(model=m).save);
tf_keras/{mlp,lstm_bn}.{index,data-*} (tf-keras model.save_weights(prefix), the TF format) and
tf_keras/mlp.h5 (tf-keras's legacy HDF5 save_weights).
Step 2 (our code writes): make_keras_ours.py, run with the project's Python, reads those with
checkpoint.keras.load_weights and writes ours/*.weights.h5 with checkpoint.keras.save_weights.
Step 3 (Keras reads ours): each ours/ file is loaded with model.load_weights into a fresh
model built from another seed, and its outputs on a probe batch are recorded.

expected.json: per source file "weights": [path relative to the model, dtype, shape, values]
in Keras's order (Keras 3 `variable.path` without the model's name; tf-keras `variable.name`
without ":0"); per model "probe" (inputs) and "outputs" (inference mode); per ours/ file the
source, like= file, and the outputs of the Keras model that loaded it ("ours").
"""

import argparse
import json
import os
import shutil
import subprocess

import numpy as np

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
import keras
import tensorflow as tf
import tf_keras

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "keras_weights")
ROOT = os.path.dirname(os.path.dirname(HERE))

# ours/<file> <- (source file, like= file or None), written by make_keras_ours.py; the Keras 3
# model (by name) that loads it, and the model whose outputs it must reproduce.
OURS = {
    "mlp.weights.h5": ("keras3/mlp.weights.h5", None, "mlp", "keras3/mlp"),
    "lstm.weights.h5": ("keras3/lstm.weights.h5", None, "lstm", "keras3/lstm"),
    "conv.weights.h5": ("keras3/conv.weights.h5", None, "conv", "keras3/conv"),
    "conv_from_tf.weights.h5": ("keras3_tf/conv/ckpt-1", "keras3/conv.weights.h5", "conv", "keras3/conv"),
    "mlp_from_tf_keras.weights.h5": ("tf_keras/mlp", "keras3/mlp.weights.h5", "mlp", "tf_keras/mlp"),
}


def _keras3_models(seed):
    keras.utils.set_random_seed(seed)
    inp = keras.Input((4,))
    x = keras.layers.Dense(3, activation="relu", name="dense")(inp)
    x = keras.layers.Dense(3, use_bias=False, name="proj")(x)
    mlp = keras.Model(inp, keras.layers.Dense(2, name="out")(x), name="mlp")
    lstm = keras.Sequential(
        [keras.Input((5, 3)), keras.layers.LSTM(4, name="lstm"), keras.layers.Dense(2, name="head")], name="seq_lstm"
    )
    conv = keras.Sequential([
        keras.Input((6, 6, 2)),
        keras.layers.Conv2D(3, 3, name="conv"),
        keras.layers.BatchNormalization(name="bn"),
        keras.layers.GlobalAveragePooling2D(name="pool"),
        keras.layers.Dense(2, name="head"),
    ], name="seq_conv")
    return {"mlp": mlp, "lstm": lstm, "conv": conv}


def _tf_keras_models(seed):
    tf_keras.utils.set_random_seed(seed)
    inp = tf_keras.Input((4,))
    x = tf_keras.layers.Dense(3, activation="relu", name="dense")(inp)
    x = tf_keras.layers.Dense(3, use_bias=False, name="proj")(x)
    mlp = tf_keras.Model(inp, tf_keras.layers.Dense(2, name="out")(x), name="mlp")
    lstm_bn = tf_keras.Sequential([
        tf_keras.Input((5, 3)),
        tf_keras.layers.LSTM(4, name="lstm"),
        tf_keras.layers.BatchNormalization(name="bn"),
        tf_keras.layers.Dense(2, name="head"),
    ], name="seq")
    return {"mlp": mlp, "lstm_bn": lstm_bn}


PROBES = {
    "mlp": np.linspace(-2, 2, 12, dtype=np.float32).reshape(3, 4),
    "lstm": np.linspace(-1, 1, 30, dtype=np.float32).reshape(2, 5, 3),
    "lstm_bn": np.linspace(-1, 1, 30, dtype=np.float32).reshape(2, 5, 3),
    "conv": np.linspace(-1, 1, 144, dtype=np.float32).reshape(2, 6, 6, 2),
}


def _fit_one_step(model, name, compile_kwargs=None):
    rng = np.random.default_rng(7)
    x = rng.normal(size=(4, *PROBES[name].shape[1:])).astype(np.float32)
    y = rng.normal(size=(4, 2)).astype(np.float32)
    model.compile(optimizer="adam", loss="mse", **(compile_kwargs or {}))
    model.fit(x, y, batch_size=4, epochs=1, verbose=0)


def _weights(variables, prefix):
    out = []
    for v in variables:
        name = v.path if hasattr(v, "path") and not v.name.endswith(":0") else v.name.removesuffix(":0")
        if prefix and name.startswith(prefix + "/"):
            name = name[len(prefix) + 1 :]
        value = np.asarray(v.numpy())
        out.append([name, value.dtype.name, list(value.shape), value.ravel().tolist()])
    return out


def _outputs(model, name):
    return np.asarray(model(PROBES[name], training=False)).tolist()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--ours-python", default=os.path.join(ROOT, ".venv", "bin", "python"))
    args = parser.parse_args()
    shutil.rmtree(OUT, ignore_errors=True)
    for sub in ("keras3", "keras3_tf", "tf_keras", "ours"):
        os.makedirs(os.path.join(OUT, sub))
    expected = {"files": {}, "models": {}, "ours": {}}

    # Step 1: Keras and TF write.
    k3 = _keras3_models(seed=1)
    _fit_one_step(k3["conv"], "conv")
    for name, model in k3.items():
        # Sequential models prefix their variables' paths with the model's name; functional ones do not.
        prefix = model.name if isinstance(model, keras.Sequential) else ""
        weights = _weights(model.weights, prefix)
        model.save_weights(os.path.join(OUT, "keras3", f"{name}.weights.h5"))
        expected["files"][f"keras3/{name}.weights.h5"] = {"weights": weights}
        expected["models"][f"keras3/{name}"] = {"probe": PROBES[name].tolist(), "outputs": _outputs(model, name)}
    k3["mlp"].save(os.path.join(OUT, "keras3", "mlp.keras"))
    expected["files"]["keras3/mlp.keras"] = expected["files"]["keras3/mlp.weights.h5"]
    for name in ("lstm", "conv"):
        prefix = tf.train.Checkpoint(model=k3[name]).save(os.path.join(OUT, "keras3_tf", name, "ckpt"))
        expected["files"][f"keras3_tf/{name}/ckpt-1"] = expected["files"][f"keras3/{name}.weights.h5"]
        assert prefix.endswith("ckpt-1"), prefix

    k2 = _tf_keras_models(seed=2)
    _fit_one_step(k2["lstm_bn"], "lstm_bn")
    for name, model in k2.items():
        model.save_weights(os.path.join(OUT, "tf_keras", name))  # no .h5 suffix: the TF checkpoint format
        expected["files"][f"tf_keras/{name}"] = {"weights": _weights(model.weights, "")}
        expected["models"][f"tf_keras/{name}"] = {"probe": PROBES[name].tolist(), "outputs": _outputs(model, name)}
    k2["mlp"].save_weights(os.path.join(OUT, "tf_keras", "mlp.h5"))
    expected["files"]["tf_keras/mlp.h5"] = expected["files"]["tf_keras/mlp"]

    # Step 2: our code writes .weights.h5 files from what it read.
    plan = os.path.join(OUT, "ours_plan.json")
    with open(plan, "w") as f:
        json.dump({k: v[:2] for k, v in OURS.items()}, f)
    subprocess.run([args.ours_python, os.path.join(HERE, "make_keras_ours.py"), plan], check=True, cwd=ROOT)
    os.remove(plan)

    # Step 3: Keras loads ours into freshly initialised models (another seed) and runs them.
    for file, (source, like, model_name, reference) in OURS.items():
        model = _keras3_models(seed=99)[model_name]
        before = _outputs(model, model_name)
        model.load_weights(os.path.join(OUT, "ours", file))
        outputs = _outputs(model, model_name)
        same = np.array_equal(outputs, expected["models"][reference]["outputs"])
        assert not np.array_equal(before, outputs), file  # the fresh model really changed
        expected["ours"][file] = {"source": source, "like": like, "model": model_name, "reference": reference,
                                  "outputs": outputs}
        print(f"ours/{file}: Keras loaded it; outputs identical to {reference}: {same}")

    with open(os.path.join(OUT, "expected.json"), "w") as f:
        json.dump(expected, f, indent=None, sort_keys=True)
    total = sum(os.path.getsize(os.path.join(d, n)) for d, _, ns in os.walk(OUT) for n in ns)
    print(f"{OUT}: {total} bytes")


if __name__ == "__main__":
    main()
