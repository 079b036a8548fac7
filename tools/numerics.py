"""Measures the optimizers' numerics: jitted steps against op by op, and against TF v1's, Keras's and optax's twins.

For every optimizer of `varstate.optimizers` (TF v1) and `varstate.optimizers.keras`, on one fixed model (a
64x32 kernel of standard normal values, a bias of 32 values of order 1e-3, a scalar) and one fixed sequence of
gradients (the same for every run, independent of the params, so that a difference is the optimizers' arithmetic
alone), after each of ``--steps`` steps:

  jit    ``opt.update`` outside jit (op by op: TF's and Keras's numbers bit for bit, which the fixture tests
         under tests/varstate/optimizers/ pin) against one jitted step from the same inputs (``opt.update`` under
         ``jax.jit``, the worst step) and against ``opt.apply_gradients`` after N steps, over the params and
         every slot: the largest difference in ulps of its array's largest element (the promise), and in ulps
         of the element itself (unbounded near zero);
  twins  op by op against the closest formula elsewhere with the same hyperparameters: the TF v1 optimizer
         against the Keras one, and either against the closest optax alias run op by op: the largest
         difference of the params, relative to their array's largest element.

    nice -n 10 .venv/bin/python tools/numerics.py [--steps 7 100]

Prints Markdown tables (docs/guides/optimizers.md quotes them) and the machine they ran on.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import varstate
from varstate.optimizers import (
    Adadelta,
    Adagrad,
    AdagradDA,
    Adam,
    Ftrl,
    GradientDescent,
    Momentum,
    ProximalAdagrad,
    ProximalGradientDescent,
    RMSProp,
    from_optax,
    keras,
)


def model() -> dict[str, np.ndarray]:
    """Values of order 1 (which the steps carry through zero) and values near zero."""
    rng = np.random.default_rng(0)
    return {
        "kernel": rng.standard_normal((64, 32)).astype(np.float32),
        "bias": (rng.standard_normal(32) * 1e-3).astype(np.float32),
        "scale": np.float32(0.5),
    }


def gradients(t: int, values: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Step ``t``'s gradients: order 1 for the kernel and the scalar, order 1e-3 for the bias."""
    def wave(shape: tuple[int, ...], freq: float, amp: float) -> np.ndarray:
        i = np.arange(int(np.prod(shape)), dtype=np.float64).reshape(shape)
        return (amp * np.cos(freq * i + 0.9 * t) + 0.1 * amp).astype(np.float32)

    return {k: wave(np.shape(v), 0.37 if k == "kernel" else 1.3, 1e-3 if k == "bias" else 1.0)
            for k, v in values.items()}


def is_var(x: Any) -> bool:
    return isinstance(x, varstate.Variable)


def _needs_step(opt: Any) -> bool:
    return isinstance(opt, AdagradDA)


def snapshot(params: dict, state: Any) -> dict[str, np.ndarray]:
    """The params and slots as {"name" or "slot['name']": array}."""
    snap = {k: np.asarray(v.value) for k, v in params.items()}
    for slot, tree in state.slots.items():
        for path, leaf in jax.tree_util.tree_leaves_with_path(tree, is_leaf=is_var):
            snap[f"{slot}{jax.tree_util.keystr(path)}"] = np.asarray(leaf.value if is_var(leaf) else leaf)
    return snap


def run_ours(make: Callable[[], Any], steps: int, jitted: bool) -> tuple[list[dict[str, np.ndarray]], float]:
    """The params and slots after each step; op by op also the worst single jitted step from the same inputs
    (``opt.update`` under ``jax.jit``, what ``apply_gradients`` compiles), in ulps of the array's largest element."""
    opt = make()
    params = {k: varstate.Variable(jnp.asarray(v), name=k) for k, v in model().items()}
    state = opt.init(params)
    one_step = jax.jit(lambda g, p, s, step: opt.update(g, p, s, step=step))
    out, worst = [], 0.0
    for t in range(steps):
        grads = {k: jnp.asarray(g) for k, g in gradients(t, model()).items()}
        step = t if _needs_step(opt) else None
        if jitted:
            params, state = opt.apply_gradients(grads, params, state, **({"step": step} if step is not None else {}))
        else:
            jit_snap = snapshot(*one_step(grads, params, state, step))
            params, state = opt.update(grads, params, state, step=step)
        out.append(snapshot(params, state))
        if not jitted:
            worst = max(worst, *(ulps_of_largest(out[-1][k], jit_snap[k]) for k in out[-1]))
    return out, worst


