"""Train a flax nnx model with TF's Adam, checkpoint with a CheckpointManager, stop, resume, get the same numbers.

    .venv/bin/python examples/nnx_train_resume.py

Runs 60 steps straight, then 30 steps + a restart from the checkpoint + 30 more, and checks that both end
with bit-identical parameters. The checkpoint has TF's keys (`model/layers/0/kernel/.ATTRIBUTES/...`).
"""

import sys
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import checkpoint
import varstate
from varstate.nnx import from_nnx, loss_fn, to_nnx
from varstate.optimizers import Adam


class MLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.layers = nnx.List([nnx.Linear(4, 16, rngs=rngs), nnx.Linear(16, 1, rngs=rngs)])

    def __call__(self, x):
        return self.layers[1](jax.nn.relu(self.layers[0](x)))


X = jax.random.normal(jax.random.key(1), (64, 4))
Y = jnp.sin(X.sum(axis=1, keepdims=True))
opt = Adam(0.01)


def train(directory: str, steps: int) -> dict:
    model = MLP(nnx.Rngs(0))
    params = from_nnx(model)
    state = opt.init(params)
    with checkpoint.CheckpointManager(directory, max_to_keep=2) as mgr:
        start = mgr.latest_step() or 0
        if start:
            restored = mgr.restore(model=params, optimizer=state)
            params, state = restored.model, restored.optimizer
            print(f"   resumed at step {start}")

        # The loss written on the Module, as a function of the params' values: its gradient has their structure.
        grads_of = jax.jit(jax.value_and_grad(loss_fn(model, lambda m: jnp.mean((m(X) - Y) ** 2))))

        for step in range(start + 1, steps + 1):
            loss, grads = grads_of(varstate.values(params))
            params, state = opt.apply_gradients(grads, params, state)
            if step % 10 == 0:
                mgr.save(step, model=params, optimizer=state)
                print(f"   step {step:3d}  loss {float(loss):.4f}")
    to_nnx(model, params)
    return varstate.values(params)


if __name__ == "__main__":
    a, b = tempfile.mkdtemp(), tempfile.mkdtemp()
    print("== straight through")
    straight = train(a, 60)
    print("== 30 steps, then a new process would resume")
    train(b, 30)
    resumed = train(b, 60)
    same = jax.tree.all(jax.tree.map(lambda x, y: bool(np.array_equal(x, y)), straight, resumed))
    print("OK: bit-identical after resuming" if same else "MISMATCH")
    sys.exit(0 if same else 1)
