"""`LossScaleOptimizer`: TF/Keras dynamic loss scaling around any varstate optimizer."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from varstate._global_step import int64_counter
from varstate._indexed_slices import IndexedSlices
from varstate._variable import Variable, owning_variable
from varstate.optimizers._core._base import Optimizer
from varstate.optimizers._core._slots import check_non_slots, non_slot_home
from varstate.optimizers._core._state import OptimizerState

_SCALE, _GOOD = "current_loss_scale", "good_steps"  # Keras's variable names (checkpoint keys)


def _is_grad_leaf(x: Any) -> bool:
    return x is None or isinstance(x, (Variable, IndexedSlices)) or hasattr(x, "__varstate_variable__")


def _grad_value(g: Any) -> Any:
    if hasattr(g, "__varstate_variable__"):
        g = g.__varstate_variable__()
    if isinstance(g, Variable):
        return g.value
    return g.values if isinstance(g, IndexedSlices) else g


def _all_finite(grads: Any) -> Any:
    """A bool scalar: no Inf or NaN in any gradient (True for none)."""
    leaves = [_grad_value(g) for g in jax.tree.leaves(grads, is_leaf=_is_grad_leaf) if g is not None]
    return jnp.all(jnp.stack([jnp.isfinite(jnp.asarray(g)).all() for g in leaves])) if leaves else jnp.bool_(True)


def _unscaled(grads: Any, scale: Any) -> Any:
    reciprocal = 1.0 / scale

    def unscale(g: Any) -> Any:  # an array: a Variable's (or its wrapper's) value, a gradient, sparse rows
        if isinstance(g, IndexedSlices):
            return IndexedSlices(unscale(g.values), g.indices, g.dense_shape)
        g = jnp.asarray(g)
        return g * reciprocal.astype(g.dtype)

    return jax.tree.map(unscale, grads, is_leaf=lambda x: isinstance(x, IndexedSlices))


def _scaled_loss(scale: Any, fn: tuple[Callable[..., Any], bool], *args: Any, **kwargs: Any) -> tuple[Any, Any]:
    # Module level, with the scale and loss function as leading arguments, so value_and_grad's
    # argnums (shifted by two) name loss_fn's own arguments.
    loss_fn, has_aux = fn
    out = loss_fn(*args, **kwargs)
    loss, aux = out if has_aux else (out, None)
    loss = jnp.asarray(loss)
    return loss * scale.astype(loss.dtype), (loss, aux)


@dataclasses.dataclass(frozen=True)
class LossScaleOptimizer(Optimizer):
    """Loss scaling around `inner_optimizer` (Keras's `LossScaleOptimizer`, TF 2 semantics).

    Scale the loss with `get_scaled_loss`, differentiate, unscale with
    `get_unscaled_gradients` (all three with the same state: `value_and_grad`
    does them together), then `update`/`apply_gradients` the unscaled
    gradients. With ``dynamic=True`` (the default), a step whose gradients
    hold an Inf or NaN is skipped (params and the inner state unchanged) and
    halves the scale (not below 1); after ``growth_interval`` consecutive
    finite steps the scale doubles (unless that overflows). The state is the
    inner `OptimizerState` plus the non-slot variables ``current_loss_scale``
    (float32) and ``good_steps`` (int64 with ``jax_enable_x64``, else int32;
    saved as int64 either way), so it checkpoints like any optimizer state.
    With ``dynamic=False`` the scale is the fixed ``initial_scale``.

    Args:
        inner_optimizer: the `Optimizer` that takes the unscaled steps (an
            optax transformation: wrap it with `from_optax` first).
        dynamic: adjust the scale as above; False keeps ``initial_scale``.
        initial_scale: the starting scale; None is 2**15 when dynamic
            (Keras's default) and must be given when not.
        growth_interval: finite steps between doublings (a positive int);
            None is 2000 when dynamic, and must be None when not.

    Raises:
        TypeError: (as Keras) `inner_optimizer` is not an Optimizer or is
            itself a LossScaleOptimizer; `dynamic` is not a bool.
        ValueError: (as Keras) ``dynamic=False`` without `initial_scale` or
            with `growth_interval`; a `growth_interval` that is not a
            positive integer.

    >>> import jax, jax.numpy as jnp, varstate
    >>> from varstate.optimizers import GradientDescent
    >>> from varstate.mixed_precision import LossScaleOptimizer
    >>> w = varstate.Variable(jnp.ones(2), name="w")
    >>> opt = LossScaleOptimizer(GradientDescent(0.5), initial_scale=8.0, growth_interval=2)
    >>> state = opt.init([w])
    >>> loss = lambda p: (p[0].value ** 2).sum()
    >>> grads = opt.get_unscaled_gradients(jax.grad(lambda p: opt.get_scaled_loss(loss(p), state))([w]), state)
    >>> params, state = opt.apply_gradients(grads, [w], state)
    >>> params[0].value.tolist(), state.non_slot("current_loss_scale").value.item()
    ([0.0, 0.0], 8.0)
    >>> params, state = opt.apply_gradients([jnp.array([jnp.inf, 0.0])], params, state)  # skipped
    >>> params[0].value.tolist(), state.non_slot("current_loss_scale").value.item()
    ([0.0, 0.0], 4.0)
    """

    inner_optimizer: Optimizer
    dynamic: bool = True
    initial_scale: float | None = None  # 2 ** 15 when dynamic
    growth_interval: int | None = None  # 2000 when dynamic

    def __post_init__(self) -> None:
        inner = self.inner_optimizer
        if isinstance(inner, LossScaleOptimizer):
            raise TypeError(
                "LossScaleOptimizer cannot wrap another LossScaleOptimizer: wrap its inner_optimizer instead."
            )
        if not isinstance(inner, Optimizer) and hasattr(inner, "init") and hasattr(inner, "update"):
            raise TypeError(
                f"LossScaleOptimizer: inner_optimizer is an optax transformation ({type(inner).__name__}), not a "
                "varstate Optimizer: wrap it with from_optax first, e.g. "
                "LossScaleOptimizer(varstate.optimizers.from_optax(optax.adam(1e-3)))."
            )
        if not isinstance(inner, Optimizer):
            raise TypeError(
                f"LossScaleOptimizer: inner_optimizer must be a varstate.optimizers.Optimizer, got "
                f"{type(inner).__name__}."
            )
        if not isinstance(self.dynamic, bool):
            raise TypeError(f"LossScaleOptimizer: dynamic must be a bool, got {self.dynamic!r}.")
        initial, growth = self.initial_scale, self.growth_interval
        if self.dynamic:
            initial = 2.0**15 if initial is None else initial
            growth = 2000 if growth is None else growth
        else:
            if initial is None:
                raise ValueError("LossScaleOptimizer: initial_scale must be given when dynamic=False.")
            if growth is not None:
                raise ValueError(
                    f"LossScaleOptimizer: growth_interval must be None when dynamic=False, got {growth!r}."
                )
        object.__setattr__(self, "initial_scale", float(initial))
        if growth is not None:
            if int(growth) != growth or growth < 1:
                raise ValueError(f"LossScaleOptimizer: growth_interval must be a positive integer, got {growth!r}.")
            object.__setattr__(self, "growth_interval", int(growth))

    def init(self, params: Any, state: OptimizerState | None = None, **kwargs: Any) -> OptimizerState:
        """The inner optimizer's state plus ``current_loss_scale`` and ``good_steps`` (when dynamic).

        Args:
            params: the params pytree, as for `Optimizer.init`.
            state: an existing state: what it holds for these params is kept,
                the rest created (see `Optimizer.init`); None creates all.
            **kwargs: ``fused=``, ``stepped=``, passed to the inner optimizer's ``init``.

        Returns:
            The `OptimizerState`.

        Raises:
            ValueError: the inner optimizer already has a non-slot named
                ``current_loss_scale`` or ``good_steps``.
        """
        kept = {}
        if state is not None and self.dynamic:
            non_slots = dict(state.non_slots)
            kept = {k: non_slots.pop(k) for k in (_SCALE, _GOOD) if k in non_slots}
            state = state.replace(non_slots=non_slots)
        state = self.inner_optimizer.init(params, state, **kwargs)
        if not self.dynamic:
            return state
        taken = set(state.non_slots) & {_SCALE, _GOOD}
        if taken:
            raise ValueError(f"LossScaleOptimizer: the inner optimizer already has non-slot variables {taken}.")
        registry, placement = non_slot_home(params)  # with the inner optimizer's non-slots
        non_slots = {**state.non_slots, **kept}
        if _SCALE not in non_slots:
            scale = jnp.asarray(self.initial_scale, jnp.float32, device=placement)
            non_slots[_SCALE] = owning_variable(scale, name=_SCALE, trainable=False, registry=registry)
        if _GOOD not in non_slots:
            non_slots[_GOOD] = int64_counter(_GOOD, registry, placement)  # Keras: int64
        return state.replace(non_slots=non_slots)

    def with_hyperparameters(self, state: OptimizerState, **values: Any) -> OptimizerState:
        """`state` with new values of the inner optimizer's traced hyperparameters (loss scaling has none).

        >>> import jax.numpy as jnp
        >>> from varstate.optimizers import Adam, LossScaleOptimizer, traced
        >>> opt = LossScaleOptimizer(Adam(traced(0.1)))
        >>> state = opt.with_hyperparameters(opt.init([jnp.zeros(2)]), learning_rate=0.5)
        >>> float(state.hyperparameters["learning_rate"])
        0.5
        """
        return self.inner_optimizer.with_hyperparameters(state, **values)

    def _initial_arrays(self, leaves: list, initial: Callable[..., Any]) -> tuple[dict[str, list], dict[str, Any]]:
        # `to_optax`'s traceable init: the inner optimizer's (by `initial`), then the scale and the counter.
        slots, non_slots = initial(self.inner_optimizer, leaves)
        if self.dynamic:
            non_slots[_SCALE] = jnp.asarray(self.initial_scale, jnp.float32)
            non_slots[_GOOD] = jnp.zeros((), jax.dtypes.canonicalize_dtype(jnp.int64))  # int64_counter's
        return slots, non_slots

    def loss_scale(self, state: OptimizerState) -> Any:
        """The current loss scale, a float32 scalar (the fixed ``initial_scale`` when not dynamic).

        Args:
            state: this optimizer's `OptimizerState`.

        Returns:
            The scale (a jax.Array).
        """
        if not self.dynamic:
            return jnp.float32(self.initial_scale)
        return state.non_slot(_SCALE).value

    def get_scaled_loss(self, loss: Any, state: OptimizerState) -> Any:
        """``loss * loss_scale``, in the loss's dtype (Keras's ``get_scaled_loss``).

        Args:
            loss: the loss (a scalar array).
            state: the `OptimizerState` of this step, before the update.

        Returns:
            The scaled loss, to differentiate.
        """
        loss = jnp.asarray(loss)
        return loss * self.loss_scale(state).astype(loss.dtype)

    def get_unscaled_gradients(self, grads: Any, state: OptimizerState) -> Any:
        """Each gradient times ``1 / loss_scale`` (Keras's ``get_unscaled_gradients``).

        Args:
            grads: the gradients of the scaled loss, a pytree; None,
                `IndexedSlices` and Variables stay of their kind.
            state: the same `OptimizerState` the loss was scaled with.

        Returns:
            The unscaled gradients, in `grads`' structure.
        """
        return _unscaled(grads, self.loss_scale(state))

    def value_and_grad(
        self, loss_fn: Callable[..., Any], argnums: int | Sequence[int] = 0, has_aux: bool = False
    ) -> Callable[..., tuple[Any, Any, Any]]:
        """``loss_fn``'s loss and gradients through loss scaling: ``f(state, *args) -> (loss, grads, finite)``.

        The returned function scales the loss by the scale in the `state` it
        is given, differentiates (``jax.grad`` with `argnums`, `has_aux` as
        ``jax.value_and_grad``) and unscales the gradients by that same scale:
        ``loss`` is ``loss_fn``'s own (unscaled; ``(loss, aux)`` with
        `has_aux`), ``grads`` are unscaled, ``finite`` is a bool scalar, False
        when a gradient holds an Inf or NaN (the step `update` will skip).
        Pass the state of this step, before `apply_gradients`: unscaling with
        the scale after the update (halved on an overflow, doubled after
        ``growth_interval`` good steps) gives gradients off by that factor.

        Args:
            loss_fn: the loss function, ``loss_fn(*args)`` returning a scalar
                (``(loss, aux)`` with `has_aux`).
            argnums: which positional argument(s) of `loss_fn` to differentiate
                (as ``jax.value_and_grad``).
            has_aux: `loss_fn` returns ``(loss, aux)``.

        Returns:
            ``f(state, *args, **kwargs) -> (loss, grads, finite)``.

        >>> import jax.numpy as jnp, varstate
        >>> from varstate.optimizers import GradientDescent
        >>> from varstate.mixed_precision import LossScaleOptimizer
        >>> w = varstate.Variable(jnp.array([1.0, 2.0]), name="w")
        >>> opt = LossScaleOptimizer(GradientDescent(0.5), initial_scale=1024.0)
        >>> state = opt.init([w])
        >>> vg = opt.value_and_grad(lambda p, x: jnp.sum(p[0] ** 2 * x))
        >>> loss, grads, finite = vg(state, [w], 3.0)
        >>> loss.item(), grads[0].value.tolist(), bool(finite)
        (15.0, [6.0, 12.0], True)
        """
        shifted = argnums + 2 if isinstance(argnums, int) else tuple(a + 2 for a in argnums)
        grad_fn = jax.value_and_grad(_scaled_loss, argnums=shifted, has_aux=True)

        def value_and_grad_fn(state: OptimizerState, *args: Any, **kwargs: Any) -> tuple[Any, Any, Any]:
            scale = self.loss_scale(state)
            (_, (loss, aux)), grads = grad_fn(scale, (loss_fn, has_aux), *args, **kwargs)
            grads = _unscaled(grads, scale)
            return ((loss, aux) if has_aux else loss), grads, _all_finite(grads)

        return value_and_grad_fn

    def update(
        self, grads: Any, params: Any, state: OptimizerState, step: Any = None, **extra_args: Any
    ) -> tuple[Any, OptimizerState]:
        """The inner update if every gradient is finite, else params and inner state unchanged; then the scale.

        Pure and un-jitted, as `Optimizer.update`; `apply_gradients` runs it jitted.

        Args:
            grads: the unscaled gradients (`get_unscaled_gradients`).
            params: the params pytree.
            state: this optimizer's `OptimizerState`.
            step: the step, for callable hyperparameters of the inner optimizer.
            **extra_args: passed to the inner optimizer's ``update``.

        Returns:
            ``(params, state)``, the new versions.
        """
        if not self.dynamic:
            return self.inner_optimizer.update(grads, params, state, step, **extra_args)
        check_non_slots(state, (_SCALE, _GOOD))
        non_slots = dict(state.non_slots)
        scale_var, good_var = non_slots.pop(_SCALE), non_slots.pop(_GOOD)
        inner_state = state.replace(non_slots=non_slots)
        finite = _all_finite(grads)

        new_params, new_inner = jax.lax.cond(
            finite,
            lambda: self.inner_optimizer.update(grads, params, inner_state, step, **extra_args),
            lambda: (params, inner_state),
        )
        scale, good = scale_var.value, good_var.value
        grow = good + 1 >= self.growth_interval
        grown = scale * 2.0
        scale = jnp.where(finite, jnp.where(grow & jnp.isfinite(grown), grown, scale), jnp.maximum(scale / 2.0, 1.0))
        good = jnp.where(finite & ~grow, good + 1, 0).astype(good_var.dtype)
        out = {**new_inner.non_slots, _SCALE: scale_var._with_value(scale), _GOOD: good_var._with_value(good)}
        return new_params, new_inner.replace(non_slots=out)
