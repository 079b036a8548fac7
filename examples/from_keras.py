"""Continue a Keras optimizer's training in JAX, then hand it back to Keras.

Reads a TF checkpoint Keras 3 wrote with ``tf.train.Checkpoint(optimizer=opt).write(path)`` (the
optimizer's ``_trainable_variables`` and its state: ``iteration``, ``learning_rate``, every slot),
takes --steps jitted steps of a small embedding + dense regression with the same Keras optimizer
(Keras's update rule and constants, `varstate.optimizers.keras`), and writes the result back in
Keras 3's layout. In Keras:

    opt = keras.optimizers.Adam(0.01); opt.build(model_variables)
    tf.train.Checkpoint(optimizer=opt).read(out).assert_consumed()

and training continues from iteration N+steps, with the params and moments varstate left.

    python examples/from_keras.py --steps 20 --out /tmp/continued/ckpt

The default input is the repository's fixture: 3 Adam steps Keras took on a (3, 2) kernel, a (2,) bias
and a (5, 3) embedding (tests/data/keras_optimizers/keras3/adam/ckpt).
"""

from __future__ import annotations

import argparse
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

from checkpoint import keras
from varstate.optimizers import keras as keras_opt

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT = os.path.join(HERE, "..", "tests", "data", "keras_optimizers", "keras3", "adam", "ckpt")
OPTIMIZERS = {"adam": lambda lr: keras_opt.Adam(lr), "sgd": lambda lr: keras_opt.SGD(lr, momentum=0.9),
              "rmsprop": lambda lr: keras_opt.RMSprop(lr), "adamw": lambda lr: keras_opt.AdamW(lr)}


def loss(values: list, ids: jax.Array, target: jax.Array) -> jax.Array:
    """Mean squared error of mean(embedding[ids]) @ kernel + bias against `target`."""
    kernel, bias, emb = values
    pred = jnp.mean(emb[ids], axis=1) @ kernel + bias
    return jnp.mean((pred - target) ** 2)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", default=DEFAULT, help="Keras 3 TF checkpoint prefix (optimizer's state)")
    parser.add_argument("--optimizer", default="adam", choices=sorted(OPTIMIZERS), help="as Keras's was made")
    parser.add_argument("--learning-rate", type=float, default=0.01)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--out", required=True, help="checkpoint prefix to write, for Keras")
    args = parser.parse_args(argv)

    opt = OPTIMIZERS[args.optimizer](args.learning_rate)
    params, state = keras.load_optimizer_state(args.checkpoint, opt)  # the optimizer's variables, in Keras's order
    start = state.non_slot("iteration").value.item()
    rng = np.random.default_rng(0)
    ids = jnp.asarray(rng.integers(0, params[2].shape[0], size=(16, 2)))
    target = jnp.asarray(rng.normal(size=(16, params[0].shape[1])).astype(np.float32))
    grad_fn = jax.jit(jax.value_and_grad(loss))
    first = None
    for _ in range(args.steps):
        value, grads = grad_fn([p.value for p in params], ids, target)
        first = float(value) if first is None else first
        params, state = opt.apply_gradients(grads, params, state)
    last = float(loss([p.value for p in params], ids, target))
    keras.save_optimizer_state(args.out, opt, params, state)
    print(f"{[p.name for p in params]}: Keras iteration {start} -> {state.non_slot('iteration').value.item()}, "
          f"loss {first:.4f} -> {last:.4f}; wrote {args.out} (Keras: tf.train.Checkpoint(optimizer=opt).read(...))")
    return 0


if __name__ == "__main__":
    sys.exit(main())
