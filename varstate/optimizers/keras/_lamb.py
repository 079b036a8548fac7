"""Keras 3's `Lamb`: Adam's moments, the step scaled per variable by the ratio of the weight's norm to the step's."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax.numpy as jnp

from varstate.optimizers._core._rows import divide
from varstate.optimizers.keras._adam import _Moments
from varstate.optimizers.keras._base import KerasOptimizer, const


class _PerVariable(KerasOptimizer):
    """A Keras optimizer whose step reduces over each whole variable (a norm, a matrix product): never fused.

    A fused state hands the step many params packed into one flat buffer, so
    a norm would run over all of them; `KerasOptimizer.init` refuses it, and packed params (`varstate.pack`).
    """

    _elementwise: ClassVar[bool] = False


@dataclasses.dataclass(frozen=True)
class Lamb(_Moments, _PerVariable):
    """``keras.optimizers.Lamb``: slots ``momentum``, ``velocity``; a layer-wise trust ratio on Adam's step.

    With ``t = iteration + 1``: ``m += (g - m) * (1 - beta_1)``,
    ``v += (g**2 - v) * (1 - beta_2)``,
    ``u = (m / (1 - beta_1**t)) / (sqrt(v / (1 - beta_2**t)) + epsilon)``,
    ``ratio = |var| / |u|`` (Euclidean norms over the whole variable; 1
    where either norm is 0), ``var -= ratio * lr * u``. A sparse gradient's
    rows are summed into a dense gradient (``g**2``: the sum of the rows'
    squares, as Keras squares the rows first); the norms are then dense.

    Numerics: run op by op, the slots equal Keras's bit for bit and each
    param element is within 1 ulp of the param's largest element: the two
    norms sum in another order than Eigen's ``reduce_sum``, which can move
    the trust ratio by its last bit. Under ``jit``, fused multiply-adds
    move elements by up to 4 ulp of the largest.

    Args:
        learning_rate: a float, or a schedule ``f(iteration)`` called with the
            ``iteration`` counter (unless ``step=`` is given; Keras then keeps no
            ``learning_rate`` variable).
        weight_decay: Keras's decoupled weight decay, ``var -= var *
            weight_decay * learning_rate`` before each update; None turns it off.
        beta_1: the decay of ``momentum``.
        beta_2: the decay of ``velocity``.
        epsilon: added to the bias-corrected ``sqrt(v)`` (Keras's 1e-7).

    Its step reduces over each whole variable: ``init(..., fused=True)`` is
    refused (ValueError).

    Raises:
        TypeError: an option that is not a float (the learning rate: nor a
            callable), or an unknown keyword (the message names the closest).

    >>> import jax.numpy as jnp
    >>> from varstate.optimizers import keras
    >>> opt = keras.Lamb(0.1)
    >>> p = [jnp.array([3.0, 4.0])]
    >>> p, state = opt.update([jnp.array([1.0, -1.0])], p, opt.init(p))
    >>> [round(x, 4) for x in p[0].tolist()], state.get_slot_names()
    ([2.6464, 4.3536], ['momentum', 'velocity'])
    """

    def _step(self, lr, var, slots, non_slots, summed):
        b1p, b2p, m, v = self._moments(var, slots, non_slots, summed)
        one = jnp.ones((), var.dtype)
        update = divide(m, one - b1p) / (jnp.sqrt(divide(v, one - b2p)) + const(self.epsilon, var.dtype))
        w_norm = jnp.sqrt(jnp.sum(jnp.square(var)))
        g_norm = jnp.sqrt(jnp.sum(jnp.square(update)))
        # Keras's nested where: the division is computed either way, its inf/NaN never chosen.
        ratio = jnp.where(w_norm > 0, jnp.where(g_norm > 0, w_norm / g_norm, one), one)
        return var - ratio * lr * update, {"momentum": m, "velocity": v}
