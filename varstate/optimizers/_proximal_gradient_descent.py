"""`ProximalGradientDescent`: TF v1's FOBOS step (shared pieces in `_proximal_math`)."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from varstate.optimizers._core._base import Hyper, Optimizer
from varstate.optimizers._core._rows import as_dtype
from varstate.optimizers._proximal_math import _float_options, _fobos, _RowWise


@dataclasses.dataclass(frozen=True)
class ProximalGradientDescent(_RowWise, Optimizer):
    """`tf.compat.v1.train.ProximalGradientDescentOptimizer` (FOBOS); no slots.

    ``prox = var - grad * lr``; with ``l1 > 0``
    ``var = sign(prox) * max(|prox| - lr * l1, 0) / (1 + l2 * lr)``, else
    ``var = prox / (1 + l2 * lr)``. Like TF it checks neither strength: a
    negative ``l1`` fails ``l1 > 0`` and is ignored. Sparse gradients update
    only their rows (duplicate indices summed first).

    Args:
        learning_rate: the step size; a float or a callable ``f(step)``
            (then pass ``step=`` to each update).
        l1_regularization_strength: the L1 strength (a float; only a positive
            one shrinks).
        l2_regularization_strength: the L2 strength (a float).

    Raises:
        TypeError: a strength that is not a float.

    >>> import jax.numpy as jnp, varstate
    >>> from varstate.optimizers import ProximalGradientDescent
    >>> w = varstate.Variable(jnp.array([1.0, -0.05]), name="w")
    >>> opt = ProximalGradientDescent(0.5, l1_regularization_strength=0.2)
    >>> (w,), _ = opt.apply_gradients([jnp.array([1.0, 0.0])], [w], opt.init([w]))
    >>> w.value.tolist()  # 1 - 0.5 = 0.5, shrunk by 0.1; -0.05 shrunk to zero
    [0.4000000059604645, -0.0]
    """

    learning_rate: Hyper
    l1_regularization_strength: float = 0.0
    l2_regularization_strength: float = 0.0

    _hyper_names: ClassVar[tuple[str, ...]] = ("learning_rate",)
    _step_floats: ClassVar[tuple[str, ...]] = ("l1_regularization_strength", "l2_regularization_strength")

    def __post_init__(self) -> None:
        super().__post_init__()
        _float_options(self, "l1_regularization_strength", "l2_regularization_strength")

    def _dense(self, h, grad, var, slots, non_slots, wide=False):
        # `wide`: rows of one element, for which TF's sparse kernel runs its scalar loop.
        dtype = var.dtype
        lr = as_dtype(h["learning_rate"], dtype)
        l1, l2 = as_dtype(self.l1_regularization_strength, dtype), as_dtype(self.l2_regularization_strength, dtype)
        return _fobos(var - grad * lr, lr * l1, l2 * lr, self.l1_regularization_strength, wide), slots

