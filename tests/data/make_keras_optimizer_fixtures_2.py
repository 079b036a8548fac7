"""Keras 3 optimizer fixtures, second set: `Lamb` and `Muon` (issue 28), on the first set's gradients.

Run by hand from the repository root in the TensorFlow venv (TF 2.21, Keras 3.15, TF backend, CPU), after
make_keras_optimizer_fixtures.py (whose steps.npz gives the initial values and the gradients):

    /tmp/tfvenv/bin/python tests/data/make_keras_optimizer_fixtures_2.py keras

then `.venv/bin/python tests/data/make_keras_optimizer_fixtures_2.py ours` (varstate restores keras3/<config>/ckpt,
takes M steps op by op, writes ours/<config>/ckpt with `checkpoint.keras.save_optimizer_state`), then
`/tmp/tfvenv/bin/python tests/data/make_keras_optimizer_fixtures_2.py readback` (Keras restores ours with
`assert_consumed`, takes the remaining steps).

Writes under tests/data/keras_optimizers_2/:
  steps.npz     per config, after every step, the params and every optimizer variable by Keras's index:
                "<config>/<step>/param/<name>", "<config>/<step>/opt/<i>" (inputs: ../keras_optimizers/steps.npz).
  meta.json     per config: the constructor's arguments, and each optimizer variable's path, name and dtype.
  keras3/<config>/ckpt   `tf.train.Checkpoint(optimizer=opt).write` after N_FIRST steps.
  ours/<config>/ckpt     (`ours`) varstate's checkpoint after N_FIRST + M steps.
  readback.npz  (`readback`) Keras's params and optimizer variables after all steps, resumed from ours:
                "<config>/param/<name>", "<config>/opt/<i>".

Keras runs eagerly, op by op (no tf.function, no XLA), so each value is TF's kernels' result.
"""

import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
IN = os.path.join(HERE, "keras_optimizers")
OUT = os.path.join(HERE, "keras_optimizers_2")
M = 2
NAMES = ("kernel", "bias", "emb")

CONFIGS = {
    "lamb": ("Lamb", {"learning_rate": 0.01}),
    "lamb_decay": ("Lamb", {"learning_rate": 0.02, "beta_1": 0.8, "weight_decay": 0.1}),
    # kernel (3, 2) and emb (5, 3, sparse) take Muon's step, bias AdamW's
    "muon": ("Muon", {"learning_rate": 0.01}),
    # emb excluded: AdamW on sparse rows; no Nesterov, no RMS scale, no Muon decay, 3 Newton-Schulz steps
    "muon_plain": ("Muon", {"learning_rate": 0.02, "nesterov": False, "rms_rate": None, "weight_decay": None,
                            "exclude_layers": ["emb"], "adam_lr_ratio": 0.5, "ns_steps": 3, "momentum": 0.9}),
}
# The Keras checkpoint round trip (keras3/, ours/, readback.npz); Muon's: make_keras_optimizer_fixtures_3.py.
ROUND_TRIP = ("lamb", "lamb_decay")


def keras_side(mode: str) -> None:
    os.environ["KERAS_BACKEND"] = "tensorflow"
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    import shutil

    import keras
    import numpy as np
    import tensorflow as tf

    sys.path.insert(0, HERE)
    from make_keras_optimizer_fixtures import gradients

    data = dict(np.load(os.path.join(IN, "steps.npz")))
    with open(os.path.join(IN, "meta.json")) as f:
        first = json.load(f)
    steps, n_first = first["steps"], first["n_first"]

    def fresh(config):
        cls, kwargs = CONFIGS[config]
        params = [keras.Variable(data[f"init/{n}"], name=n) for n in NAMES]
        return params, getattr(keras.optimizers, cls)(**kwargs)

    if mode == "keras":
        out, meta = {}, {}
        shutil.rmtree(os.path.join(OUT, "keras3"), ignore_errors=True)
        for config in CONFIGS:
            params, opt = fresh(config)
            for step in range(steps):
                opt.apply_gradients(zip(gradients(data, step), params, strict=True))
                for name, p in zip(NAMES, params, strict=True):
                    out[f"{config}/{step}/param/{name}"] = p.numpy()
                for i, v in enumerate(opt.variables):
                    out[f"{config}/{step}/opt/{i}"] = v.numpy()
                if step + 1 == n_first and config in ROUND_TRIP:
                    tf.train.Checkpoint(optimizer=opt).write(os.path.join(OUT, "keras3", config, "ckpt"))
            meta[config] = {"class": CONFIGS[config][0], "kwargs": CONFIGS[config][1],
                            "variables": [[v.path, v.name, str(v.dtype)] for v in opt.variables]}
        np.savez_compressed(os.path.join(OUT, "steps.npz"), **out)
        with open(os.path.join(OUT, "meta.json"), "w") as f:
            json.dump({"keras": keras.__version__, "tensorflow": tf.__version__, "steps": steps, "n_first": n_first,
                       "m": M, "configs": meta}, f, indent=1, sort_keys=True)
    else:  # readback
        out = {}
        for config in ROUND_TRIP:
            params, opt = fresh(config)
            opt.build(params)
            tf.train.Checkpoint(optimizer=opt).read(os.path.join(OUT, "ours", config, "ckpt")).assert_consumed()
            for step in range(n_first + M, steps):
                opt.apply_gradients(zip(gradients(data, step), params, strict=True))
            for name, p in zip(NAMES, params, strict=True):
                out[f"{config}/param/{name}"] = p.numpy()
            for i, v in enumerate(opt.variables):
                out[f"{config}/opt/{i}"] = v.numpy()
        np.savez_compressed(os.path.join(OUT, "readback.npz"), **out)
    print("wrote", OUT)


def ours_optimizer(config: str, meta: dict):
    from varstate.optimizers import keras

    c = meta["configs"][config]
    return getattr(keras, c["class"])(**c["kwargs"])


def ours_continue(config: str, data, meta: dict, out_dir: str | None = None):
    """Restores Keras's checkpoint of `config`, takes M steps op by op; writes ours when `out_dir` is given."""
    from checkpoint import keras

    sys.path.insert(0, HERE)
    from keras_roundtrip_readback import ours_gradients

    opt = ours_optimizer(config, meta)
    params, state = keras.load_optimizer_state(os.path.join(OUT, "keras3", config, "ckpt"), opt)
    for step in range(meta["n_first"], meta["n_first"] + M):
        params, state = opt.update(ours_gradients(data, step), params, state)
    if out_dir is not None:
        keras.save_optimizer_state(os.path.join(out_dir, config, "ckpt"), opt, params, state)
    return params, state


def main() -> None:
    mode = sys.argv[1] if len(sys.argv) > 1 else ""
    if mode in ("keras", "readback"):
        keras_side(mode)
    elif mode == "ours":
        import numpy as np

        data = {**np.load(os.path.join(IN, "steps.npz")), **np.load(os.path.join(OUT, "steps.npz"))}
        with open(os.path.join(OUT, "meta.json")) as f:
            meta = json.load(f)
        for config in ROUND_TRIP:
            ours_continue(config, data, meta, os.path.join(OUT, "ours"))
        print("wrote", os.path.join(OUT, "ours"))
    else:
        sys.exit("usage: make_keras_optimizer_fixtures_2.py keras|ours|readback")


if __name__ == "__main__":
    main()