def run_optax(tx: Any, steps: int) -> list[dict[str, np.ndarray]]:
    """optax's params after each step, op by op (outside jit), as the reference runs."""
    params = {k: jnp.asarray(v) for k, v in model().items()}
    opt_state = tx.init(params)
    out = []
    for t in range(steps):
        grads = {k: jnp.asarray(g) for k, g in gradients(t, model()).items()}
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        out.append({k: np.asarray(v) for k, v in params.items()})
    return out


def ulps_of_largest(ref: np.ndarray, other: np.ndarray) -> float:
    """max |ref - other| in ulps of the largest magnitude in ``ref`` (as tests/varstate/optimizers/test_fused.py)."""
    a, b = ref.astype(np.float64), other.astype(np.float64)
    if np.array_equal(a, b):
        return 0.0
    largest = np.max(np.abs(a))
    if largest == 0:
        return float("inf")
    ulp = 2.0 ** (np.floor(np.log2(largest)) - ml_dtypes.finfo(ref.dtype).nmant)
    return float(np.max(np.abs(a - b)) / ulp)


def ulps_of_element(ref: np.ndarray, other: np.ndarray) -> tuple[float, float]:
    """(max |ref - other| in ulps of each element of ``ref`` itself, that element's value)."""
    diff = np.abs(ref.astype(np.float64) - other.astype(np.float64))
    if not diff.any():
        return 0.0, 0.0
    ulps = diff / np.spacing(np.abs(ref)).astype(np.float64)
    i = int(np.argmax(ulps))
    return float(ulps.flat[i]), float(ref.flat[i])


def relative(ref: dict[str, np.ndarray], other: dict[str, np.ndarray]) -> float:
    """Largest |ref - other| of the params, relative to the largest magnitude of the array it is in
    (an array that is all zeros, as FTRL's L1 makes the bias, counts its largest difference as it is)."""
    return max(float(np.max(np.abs(ref[k].astype(np.float64) - other[k])) / (np.max(np.abs(ref[k])) or 1.0))
               for k in model())


