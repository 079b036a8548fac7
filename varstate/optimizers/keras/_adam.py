"""Keras 3's Adam family: `Adam` (with AMSGrad), `AdamW`, `Adamax`, `Nadam`, in Keras's order of operations."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax.numpy as jnp

from varstate.optimizers._core._rows import divide
from varstate.optimizers.keras._base import KerasOptimizer, const, densify, keras_power, local_step


@dataclasses.dataclass(frozen=True)
class Adam(KerasOptimizer):
    """``keras.optimizers.Adam``: slots ``momentum``, ``velocity`` (and ``velocity_hat`` with ``amsgrad``).

    With ``t = iteration + 1``: ``alpha = lr * sqrt(1 - beta_2**t) / (1 - beta_1**t)``,
    ``m += (g - m) * (1 - beta_1)``, ``v += (g**2 - v) * (1 - beta_2)``,
    ``var -= m * alpha / (sqrt(v) + epsilon)`` (``v_hat = max(v_hat, v)`` in
    place of ``v`` with AMSGrad). A sparse gradient's rows are summed into a
    dense gradient, and ``g**2`` is the sum of the rows' squares (Keras
    squares the rows before summing them).

    >>> import jax.numpy as jnp, varstate
    >>> from varstate.optimizers import keras
    >>> w = varstate.Variable(jnp.zeros(2), name="w")
    >>> opt = keras.Adam(0.1)
    >>> state = opt.init([w])
    >>> (w,), state = opt.apply_gradients([jnp.array([1.0, -1.0])], [w], state)
    >>> [round(x, 4) for x in w.value.tolist()], state.get_slot_names()
    ([-0.1, 0.1], ['momentum', 'velocity'])
    """

    beta_1: float = 0.9
    beta_2: float = 0.999
    epsilon: float = 1e-7
    amsgrad: bool = False

    _floats: ClassVar[tuple[str, ...]] = ("beta_1", "beta_2", "epsilon")

    def _slot_groups(self):
        return (("momentum", "velocity"), ("velocity_hat",)) if self.amsgrad else (("momentum", "velocity"),)

    def _alpha(self, lr, non_slots, dtype):
        t = local_step(non_slots, dtype)
        b1p = keras_power(jnp.asarray(self.beta_1, jnp.float32).astype(dtype), t)
        b2p = keras_power(jnp.asarray(self.beta_2, jnp.float32).astype(dtype), t)
        return lr * jnp.sqrt(1 - b2p) / (1 - b1p)

    def _apply(self, lr, grad, grad_sq, var, slots, non_slots):
        dtype = var.dtype
        alpha = self._alpha(lr, non_slots, dtype)
        m = slots["momentum"] + (grad - slots["momentum"]) * const(1 - self.beta_1, dtype)
        v = slots["velocity"] + (grad_sq - slots["velocity"]) * const(1 - self.beta_2, dtype)
        out = {"momentum": m, "velocity": v}
        if self.amsgrad:
            v = out["velocity_hat"] = jnp.maximum(slots["velocity_hat"], v)
        return var - (m * alpha) / (jnp.sqrt(v) + const(self.epsilon, dtype)), out

    def _step_dense(self, lr, grad, var, slots, non_slots):
        return self._apply(lr, grad, jnp.square(grad), var, slots, non_slots)

    def _step_sparse(self, lr, values, indices, var, slots, non_slots):
        grad, grad_sq = densify(values, indices, var.shape), densify(jnp.square(values), indices, var.shape)
        return self._apply(lr, grad, grad_sq, var, slots, non_slots)


@dataclasses.dataclass(frozen=True)
class AdamW(Adam):
    """``keras.optimizers.AdamW``: `Adam` with decoupled weight decay (default 0.004).

    Each step first decays the variable, ``var -= var * weight_decay * lr``,
    then takes Adam's step.

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
class Adamax(KerasOptimizer):
    """``keras.optimizers.Adamax``: slots ``momentum``, ``norm``.

    ``m += (g - m) * (1 - beta_1)``, ``u = max(beta_2 * u, |g|)``,
    ``var -= lr * m / ((1 - beta_1**t) * (u + epsilon))``. A sparse
    gradient's rows are summed (``|g|``: the sum of the rows' absolute values).

    >>> import jax.numpy as jnp
    >>> from varstate.optimizers import keras
    >>> opt = keras.Adamax(0.1)
    >>> p = [jnp.zeros(1)]
    >>> p, _ = opt.update([jnp.ones(1)], p, opt.init(p))
    >>> round(p[0].item(), 4)
    -0.1
    """

    beta_1: float = 0.9
    beta_2: float = 0.999
    epsilon: float = 1e-7

    _floats: ClassVar[tuple[str, ...]] = ("beta_1", "beta_2", "epsilon")

    def _slot_groups(self):
        return (("momentum", "norm"),)

    def _apply(self, lr, grad, grad_abs, var, slots, non_slots):
        dtype = var.dtype
        b1p = keras_power(jnp.asarray(self.beta_1, jnp.float32).astype(dtype), local_step(non_slots, dtype))
        m = slots["momentum"] + (grad - slots["momentum"]) * const(1 - self.beta_1, dtype)
        u = jnp.maximum(const(self.beta_2, dtype) * slots["norm"], grad_abs)
        var = var - (lr * m) / ((1 - b1p) * (u + const(self.epsilon, dtype)))
        return var, {"momentum": m, "norm": u}

    def _step_dense(self, lr, grad, var, slots, non_slots):
        return self._apply(lr, grad, jnp.abs(grad), var, slots, non_slots)

    def _step_sparse(self, lr, values, indices, var, slots, non_slots):
        grad, grad_abs = densify(values, indices, var.shape), densify(jnp.abs(values), indices, var.shape)
        return self._apply(lr, grad, grad_abs, var, slots, non_slots)


