"""A learning-rate sweep as one vmapped, jitted step, against a Python loop over 8 optimizers.

    .venv/bin/python examples/sweep.py

`Adam(traced(lr))` keeps the learning rate in the optimizer state, so 8 runs
that differ only in it are one program: each leaf of params and state gets a
run axis, ``state.with_hyperparameters(learning_rate=lrs)`` sets one value per
run, and ``jax.vmap(opt.update)`` steps all 8. The loop builds ``Adam(lr)``
for each rate, each a static config with its own compiled step. The two are
different XLA programs, so a step of one rounds a few values the other way (by
an ulp or two of the array's largest element); each difference feeds the next
gradient, so after 100 steps a stable run differs by a few ulps and an
unstable one (learning rate 1.0 here) by more. The best run is unstacked and
checkpointed like any other.
"""

from __future__ import annotations

import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

import checkpoint
import varstate
from varstate.optimizers import Adam, traced

LRS = np.array([0.0003, 0.001, 0.003, 0.01, 0.03, 0.1, 0.3, 1.0])
STEPS = 100


def data():
    x = jnp.asarray(np.random.default_rng(0).normal(size=(64, 8)), jnp.float32)
    y = jnp.tanh(x @ jnp.linspace(-1.0, 1.0, 8))[:, None]
    return x, y


def init_params():
    rng = np.random.default_rng(1)
    return {"hidden": jnp.asarray(rng.normal(size=(8, 16)) / 3, jnp.float32), "out": jnp.zeros((16, 1))}


def loss(params, x, y):
    return jnp.mean((jnp.tanh(x @ params["hidden"]) @ params["out"] - y) ** 2)


class Compiles:
    """Counts the programs jax lowers for the named functions, through jax's public monitoring events."""

    EVENT = "/jax/core/compile/jaxpr_to_mlir_module_duration"

    def __init__(self, *names: str) -> None:
        self.names, self.count = {f"jit({n})" for n in names}, 0

    def __call__(self, event: str, duration_secs: float, **kwargs: str | int) -> None:
        self.count += event == self.EVENT and kwargs.get("fun_name") in self.names

    def __enter__(self) -> Compiles:
        jax.monitoring.register_event_duration_secs_listener(self)
        return self

    def __exit__(self, *_exc) -> None:
        jax.monitoring.unregister_event_duration_listener(self)


def vmapped_sweep(x, y):
    """All runs at once: stacked params and state, one compiled step."""
    opt = Adam(traced(0.001))
    params = init_params()
    runs = jax.tree.map(lambda a: jnp.broadcast_to(a, (len(LRS), *jnp.shape(a))), (params, opt.init(params)))
    params_b, state_b = runs[0], runs[1].with_hyperparameters(learning_rate=LRS)

    @jax.jit
    @jax.vmap
    def sweep_step(params, state):
        return opt.update(jax.grad(loss)(params, x, y), params, state)

    for _ in range(STEPS):
        params_b, state_b = sweep_step(params_b, state_b)
    return params_b, state_b


def looped_sweep(x, y):
    """One run after another, each its own optimizer (a static learning rate) and so its own compiled step."""
    finals = []
    grad = jax.jit(jax.grad(loss))
    for lr in LRS:
        opt = Adam(float(lr))
        params = {k: varstate.Variable(v, name=k) for k, v in init_params().items()}
        state = opt.init(params)
        for _ in range(STEPS):
            params, state = opt.apply_gradients(grad(varstate.values(params), x, y), params, state)
        finals.append(varstate.values(params))
    return finals


def main() -> dict:
    x, y = data()
    with Compiles("sweep_step") as vm_compiles:
        start = time.perf_counter()
        params_b, state_b = jax.block_until_ready(vmapped_sweep(x, y))
        vm_time = time.perf_counter() - start
    with Compiles("_flat_step") as loop_compiles:
        start = time.perf_counter()
        finals = jax.block_until_ready(looped_sweep(x, y))
        loop_time = time.perf_counter() - start
    ulps = []  # per run: the largest difference, in ulps of each array's largest element
    for run, final in enumerate(finals):
        ulps.append(max(float(np.abs(np.asarray(params_b[name][run], np.float64) - np.asarray(want)).max()
                              / np.spacing(np.abs(np.asarray(want)).max())) for name, want in final.items()))
    losses = np.asarray(jax.vmap(loss, in_axes=(0, None, None))(params_b, x, y))
    best = int(np.argmin(losses))
    params_best, state_best = jax.tree.map(lambda a: a[best], (params_b, state_b))
    path = checkpoint.Checkpoint(model=params_best, optimizer=state_best).write(tempfile.mkdtemp() + "/best")
    print(f"8 learning rates, {STEPS} Adam steps each, compile included")
    print(f"  vmapped: {vm_time:.2f} s, {vm_compiles.count} compiled step")
    print(f"  loop:    {loop_time:.2f} s, {loop_compiles.count} compiled steps")
    print("  final loss by learning rate: " + ", ".join(f"{lr:g}: {v:.4f}" for lr, v in zip(LRS, losses, strict=True)))
    print("  vmapped vs loop, ulps of each array's largest element: "
          + ", ".join(f"{lr:g}: {u:.0f}" for lr, u in zip(LRS, ulps, strict=True)))
    print(f"  best: learning rate {LRS[best]:g}, checkpointed as one run at {path}")
    return {"vm_compiles": vm_compiles.count, "loop_compiles": loop_compiles.count, "ulps": ulps,
            "best": best, "losses": losses, "path": path, "params_best": params_best}


if __name__ == "__main__":
    main()
