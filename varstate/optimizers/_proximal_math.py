"""What the TF v1 proximal family (ProximalGradientDescent, ProximalAdagrad, AdagradDA, Ftrl) shares, one copy.

The float-option check, the FOBOS shrinkage, a division XLA may not rewrite,
float32 arithmetic that stands in for the double precision some of TF's
sparse kernels compute in, and the sparse step as the dense one on the
touched rows (`_RowWise`, Adagrad's too).

TF's sparse kernels take a scalar path when a row has one element; there
some divisions (and all of AdagradDA's arithmetic) run in double before the
result is stored as float. JAX has no float64 unless ``jax_enable_x64`` is
on, so for float32 variables those steps are done in pairs of float32 (an
unevaluated sum hi + lo, exact or nearly) and rounded once at the end. That is
TF's float on every one of 10^6 random inputs, under jit and op by op
(tests/varstate/optimizers/test_v1_family.py checks a sample); it could differ only where
the exact result lies within about 2^-20 ulp of a float32 rounding boundary.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from varstate._jax_compat import Tracer
from varstate.optimizers._core._rows import Array, as_dtype, divide, update_rows
from varstate.optimizers._core._traced import varies


def _float_options(opt: Any, *names: str) -> None:
    """Each option `names` of `opt` as a Python float (hashable: the config is a static jit argument).

    These options pick code paths (``l1 > 0``, FTRL's ``-0.5`` power) or seed slots, so, unlike the
    hyperparameters, they cannot be callables of the step.
    """
    cls = type(opt).__name__
    for name in names:
        x = getattr(opt, name)
        if varies(x):
            continue
        try:
            if callable(x) or isinstance(x, str | bytes):
                raise TypeError
            x = float(np.asarray(x))
        except (TypeError, ValueError):
            raise TypeError(f"{cls}: {name} must be a float, got {type(x).__name__} {x!r:.40}.") from None
        object.__setattr__(opt, name, x)


def _check(opt: Any, name: str, ok: bool, rule: str) -> None:
    """ValueError naming the option, the rule it breaks and its value (TF raises ValueError or, in a kernel,
    InvalidArgumentError, whose Python counterpart is ValueError)."""
    if isinstance(ok, Tracer):  # a value optax.inject_hyperparams injects: known only inside its jitted step
        return
    if not ok:
        raise ValueError(f"{type(opt).__name__}: {name} must be {rule}, got {getattr(opt, name)!r}.")


def _one_element_rows(var: Array) -> bool:
    """Whether TF's sparse kernel takes its scalar path: each row of `var` holds one element."""
    return math.prod(var.shape[1:]) == 1


class _RowWise:
    """A mixin before `Optimizer`: the sparse step is the dense one, ``_dense(..., wide)``, on the touched rows alone.

    ``wide``: the rows hold one element each, where TF's sparse kernel runs its scalar loop (`_one_element_rows`).
    """

    def _sparse(self, h, values, indices, var, slots, non_slots):
        wide = _one_element_rows(var)
        return update_rows(lambda g, v, s: self._dense(h, g, v, s, non_slots, wide), values, indices, var, slots)


# --- float32 pairs standing in for double -----------------------------------------------------------
def _two_sum(a: Array, b: Array) -> tuple[Array, Array]:
    """(s, e) with s = fl(a + b) and s + e == a + b exactly (Knuth's TwoSum).

    The barrier hides the sum from XLA's simplifier, which rewrites ``(x + 1) - 1`` as ``x`` (exact in
    real numbers, not in floats): with ``a`` a constant the error term came out wrong in 4 cases of 5.
    """
    s = lax.optimization_barrier(a + b)
    b_part = s - a
    return s, (a - (s - b_part)) + (b - b_part)


def _split(a: Array) -> tuple[Array, Array]:
    """a == hi + lo with both halves 12 significant bits: hi keeps the top half of the significand."""
    hi = lax.bitcast_convert_type(lax.bitcast_convert_type(a, jnp.uint32) & jnp.uint32(0xFFFFF000), jnp.float32)
    return hi, a - hi


def _two_prod(a: Array, b: Array) -> tuple[Array, Array]:
    """(p, e) with p = fl(a * b) and p + e == a * b exactly (Dekker's product; every partial product is exact).

    The barrier keeps XLA from fusing ``a * b`` into the subtraction below as one FMA, which would
    subtract from the unrounded product and lose the point of the exercise.
    """
    p = lax.optimization_barrier(a * b)
    ah, al = _split(a)
    bh, bl = _split(b)
    return p, al * bl - (((p - ah * bh) - al * bh) - ah * bl)


def _pair_div(nh: Array, nl: Array, dh: Array, dl: Array) -> Array:
    """(nh + nl) / (dh + dl) rounded once to float32: one float quotient, then its remainder's correction.

    A zero quotient is returned as it is, keeping its sign (TF stores -0.0 where its double is -0.0).
    """
    q = nh / dh
    p, pe = _two_prod(q, dh)
    r = (((nh - p) - pe) + nl) - q * dl  # nh - p is exact: p is within an ulp of nh
    d = r / dh
    return jnp.where(d == 0, q, q + d)


def _div_one_plus(x: Array, c: Array) -> Array:
    """x / (1 + c) as TF's scalar sparse path computes it: ``1.0 + c`` and the quotient in double.

    Only float32 needs the pair arithmetic; other dtypes divide in their own precision (float64 is
    TF's double; TF has no 16-bit kernels for these optimizers).
    """
    if x.dtype != jnp.float32:
        return divide(x, 1 + c)
    c = jnp.broadcast_to(c, x.shape)
    bh, bl = _two_sum(jnp.ones_like(c), c)  # 1 + c exactly, as double holds it
    return _pair_div(x, jnp.zeros_like(x), bh, bl)


def _per_l1(l1: Any, with_l1: Callable[[], Any], without: Callable[[], Any]) -> Any:
    """TF's two forms of a step, chosen by its ``l1 > 0`` on the float32 value; per value (``jnp.where`` over
    both) where `l1` is traced, since a traced value may change."""
    if varies(l1):
        shrink = as_dtype(l1, jnp.float32) > 0
        return jax.tree.map(lambda a, b: jnp.where(shrink, a, b), with_l1(), without())
    return with_l1() if np.float32(l1) > 0 else without()


def _fobos(prox: Array, threshold: Array, c: Array, l1: Any, wide: bool) -> Array:
    """TF's proximal step on ``prox = var - lr * grad``: ``sign(prox) * max(|prox| - threshold, 0) / (1 + c)``.

    Without L1 (TF's ``l1 > 0`` test, `_per_l1`) it is ``prox / (1 + c)``. ``wide``: the
    division is in double, as in TF's kernels for rows of one element.
    """
    x = _per_l1(l1, lambda: jnp.sign(prox) * jnp.maximum(jnp.abs(prox) - threshold, 0), lambda: prox)
    return _div_one_plus(x, c) if wide else divide(x, 1 + c)
