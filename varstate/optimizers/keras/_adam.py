"""Keras 3's Adam family: `Adam` (with AMSGrad), `AdamW`, `Adamax`, `Nadam`, in Keras's order of operations.

Keras's ``ops.power`` of the scalars here (``beta_1 ** t`` ...) is a scalar ``powf`` in TF and in XLA
alike: ``jnp.power`` rounds as Keras does.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax.numpy as jnp

from varstate.optimizers._core._rows import as_dtype, divide
from varstate.optimizers.keras._base import KerasOptimizer, const, local_step


@dataclasses.dataclass(frozen=True)
class _Moments:
    """Adam's family, a mixin listed before `KerasOptimizer`: the floats ``beta_1``, ``beta_2`` and ``epsilon``."""

    beta_1: float = 0.9
    beta_2: float = 0.999
    epsilon: float = 1e-7

    _floats: ClassVar[tuple[str, ...]] = ("beta_1", "beta_2", "epsilon")

    def _slot_groups(self):
        return (("momentum", "velocity"),)

    def _moments(self, var, slots, non_slots, summed):
        """Keras's ``beta_1**t`` and ``beta_2**t``, and Adam's new ``momentum`` and ``velocity`` (Lamb's too)."""
        dtype = var.dtype
        grad, grad_sq = summed(lambda g: g), summed(jnp.square)
        t = local_step(non_slots, dtype)
        b1p = jnp.power(as_dtype(self.beta_1, dtype), t)
        b2p = jnp.power(as_dtype(self.beta_2, dtype), t)
        m = slots["momentum"] + (grad - slots["momentum"]) * const(1 - self.beta_1, dtype)
        v = slots["velocity"] + (grad_sq - slots["velocity"]) * const(1 - self.beta_2, dtype)
        return b1p, b2p, m, v


@dataclasses.dataclass(frozen=True)
class Adam(_Moments, KerasOptimizer):
    """``keras.optimizers.Adam``: slots ``momentum``, ``velocity`` (and ``velocity_hat`` with ``amsgrad``).

    With ``t = iteration + 1``: ``alpha = lr * sqrt(1 - beta_2**t) / (1 - beta_1**t)``,
    ``m += (g - m) * (1 - beta_1)``, ``v += (g**2 - v) * (1 - beta_2)``,
    ``var -= m * alpha / (sqrt(v) + epsilon)`` (``v_hat = max(v_hat, v)`` in
    place of ``v`` with AMSGrad). A sparse gradient's rows are summed into a
    dense gradient, and ``g**2`` is the sum of the rows' squares (Keras
    squares the rows before summing them).

    Args:
        learning_rate: a float, or a schedule ``f(iteration)`` called with the
            ``iteration`` counter (unless ``step=`` is given; Keras then keeps no
            ``learning_rate`` variable).
        weight_decay: Keras's decoupled weight decay, ``var -= var *
            weight_decay * learning_rate`` before each update; None turns it off.
        beta_1: the decay of ``momentum``.
        beta_2: the decay of ``velocity``.
        epsilon: added to ``sqrt(v)`` (Keras's 1e-7).
        amsgrad: use the running maximum ``velocity_hat`` of ``v`` (AMSGrad).

    Raises:
        TypeError: an option that is not a float (the learning rate: nor a
            callable), or an unknown keyword (the message names the closest).

    >>> import jax.numpy as jnp, varstate
    >>> from varstate.optimizers import keras
    >>> w = varstate.Variable(jnp.zeros(2), name="w")
    >>> opt = keras.Adam(0.1)
    >>> state = opt.init([w])
    >>> (w,), state = opt.apply_gradients([jnp.array([1.0, -1.0])], [w], state)
    >>> [round(x, 4) for x in w.value.tolist()], state.get_slot_names()
    ([-0.1, 0.1], ['momentum', 'velocity'])
    """

    amsgrad: bool = False

    def _slot_groups(self):
        return (("momentum", "velocity"), ("velocity_hat",)) if self.amsgrad else (("momentum", "velocity"),)

    def _step(self, lr, var, slots, non_slots, summed):
        b1p, b2p, m, v = self._moments(var, slots, non_slots, summed)
        alpha = lr * jnp.sqrt(1 - b2p) / (1 - b1p)
        out = {"momentum": m, "velocity": v}
        if self.amsgrad:
            v = out["velocity_hat"] = jnp.maximum(slots["velocity_hat"], v)
        return var - (m * alpha) / (jnp.sqrt(v) + const(self.epsilon, var.dtype)), out


