"""Keras 3's `Adafactor`: a second moment factored into row and column means for variables of 2 or more dimensions."""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import jax.numpy as jnp
import numpy as np

from varstate.optimizers._core._rows import as_dtype, divide
from varstate.optimizers._core._slots import param_want
from varstate.optimizers.keras._base import const, densify, local_step, scatter_sub
from varstate.optimizers.keras._lamb import _PerVariable


def _slot_shape(name: str, shape: tuple[int, ...], dtype: Any) -> tuple[tuple[int, ...], Any, tuple[int, ...]]:
    """Keras's shapes: ``r`` drops the last dimension, ``c`` the one before; below 2-D both are an int32 0.

    With the param's axes each slot dimension follows (a slot is split as they are).
    """
    n = len(shape)
    if name == "velocity":
        return shape, dtype, tuple(range(n))
    if n < 2:
        return (), jnp.int32, ()  # Keras's placeholder, `Variable(0)`: in its variable list, never updated
    axes = tuple(range(n - 1)) if name == "r" else (*range(n - 2), n - 1)
    return tuple(shape[a] for a in axes), dtype, axes


def _mean(x: Any, axis: Any = None, keepdims: bool = False) -> Any:
    """Keras's ``ops.mean`` (TF's sum, then a division by the count), in float32 at least as Keras computes it."""
    wide = jnp.promote_types(x.dtype, jnp.float32)
    total = jnp.sum(x.astype(wide), axis=axis, keepdims=keepdims)
    count = x.size // max(total.size, 1)
    return divide(total, jnp.asarray(count, wide)).astype(x.dtype)


