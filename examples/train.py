"""A resumable training loop: an MLP on synthetic data, varstate Adam, a global step, CheckpointManager.

    python examples/train.py --dir /tmp/run --steps 300                  # train (or resume) to step 300
    python examples/train.py --dir /tmp/run --steps 300 --stop-after 100 # stop after 100 steps of this run
    kill -TERM <pid>                                                     # saves a checkpoint and exits

Every step's batch is a pure function of (seed, step), so a run that is
stopped and resumed from its checkpoint ends with exactly the parameters of an
uninterrupted one, bit for bit. `--out params.npz` writes the final parameters.
"""

from __future__ import annotations

import argparse
import itertools
import signal
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import checkpoint
import varstate
from varstate.optimizers import Adam

SIZES = (16, 64, 64, 1)
BATCH = 128


def make_model(seed: int) -> dict:
    rng = np.random.default_rng(seed)  # numpy: nothing to compile
    model = {}
    for i, (n_in, n_out) in enumerate(itertools.pairwise(SIZES)):
        kernel = jnp.asarray(rng.standard_normal((n_in, n_out), np.float32) * np.float32((2.0 / n_in) ** 0.5))
        model[f"dense{i}"] = {
            "kernel": varstate.Variable(kernel, name=f"dense{i}/kernel"),
            "bias": varstate.Variable(jnp.zeros(n_out), name=f"dense{i}/bias"),
        }
    return model


def forward(model: dict, x: jax.Array) -> jax.Array:
    for i in range(len(SIZES) - 1):
        layer = model[f"dense{i}"]
        x = x @ layer["kernel"].value + layer["bias"].value
        if i < len(SIZES) - 2:
            x = jax.nn.relu(x)
    return x[:, 0]


@jax.jit
def batch(seed: int, step: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The batch of `step`: depends on nothing else, so a resumed run sees the same data."""
    kx, kn = jax.random.split(jax.random.fold_in(jax.random.PRNGKey(seed), step))
    x = jax.random.normal(kx, (BATCH, SIZES[0]))
    y = jnp.sin(x[:, 0]) + 0.5 * x[:, 1] * x[:, 2] + 0.1 * jax.random.normal(kn, (BATCH,))
    return x, y


@jax.jit
def loss_and_grads(model: dict, x: jax.Array, y: jax.Array):
    def loss(m):
        return jnp.mean((forward(m, x) - y) ** 2)

    return jax.value_and_grad(loss)(model)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", required=True, help="checkpoint directory")
    p.add_argument("--steps", type=int, default=300, help="train until the global step reaches this")
    p.add_argument("--stop-after", type=int, default=None, help="stop (and save) after this many steps of this run")
    p.add_argument("--save-every", type=int, default=100)
    p.add_argument("--log-every", type=int, default=50)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--async-save", action="store_true",
                   help="save in the background (the next steps donate the saved buffers meanwhile)")
    p.add_argument("--out", default=None, help="write the final parameters to this .npz")
    args = p.parse_args(argv)

    stop = {"signal": None}
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: stop.update(signal=signum))
    try:
        return _train(args, stop)
    finally:
        signal.signal(signal.SIGTERM, previous)


def _train(args: argparse.Namespace, stop: dict) -> int:
    registry = varstate.Registry()
    model = make_model(args.seed)
    opt = Adam(1e-2)
    state = opt.init(model)
    global_step = varstate.get_or_create_global_step(registry)
    manager = checkpoint.CheckpointManager(
        args.dir, max_to_keep=3, async_save=args.async_save, save_interval_steps=args.save_every
    )
    if manager.latest_checkpoint:
        status = manager.restore(model=model, optimizer=state, global_step=global_step).assert_consumed()
        model, state, global_step = status.model, status.optimizer, status.global_step
        print(f"resumed from {manager.latest_checkpoint} at step {int(global_step.value)}", flush=True)
    else:
        print("starting from scratch", flush=True)

    def save() -> None:
        step = int(global_step.value)
        if step in manager.all_steps():  # saved already (the last step is a multiple of --save-every)
            return
        manager.save(step, model=model, optimizer=state, global_step=global_step)

    ran, loss, t0 = 0, float("nan"), time.perf_counter()
    while int(global_step.value) < args.steps:
        x, y = batch(args.seed, global_step.value)
        loss, grads = loss_and_grads(model, x, y)
        model, state = opt.apply_gradients(grads, model, state)
        global_step = global_step.assign_add(1)
        ran += 1
        step = int(global_step.value)
        if step % args.log_every == 0:
            print(f"  step {step:4d}/{args.steps}  loss {float(loss):.4f}", flush=True)
        if stop["signal"] is not None:
            save()
            print(f"SIGTERM at step {step}: checkpoint saved, exiting", flush=True)
            manager.close()
            return 0
        if args.stop_after is not None and ran >= args.stop_after:
            save()
            print(f"stopped after {ran} steps at step {step}: checkpoint saved", flush=True)
            manager.close()
            return 0
        if manager.should_save(step):
            save()
    if ran:
        save()
    manager.close()
    print(f"done: step {int(global_step.value)}, {ran} steps in {time.perf_counter() - t0:.1f}s", flush=True)
    if args.out:
        flat = {f"{name}/{k}": np.asarray(v.value) for name, layer in model.items() for k, v in layer.items()}
        np.savez(args.out, **flat)
    return 0


if __name__ == "__main__":
    sys.exit(main())
