"""Keras 3's `SGD`, `RMSprop`, `Adagrad`, `Adadelta` and `Lion`, in Keras's order of operations."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax.numpy as jnp

from varstate.optimizers._core._rows import add_rows, as_dtype, gather_rows
from varstate.optimizers._core._traced import varies
from varstate.optimizers.keras._base import KerasOptimizer, const, densify, scatter_sub


@dataclasses.dataclass(frozen=True)
class SGD(KerasOptimizer):
    """``keras.optimizers.SGD``: slot ``momentum`` when ``momentum != 0``.

    ``m = m * momentum - g * lr``; ``var += m``, or with Nesterov
    ``var += m * momentum - g * lr``. Without momentum, ``var -= g * lr``
    (sparse rows subtracted one after another).

    Args:
        learning_rate: a float, or a schedule ``f(iteration)`` called with the
            ``iteration`` counter (unless ``step=`` is given; Keras then keeps no
            ``learning_rate`` variable).
        weight_decay: Keras's decoupled weight decay, ``var -= var *
            weight_decay * learning_rate`` before each update; None turns it off.
        momentum: the momentum (a float; 0 keeps no ``momentum`` slot).
        nesterov: take Nesterov's step (the formula above).

    Raises:
        TypeError: an option that is not a float (the learning rate: nor a
            callable), or an unknown keyword (the message names the closest).

    >>> import jax.numpy as jnp
    >>> from varstate.optimizers import keras
    >>> opt = keras.SGD(0.1, momentum=0.5, nesterov=True)
    >>> p = [jnp.zeros(1)]
    >>> p, state = opt.update([jnp.ones(1)], p, opt.init(p))
    >>> round(p[0].item(), 4), round(state.slots["momentum"][0].item(), 4)
    (-0.15, -0.1)
    """

    learning_rate: float = 0.01
    momentum: float = 0.0
    nesterov: bool = False

    _floats: ClassVar[tuple[str, ...]] = ("momentum",)

    @property
    def _with_momentum(self) -> bool:
        """Keras keeps a momentum slot and step for a non-zero momentum; a traced one may change: always."""
        return varies(self.momentum) or self.momentum != 0

    def _slot_groups(self):
        return (("momentum",),) if self._with_momentum else ()

    def _step(self, lr, var, slots, non_slots, summed):
        mom = as_dtype(self.momentum, var.dtype)
        scaled = summed(lambda g: g * lr)
        m = slots["momentum"] * mom - scaled
        var = var + (m * mom - scaled) if self.nesterov else var + m
        return var, {"momentum": m}

    def _step_dense(self, lr, grad, var, slots, non_slots):
        if not self._with_momentum:
            return var - grad * lr, {}
        return super()._step_dense(lr, grad, var, slots, non_slots)

    def _step_sparse(self, lr, values, indices, var, slots, non_slots):
        if not self._with_momentum:
            return scatter_sub(var, indices, values * lr), {}
        return super()._step_sparse(lr, values, indices, var, slots, non_slots)


@dataclasses.dataclass(frozen=True)
class RMSprop(KerasOptimizer):
    """``keras.optimizers.RMSprop``: slots ``velocity``, ``momentum`` (momentum > 0), ``average_gradient`` (centered).

    ``v = rho * v + (1 - rho) * g**2``; centered: ``a = rho * a + (1 - rho) * g``
    and the denominator is ``v - a**2 + epsilon``, else ``v + epsilon``;
    ``inc = lr * g / sqrt(denominator)``; ``mom = momentum * mom + inc;
    var -= mom``, or ``var -= inc`` without momentum.

    Args:
        learning_rate: a float, or a schedule ``f(iteration)`` called with the
            ``iteration`` counter (unless ``step=`` is given; Keras then keeps no
            ``learning_rate`` variable).
        weight_decay: Keras's decoupled weight decay, ``var -= var *
            weight_decay * learning_rate`` before each update; None turns it off.
        rho: the decay of ``velocity`` (and ``average_gradient``).
        momentum: the momentum (0 keeps no ``momentum`` slot).
        epsilon: added to the denominator under the square root.
        centered: subtract the squared mean gradient (slot ``average_gradient``).

    Raises:
        TypeError: an option that is not a float (the learning rate: nor a
            callable), or an unknown keyword (the message names the closest).

    >>> import jax.numpy as jnp
    >>> from varstate.optimizers import keras
    >>> opt = keras.RMSprop(0.01, centered=True, momentum=0.9)
    >>> p = [jnp.zeros(1)]
    >>> p, state = opt.update([jnp.ones(1)], p, opt.init(p))
    >>> opt.keras_layout()[1], round(p[0].item(), 4)
    ((('velocity',), ('momentum',), ('average_gradient',)), -0.0333)
    """

    rho: float = 0.9
    momentum: float = 0.0
    epsilon: float = 1e-7
    centered: bool = False

    _floats: ClassVar[tuple[str, ...]] = ("rho", "momentum", "epsilon")

    @property
    def _with_momentum(self) -> bool:
        """Keras keeps a momentum slot and step for a positive momentum; a traced one may change: always."""
        return varies(self.momentum) or self.momentum > 0

    def _slot_groups(self):
        groups = [("velocity",)]
        if self._with_momentum:
            groups.append(("momentum",))
        if self.centered:
            groups.append(("average_gradient",))
        return tuple(groups)

    def _denominator(self, dtype, slots, new, summed):
        rho, rest = const(self.rho, dtype), const(1 - self.rho, dtype)
        v = new["velocity"] = rho * slots["velocity"] + summed(lambda g: rest * jnp.square(g))
        if self.centered:
            a = new["average_gradient"] = rho * slots["average_gradient"] + summed(lambda g: rest * g)
            return v - jnp.square(a) + const(self.epsilon, dtype)
        return v + const(self.epsilon, dtype)

    def _step_dense(self, lr, grad, var, slots, non_slots):
        new = {}
        den = self._denominator(var.dtype, slots, new, lambda f: f(grad))
        inc = (lr * grad) / jnp.sqrt(den)
        if self._with_momentum:
            mom = new["momentum"] = const(self.momentum, var.dtype) * slots["momentum"] + inc
            return var - mom, new
        return var - inc, new

    def _step_sparse(self, lr, values, indices, var, slots, non_slots):
        new, shape = {}, var.shape
        den = self._denominator(var.dtype, slots, new, lambda f: densify(f(values), indices, shape))
        inc = (lr * values) / gather_rows(jnp.sqrt(den), indices)
        if self._with_momentum:
            mom = new["momentum"] = const(self.momentum, var.dtype) * slots["momentum"] + densify(inc, indices, shape)
            return var - mom, new
        return scatter_sub(var, indices, inc), new


@dataclasses.dataclass(frozen=True)
class Adagrad(KerasOptimizer):
    """``keras.optimizers.Adagrad``: slot ``accumulator`` (starting at ``initial_accumulator_value``).

    ``acc += g**2``; ``var -= lr * g / sqrt(acc + epsilon)`` (sparse rows
    added and subtracted one after another).

    Args:
        learning_rate: a float, or a schedule ``f(iteration)`` called with the
            ``iteration`` counter (unless ``step=`` is given; Keras then keeps no
            ``learning_rate`` variable).
        weight_decay: Keras's decoupled weight decay, ``var -= var *
            weight_decay * learning_rate`` before each update; None turns it off.
        initial_accumulator_value: the accumulator's starting value.
        epsilon: added to the accumulator under the square root.

    Raises:
        TypeError: an option that is not a float (the learning rate: nor a
            callable), or an unknown keyword (the message names the closest).

    >>> import jax.numpy as jnp
    >>> from varstate.optimizers import keras
    >>> opt = keras.Adagrad(0.1, initial_accumulator_value=0.0, epsilon=0.0)
    >>> p = [jnp.zeros(1)]
    >>> p, state = opt.update([jnp.full(1, 2.0)], p, opt.init(p))
    >>> round(p[0].item(), 4), state.slots["accumulator"][0].item()
    (-0.1, 4.0)
    """

    initial_accumulator_value: float = 0.1
    epsilon: float = 1e-7

    _floats: ClassVar[tuple[str, ...]] = ("initial_accumulator_value", "epsilon")

    def _slot_groups(self):
        return (("accumulator",),)

    def _slot_inits(self):
        return {"accumulator": self.initial_accumulator_value}

    def _step_dense(self, lr, grad, var, slots, non_slots):
        acc = slots["accumulator"] + jnp.square(grad)
        return var - (lr * grad) / jnp.sqrt(acc + const(self.epsilon, var.dtype)), {"accumulator": acc}

    def _step_sparse(self, lr, values, indices, var, slots, non_slots):
        acc = add_rows(slots["accumulator"], indices, jnp.square(values))
        rows = (lr * values) / gather_rows(jnp.sqrt(acc + const(self.epsilon, var.dtype)), indices)
        return scatter_sub(var, indices, rows), {"accumulator": acc}


@dataclasses.dataclass(frozen=True)
class Adadelta(KerasOptimizer):
    """``keras.optimizers.Adadelta``: slots ``accumulated_grad``, ``accumulated_delta_var``.

    ``ag = rho * ag + (1 - rho) * g**2``;
    ``delta = -sqrt(adv + epsilon) * g / sqrt(ag + epsilon)``;
    ``adv = rho * adv + (1 - rho) * delta**2``; ``var += lr * delta``.

    Args:
        learning_rate: a float, or a schedule ``f(iteration)`` called with the
            ``iteration`` counter (unless ``step=`` is given; Keras then keeps no
            ``learning_rate`` variable).
        weight_decay: Keras's decoupled weight decay, ``var -= var *
            weight_decay * learning_rate`` before each update; None turns it off.
        rho: the decay of both accumulators.
        epsilon: added under both square roots.

    Raises:
        TypeError: an option that is not a float (the learning rate: nor a
            callable), or an unknown keyword (the message names the closest).

    >>> import jax.numpy as jnp
    >>> from varstate.optimizers import keras
    >>> opt = keras.Adadelta(1.0, rho=0.5, epsilon=0.0)
    >>> p = [jnp.zeros(1)]
    >>> p, state = opt.update([jnp.ones(1)], p, opt.init(p))
    >>> p[0].item(), state.slots["accumulated_grad"][0].item()
    (0.0, 0.5)
    """

    learning_rate: float = 0.001
    rho: float = 0.95
    epsilon: float = 1e-7

    _floats: ClassVar[tuple[str, ...]] = ("rho", "epsilon")

    def _slot_groups(self):
        return (("accumulated_grad", "accumulated_delta_var"),)

    def _rms(self, x):
        return jnp.sqrt(x + const(self.epsilon, x.dtype))

    def _step_dense(self, lr, grad, var, slots, non_slots):
        dtype = var.dtype
        rho, rest = const(self.rho, dtype), const(1 - self.rho, dtype)
        ag = rho * slots["accumulated_grad"] + rest * jnp.square(grad)
        delta = -((self._rms(slots["accumulated_delta_var"]) * grad) / self._rms(ag))
        adv = rho * slots["accumulated_delta_var"] + rest * jnp.square(delta)
        return var + lr * delta, {"accumulated_grad": ag, "accumulated_delta_var": adv}

    def _step_sparse(self, lr, values, indices, var, slots, non_slots):
        dtype, shape = var.dtype, var.shape
        rho, rest = const(self.rho, dtype), const(1 - self.rho, dtype)
        ag = rho * slots["accumulated_grad"] + densify(rest * jnp.square(values), indices, shape)
        rms_delta = gather_rows(self._rms(slots["accumulated_delta_var"]), indices)
        delta = -((rms_delta * values) / gather_rows(self._rms(ag), indices))
        adv = rho * slots["accumulated_delta_var"] + densify(rest * jnp.square(delta), indices, shape)
        return add_rows(var, indices, lr * delta), {"accumulated_grad": ag, "accumulated_delta_var": adv}


@dataclasses.dataclass(frozen=True)
class Lion(KerasOptimizer):
    """``keras.optimizers.Lion``: slot ``momentum``.

    ``var -= lr * sign(m * beta_1 + g * (1 - beta_1))``, then
    ``m = m * beta_2 + g * (1 - beta_2)``.

    Args:
        learning_rate: a float, or a schedule ``f(iteration)`` called with the
            ``iteration`` counter (unless ``step=`` is given; Keras then keeps no
            ``learning_rate`` variable).
        weight_decay: Keras's decoupled weight decay, ``var -= var *
            weight_decay * learning_rate`` before each update; None turns it off.
        beta_1: the interpolation of the momentum into the sign's argument.
        beta_2: the decay of the ``momentum`` slot.

    Raises:
        TypeError: an option that is not a float (the learning rate: nor a
            callable), or an unknown keyword (the message names the closest).

    >>> import jax.numpy as jnp
    >>> from varstate.optimizers import keras
    >>> opt = keras.Lion(0.1)
    >>> p = [jnp.zeros(2)]
    >>> p, _ = opt.update([jnp.array([3.0, -0.5])], p, opt.init(p))
    >>> [round(x, 4) for x in p[0].tolist()]
    [-0.1, 0.1]
    """

    beta_1: float = 0.9
    beta_2: float = 0.99

    _floats: ClassVar[tuple[str, ...]] = ("beta_1", "beta_2")

    def _slot_groups(self):
        return (("momentum",),)

    def _step(self, lr, var, slots, non_slots, summed):
        b1, b2 = as_dtype(self.beta_1, var.dtype), as_dtype(self.beta_2, var.dtype)
        m = slots["momentum"]
        var = var - lr * jnp.sign(m * b1 + summed(lambda g: g * (1.0 - b1)))
        return var, {"momentum": m * b2 + summed(lambda g: g * (1.0 - b2))}
