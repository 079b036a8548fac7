"""Walking pytrees the way TF walks trackables, shared by save and restore.

`children(obj)` names an object's direct dependencies the way TF names them
(dict key, field name, list index); `kind(obj)` says whether it is a
container, a variable, a plain array, a Python scalar or an optimizer state;
`rebuild` makes a new object of the same structure from new children.

flax nnx: a Module's children are those of its `nnx.State` (each shared
Variable once), and an nnx Variable stands for its value (nnx's ``value``
level is no node), so a Module is named as TF names a tf.Module of the same
attributes. A PRNG key array is saved as its key data.
"""

from __future__ import annotations

import enum
import sys
from typing import Any, cast

import jax
import numpy as np

from checkpoint import _keys
from checkpoint._dtypes import PYTHON_TYPES
from varstate import Packed, PartitionedVariable, Variable, _seam
from varstate.optimizers import OptimizerState

PLAIN_SLOTS = "slots"  # the optimizer's child holding the slots of plain-array params



class Kind(enum.IntEnum):
    """What a node of the walk is, which decides how it is saved and matched."""

    CONTAINER = 0  # a pytree whose children are nodes
    VARIABLE = 1
    PARTITIONED = 2
    ARRAY = 3  # a plain array: a value without a resource
    PYTHON = 4  # a bool, int, float or str
    OPTIMIZER = 5  # an OptimizerState: non-slots as children, slots hung off their primaries
    NONE = 6  # None: no node


VALUES = (Kind.VARIABLE, Kind.PARTITIONED, Kind.ARRAY, Kind.PYTHON)  # the kinds that are one stored value
_ARRAYS = (jax.Array, np.ndarray, np.generic, jax.ShapeDtypeStruct)
_PYTHON = tuple(PYTHON_TYPES.values())


def as_variable(obj: Any) -> Variable | None:
    """The Variable behind `obj`: itself, or a wrapper's (`__varstate_variable__`)."""
    if isinstance(obj, Variable):
        return obj
    get = getattr(type(obj), "__varstate_variable__", None)
    return get(obj) if get is not None else None


def variable_of(obj: Any) -> Variable:
    """The Variable behind a node already walked as a variable (`kind` found one: `as_variable` is not None)."""
    return cast(Variable, as_variable(obj))


def _nnx() -> Any:
    """flax.nnx if it was imported (only then can an object be nnx's); never imports flax itself."""
    return sys.modules.get("flax.nnx")


def is_prng_key(value: Any) -> bool:
    """True for a typed PRNG key array (``jax.random.key``), or a ShapeDtypeStruct of one."""
    dtype = getattr(value, "dtype", None)
    if isinstance(dtype, np.dtype):  # every numeric dtype (bfloat16 too): a key's dtype is jax's extended dtype
        return False
    return isinstance(value, (jax.Array, jax.ShapeDtypeStruct)) and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


def key_impl(value: Any) -> str:
    """The name of a PRNG key array's implementation (``threefry2x32``), as `jax.random.wrap_key_data` takes it."""
    if isinstance(value, jax.ShapeDtypeStruct):
        found: list[str] = []  # an abstract key: its dtype knows, asked while tracing

        def record(k: Any) -> int:
            found.append(str(jax.random.key_impl(k)))
            return 0

        jax.eval_shape(record, value)
        return found[0]
    return str(jax.random.key_impl(value))


def unwrap(obj: Any) -> Any:
    """An nnx Variable's value (nnx's ``value`` level is not a node); anything else as it is."""
    nnx = _nnx()
    if nnx is not None and isinstance(obj, nnx.Variable):
        return obj.get_value()
    return obj


def is_nnx_module(obj: Any) -> bool:
    nnx = _nnx()
    return nnx is not None and isinstance(obj, nnx.Module)


def nnx_split(obj: Any) -> tuple[Any, Any] | None:
    """(graphdef, state) of an nnx Module (`nnx.split`), else None; `nnx_merge` puts them back together."""
    return _nnx().split(obj) if is_nnx_module(obj) else None


def nnx_merge(graphdef: Any, state: Any) -> Any:
    return _nnx().merge(graphdef, state)


