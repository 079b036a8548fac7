"""`RMSProp`: TF v1's RMSProp, plain or centered, with momentum."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax.numpy as jnp

from varstate.optimizers._core._base import Hyper, Optimizer
from varstate.optimizers._core._rows import as_dtype, gather_rows, set_rows


@dataclasses.dataclass(frozen=True)
class RMSProp(Optimizer):
    """`tf.compat.v1.train.RMSPropOptimizer`; slots ``rms`` (starts at 1), ``momentum``, and ``mg`` if centered.

    ``rms += (grad**2 - rms) * (1 - decay)``;
    ``mom = mom * momentum + grad * lr / sqrt(rms + epsilon)``; ``var -= mom``.
    Centered: ``mg += (grad - mg) * (1 - decay)`` and the denominator is
    ``sqrt(rms - mg**2 + epsilon)``.

    Args:
        learning_rate: the step size; a float or a callable ``f(step)``
            (then pass ``step=`` to each update).
        decay: the decay of ``rms`` (and ``mg``); a float or a callable.
        momentum: the decay of the ``momentum`` slot; a float or a callable.
        epsilon: added inside the square root; a float or a callable.
        centered: subtract the squared mean gradient (slot ``mg``) in the
            denominator.

    Raises:
        TypeError: a hyperparameter that is neither a float nor a callable of the
            step, or an unknown keyword (the message names the closest).

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