@dataclasses.dataclass(frozen=True)
class AdamW(Adam):
    """``keras.optimizers.AdamW``: `Adam` with decoupled weight decay (default 0.004).

    Each step first decays the variable, ``var -= var * weight_decay * lr``,
    then takes Adam's step.

    Args:
        learning_rate: a float, or a schedule ``f(iteration)`` called with the
            ``iteration`` counter (unless ``step=`` is given; Keras then keeps no
            ``learning_rate`` variable).
        weight_decay: the decoupled weight decay (default 0.004, Keras's), ``var -= var *
            weight_decay * learning_rate`` before each update; None turns it
            off.
        beta_1: as `Adam`'s.
        beta_2: as `Adam`'s.
        epsilon: as `Adam`'s.
        amsgrad: as `Adam`'s.

    Raises:
        TypeError: an option that is not a float (the learning rate: nor a
            callable), or an unknown keyword (the message names the closest).

    >>> import jax.numpy as jnp
    >>> from varstate.optimizers import keras
    >>> opt = keras.AdamW(0.1, weight_decay=0.5)
    >>> p = [jnp.ones(1)]
    >>> p, _ = opt.update([jnp.zeros(1)], p, opt.init(p))
    >>> round(p[0].item(), 4)
    0.95
    """

    weight_decay: float | None = 0.004


@dataclasses.dataclass(frozen=True)
class Adamax(_Moments, KerasOptimizer):
    """``keras.optimizers.Adamax``: slots ``momentum``, ``norm``.

    ``m += (g - m) * (1 - beta_1)``, ``u = max(beta_2 * u, |g|)``,
    ``var -= lr * m / ((1 - beta_1**t) * (u + epsilon))``. A sparse
    gradient's rows are summed (``|g|``: the sum of the rows' absolute values).

    Args:
        learning_rate: a float, or a schedule ``f(iteration)`` called with the
            ``iteration`` counter (unless ``step=`` is given; Keras then keeps no
            ``learning_rate`` variable).
        weight_decay: Keras's decoupled weight decay, ``var -= var *
            weight_decay * learning_rate`` before each update; None turns it off.
        beta_1: the decay of ``momentum``.
        beta_2: the decay of the infinity norm ``norm``.
        epsilon: added to ``u``.

    Raises:
        TypeError: an option that is not a float (the learning rate: nor a
            callable), or an unknown keyword (the message names the closest).

    >>> import jax.numpy as jnp
    >>> from varstate.optimizers import keras
    >>> opt = keras.Adamax(0.1)
    >>> p = [jnp.zeros(1)]
    >>> p, _ = opt.update([jnp.ones(1)], p, opt.init(p))
    >>> round(p[0].item(), 4)
    -0.1
    """

    def _slot_groups(self):
        return (("momentum", "norm"),)

    def _step(self, lr, var, slots, non_slots, summed):
        dtype = var.dtype
        grad, grad_abs = summed(lambda g: g), summed(jnp.abs)
        b1p = jnp.power(as_dtype(self.beta_1, dtype), local_step(non_slots, dtype))
        m = slots["momentum"] + (grad - slots["momentum"]) * const(1 - self.beta_1, dtype)
        u = jnp.maximum(const(self.beta_2, dtype) * slots["norm"], grad_abs)
        var = var - (lr * m) / ((1 - b1p) * (u + const(self.epsilon, dtype)))
        return var, {"momentum": m, "norm": u}


