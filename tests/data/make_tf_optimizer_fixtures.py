"""Writes tf_optimizer_fixtures.npz: several steps of each tf.compat.v1.train optimizer, dense and sparse.

Run by hand with TensorFlow (not a test dependency):
    /work/tfvenv/bin/python tests/data/make_tf_optimizer_fixtures.py

Keys (all plain numeric or unicode arrays, no pickled objects):
    init/<var>                          initial values (w: dense 2-D, b: dense 1-D, emb: sparse 2-D, vec: sparse 1-D)
    grad/<step>/<var>                   dense gradients; grad/<step>/<var>/values and .../indices for sparse ones
    <case>/<step>/<var>                 the variable after step <step> (1-based)
    <case>/<step>/<var>/<slot>          each slot after the step
    <case>/<step>/<non-slot>            e.g. beta1_power
    <case>/slot_names                   opt.get_slot_names()
    <case>/checkpoint_keys              keys of the optimizer's variables in tf.train.Checkpoint(optimizer=, model=)
    negative_lr/<var>                   GradientDescent(-0.1), one dense step (TF accepts a negative rate)
    adagrad_zero_accumulator_error      the ValueError message for initial_accumulator_value=0

It also writes tf_optimizer_ckpt/<case>.{index,data-*}: tf.train.Checkpoint(model=vars, optimizer=opt)
after step 2 of the adam, momentum and rmsprop_centered cases (restored by the tests, then stepped once more).
"""

import os

import numpy as np
import tensorflow as tf

v1 = tf.compat.v1.train
STEPS = 3
OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tf_optimizer_fixtures.npz")
CKPT_DIR = os.path.join(os.path.dirname(OUT), "tf_optimizer_ckpt")
CKPT_CASES = ("adam", "momentum", "rmsprop_centered")

CASES = {
    "gd": lambda: v1.GradientDescentOptimizer(0.1),
    "momentum": lambda: v1.MomentumOptimizer(0.1, momentum=0.9),
    "momentum_nesterov": lambda: v1.MomentumOptimizer(0.1, momentum=0.9, use_nesterov=True),
    "adam": lambda: v1.AdamOptimizer(0.01),
    "adam_eps": lambda: v1.AdamOptimizer(0.1, beta1=0.8, beta2=0.99, epsilon=0.1),
    "adagrad": lambda: v1.AdagradOptimizer(0.1),
    "adagrad_init": lambda: v1.AdagradOptimizer(0.3, initial_accumulator_value=2.0),
    "rmsprop": lambda: v1.RMSPropOptimizer(0.01),
    "rmsprop_momentum": lambda: v1.RMSPropOptimizer(0.02, decay=0.8, momentum=0.5, epsilon=1e-6),
    "rmsprop_centered": lambda: v1.RMSPropOptimizer(0.02, decay=0.8, momentum=0.5, epsilon=1e-6, centered=True),
}


def main():
    os.makedirs(CKPT_DIR, exist_ok=True)
    rng = np.random.default_rng(1234)
    out = {}
    init = {
        "w": rng.standard_normal((5, 3)).astype(np.float32),
        "b": rng.standard_normal((3,)).astype(np.float32),
        "emb": rng.standard_normal((6, 3)).astype(np.float32),
        "vec": rng.standard_normal((6,)).astype(np.float32),
    }
    for k, x in init.items():
        out[f"init/{k}"] = x
    sparse_indices = [np.array(ix, np.int32) for ix in ([0, 2, 0, 5], [3, 3, 3, 1], [2, 4, 0, 2])]
    grads = []
    for s in range(STEPS):
        idx = sparse_indices[s]
        g = {
            "w": rng.standard_normal((5, 3)).astype(np.float32),
            "b": rng.standard_normal((3,)).astype(np.float32),
            "emb": (rng.standard_normal((4, 3)).astype(np.float32), idx),
            "vec": (rng.standard_normal((4,)).astype(np.float32), idx),
        }
        grads.append(g)
        for k, x in g.items():
            if isinstance(x, tuple):
                out[f"grad/{s + 1}/{k}/values"], out[f"grad/{s + 1}/{k}/indices"] = x
            else:
                out[f"grad/{s + 1}/{k}"] = x

    for case, make in CASES.items():
        opt = make()
        tvars = {k: tf.Variable(x, name=k) for k, x in init.items()}
        for s, g in enumerate(grads, start=1):
            pairs = []
            for k, x in g.items():
                if isinstance(x, tuple):
                    gx = tf.IndexedSlices(tf.constant(x[0]), tf.constant(x[1]), tf.constant(init[k].shape))
                else:
                    gx = tf.constant(x)
                pairs.append((gx, tvars[k]))
            opt.apply_gradients(pairs)
            if s == 2 and case in CKPT_CASES:
                tf.train.Checkpoint(optimizer=opt, model=tf.train.Checkpoint(**tvars)).write(
                    os.path.join(CKPT_DIR, case)
                )
            for k, var in tvars.items():
                out[f"{case}/{s}/{k}"] = var.numpy()
                for slot in opt.get_slot_names():
                    out[f"{case}/{s}/{k}/{slot}"] = opt.get_slot(var, slot).numpy()
            if hasattr(opt, "_get_beta_accumulators"):
                b1, b2 = opt._get_beta_accumulators()
                out[f"{case}/{s}/beta1_power"] = b1.numpy()
                out[f"{case}/{s}/beta2_power"] = b2.numpy()
        out[f"{case}/slot_names"] = np.array(sorted(opt.get_slot_names()), dtype=str)
        ckpt = tf.train.Checkpoint(optimizer=opt, model=tf.train.Checkpoint(**tvars))
        prefix = ckpt.write(os.path.join(os.environ.get("TMPDIR", "/tmp"), f"tf_opt_fixture_{case}"))
        names = [name for name, _ in tf.train.list_variables(prefix)]
        keys = sorted(n for n in names if "optimizer" in n.split("/.ATTRIBUTES")[0])
        out[f"{case}/checkpoint_keys"] = np.array(keys, dtype=str)

    var = tf.Variable(init["w"])
    v1.GradientDescentOptimizer(-0.1).apply_gradients([(tf.constant(grads[0]["w"]), var)])
    out["negative_lr/w"] = var.numpy()
    try:
        v1.AdagradOptimizer(0.1, initial_accumulator_value=0.0)
    except ValueError as e:
        out["adagrad_zero_accumulator_error"] = np.array(str(e))
    np.savez_compressed(OUT, **out)
    print(f"wrote {OUT}: {len(out)} arrays")


if __name__ == "__main__":
    main()
