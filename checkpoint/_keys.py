"""The checkpoint-key grammar of TF's object-based checkpoints, in one place.

A value's key is the path of its node from the root (each part escaped), then
``/.ATTRIBUTES/<attribute>``; an optimizer slot's node sits under its
primary's path as ``<primary>/.OPTIMIZER_SLOT/<optimizer>/<slot name>``.
A saved slice of a partitioned variable is described by offset and extent
per dimension.

>>> from checkpoint import _keys
>>> _keys.attribute_key(_keys.escape("model") + "/" + _keys.escape("dense/kernel"))
'model/dense.Skernel/.ATTRIBUTES/VARIABLE_VALUE'
>>> _keys.attribute_key(_keys.slot_path("model/w", "optimizer", "m"))
'model/w/.OPTIMIZER_SLOT/optimizer/m/.ATTRIBUTES/VARIABLE_VALUE'
>>> _keys.node_path(_keys.attribute_key(_keys.slot_path("w", "opt", "m")))
'w/.OPTIMIZER_SLOT/opt/m'
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

OBJECT_GRAPH_KEY = "_CHECKPOINTABLE_OBJECT_GRAPH"  # the serialized TrackableObjectGraph
ATTRIBUTES = ".ATTRIBUTES"
OPTIMIZER_SLOT = ".OPTIMIZER_SLOT"
VARIABLE_VALUE = "VARIABLE_VALUE"
PY_STATE = "py_state"  # TF's attribute name for Python state
SAVE_COUNTER = "save_counter"


def escape(local_name: str) -> str:
    """TF's escaping of one path part: ``.`` -> ``..``, ``/`` -> ``.S``."""
    return local_name.replace(".", "..").replace("/", ".S")


def local_name(entry: Any) -> str:
    """A pytree path entry as the local name of the child it leads to: a dict key, field name or index."""
    for attr in ("key", "name", "idx"):  # jax's DictKey and FlattenedIndexKey, GetAttrKey, SequenceKey
        if hasattr(entry, attr):
            return str(getattr(entry, attr))
    return str(entry)


def child_path(parent: str | None, local_name: str) -> str:
    """The path of a node's child: its escaped local name after its parent's path and a ``/``, or alone under the
    root (`parent` None). A child of the root named ``""`` has the path ``""``, and its own child ``y`` the path
    ``/y``, as TF joins them."""
    return escape(local_name) if parent is None else f"{parent}/{escape(local_name)}"


def _first_edges(nodes: Sequence[Any]) -> Iterator[tuple[int, int, str]]:
    """(node, parent, local name) of each node's first reference from the root, breadth first (TF's rule for a
    node's key); a child reference outside `nodes` is skipped, the readers of a graph report it where it matters."""
    seen = {0}
    queue = [0]
    for i in queue:  # grows as the walk goes
        for ref in nodes[i].children:
            if ref.node_id not in seen and 0 <= ref.node_id < len(nodes):
                seen.add(ref.node_id)
                queue.append(ref.node_id)
                yield ref.node_id, i, ref.local_name


def first_paths(nodes: Sequence[Any]) -> dict[int, tuple[str, ...]]:
    """Each node's first path from the root, as its local names; `nodes` are an object graph's nodes (a
    checkpoint's or an export's)."""
    paths: dict[int, tuple[str, ...]] = {0: ()}
    for node, parent, name in _first_edges(nodes):
        paths[node] = (*paths[parent], name)
    return paths


def key_paths(nodes: Sequence[Any]) -> dict[int, str]:
    """`first_paths` as the prefixes of the nodes' checkpoint keys: escaped local names joined by ``/``.

    Built from each parent's key, so that each name is escaped once: escaping every path's names again made a
    chain of 3,000 nodes (4.5 million names over its paths) take seconds to list.
    """
    keys = {0: ""}
    for node, parent, name in _first_edges(nodes):
        keys[node] = child_path(None if parent == 0 else keys[parent], name)
    return keys


def attribute_key(path: str, attribute: str = VARIABLE_VALUE) -> str:
    return f"{path}/{ATTRIBUTES}/{attribute}"


def slot_path(primary_path: str, optimizer_path: str, slot_name: str) -> str:
    return f"{primary_path}/{OPTIMIZER_SLOT}/{optimizer_path}/{escape(slot_name)}"


def node_path(key: str) -> str:
    """The node path of a value's key (the key without its ``/.ATTRIBUTES/...`` part)."""
    return key.split(f"/{ATTRIBUTES}/")[0]


def value_suffix(attribute: str = VARIABLE_VALUE) -> str:
    return f"/{ATTRIBUTES}/{attribute}"


def slice_index(offset: Sequence[int], extent: Sequence[int]) -> tuple[slice, ...]:
    """The numpy index of a saved slice (TF's TensorSlice) within its full value."""
    return tuple(slice(o, o + n) for o, n in zip(offset, extent, strict=True))


