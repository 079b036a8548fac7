"""Keras 3 optimizer fixtures, third set: `Adafactor` step by step, and Keras file round trips of Adafactor and Muon.

Run by hand from the repository root, in turn (TF 2.21, Keras 3.15, TF backend, CPU, in the TensorFlow venv):

    /tmp/tfvenv/bin/python tests/data/make_keras_optimizer_fixtures_3.py keras
    .venv/bin/python tests/data/make_keras_optimizer_fixtures_3.py ours
    /tmp/tfvenv/bin/python tests/data/make_keras_optimizer_fixtures_3.py readback

`keras`: on seeded inputs (kernel (3, 2), bias (2,), k3 (2, 3, 4) and big (8, 12) dense; emb (5, 3) and vec (6,)
sparse, a duplicate index each step), every config takes STEPS steps; each step's params and optimizer variables
(by Keras's index) go to steps.npz, each set as one float32 array of the values raveled in turn (`unpack` splits it
by meta.json's shapes and dtypes): "<config>/<step>/params", "<config>/<step>/opt"; the ROUND_TRIP
configs write `tf.train.Checkpoint(optimizer=opt)` after N_FIRST steps (keras3/<config>/ckpt). Then a compiled
Sequential model (Dense 4 -> 3 -> 2) per H5 config takes STEPS steps of fixed gradients with
`optimizer.apply_gradients`, saving `model.save_weights` after N_FIRST (keras3_h5/<config>.weights.h5); its weights
and optimizer variables after every step: "h5/<config>/<step>/weights", "h5/<config>/<step>/opt".

`ours` (varstate, no TensorFlow): reads each Keras file with `checkpoint.keras.load_optimizer_state`, takes M steps
op by op, writes ours/<config>/ckpt (`save_optimizer_state`) and ours_h5/<config>.weights.h5 (`save_weights` with
the optimizer's state).

`readback`: Keras restores ours (`assert_consumed`; `model.load_weights`) and takes the remaining steps; what it
holds then goes to readback.npz ("<config>/params", "<config>/opt", "h5/<config>/weights", "h5/<config>/opt").

Keras runs eagerly, op by op (no tf.function, no XLA), so each value is TF's kernels' result.
"""

import itertools
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "keras_optimizers_3")
STEPS, N_FIRST, M = 6, 3, 2
SHAPES = {"kernel": (3, 2), "bias": (2,), "emb": (5, 3), "vec": (6,), "k3": (2, 3, 4), "big": (8, 12)}
SPARSE = ("emb", "vec")
H5_LAYERS = (4, 3, 2)  # Dense 4 -> 3, Dense 3 -> 2: kernels take Muon's step, biases AdamW's

CONFIGS = {
    "adafactor": ("Adafactor", {}),
    # keras/src/optimizers/adafactor_test.py's golden setup, with weight decay
    "adafactor_golden": ("Adafactor", {"learning_rate": 0.5, "beta_2_decay": -0.65, "epsilon_1": 1e-15,
                                       "epsilon_2": 1e-4, "clip_threshold": 0.9, "relative_step": False,
                                       "weight_decay": 0.05}),
    # a schedule (ExponentialDecay(0.01, 2, 0.5)): no learning_rate variable, no relative-step cap on it
    "adafactor_schedule": ("Adafactor", {"learning_rate": "exponential_decay"}),
    # Muon on these shapes: kernel, emb, big take its step; bias, vec, k3 AdamW's
    "muon": ("Muon", {"learning_rate": 0.01}),
}
ROUND_TRIP = ("adafactor", "muon")
H5 = {"adafactor": ("Adafactor", {"learning_rate": 0.01}), "muon": ("Muon", {"learning_rate": 0.01})}


def inputs() -> dict:
    import numpy as np

    rng = np.random.default_rng(28)
    data = {f"init/{n}": rng.normal(size=s).astype(np.float32) for n, s in SHAPES.items()}
    for step in range(STEPS):
        for n, s in SHAPES.items():
            if n in SPARSE:
                data[f"grad/{step}/{n}/values"] = rng.normal(size=(3, *s[1:])).astype(np.float32)
                data[f"grad/{step}/{n}/indices"] = np.array([step % s[0], (step + 2) % s[0], step % s[0]], np.int32)
            else:
                data[f"grad/{step}/{n}"] = rng.normal(size=s).astype(np.float32)
    shapes = [t for a, b in itertools.pairwise(H5_LAYERS) for t in ((a, b), (b,))]
    for i, s in enumerate(shapes):
        data[f"h5/init/{i}"] = rng.normal(size=s).astype(np.float32) * np.float32(0.5)
        for step in range(STEPS):
            data[f"h5/grad/{step}/{i}"] = rng.normal(size=s).astype(np.float32)
    return data


