"""Pytrees -> TF's TrackableObjectGraph and {checkpoint key: value}.

The walk is shared by save and restore: `children(obj)` names an object's
direct dependencies the way TF names them (dict key, field name, list index),
`kind(obj)` says whether it is a container, a variable, a plain array, a
Python scalar or an optimizer state.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any

import jax
import numpy as np

from checkpoint.protos.trackable_object_graph_pb2 import TrackableObjectGraph
from varstate._partition import PartitionedVariable
from varstate._variable import Variable
from varstate.optimizers._state import OptimizerState

OBJECT_GRAPH_KEY = "_CHECKPOINTABLE_OBJECT_GRAPH"
VARIABLE_VALUE = "VARIABLE_VALUE"
PY_STATE = "py_state"  # TF's attribute name for Python state
SAVE_COUNTER = "save_counter"
PLAIN_SLOTS = "slots"  # the optimizer's child holding the slots of plain-array params

CONTAINER, VARIABLE, PARTITIONED, ARRAY, PYTHON, OPTIMIZER, NONE = range(7)
_ARRAYS = (jax.Array, np.ndarray, np.generic, jax.ShapeDtypeStruct)
_PYTHON = (bool, int, float, str)


def python_type(value: Any) -> type:
    """The Python type a `PYTHON` value is saved as: bool, int, float or str (an IntEnum is an int)."""
    return next(t for t in _PYTHON if isinstance(value, t))


def escape(local_name: str) -> str:
    """TF's escaping of one path part: ``.`` -> ``..``, ``/`` -> ``.S``."""
    return local_name.replace(".", "..").replace("/", ".S")


def variable_key(path: str) -> str:
    return f"{path}/.ATTRIBUTES/{VARIABLE_VALUE}"


def slot_key(primary_path: str, optimizer_path: str, slot_name: str) -> str:
    return f"{primary_path}/.OPTIMIZER_SLOT/{optimizer_path}/{escape(slot_name)}/.ATTRIBUTES/{VARIABLE_VALUE}"


def as_variable(obj: Any) -> Variable | None:
    """The Variable behind `obj`: itself, or a wrapper's (`__varstate_variable__`)."""
    if isinstance(obj, Variable):
        return obj
    get = getattr(type(obj), "__varstate_variable__", None)
    return get(obj) if get is not None else None


def kind(obj: Any) -> int:
    if obj is None:
        return NONE
    if isinstance(obj, OptimizerState):
        return OPTIMIZER
    if as_variable(obj) is not None:
        return VARIABLE
    if isinstance(obj, PartitionedVariable):
        return PARTITIONED
    if isinstance(obj, _ARRAYS):
        return ARRAY
    if isinstance(obj, _PYTHON):
        return PYTHON
    return CONTAINER


def _key_name(k: Any) -> str:
    if isinstance(k, jax.tree_util.DictKey):
        return str(k.key)
    if isinstance(k, jax.tree_util.GetAttrKey):
        return k.name
    if isinstance(k, jax.tree_util.SequenceKey):
        return str(k.idx)
    if isinstance(k, jax.tree_util.FlattenedIndexKey):
        return str(k.key)
    return str(k)


def children(obj: Any, where: str = "an object") -> list[tuple[str, Any]]:
    """An object's direct dependencies as (local name, child), in pytree order."""
    if isinstance(obj, OptimizerState):
        # Slot Variables hang off their primaries (slot_variables); non-slots are children.
        kids = list(obj.non_slots.items())
        plain = plain_slots(obj)
        if jax.tree.leaves(plain):
            kids.append((PLAIN_SLOTS, plain))
        return kids
    pairs, _ = _flatten_one(obj, where)
    return [(_key_name(path[0]), child) for path, child in pairs]


def _flatten_one(obj: Any, where: str) -> tuple[list, Any]:
    """One level of a container's pytree; a ValueError naming `where` if `obj` is a leaf of no supported kind."""
    pairs, treedef = jax.tree_util.tree_flatten_with_path(obj, is_leaf=lambda x: x is not obj)
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
    leaves, treedef = jax.tree_util.tree_flatten(state.slots, is_leaf=_slot_leaf)
    return treedef.unflatten([None if _slot_leaf(x) else x for x in leaves])