_CORNER_BUDGET = 1 << 21  # corners summed (2**split dimensions per slice) before the grid is painted instead
_CELL_BUDGET = 1 << 24  # cells of the grid of slice boundaries painted at most (a bool each)


def box_of(index: Sequence[slice], shape: Sequence[int]) -> tuple[tuple[int, int], ...]:
    """A shard's index (slices, as jax's sharding gives them) as (offset, extent) per dimension: `slice_index`'s
    inverse."""
    return tuple((s.indices(d)[0], len(range(*s.indices(d)))) for s, d in zip(index, shape, strict=True))


def covers_exactly(shape: Sequence[int], boxes: Sequence[Sequence[tuple[int, int]]]) -> bool:
    """True if the slices `boxes` ((offset, extent) per dimension) tile `shape`: disjoint, every element once.

    Slices come from files, so the work is bounded for any input. Give each
    box the signed corners of its indicator function (per dimension +1 at its
    start and -1 at its end, multiplied): summing indicators sums corners, and
    indicators add up to the shape's exactly when the corners do. That is
    2**d corners a slice, d the dimensions some slice splits (1 for a
    partitioned variable), whatever the layout. Where that is too many, the
    grid of distinct slice boundaries is painted; ValueError if that grid is
    too large as well (no partitioner splits so finely; checking would take
    minutes).

    >>> covers_exactly((4, 2), [[(0, 3), (0, 2)], [(3, 1), (0, 2)]]), covers_exactly((4,), [[(0, 3)], [(2, 2)]])
    (True, False)
    """
    shape = tuple(shape)
    kept, volume = [], 0
    for box in boxes:
        if len(box) != len(shape) or any(o < 0 or n < 0 or o + n > d for (o, n), d in zip(box, shape, strict=True)):
            return False
        v = math.prod(n for _, n in box)
        if v:  # an empty slice covers nothing and overlaps nothing
            kept.append(box)
            volume += v
    if volume != math.prod(shape):
        return False
    split = [a for a, d in enumerate(shape) if any(box[a][0] or box[a][1] != d for box in kept)]
    if not split:
        return len(kept) <= 1  # each one is the whole shape
    cut = [[box[a] for a in split] for box in kept]
    if len(kept) << len(split) <= _CORNER_BUDGET:
        return _corners_cancel([[(0, shape[a]) for a in split]], cut)
    return _paint([shape[a] for a in split], cut)


def _corners_cancel(whole: list, boxes: list) -> bool:
    total: dict[tuple[int, ...], int] = {}
    for sign, group in ((-1, whole), (1, boxes)):
        for box in group:
            corners: list[tuple[tuple[int, ...], int]] = [((), sign)]
            for o, n in box:
                corners = [((*c, o), s) for c, s in corners] + [((*c, o + n), -s) for c, s in corners]
            for c, s in corners:
                total[c] = total.get(c, 0) + s
    return not any(total.values())


def _paint(shape: list[int], boxes: list) -> bool:
    bounds = [sorted({0, d, *(b[a][0] for b in boxes), *(b[a][0] + b[a][1] for b in boxes)})
              for a, d in enumerate(shape)]
    cells = math.prod(len(b) - 1 for b in bounds)
    if cells > _CELL_BUDGET:
        raise ValueError(
            f"{len(boxes)} slices cut {len(shape)} dimensions into {cells} pieces, more than the {_CELL_BUDGET} "
            "this reader checks: too fragmented for a partitioned variable"
        )
    at = [{x: i for i, x in enumerate(b)} for b in bounds]
    grid = np.zeros([len(b) - 1 for b in bounds], bool)
    for box in boxes:
        region = grid[tuple(slice(w[o], w[o + n]) for (o, n), w in zip(box, at, strict=True))]
        if region.any():
            return False
        region[...] = True  # a view: costs the cells painted, at most the grid once over
    return True  # disjoint, inside, and their volumes add up to the shape's


def parse_slice_spec(key: str, spec: str) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """(full shape, offset, extent) of TF's slice string (``"10 4 0,4:0,4"``); ValueError naming `key`."""
    try:
        *dims, parts = spec.split(" ")
        full_shape = tuple(map(int, dims))
        offset, extent = [], []
        for pair in parts.split(":"):
            start, length = pair.split(",")
            offset.append(int(start))
            extent.append(int(length))
    except ValueError:
        raise ValueError(f"Invalid slice spec {_cut(spec)} for {key!r}: expected e.g. '10 4 0,4:0,4'.") from None
    if len(offset) != len(full_shape):
        raise ValueError(f"Invalid slice spec {_cut(spec)} for {key!r}: rank mismatch.")
    return full_shape, tuple(offset), tuple(extent)


def _cut(spec: str) -> str:
    return repr(spec) if len(spec) <= 100 else f"{spec[:100]!r}... ({len(spec)} characters)"  # specs come from files
