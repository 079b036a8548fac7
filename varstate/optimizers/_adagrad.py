"""`Adagrad` and `RMSProp`: TF v1's adaptive optimizers with accumulator slots."""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar

import jax.numpy as jnp

from varstate.optimizers._base import Hyper, Optimizer, as_dtype, gather_rows, set_rows


@dataclasses.dataclass(frozen=True)
class Adagrad(Optimizer):
    """`tf.compat.v1.train.AdagradOptimizer`; slot ``accumulator`` starting at ``initial_accumulator_value``.

    ``accum += grad**2``; ``var -= grad * lr * (1 / sqrt(accum))``.

    >>> import jax.numpy as jnp, varstate
    >>> from varstate.optimizers import Adagrad
    >>> w = varstate.Variable(jnp.ones(2), name="w")
    >>> opt = Adagrad(0.1, initial_accumulator_value=3.0)
    >>> (w,), state = opt.apply_gradients([jnp.ones(2)], [w], opt.init([w]))
    >>> w.value.tolist(), state.get_slot(w, "accumulator").value.tolist()
    ([0.949999988079071, 0.949999988079071], [4.0, 4.0])
    """

    learning_rate: Hyper
    initial_accumulator_value: float = 0.1

    _hyper_names: ClassVar[tuple[str, ...]] = ("learning_rate",)

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.initial_accumulator_value > 0:
            raise ValueError(
                f"Adagrad: initial_accumulator_value must be positive: {self.initial_accumulator_value}."
            )

    def _slot_inits(self):
        return {"accumulator": self.initial_accumulator_value}

    def _dense(self, h, grad, var, slots, non_slots):
        lr = as_dtype(h["learning_rate"], var.dtype)
        accum = slots["accumulator"] + grad * grad
        # TF's kernel says rsqrt; its vectorized form is a hardware estimate, its scalar form 1/sqrt:
        # the correctly rounded 1/sqrt is what TF computes wherever the result does not depend on the CPU.
        return var - grad * lr * (1 / jnp.sqrt(accum)), {"accumulator": accum}

    def _sparse(self, h, values, indices, var, slots, non_slots):
        lr = as_dtype(h["learning_rate"], var.dtype)
        accum = gather_rows(slots["accumulator"], indices) + values * values
        if math.prod(var.shape[1:]) > 1:
            rows = gather_rows(var, indices) - lr * values * (1 / jnp.sqrt(accum))
        else:  # TF's kernel divides by sqrt when a row has one element
            rows = gather_rows(var, indices) - lr * values / jnp.sqrt(accum)
        return set_rows(var, indices, rows), {"accumulator": set_rows(slots["accumulator"], indices, accum)}


@dataclasses.dataclass(frozen=True)
class RMSProp(Optimizer):
    """`tf.compat.v1.train.RMSPropOptimizer`; slots ``rms`` (starts at 1), ``momentum``, and ``mg`` if centered.

    ``rms += (grad**2 - rms) * (1 - decay)``;
    ``mom = mom * momentum + grad * lr / sqrt(rms + epsilon)``; ``var -= mom``.
    Centered: ``mg += (grad - mg) * (1 - decay)`` and the denominator is
    ``sqrt(rms - mg**2 + epsilon)``.

    >>> import jax.numpy as jnp, varstate
    >>> from varstate.optimizers import RMSProp
    >>> w = varstate.Variable(jnp.zeros(2), name="w")
    >>> opt = RMSProp(0.01, centered=True)
    >>> sorted(opt.init([w]).slots)
    ['mg', 'momentum', 'rms']
    """

    learning_rate: Hyper
    decay: Hyper = 0.9
    momentum: Hyper = 0.0
    epsilon: Hyper = 1e-10
    centered: bool = False

    _hyper_names: ClassVar[tuple[str, ...]] = ("learning_rate", "decay", "momentum", "epsilon")

    def _slot_inits(self):
        slots = {"rms": 1.0}
        if self.centered:
            slots["mg"] = 0.0
        slots["momentum"] = 0.0
        return slots

    def _scalars(self, h, dtype):
        return tuple(as_dtype(h[k], dtype) for k in ("learning_rate", "decay", "momentum", "epsilon"))

    def _dense(self, h, grad, var, slots, non_slots):
        lr, rho, momentum, eps = self._scalars(h, var.dtype)
        ms = slots["rms"] + (grad * grad - slots["rms"]) * (1 - rho)
        new = {"rms": ms}
        if self.centered:
            mg = slots["mg"] + (grad - slots["mg"]) * (1 - rho)
            denom = (ms - mg * mg) + eps
            new["mg"] = mg
        else:
            denom = ms + eps
        mom = slots["momentum"] * momentum + (grad * lr) / jnp.sqrt(denom)
        new["momentum"] = mom
        return var - mom, new

    def _sparse(self, h, values, indices, var, slots, non_slots):
        lr, rho, momentum, eps = self._scalars(h, var.dtype)
        ms = gather_rows(slots["rms"], indices) * rho + (values * values) * (1 - rho)
        new = {"rms": set_rows(slots["rms"], indices, ms)}
        if self.centered:
            mg = gather_rows(slots["mg"], indices) * rho + values * (1 - rho)
            denom = ms + eps - mg * mg
            new["mg"] = set_rows(slots["mg"], indices, mg)
        else:
            denom = ms + eps
        mom = gather_rows(slots["momentum"], indices) * momentum + (1 / jnp.sqrt(denom)) * lr * values
        new["momentum"] = set_rows(slots["momentum"], indices, mom)
        return set_rows(var, indices, gather_rows(var, indices) - mom), new