def kind(obj: Any) -> Kind:
    if obj is None:
        return Kind.NONE
    if isinstance(obj, OptimizerState):
        return Kind.OPTIMIZER
    if as_variable(obj) is not None:
        return Kind.VARIABLE
    if isinstance(obj, PartitionedVariable):
        return Kind.PARTITIONED
    if isinstance(obj, _ARRAYS):
        return Kind.ARRAY
    if isinstance(obj, _PYTHON):
        return Kind.PYTHON
    return Kind.CONTAINER


def leaves(obj: Any, where: str) -> list[Any]:
    """`jax.tree.leaves(obj)`, with a message naming `where` and the keys when a dict's keys do not sort."""
    try:
        return jax.tree.leaves(obj)
    except ValueError:
        _check_sortable(obj, where)
        raise


def _check_sortable(obj: Any, where: str) -> None:
    """A ValueError naming the dict and keys if JAX cannot flatten `obj` because a dict's keys do not sort.

    Asked once JAX has failed, whose own error ("Comparator raised exception while sorting pytree dictionary
    keys") names neither.
    """
    try:
        jax.tree_util.tree_structure(obj)
    except ValueError:
        found = _unsortable_dict(obj, ())
        if found is None:  # another ValueError (a custom pytree's flatten): JAX's own says more
            raise
        path, (a, b) = found
        at = f"its dict at {'.'.join(path)} has" if path else "it is a dict with"
        same = f" Both would be saved as the child {str(a)!r}, so rename one as well." if str(a) == str(b) else ""
        raise ValueError(
            f"Cannot checkpoint {where}: {at} keys {a!r} ({type(a).__name__}) and {b!r} ({type(b).__name__}), "
            "which JAX cannot sort to flatten the dict (it orders a dict's children by key, and these do not "
            f"compare). Use keys of one type, e.g. all str ({{str(k): v for k, v in d.items()}}).{same}"
        ) from None


def _unsortable_dict(obj: Any, path: tuple[str, ...]) -> tuple[tuple[str, ...], tuple[Any, Any]] | None:
    """(local names leading to it, two keys) for the first dict in `obj` whose keys JAX cannot sort, or None."""
    try:
        pairs, _ = jax.tree_util.tree_flatten_with_path(obj, is_leaf=lambda x: x is not obj)
    except ValueError:
        clash = _clashing_keys(list(obj)) if isinstance(obj, dict) else None
        return None if clash is None else (path, clash)
    for entry, child in pairs:
        if entry:  # an empty path: `obj` is a leaf
            found = _unsortable_dict(child, (*path, _keys.local_name(entry[0])))
            if found is not None:
                return found
    return None


def _clashing_keys(keys: list[Any]) -> tuple[Any, Any] | None:
    """Two of `keys` that do not compare, or None (one key of each type is tried, so a large dict costs little)."""
    first_of: dict[type, Any] = {}
    for k in keys:
        first_of.setdefault(type(k), k)
    firsts = list(first_of.values())
    for i, a in enumerate(firsts):
        for b in firsts[i + 1:]:
            try:
                _ = a < b, b < a
            except TypeError:
                return a, b
    return None


def children(obj: Any, where: str = "an object") -> list[tuple[str, Any]]:
    """An object's direct dependencies as (local name, child), in pytree order."""
    if isinstance(obj, OptimizerState):
        # Slot Variables hang off their primaries (slot_variables); non-slots are children.
        kids = list(obj.non_slots.items())
        plain = plain_slots(obj)
        if jax.tree.leaves(plain):
            kids.append((PLAIN_SLOTS, plain))
        return kids
    if is_nnx_module(obj):  # as its nnx.State: shared Variables once each
        obj = _nnx().state(obj)
    if isinstance(obj, Packed):  # as its params, each variable under its own key (`varstate.pack`)
        obj = obj.unpack()
    pairs, _ = _flatten_one(obj, where)
    return [(_keys.local_name(path[0]), unwrap(child)) for path, child in pairs]


def _flatten_one(obj: Any, where: str) -> tuple[list, Any]:
    """One level of a container's pytree; a ValueError naming `where` if `obj` is a leaf of no supported kind."""
    try:
        pairs, treedef = jax.tree_util.tree_flatten_with_path(obj, is_leaf=lambda x: x is not obj)
    except ValueError:
        _check_sortable(obj, where)
        raise
    if pairs and not pairs[0][0]:
        raise ValueError(
            f"Cannot checkpoint {where}: {type(obj).__name__} {obj!r:.60} is not a Variable, PartitionedVariable, "
            "OptimizerState, array, Python bool/int/float/str or a pytree of them. Leave it out of the roots, or "
            "register its type as a pytree (e.g. jax.tree_util.register_dataclass)."
        )
    return pairs, treedef