def packed(values):
    """Values as one float32 array (one npz entry per set: the file stays small); ints up to 2**24 stay exact."""
    import numpy as np

    return np.concatenate([np.asarray(v, np.float32).ravel() for v in values])


def unpack(flat, variables) -> list:
    """`packed`'s values back, split by `variables`' [path, name, dtype, shape] (meta.json)."""
    import numpy as np

    out, start = [], 0
    for *_, dtype, shape in variables:
        n = int(np.prod(shape, dtype=np.int64))
        out.append(flat[start:start + n].astype(dtype).reshape(shape))
        start += n
    assert start == flat.size, (start, flat.size)
    return out


# --- varstate's side (also imported by the tests) ----------------------------------------------------------------
def ours_optimizer(config: str, table: dict = CONFIGS):
    import jax.numpy as jnp

    from varstate.optimizers import keras

    cls, kwargs = table[config]
    kwargs = dict(kwargs)
    if kwargs.get("learning_rate") == "exponential_decay":  # Keras's ExponentialDecay(0.01, 2, 0.5), its float32 ops
        def schedule(it):
            return jnp.float32(0.01) * jnp.power(jnp.float32(0.5), it.astype(jnp.float32) / jnp.float32(2))
        kwargs["learning_rate"] = schedule
    return getattr(keras, cls)(**kwargs)


def ours_params(data):
    import varstate

    return [varstate.Variable(data[f"init/{n}"], name=n) for n in SHAPES]


def ours_gradients(data, step: int) -> list:
    import jax.numpy as jnp

    import varstate

    return [varstate.IndexedSlices(jnp.asarray(data[f"grad/{step}/{n}/values"]),
                                   jnp.asarray(data[f"grad/{step}/{n}/indices"]), s)
            if n in SPARSE else jnp.asarray(data[f"grad/{step}/{n}"]) for n, s in SHAPES.items()]


def ours_continue(config: str, data, out_dir: str | None = None):
    """Keras's TF checkpoint of `config` restored, M steps op by op; written to `out_dir` when given."""
    from checkpoint import keras

    opt = ours_optimizer(config)
    params, state = keras.load_optimizer_state(os.path.join(OUT, "keras3", config, "ckpt"), opt)
    for step in range(N_FIRST, N_FIRST + M):
        params, state = opt.update(ours_gradients(data, step), params, state)
    if out_dir is not None:
        keras.save_optimizer_state(os.path.join(out_dir, config, "ckpt"), opt, params, state)
    return opt, params, state


def ours_continue_h5(config: str, data, out_path: str | None = None):
    """Keras's <config>.weights.h5 (model and optimizer) read, M steps op by op, written back when `out_path`."""
    import jax.numpy as jnp

    from checkpoint import keras
    from checkpoint.keras._optimizer import _trainable

    opt = ours_optimizer(config, H5)
    weights, state = keras.load_optimizer_state(os.path.join(OUT, "keras3_h5", f"{config}.weights.h5"), opt)
    leaves, treedef, idx = _trainable(weights)
    for step in range(N_FIRST, N_FIRST + M):
        grads = [None] * len(leaves)
        for k, i in enumerate(idx):
            grads[i] = jnp.asarray(data[f"h5/grad/{step}/{k}"])
        weights, state = opt.update(treedef.unflatten(grads), weights, state)
    if out_path is not None:
        keras.save_weights(out_path, weights, optimizer=opt, optimizer_state=state)
    return opt, weights, state


