"""float32 vs mixed_bfloat16 (AutoCastVariable + autocast) on a matmul-heavy MLP training step.

Per-step time (min of interleaved repeats) and the compiled step's memory
(XLA memory analysis: peak, and temporaries) for the same jitted
value_and_grad + Adam step; ratios are mixed_bfloat16 / float32. Variables and
optimizer slots stay float32 in both; only the forward/backward compute and
activations change dtype. On CPUs without native bf16 matmuls expect a time
ratio above 1; the memory ratio reflects the halved activations.
Run: .venv/bin/python -m benchmarks.mixed_precision [width] [depth] [batch]
"""

import sys
import time

import jax
import jax.numpy as jnp

import varstate
from varstate import mixed_precision
from varstate.optimizers import Adam


def make(policy_name, width, depth, batch):
    policy = mixed_precision.Policy(policy_name)
    key, params = jax.random.key(0), []
    reg = varstate.Registry()
    for i in range(depth):
        key, k = jax.random.split(key)
        params.append({"kernel": varstate.Variable(jax.random.normal(k, (width, width)) / width**0.5,
                                                   name=f"dense{i}/kernel", registry=reg),
                       "bias": varstate.Variable(jnp.zeros(width), name=f"dense{i}/bias", registry=reg)})
    if policy.compute_dtype != policy.variable_dtype:
        params = mixed_precision.autocast_variables(params)
    x = jax.random.normal(jax.random.key(1), (batch, width))
    y = jnp.tanh(x)
    opt = Adam(1e-3)

    def loss_fn(params):
        with varstate.autocast(policy.compute_dtype):
            h = x.astype(policy.compute_dtype)
            for layer in params:
                h = jax.nn.gelu(h @ layer["kernel"].value + layer["bias"].value)
        return jnp.mean((h.astype(jnp.float32) - y) ** 2)

    def step(params, state):
        loss, grads = jax.value_and_grad(loss_fn)(params)
        params, state = opt.update(grads, params, state)
        return params, state, loss

    return jax.jit(step, donate_argnums=(0, 1)), params, opt.init(params)


def timed(step, params, state, calls):
    params, state, loss = step(params, state)
    jax.block_until_ready(loss)
    start = time.perf_counter()
    for _ in range(calls):
        params, state, loss = step(params, state)
    jax.block_until_ready(loss)
    return (time.perf_counter() - start) / calls, params, state


def main():
    width, depth, batch = (int(a) for a in (sys.argv[1:] + ["1024", "4", "512"][len(sys.argv) - 1:])[:3])
    print(f"jax {jax.__version__}, {jax.devices()[0].platform}; MLP {depth} x {width}x{width}, batch {batch}, Adam")
    runs = {name: make(name, width, depth, batch) for name in ("float32", "mixed_bfloat16")}
    memory = {}
    for name, (step, params, state) in runs.items():
        stats = step.lower(params, state).compile().memory_analysis()
        memory[name] = (stats.peak_memory_in_bytes, stats.temp_size_in_bytes)
    best = dict.fromkeys(runs, float("inf"))
    live = {name: (p, s) for name, (_, p, s) in runs.items()}
    for _ in range(7):  # interleaved, min of repeats: the machine is noisy
        for name, (step, _, _) in runs.items():
            t, p, s = timed(step, *live[name], calls=5)
            live[name] = (p, s)
            best[name] = min(best[name], t)
    print(f"{'policy':<16}{'step ms':>10}{'peak MiB':>10}{'temp MiB':>10}")
    for name in runs:
        print(f"{name:<16}{best[name] * 1e3:>10.2f}{memory[name][0] / 2**20:>10.1f}{memory[name][1] / 2**20:>10.1f}")
    f, b = "float32", "mixed_bfloat16"
    print(f"{'ratio bf16/f32':<16}{best[b] / best[f]:>10.2f}{memory[b][0] / memory[f][0]:>10.2f}"
          f"{memory[b][1] / memory[f][1]:>10.2f}")


if __name__ == "__main__":
    main()