# (label, our optimizer, [(twin label, twin: a varstate optimizer or an optax transformation)]).
ROWS: list[tuple[str, Callable[[], Any], list[tuple[str, Callable[[], Any]]]]] = [
    ("GradientDescent(0.1)", lambda: GradientDescent(0.1),
     [("keras.SGD(0.1)", lambda: keras.SGD(0.1)), ("optax.sgd(0.1)", lambda: optax.sgd(0.1))]),
    ("Momentum(0.1, 0.9)", lambda: Momentum(0.1, 0.9),
     [("keras.SGD(0.1, momentum=0.9)", lambda: keras.SGD(0.1, momentum=0.9)),
      ("optax.sgd(0.1, 0.9)", lambda: optax.sgd(0.1, 0.9))]),
    ("Momentum(0.1, 0.9, use_nesterov=True)", lambda: Momentum(0.1, 0.9, use_nesterov=True),
     [("keras.SGD(0.1, momentum=0.9, nesterov=True)", lambda: keras.SGD(0.1, momentum=0.9, nesterov=True)),
      ("optax.sgd(0.1, 0.9, nesterov=True)", lambda: optax.sgd(0.1, 0.9, nesterov=True))]),
    ("Adam(0.01)", lambda: Adam(0.01),
     [("keras.Adam(0.01, epsilon=1e-8)", lambda: keras.Adam(0.01, epsilon=1e-8)),
      ("optax.adam(0.01)", lambda: optax.adam(0.01))]),
    ("Adagrad(0.1)", lambda: Adagrad(0.1),
     [("keras.Adagrad(0.1, epsilon=0)", lambda: keras.Adagrad(0.1, epsilon=0.0)),
      ("optax.adagrad(0.1, eps=0)", lambda: optax.adagrad(0.1, eps=0.0))]),
    ("RMSProp(0.01)", lambda: RMSProp(0.01),
     [("optax.rmsprop(0.01, eps=1e-10, initial_scale=1)", lambda: optax.rmsprop(0.01, eps=1e-10, initial_scale=1.0))]),
    ("RMSProp(0.01, momentum=0.5, centered=True)", lambda: RMSProp(0.01, momentum=0.5, centered=True),
     [("optax.rmsprop(0.01, eps=1e-10, initial_scale=1, centered=True, momentum=0.5)",
       lambda: optax.rmsprop(0.01, eps=1e-10, initial_scale=1.0, centered=True, momentum=0.5))]),
    ("Adadelta(1.0, epsilon=1e-6)", lambda: Adadelta(1.0, epsilon=1e-6),
     [("keras.Adadelta(1.0, epsilon=1e-6)", lambda: keras.Adadelta(1.0, epsilon=1e-6)),
      ("optax.adadelta(1.0, rho=0.95, eps=1e-6)", lambda: optax.adadelta(1.0, rho=0.95, eps=1e-6))]),
    ("AdagradDA(0.1, l2=0.01)", lambda: AdagradDA(0.1, l2_regularization_strength=0.01), []),
    ("Ftrl(0.1)", lambda: Ftrl(0.1), [("keras.Ftrl(0.1)", lambda: keras.Ftrl(0.1))]),
    ("Ftrl(0.1, -0.6, l1=0.001, shrinkage=0.01)",
     lambda: Ftrl(0.1, -0.6, l1_regularization_strength=0.001, l2_shrinkage_regularization_strength=0.01),
     [("keras.Ftrl(same)", lambda: keras.Ftrl(0.1, learning_rate_power=-0.6, l1_regularization_strength=0.001,
                                             l2_shrinkage_regularization_strength=0.01))]),
    ("ProximalAdagrad(0.1, l1=0.001, l2=0.01)",
     lambda: ProximalAdagrad(0.1, l1_regularization_strength=0.001, l2_regularization_strength=0.01), []),
    ("ProximalGradientDescent(0.1, l1=0.001, l2=0.01)",
     lambda: ProximalGradientDescent(0.1, l1_regularization_strength=0.001, l2_regularization_strength=0.01), []),
    ("from_optax(optax.adam(0.01))", lambda: from_optax(optax.adam(0.01)), []),
    ("keras.SGD(0.1, momentum=0.9, nesterov=True)", lambda: keras.SGD(0.1, momentum=0.9, nesterov=True),
     [("optax.sgd(0.1, 0.9, nesterov=True)", lambda: optax.sgd(0.1, 0.9, nesterov=True))]),
    ("keras.Adam(0.01)", lambda: keras.Adam(0.01),
     [("optax.adam(0.01, eps=1e-7)", lambda: optax.adam(0.01, eps=1e-7))]),
    ("keras.Adam(0.01, amsgrad=True)", lambda: keras.Adam(0.01, amsgrad=True),
     [("optax.amsgrad(0.01, eps=1e-7)", lambda: optax.amsgrad(0.01, eps=1e-7))]),
    ("keras.AdamW(0.01)", lambda: keras.AdamW(0.01),
     [("optax.adamw(0.01, eps=1e-7, weight_decay=0.004)",
       lambda: optax.adamw(0.01, eps=1e-7, weight_decay=0.004))]),
    ("keras.Adamax(0.01)", lambda: keras.Adamax(0.01),
     [("optax.adamax(0.01, eps=1e-7)", lambda: optax.adamax(0.01, eps=1e-7))]),
    ("keras.Nadam(0.01)", lambda: keras.Nadam(0.01),
     [("optax.nadam(0.01, eps=1e-7)", lambda: optax.nadam(0.01, eps=1e-7))]),
    ("keras.Lion(0.001)", lambda: keras.Lion(0.001),
     [("optax.lion(0.001, weight_decay=0)", lambda: optax.lion(0.001, weight_decay=0.0))]),
    ("keras.RMSprop(0.01)", lambda: keras.RMSprop(0.01),
     [("optax.rmsprop(0.01, eps=1e-7)", lambda: optax.rmsprop(0.01, eps=1e-7))]),
    ("keras.RMSprop(0.01, momentum=0.5, centered=True)", lambda: keras.RMSprop(0.01, momentum=0.5, centered=True),
     [("optax.rmsprop(0.01, eps=1e-7, centered=True, momentum=0.5)",
       lambda: optax.rmsprop(0.01, eps=1e-7, centered=True, momentum=0.5))]),
    ("keras.Adagrad(0.1)", lambda: keras.Adagrad(0.1),
     [("optax.adagrad(0.1, eps=1e-7)", lambda: optax.adagrad(0.1, eps=1e-7))]),
    ("keras.Adadelta(1.0)", lambda: keras.Adadelta(1.0),
     [("optax.adadelta(1.0, rho=0.95, eps=1e-7)", lambda: optax.adadelta(1.0, rho=0.95, eps=1e-7))]),
    ("keras.Ftrl(0.1)", lambda: keras.Ftrl(0.1), []),
]


