"""`Adagrad`: TF v1's adaptive optimizer with a squared-gradient accumulator slot."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax.numpy as jnp

from varstate.optimizers._core._base import Hyper, Optimizer
from varstate.optimizers._core._rows import as_dtype
from varstate.optimizers._proximal_math import _RowWise


@dataclasses.dataclass(frozen=True)
class Adagrad(_RowWise, Optimizer):
    """`tf.compat.v1.train.AdagradOptimizer`; slot ``accumulator`` starting at ``initial_accumulator_value``.

    ``accum += grad**2``; ``var -= grad * lr * (1 / sqrt(accum))``.

    Args:
        learning_rate: the step size; a float or a callable ``f(step)``
            (then pass ``step=`` to each update).
        initial_accumulator_value: the accumulator's starting value (positive).

    Raises:
        ValueError: `initial_accumulator_value` is not positive (as TF).
        TypeError: a hyperparameter that is neither a float nor a callable of the
            step, or an unknown keyword (the message names the closest).

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

    def _dense(self, h, grad, var, slots, non_slots, wide=False):
        lr = as_dtype(h["learning_rate"], var.dtype)
        accum = slots["accumulator"] + grad * grad
        if wide:  # TF's sparse kernel divides by sqrt when a row has one element
            return var - lr * grad / jnp.sqrt(accum), {"accumulator": accum}
        # TF's kernel says rsqrt, which TF evaluates as the correctly rounded 1 / sqrt. Op by op, so do we;
        # under jit XLA rewrites 1 / sqrt as rsqrt, within 1 ulp (the jit contract in the README).
        return var - grad * lr * (1 / jnp.sqrt(accum)), {"accumulator": accum}
