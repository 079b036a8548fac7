"""Pytrees -> TF's TrackableObjectGraph and the values to store under its checkpoint keys."""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from checkpoint import _keys
from checkpoint._graph._walk import (
    VALUES,
    Kind,
    as_variable,
    children,
    has_python,
    identity,
    is_nnx_module,
    is_prng_key,
    key_impl,
    kind,
    leaves,
    linked_slots,
    unwrap,
    variable_of,
)
from checkpoint.protos.saved_object_graph_pb2 import SavedObjectGraph
from checkpoint.protos.trackable_object_graph_pb2 import TrackableObjectGraph
from varstate import PartitionedVariable, Variable, _seam

# A PRNG key array is stored as its key data (uint32, under VARIABLE_VALUE) and, beside it on the same node,
# the name of its implementation as a string: both are needed to rebuild the key (TF has no key arrays).
PRNG_KEY_IMPL = "PRNG_KEY_IMPL"


@dataclasses.dataclass
class Saveable:
    """One value to store: the object, its graph node and checkpoint key."""

    key: str
    obj: Any  # Variable, PartitionedVariable (or a list of slot shards), array or Python scalar
    attribute: str = _keys.VARIABLE_VALUE


@dataclasses.dataclass
class Graph:
    proto: TrackableObjectGraph
    saveables: list[Saveable]
    paths: list[str]  # node id -> path ("" for the root)
    objects: list[Any]  # node id -> the object walked (None for the root); slot nodes have none


def build(roots: dict[str, Any], *, top: str | None = None) -> Graph:
    """Walks `roots` breadth-first (TF's order) into a TrackableObjectGraph.

    The root named `top`, if given, is the top of the paths: its children's paths start without it (``"w"``,
    where TF's join under a root named ``""`` gives ``"/w"``), which is how a format without an object graph
    names a tree's values from the tree itself.
    """
    proto = TrackableObjectGraph()
    nodes = [proto.nodes.add()]  # the root: the Checkpoint itself. Held in a list: indexing the proto's is slow
    paths = [""]
    labels = ["(root)"]  # TF's pretty names, for errors
    objects: list[Any] = [None]
    kinds = [Kind.CONTAINER]
    in_optimizer = [False]  # node id -> reached through an optimizer state (its non-slots, plain slots)
    tops = {0}  # the nodes whose children's paths start at the top: the root, and the root named `top`
    node_of: dict[Any, int] = {}
    saveables: list[Saveable] = []
    valued: set[int] = set()  # the nodes given a value
    edges: dict[int, list[int]] = {}  # node id -> the nodes it leads to (children, slots), for `_mark_values`

    def add_value(node_id: int, attribute: str, obj: Any, full_name: str) -> None:
        key = _keys.attribute_key(paths[node_id], attribute)
        nodes[node_id].attributes.add(name=attribute, full_name=full_name, checkpoint_key=key)
        saveables.append(Saveable(key, obj, attribute))
        valued.add(node_id)

    variables: list[Variable | None] = [None]  # node id -> the Variable of a node walked as one
    primary_node: dict[int, int] = {}  # resource id -> the node of its Variable (or PartitionedVariable)
    queue = collections.deque([(0, [(name, unwrap(roots[name])) for name in roots])])
    while queue:
        parent, kids = queue.popleft()
        parent_node, parent_path, parent_label = nodes[parent], paths[parent], labels[parent]
        under_optimizer = kinds[parent] == Kind.OPTIMIZER or in_optimizer[parent]
        targets = edges[parent] = []
        for name, child in kids:
            k = kind(child)
            var = variable_of(child) if k == Kind.VARIABLE else None
            if k == Kind.NONE or (k == Kind.CONTAINER and not leaves(child, f"{parent_label}.{name}")
                                  and not has_python(child)):
                continue
            ident = ("v", var.resource_id) if var is not None else identity(child, k)
            node_id = node_of.get(ident) if ident is not None else None
            if node_id is None:
                node_id = len(nodes)
                nodes.append(proto.nodes.add())
                paths.append(_keys.child_path(None if parent in tops else parent_path, name))
                if parent == 0 and name == top:
                    tops.add(node_id)
                labels.append(f"{parent_label}.{name}")
                objects.append(child)
                variables.append(var)
                kinds.append(k)
                in_optimizer.append(under_optimizer)
                if ident is not None:
                    node_of[ident] = node_id
                if var is not None:
                    primary_node[var.resource_id] = node_id
                elif k == Kind.PARTITIONED:
                    primary_node.update((v.resource_id, node_id) for v in child)
                elif k == Kind.CONTAINER or k == Kind.OPTIMIZER:
                    queue.append((node_id, children(child, labels[node_id])))
            parent_node.children.add(node_id=node_id, local_name=name)
            targets.append(node_id)
    for node_id in range(1, len(objects)):
        k, obj, path, var = kinds[node_id], objects[node_id], paths[node_id], variables[node_id]
        if k in VALUES:
            full_name = var.name if var is not None else obj.name if k == Kind.PARTITIONED else path
            add_value(node_id, _keys.PY_STATE if k == Kind.PYTHON else _keys.VARIABLE_VALUE, obj, full_name)
            value = var.value if var is not None else obj
            if k in (Kind.VARIABLE, Kind.ARRAY) and is_prng_key(value):
                add_value(node_id, PRNG_KEY_IMPL, key_impl(value), full_name)
    # Slots: found through their primary's resource id among all nodes, as TF
    # asks each optimizer for the slot of every variable in the graph (a slot
    # whose primary is not saved is skipped).
    weights = next((labels[i] for i, (k, obj) in enumerate(zip(kinds, objects, strict=True))
                    if not in_optimizer[i] and _is_weight(k, obj)), None)
    def plain() -> bool:  # no Variable and no nnx Module saved outside the optimizers
        return not any(not opt and (k in (Kind.VARIABLE, Kind.PARTITIONED) or is_nnx_module(o))
                       for k, o, opt in zip(kinds, objects, in_optimizer, strict=True))

    for opt_id in [i for i, k in enumerate(kinds) if k == Kind.OPTIMIZER]:
        linked = linked_slots(objects[opt_id])
        if weights is not None and not any(rid in primary_node for (rid, _), _ in linked):
            _check_primaries_saved(objects[opt_id], labels[opt_id], primary_node, weights, plain=plain)
        grouped: dict[tuple[int, str], list[Variable]] = {}
        for (rid, slot_name), slot in linked:
            if rid in primary_node:
                grouped.setdefault((primary_node[rid], slot_name), []).append(slot)
        for (primary, slot_name), shards in sorted(grouped.items()):
            if kinds[primary] == Kind.PARTITIONED and len(shards) != len(objects[primary]):
                raise ValueError(
                    f"Cannot checkpoint the {slot_name!r} slots of {labels[primary]}: the optimizer {labels[opt_id]} "
                    f"has them for {len(shards)} of its {len(objects[primary])} shards. One value holds the slot of "
                    "the whole variable: give the optimizer every shard of it, or none."
                )
            existing = node_of.get(("v", shards[0].resource_id)) if len(shards) == 1 else None
            if existing is None:
                existing = len(nodes)
                nodes.append(proto.nodes.add())
                paths.append(_keys.slot_path(paths[primary], paths[opt_id], slot_name))
                full_name = shards[0].name if len(shards) == 1 else shards[0].save_slice_info.full_name
                add_value(existing, _keys.VARIABLE_VALUE, shards[0] if kinds[primary] == Kind.VARIABLE else shards,
                          full_name)
            nodes[opt_id].slot_variables.add(original_variable_node_id=primary, slot_name=slot_name,
                                             slot_variable_node_id=existing)
            edges.setdefault(opt_id, []).append(existing)
    _mark_values(nodes, valued, edges)
    return Graph(proto, saveables, paths, objects)