@dataclasses.dataclass(frozen=True)
class Nadam(_Moments, KerasOptimizer):
    """``keras.optimizers.Nadam``: slots ``momentum``, ``velocity``; non-slot ``u_product`` (the momentum schedule).

    With ``u_t = beta_1 * (1 - 0.5 * 0.96**t)``, each step first multiplies
    ``u_product`` by ``u_t``; then ``m += (g - m) * (1 - beta_1)``,
    ``v += (g**2 - v) * (1 - beta_2)``,
    ``m_hat = u_{t+1} m / (1 - u_product u_{t+1}) + (1 - u_t) g / (1 - u_product)``,
    ``var -= m_hat * lr / (sqrt(v / (1 - beta_2**t)) + epsilon)``.

    Args:
        learning_rate: a float, or a schedule ``f(iteration)`` called with the
            ``iteration`` counter (unless ``step=`` is given; Keras then keeps no
            ``learning_rate`` variable).
        weight_decay: Keras's decoupled weight decay, ``var -= var *
            weight_decay * learning_rate`` before each update; None turns it off.
        beta_1: the decay of ``momentum`` (and the schedule's base).
        beta_2: the decay of ``velocity``.
        epsilon: added to the denominator.

    Raises:
        TypeError: an option that is not a float (the learning rate: nor a
            callable), or an unknown keyword (the message names the closest).

    >>> import jax.numpy as jnp
    >>> from varstate.optimizers import keras
    >>> opt = keras.Nadam(0.1)
    >>> p = [jnp.zeros(1)]
    >>> p, state = opt.update([jnp.ones(1)], p, opt.init(p))
    >>> round(p[0].item(), 4), round(state.non_slot("u_product").value.item(), 4)
    (-0.1063, 0.468)
    """

    def _extra_non_slots(self):
        return {"u_product": 1.0}

    def _u_product(self, non_slots):
        """Keras's update of ``u_product``, made before the variables' steps (in float32, its dtype)."""
        u = non_slots["u_product"]
        decay = jnp.power(const(0.96, u.dtype), local_step(non_slots, u.dtype))
        return u * const(self.beta_1, u.dtype) * (const(1.0, u.dtype) - const(0.5, u.dtype) * decay)

    def _step(self, lr, var, slots, non_slots, summed):
        dtype = var.dtype
        grad, grad_sq = summed(lambda g: g), summed(jnp.square)
        t, t1 = local_step(non_slots, dtype), local_step(non_slots, dtype, 2)
        decay, b1, b2 = (as_dtype(x, dtype) for x in (0.96, self.beta_1, self.beta_2))
        u_t = b1 * (1.0 - 0.5 * jnp.power(decay, t))
        u_t1 = b1 * (1.0 - 0.5 * jnp.power(decay, t1))
        u_prod = self._u_product(non_slots).astype(dtype)
        u_prod1 = u_prod * u_t1
        b2p = jnp.power(b2, t)
        m = slots["momentum"] + (grad - slots["momentum"]) * (1 - b1)
        v = slots["velocity"] + (grad_sq - slots["velocity"]) * (1 - b2)
        # Keras keeps (1 - u_t) * g / (1 - u_product) on sparse rows, then sums them into m_hat.
        m_hat = divide(u_t1 * m, 1 - u_prod1) + summed(lambda g: divide((1 - u_t) * g, 1 - u_prod))
        v_hat = divide(v, 1 - b2p)
        var = var - (m_hat * lr) / (jnp.sqrt(v_hat) + const(self.epsilon, dtype))
        return var, {"momentum": m, "velocity": v}

    def _finish(self, h, non_slots):
        return super()._finish(h, {**non_slots, "u_product": self._u_product(non_slots)})
