"""`AdagradDA`: TF v1's Adagrad dual averaging, which reads the global step at every update."""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import jax.numpy as jnp
from jax import lax

from varstate._global_step import assert_global_step
from varstate.optimizers._core._base import Hyper, Optimizer
from varstate.optimizers._core._rows import as_dtype, divide, gather_rows, set_rows
from varstate.optimizers._proximal_math import (
    _check,
    _float_options,
    _one_element_rows,
    _pair_div,
    _per_l1,
    _two_prod,
    _two_sum,
)


@dataclasses.dataclass(frozen=True)
class AdagradDA(Optimizer):
    """`tf.compat.v1.train.AdagradDAOptimizer`; slots ``gradient_accumulator`` (starts at 0) and
    ``gradient_squared_accumulator`` (starts at ``initial_gradient_squared_accumulator_value``).

    ``g_acc += grad``; ``gg_acc += grad**2``; with ``t = step + 1``:
    ``var = -sign(g_acc) * lr * max(|g_acc| - t * l1, 0) / (t * l2 * lr + sqrt(gg_acc))``
    (without L1: ``var = -g_acc * lr / (t * l2 * lr + sqrt(gg_acc))``). The
    variable is recomputed from the accumulators, not moved: a sparse gradient
    sets its rows (duplicate indices summed first).

    The global step comes with each update, ``apply_gradients(..., step=global_step)``
    (a Variable or an integer scalar): the global step *before* this update, as
    TF's optimizer reads it; the kernel gets ``step + 1``, as TF's does. It is a
    traced argument, so a new step does not recompile. TF takes ``global_step``
    in the constructor and keeps it as a tensor; a jitted step cannot read a
    Variable captured in its static config, and a non-slot copy would add a
    variable TF's checkpoints do not have. ``global_step=`` is accepted only as
    None, so that TF's positional order still holds.

    Args:
        learning_rate: the step size; a float or a callable ``f(step)``
            (then pass ``step=`` to each update).
        global_step: only None is accepted (see above): pass the global step
            to each update as ``step=``.
        initial_gradient_squared_accumulator_value: the starting value of
            ``gradient_squared_accumulator`` (positive).
        l1_regularization_strength: the L1 strength (a float; 0 turns it off).
        l2_regularization_strength: the L2 strength (a float).

    Raises:
        TypeError: a `global_step` other than None; a strength or accumulator
            value that is not a float; or, at update, a missing or non-integer
            ``step=``.
        ValueError: `initial_gradient_squared_accumulator_value` is not positive.

    >>> import jax.numpy as jnp, varstate
    >>> from varstate.optimizers import AdagradDA
    >>> w = varstate.Variable(jnp.zeros(2), name="w")
    >>> opt = AdagradDA(0.5, initial_gradient_squared_accumulator_value=3.0)
    >>> (w,), state = opt.apply_gradients([jnp.array([1.0, -1.0])], [w], opt.init([w]), step=0)
    >>> w.value.tolist(), state.get_slot(w, "gradient_squared_accumulator").value.tolist()
    ([-0.25, 0.25], [4.0, 4.0])
    """

    learning_rate: Hyper
    global_step: Any = None
    initial_gradient_squared_accumulator_value: float = 0.1
    l1_regularization_strength: float = 0.0
    l2_regularization_strength: float = 0.0

    _hyper_names: ClassVar[tuple[str, ...]] = ("learning_rate",)
    _step_floats: ClassVar[tuple[str, ...]] = ("l1_regularization_strength", "l2_regularization_strength")

    def __post_init__(self) -> None:
        if self.global_step is not None:
            raise TypeError(
                "AdagradDA takes the global step with each update, not in the constructor: "
                "pass step=global_step to apply_gradients/update (a jitted step cannot read a Variable kept "
                "in the optimizer's static config)."
            )
        super().__post_init__()
        _float_options(
            self, "initial_gradient_squared_accumulator_value", "l1_regularization_strength",
            "l2_regularization_strength",
        )
        _check(
            self, "initial_gradient_squared_accumulator_value",
            self.initial_gradient_squared_accumulator_value > 0, "positive",
        )

    def hyperparameters(self, step: Any = None) -> dict[str, Any]:
        """The learning rate at `step`, and ``global_step``, which is `step` itself.

        Args:
            step: the global step before this update (required).

        Returns:
            ``{"learning_rate": ..., "global_step": step}``.

        Raises:
            TypeError: `step` is None, or not a scalar integer.

        >>> from varstate.optimizers import AdagradDA
        >>> AdagradDA(0.1).hyperparameters(step=4)["global_step"].item()
        4
        """
        if step is None:
            raise TypeError(
                "AdagradDA needs the global step: pass step= to apply_gradients/update (the global step "
                "before this update, e.g. step=global_step; TF's kernel gets step + 1)."
            )
        h = super().hyperparameters(step)
        step = jnp.asarray(step)
        try:
            assert_global_step(step)
        except TypeError as e:
            raise TypeError(f"AdagradDA: step= is the global step: {e}") from None
        h["global_step"] = step
        return h

    def _slot_inits(self):
        initial = self.initial_gradient_squared_accumulator_value
        return {"gradient_accumulator": 0.0, "gradient_squared_accumulator": initial}

    def _scalars(self, h, dtype):
        lr = as_dtype(h["learning_rate"], dtype)
        l1, l2 = as_dtype(self.l1_regularization_strength, dtype), as_dtype(self.l2_regularization_strength, dtype)
        t = (h["global_step"] + 1).astype(jnp.float32).astype(dtype)  # TF: static_cast<float>(global_step)
        return lr, l1, l2, t

    def _by_l1(self, with_l1, without):
        return _per_l1(self.l1_regularization_strength, with_l1, without)

    def _dense(self, h, grad, var, slots, non_slots):
        lr, l1, l2, t = self._scalars(h, var.dtype)
        ga = slots["gradient_accumulator"] + grad
        gg = slots["gradient_squared_accumulator"] + grad * grad
        denom = l2 * (t * lr) + jnp.sqrt(gg)
        new = self._by_l1(lambda: (-lr * jnp.sign(ga)) * jnp.maximum(jnp.abs(ga) - t * l1, 0) / denom,
                          lambda: -(lr * ga) / denom)
        # The new value does not read the old one; jit drops unread inputs, and a dropped input is not donated,
        # so the old buffer would outlive the step. The barrier reads it (and computes nothing).
        new, _ = lax.optimization_barrier((new, var))
        return new, {"gradient_accumulator": ga, "gradient_squared_accumulator": gg}

    def _sparse(self, h, values, indices, var, slots, non_slots):
        lr, l1, l2, t = self._scalars(h, var.dtype)
        ga = gather_rows(slots["gradient_accumulator"], indices)
        gg = gather_rows(slots["gradient_squared_accumulator"], indices)
        if not _one_element_rows(var):
            # TF's loop over rows of several elements has its own form: g_acc / t, sqrt(gg_acc) / (t * lr).
            ga, gg = ga + values, gg + values * values
            denom = l2 + divide(jnp.sqrt(gg), t * lr)
            rows = self._by_l1(lambda: -jnp.sign(ga) * jnp.maximum(divide(jnp.abs(ga), t) - l1, 0) / denom,
                               lambda: -divide(ga, t) / denom)
        elif var.dtype == jnp.float32:
            rows, ga, gg = self._float32_scalar_rows(lr, l1, l2, t, values, ga, gg)
        else:  # TF's scalar loop in double; here in the variable's own precision
            ga, gg = ga + values, gg + values * values
            denom = (t * l2) * lr + jnp.sqrt(gg)
            rows = self._by_l1(lambda: (-jnp.sign(ga) * lr) * jnp.maximum(jnp.abs(ga) - t * l1, 0) / denom,
                               lambda: (-ga * lr) / denom)
        new = {"gradient_accumulator": ga, "gradient_squared_accumulator": gg}
        new = {k: set_rows(slots[k], indices, v) for k, v in new.items()}
        return set_rows(var, indices, rows), new

    def _float32_scalar_rows(self, lr, l1, l2, t, g, ga, gg):
        """TF's scalar loop for float32, whose arithmetic is double: in float32 pairs, rounded once.

        TF: ``ga += g``, ``gg += g * g`` (double, stored as float); then with ``gs = step + 1``
        ``var = sgn(-ga) * lr * max(|ga| - gs * l1, 0) / (gs * l2 * lr + sqrt(gg))`` or, without L1,
        ``var = (-ga * lr) / (gs * l2 * lr + sqrt(gg))``, in double except ``sqrt(gg)``, a float
        (C++'s ``std::sqrt`` of a float).
        """
        ga = ga + g  # exact in double, then rounded: the float sum
        sq, sq_lo = _two_prod(g, g)
        s, s_lo = _two_sum(gg, sq)
        gg = s + (s_lo + sq_lo)
        # Denominator gs * l2 * lr + sqrt(gg) as a pair; TF's std::sqrt of a float is a float.
        a, a_lo = _two_prod(t, l2)
        b, b_lo = _two_prod(a, lr)
        b_lo = b_lo + a_lo * lr
        dh, dl = _two_sum(b, jnp.sqrt(gg))
        dl = dl + b_lo

        def with_l1():
            c, c_lo = _two_prod(t, l1)
            m, m_lo = _two_sum(jnp.abs(ga), -c)
            m_lo = m_lo - c_lo
            positive = (m > 0) | ((m == 0) & (m_lo > 0))
            m, m_lo = jnp.where(positive, m, 0), jnp.where(positive, m_lo, 0)
            sign_lr = jnp.where(ga == 0, 0, -jnp.sign(ga)) * lr  # TF's sgn(-0.0) is +0
            nh, nl = _two_prod(sign_lr, m)
            return nh, nl + sign_lr * m_lo

        nh, nl = self._by_l1(with_l1, lambda: _two_prod(-ga, lr))
        return _pair_div(nh, nl, dh, dl), ga, gg
