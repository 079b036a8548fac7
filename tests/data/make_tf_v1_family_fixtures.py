"""Writes tf_v1_family_fixtures.npz: 3 steps of TF v1's Adadelta, AdagradDA, Ftrl, ProximalAdagrad, ProximalGD.

Run by hand with TensorFlow (not a test dependency):
    /tmp/tfvenv/bin/python tests/data/make_tf_v1_family_fixtures.py

Keys (plain numeric or unicode arrays, no pickled objects), as in tf_optimizer_fixtures.npz:
    init/<var>                      initial values (w: dense 2-D, b: dense 1-D, emb: sparse 2-D, vec: sparse 1-D)
    grad/<step>/<var>               dense gradients; grad/<step>/<var>/values and .../indices for sparse ones
                                    (each sparse gradient repeats an index, which TF sums before its kernel)
    <case>/<step>/<var>             the variable after step <step> (1-based)
    <case>/<step>/<var>/<slot>      each slot after the step
    <case>/slot_names               opt.get_slot_names(), sorted
    <case>/checkpoint_keys          keys of the optimizer's variables in tf.train.Checkpoint(optimizer=, model=)
    <case>/dtype                    the variables' dtype (a case ending in _f64 runs in float64)
    error/<name>/type, .../message  the exception TF raises for a bad argument (at construction, or for the
                                    ones TF's kernels check, at the first apply_gradients)

AdagradDA gets `global_step`, an int64 variable starting at 0 that apply_gradients(global_step=) increments:
TF's kernel sees global_step + 1, so step s (1-based) runs with the global step s - 1.
"""

import os

import numpy as np
import tensorflow as tf

v1 = tf.compat.v1.train
STEPS = 3
OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tf_v1_family_fixtures.npz")

# Each make(global_step) builds the optimizer; only AdagradDA uses the global step.
CASES = {
    "adadelta": lambda gs: v1.AdadeltaOptimizer(),
    "adadelta_lr": lambda gs: v1.AdadeltaOptimizer(1.0, rho=0.9, epsilon=1e-6),
    "adagrad_da": lambda gs: v1.AdagradDAOptimizer(0.1, gs),
    "adagrad_da_l1": lambda gs: v1.AdagradDAOptimizer(0.1, gs, l1_regularization_strength=0.5),
    "adagrad_da_l2": lambda gs: v1.AdagradDAOptimizer(
        0.1, gs, initial_gradient_squared_accumulator_value=0.5, l2_regularization_strength=0.3),
    "adagrad_da_l1_l2": lambda gs: v1.AdagradDAOptimizer(
        0.2, gs, l1_regularization_strength=0.3, l2_regularization_strength=0.2),
    "ftrl": lambda gs: v1.FtrlOptimizer(0.1),
    "ftrl_l1": lambda gs: v1.FtrlOptimizer(0.1, l1_regularization_strength=2.0),
    "ftrl_l2": lambda gs: v1.FtrlOptimizer(0.1, initial_accumulator_value=0.5, l2_regularization_strength=0.3),
    "ftrl_zero_accum": lambda gs: v1.FtrlOptimizer(0.2, initial_accumulator_value=0.0),
    "ftrl_shrinkage": lambda gs: v1.FtrlOptimizer(
        0.1, l1_regularization_strength=0.5, l2_regularization_strength=0.2, l2_shrinkage_regularization_strength=0.3),
    "ftrl_power": lambda gs: v1.FtrlOptimizer(0.1, learning_rate_power=-0.7, l1_regularization_strength=0.5),
    "ftrl_power_zero": lambda gs: v1.FtrlOptimizer(0.3, learning_rate_power=0.0),
    "ftrl_power_shrinkage": lambda gs: v1.FtrlOptimizer(
        0.1, learning_rate_power=-0.6, l2_shrinkage_regularization_strength=0.2),
    "ftrl_beta": lambda gs: v1.FtrlOptimizer(0.1, l2_regularization_strength=0.1, beta=0.4),
    "proximal_adagrad": lambda gs: v1.ProximalAdagradOptimizer(0.1),
    "proximal_adagrad_l1": lambda gs: v1.ProximalAdagradOptimizer(0.1, l1_regularization_strength=2.0),
    "proximal_adagrad_l2": lambda gs: v1.ProximalAdagradOptimizer(
        0.1, initial_accumulator_value=0.3, l2_regularization_strength=0.5),
    "proximal_adagrad_l1_l2": lambda gs: v1.ProximalAdagradOptimizer(
        0.3, l1_regularization_strength=1.0, l2_regularization_strength=0.5),
    "proximal_gd": lambda gs: v1.ProximalGradientDescentOptimizer(0.1),
    "proximal_gd_l1": lambda gs: v1.ProximalGradientDescentOptimizer(0.1, l1_regularization_strength=2.0),
    "proximal_gd_l2": lambda gs: v1.ProximalGradientDescentOptimizer(0.1, l2_regularization_strength=0.5),
    "proximal_gd_l1_l2": lambda gs: v1.ProximalGradientDescentOptimizer(
        0.2, l1_regularization_strength=1.0, l2_regularization_strength=0.5),
    # TF checks no ProximalGradientDescent argument: a negative l1 fails `l1 > 0` and is ignored.
    "proximal_gd_negative_l1": lambda gs: v1.ProximalGradientDescentOptimizer(0.1, l1_regularization_strength=-0.5),
    # float64 variables: TF casts each float32 hyperparameter to float64 and runs its kernels in double.
    # (ProximalAdagrad and ProximalGradientDescent pass float32 hyperparameters uncast: no float64 there.)
    "adadelta_lr_f64": lambda gs: v1.AdadeltaOptimizer(1.0, rho=0.9, epsilon=1e-6),
    "adagrad_da_l1_l2_f64": lambda gs: v1.AdagradDAOptimizer(
        0.2, gs, l1_regularization_strength=0.3, l2_regularization_strength=0.2),
    "ftrl_shrinkage_f64": lambda gs: v1.FtrlOptimizer(
        0.1, l1_regularization_strength=0.5, l2_regularization_strength=0.2, l2_shrinkage_regularization_strength=0.3),
    "ftrl_power_f64": lambda gs: v1.FtrlOptimizer(0.1, learning_rate_power=-0.7, l1_regularization_strength=0.5),
}

