"""The object graph of roots saved before: a training loop saves the same structure every time.

Building the graph walks every node in Python (about 6 us each: 9-12 ms for
1,500 Variables, a sixth of a small TF-format save). `graph_of` keeps the
last few graphs with what they were built from, and takes one again only when
the new roots are the same structure to the last detail the graph depends on:

- the containers, flattened over Python's containers alone (`_seam.flatten`:
  dicts with their keys, lists, tuples, named tuples with their types, None);
- per leaf, a Variable's handle (its identity, name, slot link and every
  other fixed attribute: handles are immutable and compared by identity),
  else the leaf's type, and for an array whether it is a scalar (which
  decides what counts as a model's weight for the optimizer check);
- an optimizer state is opened by that flatten: its parts (slots, non-slots,
  a fused state's buffers) are containers and leaves like the others.

Anything else, an nnx Module, a PartitionedVariable, an AutoCastVariable, a
fused optimizer state (its saved slots are views, no leaf: `_positions`
refuses them), a custom pytree, a PRNG key, is built afresh every time.
On a match the graph's proto is shared and its values are read from the new
leaves, by the position each value's leaf had when the graph was built.
Nothing kept holds a value or keeps a Variable's handle alive.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

import jax
import numpy as np

from checkpoint._graph._build import Graph, Saveable, build
from varstate import Variable, _seam
from varstate.optimizers import OptimizerState

_ARRAYS = (jax.Array, np.ndarray, np.generic)
_SCALARS = frozenset({bool, int, float, str})
_MAX = 4  # structures kept (each its proto and keys): a loop saves one or two (with an EMA copy, or alternating)

# (root names, containers' treedef) -> (marks, graph proto, paths, [(key, attribute, leaf index)], [the leaf
# indices of each Variable held at several places])
_SEEN: dict[tuple, tuple] = {}
_LOCK = threading.Lock()


def graph_of(roots: dict[str, Any]) -> Graph:
    """`build(roots)`, or the graph of an earlier call on roots of the same structure with these roots' values
    (its `objects` then left empty: a save reads the proto and the values alone)."""
    flat = _structure(roots)
    if flat is None:
        return build(roots)
    key, marks, leaves = flat
    seen = _SEEN.get(key)
    # A Variable held at several places is saved once, from the place the walk meets first: the match holds
    # where every place holds the same version (two versions of one Variable are built, as `build` picks).
    if seen is not None and seen[0] == marks and all(leaves[i] is leaves[t[0]] for t in seen[4] for i in t):
        _, proto, paths, where, _ = seen
        return Graph(proto, [Saveable(k, leaves[i], a) for k, a, i in where], paths, [])
    graph = build(roots)
    found = _positions(graph, leaves)
    if found is not None:
        with _LOCK:  # saves from several threads
            if len(_SEEN) >= _MAX:
                del _SEEN[next(iter(_SEEN))]
            _SEEN[key] = (marks, graph.proto, graph.paths, *found)
    return graph


def _structure(roots: dict[str, Any]) -> tuple[tuple, list, list] | None:
    """(cache key, marks, leaves) of `roots`; None where a leaf is of a kind the marks cannot vouch for, or a
    container or optimizer state is met twice (the graph then has one node with two parents, which the
    containers' treedef does not show)."""
    tree = list(roots.values())
    try:
        flat = _seam.flatten(tree)
    except ValueError:  # a dict whose keys do not sort: `build` says which
        return None
    if flat is None or not _unshared(tree, set()):
        return None
    top, c_def = flat
    marks: list[Any] = []
    leaves: list[Any] = []
    if not all(_mark(x, marks, leaves) for x in top):
        return None
    return (tuple(roots), c_def), marks, leaves


def _unshared(tree: Any, seen: set[int]) -> bool:
    """No container (of those `_seam.flatten` opens) and no optimizer state in `tree` is met twice."""
    stack = [tree]
    while stack:
        x = stack.pop()
        t = type(x)
        if t is dict:
            kids: Any = x.values()
        elif t is list or (issubclass(t, tuple) and (t is tuple or hasattr(t, "_fields"))):
            kids = x
        elif t is OptimizerState:
            kids = ()
        else:
            continue
        if id(x) in seen:
            return False
        seen.add(id(x))
        stack.extend(kids)
    return True


def _mark(x: Any, marks: list, leaves: list) -> bool:
    t = type(x)
    if t is Variable:
        # Weakly: a handle kept alive keeps its name taken in its registry. Two references compare as their
        # handles while both live; a dead one equals no other, so a structure of dead Variables is not matched.
        marks.append(weakref.ref(x.handle))
    elif isinstance(x, _ARRAYS):  # the exact type: a PRNG key array is a jax.Array of another type
        marks.append((t, np.ndim(x) == 0))
    elif t in _SCALARS:
        marks.append(t)
    else:
        return False
    leaves.append(x)
    return True


def _positions(graph: Graph, leaves: list) -> tuple[list[tuple[str, str, int]], list[list[int]]] | None:
    """(key, attribute, leaf index) of each value of `graph`, and the leaf indices of each Variable held at several
    places; None where a value is not one leaf of `leaves` (a PRNG key's implementation, which is no leaf;
    shards; an object met twice, whose places cannot be told apart)."""
    places: dict[Any, list[int]] = {}  # a Variable's handle -> its places
    ids: dict[int, int] = {}
    shared: set[int] = set()
    for i, x in enumerate(leaves):
        if type(x) is Variable:
            places.setdefault(x.handle, []).append(i)
        elif id(x) in ids:
            shared.add(id(x))
        else:
            ids[id(x)] = i
    where = []
    for s in graph.saveables:
        if id(s.obj) in shared:
            return None
        if type(s.obj) is Variable:
            at = places[s.obj.handle][0] if s.obj.handle in places else None
        else:
            at = ids.get(id(s.obj))
        if at is None or leaves[at] is not s.obj:
            return None
        where.append((s.key, s.attribute, at))
    return where, [t for t in places.values() if len(t) > 1]
