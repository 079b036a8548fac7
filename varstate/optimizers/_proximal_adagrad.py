"""`ProximalAdagrad`: TF v1's FOBOS step with Adagrad's per-coordinate learning rate."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax.numpy as jnp

from varstate.optimizers._core._base import Hyper, Optimizer
from varstate.optimizers._core._rows import as_dtype
from varstate.optimizers._proximal_math import _check, _float_options, _fobos, _RowWise


@dataclasses.dataclass(frozen=True)
class ProximalAdagrad(_RowWise, Optimizer):
    """`tf.compat.v1.train.ProximalAdagradOptimizer`; slot ``accumulator`` starting at ``initial_accumulator_value``.

    ``accum += grad**2``; ``lr_t = lr / sqrt(accum)``; ``prox = var - grad * lr_t``;
    with ``l1 > 0`` ``var = sign(prox) * max(|prox| - lr_t * l1, 0) / (1 + l2 * lr_t)``,
    else ``var = prox / (1 + l2 * lr_t)``. Sparse gradients update only their
    rows (duplicate indices summed first).

    TF's kernels refuse ``learning_rate <= 0`` and negative strengths when they
    run (InvalidArgumentError); here a float value is refused at construction
    (ValueError). A callable learning rate is not checked.

    Args:
        learning_rate: the step size (positive when a float); a float or a
            callable ``f(step)`` (then pass ``step=`` to each update).
        initial_accumulator_value: the accumulator's starting value (positive).
        l1_regularization_strength: the L1 strength (non-negative; 0 turns off
            the shrinkage).
        l2_regularization_strength: the L2 strength (non-negative).

    Raises:
        ValueError: a value out of the ranges above.
        TypeError: an accumulator value or strength that is not a float.

    >>> import jax.numpy as jnp, varstate
    >>> from varstate.optimizers import ProximalAdagrad
    >>> w = varstate.Variable(jnp.array([1.0, 0.12]), name="w")
    >>> opt = ProximalAdagrad(0.3, initial_accumulator_value=8.0, l1_regularization_strength=0.5)
    >>> (w,), state = opt.apply_gradients([jnp.array([1.0, 1.0])], [w], opt.init([w]))
    >>> [round(x, 4) for x in w.value.tolist()], state.get_slot(w, "accumulator").value.tolist()
    ([0.85, 0.0], [9.0, 9.0])
    """

    learning_rate: Hyper
    initial_accumulator_value: float = 0.1
    l1_regularization_strength: float = 0.0
    l2_regularization_strength: float = 0.0

    _hyper_names: ClassVar[tuple[str, ...]] = ("learning_rate",)
    _step_floats: ClassVar[tuple[str, ...]] = ("l1_regularization_strength", "l2_regularization_strength")

    def __post_init__(self) -> None:
        super().__post_init__()
        _float_options(self, "initial_accumulator_value", "l1_regularization_strength", "l2_regularization_strength")
        _check(self, "initial_accumulator_value", self.initial_accumulator_value > 0, "positive")
        if not callable(self.learning_rate):
            _check(self, "learning_rate", self.learning_rate > 0, "positive")
        _check(self, "l1_regularization_strength", self.l1_regularization_strength >= 0, "non-negative")
        _check(self, "l2_regularization_strength", self.l2_regularization_strength >= 0, "non-negative")

    def _slot_inits(self):
        return {"accumulator": self.initial_accumulator_value}

    def _dense(self, h, grad, var, slots, non_slots, wide=False):
        # `wide`: rows of one element, for which TF's sparse kernel runs its scalar loop.
        dtype = var.dtype
        lr = as_dtype(h["learning_rate"], dtype)
        l1, l2 = as_dtype(self.l1_regularization_strength, dtype), as_dtype(self.l2_regularization_strength, dtype)
        accum = slots["accumulator"] + grad * grad
        if wide:  # TF's scalar loop divides by sqrt
            lr_t = lr / jnp.sqrt(accum)
        else:  # TF says lr * rsqrt(accum); its correctly rounded form is 1 / sqrt (see Adagrad)
            lr_t = lr * (1 / jnp.sqrt(accum))
        new = _fobos(var - grad * lr_t, lr_t * l1, l2 * lr_t, self.l1_regularization_strength, wide)
        return new, {"accumulator": accum}