# Arguments TF refuses: the optimizer, its arguments, and whether TF checks them in its constructor (a ValueError)
# or in its kernel at the first step (InvalidArgumentError; "sparse" when only the sparse kernel checks).
ERRORS = {
    "ftrl_initial_accumulator_value": (v1.FtrlOptimizer, {"learning_rate": 0.1, "initial_accumulator_value": -0.1}),
    "ftrl_learning_rate_power": (v1.FtrlOptimizer, {"learning_rate": 0.1, "learning_rate_power": 0.5}),
    "ftrl_l1": (v1.FtrlOptimizer, {"learning_rate": 0.1, "l1_regularization_strength": -1.0}),
    "ftrl_l2": (v1.FtrlOptimizer, {"learning_rate": 0.1, "l2_regularization_strength": -1.0}),
    "ftrl_l2_shrinkage": (v1.FtrlOptimizer, {"learning_rate": 0.1, "l2_shrinkage_regularization_strength": -1.0}),
    "ftrl_learning_rate_sparse": (v1.FtrlOptimizer, {"learning_rate": 0.0}),
    "proximal_adagrad_initial_accumulator_value": (
        v1.ProximalAdagradOptimizer, {"learning_rate": 0.1, "initial_accumulator_value": 0.0}),
    "proximal_adagrad_learning_rate": (v1.ProximalAdagradOptimizer, {"learning_rate": 0.0}),
    "proximal_adagrad_l1": (v1.ProximalAdagradOptimizer, {"learning_rate": 0.1, "l1_regularization_strength": -1.0}),
    "proximal_adagrad_l2": (v1.ProximalAdagradOptimizer, {"learning_rate": 0.1, "l2_regularization_strength": -1.0}),
    "adagrad_da_initial_gradient_squared_accumulator_value": (
        v1.AdagradDAOptimizer, {"learning_rate": 0.1, "initial_gradient_squared_accumulator_value": 0.0}),
}


def _error(cls, kwargs, sparse):
    """(type name, message) of what TF raises constructing `cls(**kwargs)` and stepping it once."""
    try:
        if cls is v1.AdagradDAOptimizer:
            kwargs = {**kwargs, "global_step": tf.Variable(0, dtype=tf.int64)}
        opt = cls(**kwargs)
        var = tf.Variable(np.ones((3, 2), np.float32))
        if sparse:
            grad = tf.IndexedSlices(tf.ones((1, 2)), tf.constant([1]), tf.constant([3, 2]))
        else:
            grad = tf.ones((3, 2))
        opt.apply_gradients([(grad, var)])
    except (ValueError, tf.errors.InvalidArgumentError) as e:
        message = e.message if isinstance(e, tf.errors.OpError) else str(e)
        return type(e).__name__, message
    raise AssertionError(f"TF accepted {cls.__name__}({kwargs}) with a {'sparse' if sparse else 'dense'} gradient")


def main():
    rng = np.random.default_rng(4321)
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
        dtype = np.float64 if case.endswith("_f64") else np.float32
        global_step = tf.Variable(0, dtype=tf.int64, name="global_step")
        opt = make(global_step)
        tvars = {k: tf.Variable(x.astype(dtype), name=k) for k, x in init.items()}
        for s, g in enumerate(grads, start=1):
            pairs = []
            for k, x in g.items():
                if isinstance(x, tuple):
                    values = tf.constant(x[0].astype(dtype))
                    gx = tf.IndexedSlices(values, tf.constant(x[1]), tf.constant(init[k].shape))
                else:
                    gx = tf.constant(x.astype(dtype))
                pairs.append((gx, tvars[k]))
            opt.apply_gradients(pairs, global_step=global_step)
            assert global_step.numpy() == s
            for k, var in tvars.items():
                out[f"{case}/{s}/{k}"] = var.numpy()
                for slot in opt.get_slot_names():
                    out[f"{case}/{s}/{k}/{slot}"] = opt.get_slot(var, slot).numpy()
        out[f"{case}/slot_names"] = np.array(sorted(opt.get_slot_names()), dtype=str)
        out[f"{case}/dtype"] = np.array(np.dtype(dtype).name)
        ckpt = tf.train.Checkpoint(optimizer=opt, model=tf.train.Checkpoint(**tvars))
        prefix = ckpt.write(os.path.join(os.environ.get("TMPDIR", "/tmp"), f"tf_v1_family_fixture_{case}"))
        names = [name for name, _ in tf.train.list_variables(prefix)]
        keys = sorted(n for n in names if "optimizer" in n.split("/.ATTRIBUTES")[0])
        out[f"{case}/checkpoint_keys"] = np.array(keys, dtype=str)

    for name, (cls, kwargs) in ERRORS.items():
        kind, message = _error(cls, dict(kwargs), sparse=name.endswith("_sparse"))
        out[f"error/{name}/type"] = np.array(kind)
        out[f"error/{name}/message"] = np.array(message)
    np.savez_compressed(OUT, **out)
    print(f"wrote {OUT}: {len(out)} arrays")


if __name__ == "__main__":
    main()