def _is_weight(k: Kind, obj: Any) -> bool:
    """A model's value: a Variable, or an array of rank 1 or more (an nnx Module's values are plain arrays)."""
    return k in (Kind.VARIABLE, Kind.PARTITIONED) or (k == Kind.ARRAY and len(getattr(obj, "shape", ())) > 0)


def _check_primaries_saved(state: Any, where: str, primary_node: dict[int, int], weights: str, *,
                           plain: Callable[[], bool]) -> None:
    """Refuses an optimizer state saved beside a model holding none of the Variables its slots belong to.

    TF saves a slot only under its primary's node, so a slot whose primary is
    not saved is left out. When a model is saved (`weights` names its first
    value) but not one of the state's primaries is, the state was built on
    other Variables (an nnx Module or a rebuilt tree given as the model) and
    every slot would be lost. Some primaries saved (a part of the model) and
    an optimizer saved with no model keep TF's behaviour. With no Variable
    and no nnx Module saved (`plain()`, asked only then), the params became plain arrays (`v * 2`
    gives one), so the message adds how to change a value and keep a Variable.
    """
    first = None
    for slot_name, tree in state.slots.items():
        for path, slot in jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: isinstance(x, Variable))[0]:
            link = _seam.slot_link(slot) if isinstance(slot, Variable) else None
            if link is not None and link[0] in primary_node:
                return
            if link is not None and first is None:
                first = (slot_name, path, slot)
    if first is None:
        return
    slot_name, path, slot = first
    primary = slot.name.removesuffix(f"/{slot_name}")
    raise ValueError(
        f"Cannot checkpoint the optimizer {where}: none of its slots belongs to a saved Variable. The first, "
        f"{slot_name!r} ({slot.name!r}), is for the Variable {primary!r} (params{jax.tree_util.keystr(path)}), "
        f"which is not among the saved Variables (the model saved starts at {weights}), so every slot would be "
        "left out, as TF leaves out a slot whose Variable is not saved, and the training state lost. Save the "
        "params the optimizer stepped: Checkpoint(model=params, optimizer=state) with the params apply_gradients "
        "returned (for an nnx model, the params of varstate.nnx.from_nnx(model), not the Module). An optimizer "
        "saved with no model (Checkpoint(optimizer=state)) keeps only its non-slot values, as in TF."
        + ("" if not plain() else " The model saved holds plain arrays, no Variable: if the params became arrays "
           "(`{k: v * 2 for k, v in params.items()}`), change a value and keep its Variable with `v.assign(v * 2)`, "
           "or `varstate.with_values(params, new_arrays)` for a tree.")
    )


