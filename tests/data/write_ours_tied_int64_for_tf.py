"""The middle step of make_tf_tied_int64_fixtures.py: checkpoints written by OUR code, for TensorFlow to check.

make_tf_tied_int64_fixtures.py (TF venv) runs this with the repository's venv after TF wrote tf_int64/:

    .venv/bin/python tests/data/write_ours_tied_int64_for_tf.py

Writes under tests/data/tf_checkpoints/:
  ours_tied/   TF's testAnonymousVarsInInit in varstate: a model holding each of `w` and `b` twice (as
               attributes and in the list `vars`) and varstate's Adam state after two steps,
               `checkpoint.Checkpoint(model=..., optimizer=...).save(format="tf")`.
  ours_int64/  TF's tf_int64/ (int64 and float64 counters, a Keras Adam's int64 `iterations`) restored into
               varstate Variables (int32 and float32: JAX's 64-bit types are off) and a plain-array leaf, then
               saved back with `Checkpoint.save(format="tf")`: every value keeps its stored dtype.

The tests import TIED_LR, tied_training and int64_templates from here, so the checkpoints TF checked and the
ones the tests write come from one definition.
"""

import os
import shutil

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tf_checkpoints")
TIED_LR = 0.05  # testAnonymousVarsInInit's AdamOptimizer(learning_rate=0.05)
TIED_STEPS = 2


def tied_loss(values):
    """testAnonymousVarsInInit's loss: (1 - (x * w + b)) ** 2 at x = 1, reading w and b through the list."""
    w, b = values["vars"]
    return (1.0 - (1.0 * w + b)) ** 2


def tied_training(registry=None):
    """(model, Adam state) after TIED_STEPS steps; `model` holds w and b twice, as TF's Model(w, b, vars=[w, b])."""
    import jax
    import jax.numpy as jnp

    import varstate
    from varstate.optimizers import Adam

    w = varstate.Variable(jnp.float32(0.0), name="w", registry=registry)
    b = varstate.Variable(jnp.float32(0.0), name="b", registry=registry)
    model = {"w": w, "b": b, "vars": [w, b]}
    opt = Adam(TIED_LR)
    state = opt.init(model)
    for _ in range(TIED_STEPS):
        values = jax.tree.map(lambda v: v.value, model, is_leaf=lambda x: isinstance(x, varstate.Variable))
        # The places not read get zero gradients; a variable's gradients at its places add up (TF's tape).
        model, state = opt.apply_gradients(jax.grad(tied_loss)(values), model, state)
    return model, state


def int64_templates(registry=None):
    """Templates for tf_int64/: what a JAX program holds for TF's int64/float64 values with 64-bit types off."""
    import jax.numpy as jnp

    import varstate

    def var(value, name):
        return varstate.Variable(value, name=name, registry=registry)

    iterations = var(jnp.int32(0), "iteration")
    learning_rate = var(jnp.float32(0), "learning_rate")
    m, v = var(jnp.zeros(2, jnp.float32), "w_momentum"), var(jnp.zeros(2, jnp.float32), "w_velocity")
    return {
        "model": {
            "step": var(jnp.int32(0), "step"),
            "counts": var(jnp.zeros(3, jnp.int32), "counts"),
            "x": var(jnp.float32(0), "x"),
            "w": var(jnp.zeros(2, jnp.float32), "w"),
            "plain": jnp.zeros(2, jnp.int32),  # a plain array: no handle to remember the stored dtype on
        },
        # A Keras 3 optimizer's trackables: `_variables` lists the iteration and the learning rate again.
        "optimizer": {"_iterations": iterations, "_learning_rate": learning_rate,
                      "_variables": [iterations, learning_rate, m, v]},
    }


def ours_tied(directory: str) -> str:
    import checkpoint
    import varstate

    model, state = tied_training(varstate.Registry())
    return checkpoint.Checkpoint(model=model, optimizer=state).save(os.path.join(directory, "ckpt"), format="tf")


def ours_int64(directory: str) -> str:
    import checkpoint
    import varstate

    source = os.path.join(OUT, "tf_int64", "ckpt-1")
    roots = checkpoint.Checkpoint(**int64_templates(varstate.Registry())).restore(source).assert_consumed().roots
    return checkpoint.Checkpoint(**roots).save(os.path.join(directory, "ckpt"), format="tf")


def main() -> None:
    for sub in ("ours_tied", "ours_int64"):
        shutil.rmtree(os.path.join(OUT, sub), ignore_errors=True)
    print("wrote", ours_tied(os.path.join(OUT, "ours_tied")))
    print("wrote", ours_int64(os.path.join(OUT, "ours_int64")))


if __name__ == "__main__":
    main()
