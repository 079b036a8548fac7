"""Cost of Variables over raw arrays in a jitted step, and of creating Variables.

Prints ratios (Variables / raw arrays) of the per-call time of the same jitted
step; targets from the foundation issue: <= 1.25 for 1,000 tiny Variables (pure
dispatch, the worst case) and <= 1.05 for 200 Variables of 256x64.

The "bare node" column is the floor for any Python-registered pytree node: a
class holding the same two fields with the smallest flatten and unflatten
functions. Variables / bare node near 1.00 means Variable adds nothing of its
own; what is left over raw arrays is jax calling Python once per node on the
way in and once on the way out. (On the 2-core CI machine, 2026-12-02, a
Python node measured 1.24-1.30 on the tiny case; a throwaway C extension type
with C flatten/unflatten, 1.17-1.19: the rest is jaxlib's own work per node.)
Run: .venv/bin/python -m benchmarks.variable_overhead
"""

import gc
import time

import jax
import jax.numpy as jnp

import varstate
from benchmarks._common import per_call


class _Bare:
    __slots__ = ("handle", "value")


def _bare_unflatten(handle, children):
    node = object.__new__(_Bare)
    (node.value,) = children
    node.handle = handle
    return node


jax.tree_util.register_pytree_node(_Bare, lambda n: ((n.value,), n.handle), _bare_unflatten)


def _bare(x):
    node = object.__new__(_Bare)
    node.value, node.handle = x, object()
    return node


def _step(tree):
    return jax.tree.map(lambda x: x * 0.999 + 0.001, tree)


def compare(n, shape, calls, repeats=15):
    raw = [jnp.full(shape, float(i)) for i in range(n)]
    reg = varstate.Registry()
    wrapped = [varstate.Variable(x, name="v", registry=reg) for x in raw]
    trees = {"raw": raw, "variables": wrapped, "bare": [_bare(x) for x in raw]}
    step = jax.jit(_step)
    best = dict.fromkeys(trees, float("inf"))
    for _ in range(repeats):  # interleaved, min of repeats: the machine is noisy
        for name, tree in trees.items():
            best[name] = min(best[name], per_call(step, (tree,), calls))
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
    print(f"{'workload':<28}{'raw (us)':>10}{'Variables (us)':>16}{'ratio':>7}{'target':>8}"
          f"{'bare node':>11}{'Var/bare':>10}")
    for label, n, shape, calls, target in (
        ("1,000 tiny Variables", 1000, (2,), 50, 1.25),
        ("200 Variables of 256x64", 200, (256, 64), 50, 1.05),
    ):
        t = compare(n, shape, calls)
        ratio, bare = t["variables"] / t["raw"], t["bare"] / t["raw"]
        print(f"{label:<28}{t['raw'] * 1e6:>10.0f}{t['variables'] * 1e6:>16.0f}{ratio:>7.2f}{target:>8.2f}"
              f"{bare:>11.2f}{t['variables'] / t['bare']:>10.2f}")
    secs = creation()
    print(f"creating 100,000 Variables: {secs:.2f} s ({secs * 1e6 / 100_000:.1f} us each)")


if __name__ == "__main__":
    main()
