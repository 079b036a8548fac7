"""`Ftrl`: TF v1's FTRL-proximal, with online L2, shrinkage L2 and any learning-rate power."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax.numpy as jnp
import numpy as np

from varstate.optimizers._core._base import Hyper, Optimizer
from varstate.optimizers._core._rows import as_dtype, divide, gather_rows, set_rows
from varstate.optimizers._core._traced import varies
from varstate.optimizers._proximal_math import _check, _float_options, _one_element_rows


@dataclasses.dataclass(frozen=True)
class Ftrl(Optimizer):
    """`tf.compat.v1.train.FtrlOptimizer`; slots ``accum`` (starts at ``initial_accumulator_value``) and ``linear``.

    With ``p = -learning_rate_power`` and ``g`` the gradient plus
    ``2 * l2_shrinkage_regularization_strength * var`` (shrinkage, if set):
    ``new_accum = accum + grad**2``;
    ``linear += g - (new_accum**p - accum**p) / lr * var``;
    ``var = (l1 * sign(linear) - linear) / (new_accum**p / lr + 2 * l2)`` where
    ``|linear| > l1``, else 0; ``accum = new_accum``. ``l2`` is
    ``l2_regularization_strength + beta / (2 * lr)``, as TF adjusts it. The
    default power ``-0.5`` takes square roots (TF's fast path); any other
    power is ``pow``. Sparse gradients update only their rows (duplicate
    indices summed first).

    TF refuses a negative accumulator value or strength and a positive
    power in its constructor (ValueError), and its sparse kernel a
    ``learning_rate <= 0``; here all of them raise ValueError at construction
    (a callable learning rate is not checked). TF's ``accum_name`` and
    ``linear_name`` only name graph-mode variables and are not taken.

    Args:
        learning_rate: the step size (positive); a float or a callable
            ``f(step)`` (then pass ``step=`` to each update).
        learning_rate_power: the power ``-p`` above (zero or negative; -0.5
            takes square roots).
        initial_accumulator_value: the starting value of ``accum`` (zero or
            positive).
        l1_regularization_strength: the L1 strength (zero or positive).
        l2_regularization_strength: the L2 strength (zero or positive).
        l2_shrinkage_regularization_strength: the strength of the shrinkage
            added to the gradient (zero or positive; 0 turns it off).
        beta: added to L2 as ``beta / (2 * lr)``; None is 0.

    Raises:
        ValueError: a value out of the ranges above (at construction, as TF).
        TypeError: an option other than `learning_rate` that is not a float.

    >>> import jax.numpy as jnp, varstate
    >>> from varstate.optimizers import Ftrl
    >>> w = varstate.Variable(jnp.zeros(3), name="w")
    >>> opt = Ftrl(1.0, initial_accumulator_value=0.0, l1_regularization_strength=1.0)
    >>> (w,), state = opt.apply_gradients([jnp.array([0.5, 2.0, -4.0])], [w], opt.init([w]))
    >>> w.value.tolist(), state.get_slot(w, "linear").value.tolist()
    ([0.0, -0.5, 0.75], [0.5, 2.0, -4.0])
    """

    learning_rate: Hyper
    learning_rate_power: float = -0.5
    initial_accumulator_value: float = 0.1
    l1_regularization_strength: float = 0.0
    l2_regularization_strength: float = 0.0
    _: dataclasses.KW_ONLY  # TF's next positional arguments are use_locking, name, ...: not taken
    l2_shrinkage_regularization_strength: float = 0.0
    beta: float | None = None

    _hyper_names: ClassVar[tuple[str, ...]] = ("learning_rate",)
    _step_floats: ClassVar[tuple[str, ...]] = (
        "learning_rate_power", "l1_regularization_strength", "l2_regularization_strength",
        "l2_shrinkage_regularization_strength", "beta")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.beta is None:
            object.__setattr__(self, "beta", 0.0)
        _float_options(
            self, "learning_rate_power", "initial_accumulator_value", "l1_regularization_strength",
            "l2_regularization_strength", "l2_shrinkage_regularization_strength", "beta",
        )
        if not callable(self.learning_rate):
            _check(self, "learning_rate", self.learning_rate > 0, "positive")
        _check(self, "learning_rate_power", self.learning_rate_power <= 0, "negative or zero")
        for name in ("initial_accumulator_value", "l1_regularization_strength", "l2_regularization_strength",
                     "l2_shrinkage_regularization_strength"):
            _check(self, name, getattr(self, name) >= 0, "positive or zero")

    def _slot_inits(self):
        return {"accum": self.initial_accumulator_value, "linear": 0.0}

    def _scalars(self, h, dtype):
        lr32 = jnp.asarray(h["learning_rate"], jnp.float32)
        # TF adds beta to l2 in float32 before the cast: l2 + beta / (2 * max(lr, 1e-36)).
        l2 = as_dtype(self.l2_regularization_strength, jnp.float32) + as_dtype(self.beta, jnp.float32) / (
            jnp.float32(2) * jnp.maximum(lr32, jnp.float32(1e-36))
        )
        l1 = as_dtype(self.l1_regularization_strength, dtype)
        shrinkage = as_dtype(self.l2_shrinkage_regularization_strength, dtype)
        return lr32.astype(dtype), l1, l2.astype(dtype), shrinkage

    def _pow(self, x):
        """``x ** -learning_rate_power``; a square root for TF's ``-0.5`` (compared in float32, as TF does)."""
        p = self.learning_rate_power
        if varies(p):  # traced: TF's choice, made per value
            p = as_dtype(p, jnp.float32)
            return jnp.where(p == -0.5, jnp.sqrt(x), jnp.power(x, (-p).astype(x.dtype)))
        if np.float32(p) == np.float32(-0.5):
            return jnp.sqrt(x)
        return jnp.power(x, as_dtype(-p, x.dtype))

    def _gradient(self, grad, var, shrinkage):
        """The gradient with the shrinkage term; TF runs its V2 kernel only when the strength is positive."""
        s = self.l2_shrinkage_regularization_strength
        if varies(s):  # traced: TF's choice of kernel, made per value
            return jnp.where(shrinkage > 0, grad + (2 * shrinkage) * var, grad)
        return grad + (2 * shrinkage) * var if s > 0 else grad

    def _dense(self, h, grad, var, slots, non_slots):
        lr, l1, l2, shrinkage = self._scalars(h, var.dtype)
        accum, linear = slots["accum"], slots["linear"]
        new_accum = accum + grad * grad
        g = self._gradient(grad, var, shrinkage)
        linear = linear + (g - divide(self._pow(new_accum) - self._pow(accum), lr) * var)
        x = l1 * jnp.sign(linear) - linear
        y = divide(self._pow(new_accum), lr) + 2 * l2
        var = jnp.where(jnp.abs(linear) > l1, x / y, jnp.zeros((), var.dtype))
        return var, {"accum": new_accum, "linear": linear}

    def _sparse(self, h, values, indices, var, slots, non_slots):
        lr, l1, l2, shrinkage = self._scalars(h, var.dtype)
        accum, linear = gather_rows(slots["accum"], indices), gather_rows(slots["linear"], indices)
        rows = gather_rows(var, indices)
        new_accum = accum + values * values
        g = self._gradient(values, rows, shrinkage)
        sigma = self._pow(new_accum) - self._pow(accum)
        if _one_element_rows(var):  # TF's scalar loop: (linear + g) - sigma / lr * var
            linear = (linear + g) - divide(sigma, lr) * rows
        else:  # TF's row loop, as the dense kernel
            linear = linear + (g - divide(sigma, lr) * rows)
        # Both sparse loops clip linear to [-l1, l1] rather than test |linear| > l1: x is 0 there, as in the
        # dense kernel, except 0 / 0 (accumulator 0, gradient 0) stays NaN, as in TF.
        x = jnp.maximum(jnp.minimum(linear, l1), -l1) - linear
        rows = x / (divide(self._pow(new_accum), lr) + 2 * l2)
        new = {"accum": set_rows(slots["accum"], indices, new_accum),
               "linear": set_rows(slots["linear"], indices, linear)}
        return set_rows(var, indices, rows), new