def _slot_leaf(x: Any) -> bool:
    return x is None or isinstance(x, (Variable, PartitionedVariable))


def plain_slots(state: OptimizerState) -> Any:
    """The slots of plain-array params (no resource to link): `slots` with every slot Variable as None.

    They are saved as the optimizer's child ``slots`` (not in TF, which has no
    plain-array params); a state with only slot Variables has none.
    """
    return jax.tree.map(lambda x: None if _slot_leaf(x) else x, state.slots, is_leaf=_slot_leaf)


def merge_slots(template: Any, variable_slots, plain: Any) -> Any:
    """`template` (an OptimizerState's slots) with slot Variables from `variable_slots(v)`, the rest from `plain`."""

    def one(leaf: Any, p: Any) -> Any:
        if isinstance(leaf, Variable):
            return variable_slots(leaf)
        if isinstance(leaf, PartitionedVariable):
            return jax.tree.map(variable_slots, leaf, is_leaf=lambda x: isinstance(x, Variable))
        return leaf if leaf is None else p

    return jax.tree.map(one, template, plain, is_leaf=_slot_leaf)


def rebuild(obj: Any, fn, where: str = "an object") -> Any:
    """`obj` with each direct child replaced by `fn(local_name, child)`; an nnx Module or State comes back new."""
    parts = nnx_split(obj)
    if parts is not None:  # a new Module from the new state: shared Variables stay shared, as nnx.merge keeps them
        return nnx_merge(parts[0], rebuild(parts[1], fn, where))
    nnx = _nnx()
    pairs, treedef = _flatten_one(obj, where)

    def one(path, child):
        if nnx is not None and isinstance(child, nnx.Variable):  # keeps its type and metadata, new value
            return child.replace(fn(_keys.local_name(path[0]), child.get_value()))
        return fn(_keys.local_name(path[0]), child)

    return treedef.unflatten([one(path, child) for path, child in pairs])


def rewrap(obj: Any, new_variable: Variable) -> Any:
    """Puts `new_variable` back into `obj` (a Variable, or a wrapper of one)."""
    if isinstance(obj, Variable):
        return new_variable
    leaves, treedef = jax.tree_util.tree_flatten(obj, is_leaf=lambda x: isinstance(x, Variable))
    return treedef.unflatten([new_variable if isinstance(x, Variable) else x for x in leaves])


def slot_variables(state: OptimizerState) -> list[Variable]:
    """Every slot Variable of an optimizer state, once each, in pytree order.

    A variable held at two places (tied weights) has one slot, found at both
    places of the state: it is one saved value, not two shards of one.
    """
    out: dict[int, Variable] = {}
    for v in jax.tree.leaves(state.slots, is_leaf=lambda x: isinstance(x, Variable)):  # a PartitionedVariable's too
        if isinstance(v, Variable):
            out.setdefault(v.resource_id, v)
    return list(out.values())


def linked_slots(state: OptimizerState) -> list[tuple[tuple[int, str], Variable]]:
    """`slot_variables` with each slot's link: (its primary's resource id, its slot name)."""
    return [(link, v) for v in slot_variables(state) if (link := _seam.slot_link(v)) is not None]


def node_variables(obj: Any) -> list[Variable]:
    """The Variables of a node walked as a variable or a partitioned variable: itself, or its shards."""
    return list(obj) if isinstance(obj, PartitionedVariable) else [variable_of(obj)]


def identity(obj: Any, k: Kind) -> Any:
    """What makes two occurrences the same node (TF stores a variable once)."""
    if k == Kind.VARIABLE:
        return ("v", variable_of(obj).resource_id)
    if k == Kind.PARTITIONED:
        return ("p", tuple(v.resource_id for v in obj))
    if k in (Kind.CONTAINER, Kind.OPTIMIZER):
        return ("o", id(obj))
    return None  # arrays and Python values have no identity to share


def has_python(obj: Any) -> bool:
    """True if `obj` holds a Python scalar somewhere (so an otherwise empty container is still saved)."""
    return any(kind(c) == Kind.PYTHON or (kind(c) == Kind.CONTAINER and has_python(c)) for _, c in children(obj))