def _mark_values(nodes: list[Any], valued: set[int], edges: dict[int, list[int]]) -> None:
    """Sets TF's `has_checkpoint_values`: the node, a dependency or one of its slots holds a value.

    `valued`: the nodes holding a value; `edges`: each node's children and slots. Only nodes with edges can
    change, and a graph of 2,000 values has a few dozen of them.
    """
    has = [False] * len(nodes)
    for i in valued:
        has[i] = True
    pending = [(i, targets) for i, targets in edges.items() if not has[i]]
    changed = True
    while changed:
        changed = False
        for i, targets in pending:
            if not has[i] and any(has[j] for j in targets):
                has[i] = changed = True
    for node, value in zip(nodes, has, strict=True):
        node.has_checkpoint_values.value = value


def node_names(proto: TrackableObjectGraph | SavedObjectGraph) -> list[str]:
    """Readable names of a saved graph's nodes, TF style: ``(root).model.kernel``.

    A checkpoint's graph and an export's carry nodes of two proto types with the same ``children`` and
    ``slot_variables`` fields, so one walk names both.
    """
    nodes: Sequence[Any] = proto.nodes  # the two node types share the fields read here
    names: list[str | None] = [None] * len(nodes)
    for i, path in _keys.first_paths(nodes).items():
        names[i] = ".".join(("(root)", *path))
    for i, node in enumerate(nodes):  # after the walk: a primary may sit deeper than its optimizer
        for slot_ref in node.slot_variables:
            j, p = slot_ref.slot_variable_node_id, slot_ref.original_variable_node_id
            if 0 <= j < len(names) and names[j] is None and 0 <= p < len(names):
                names[j] = f"{names[p] or f'(node {p})'}'s state {slot_ref.slot_name!r} for {names[i]}"
    return [n if n is not None else f"(node {i})" for i, n in enumerate(names)]


def values(graph: Graph) -> dict[str, Any]:
    """{checkpoint key: array | Python scalar | [(SaveSliceInfo, array), ...]} for storage."""
    out: dict[str, Any] = {}
    for s in graph.saveables:
        if isinstance(s.obj, (PartitionedVariable, list)):
            for v in s.obj:
                if v.save_slice_info is None:
                    raise ValueError(f"Cannot save {s.key!r}: shard {v.name!r} has no SaveSliceInfo.")
                _initialized(s.key, v.value)
            out[s.key] = [(v.save_slice_info, _as_saved(v, v.value)) for v in s.obj]
        else:
            var = as_variable(s.obj)
            out[s.key] = _initialized(s.key, var.value if var is not None else s.obj)
            if is_prng_key(out[s.key]):
                out[s.key] = jax.random.key_data(out[s.key])  # its implementation is the node's PRNG_KEY_IMPL
            elif var is not None:
                out[s.key] = _as_saved(var, out[s.key])
    return out


def _as_saved(var: Variable, value: Any) -> Any:
    """`value` in the dtype `var` is stored as (TF's int64 counters held as int32 while 64-bit types are off)."""
    saved = _seam.saved_dtype(var)
    if saved == var.dtype and not getattr(saved, "metadata", None):  # a quantized tag must reach the writer
        return value
    return np.asarray(jax.device_get(value)).astype(saved)


def _initialized(key: str, value: Any) -> Any:
    if isinstance(value, jax.ShapeDtypeStruct):
        raise ValueError(
            f"Cannot save {key!r}: the value is uninitialized (shape {value.shape}, {value.dtype}). "
            "Initialize it (varstate.zero_initializer, assign, or restore) before saving."
        )
    return value
