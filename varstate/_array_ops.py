"""`_ArrayOps`: Python operators, numpy's and JAX's array protocols on a variable's value.

Shared by `Variable` and `AutoCastVariable`: each defines `read_value()`,
and every operator applies to what it returns (an AutoCastVariable's read is
the cast one). Operands that are variables are read through their `value`.

`jnp` and `jax.nn` functions are jitted: they take a variable as a pytree (its
value; its handle in the cache key), and an unjitted one reads it through
`__jax_array__`. `lax`
primitives do not consult it: they convert each operand through JAX's
canonicalization table, where `_ArrayOps` is registered too, so `lax.add(v, x)`
works and so do custom JVP rules that hand a variable's tangent (itself a
variable: the tangent has the primal's pytree structure) to a primitive, as
`jax.nn.relu`'s does under `jax.grad`.

It also holds the conversion of Python values to a variable's dtype that
`assign` and the scatters share (`_as_array`), refusing what TF's does.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import jax
import jax.interpreters.xla
import jax.numpy as jnp
import numpy as np

from varstate._jax_compat import Tracer


def _unwrap(x: Any) -> Any:
    return x.value if isinstance(x, _ArrayOps) else x


def _fit_fix(dtype: np.dtype) -> str:
    """How to hold a value that does not fit in `dtype`, for messages."""
    if dtype in (np.dtype(np.int32), np.dtype(np.uint32)) and jax.dtypes.canonicalize_dtype(np.int64) == np.int32:
        # JAX's widest integers while its 64-bit types are off: TF's int64 is narrowed to them.
        return ("JAX's 64-bit types are off, so int64 is held as int32: turn them on at startup with "
                "jax.config.update(\"jax_enable_x64\", True), then pass an int64 value (np.int64(...)) "
                "to an int64 variable.")
    return "pass a value in that range, or create the variable with a wider dtype."


def _overflow_error(value: Any, dtype: Any, what: str) -> OverflowError:
    """The error for a Python integer `value` that `dtype` (None: JAX's default integer) cannot hold."""
    target = np.dtype(dtype if dtype is not None else jax.dtypes.canonicalize_dtype(np.int64))
    span = f" (range {np.iinfo(target).min}..{np.iinfo(target).max})" if target.kind in "iu" else ""
    return OverflowError(f"{what}: {value!r:.60} does not fit in {target}{span}; {_fit_fix(target)}")


def _as_array(value: Any, dtype: Any, what: str) -> Any:
    """A Python or numpy `value` as a jax array of `dtype`, refusing what TF's conversion refuses.

    An integer out of `dtype`'s range (OverflowError), a Python float with a
    fraction for an integer dtype (TypeError): `what` names the variable and
    the method in the message (``"Variable 'w'.assign"``).
    """
    try:
        out = jnp.asarray(value, dtype=dtype)
    except OverflowError:
        raise _overflow_error(value, dtype, what) from None
    _check_lossless(value, out, what)
    return out


def _check_lossless(value: Any, out: Any, what: str) -> None:
    """Refuses `out`, the conversion of `value`, if it dropped a Python float's fraction (TF's conversion refuses)
    or wrapped a numpy integer that its dtype cannot hold (an int64 with JAX's 64-bit types off)."""
    if (isinstance(value, (np.ndarray, np.generic)) and value.dtype.kind in "iu" and out.dtype.kind in "iu"
            and value.size and not np.can_cast(value.dtype, out.dtype)):
        info = np.iinfo(out.dtype)
        low, high = value.min(), value.max()
        if low < info.min or high > info.max:
            raise _overflow_error(int(high if high > info.max else low), out.dtype, what)
    if isinstance(value, (float, complex, list, tuple)) and jnp.issubdtype(out.dtype, jnp.integer):
        exact = np.asarray(value)
        if not np.issubdtype(exact.dtype, np.integer) and not np.array_equal(exact, out):
            raise TypeError(
                f"{what}: cannot convert {value!r:.60} to {out.dtype} without losing its fractional part; "
                "pass an integer."
            )


def _binary(op: Callable[[Any, Any], Any]) -> tuple[Callable[[Any, Any], Any], Callable[[Any, Any], Any]]:
    """`op` on the read value as a method, and reflected (``__add__``, ``__radd__``)."""
    return (lambda self, other: op(self.read_value(), _unwrap(other)),
            lambda self, other: op(_unwrap(other), self.read_value()))


def _unary(op: Callable[[Any], Any]) -> Callable[[Any], Any]:
    return lambda self: op(self.read_value())


class _ArrayOps:
    """Operators and numpy's array protocol on `self.read_value()`: shared by Variable and AutoCastVariable."""

    __slots__ = ()
    # Elementwise __eq__ makes variables unhashable, as in TF; use `ref()`.
    __hash__ = None  # type: ignore[assignment]  # object's __hash__ is a method; None is how Python unsets it
    # Above numpy's: `np_array * v` calls our __rmul__ (a jax value, traceable) instead of __array__.
    __array_priority__ = 100

    if TYPE_CHECKING:  # what each subclass defines (AutoCastVariable's name comes through __getattr__)
        @property
        def name(self) -> str: ...
        @property
        def value(self) -> Any: ...
        def read_value(self) -> Any: ...

    __add__, __radd__ = _binary(operator.add)
    __sub__, __rsub__ = _binary(operator.sub)
    __mul__, __rmul__ = _binary(operator.mul)
    __truediv__, __rtruediv__ = _binary(operator.truediv)
    __floordiv__, __rfloordiv__ = _binary(operator.floordiv)
    __mod__, __rmod__ = _binary(operator.mod)
    __pow__, __rpow__ = _binary(operator.pow)
    __matmul__, __rmatmul__ = _binary(operator.matmul)
    __and__, __rand__ = _binary(operator.and_)
    __or__, __ror__ = _binary(operator.or_)
    __xor__, __rxor__ = _binary(operator.xor)
    __lshift__, __rlshift__ = _binary(operator.lshift)
    __rshift__, __rrshift__ = _binary(operator.rshift)
    __lt__, __le__ = _binary(operator.lt)[0], _binary(operator.le)[0]
    __gt__, __ge__ = _binary(operator.gt)[0], _binary(operator.ge)[0]
    __eq__, __ne__ = _binary(operator.eq)[0], _binary(operator.ne)[0]
    __neg__, __pos__ = _unary(operator.neg), _unary(operator.pos)
    __abs__, __invert__ = _unary(operator.abs), _unary(operator.invert)
    __bool__, __float__ = _unary(bool), _unary(float)
    __int__, __index__ = _unary(int), _unary(operator.index)

    def __jax_array__(self) -> Any:
        # Under jit a Variable argument is flattened (a pytree) and rebuilt around a tracer, so this returns
        # the tracer: jnp functions on it are traced and differentiated as on the value itself.
        return self.read_value()

    def numpy(self) -> np.ndarray:
        """The read value as a numpy array (TF's `Variable.numpy()`); a cast one inside `autocast`.

        >>> import jax.numpy as jnp, varstate
        >>> varstate.Variable(jnp.arange(3.0), name="n").numpy()
        array([0., 1., 2.], dtype=float32)
        """
        value = self.read_value()
        if isinstance(value, Tracer):
            raise TypeError(
                f"{type(self).__name__} {self.name!r}.numpy() inside a JAX transformation (jit, grad, vmap, ...): "
                "the value is a tracer and has no numbers yet. Return the variable (or its value) from the "
                "transformed function and call .numpy() on the result."
            )
        return np.asarray(value)

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        out = np.asarray(self.read_value(), dtype=dtype)
        return out.copy() if copy else out

    def __getitem__(self, idx: Any) -> Any:
        return self.read_value()[idx]

    def __iter__(self) -> Any:
        # Without it Python iterates through __getitem__, which jax clamps: it never stops.
        return iter(self.read_value())

    def astype(self, dtype: Any) -> Any:
        return self.read_value().astype(dtype)

    @property
    def T(self) -> Any:  # noqa: N802 - numpy's name
        return self.read_value().T


# JAX's public alias of its canonicalization table (jax.interpreters.xla.__all__); looked up by type's MRO, so
# the base covers both classes. Were a JAX release to drop it, only lax primitives on variables would stop
# working (tests/varstate/test_jax_interop.py says so), not the import.
_handlers = getattr(jax.interpreters.xla, "canonicalize_dtype_handlers", None)
if _handlers is not None:
    _handlers[_ArrayOps] = _ArrayOps.__jax_array__
