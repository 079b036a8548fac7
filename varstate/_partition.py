"""Partitioned variables: shards along one axis, each with TF's SaveSliceInfo."""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from varstate._registry import Registry, _scoped, outside_name_scopes
from varstate._variable import Variable


class SaveSliceInfo(NamedTuple):
    """Where a shard sits in its full variable (TF's `Variable.SaveSliceInfo`).

    Args:
        full_name: the full variable's name (TF's checkpoint key of the whole).
        full_shape: the full variable's shape.
        var_offset: where the shard starts in the full variable, per dimension.
        var_shape: the shard's shape.

    >>> SaveSliceInfo("emb", (10, 4), (0, 0), (4, 4)).spec
    '10 4 0,4:0,4'
    """

    full_name: str
    full_shape: tuple[int, ...]
    var_offset: tuple[int, ...]
    var_shape: tuple[int, ...]

    @property
    def spec(self) -> str:
        """TF's slice string, the full shape then ``start,length`` per dimension (``"10 4 0,4:0,4"``)."""
        dims = " ".join(str(d) for d in self.full_shape)
        parts = ":".join(f"{o},{s}" for o, s in zip(self.var_offset, self.var_shape, strict=True))
        return f"{dims} {parts}"

    @classmethod
    def from_spec(cls, full_name: str, spec: str) -> SaveSliceInfo:
        """Parses TF's slice string (the inverse of `spec`).

        Args:
            full_name: the full variable's name.
            spec: TF's slice string, e.g. ``"10 4 0,4:0,4"``.

        Returns:
            The SaveSliceInfo it describes.

        Raises:
            ValueError: `spec` is malformed, or its ranks disagree.
        """
        try:
            *dims, parts = spec.split(" ")
            full_shape = tuple(int(d) for d in dims)
            # ``start,length`` pairs transposed; a pair of another length fails the unpacking, or zip's strictness.
            offset, shape = zip(*(map(int, p.split(",")) for p in parts.split(":")), strict=True)
        except ValueError:
            raise ValueError(f"Invalid slice spec {spec!r} for {full_name!r}: expected e.g. '10 4 0,4:0,4'.") from None
        if len(offset) != len(full_shape):
            raise ValueError(f"Invalid slice spec {spec!r} for {full_name!r}: rank mismatch.")
        return cls(full_name, full_shape, offset, shape)


def fixed_size_partitioner(num_shards: int, axis: int = 0):
    """A partitioner making `num_shards` shards (fewer if the axis is shorter), as TF's.

    Args:
        num_shards: how many shards to make (a positive int).
        axis: the axis to split.

    Returns:
        A partitioner ``f(shape, dtype) -> list of shard counts per axis`` for
        `PartitionedVariable`.

    Raises:
        ValueError: `num_shards` is not a positive int.

    >>> fixed_size_partitioner(3)((2, 5), "float32")
    [2, 1]
    """
    if not isinstance(num_shards, int) or num_shards < 1:
        raise ValueError(f"fixed_size_partitioner: num_shards must be a positive int, got {num_shards!r}.")

    def partitioner(shape: Sequence[int], dtype: Any) -> list[int]:
        return _split_along(shape, axis, min(num_shards, shape[axis]))

    return partitioner


def _split_along(shape: Sequence[int], axis: int, shards: int) -> list[int]:
    """A partitioner's answer: `shards` (at least one) along `axis`, one along every other dimension."""
    parts = [1] * len(shape)
    parts[axis] = max(1, shards)
    return parts