def merge_slots(template: Any, variable_slots, plain: Any) -> Any:
    """`template` (an OptimizerState's slots) with slot Variables from `variable_slots(v)`, the rest from `plain`."""
    leaves, treedef = jax.tree_util.tree_flatten(template, is_leaf=_slot_leaf)
    plain_leaves = jax.tree_util.tree_flatten(plain, is_leaf=lambda x: x is None)[0]
    out = []
    for leaf, p in zip(leaves, plain_leaves, strict=True):
        if isinstance(leaf, Variable):
            out.append(variable_slots(leaf))
        elif isinstance(leaf, PartitionedVariable):
            out.append(jax.tree.map(variable_slots, leaf, is_leaf=lambda x: isinstance(x, Variable)))
        else:
            out.append(leaf if leaf is None else p)
    return treedef.unflatten(out)


def rebuild(obj: Any, fn, where: str = "an object") -> Any:
    """`obj` with each direct child replaced by `fn(local_name, child)`."""
    pairs, treedef = _flatten_one(obj, where)
    return treedef.unflatten([fn(_key_name(path[0]), child) for path, child in pairs])


def rewrap(obj: Any, new_variable: Variable) -> Any:
    """Puts `new_variable` back into `obj` (a Variable, or a wrapper of one)."""
    if isinstance(obj, Variable):
        return new_variable
    leaves, treedef = jax.tree_util.tree_flatten(obj, is_leaf=lambda x: isinstance(x, Variable))
    return treedef.unflatten([new_variable if isinstance(x, Variable) else x for x in leaves])


def slot_variables(state: OptimizerState) -> list[Variable]:
    """Every slot Variable of an optimizer state, in pytree order."""
    leaves = jax.tree.leaves(state.slots, is_leaf=lambda x: isinstance(x, (Variable, PartitionedVariable)))
    out = []
    for leaf in leaves:
        out.extend(leaf if isinstance(leaf, PartitionedVariable) else [leaf] if isinstance(leaf, Variable) else [])
    return out


def _identity(obj: Any, k: int) -> Any:
    """What makes two occurrences the same node (TF stores a variable once)."""
    if k == VARIABLE:
        return ("v", as_variable(obj).resource_id)
    if k == PARTITIONED:
        return ("p", tuple(v.resource_id for v in obj))
    if k in (CONTAINER, OPTIMIZER):
        return ("o", id(obj))
    return None  # arrays and Python values have no identity to share


@dataclasses.dataclass
class Saveable:
    """One value to store: the object, its graph node and checkpoint key."""

    key: str
    obj: Any  # Variable, PartitionedVariable (or a list of slot shards), array or Python scalar
    full_name: str
    attribute: str = VARIABLE_VALUE


@dataclasses.dataclass
class Graph:
    proto: TrackableObjectGraph
    saveables: list[Saveable]
    paths: list[str]  # node id -> path ("" for the root)


