"""`GradientDescent`: TF v1's plain SGD."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from varstate.optimizers._core._base import Hyper, Optimizer
from varstate.optimizers._core._rows import add_rows, as_dtype


@dataclasses.dataclass(frozen=True)
class GradientDescent(Optimizer):
    """`tf.compat.v1.train.GradientDescentOptimizer`: ``var -= grad * lr``; no slots.

    Sparse gradients are scattered with their duplicates (TF does not sum them first).

    Args:
        learning_rate: the step size; a float or a callable ``f(step)``
            (then pass ``step=`` to each update).

    Raises:
        TypeError: a hyperparameter that is neither a float nor a callable of the
            step, or an unknown keyword (the message names the closest).

    >>> import jax.numpy as jnp, varstate
    >>> from varstate.optimizers import GradientDescent
    >>> emb = varstate.Variable(jnp.zeros((3, 2)), name="emb")
    >>> opt = GradientDescent(1.0)
    >>> g = varstate.IndexedSlices(jnp.ones((2, 2)), jnp.array([2, 2]), (3, 2))
    >>> (emb,), _ = opt.apply_gradients([g], [emb], opt.init([emb]))
    >>> emb.value[:, 0].tolist()
    [0.0, 0.0, -2.0]
    """

    learning_rate: Hyper

    _dedup: ClassVar[bool] = False
    _hyper_names: ClassVar[tuple[str, ...]] = ("learning_rate",)

    def _dense(self, h, grad, var, slots, non_slots):
        return var - grad * as_dtype(h["learning_rate"], var.dtype), slots

    def _sparse(self, h, values, indices, var, slots, non_slots):
        return add_rows(var, indices, -values * as_dtype(h["learning_rate"], var.dtype)), slots