# --- Keras's side ----------------------------------------------------------------------------------------------
def keras_side(mode: str) -> None:
    os.environ["KERAS_BACKEND"] = "tensorflow"
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    import shutil

    import keras
    import numpy as np
    import tensorflow as tf

    def optimizer(cls, kwargs):
        kwargs = dict(kwargs)
        if kwargs.get("learning_rate") == "exponential_decay":
            kwargs["learning_rate"] = keras.optimizers.schedules.ExponentialDecay(0.01, decay_steps=2,
                                                                                  decay_rate=0.5)
        return getattr(keras.optimizers, cls)(**kwargs)

    def gradients(data, step):
        return [tf.IndexedSlices(tf.constant(data[f"grad/{step}/{n}/values"]),
                                 tf.constant(data[f"grad/{step}/{n}/indices"]), tf.constant(s, tf.int64))
                if n in SPARSE else tf.constant(data[f"grad/{step}/{n}"]) for n, s in SHAPES.items()]

    def fresh(config):
        return [keras.Variable(data[f"init/{n}"], name=n) for n in SHAPES], optimizer(*CONFIGS[config])

    def model(config):
        layers = [keras.layers.Dense(b) for b in H5_LAYERS[1:]]
        m = keras.Sequential([keras.Input((H5_LAYERS[0],)), *layers])
        for i, v in enumerate(m.trainable_variables):
            v.assign(data[f"h5/init/{i}"])
        m.compile(optimizer=optimizer(*H5[config]), loss="mse")
        m.optimizer.build(m.trainable_variables)
        return m

    def h5_step(m, step):
        m.optimizer.apply_gradients(zip([tf.constant(data[f"h5/grad/{step}/{i}"])
                                         for i in range(len(m.trainable_variables))], m.trainable_variables,
                                        strict=True))

    if mode == "keras":
        data = inputs()
        out, meta = dict(data), {}
        for sub in ("keras3", "keras3_h5"):
            shutil.rmtree(os.path.join(OUT, sub), ignore_errors=True)
        for config in CONFIGS:
            params, opt = fresh(config)
            for step in range(STEPS):
                opt.apply_gradients(zip(gradients(data, step), params, strict=True))
                out[f"{config}/{step}/params"] = packed(params)
                out[f"{config}/{step}/opt"] = packed(opt.variables)
                if step + 1 == N_FIRST and config in ROUND_TRIP:
                    tf.train.Checkpoint(optimizer=opt).write(os.path.join(OUT, "keras3", config, "ckpt"))
            meta[config] = {"class": CONFIGS[config][0], "kwargs": CONFIGS[config][1],
                            "variables": [[v.path, v.name, str(v.dtype), list(v.shape)] for v in opt.variables]}
        os.makedirs(os.path.join(OUT, "keras3_h5"))
        for config in H5:
            m = model(config)
            for step in range(STEPS):
                h5_step(m, step)
                out[f"h5/{config}/{step}/weights"] = packed(m.weights)
                out[f"h5/{config}/{step}/opt"] = packed(m.optimizer.variables)
                if step + 1 == N_FIRST:
                    m.save_weights(os.path.join(OUT, "keras3_h5", f"{config}.weights.h5"))
            meta[f"h5/{config}"] = {"class": H5[config][0], "kwargs": H5[config][1],
                                    "weights": [[v.path, v.name, str(v.dtype), list(v.shape)] for v in m.weights],
                                    "variables": [[v.path, v.name, str(v.dtype), list(v.shape)]
                                                  for v in m.optimizer.variables]}
        np.savez_compressed(os.path.join(OUT, "steps.npz"), **out)
        with open(os.path.join(OUT, "meta.json"), "w") as f:
            json.dump({"keras": keras.__version__, "tensorflow": tf.__version__, "steps": STEPS, "n_first": N_FIRST,
                       "m": M, "configs": meta}, f, indent=1, sort_keys=True)
    else:  # readback
        data = dict(np.load(os.path.join(OUT, "steps.npz")))
        out = {}
        for config in ROUND_TRIP:
            params, opt = fresh(config)
            opt.build(params)
            tf.train.Checkpoint(optimizer=opt).read(os.path.join(OUT, "ours", config, "ckpt")).assert_consumed()
            for step in range(N_FIRST + M, STEPS):
                opt.apply_gradients(zip(gradients(data, step), params, strict=True))
            out[f"{config}/params"] = packed(params)
            out[f"{config}/opt"] = packed(opt.variables)
        for config in H5:
            m = model(config)
            m.load_weights(os.path.join(OUT, "ours_h5", f"{config}.weights.h5"))
            for step in range(N_FIRST + M, STEPS):
                h5_step(m, step)
            out[f"h5/{config}/weights"] = packed(m.weights)
            out[f"h5/{config}/opt"] = packed(m.optimizer.variables)
        np.savez_compressed(os.path.join(OUT, "readback.npz"), **out)
    print("wrote", OUT)


def main() -> None:
    mode = sys.argv[1] if len(sys.argv) > 1 else ""
    if mode in ("keras", "readback"):
        keras_side(mode)
    elif mode == "ours":
        import numpy as np

        data = dict(np.load(os.path.join(OUT, "steps.npz")))
        for config in ROUND_TRIP:
            ours_continue(config, data, os.path.join(OUT, "ours"))
        os.makedirs(os.path.join(OUT, "ours_h5"), exist_ok=True)
        for config in H5:
            ours_continue_h5(config, data, os.path.join(OUT, "ours_h5", f"{config}.weights.h5"))
        print("wrote", os.path.join(OUT, "ours"), os.path.join(OUT, "ours_h5"))
    else:
        sys.exit("usage: make_keras_optimizer_fixtures_3.py keras|ours|readback")


if __name__ == "__main__":
    main()
