"""Keras 3's `Ftrl`, in Keras's order of operations."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax.numpy as jnp

from varstate.optimizers._core._rows import divide
from varstate.optimizers.keras._base import KerasOptimizer, const


@dataclasses.dataclass(frozen=True)
class Ftrl(KerasOptimizer):
    """``keras.optimizers.Ftrl``: slots ``accumulator`` (starting at ``initial_accumulator_value``), ``linear``.

    With ``p = -learning_rate_power``, ``l2 = l2_regularization_strength + beta / (2 lr)``:
    ``g' = g + 2 * l2_shrinkage_regularization_strength * var``;
    ``n = acc + g**2``; ``linear += g' - (n**p - acc**p) / lr * var``;
    ``var = (clip(linear, -l1, l1) - linear) / (n**p / lr + 2 l2)``; ``acc = n``.
    A sparse gradient's rows are summed (``g**2``: the sum of the rows' squares).

    Keras raises ``acc`` to ``p`` with TF's vectorized ``pow`` (Eigen's
    polynomial, within an ulp of the exact power but not always rounded to
    nearest), which XLA computes differently: Ftrl agrees with Keras to a few
    ulp, not bit for bit.

    Args:
        learning_rate: a float, or a schedule ``f(iteration)`` called with the
            ``iteration`` counter (unless ``step=`` is given; Keras then keeps no
            ``learning_rate`` variable).
        weight_decay: Keras's decoupled weight decay, ``var -= var *
            weight_decay * learning_rate`` before each update; None turns it off.
        learning_rate_power: the power ``-p`` (zero or negative; -0.5 takes square roots).
        initial_accumulator_value: the accumulator's starting value (zero or positive).
        l1_regularization_strength: the L1 strength (zero or positive).
        l2_regularization_strength: the L2 strength (zero or positive).
        l2_shrinkage_regularization_strength: the shrinkage added to the gradient (zero or positive).
        beta: added to L2 as ``beta / (2 lr)``.

    Raises:
        TypeError: an option that is not a float (the learning rate: nor a
            callable), or an unknown keyword (the message names the closest).
        ValueError: a value out of the ranges above (as Keras requires).

    >>> import jax.numpy as jnp
    >>> from varstate.optimizers import keras
    >>> opt = keras.Ftrl(1.0, initial_accumulator_value=0.0)
    >>> p = [jnp.zeros(1)]
    >>> p, state = opt.update([jnp.full(1, 2.0)], p, opt.init(p))
    >>> p[0].item(), state.slots["linear"][0].item()
    (-1.0, 2.0)
    """

    learning_rate_power: float = -0.5
    initial_accumulator_value: float = 0.1
    l1_regularization_strength: float = 0.0
    l2_regularization_strength: float = 0.0
    l2_shrinkage_regularization_strength: float = 0.0
    beta: float = 0.0

    _floats: ClassVar[tuple[str, ...]] = (
        "learning_rate_power", "initial_accumulator_value", "l1_regularization_strength",
        "l2_regularization_strength", "l2_shrinkage_regularization_strength", "beta",
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        for name, bad, want in (
            ("initial_accumulator_value", self.initial_accumulator_value < 0, "positive or zero"),
            ("learning_rate_power", self.learning_rate_power > 0, "negative or zero"),
            ("l1_regularization_strength", self.l1_regularization_strength < 0, "positive or zero"),
            ("l2_regularization_strength", self.l2_regularization_strength < 0, "positive or zero"),
            ("l2_shrinkage_regularization_strength", self.l2_shrinkage_regularization_strength < 0,
             "positive or zero"),
        ):
            if bad:
                raise ValueError(f"Ftrl: {name} must be {want} (as Keras requires), got {getattr(self, name)}.")

    def _slot_groups(self):
        return (("accumulator", "linear"),)

    def _slot_inits(self):
        return {"accumulator": self.initial_accumulator_value, "linear": 0.0}

    def _step(self, lr, var, slots, non_slots, summed):
        dtype = var.dtype
        grad, grad_sq = summed(lambda g: g), summed(jnp.square)
        power = const(-self.learning_rate_power, dtype)
        l2 = const(self.l2_regularization_strength, dtype) + const(self.beta, dtype) / (2.0 * lr)
        grad = grad + const(2 * self.l2_shrinkage_regularization_strength, dtype) * var
        acc = slots["accumulator"]
        new_acc = acc + grad_sq
        new_pow = jnp.power(new_acc, power)
        linear = slots["linear"] + (grad - divide(new_pow - jnp.power(acc, power), lr) * var)
        quadratic = divide(new_pow, lr) + 2 * l2
        l1 = const(self.l1_regularization_strength, dtype)
        var = (jnp.clip(linear, -l1, l1) - linear) / quadratic
        return var, {"accumulator": new_acc, "linear": linear}
