"""Optimizer step speed and memory: varstate vs optax (jit + donation) and flax.nnx.Optimizer (nnx.jit).

Run by hand: ``.venv/bin/python benchmarks/optimizers.py`` (about a minute on 2 CPU cores).
Times are the minimum over repeats of the mean step time of a burst of steps
(the machine is noisy); a ratio < 1 means varstate is faster.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import varstate
from varstate.optimizers import Adam
from varstate.optimizers._step import _jitted_update

REPEATS = 5


def _time(runners, n_steps):
    """Min over REPEATS of each runner's mean step time, wall clock and process CPU time.

    Repeats are interleaved across runners (fair under noise). CPU time (all
    threads) is the steadier figure on a shared machine. `runners` maps a
    name to (step, carry); `carry = step(carry)` is one step.
    """
    carries = {}
    for name, (step, carry) in runners.items():
        carries[name] = jax.block_until_ready(step(step(carry)))  # compile and settle
    wall = dict.fromkeys(runners, float("inf"))
    cpu = dict.fromkeys(runners, float("inf"))
    for _ in range(REPEATS):
        for name, (step, _) in runners.items():
            carry = carries[name]
            t0, c0 = time.perf_counter(), time.process_time()
            for _ in range(n_steps):
                carry = step(carry)
            carries[name] = jax.block_until_ready(carry)
            wall[name] = min(wall[name], (time.perf_counter() - t0) / n_steps)
            cpu[name] = min(cpu[name], (time.process_time() - c0) / n_steps)
    return {name: (wall[name], cpu[name]) for name in runners}


def _optax_step(tx):
    def step(params, opt_state, grads):
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    return jax.jit(step, donate_argnums=(0, 1))


class _Model(nnx.Module):
    def __init__(self, shapes):
        for i, shape in enumerate(shapes):
            setattr(self, f"p{i}", nnx.Param(jnp.zeros(shape)))


@nnx.jit
def _nnx_step(model, optimizer, grads):
    optimizer.update(model, grads)


def bench_dense(count, shape, n_steps):
    shapes = [shape] * count
    lr = 1e-3
    grads = [jnp.full(s, 0.01) for s in shapes]

    opt = Adam(lr)
    params = [varstate.Variable(jnp.zeros(s), name=f"p{i}") for i, s in enumerate(shapes)]

    tx = optax.adam(lr)
    arrays = [jnp.zeros(s) for s in shapes]
    step = _optax_step(tx)

    model = _Model(shapes)
    optimizer = nnx.Optimizer(model, optax.adam(lr), wrt=nnx.Param)
    nnx_grads = jax.tree.map(lambda x: jnp.full(x.shape, 0.01), nnx.state(model, nnx.Param))

    def nnx_step(carry):
        _nnx_step(model, optimizer, nnx_grads)
        return nnx.state(model, nnx.Param)

    best = _time({
        "varstate": (lambda c: opt.apply_gradients(grads, *c), (params, opt.init(params))),
        "optax": (lambda c: step(*c, grads), (arrays, tx.init(arrays))),
        "nnx": (nnx_step, None),
    }, n_steps)
    return best["varstate"], best["optax"], best["nnx"]


def peak_bytes(compiled):
    m = compiled.memory_analysis()
    return m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes + m.temp_size_in_bytes


def bench_memory(count, shape):
    shapes = [shape] * count
    grads = [jnp.full(s, 0.01) for s in shapes]
    opt = Adam(1e-3)
    params = [varstate.Variable(jnp.zeros(s), name=f"p{i}") for i, s in enumerate(shapes)]
    ours = peak_bytes(_jitted_update.lower(opt, grads, params, opt.init(params), None).compile())
    tx = optax.adam(1e-3)
    arrays = [jnp.zeros(s) for s in shapes]
    ref = peak_bytes(_optax_step(tx).lower(arrays, tx.init(arrays), grads).compile())
    return ours, ref


def bench_lazy(rows, dim, touched, n_steps):
    rng = np.random.default_rng(0)
    indices = jnp.asarray(rng.integers(0, rows, touched).astype(np.int32))
    sparse = [varstate.IndexedSlices(jnp.full((touched, dim), 0.01), indices, (rows, dim))]
    lazy = Adam(1e-3, lazy=True)
    table = [varstate.Variable(jnp.zeros((rows, dim)), name="embedding")]
    lazy_t = _time({"lazy": (lambda c: lazy.apply_gradients(sparse, *c), (table, lazy.init(table)))}, n_steps)["lazy"]
    del table  # 3 x 256 MB; free it before the dense run

    dense = Adam(1e-3)
    table = [varstate.Variable(jnp.zeros((rows, dim)), name="embedding")]
    grad = [jnp.full((rows, dim), 0.01)]
    dense_t = _time({"dense": (lambda c: dense.apply_gradients(grad, *c), (table, dense.init(table)))}, 2)["dense"]
    return lazy_t, dense_t


def main():
    print(f"jax {jax.__version__} on {jax.devices()[0].platform}; min over {REPEATS} interleaved repeats")
    print("each cell: wall ms / CPU ms; ratios wall (CPU)\n")
    print(f"{'Adam step':<22}{'varstate':>16}{'optax':>16}{'nnx':>18}{'ours/optax':>16}{'nnx/ours':>16}")
    for count, shape, n in [(200, (256, 64), 20), (1000, (16, 4), 20)]:
        ours, ref, flax_t = bench_dense(count, shape, n)
        cells = "".join(f"{w * 1e3:>9.2f}/{c * 1e3:<6.2f}" for w, c in (ours, ref))
        print(f"{f'{count} x {shape[0]}x{shape[1]}':<22}{cells}{flax_t[0] * 1e3:>11.2f}/{flax_t[1] * 1e3:<6.2f}"
              f"{ours[0] / ref[0]:>9.3f} ({ours[1] / ref[1]:.3f})"
              f"{flax_t[0] / ours[0]:>8.1f}x ({flax_t[1] / ours[1]:.1f}x)")

    ours_b, ref_b = bench_memory(200, (256, 64))
    print(f"\npeak memory of one donated step (compiled memory analysis), 200 x 256x64: varstate "
          f"{ours_b / 2**20:.1f} MB, optax {ref_b / 2**20:.1f} MB, ratio {ours_b / ref_b:.3f}")

    lazy_t, dense_t = bench_lazy(1_000_000, 64, 1024, 20)
    print(f"\nAdam step on a 1,000,000 x 64 table, 1,024 rows touched: lazy {lazy_t[0] * 1e3:.3f} ms, "
          f"dense {dense_t[0] * 1e3:.1f} ms, dense/lazy {dense_t[0] / lazy_t[0]:.0f}x "
          f"(CPU {dense_t[1] / lazy_t[1]:.0f}x)")


if __name__ == "__main__":
    main()