@dataclasses.dataclass(frozen=True)
class Adafactor(_PerVariable):
    """``keras.optimizers.Adafactor``: slots ``r``, ``c`` (row and column accumulators) and ``velocity``.

    With ``t = iteration + 1``: ``rho = min(lr, 1 / sqrt(t))`` (with
    ``relative_step`` and a float learning rate, ``lr`` is first
    ``min(lr, 1 / sqrt(t))`` too), ``alpha = max(epsilon_2, rms(var)) * rho``,
    ``g2 = g**2 + epsilon_1``, ``beta = 1 - t**beta_2_decay``. A variable of
    2 or more dimensions keeps ``r`` (``g2``'s mean over the last axis,
    decayed: ``r = beta * r + (1 - beta) * mean(g2, -1)``) and ``c`` (over
    the second last), and ``velocity = (r / mean(r, -1))[..., None] *
    c[..., None, :]``; a smaller one ``velocity = beta * velocity + (1 -
    beta) * g2``, and its ``r`` and ``c`` are Keras's placeholders, int32
    scalars 0. Then ``u = g / sqrt(velocity)``, ``var -= alpha * u / max(1,
    rms(u) / clip_threshold)``, where ``rms(x) = sqrt(mean(x**2))`` over the
    whole variable.

    A sparse gradient follows Keras's rules for `IndexedSlices`: ``g2`` sums
    the rows' squares into a dense tensor, ``u`` stays on the rows
    (duplicates apart) and ``rms(u)`` sums their squares, and the variable
    is updated by a scatter of the rows. A row of ``sqrt(velocity)`` holding
    a 0 or NaN outside the gradient's rows (in float16, where ``epsilon_1``
    rounds to 0, a row never given a gradient) joins them as ``0 /
    sqrt(velocity)``, NaN, as in Keras (whose union of rows fails on a
    duplicate index there).

    Numerics: op by op and under ``jit``, each element of each param and
    slot is within 4 ulp of the largest element of Keras's (measured against
    Keras 3.15: params 2, slots 3): its means sum in another order than
    Eigen's, and ``velocity``, a ratio of means times a third, compounds
    them. The iteration, the learning rate and the placeholders are exact.
    The step reduces over whole variables: ``init(..., fused=True)`` is
    refused (ValueError).

    Args:
        learning_rate: a float, or a schedule ``f(iteration)`` called with the
            ``iteration`` counter (unless ``step=`` is given; Keras then keeps no
            ``learning_rate`` variable).
        beta_2_decay: the exponent of ``t`` in the second moment's decay.
        epsilon_1: added to the squared gradient.
        epsilon_2: the least ``rms(var)`` the step scales by.
        clip_threshold: the largest ``rms`` of the update before it is scaled down.
        relative_step: with a float learning rate, cap it at ``1 / sqrt(t)``.
        weight_decay: Keras's decoupled weight decay, ``var -= var *
            weight_decay * learning_rate`` before each update; None turns it off.

    Raises:
        TypeError: an option that is not a float (the learning rate: nor a
            callable; ``relative_step``: not a bool), or an unknown keyword
            (the message names the closest).

    >>> import jax.numpy as jnp, varstate
    >>> from varstate.optimizers import keras
    >>> opt = keras.Adafactor(0.5)
    >>> w = varstate.Variable(jnp.array([[1.0, 2.0], [3.0, 4.0]]), name="dense/kernel")
    >>> state = opt.init([w])
    >>> state.get_slot_names(), state.get_slot(w, "r").shape, state.get_slot(w, "r").name
    (['c', 'r', 'velocity'], (2,), 'dense/kernel/r')
    >>> (w,), state = opt.update([jnp.array([[1.0, 6.0], [7.0, 2.0]])], [w], state)
    >>> [round(x, 4) for x in w.value.ravel().tolist()]
    [0.7007, -0.0081, 1.2492, 3.4407]
    >>> state = keras.Adafactor().init({"k": jnp.ones((4, 2, 3)), "b": jnp.ones(3)})
    >>> state.slots["r"]["k"].shape, state.slots["c"]["k"].shape, state.slots["r"]["b"].dtype
    ((4, 2), (4, 3), dtype('int32'))
    >>> p = [jnp.array([1.0, 2.0, 3.0, 4.0])]
    >>> p, state = keras.Adafactor(0.5).update([jnp.array([1.0, 6.0, 7.0, 2.0])], p, keras.Adafactor(0.5).init(p))
    >>> [round(x, 4) for x in p[0].tolist()]
    [-0.3693, 0.6307, 1.6307, 2.6307]
    """

    beta_2_decay: float = -0.8
    epsilon_1: float = 1e-30
    epsilon_2: float = 1e-3
    clip_threshold: float = 1.0
    relative_step: bool = True

    _floats: ClassVar[tuple[str, ...]] = ("beta_2_decay", "epsilon_1", "epsilon_2", "clip_threshold")

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.relative_step, (bool, np.bool_)):
            raise TypeError(f"Adafactor: relative_step must be a bool, got {type(self.relative_step).__name__} "
                            f"{self.relative_step!r:.40}.")
        object.__setattr__(self, "relative_step", bool(self.relative_step))

    def _slot_groups(self):
        return (("r", "c", "velocity"),)

    def _slot_layout(self, name: str, p: Any) -> tuple:
        return _slot_shape(name, *param_want(p))

    # --- the step -------------------------------------------------------
    def _step_dense(self, lr, grad, var, slots, non_slots):
        alpha, slots, v = self._second_moment(lr, var, slots, non_slots, jnp.square(grad))
        u = grad / jnp.sqrt(v)
        return var - alpha * divide(u, self._clip(_mean(jnp.square(u)), var.dtype)), slots

    def _step_sparse(self, lr, values, indices, var, slots, non_slots):
        alpha, slots, v = self._second_moment(lr, var, slots, non_slots,
                                              densify(jnp.square(values), indices, var.shape))
        # Keras's division of rows by a dense tensor: on the rows, plus any other row of the divisor holding a 0 or
        # a NaN, which then divides a 0 (NaN there, as a dense division would give).
        root = jnp.sqrt(v)
        rows = values / root[indices]
        bad = jnp.any((root == 0) | jnp.isnan(root), axis=tuple(range(1, root.ndim)))
        bad = bad.at[indices].set(False, mode="drop").reshape((-1,) + (1,) * (root.ndim - 1))
        zero = jnp.zeros((), v.dtype)
        extra = jnp.where(bad, zero / root, zero)
        # Keras's mean of sparse rows: their sum over the dense shape's size
        total = jnp.sum(jnp.square(rows)) + jnp.sum(jnp.square(extra))
        scale = self._clip(divide(total, jnp.asarray(var.size, var.dtype)), var.dtype)
        var = jnp.where(bad, var - alpha * divide(extra, scale), var)  # only the rows Keras's scatter touches
        return scatter_sub(var, indices, alpha * divide(rows, scale)), slots

    def _clip(self, mean_square, dtype):
        """Keras's ``max(1, rms(u) / clip_threshold)``."""
        return jnp.maximum(jnp.ones((), dtype), divide(jnp.sqrt(mean_square), const(self.clip_threshold, dtype)))

    def _second_moment(self, lr, var, slots, non_slots, grad_sq):
        """(alpha, the new slots, velocity) from the dense squared gradient `grad_sq`, in Keras's order of ops."""
        dtype = var.dtype
        one = jnp.ones((), dtype)
        t = local_step(non_slots, dtype)
        cap = one / jnp.sqrt(t)
        if self.relative_step and not callable(self.learning_rate):
            lr = jnp.minimum(lr, cap)
        rho = jnp.minimum(lr, cap)
        alpha = jnp.maximum(as_dtype(self.epsilon_2, dtype), jnp.sqrt(_mean(jnp.square(var)))) * rho
        g2 = grad_sq + const(self.epsilon_1, dtype)
        beta = one - jnp.power(t, const(self.beta_2_decay, dtype))
        if var.ndim < 2:
            v = beta * slots["velocity"] + (one - beta) * g2
            return alpha, {**slots, "velocity": v}, v
        r = beta * slots["r"] + (one - beta) * _mean(g2, axis=-1)
        c = beta * slots["c"] + (one - beta) * _mean(g2, axis=-2)
        v = divide(r, _mean(r, axis=-1, keepdims=True))[..., None] * c[..., None, :]
        return alpha, {"r": r, "c": c, "velocity": v}, v