@dataclasses.dataclass(frozen=True)
class Nadam(KerasOptimizer):
    """``keras.optimizers.Nadam``: slots ``momentum``, ``velocity``; non-slot ``u_product`` (the momentum schedule).

    With ``u_t = beta_1 * (1 - 0.5 * 0.96**t)``, each step first multiplies
    ``u_product`` by ``u_t``; then ``m += (g - m) * (1 - beta_1)``,
    ``v += (g**2 - v) * (1 - beta_2)``,
    ``m_hat = u_{t+1} m / (1 - u_product u_{t+1}) + (1 - u_t) g / (1 - u_product)``,
    ``var -= m_hat * lr / (sqrt(v / (1 - beta_2**t)) + epsilon)``.

    >>> import jax.numpy as jnp
    >>> from varstate.optimizers import keras
    >>> opt = keras.Nadam(0.1)
    >>> p = [jnp.zeros(1)]
    >>> p, state = opt.update([jnp.ones(1)], p, opt.init(p))
    >>> round(p[0].item(), 4), round(state.non_slot("u_product").value.item(), 4)
    (-0.1063, 0.468)
    """

    beta_1: float = 0.9
    beta_2: float = 0.999
    epsilon: float = 1e-7

    _floats: ClassVar[tuple[str, ...]] = ("beta_1", "beta_2", "epsilon")

    def _slot_groups(self):
        return (("momentum", "velocity"),)

    def _extra_non_slots(self):
        return {"u_product": 1.0}

    def _u_product(self, non_slots):
        """Keras's update of ``u_product``, made before the variables' steps (in float32, its dtype)."""
        u = non_slots["u_product"]
        decay = keras_power(const(0.96, u.dtype), local_step(non_slots, u.dtype))
        return u * const(self.beta_1, u.dtype) * (const(1.0, u.dtype) - const(0.5, u.dtype) * decay)

    def _apply(self, lr, grad, grad_sq, sparse_term, var, slots, non_slots):
        dtype = var.dtype
        t, t1 = local_step(non_slots, dtype), local_step(non_slots, dtype, 2)
        decay = jnp.asarray(0.96, jnp.float32).astype(dtype)
        b1 = jnp.asarray(self.beta_1, jnp.float32).astype(dtype)
        b2 = jnp.asarray(self.beta_2, jnp.float32).astype(dtype)
        u_t = b1 * (1.0 - 0.5 * keras_power(decay, t))
        u_t1 = b1 * (1.0 - 0.5 * keras_power(decay, t1))
        u_prod = self._u_product(non_slots).astype(dtype)
        u_prod1 = u_prod * u_t1
        b2p = keras_power(b2, t)
        m = slots["momentum"] + (grad - slots["momentum"]) * (1 - b1)
        v = slots["velocity"] + (grad_sq - slots["velocity"]) * (1 - b2)
        if sparse_term is None:
            g_term = divide((1 - u_t) * grad, 1 - u_prod)
        else:  # Keras keeps (1 - u_t) * g / (1 - u_product) on the rows, then sums them into m_hat
            values, indices = sparse_term
            g_term = densify(divide((1 - u_t) * values, 1 - u_prod), indices, var.shape)
        m_hat = divide(u_t1 * m, 1 - u_prod1) + g_term
        v_hat = divide(v, 1 - b2p)
        var = var - (m_hat * lr) / (jnp.sqrt(v_hat) + const(self.epsilon, dtype))
        return var, {"momentum": m, "velocity": v}

    def _step_dense(self, lr, grad, var, slots, non_slots):
        return self._apply(lr, grad, jnp.square(grad), None, var, slots, non_slots)

    def _step_sparse(self, lr, values, indices, var, slots, non_slots):
        grad, grad_sq = densify(values, indices, var.shape), densify(jnp.square(values), indices, var.shape)
        return self._apply(lr, grad, grad_sq, (values, indices), var, slots, non_slots)

    def _finish(self, h, non_slots):
        return super()._finish(h, {**non_slots, "u_product": self._u_product(non_slots)})
