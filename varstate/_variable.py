"""`Variable`: an immutable pytree whose identity is a shared resource handle.

Every version of a variable (the result of `assign`, of `jax.jit`, of
unflattening) holds the same `ResourceHandle`. The handle is the pytree's
static data and compares by identity, so treedef equality and hashing in
jit's cache stay at C level, and unflatten is two attribute stores.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from itertools import repeat
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import ArrayLike

from varstate import _scatter
from varstate._array_ops import _ArrayOps, _check_lossless, _overflow_error, _unwrap
from varstate._indexed_slices import IndexedSlices
from varstate._jax_compat import ArrayImpl, Tracer, in_transformation, is_deleted_array
from varstate._registry import Registry, _next_resource_id, _scoped


class VariableSynchronization(enum.IntEnum):
    """When a distributed variable is aggregated (TF's enum, same values).

    >>> import varstate
    >>> varstate.Variable(0.0, trainable=False, synchronization="on_read").synchronization
    <VariableSynchronization.ON_READ: 3>
    """

    AUTO = 0
    NONE = 1
    ON_WRITE = 2
    ON_READ = 3


class VariableAggregation(enum.IntEnum):
    """How replica updates are combined (TF's enum, same values).

    >>> import varstate
    >>> varstate.Variable(0.0, aggregation=varstate.VariableAggregation.SUM).aggregation.name
    'SUM'
    """

    NONE = 0
    SUM = 1
    MEAN = 2
    ONLY_FIRST_REPLICA = 3


def _enum_value(enum_cls: type[enum.IntEnum], value: Any, what: str) -> enum.IntEnum:
    if isinstance(value, enum_cls):
        return value
    if isinstance(value, str) and value.upper() in enum_cls.__members__:
        return enum_cls[value.upper()]
    raise ValueError(
        f"Invalid variable {what} {value!r}: expected one of "
        f"{', '.join(f'{enum_cls.__name__}.{m}' for m in enum_cls.__members__)}."
    )


class ResourceHandle:
    """The identity shared by every version of one variable.

    Static pytree data: equality and hash are object identity (C level).
    Immutable: attributes are fixed at creation; `slot_of`/`slot_name` link an optimizer
    slot to its primary's resource id; `saved_dtype`, when not None, is the
    dtype checkpoints store instead of the value's (TF's int64 global step
    while JAX's 64-bit types are off).

    >>> import varstate
    >>> v = varstate.Variable(1.0, name="w")
    >>> v.handle is v.assign(2.0).handle, v.handle.resource_id == v.resource_id
    (True, True)
    """

    resource_id: int
    name: str
    trainable: bool
    synchronization: VariableSynchronization
    aggregation: VariableAggregation
    save_slice_info: Any
    slot_of: int | None
    slot_name: str | None
    saved_dtype: np.dtype | None
    registry: Registry
    origin: ResourceHandle | None  # the handle this one was derived from (see `derived`): kept alive, registered
    __slots__ = ("__weakref__", *__annotations__)  # one slot per attribute above

    def __repr__(self) -> str:
        return f"ResourceHandle(id={self.resource_id}, name={self.name!r})"

    def __setattr__(self, name: str, value: Any) -> None:
        # Every version of the variable, and every template a restore was given, shares this object.
        raise AttributeError(f"ResourceHandle {self.name!r} is immutable: {name} is fixed at creation.")

    def __reduce__(self):
        # Handles are process-local identities; copying one would fork it.
        raise TypeError("ResourceHandle cannot be pickled or copied: it is a process-local identity.")


_new = object.__new__


def version(value: Any, handle: ResourceHandle) -> Variable:
    """A version of the variable of `handle` holding `value`, unchecked and uncopied (a jitted step's output)."""
    v = _new(Variable)
    v._value = value
    v._handle = handle
    return v


def versions(values: list, handles: list) -> list[Variable]:
    """One new version per (value, handle): a jitted step's thousands of outputs, without a call per Variable."""
    out = list(map(_new, repeat(Variable, len(handles))))
    for v, value, handle in zip(out, values, handles, strict=True):
        v._value = value
        v._handle = handle
    return out


def _new_handle(attributes: dict[str, Any]) -> ResourceHandle:
    """A handle holding `attributes` (all of them: see the annotations), set past its immutability."""
    h = _new(ResourceHandle)
    for key, x in attributes.items():
        object.__setattr__(h, key, x)
    return h


def owning_variable(
    value: Any, *, name: str | None = None, trainable: bool | None = None, registry: Any = None,
    save_slice_info: Any = None, copy: bool = False, **fixed: Any,
) -> Variable:
    """A Variable holding `value` without copying it (unless `copy`): a fresh array its caller made for it alone (a
    slot's zeros). `fixed` gives the handle's other attributes (slot_of, slot_name, saved_dtype) at creation."""
    v = _new(Variable)
    v._init(value, name, trainable, None, VariableSynchronization.AUTO, VariableAggregation.NONE, registry,
            save_slice_info, copy=copy, **fixed)
    return v


def derived(var: Variable, **changes: Any) -> Variable:
    """A version of `var` whose handle differs in `changes` (a restored saved dtype): same resource id, name and
    registry entry, while the handle `var` shares with its other versions (a restore's template) stays as it was."""
    old = var._handle
    attributes = {key: getattr(old, key) for key in ResourceHandle.__annotations__}
    # The registry holds the first handle weakly: each derived one keeps it alive.
    return version(var._value, _new_handle({**attributes, **changes, "origin": old.origin or old}))


# While a `custom_gradient` function runs, reads consult this hook (a function
# of the Variable) so that lifted values replace closed-over ones; None
# otherwise, which keeps the common read a single global check.
_read_hook: Callable[[Variable], Any] | None = None


_ARRAY_TYPES = (jax.Array, np.ndarray, np.generic, int, float, complex, bool, list, tuple)
# What assign and its kin take, for type checkers: an array, a number, a nested list of numbers, a variable.
_Value = ArrayLike | _ArrayOps | list[Any] | tuple[Any, ...]


class DonatedVariableError(RuntimeError):
    """A version of a Variable whose buffer a jitted step donated (deleted) was used.

    `Optimizer.apply_gradients` donates the params and state it is given: their
    buffers become the new versions' and the old versions are spent. Reading
    one (its value, an operator, ``np.asarray``) raises this error, naming the
    variable; use the params and state that ``apply_gradients`` returned.
    ``repr`` of a spent version still works and says it was donated. A
    ``RuntimeError``, as JAX's own error for a deleted array.

    >>> import jax.numpy as jnp, varstate
    >>> from varstate.optimizers import GradientDescent
    >>> w = varstate.Variable(jnp.ones(2), name="w")
    >>> opt = GradientDescent(0.5)
    >>> new, state = opt.apply_gradients([jnp.ones(2)], [w], opt.init([w]))
    >>> try:
    ...     w + 1
    ... except varstate.DonatedVariableError as e:
    ...     print(str(e)[:60])
    Variable 'w': this version's buffer was donated to a jitted
    >>> new[0].value.tolist(), "donated" in repr(w)
    ([0.5, 0.5], True)
    """


def donated_error(what: str) -> DonatedVariableError:
    """The error for a spent version; `what` names it (``"Variable 'w'"``, ``"params['w']"``)."""
    return DonatedVariableError(
        f"{what}: this version's buffer was donated to a jitted step and deleted "
        "(Optimizer.apply_gradients donates the params and state it is given, as does any jax.jit with "
        "donate_argnums). Use the params and state that apply_gradients returned: "
        "`params, state = opt.apply_gradients(grads, params, state)`."
    )


def _copy(x: jax.Array) -> jax.Array:
    # A new buffer with the same sharding and committedness (tf.Variable copies its initial value too): a
    # donated step then deletes the Variable's buffer, never the caller's array. device_put copies without
    # compiling anything; jnp.array(x, copy=True) compiled a program per shape and dtype (50 new shapes: 2.07 s
    # against 0.01 s, CPU, no compilation cache), for 34 us less per copy once compiled.
    if isinstance(x.sharding, jax.sharding.SingleDeviceSharding):
        return jax.device_put(x, may_alias=False)  # no target: an uncommitted array stays uncommitted
    # The sharding named explicitly: without it a global array spanning other processes is moved to one device.
    return jax.device_put(x, x.sharding, may_alias=False)


def _as_value(value: Any, dtype: Any, what: str, copy: bool = True) -> Any:
    if isinstance(value, Variable):  # its value (DonatedVariableError if spent), or its ShapeDtypeStruct
        value = value.read_value() if value.is_initialized else value._value
    if isinstance(value, jax.ShapeDtypeStruct):
        return value if dtype is None else jax.ShapeDtypeStruct(value.shape, dtype, sharding=value.sharding)
    if not isinstance(value, _ARRAY_TYPES) or isinstance(value, (str, bytes)):
        raise TypeError(
            f"{what}: expected an array, a Python number or a nested list of numbers, "
            f"got {type(value).__name__}. Pass jnp.asarray(...) of the value."
        )
    if dtype is not None and isinstance(value, jax.Array) and jnp.issubdtype(value.dtype, jnp.inexact) and not (
            jnp.issubdtype(dtype, jnp.inexact)):
        # TF converts no Tensor to another dtype: a float one would lose its fractions here.
        raise TypeError(
            f"{what}: cannot convert a {value.dtype} array to {dtype}: it would drop the fractional part. "
            f"Round or cast it first (jnp.round(x).astype({dtype}))."
        )
    try:
        out = jnp.asarray(value, dtype=dtype)
    except OverflowError:
        raise _overflow_error(value, dtype, what) from None
    except (TypeError, ValueError) as e:
        raise TypeError(f"{what}: cannot convert {type(value).__name__} to an array: {e}") from None
    if jax.typeof(out).weak_type:
        # A TF variable has a definite dtype; a weakly typed value (from a Python number, or jnp.full with one)
        # would also make the first step's jit differ from the next one's (its outputs are strongly typed).
        out = jax.lax.convert_element_type(out, out.dtype)
    elif copy and out is value:  # the caller's own jax.Array (numpy and Python values are copied by asarray)
        out = _copy(out)
    _check_lossless(value, out, what)  # as TF's conversion of Python numbers: no silent truncation
    return out


class Variable(_ArrayOps):
    """A TF resource variable as an immutable JAX pytree.

    The value is the only pytree child; the `ResourceHandle` (id, name,
    trainable, ...) is static data shared by every version. Methods such as
    `assign` return a NEW Variable with the same resource.

    `Variable(x)` copies a jax.Array `x` (with its sharding), as `tf.Variable`
    copies its initial value, and so does `assign(x)` outside jit: a step that
    donates the variable's buffer (`apply_gradients`) never deletes the
    caller's `x`. A version whose buffer was donated raises
    `DonatedVariableError` when read.

    Args:
        initial_value: the value: an array, a number, nested lists, another
            Variable (its value is read), or a callable returning one (called
            once). A jax.Array is copied with its sharding.
        name: the name before uniquification (default ``"Variable"``); the
            enclosing `name_scope` prefixes it and the registry appends ``_1``,
            ``_2``... to a name already taken. Checkpoints of TF1's Saver match
            variables by it.
        trainable: whether optimizers update it and gradients reach it; None
            (default) means True unless `synchronization` is ON_READ.
        dtype: the dtype to convert `initial_value` to; None keeps its own.
        synchronization: a `VariableSynchronization` or its name (``"on_read"``),
            recorded for checkpoints as TF does.
        aggregation: a `VariableAggregation` or its name (``"sum"``), recorded for
            checkpoints as TF does.
        registry: the `Registry` the name is unique in; None is the default one.
        save_slice_info: the `SaveSliceInfo` of a shard of a partitioned variable
            (`PartitionedVariable` sets it); None for a whole variable.

    Raises:
        ValueError: created inside a JAX transformation (jit, grad, vmap); an
            empty name or one with ``:``; an unknown synchronization or
            aggregation name; ``trainable=True`` with ON_READ synchronization.
        TypeError: a name that is not a string, a non-bool `trainable`, or an
            `initial_value` that is not convertible to an array.

    >>> import jax, jax.numpy as jnp, varstate
    >>> v = varstate.Variable(jnp.zeros(3), name="w")
    >>> v2 = jax.jit(lambda v: v.assign_add(jnp.ones(3)))(v)
    >>> (v2.resource_id == v.resource_id, v2.value.tolist(), v.value.tolist())
    (True, [1.0, 1.0, 1.0], [0.0, 0.0, 0.0])
    >>> x = jnp.ones(2)
    >>> varstate.Variable(x).value is x
    False
    """

    __slots__ = ("_handle", "_value")

    def __init__(
        self,
        initial_value: Any,
        *,
        name: str | None = None,
        trainable: bool | None = None,
        dtype: Any = None,
        synchronization: VariableSynchronization | str = VariableSynchronization.AUTO,
        aggregation: VariableAggregation | str = VariableAggregation.NONE,
        registry: Registry | None = None,
        save_slice_info: Any = None,
    ) -> None:
        self._init(initial_value, name, trainable, dtype, synchronization, aggregation, registry, save_slice_info,
                   copy=True)

    def _init(self, initial_value, name, trainable, dtype, synchronization, aggregation, registry, save_slice_info,
              *, copy: bool, **fixed: Any) -> None:
        if in_transformation() or isinstance(initial_value, Tracer):
            raise ValueError(
                f"Variable {name or 'Variable'!r} created inside a JAX transformation "
                "(jit, grad, vmap, ...). Variables are created outside and updated inside: "
                "create it before the jitted function and pass it in as an argument."
            )
        if name is not None and not isinstance(name, str):
            raise TypeError(f"Variable name must be a string, got {type(name).__name__} {name!r}.")
        if name is not None and (not name or ":" in name):
            raise ValueError(f"Invalid variable name {name!r}: expected a non-empty string without ':'.")
        synchronization = _enum_value(VariableSynchronization, synchronization, "synchronization")
        aggregation = _enum_value(VariableAggregation, aggregation, "aggregation")
        if trainable is None:
            trainable = synchronization != VariableSynchronization.ON_READ
        elif not isinstance(trainable, (bool, np.bool_)):
            raise TypeError(f"Variable trainable must be a bool, got {type(trainable).__name__}.")
        elif trainable and synchronization == VariableSynchronization.ON_READ:
            who = "A new Variable (no name given)" if name is None else f"Variable {name!r}"
            raise ValueError(
                f"{who}: synchronization ON_READ is only allowed for non-trainable "
                "variables; pass trainable=False."
            )
        if dtype is not None:
            dtype = jnp.dtype(dtype)
        if callable(initial_value) and not isinstance(initial_value, (jax.Array, Variable)):
            initial_value = initial_value()
        value = _as_value(initial_value, dtype, f"Variable {name or 'Variable'!r} initial_value", copy)
        registry = Registry.default() if registry is None else registry
        base = _scoped(name or "Variable")
        h = _new_handle({"resource_id": _next_resource_id(), "name": base, "trainable": bool(trainable),
                         "synchronization": synchronization, "aggregation": aggregation,
                         "save_slice_info": save_slice_info, "slot_of": None, "slot_name": None, "saved_dtype": None,
                         "registry": registry, "origin": None, **fixed})
        object.__setattr__(h, "name", registry._register(h, base))  # registered once it has its id
        self._value = value
        self._handle = h

    # --- identity and metadata -------------------------------------------
    @property
    def handle(self) -> ResourceHandle:
        """The shared resource handle (static pytree data)."""
        return self._handle

    @property
    def resource_id(self) -> int:
        """Process-unique id of the resource; the same for every version."""
        return self._handle.resource_id

    @property
    def name(self) -> str:
        """The unique name given at creation, name scopes included, without TF's ``:0`` suffix."""
        return self._handle.name

    @property
    def trainable(self) -> bool:
        """Whether optimizers update it and gradients reach it."""
        return self._handle.trainable

    @property
    def synchronization(self) -> VariableSynchronization:
        """The `VariableSynchronization` given at creation."""
        return self._handle.synchronization

    @property
    def aggregation(self) -> VariableAggregation:
        """The `VariableAggregation` given at creation."""
        return self._handle.aggregation

    @property
    def save_slice_info(self):
        """`SaveSliceInfo` for a shard of a partitioned variable, else None."""
        return self._handle.save_slice_info

    def ref(self) -> ResourceHandle:
        """A hashable stand-in for this variable's resource (TF's `Variable.ref()`)."""
        return self._handle

    # --- value ------------------------------------------------------------
    @property
    def value(self) -> Any:
        """The current value, a jax.Array (a tracer under jit) or a ShapeDtypeStruct if uninitialized.

        Read-only: `assign` returns a new version (setting it raises AttributeError).

        Raises:
            DonatedVariableError: a jitted step donated this version's buffer.
        """
        if _read_hook is not None:
            return _read_hook(self)
        value = self._value
        if type(value) is ArrayImpl and value.is_deleted():
            raise donated_error(f"Variable {self.name!r}")
        return value

    @value.setter
    def value(self, new_value: Any) -> None:
        raise AttributeError(
            f"Variable {self.name!r}: .value cannot be set; a Variable is immutable and assign returns the new "
            "version: `v = v.assign(new_value)` (inside jit too)."
        )

    @property
    def is_initialized(self) -> bool:
        """False for a Variable made by `uninitialized` (its value a ShapeDtypeStruct) until it gets a value."""
        return not isinstance(self._value, jax.ShapeDtypeStruct)

    @property
    def shape(self) -> tuple[int, ...]:
        """The value's shape, a tuple of ints."""
        return tuple(self._value.shape)

    @property
    def dtype(self) -> np.dtype:
        """The value's dtype."""
        return self._value.dtype

    @property
    def ndim(self) -> int:
        """The value's number of dimensions."""
        return len(self._value.shape)

    @property
    def size(self) -> int:
        """The value's number of elements."""
        return int(np.prod(self._value.shape, dtype=np.int64))

    @property
    def sharding(self) -> Any:
        """The value's sharding (None under tracing or when unknown)."""
        return getattr(self._value, "sharding", None)

    def read_value(self) -> Any:
        """The value, a jax.Array (TF's `read_value`); `value` reads the same.

        Raises:
            ValueError: the variable is uninitialized (see `uninitialized`).
            DonatedVariableError: a jitted step donated this version's buffer.
        """
        value = self._value
        if type(value) is ArrayImpl:  # the common case first: one type test (operators read through here)
            if value.is_deleted():
                raise donated_error(f"Variable {self.name!r}")
        elif isinstance(value, jax.ShapeDtypeStruct):
            raise ValueError(
                f"Variable {self.name!r} is uninitialized (shape {self.shape}, {self.dtype}): "
                "initialize it with varstate.zero_initializer(v), v.assign(...), or restore a checkpoint."
            )
        return value if _read_hook is None else _read_hook(self)

    # --- new versions -----------------------------------------------------
    def _checked(self, value: Any, op: str) -> Any:
        value = _unwrap(value)
        dtype = self.dtype
        if isinstance(value, (int, float, complex, bool, list, tuple)):
            value = _as_value(value, dtype, f"Variable {self.name!r}.{op}")
        elif not hasattr(value, "shape") or not hasattr(value, "dtype") or isinstance(value, jax.ShapeDtypeStruct):
            raise TypeError(f"Variable {self.name!r}.{op}: expected an array, got {type(value).__name__}.")
        elif isinstance(value, (np.ndarray, np.generic)) and np.can_cast(value.dtype, dtype, "same_kind"):
            given = value
            value = jnp.asarray(value, dtype)  # as TF converts a numpy value (float64 -> float32)
            _check_lossless(given, value, f"Variable {self.name!r}.{op}")  # an int64 wrapped into int32: refused
        elif value.dtype != dtype:
            raise TypeError(
                f"Variable {self.name!r}.{op}: dtype mismatch: the variable is {dtype}, "
                f"the value is {value.dtype}. Cast it first with .astype({dtype})."
            )
        if tuple(value.shape) != self.shape:
            raise ValueError(
                f"Variable {self.name!r}.{op}: shape mismatch: the variable has shape {self.shape}, "
                f"the value has shape {tuple(value.shape)}."
            )
        given = value
        value = jnp.asarray(value)
        sharding = self.sharding
        if sharding is not None and not isinstance(value, Tracer) and value.sharding != sharding:
            # Keep the variable where it lives (mesh shards stay shards).
            value = jax.device_put(value, sharding)
        if value is given and type(value) is ArrayImpl:
            value = _copy(value)  # as Variable(x): a donated step must not delete the caller's array
        return value

    def _with_value(self, value: Any) -> Variable:
        return version(value, self._handle)

    def assign(self, value: _Value) -> Variable:
        """A new version holding `value`, with this variable's identity; this version is unchanged.

        Args:
            value: an array of the variable's shape and dtype (a Python number
                or numpy value is converted); a concrete jax.Array is copied.

        Returns:
            The new Variable version.

        Raises:
            TypeError: `value` is not an array, or its dtype differs (a numpy
                value of the same kind is converted, as TF does).
            ValueError: its shape differs from the variable's.
        """
        return version(self._checked(value, "assign"), self._handle)

    def assign_add(self, delta: _Value) -> Variable:
        """A new version holding ``value + delta`` (TF's `assign_add`).

        Args:
            delta: an array of the variable's shape and dtype.

        Returns:
            The new Variable version.

        Raises:
            TypeError: `delta` is not an array, or its dtype differs (a numpy
                value of the same kind is converted, as TF does).
            ValueError: its shape differs from the variable's.
        """
        return version(self.read_value() + self._checked(delta, "assign_add"), self._handle)

    def assign_sub(self, delta: _Value) -> Variable:
        """A new version holding ``value - delta`` (TF's `assign_sub`).

        Args:
            delta: an array of the variable's shape and dtype.

        Returns:
            The new Variable version.

        Raises:
            TypeError: `delta` is not an array, or its dtype differs (a numpy
                value of the same kind is converted, as TF does).
            ValueError: its shape differs from the variable's.
        """
        return version(self.read_value() - self._checked(delta, "assign_sub"), self._handle)

    def _scatter(self, sparse_delta: Any, op: str) -> Variable:
        return version(_scatter.scatter(self, sparse_delta, op), self._handle)

    def scatter_add(self, sparse_delta: IndexedSlices) -> Variable:
        """A new version with the rows of `sparse_delta` added (TF's `scatter_add`; duplicates accumulate).

        Args:
            sparse_delta: `IndexedSlices` whose ``values`` have shape
                ``indices.shape + variable.shape[1:]`` and the variable's dtype.

        Returns:
            The new Variable version.

        Raises:
            TypeError: `sparse_delta` is not IndexedSlices, its indices are not
                integers or its values have another dtype.
            ValueError: the variable is a scalar, or the values' shape is wrong.
            IndexError: an index is out of range (checked outside jit; under
                jit out-of-range rows are dropped).
        """
        return self._scatter(sparse_delta, "scatter_add")

    def scatter_sub(self, sparse_delta: IndexedSlices) -> Variable:
        """A new version with the rows of `sparse_delta` subtracted (TF's `scatter_sub`; duplicates accumulate).

        Args:
            sparse_delta: `IndexedSlices` whose ``values`` have shape
                ``indices.shape + variable.shape[1:]`` and the variable's dtype.

        Returns:
            The new Variable version.

        Raises:
            TypeError: `sparse_delta` is not IndexedSlices, its indices are not
                integers or its values have another dtype.
            ValueError: the variable is a scalar, or the values' shape is wrong.
            IndexError: an index is out of range (checked outside jit; under
                jit out-of-range rows are dropped).
        """
        return self._scatter(sparse_delta, "scatter_sub")

    def scatter_update(self, sparse_delta: IndexedSlices) -> Variable:
        """A new version with the rows of `sparse_delta` written over (TF's `scatter_update`).

        Args:
            sparse_delta: `IndexedSlices` whose ``values`` have shape
                ``indices.shape + variable.shape[1:]`` and the variable's dtype.

        Returns:
            The new Variable version.

        Raises:
            TypeError: `sparse_delta` is not IndexedSlices, its indices are not
                integers or its values have another dtype.
            ValueError: the variable is a scalar, or the values' shape is wrong.
            IndexError: an index is out of range (checked outside jit; under
                jit out-of-range rows are dropped).
        """
        return self._scatter(sparse_delta, "scatter_update")

    # TF's other scatters and gathers: the rules (order of duplicates, checks, jit) are in _scatter.py's docstring.
    def scatter_max(self, sparse_delta: IndexedSlices) -> Variable:
        """A new version whose rows at `sparse_delta.indices` are the elementwise max with its values (TF's).

        As TF's kernel, an element is replaced only by a strictly greater
        update, one duplicate after another: a NaN in the variable stays, a NaN
        update is ignored, and of equal zeros (-0.0, +0.0) the first one wins
        (`scatter_min` and the `scatter_nd_` ones alike).

        Args:
            sparse_delta: `IndexedSlices` whose ``values`` have shape
                ``indices.shape + variable.shape[1:]`` and the variable's dtype.

        Returns:
            The new Variable version.

        Raises:
            TypeError, ValueError, IndexError: as `scatter_add`.

        >>> import jax.numpy as jnp, varstate
        >>> v = varstate.Variable(jnp.array([1.0, 5.0, 2.0]))
        >>> v.scatter_max(varstate.IndexedSlices(jnp.array([3.0, 4.0, 9.0]), jnp.array([0, 1, 0]))).numpy()
        array([9., 5., 2.], dtype=float32)
        """
        return self._scatter(sparse_delta, "scatter_max")

    def scatter_min(self, sparse_delta: IndexedSlices) -> Variable:
        """A new version whose rows at `sparse_delta.indices` are the elementwise min with its values (TF's).

        Takes, returns and raises as `scatter_max`.

        >>> import jax.numpy as jnp, varstate
        >>> v = varstate.Variable(jnp.array([1.0, 5.0, 2.0]))
        >>> v.scatter_min(varstate.IndexedSlices(jnp.array([3.0, 4.0]), jnp.array([0, 1]))).numpy()
        array([1., 4., 2.], dtype=float32)
        """
        return self._scatter(sparse_delta, "scatter_min")

    def scatter_mul(self, sparse_delta: IndexedSlices) -> Variable:
        """A new version whose rows at `sparse_delta.indices` are multiplied by its values (TF's `scatter_mul`).

        Duplicate indices multiply one after another in index order, as TF's
        kernel does (rounding as TF's, bit for bit).

        Takes, returns and raises as `scatter_max`.

        >>> import jax.numpy as jnp, varstate
        >>> v = varstate.Variable(jnp.array([1.0, 5.0]))
        >>> v.scatter_mul(varstate.IndexedSlices(jnp.array([3.0, 2.0]), jnp.array([0, 0]))).numpy()
        array([6., 5.], dtype=float32)
        """
        return self._scatter(sparse_delta, "scatter_mul")

    def scatter_div(self, sparse_delta: IndexedSlices) -> Variable:
        """A new version whose rows at `sparse_delta.indices` are divided by its values (TF's `scatter_div`).

        Duplicate indices divide one after another in index order, as TF's
        kernel does (bit for bit); an integer quotient truncates toward zero.

        Takes, returns and raises as `scatter_max`.

        >>> import jax.numpy as jnp, varstate
        >>> v = varstate.Variable(jnp.array([12.0, 5.0]))
        >>> v.scatter_div(varstate.IndexedSlices(jnp.array([3.0, 2.0]), jnp.array([0, 0]))).numpy()
        array([2., 5.], dtype=float32)
        """
        return self._scatter(sparse_delta, "scatter_div")

    def _scatter_nd(self, indices: Any, updates: Any, op: str) -> Variable:
        return version(_scatter.scatter_nd(self, indices, updates, op), self._handle)

    def scatter_nd_add(self, indices: Any, updates: Any) -> Variable:
        """A new version with `updates` added at `indices` (TF's `scatter_nd_add`; duplicates accumulate).

        Args:
            indices: integers of shape ``(..., K)``: each row addresses the
                first K dimensions of the variable (1 <= K <= rank).
            updates: shape ``indices.shape[:-1] + variable.shape[K:]``, the
                variable's dtype (a Python or numpy value is converted).

        Returns:
            The new Variable version.

        Raises:
            TypeError: indices are not integers, or updates have another dtype.
            ValueError: the variable is a scalar, K is out of 1..rank, or the
                updates' shape is wrong.
            IndexError: an index is out of range (checked outside jit; under
                jit out-of-range updates are dropped).

        >>> import jax.numpy as jnp, varstate
        >>> v = varstate.Variable(jnp.zeros((2, 2)))
        >>> v.scatter_nd_add(jnp.array([[0, 1], [1, 0], [0, 1]]), jnp.array([1.0, 2.0, 3.0])).numpy()
        array([[0., 4.],
               [2., 0.]], dtype=float32)
        """
        return self._scatter_nd(indices, updates, "scatter_nd_add")

    def scatter_nd_sub(self, indices: Any, updates: Any) -> Variable:
        """A new version with `updates` subtracted at `indices` (TF's `scatter_nd_sub`; duplicates accumulate).

        Takes, returns and raises as `scatter_nd_add`.

        >>> import jax.numpy as jnp, varstate
        >>> v = varstate.Variable(jnp.ones((2, 2)))
        >>> v.scatter_nd_sub(jnp.array([[1]]), jnp.array([[1.0, 2.0]])).numpy()
        array([[ 1.,  1.],
               [ 0., -1.]], dtype=float32)
        """
        return self._scatter_nd(indices, updates, "scatter_nd_sub")

    def scatter_nd_update(self, indices: Any, updates: Any) -> Variable:
        """A new version with `updates` written at `indices` (TF's `scatter_nd_update`).

        Takes, returns and raises as `scatter_nd_add`.

        >>> import jax.numpy as jnp, varstate
        >>> v = varstate.Variable(jnp.zeros((2, 2)))
        >>> v.scatter_nd_update(jnp.array([[1, 1]]), jnp.array([7.0])).numpy()
        array([[0., 0.],
               [0., 7.]], dtype=float32)
        """
        return self._scatter_nd(indices, updates, "scatter_nd_update")

    def scatter_nd_max(self, indices: Any, updates: Any) -> Variable:
        """A new version holding the elementwise max with `updates` at `indices` (TF's `scatter_nd_max`).

        Takes, returns and raises as `scatter_nd_add`.

        >>> import jax.numpy as jnp, varstate
        >>> v = varstate.Variable(jnp.array([[1.0, 5.0]]))
        >>> v.scatter_nd_max(jnp.array([[0, 0], [0, 1]]), jnp.array([3.0, 4.0])).numpy()
        array([[3., 5.]], dtype=float32)
        """
        return self._scatter_nd(indices, updates, "scatter_nd_max")

    def scatter_nd_min(self, indices: Any, updates: Any) -> Variable:
        """A new version holding the elementwise min with `updates` at `indices` (TF's `scatter_nd_min`).

        Takes, returns and raises as `scatter_nd_add`.

        >>> import jax.numpy as jnp, varstate
        >>> v = varstate.Variable(jnp.array([[1.0, 5.0]]))
        >>> v.scatter_nd_min(jnp.array([[0, 0], [0, 1]]), jnp.array([3.0, 4.0])).numpy()
        array([[1., 4.]], dtype=float32)
        """
        return self._scatter_nd(indices, updates, "scatter_nd_min")

    def sparse_read(self, indices: Any) -> Any:
        """The rows at `indices`, an array of shape ``indices.shape + shape[1:]`` (TF's `sparse_read`).

        Args:
            indices: integers indexing the first dimension.

        Returns:
            The gathered rows (under jit, an out-of-range row reads as zeros).

        Raises:
            TypeError: indices are not integers.
            ValueError: the variable is a scalar.
            IndexError: an index is out of range (checked outside jit).

        >>> import jax.numpy as jnp, varstate
        >>> varstate.Variable(jnp.arange(6.0).reshape(3, 2)).sparse_read(jnp.array([2, 0])).tolist()
        [[4.0, 5.0], [0.0, 1.0]]
        """
        return _scatter.sparse_read(self, indices)

    def gather_nd(self, indices: Any) -> Any:
        """The slices the rows of `indices` address, shape ``indices.shape[:-1] + shape[K:]`` (TF's `gather_nd`).

        Args:
            indices: integers of shape ``(..., K)``, each row addressing the
                first K dimensions (1 <= K <= rank).

        Returns:
            The gathered slices (under jit, an out-of-range one reads as zeros).

        Raises:
            TypeError: indices are not integers.
            ValueError: the variable is a scalar, or K is out of 1..rank.
            IndexError: an index is out of range (checked outside jit).

        >>> import jax.numpy as jnp, varstate
        >>> varstate.Variable(jnp.arange(6.0).reshape(3, 2)).gather_nd(jnp.array([[2, 1], [0, 0]])).tolist()
        [5.0, 0.0]
        """
        return _scatter.gather_nd(self, indices)

    def get_shape(self) -> tuple[int, ...]:
        """The shape, as `shape` gives it: a tuple of ints (TF's `get_shape`, whose TensorShape compares equal).

        >>> import varstate
        >>> varstate.Variable([[1.0, 2.0]]).get_shape()
        (1, 2)
        """
        return self.shape

    @property
    def device(self) -> str:
        """The device the value lives on, in TF's naming (``"/job:localhost/replica:0/task:P/device:CPU:N"``).

        P is the JAX process index and N the device's index among that
        process's devices of its platform (``CPU``, ``GPU``, ``TPU``); for a
        value sharded over several devices, the lowest-numbered one (as a
        distributed TF variable names its first replica's). ``""`` when
        unknown: under jit, or for an uninitialized variable without a sharding.

        >>> import varstate
        >>> varstate.Variable(1.0).device
        '/job:localhost/replica:0/task:0/device:CPU:0'
        """
        return _scatter.device(self)

    def __len__(self) -> int:
        if not self.shape:
            raise TypeError(f"len() of a scalar Variable {self.name!r}")
        return self.shape[0]

    def __repr__(self) -> str:
        if not (hasattr(self._value, "shape") and hasattr(self._value, "dtype")):
            # jax.tree.map(f, params) keeps the Variables around whatever f returns (a mask's bools, labels...).
            return f"<varstate.Variable {self.name!r} value={self._value!r}>"
        head = f"<varstate.Variable {self.name!r} shape={self.shape} dtype={self.dtype}"
        if not self.is_initialized:
            return head + " (uninitialized)>"
        if is_deleted_array(self._value):
            return head + " (donated: use the version apply_gradients returned)>"
        if isinstance(self._value, Tracer):
            return head + f" value={self._value}>"
        if jax.dtypes.issubdtype(self._value.dtype, jax.dtypes.prng_key):  # no NumPy form: show its key data
            data = np.asarray(jax.random.key_data(self._value))
            return head + f", key_data={np.array2string(data, threshold=20)}>"
        return head + f", numpy={np.array2string(np.asarray(self._value), threshold=20)}>"

    def __copy__(self) -> Variable:
        # A version is immutable: its copy is the same version (same value, same identity), as for a tuple.
        return version(self._value, self._handle)

    def __deepcopy__(self, memo: dict) -> Variable:
        # The value is copied, the identity kept (identity is the resource, not the data): a deep copy of a model
        # and its optimizer state keeps every slot linked to its primary, and saves to the same checkpoint keys.
        value = self._value
        if isinstance(value, jax.Array) and not isinstance(value, Tracer):
            value = _copy(self.read_value())
        return version(value, self._handle)


def _flatten_with_keys(v: Variable):
    return ((_VALUE_KEY, v._value if _read_hook is None else _read_hook(v)),), v._handle


_VALUE_KEY = jax.tree_util.GetAttrKey("value")

def _flatten(v: Variable):
    return (v._value if _read_hook is None else _read_hook(v),), v._handle


def _unflatten(handle: ResourceHandle, children: Any) -> Variable:
    # Runs for every Variable leaving every jitted call: kept to one frame.
    v = _new(Variable)
    (v._value,) = children
    v._handle = handle
    return v


jax.tree_util.register_pytree_with_keys(Variable, _flatten_with_keys, _unflatten, flatten_func=_flatten)


def is_resource_variable(x: Any) -> bool:
    """True for varstate Variables (TF's `resource_variable_ops.is_resource_variable`).

    Args:
        x: any object; one that sets ``_should_act_as_resource_variable`` (an
            `AutoCastVariable`) counts as a Variable, as in TF.

    Returns:
        Whether `x` is a Variable.

    >>> import varstate
    >>> varstate.is_resource_variable(varstate.Variable(1.0)), varstate.is_resource_variable(1.0)
    (True, False)
    """
    return isinstance(x, Variable) or bool(getattr(x, "_should_act_as_resource_variable", False))


def format_device(v: Any) -> str:
    """The placement of a variable for messages, ``"<device> (resource)"`` as TF names a resource's device.

    Args:
        v: a Variable (or anything with a ``sharding``).

    Returns:
        ``"<device> (resource)"`` for a variable on one device, ``"<sharding>
        (resource)"`` for one sharded over several, ``"(resource)"`` when the
        placement is unknown (no sharding, or a tracer under jit).

    >>> import varstate
    >>> varstate.format_device(varstate.Variable(1.0)).endswith("(resource)")
    True
    """
    sharding = getattr(v, "sharding", None)
    if sharding is None or isinstance(getattr(v, "value", None), Tracer):
        return "(resource)"
    devices = sharding.device_set
    return f"{next(iter(devices)) if len(devices) == 1 else sharding} (resource)"
