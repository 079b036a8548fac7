"""Cost of Variables over raw arrays in a jitted step, and of creating Variables.

Prints ratios (Variables / raw arrays) of the per-call time of the same jitted
step; targets from the foundation issue: <= 1.25 for 1,000 tiny Variables (pure
dispatch, the worst case) and <= 1.05 for 200 Variables of 256x64.
Run: .venv/bin/python benchmarks/variable_overhead.py
"""

import gc
import time

import jax
import jax.numpy as jnp

import varstate


def _step(tree):
    return jax.tree.map(lambda x: x * 0.999 + 0.001, tree)


def _per_call(fn, tree, calls):
    out = fn(tree)
    jax.block_until_ready(out)
    start = time.perf_counter()
    for _ in range(calls):
        out = fn(tree)
    jax.block_until_ready(out)
    return (time.perf_counter() - start) / calls


def compare(n, shape, calls, repeats=15):
    raw = [jnp.full(shape, float(i)) for i in range(n)]
    reg = varstate.Registry()
    wrapped = [varstate.Variable(x, name="v", registry=reg) for x in raw]
    step = jax.jit(_step)
    best = {"raw": float("inf"), "variables": float("inf")}
    for _ in range(repeats):  # interleaved, min of repeats: the machine is noisy
        best["raw"] = min(best["raw"], _per_call(step, raw, calls))
        best["variables"] = min(best["variables"], _per_call(step, wrapped, calls))
    return best


def creation(n=100_000):
    reg = varstate.Registry()
    value = jnp.zeros(())
    gc.collect()
    start = time.perf_counter()
    keep = [varstate.Variable(value, name="w", registry=reg) for _ in range(n)]
    elapsed = time.perf_counter() - start
    assert len(reg) == n
    del keep
    gc.collect()
    assert len(reg) == 0
    return elapsed


def main():
    print(f"jax {jax.__version__}, {jax.devices()[0].platform}")
    print(f"{'workload':<28}{'raw (us)':>12}{'Variables (us)':>16}{'ratio':>8}{'target':>8}")
    for label, n, shape, calls, target in (
        ("1,000 tiny Variables", 1000, (2,), 50, 1.25),
        ("200 Variables of 256x64", 200, (256, 64), 50, 1.05),
    ):
        t = compare(n, shape, calls)
        ratio = t["variables"] / t["raw"]
        print(f"{label:<28}{t['raw'] * 1e6:>12.0f}{t['variables'] * 1e6:>16.0f}{ratio:>8.2f}{target:>8.2f}")
    secs = creation()
    print(f"creating 100,000 Variables: {secs:.2f} s ({secs * 1e6 / 100_000:.1f} us each)")


if __name__ == "__main__":
    main()
