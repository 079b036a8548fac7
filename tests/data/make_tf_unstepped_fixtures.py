"""Writes tests/data/tf_unstepped/: TF checkpoints where one variable never received a gradient.

Run by hand with TensorFlow (never imported by the package or the tests):

    /tmp/tfvenv/bin/python tests/data/make_tf_unstepped_fixtures.py

TF creates an optimizer's slots only for the variables that get a gradient (`_create_slots(var_list)`
with the variables of non-None gradients). For each case, the variables `w` (3x2), `b` (2) and `u` (2x2)
of `tf.train.Checkpoint(model=tf.train.Checkpoint(w=, b=, u=), optimizer=<tf.compat.v1 optimizer>)`
are stepped 3 times (eager) with gradients for `w` and `b` only, then saved: the checkpoint has no
slot for `u`. Step 4 then gives all three a gradient: TF creates `u`'s slots (zeros, or the
optimizer's initial value) and updates them.

Outputs:
- <case>.{index,data-00000-of-00001}: the checkpoint after step 3.
- expected.json: per case, the optimizer's class and arguments, the initial values, the gradients of
  each step (`u` absent in steps 1-3), the checkpoint's keys, the slot names TF made for each variable
  after step 3, and every variable, slot and non-slot value after step 4.
"""

import json
import os
import shutil

import numpy as np
import tensorflow as tf

v1 = tf.compat.v1.train
OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tf_unstepped")
SHAPES = {"w": (3, 2), "b": (2,), "u": (2, 2)}
CASES = {
    "adam": ("AdamOptimizer", {"learning_rate": 0.1, "beta1": 0.8, "beta2": 0.9, "epsilon": 1e-3}),
    "momentum": ("MomentumOptimizer", {"learning_rate": 0.1, "momentum": 0.9}),
    "adagrad": ("AdagradOptimizer", {"learning_rate": 0.1, "initial_accumulator_value": 0.3}),
}


def _listed(a):
    a = np.asarray(a)
    return {"dtype": str(a.dtype), "shape": list(a.shape), "values": a.ravel().tolist()}


def run(case, cls, kwargs):
    rng = np.random.default_rng(sorted(CASES).index(case))
    init = {n: rng.standard_normal(s).astype(np.float32) for n, s in SHAPES.items()}
    tvars = {n: tf.Variable(v, name=n) for n, v in init.items()}
    opt = getattr(v1, cls)(**kwargs)
    steps = []
    for s in range(4):
        grads = {n: rng.standard_normal(SHAPES[n]).astype(np.float32) for n in SHAPES if s == 3 or n != "u"}
        steps.append(grads)
        opt.apply_gradients([(tf.constant(g), tvars[n]) for n, g in grads.items()])
        if s == 2:
            ckpt = tf.train.Checkpoint(model=tf.train.Checkpoint(**tvars), optimizer=opt)
            prefix = ckpt.write(os.path.join(OUT, case))
            keys = sorted(n for n, _ in tf.train.list_variables(prefix))
            slots_made = {n: sorted(k for k in opt.get_slot_names() if opt.get_slot(v, k) is not None)
                          for n, v in tvars.items()}
            assert slots_made["u"] == [] and slots_made["w"], slots_made
    after = {n: _listed(v.numpy()) for n, v in tvars.items()}
    for n, v in tvars.items():
        for k in opt.get_slot_names():
            after[f"{n}/{k}"] = _listed(opt.get_slot(v, k).numpy())
    if hasattr(opt, "_get_beta_accumulators"):
        for name, var in zip(("beta1_power", "beta2_power"), opt._get_beta_accumulators(), strict=True):
            after[name] = _listed(var.numpy())
    return {
        "optimizer": cls, "kwargs": kwargs, "init": {n: _listed(v) for n, v in init.items()},
        "grads": [{n: _listed(g) for n, g in grads.items()} for grads in steps],
        "keys": keys, "slots_after_step_3": slots_made, "after_step_4": after,
    }


def main():
    shutil.rmtree(OUT, ignore_errors=True)
    os.makedirs(OUT)
    expected = {case: run(case, cls, kwargs) for case, (cls, kwargs) in CASES.items()}
    with open(os.path.join(OUT, "expected.json"), "w") as f:
        json.dump(expected, f, indent=1, sort_keys=True)


if __name__ == "__main__":
    main()
