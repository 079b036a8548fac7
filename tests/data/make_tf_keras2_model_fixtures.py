"""A tf.keras 2 model checkpoint holding its optimizer_v2 state: tests/data/tf_keras2_model/.

Run by hand from the repository root in the TensorFlow venv (TF 2.21, tf-keras 2.21, CPU):

    /tmp/tfvenv/bin/python tests/data/make_tf_keras2_model_fixtures.py

The model is make_keras_fixtures.py's mlp (functional "mlp": Dense(3, "dense") -> Dense(3, use_bias=False,
"proj") -> Dense(2, "out")), whose layer order differs from its sorted layer names; it is compiled with
tf-keras's legacy Adam (optimizer_v2: ``iter`` and slots ``m``/``v`` under ``.OPTIMIZER_SLOT``), fitted STEPS
steps, and written with ``model.save_weights(prefix)`` (the TF checkpoint format):
  mlp_adam.{index,data-00000-of-00001}, checkpoint
  expected.npz  "layers": the names of the layers holding weights, in ``model.layers`` order;
                "weight/<layer>/<weight>": each weight's value; "slot/<layer>/<weight>/<m|v>": its Adam slots;
                "iter": the optimizer's step count.
"""

import os
import shutil

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ["CUDA_VISIBLE_DEVICES"] = ""

import numpy as np
import tf_keras

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tf_keras2_model")
STEPS = 2


def main() -> None:
    shutil.rmtree(OUT, ignore_errors=True)
    os.makedirs(OUT)
    tf_keras.utils.set_random_seed(3)
    inp = tf_keras.Input((4,))
    x = tf_keras.layers.Dense(3, activation="relu", name="dense")(inp)
    x = tf_keras.layers.Dense(3, use_bias=False, name="proj")(x)
    model = tf_keras.Model(inp, tf_keras.layers.Dense(2, name="out")(x), name="mlp")
    opt = tf_keras.optimizers.legacy.Adam(0.01)
    model.compile(optimizer=opt, loss="mse")
    rng = np.random.default_rng(11)
    xs = rng.normal(size=(4 * STEPS, 4)).astype(np.float32)
    ys = rng.normal(size=(4 * STEPS, 2)).astype(np.float32)
    model.fit(xs, ys, batch_size=4, epochs=1, shuffle=False, verbose=0)
    model.save_weights(os.path.join(OUT, "mlp_adam"))
    data: dict = {"layers": np.array([layer.name for layer in model.layers if layer.weights]),
                  "iter": np.asarray(opt.iterations.numpy())}
    for layer in model.layers:
        for v in layer.weights:
            key = f"{layer.name}/{v.name.removesuffix(':0').rsplit('/', 1)[-1]}"
            data[f"weight/{key}"] = v.numpy()
            for slot in opt.get_slot_names():
                data[f"slot/{key}/{slot}"] = opt.get_slot(v, slot).numpy()
    np.savez(os.path.join(OUT, "expected.npz"), **data)


if __name__ == "__main__":
    main()
