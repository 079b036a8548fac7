"""The checkpoint-key grammar of TF's object-based checkpoints, in one place.

A value's key is the path of its node from the root (each part escaped), then
``/.ATTRIBUTES/<attribute>``; an optimizer slot's node sits under its
primary's path as ``<primary>/.OPTIMIZER_SLOT/<optimizer>/<slot name>``.
A saved slice of a partitioned variable is described by offset and extent
per dimension.

>>> from checkpoint import _keys
>>> _keys.variable_key(_keys.escape("model") + "/" + _keys.escape("dense/kernel"))
'model/dense.Skernel/.ATTRIBUTES/VARIABLE_VALUE'
>>> _keys.slot_key("model/w", "optimizer", "m")
'model/w/.OPTIMIZER_SLOT/optimizer/m/.ATTRIBUTES/VARIABLE_VALUE'
>>> _keys.node_path(_keys.slot_key("w", "opt", "m"))
'w/.OPTIMIZER_SLOT/opt/m'
"""

from __future__ import annotations

from collections.abc import Sequence

OBJECT_GRAPH_KEY = "_CHECKPOINTABLE_OBJECT_GRAPH"  # the serialized TrackableObjectGraph
ATTRIBUTES = ".ATTRIBUTES"
OPTIMIZER_SLOT = ".OPTIMIZER_SLOT"
VARIABLE_VALUE = "VARIABLE_VALUE"
PY_STATE = "py_state"  # TF's attribute name for Python state
SAVE_COUNTER = "save_counter"


def escape(local_name: str) -> str:
    """TF's escaping of one path part: ``.`` -> ``..``, ``/`` -> ``.S``."""
    return local_name.replace(".", "..").replace("/", ".S")


def attribute_key(path: str, attribute: str = VARIABLE_VALUE) -> str:
    return f"{path}/{ATTRIBUTES}/{attribute}"


def variable_key(path: str) -> str:
    return attribute_key(path, VARIABLE_VALUE)


def slot_path(primary_path: str, optimizer_path: str, slot_name: str) -> str:
    return f"{primary_path}/{OPTIMIZER_SLOT}/{optimizer_path}/{escape(slot_name)}"


def slot_key(primary_path: str, optimizer_path: str, slot_name: str) -> str:
    return variable_key(slot_path(primary_path, optimizer_path, slot_name))


def node_path(key: str) -> str:
    """The node path of a value's key (the key without its ``/.ATTRIBUTES/...`` part)."""
    return key.split(f"/{ATTRIBUTES}/")[0]


def value_suffix(attribute: str = VARIABLE_VALUE) -> str:
    return f"/{ATTRIBUTES}/{attribute}"


def slice_index(offset: Sequence[int], extent: Sequence[int]) -> tuple[slice, ...]:
    """The numpy index of a saved slice (TF's TensorSlice) within its full value."""
    return tuple(slice(o, o + n) for o, n in zip(offset, extent, strict=True))


def covers_exactly(shape: Sequence[int], boxes: Sequence[Sequence[tuple[int, int]]]) -> bool:
    """True if the slices `boxes` ((offset, extent) per dimension) tile `shape`: disjoint, every element once.

    Disjoint boxes whose volumes add up to the whole leave no element unset.
    Overlaps are found by a sweep along the most-split dimension, so slices
    along one axis (the partitioned-variable case) cost O(n log n).
    """
    total = 1
    for d in shape:
        total *= d
    volume = 0
    for b in boxes:
        v = 1
        for _, n in b:
            v *= n
        volume += v
    if volume != total:
        return False
    if len(boxes) < 2 or not shape:
        return True
    axis = max(range(len(shape)), key=lambda a: len({b[a][0] for b in boxes}))
    active: list[Sequence[tuple[int, int]]] = []  # boxes whose extent along `axis` reaches the sweep position
    for box in sorted(boxes, key=lambda b: b[axis][0]):
        start = box[axis][0]
        active = [a for a in active if a[axis][0] + a[axis][1] > start]
        for other in active:
            if all(p < q + m and q < p + n for (p, n), (q, m) in zip(box, other, strict=True)):
                return False
        active.append(box)
    return True


def parse_slice_spec(key: str, spec: str) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """(full shape, offset, extent) of TF's slice string (``"10 4 0,4:0,4"``); ValueError naming `key`."""
    try:
        *dims, parts = spec.split(" ")
        full_shape = tuple(int(d) for d in dims)
        pairs = [p.split(",") for p in parts.split(":")]
        offset = tuple(int(s) for s, _ in pairs)
        extent = tuple(int(n) for _, n in pairs)
    except ValueError:
        raise ValueError(f"Invalid slice spec {spec!r} for {key!r}: expected e.g. '10 4 0,4:0,4'.") from None
    if len(offset) != len(full_shape):
        raise ValueError(f"Invalid slice spec {spec!r} for {key!r}: rank mismatch.")
    return full_shape, offset, extent