def machine() -> str:
    cpu, avx512 = platform.processor() or platform.machine(), False
    try:
        with open("/proc/cpuinfo") as f:
            info = f.read()
        cpu = next(line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name"))
        avx512 = " avx512f" in info
    except (OSError, StopIteration):
        pass
    return (f"{os.cpu_count()}-core {platform.machine()} {cpu}{' (AVX-512)' if avx512 else ''}; "
            f"jax {jax.__version__}, jaxlib {jax.lib.__version__}, optax {optax.__version__}, numpy {np.__version__}")


def _fmt(x: float) -> str:
    if x == 0:
        return "0"
    if x >= 100:
        return f"{x:,.0f}"
    return f"{x:.3g}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, nargs="+", default=[7, 100])
    args = parser.parse_args()
    last = max(args.steps)
    print(f"machine: {machine()}\n")
    print("## jit against op by op: ulps of the worst array's largest element / of the worst element itself "
          "(its value), over params and slots; params' max |diff| after the last step (the array's largest |value|)\n")
    print("| optimizer | one step | " + " | ".join(f"after {n}" for n in args.steps) + " | params' max abs diff |")
    print("|---|---|" + "---|" * (len(args.steps) + 1))
    twins = []
    for label, make, others in ROWS:
        op, one_step = run_ours(make, last, jitted=False)
        jit, _ = run_ours(make, last, jitted=True)
        cells = [_fmt(one_step)]
        for n in args.steps:
            ref, got = op[n - 1], jit[n - 1]
            largest = max(ulps_of_largest(ref[k], got[k]) for k in ref)
            elem, value = max(ulps_of_element(ref[k], got[k]) for k in ref)
            cells.append(f"{_fmt(largest)} / {_fmt(elem)}{f' ({value:.1g})' if elem else ''}")
        diffs = [(float(np.max(np.abs(op[-1][k].astype(np.float64) - jit[-1][k]))), float(np.max(np.abs(op[-1][k]))))
                 for k in model()]
        absdiff, scale = max(diffs)
        print(f"| `{label}` | " + " | ".join(cells) + f" | {absdiff:.2g} ({scale:.2g}) |", flush=True)
        for twin_label, twin in others:
            made = twin()
            theirs = run_optax(made, last) if isinstance(made, optax.GradientTransformation) else [
                {k: s[k] for k in model()} for s in run_ours(twin, last, jitted=False)[0]]
            twins.append((label, twin_label, [relative(op[n - 1], theirs[n - 1]) for n in args.steps]))
    print("\n## twins, op by op (params: max |diff| / the array's largest |value|)\n")
    print("| ours | twin | " + " | ".join(f"after {n}" for n in args.steps) + " |")
    print("|---|---|" + "---|" * len(args.steps))
    for label, twin_label, rels in twins:
        print(f"| `{label}` | `{twin_label}` | " + " | ".join(f"{r:.2g}" if r else "0" for r in rels) + " |")


if __name__ == "__main__":
    main()
