"""`Adadelta`: TF v1's Adadelta with its two running averages as slots."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax.numpy as jnp

from varstate.optimizers._core._base import Hyper, Optimizer
from varstate.optimizers._core._rows import as_dtype, update_rows


@dataclasses.dataclass(frozen=True)
class Adadelta(Optimizer):
    """`tf.compat.v1.train.AdadeltaOptimizer`; slots ``accum`` and ``accum_update``, both starting at 0.

    ``accum = accum * rho + grad**2 * (1 - rho)``;
    ``update = sqrt(accum_update + epsilon) / sqrt(accum + epsilon) * grad``;
    ``var -= update * lr``;
    ``accum_update = accum_update * rho + update**2 * (1 - rho)``.
    Sparse gradients update only their rows (duplicate indices summed first).

    Args:
        learning_rate: the step size (TF's default 0.001); a float or a
            callable ``f(step)`` (then pass ``step=`` to each update).
        rho: the decay rate of both accumulators; a float or a callable.
        epsilon: added inside both square roots; a float or a callable.

    Raises:
        TypeError: a hyperparameter that is neither a float nor a callable of the
            step, or an unknown keyword (the message names the closest).

    >>> import jax.numpy as jnp, varstate
    >>> from varstate.optimizers import Adadelta
    >>> w = varstate.Variable(jnp.zeros(2), name="w")
    >>> opt = Adadelta(learning_rate=1.0, rho=0.25, epsilon=1.0)
    >>> (w,), state = opt.apply_gradients([jnp.array([2.0, 2.0])], [w], opt.init([w]))
    >>> w.value.tolist(), state.get_slot(w, "accum").value.tolist(), state.get_slot(w, "accum_update").value.tolist()
    ([-1.0, -1.0], [3.0, 3.0], [0.75, 0.75])
    """

    learning_rate: Hyper = 0.001
    rho: Hyper = 0.95
    epsilon: Hyper = 1e-8

    _hyper_names: ClassVar[tuple[str, ...]] = ("learning_rate", "rho", "epsilon")

    def _slot_inits(self):
        return {"accum": 0.0, "accum_update": 0.0}

    def _dense(self, h, grad, var, slots, non_slots):
        lr, rho, eps = (as_dtype(h[k], var.dtype) for k in ("learning_rate", "rho", "epsilon"))
        accum = slots["accum"] * rho + grad * grad * (1 - rho)
        # TF says rsqrt(accum + epsilon); its correctly rounded form is 1 / sqrt (see Adagrad).
        update = jnp.sqrt(slots["accum_update"] + eps) * (1 / jnp.sqrt(accum + eps)) * grad
        accum_update = slots["accum_update"] * rho + update * update * (1 - rho)
        return var - update * lr, {"accum": accum, "accum_update": accum_update}

    def _sparse(self, h, values, indices, var, slots, non_slots):
        return update_rows(lambda g, v, s: self._dense(h, g, v, s, non_slots), values, indices, var, slots)
