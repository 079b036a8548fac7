"""`_ArrayOps`: Python operators and numpy's array protocol on a variable's value.

Shared by `Variable` and `AutoCastVariable`: each defines `read_value()`,
and every operator applies to what it returns (an AutoCastVariable's read is
the cast one). Operands that are variables are read through their `value`.
"""

from __future__ import annotations

import operator
from typing import Any

import numpy as np


def _unwrap(x: Any) -> Any:
    return x.value if isinstance(x, _ArrayOps) else x


class _ArrayOps:
    """Operators and numpy's array protocol on `self.read_value()`: shared by Variable and AutoCastVariable."""

    __slots__ = ()
    # Elementwise __eq__ makes variables unhashable, as in TF; use `ref()`.
    __hash__ = None  # type: ignore[assignment]
    # Above numpy's: `np_array * v` calls our __rmul__ (a jax value, traceable) instead of __array__.
    __array_priority__ = 100

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
