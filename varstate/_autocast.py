"""`AutoCastVariable` and `autocast`: float32 storage read in a compute dtype (TF/Keras mixed precision).

The wrapper is a pytree whose one child is the wrapped Variable, so under
`jax.grad` the gradient lands on the float32 value (the cast is part of the
differentiated computation), an optimizer walking params to their Variables
updates the storage and rebuilds the wrapper, and a checkpoint sees the
wrapped Variable (`__varstate_variable__`), with the plain variable's keys.

The autocast dtype is read when a value is read, that is at trace time under
`jax.jit`. The active dtype lives in a JAX user context, which is part of
every jit cache key: a function traced in one scope is traced again when
called in another, so a jitted `jnp` function (`jnp.multiply` is one) never
reuses a trace that read the other dtype. Entering `autocast` inside the
jitted function, as a Keras layer does inside `call`, works as well.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from varstate._array_ops import _ArrayOps, _unwrap
from varstate._indexed_slices import IndexedSlices
from varstate._variable import Variable

# Thread-local, and in every jit cache key: a thread-local Python attribute would let a trace made under one
# dtype (an eager `jnp.multiply` is a cached jit) be reused under another.
_context = jax.make_user_context(None)


def _cast(value: Any) -> Any:
    """`value` (an array, or an uninitialized variable's ShapeDtypeStruct) as read in the autocast dtype."""
    dtype = _context.value
    if dtype is None or dtype == value.dtype:
        return value
    if isinstance(value, jax.ShapeDtypeStruct):  # uninitialized: the type a read will have
        return jax.ShapeDtypeStruct(value.shape, dtype, sharding=value.sharding)
    return value.astype(dtype)


@contextlib.contextmanager
def autocast(dtype: Any) -> Iterator[None]:
    """Within the block (this thread), `AutoCastVariable` reads return `dtype` (TF's `enable_auto_cast_variables`).

    Args:
        dtype: the dtype reads return inside the block; a non-floating dtype
            (or None) turns casting off, as in TF.

    Yields:
        None; the previous dtype is back when the block exits.

    >>> import jax.numpy as jnp, varstate
    >>> v = varstate.AutoCastVariable(varstate.Variable(jnp.ones(2), name="k"))
    >>> with varstate.autocast(jnp.bfloat16):
    ...     print(v.value.dtype, v.dtype, v.true_dtype)
    bfloat16 bfloat16 float32
    >>> print(v.value.dtype)
    float32
    """
    if dtype is not None:
        dtype = jnp.dtype(dtype)
        if not jnp.issubdtype(dtype, jnp.floating):
            dtype = None
    with _context(dtype):
        yield


_new = object.__new__


def _wrap(variable: Variable) -> AutoCastVariable:
    out = _new(AutoCastVariable)
    out._variable = variable
    return out


class AutoCastVariable(_ArrayOps):
    """A floating-point Variable whose reads are cast to the `autocast` dtype (TF's `AutoCastVariable`).

    Outside `autocast` it behaves as the wrapped Variable. Inside, `value`,
    `read_value()`, operators and indexing give the compute dtype and `dtype`
    reports it; `true_dtype` is the storage dtype. `assign*` cast back to the
    storage dtype and return a new wrapper (as do the `scatter_*` and
    `scatter_nd_*` methods); `sparse_read` and `gather_nd` read in the compute
    dtype. Other attributes (`name`,
    `resource_id`, `shape`, `trainable`, ...) are the wrapped Variable's.

    Args:
        variable: the floating-point Variable to wrap.

    Raises:
        ValueError: `variable` is not a Variable, or not floating-point (as TF).

    >>> import jax, jax.numpy as jnp, varstate
    >>> w = varstate.AutoCastVariable(varstate.Variable(jnp.full(2, 1.5), name="w"))
    >>> def loss(w, x):
    ...     with varstate.autocast(jnp.bfloat16):
    ...         return (w * x).astype(jnp.float32).sum()
    >>> g = jax.grad(loss)(w, jnp.ones(2, jnp.bfloat16))
    >>> type(g).__name__, g.__varstate_variable__().value.dtype
    ('AutoCastVariable', dtype('float32'))
    """

    __slots__ = ("_variable",)
    _should_act_as_resource_variable = True

    def __init__(self, variable: Variable) -> None:
        if not isinstance(variable, Variable):
            raise ValueError(
                f"AutoCastVariable wraps a varstate.Variable, got {type(variable).__name__}: "
                "create it with AutoCastVariable(varstate.Variable(...))."
            )
        if not jnp.issubdtype(variable.dtype, jnp.floating):
            raise ValueError(
                f"AutoCastVariable wraps floating-point variables only, but {variable.name!r} has dtype "
                f"{variable.dtype}; leave non-float variables unwrapped."
            )
        self._variable = variable

    def __varstate_variable__(self) -> Variable:
        """The wrapped Variable (what checkpoints save and restore)."""
        return self._variable

    def __getattr__(self, name: str) -> Any:
        # Protocols look their hooks up on the instance (`copy.deepcopy` finds `__deepcopy__`, numpy
        # `__array_interface__`): forwarded, the Variable's hook would answer for the wrapper and drop the autocast.
        if name == "_variable" or (name.startswith("__") and name.endswith("__")):  # `_variable`: not yet set
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        return getattr(self._variable, name)

    def __copy__(self) -> AutoCastVariable:
        return _wrap(self._variable)

    def __deepcopy__(self, memo: dict) -> AutoCastVariable:
        # As a Variable's deep copy: the value copied, the identity kept; and still a wrapper, so reads autocast.
        out = _wrap(copy.deepcopy(self._variable, memo))
        memo[id(self)] = out
        return out

    @property
    def true_dtype(self) -> np.dtype:
        """The storage dtype of the wrapped variable."""
        return self._variable.dtype

    @property
    def dtype(self) -> np.dtype:
        """The dtype reads return, which is the autocast dtype inside `autocast` and `true_dtype` elsewhere.

        TF 2.4 and later report the storage dtype here; jax takes an object's
        `dtype` for type promotion and `jnp.zeros_like`, so this one follows
        the reads (see "Where we differ" in the TF1 migration guide).
        """
        return _context.value or self._variable.dtype

    @property
    def value(self) -> Any:
        """The value, cast to the autocast dtype inside `autocast`."""
        return _cast(self._variable.value)

    def read_value(self) -> Any:
        """As `value`, cast to the autocast dtype inside `autocast`.

        Raises:
            ValueError: the variable is uninitialized.
        """
        return _cast(self._variable.read_value())

    def _to_storage(self, x: Any) -> Any:
        x = _unwrap(x)
        return jnp.asarray(x).astype(self._variable.dtype) if hasattr(x, "dtype") else x

    def assign(self, value: Any) -> AutoCastVariable:
        """A new wrapper around ``variable.assign(value)``, `value` cast to the storage dtype first.

        Args:
            value: an array of the variable's shape, in any floating dtype.

        Returns:
            A new AutoCastVariable wrapping the new version.
        """
        return _wrap(self._variable.assign(self._to_storage(value)))

    def assign_add(self, delta: Any) -> AutoCastVariable:
        """A new wrapper holding ``value + delta``, `delta` cast to the storage dtype first.

        Args:
            delta: an array of the variable's shape.

        Returns:
            A new AutoCastVariable wrapping the new version.
        """
        return _wrap(self._variable.assign_add(self._to_storage(delta)))

    def assign_sub(self, delta: Any) -> AutoCastVariable:
        """A new wrapper holding ``value - delta``, `delta` cast to the storage dtype first.

        Args:
            delta: an array of the variable's shape.

        Returns:
            A new AutoCastVariable wrapping the new version.
        """
        return _wrap(self._variable.assign_sub(self._to_storage(delta)))

    def _scatter(self, op: str, sparse_delta: Any) -> AutoCastVariable:
        if isinstance(sparse_delta, IndexedSlices):
            values = jnp.asarray(_unwrap(sparse_delta.values)).astype(self._variable.dtype)
            sparse_delta = IndexedSlices(values, sparse_delta.indices, sparse_delta.dense_shape)
        return _wrap(getattr(self._variable, op)(sparse_delta))

    def scatter_add(self, sparse_delta: IndexedSlices) -> AutoCastVariable:
        """`Variable.scatter_add` on the wrapped variable, the rows cast to the storage dtype first.

        Args:
            sparse_delta: `IndexedSlices` rows, as for `Variable.scatter_add`.

        Returns:
            A new AutoCastVariable wrapping the new version.
        """
        return self._scatter("scatter_add", sparse_delta)

    def scatter_sub(self, sparse_delta: IndexedSlices) -> AutoCastVariable:
        """`Variable.scatter_sub` on the wrapped variable, the rows cast to the storage dtype first.

        Args:
            sparse_delta: `IndexedSlices` rows, as for `Variable.scatter_sub`.

        Returns:
            A new AutoCastVariable wrapping the new version.
        """
        return self._scatter("scatter_sub", sparse_delta)

    def scatter_update(self, sparse_delta: IndexedSlices) -> AutoCastVariable:
        """`Variable.scatter_update` on the wrapped variable, the rows cast to the storage dtype first.

        Args:
            sparse_delta: `IndexedSlices` rows, as for `Variable.scatter_update`.

        Returns:
            A new AutoCastVariable wrapping the new version.
        """
        return self._scatter("scatter_update", sparse_delta)

    def scatter_max(self, sparse_delta: IndexedSlices) -> AutoCastVariable:
        """`Variable.scatter_max` on the wrapped variable, the rows cast to the storage dtype first."""
        return self._scatter("scatter_max", sparse_delta)

    def scatter_min(self, sparse_delta: IndexedSlices) -> AutoCastVariable:
        """`Variable.scatter_min` on the wrapped variable, the rows cast to the storage dtype first."""
        return self._scatter("scatter_min", sparse_delta)

    def scatter_mul(self, sparse_delta: IndexedSlices) -> AutoCastVariable:
        """`Variable.scatter_mul` on the wrapped variable, the rows cast to the storage dtype first."""
        return self._scatter("scatter_mul", sparse_delta)

    def scatter_div(self, sparse_delta: IndexedSlices) -> AutoCastVariable:
        """`Variable.scatter_div` on the wrapped variable, the rows cast to the storage dtype first."""
        return self._scatter("scatter_div", sparse_delta)

    def _scatter_nd(self, op: str, indices: Any, updates: Any) -> AutoCastVariable:
        return _wrap(getattr(self._variable, op)(indices, self._to_storage(updates)))

    def scatter_nd_add(self, indices: Any, updates: Any) -> AutoCastVariable:
        """`Variable.scatter_nd_add` on the wrapped variable, `updates` cast to the storage dtype first."""
        return self._scatter_nd("scatter_nd_add", indices, updates)

    def scatter_nd_sub(self, indices: Any, updates: Any) -> AutoCastVariable:
        """`Variable.scatter_nd_sub` on the wrapped variable, `updates` cast to the storage dtype first."""
        return self._scatter_nd("scatter_nd_sub", indices, updates)

    def scatter_nd_update(self, indices: Any, updates: Any) -> AutoCastVariable:
        """`Variable.scatter_nd_update` on the wrapped variable, `updates` cast to the storage dtype first."""
        return self._scatter_nd("scatter_nd_update", indices, updates)

    def scatter_nd_max(self, indices: Any, updates: Any) -> AutoCastVariable:
        """`Variable.scatter_nd_max` on the wrapped variable, `updates` cast to the storage dtype first."""
        return self._scatter_nd("scatter_nd_max", indices, updates)

    def scatter_nd_min(self, indices: Any, updates: Any) -> AutoCastVariable:
        """`Variable.scatter_nd_min` on the wrapped variable, `updates` cast to the storage dtype first."""
        return self._scatter_nd("scatter_nd_min", indices, updates)

    def sparse_read(self, indices: Any) -> Any:
        """`Variable.sparse_read`, cast to the autocast dtype inside `autocast` (as TF's)."""
        return _cast(self._variable.sparse_read(indices))

    def gather_nd(self, indices: Any) -> Any:
        """`Variable.gather_nd`, cast to the autocast dtype inside `autocast` (as TF's)."""
        return _cast(self._variable.gather_nd(indices))

    def _with_value(self, value: Any) -> AutoCastVariable:
        return _wrap(self._variable._with_value(value))

    def __len__(self) -> int:
        return len(self._variable)

    def __repr__(self) -> str:
        v = self._variable
        return (f"<AutoCastVariable {v.name!r} shape={v.shape} dtype={v.dtype} "
                f"dtype_to_cast_to={self.dtype} inner_variable={v!r}>")


def flatten_autocast(a: AutoCastVariable) -> tuple[tuple[Variable], None]:
    """An AutoCastVariable's pytree children (its Variable) and static data."""
    return (a._variable,), None


def unflatten_autocast(_: None, children: Any) -> AutoCastVariable:
    return _wrap(children[0])


_KEY = jax.tree_util.GetAttrKey("_variable")
jax.tree_util.register_pytree_with_keys(
    AutoCastVariable, lambda a: (((_KEY, a._variable),), None), unflatten_autocast, flatten_func=flatten_autocast)
