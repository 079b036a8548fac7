"""Traced hyperparameters: values the state holds, so that one compiled step serves every value.

A float hyperparameter is static by default: part of the optimizer's hash and
a constant in the compiled step. ``traced(0.01)`` makes it a value instead:
`Optimizer.init` puts it into the state (``state.hyperparameters``), the step
reads it from there, and optimizers that differ only in traced values are
equal, so a sweep compiles once and ``jax.vmap`` can batch the values.

Inside the step the optimizer runs as a copy whose traced fields are `Live`
values from the state (`bind`). Keras computes constants such as
``1 - beta_1`` from the Python float in double precision and rounds the
result once; so the state keeps, next to each value, its complement
``1 - x`` rounded that way (`entry`), and ``1 - live`` reads it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from varstate._jax_compat import Tracer


@dataclasses.dataclass(frozen=True, eq=False)
class Traced:
    """A hyperparameter declared traced (`traced`): its value seeds the state; it is no part of the config's key.

    Equality and hash ignore the value: ``Adam(traced(0.01)) == Adam(traced(0.02))``,
    so both share one compiled step. Order comparisons use the value, for the
    constructors' range checks (Ftrl's ``learning_rate_power <= 0``).
    """

    value: float

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Traced)

    def __hash__(self) -> int:
        return hash(Traced)

    def __lt__(self, other: Any) -> bool:
        return self.value < other

    def __le__(self, other: Any) -> bool:
        return self.value <= other

    def __gt__(self, other: Any) -> bool:
        return self.value > other

    def __ge__(self, other: Any) -> bool:
        return self.value >= other

    def __float__(self) -> float:
        return self.value

    def __repr__(self) -> str:
        return f"traced({self.value!r})"


def traced(value: float) -> Traced:
    """Declares a hyperparameter traced: held in the optimizer state as a value, not compiled in as a constant.

    Any float hyperparameter that the step reads (learning rate, betas,
    epsilon, momentum, decays, l1/l2 strengths; Keras's too) may be traced.
    ``opt.init`` stores it in ``state.hyperparameters[name]`` (a float32
    scalar) and every step reads it from there, so runs that differ only in
    traced values share one compiled step, and ``jax.vmap`` over the values
    (or over stacked states) batches a sweep into one program. A traced value
    gives the static float's numbers op by op (TF's and Keras's fixtures pass
    both ways). Change it with ``state.with_hyperparameters(name=value)``.

    Args:
        value: the initial value, a real number.

    Returns:
        The marker to pass to an optimizer's constructor.

    Raises:
        TypeError: `value` is not a real number (a schedule stays a callable of
            the step; it needs no tracing).

    >>> import jax.numpy as jnp, varstate
    >>> from varstate.optimizers import Adam, traced
    >>> Adam(traced(0.01)) == Adam(traced(0.02))
    True
    >>> state = Adam(traced(0.01)).init([jnp.zeros(2)])
    >>> float(state.hyperparameters["learning_rate"])
    0.009999999776482582
    >>> float(state.with_hyperparameters(learning_rate=0.5).hyperparameters["learning_rate"])
    0.5
    """
    if isinstance(value, Traced):
        return value
    if isinstance(value, bool | str | bytes) or callable(value):
        raise TypeError(
            f"traced: expected a real number, got {type(value).__name__} {value!r:.40}. A schedule (a callable "
            "of the step) is passed as it is: the step is already a traced value."
        )
    try:
        return Traced(float(np.asarray(value)))
    except (TypeError, ValueError):
        raise TypeError(f"traced: expected a real number, got {type(value).__name__} {value!r:.40}.") from None


def varies(x: Any) -> bool:
    """Whether a hyperparameter is traced (`Traced` in a config, `Live` in a step): a code path it would pick by
    its value is then the one that serves every value."""
    return isinstance(x, Traced | Live)


class Live:
    """A traced hyperparameter inside a step: its float32 value and complement ``1 - x``, read from the state.

    Arithmetic with an array is float32 arithmetic on the value, as with a
    tensor. Arithmetic with a Python number is the host arithmetic Keras does
    on its floats: only the forms that float32 can give exactly are allowed
    (``1 - x`` and ``x - 1`` from the stored complement, ``-x``, ``2 * x``);
    any other, and any comparison, raises, so that no value-dependent choice
    is made silently on a traced value.
    """

    __slots__ = ("one_minus", "value")

    def __init__(self, value: Any, one_minus: Any) -> None:
        self.value, self.one_minus = value, one_minus

    def __jax_array__(self) -> Any:
        return self.value

    def _host(self, op: str, other: Any) -> Any:
        raise TypeError(
            f"a traced hyperparameter met host arithmetic ({op} {other!r}) that float32 cannot reproduce: "
            "this optimizer cannot trace it (please report)."
        )

    def __rsub__(self, other: Any) -> Any:
        if isinstance(other, int | float) and other == 1:
            return self.one_minus
        return other - self.value if _is_array(other) else self._host("-", other)

    def __sub__(self, other: Any) -> Any:
        if isinstance(other, int | float) and other == 1:
            return -self.one_minus
        return self.value - other if _is_array(other) else self._host("-", other)

    def __neg__(self) -> Any:
        return -self.value

    def __mul__(self, other: Any) -> Any:
        if isinstance(other, int | float) and other == 2:
            return self.value * 2
        return self.value * other if _is_array(other) else self._host("*", other)

    __rmul__ = __mul__

    def __truediv__(self, other: Any) -> Any:
        return self.value / other if _is_array(other) else self._host("/", other)

    def __rtruediv__(self, other: Any) -> Any:
        return other / self.value if _is_array(other) else self._host("/", other)

    def __add__(self, other: Any) -> Any:
        return self.value + other if _is_array(other) else self._host("+", other)

    __radd__ = __add__

    def __bool__(self) -> bool:
        raise TypeError("a traced hyperparameter has no truth value inside a step (please report).")

    def _compare(self, other: Any) -> bool:
        raise TypeError(f"a traced hyperparameter cannot be compared inside a step (with {other!r}; please report).")

    __eq__ = __ne__ = __lt__ = __le__ = __gt__ = __ge__ = _compare
    __hash__ = None  # type: ignore[assignment]


def _is_array(x: Any) -> bool:
    return isinstance(x, jax.Array | np.ndarray | np.generic)


def traced_names(opt: Any) -> tuple[str, ...]:
    """The names of `opt`'s traced fields that the state holds (in the order of the dataclass fields)."""
    return tuple(f.name for f in dataclasses.fields(opt)
                 if isinstance(opt.__dict__.get(f.name), Traced) and f.name not in opt._held_elsewhere())


