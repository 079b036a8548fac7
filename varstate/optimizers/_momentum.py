"""`Momentum`: TF v1's momentum SGD (Nesterov optional)."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from varstate.optimizers._core._base import Hyper, Optimizer
from varstate.optimizers._core._rows import as_dtype, gather_rows, set_rows


@dataclasses.dataclass(frozen=True)
class Momentum(Optimizer):
    """`tf.compat.v1.train.MomentumOptimizer`; slot ``momentum`` (the accumulator).

    ``accum = accum * momentum + grad``; ``var -= accum * lr`` (Nesterov:
    ``var -= grad * lr + accum * momentum * lr``). Sparse gradients touch only
    their rows.

    Args:
        learning_rate: the step size; a float or a callable ``f(step)``
            (then pass ``step=`` to each update).
        momentum: the accumulator's decay; a float or a callable.
        use_nesterov: take Nesterov's step (the formula above).

    Raises:
        TypeError: a hyperparameter that is neither a float nor a callable of the
            step, or an unknown keyword (the message names the closest).

    >>> import jax.numpy as jnp, varstate
    >>> from varstate.optimizers import Momentum
    >>> w = varstate.Variable(jnp.zeros(2), name="w")
    >>> opt = Momentum(learning_rate=0.5, momentum=0.9)
    >>> params, state = [w], opt.init([w])
    >>> for _ in range(2):
    ...     params, state = opt.apply_gradients([jnp.ones(2)], params, state)
    >>> state.get_slot(w, "momentum").value.tolist(), params[0].value.tolist()
    ([1.899999976158142, 1.899999976158142], [-1.4500000476837158, -1.4500000476837158])
    """

    learning_rate: Hyper
    momentum: Hyper
    use_nesterov: bool = False

    _hyper_names: ClassVar[tuple[str, ...]] = ("learning_rate", "momentum")

    def _slot_inits(self):
        return {"momentum": 0.0}

    def _dense(self, h, grad, var, slots, non_slots):
        lr, mom = as_dtype(h["learning_rate"], var.dtype), as_dtype(h["momentum"], var.dtype)
        accum = slots["momentum"] * mom + grad
        var = var - (grad * lr + accum * mom * lr) if self.use_nesterov else var - accum * lr
        return var, {"momentum": accum}

    def _sparse(self, h, values, indices, var, slots, non_slots):
        lr, mom = as_dtype(h["learning_rate"], var.dtype), as_dtype(h["momentum"], var.dtype)
        accum = gather_rows(slots["momentum"], indices) * mom + values
        step = lr * values + lr * mom * accum if self.use_nesterov else accum * lr
        rows = gather_rows(var, indices) - step
        return set_rows(var, indices, rows), {"momentum": set_rows(slots["momentum"], indices, accum)}
