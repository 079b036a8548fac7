"""`Adadelta`: TF v1's Adadelta with its two running averages as slots."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax.numpy as jnp

from varstate.optimizers._core._base import Hyper, Optimizer
from varstate.optimizers._core._rows import as_dtype, gather_rows, set_rows


@dataclasses.dataclass(frozen=True)
class Adadelta(Optimizer):
    """`tf.compat.v1.train.AdadeltaOptimizer`; slots ``accum`` and ``accum_update``, both starting at 0.

    ``accum = accum * rho + grad**2 * (1 - rho)``;
    ``update = sqrt(accum_update + epsilon) / sqrt(accum + epsilon) * grad``;
    ``var -= update * lr``;
    ``accum_update = accum_update * rho + update**2 * (1 - rho)``.
    Sparse gradients update only their rows (duplicate indices summed first).

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

    def _step(self, h, grad, var, accum, accum_update):
        lr, rho, eps = (as_dtype(h[k], var.dtype) for k in ("learning_rate", "rho", "epsilon"))
        accum = accum * rho + grad * grad * (1 - rho)
        # TF says rsqrt(accum + epsilon); its correctly rounded form is 1 / sqrt (see Adagrad).
        update = jnp.sqrt(accum_update + eps) * (1 / jnp.sqrt(accum + eps)) * grad
        var = var - update * lr
        return var, accum, accum_update * rho + update * update * (1 - rho)

    def _dense(self, h, grad, var, slots, non_slots):
        var, accum, accum_update = self._step(h, grad, var, slots["accum"], slots["accum_update"])
        return var, {"accum": accum, "accum_update": accum_update}

    def _sparse(self, h, values, indices, var, slots, non_slots):
        old = (gather_rows(slots[k], indices) for k in ("accum", "accum_update"))
        rows, accum, accum_update = self._step(h, values, gather_rows(var, indices), *old)
        return set_rows(var, indices, rows), {
            "accum": set_rows(slots["accum"], indices, accum),
            "accum_update": set_rows(slots["accum_update"], indices, accum_update),
        }