def entry(value: Any, where: str) -> tuple[Any, Any]:
    """(float32 value, float32 ``1 - value``) as the state holds them; `where` names the value for errors.

    A Python float's complement is rounded from double precision (as Keras
    rounds ``1 - beta_1``); a float32 array's, or a traced one's, is float32
    arithmetic, which rounds the exact difference the same way. An array may
    have a leading run axis (stacked states).
    """
    bad = TypeError(f"{where}: expected a real number or an array of them, got {type(value).__name__} {value!r:.40}.")
    if isinstance(value, Tracer | jax.Array):
        if not jnp.issubdtype(value.dtype, jnp.floating) and not jnp.issubdtype(value.dtype, jnp.integer):
            raise bad
        v = jnp.asarray(value).astype(jnp.float32)
        return v, 1 - v
    if isinstance(value, bool | str | bytes) or callable(value):
        raise bad
    try:
        wide = np.asarray(value, np.float64)
    except (TypeError, ValueError):
        raise bad from None
    return jnp.asarray(wide.astype(np.float32)), jnp.asarray((1 - wide).astype(np.float32))


def bind(opt: Any, held: dict[str, tuple]) -> Any:
    """`opt` as the step runs it: a copy whose traced fields are `Live` values from the state's `held` entries.

    The copy skips the constructor (its checks ran on `opt`); nothing outside
    the step sees it.
    """
    shadow = object.__new__(type(opt))
    shadow.__dict__.update(opt.__dict__)
    for name in traced_names(opt):
        shadow.__dict__[name] = Live(*held[name])
    return shadow