def build(roots: dict[str, Any]) -> Graph:
    """Walks `roots` breadth-first (TF's order) into a TrackableObjectGraph."""
    proto = TrackableObjectGraph()
    proto.nodes.add()  # the root: the Checkpoint itself
    paths = [""]
    labels = ["(root)"]  # TF's pretty names, for errors
    objects: list[Any] = [None]
    kinds = [CONTAINER]
    node_of: dict[Any, int] = {}
    queue = collections.deque([(0, [(name, roots[name]) for name in roots])])
    while queue:
        parent, kids = queue.popleft()
        for name, child in kids:
            k = kind(child)
            if k == NONE or (k == CONTAINER and not jax.tree.leaves(child) and not _has_python(child)):
                continue
            ident = _identity(child, k)
            node_id = node_of.get(ident) if ident is not None else None
            if node_id is None:
                node_id = len(proto.nodes)
                proto.nodes.add()
                path = f"{paths[parent]}/{escape(name)}" if parent else escape(name)
                paths.append(path)
                labels.append(f"{labels[parent]}.{name}")
                objects.append(child)
                kinds.append(k)
                if ident is not None:
                    node_of[ident] = node_id
                if k in (CONTAINER, OPTIMIZER):
                    queue.append((node_id, children(child, labels[node_id])))
            ref = proto.nodes[parent].children.add()
            ref.node_id, ref.local_name = node_id, name
    saveables = []
    for node_id in range(1, len(objects)):
        k, obj, path = kinds[node_id], objects[node_id], paths[node_id]
        if k in (VARIABLE, PARTITIONED, ARRAY, PYTHON):
            attr = PY_STATE if k == PYTHON else VARIABLE_VALUE
            key = f"{path}/.ATTRIBUTES/{attr}"
            full_name = as_variable(obj).name if k == VARIABLE else obj.name if k == PARTITIONED else path
            _add_attribute(proto.nodes[node_id], attr, full_name, key)
            saveables.append(Saveable(key, obj, full_name, attr))
    # Slots: found through their primary's resource id among all nodes, as TF
    # asks each optimizer for the slot of every variable in the graph (a slot
    # whose primary is not saved is skipped).
    primary_node = {}
    for node_id, (k, obj) in enumerate(zip(kinds, objects, strict=True)):
        if k == VARIABLE:
            primary_node[as_variable(obj).resource_id] = node_id
        elif k == PARTITIONED:
            for shard in obj:
                primary_node[shard.resource_id] = node_id
    for opt_id in [i for i, k in enumerate(kinds) if k == OPTIMIZER]:
        grouped: dict[tuple[int, str], list[Variable]] = {}
        for slot in slot_variables(objects[opt_id]):
            primary = primary_node.get(slot.handle.slot_of)
            if primary is not None:
                grouped.setdefault((primary, slot.handle.slot_name), []).append(slot)
        for (primary, slot_name), shards in sorted(grouped.items()):
            if kinds[primary] == PARTITIONED and len(shards) != len(objects[primary]):
                raise ValueError(
                    f"Cannot checkpoint the {slot_name!r} slots of {labels[primary]}: the optimizer {labels[opt_id]} "
                    f"has them for {len(shards)} of its {len(objects[primary])} shards. One value holds the slot of "
                    "the whole variable: give the optimizer every shard of it, or none."
                )
            existing = node_of.get(("v", shards[0].resource_id)) if len(shards) == 1 else None
            if existing is None:
                existing = len(proto.nodes)
                proto.nodes.add()
                paths.append(f"{paths[primary]}/.OPTIMIZER_SLOT/{paths[opt_id]}/{escape(slot_name)}")
                key = slot_key(paths[primary], paths[opt_id], slot_name)
                obj = shards[0] if kinds[primary] == VARIABLE else shards
                full_name = shards[0].name if len(shards) == 1 else shards[0].save_slice_info.full_name
                _add_attribute(proto.nodes[existing], VARIABLE_VALUE, full_name, key)
                saveables.append(Saveable(key, obj, full_name))
            ref = proto.nodes[opt_id].slot_variables.add()
            ref.original_variable_node_id, ref.slot_name, ref.slot_variable_node_id = primary, slot_name, existing
    _mark_values(proto)
    return Graph(proto, saveables, paths)


def _mark_values(proto: TrackableObjectGraph) -> None:
    """Sets TF's `has_checkpoint_values`: the node, a dependency or one of its slots holds a value."""
    has = [bool(n.attributes) for n in proto.nodes]
    changed = True
    while changed:
        changed = False
        for i, node in enumerate(proto.nodes):
            if not has[i] and (any(has[r.node_id] for r in node.children)
                               or any(has[r.slot_variable_node_id] for r in node.slot_variables)):
                has[i] = changed = True
    for node, value in zip(proto.nodes, has, strict=True):
        node.has_checkpoint_values.value = value


def _add_attribute(node, name: str, full_name: str, key: str) -> None:
    attr = node.attributes.add()
    attr.name, attr.full_name, attr.checkpoint_key = name, full_name, key


def _has_python(obj: Any) -> bool:
    return any(kind(c) == PYTHON or (kind(c) == CONTAINER and _has_python(c)) for _, c in children(obj))


def node_names(proto: TrackableObjectGraph) -> list[str]:
    """Readable names of a saved graph's nodes, TF style: ``(root).model.kernel``."""
    names: list[str | None] = [None] * len(proto.nodes)
    names[0] = "(root)"
    queue = collections.deque([0])
    while queue:
        i = queue.popleft()
        for ref in proto.nodes[i].children:
            if 0 <= ref.node_id < len(names) and names[ref.node_id] is None:
                names[ref.node_id] = f"{names[i]}.{ref.local_name}"
                queue.append(ref.node_id)
    for i, node in enumerate(proto.nodes):  # after the walk: a primary may sit deeper than its optimizer
        for ref in node.slot_variables:
            j, p = ref.slot_variable_node_id, ref.original_variable_node_id
            if 0 <= j < len(names) and names[j] is None and 0 <= p < len(names):
                names[j] = f"{names[p] or f'(node {p})'}'s state {ref.slot_name!r} for {names[i]}"
    return [n if n is not None else f"(node {i})" for i, n in enumerate(names)]