def variable_axis_size_partitioner(max_shard_bytes: int, axis: int = 0, max_shards: int | None = None):
    """A partitioner keeping each shard under `max_shard_bytes`, as TF's.

    Args:
        max_shard_bytes: the largest size of a shard in bytes (a positive int);
            a single row larger than it is still one shard.
        axis: the axis to split.
        max_shards: the most shards to make; None or 0 means no limit (as TF).

    Returns:
        A partitioner ``f(shape, dtype) -> list of shard counts per axis`` for
        `PartitionedVariable`.

    Raises:
        ValueError: `max_shard_bytes` is not a positive int, or `max_shards` is
            negative.

    >>> variable_axis_size_partitioner(64)((10, 4), "float32")  # 16 bytes a row: 4 rows a shard
    [3, 1]
    """
    if not isinstance(max_shard_bytes, int) or max_shard_bytes < 1:
        raise ValueError(
            f"variable_axis_size_partitioner: max_shard_bytes must be a positive int, got {max_shard_bytes!r}."
        )
    if max_shards is not None and max_shards < 0:  # as TF, 0 (like None) means no limit
        raise ValueError(f"variable_axis_size_partitioner: max_shards must be positive, got {max_shards!r}.")

    def partitioner(shape: Sequence[int], dtype: Any) -> list[int]:
        row_bytes = math.prod(d for i, d in enumerate(shape) if i != axis) * jnp.dtype(dtype).itemsize
        rows_per_shard = max(1, max_shard_bytes // max(row_bytes, 1))
        shards = math.ceil(shape[axis] / rows_per_shard)
        return _split_along(shape, axis, min(max_shards, shards) if max_shards else shards)

    return partitioner


def _slices(full_name: str, full_shape: tuple[int, ...], num: int, axis: int) -> Iterator[SaveSliceInfo]:
    # TF puts the remainder rows on the first shards.
    base, excess = divmod(full_shape[axis], num)
    start = 0
    for i in range(num):
        rows = base + (i < excess)
        offset = tuple(start if d == axis else 0 for d in range(len(full_shape)))
        yield SaveSliceInfo(full_name, full_shape, offset, (*full_shape[:axis], rows, *full_shape[axis + 1 :]))
        start += rows


def _part(value: Any, info: SaveSliceInfo) -> Any:
    """The slice of the full `value` that `info` places."""
    return value[tuple(slice(o, o + s) for o, s in zip(info.var_offset, info.var_shape, strict=True))]


def _unique_full_name(registry: Registry, name: str, shards: int) -> str:
    """`name`, or ``name_1``, ``name_2``... (TF1's naming): the first whose shard names and itself are all free.

    The full name is the key a checkpoint saves the whole under: two tables sharing it would both restore from
    one tensor. It counts as taken by a variable of that name too (they would share that key).
    """
    def free(candidate: str) -> bool:
        return all(registry.unique_name(n) == n for n in (candidate, *(f"{candidate}/part_{i}" for i in range(shards))))

    candidate, i = name, 0
    while not free(candidate):
        i += 1
        candidate = f"{name}_{i}"
    return candidate


class PartitionedVariable:
    """A variable stored as several shard Variables along one axis (TF's PartitionedVariable).

    A pytree whose children are the shard Variables, named
    ``<name>/part_<i>``, each with the `SaveSliceInfo` of its slice (what TF
    checkpoints record). Iterating or indexing gives the shards.

    Args:
        initial_value: the full value (an array, or a callable returning one).
        name: the full variable's name (required; `name_scope` prefixes it).
        num_shards: split into this many shards (fewer if the axis is shorter).
        max_shard_bytes: split so that each shard stays under this many bytes.
        partitioner: ``f(shape, dtype) -> shards per axis`` (as TF's
            partitioners; only `axis` may be split). Give exactly one of
            `num_shards`, `max_shard_bytes` and `partitioner`.
        axis: the axis to split (negative counts from the end).
        trainable: whether the shards are trainable.
        dtype: the dtype to convert `initial_value` to; None keeps its own.
        registry: the `Registry` of the shards' names; None is the default one.
        sharding: where to place every shard (each shard split over a mesh,
            for instance; in a `jax.distributed` job a mesh of all processes'
            devices, the initial value then being a global array); None leaves
            them where the value is.

    Raises:
        TypeError: an empty or non-string name, or a `sharding` that is not a
            ``jax.sharding.Sharding``.
        ValueError: not exactly one of the three ways to split; a scalar value;
            `axis` out of range; a partitioner that splits another axis.

    >>> import jax.numpy as jnp, varstate
    >>> pv = varstate.PartitionedVariable(jnp.arange(10.0).reshape(5, 2), name="emb", num_shards=2,
    ...                                   registry=varstate.Registry())
    >>> [v.name for v in pv], [v.shape for v in pv], pv[0].save_slice_info.spec
    (['emb/part_0', 'emb/part_1'], [(3, 2), (2, 2)], '5 2 0,3:0,2')
    >>> bool((pv.as_array() == jnp.arange(10.0).reshape(5, 2)).all())
    True
    """

    __slots__ = ("_axis", "_dtype", "_name", "_shape", "_variables")

    def __init__(
        self,
        initial_value: Any,
        *,
        name: str,
        num_shards: int | None = None,
        max_shard_bytes: int | None = None,
        partitioner: Any = None,
        axis: int = 0,
        trainable: bool = True,
        dtype: Any = None,
        registry: Any = None,
        sharding: jax.sharding.Sharding | None = None,
    ) -> None:
        if not isinstance(name, str) or not name:
            raise TypeError(f"PartitionedVariable name must be a non-empty string, got {name!r}.")
        if sharding is not None and not isinstance(sharding, jax.sharding.Sharding):
            raise TypeError(f"PartitionedVariable {name!r}: sharding must be a jax.sharding.Sharding (each shard is "
                            f"placed on it), got {type(sharding).__name__}.")
        if sum(x is not None for x in (num_shards, max_shard_bytes, partitioner)) != 1:
            raise ValueError(
                f"PartitionedVariable {name!r}: give exactly one of num_shards, max_shard_bytes or partitioner."
            )
        value = jnp.asarray(initial_value() if callable(initial_value) else initial_value, dtype=dtype)
        if value.ndim == 0:
            raise ValueError(f"PartitionedVariable {name!r}: cannot partition a scalar.")
        if not -value.ndim <= axis < value.ndim:
            raise ValueError(f"PartitionedVariable {name!r}: axis {axis} is out of range for shape {value.shape}.")
        axis %= value.ndim
        if num_shards is not None:
            partitioner = fixed_size_partitioner(num_shards, axis)
        elif max_shard_bytes is not None:
            partitioner = variable_axis_size_partitioner(max_shard_bytes, axis)
        parts = list(partitioner(value.shape, value.dtype))
        if len(parts) != value.ndim or any(p != 1 for i, p in enumerate(parts) if i != axis):
            raise ValueError(
                f"PartitionedVariable {name!r}: partitioner returned {parts}; only axis {axis} "
                f"may be split for shape {value.shape}."
            )
        registry = Registry.default() if registry is None else registry
        scoped = _scoped(name)  # the shards are named from the full name, scopes included, outside them
        with registry._lock, outside_name_scopes():  # the name found free stays free until the shards take it
            full_name = _unique_full_name(registry, scoped, parts[axis])
            self._variables = tuple(
                Variable(_part(value, info) if sharding is None else jax.device_put(_part(value, info), sharding),
                         name=f"{full_name}/part_{i}", trainable=trainable, save_slice_info=info, registry=registry)
                for i, info in enumerate(_slices(full_name, value.shape, parts[axis], axis))
            )
        self._name, self._shape, self._dtype, self._axis = full_name, value.shape, value.dtype, axis

    @classmethod
    def _from_shards(cls, shards: Iterable[Variable], meta: tuple) -> PartitionedVariable:
        pv = object.__new__(cls)
        pv._variables = tuple(shards)
        pv._name, pv._shape, pv._dtype, pv._axis = meta
        return pv

    @property
    def name(self) -> str:
        """The full variable's name, scopes included (the shards' names add ``/part_<i>``)."""
        return self._name

    @property
    def shape(self) -> tuple[int, ...]:
        """The full variable's shape."""
        return self._shape

    @property
    def dtype(self) -> np.dtype:
        """The dtype of every shard."""
        return self._dtype

    @property
    def variables(self) -> list[Variable]:
        """The shard Variables, in order along the axis."""
        return list(self._variables)

    def __iter__(self) -> Iterator[Variable]:
        return iter(self._variables)

    def __len__(self) -> int:
        return len(self._variables)

    def __getitem__(self, i: int) -> Variable:
        return self._variables[i]

    def as_array(self) -> jax.Array:
        """The full value, shards concatenated along the partition axis."""
        return jnp.concatenate([v.read_value() for v in self._variables], axis=self._axis)

    def assign(self, value: Any) -> PartitionedVariable:
        """A new version holding `value`, re-sliced into the same shards (each shard's `Variable.assign`).

        Args:
            value: the full value, of the full variable's shape.

        Returns:
            The new PartitionedVariable version (same shards' identities).

        Raises:
            ValueError: `value` has another shape.
        """
        value = jnp.asarray(value)
        if tuple(value.shape) != self._shape:
            raise ValueError(
                f"PartitionedVariable {self._name!r}.assign: shape mismatch: the variable has shape "
                f"{self._shape}, the value has shape {tuple(value.shape)}."
            )
        new = [v.assign(_part(value, v.save_slice_info)) for v in self._variables]
        return self._from_shards(new, (self._name, self._shape, self._dtype, self._axis))

    def __repr__(self) -> str:
        return (
            f"<varstate.PartitionedVariable {self._name!r} shape={self._shape} dtype={self._dtype} "
            f"shards={[v.shape[self._axis] for v in self._variables]}>"
        )


jax.tree_util.register_pytree_with_keys(
    PartitionedVariable,
    lambda pv: (
        tuple((jax.tree_util.SequenceKey(i), v) for i, v in enumerate(pv._variables)),
        (pv._name, pv._shape, pv._dtype, pv._axis),
    ),
    lambda meta, shards: PartitionedVariable._from_shards(shards, meta),
    flatten_func=lambda pv: (pv._variables, (pv._name, pv._shape, pv._dtype, pv._axis)),
)


def expand_variables(var_list: Iterable[Any] | None) -> list[Any] | None:
    """Replaces each PartitionedVariable in `var_list` by its shards (TF's expanded list).

    Args:
        var_list: an iterable of Variables and PartitionedVariables, or None.

    Returns:
        A list with each PartitionedVariable replaced by its shards in order;
        None for None.

    >>> import jax.numpy as jnp, varstate
    >>> r = varstate.Registry()
    >>> pv = varstate.PartitionedVariable(jnp.zeros((4, 2)), name="p", num_shards=2, registry=r)
    >>> [v.name for v in varstate.expand_variables([pv, varstate.Variable(1.0, name="b", registry=r)])]
    ['p/part_0', 'p/part_1', 'b']
    """
    if var_list is None:
        return None
    return [x for v in var_list for x in (v if isinstance(v, PartitionedVariable) else [v])]
