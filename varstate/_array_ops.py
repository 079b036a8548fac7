"""`_ArrayOps`: Python operators, numpy's and JAX's array protocols on a variable's value.

Shared by `Variable` and `AutoCastVariable`: each defines `read_value()`,
and every operator applies to what it returns (an AutoCastVariable's read is
the cast one). Operands that are variables are read through their `value`.

`jnp` and `jax.nn` functions take a variable through `__jax_array__`. `lax`
primitives do not consult it: they convert each operand through JAX's
canonicalization table, where `_ArrayOps` is registered too, so `lax.add(v, x)`
works and so do custom JVP rules that hand a variable's tangent (itself a
variable: the tangent has the primal's pytree structure) to a primitive, as
`jax.nn.relu`'s does under `jax.grad`.
"""

from __future__ import annotations

import operator
from typing import Any

import jax.interpreters.xla
import numpy as np

from varstate._jax_compat import Tracer


def _unwrap(x: Any) -> Any:
    return x.value if isinstance(x, _ArrayOps) else x


class _ArrayOps:
    """Operators and numpy's array protocol on `self.read_value()`: shared by Variable and AutoCastVariable."""

    __slots__ = ()
    # Elementwise __eq__ makes variables unhashable, as in TF; use `ref()`.
    __hash__ = None  # type: ignore[assignment]
    # Above numpy's: `np_array * v` calls our __rmul__ (a jax value, traceable) instead of __array__.
    __array_priority__ = 100

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

    def __bool__(self) -> bool:
        return bool(self.read_value())

    def __float__(self) -> float:
        return float(self.read_value())

    def __int__(self) -> int:
        return int(self.read_value())

    def __index__(self) -> int:
        return operator.index(self.read_value())

    def astype(self, dtype: Any) -> Any:
        return self.read_value().astype(dtype)

    @property
    def T(self) -> Any:  # noqa: N802 - numpy's name
        return self.read_value().T


def _binary(op, reflected=False):
    if reflected:
        def method(self, other):
            return op(_unwrap(other), self.read_value())
    else:
        def method(self, other):
            return op(self.read_value(), _unwrap(other))
    return method


for _name, _op in {
    "add": operator.add, "sub": operator.sub, "mul": operator.mul, "truediv": operator.truediv,
    "floordiv": operator.floordiv, "mod": operator.mod, "pow": operator.pow, "matmul": operator.matmul,
    "and": operator.and_, "or": operator.or_, "xor": operator.xor,
    "lshift": operator.lshift, "rshift": operator.rshift,
}.items():
    setattr(_ArrayOps, f"__{_name}__", _binary(_op))
    setattr(_ArrayOps, f"__r{_name}__", _binary(_op, reflected=True))
for _name, _op in {
    "lt": operator.lt, "le": operator.le, "gt": operator.gt, "ge": operator.ge,
    "eq": operator.eq, "ne": operator.ne,
}.items():
    setattr(_ArrayOps, f"__{_name}__", _binary(_op))
for _name, _op in {"neg": operator.neg, "pos": operator.pos, "abs": operator.abs, "invert": operator.invert}.items():
    setattr(_ArrayOps, f"__{_name}__", (lambda op: lambda self: op(self.read_value()))(_op))


# JAX's public alias of its canonicalization table (jax.interpreters.xla.__all__); looked up by type's MRO, so
# the base covers both classes. Were a JAX release to drop it, only lax primitives on variables would stop
# working (tests/varstate/test_jax_interop.py says so), not the import.
_handlers = getattr(jax.interpreters.xla, "canonicalize_dtype_handlers", None)
if _handlers is not None:
    _handlers[_ArrayOps] = _ArrayOps.__jax_array__
