"""`Adam`: TF v1's Adam with the ``beta1_power``/``beta2_power`` non-slot variables."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax.numpy as jnp

from varstate.optimizers._core._base import Hyper, Optimizer
from varstate.optimizers._core._rows import add_rows, as_dtype, gather_rows, set_rows


@dataclasses.dataclass(frozen=True)
class Adam(Optimizer):
    """`tf.compat.v1.train.AdamOptimizer`: slots ``m``, ``v``; non-slots ``beta1_power``, ``beta2_power``.

    The "epsilon hat" form of TF's kernel:
    ``alpha = lr * sqrt(1 - beta2^t) / (1 - beta1^t)``,
    ``var -= m * alpha / (sqrt(v) + epsilon)``. The beta powers start at
    ``beta1``/``beta2`` and are multiplied once per step.

    An `IndexedSlices` gradient decays ``m`` and ``v`` everywhere and moves
    every row of the variable, as TF's sparse Adam does; ``lazy=True`` (TF's
    LazyAdamOptimizer) updates only the touched rows of ``m``, ``v`` and the
    variable, so a step costs O(rows touched).

    Args:
        learning_rate: the step size; a float or a callable ``f(step)``
            (then pass ``step=`` to each update).
        beta1: the decay of ``m``, a float (it is also ``beta1_power``'s initial value).
        beta2: the decay of ``v``, a float (``beta2_power``'s initial value).
        epsilon: TF's "epsilon hat", added to ``sqrt(v)``; a float or a callable.
        lazy: update only the rows an `IndexedSlices` gradient touches (TF's
            ``LazyAdamOptimizer``); dense gradients are unaffected.

    Raises:
        TypeError: a hyperparameter that is neither a float nor a callable of the
            step, or an unknown keyword (the message names the closest).
            At `Optimizer.init`, a callable `beta1` or `beta2`.

    >>> import jax.numpy as jnp, varstate
    >>> from varstate.optimizers import Adam
    >>> emb = varstate.Variable(jnp.ones((4, 2)), name="emb")
    >>> opt = Adam(0.1, lazy=True)
    >>> state = opt.init([emb])
    >>> g = varstate.IndexedSlices(jnp.ones((1, 2)), jnp.array([1]), (4, 2))
    >>> (emb,), state = opt.apply_gradients([g], [emb], state)
    >>> [round(x, 4) for x in emb.value[:, 0].tolist()], state.get_slot_names()
    ([1.0, 0.9, 1.0, 1.0], ['m', 'v'])
    """

    learning_rate: Hyper = 0.001
    beta1: Hyper = 0.9
    beta2: Hyper = 0.999
    epsilon: Hyper = 1e-8
    lazy: bool = False

    _hyper_names: ClassVar[tuple[str, ...]] = ("learning_rate", "beta1", "beta2", "epsilon")

    def _slot_inits(self):
        return {"m": 0.0, "v": 0.0}

    def _non_slot_inits(self):
        if callable(self.beta1) or callable(self.beta2):
            raise TypeError("Adam: beta1 and beta2 must be floats: they are the initial beta1_power/beta2_power.")
        return {"beta1_power": self.beta1, "beta2_power": self.beta2}

    def _scalars(self, h, non_slots, dtype):
        lr, b1, b2, eps = (as_dtype(h[k], dtype) for k in ("learning_rate", "beta1", "beta2", "epsilon"))
        b1p, b2p = non_slots["beta1_power"].astype(dtype), non_slots["beta2_power"].astype(dtype)
        alpha = lr * jnp.sqrt(1 - b2p) / (1 - b1p)
        return alpha, b1, b2, eps

    def _dense(self, h, grad, var, slots, non_slots):
        alpha, b1, b2, eps = self._scalars(h, non_slots, var.dtype)
        m, v = slots["m"], slots["v"]
        m = m + (grad - m) * (1 - b1)
        v = v + (grad * grad - v) * (1 - b2)
        return var - (m * alpha) / (jnp.sqrt(v) + eps), {"m": m, "v": v}

    def _sparse(self, h, values, indices, var, slots, non_slots):
        alpha, b1, b2, eps = self._scalars(h, non_slots, var.dtype)
        m, v = slots["m"], slots["v"]
        if self.lazy:
            m_rows = b1 * gather_rows(m, indices) + (1 - b1) * values
            v_rows = b2 * gather_rows(v, indices) + (1 - b2) * (values * values)
            rows = gather_rows(var, indices) - alpha * m_rows / (jnp.sqrt(v_rows) + eps)
            return set_rows(var, indices, rows), {"m": set_rows(m, indices, m_rows), "v": set_rows(v, indices, v_rows)}
        m = add_rows(m * b1, indices, values * (1 - b1))
        v = add_rows(v * b2, indices, (values * values) * (1 - b2))
        return var - alpha * m / (jnp.sqrt(v) + eps), {"m": m, "v": v}

    def _finish(self, h, non_slots):
        b1, b2 = as_dtype(h["beta1"], jnp.float32), as_dtype(h["beta2"], jnp.float32)
        return {**non_slots, "beta1_power": non_slots["beta1_power"] * b1, "beta2_power": non_slots["beta2_power"] * b2}
