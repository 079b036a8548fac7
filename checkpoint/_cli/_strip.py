"""`varstate-ckpt strip-optimizer SRC DST`: a copy of a checkpoint without its optimizer state.

An optimizer is found as TF records one: an object of the object graph that
holds slot variables (`slot_variables` of its node). Those objects go, with
their slot variables and every object reachable only through them (their
non-slot values: ``beta1_power``, ``iter``, hyperparameters); everything
still reachable from the root stays, ``save_counter`` included. The kept
nodes are renumbered in their old order and every child reference is
rewritten, so the result is the checkpoint a program that never had an
optimizer would have written: `Checkpoint(model=...).restore(DST)` consumes
all of it. Keys are unchanged. An optimizer that holds no slot variables
(plain SGD) cannot be told from any other object and is kept.

DST is written in SRC's format (a TF bundle, or this library's orbax format)
through the save sequence of `Checkpoint.write` (a temporary name, fsync,
then a rename), and read back: its keys, object graph and every value are
checked against what was meant to be written. A TF bundle is written one
value at a time; the orbax writer takes the values together.

Refused: a checkpoint without an object graph (TF name-based, orbax's own,
safetensors) with exit status 2; one without optimizer state with exit
status 1 (nothing is written).
"""

from __future__ import annotations

import os
import sys
from typing import Any

import numpy as np

from checkpoint import _keys, _storage
from checkpoint._cli import _out as out
from checkpoint._storage import _save
from checkpoint._storage._safetensors import is_safetensors
from checkpoint.protos.trackable_object_graph_pb2 import TrackableObjectGraph


def strip_optimizer(args) -> int:
    src, dst = args.src, os.path.abspath(args.dst)
    if os.path.lexists(dst) or os.path.lexists(dst + ".index"):
        raise out.UsageError(f"destination {args.dst!r} already exists; remove it or choose another path")
    if is_safetensors(src):
        raise out.UsageError(f"{src} is safetensors, which records no object graph, so which of its values are "
                             "optimizer state is not known; convert it to the TF format first (varstate-ckpt "
                             "convert SRC DST --to tf) if it was written from a checkpoint, then strip that")
    reader = _storage.open_reader(src)
    fmt = _format_of(reader)
    graph = out.object_graph(reader)
    if graph is None:
        raise out.UsageError(f"{src} ({reader.format_name}) has no object graph, so which of its values are "
                             "optimizer state is not recorded; nothing can be stripped")
    optimizers = [i for i, node in enumerate(graph.nodes) if node.slot_variables]
    if not optimizers:
        print(f"{out.PROG}: {out.safe(src)}: no optimizer state (no object holds slot variables); nothing to strip, "
              f"{out.safe(args.dst)} not written", file=sys.stderr)
        return 1
    new_graph, kept = stripped_graph(graph, optimizers)
    # Keys outside the object graph (none in a checkpoint this library or TF writes) are kept as they are.
    gone = _attribute_keys(graph) - _attribute_keys(new_graph)
    keys = [k for k in out.key_list(reader) if k not in gone]
    dropped = [k for k in out.key_list(reader) if k in gone]
    _write(fmt, dst, reader, keys, new_graph)
    back = _storage.open_reader(dst)
    out.check_copy(dst, back, keys, new_graph, "the one written", ((k, reader.get(k), back.get(k)) for k in keys))
    names = _keys.first_paths(graph.nodes)
    owners = ", ".join("/".join(names.get(i, (f"node {i}",))) or "(root)" for i in optimizers)
    slots = sum(len(graph.nodes[i].slot_variables) for i in optimizers)
    size = sum(out.nbytes(reader, k) for k in dropped)
    out.say(f"dropped the optimizer state of {owners}: {len(graph.nodes) - len(kept)} objects ({slots} slot "
            f"variables), {len(dropped)} values, {out.human(size)}")
    total = sum(out.nbytes(reader, k) for k in keys)
    out.say(f"wrote {args.dst} ({fmt}): {len(keys)} values, {out.human(total)}; verified by reading it back")
    return 0


def _format_of(reader) -> str:
    from checkpoint._storage import _orbax  # imports orbax: not before a checkpoint is read

    if isinstance(reader, _storage.BundleReader):
        return "tf"
    if isinstance(reader, _orbax.OrbaxReader):
        return "orbax"
    raise out.UsageError(f"{reader.path} ({reader.format_name}) has no object graph of its own, so which of "
                         "its values are optimizer state is not recorded; strip-optimizer reads TF object-based "
                         "checkpoints and this library's orbax format")


def _attribute_keys(graph: TrackableObjectGraph) -> set[str]:
    return {attr.checkpoint_key for node in graph.nodes for attr in node.attributes}


def stripped_graph(graph: TrackableObjectGraph, optimizers: list[int]) -> tuple[TrackableObjectGraph, list[int]]:
    """`graph` without the nodes `optimizers`, their slot variables and what only they reach; (graph, old ids kept).

    >>> g = TrackableObjectGraph()
    >>> root, w, opt, m = (g.nodes.add() for _ in range(4))
    >>> _ = root.children.add(node_id=1, local_name="w"), root.children.add(node_id=2, local_name="opt")
    >>> _ = opt.slot_variables.add(original_variable_node_id=1, slot_name="m", slot_variable_node_id=3)
    >>> new, kept = stripped_graph(g, [2])
    >>> kept, [(c.local_name, c.node_id) for c in new.nodes[0].children]
    ([0, 1], [('w', 1)])
    """
    gone = set(optimizers) | {ref.slot_variable_node_id for i in optimizers for ref in graph.nodes[i].slot_variables}
    reached, queue = {0}, [0]
    for i in queue:  # grows as the walk goes
        node = graph.nodes[i]
        refs = [c.node_id for c in node.children]
        refs += [s.slot_variable_node_id for s in node.slot_variables]
        for j in refs:
            if j not in reached and j not in gone and 0 <= j < len(graph.nodes):
                reached.add(j)
                queue.append(j)
    kept = sorted(reached)
    new_id = {old: new for new, old in enumerate(kept)}
    stripped = TrackableObjectGraph()
    for old in kept:
        node = stripped.nodes.add()
        node.CopyFrom(graph.nodes[old])
        children = [c for c in node.children if c.node_id in new_id]
        slots = [s for s in node.slot_variables
                 if s.original_variable_node_id in new_id and s.slot_variable_node_id in new_id]
        del node.children[:], node.slot_variables[:]
        for c in children:
            node.children.add().CopyFrom(c)
            node.children[-1].node_id = new_id[c.node_id]
        for s in slots:
            node.slot_variables.add().CopyFrom(s)
            node.slot_variables[-1].original_variable_node_id = new_id[s.original_variable_node_id]
            node.slot_variables[-1].slot_variable_node_id = new_id[s.slot_variable_node_id]
    return stripped, kept


class _Stored:
    """One value of the source, read when the bundle writer converts it (so one value is in memory at a time)."""

    def __init__(self, reader, key: str) -> None:
        self.reader, self.key = reader, key

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        value = np.asarray(self.reader.get(self.key))
        return value if dtype is None else value.astype(dtype)


def _write(fmt: str, dst: str, reader, keys: list[str], graph: TrackableObjectGraph) -> None:
    if fmt == "tf":
        tensors: dict[str, Any] = {k: _Stored(reader, k) for k in keys}
        tensors[_keys.OBJECT_GRAPH_KEY] = graph.SerializeToString()
        start = lambda temp: (lambda: _storage.write_bundle(temp, tensors))
    else:
        start = lambda temp: _write_orbax(temp, reader, keys, graph)
    _save.start(dst, fmt, "strip-optimizer", start, lambda primary: None)()


def _write_orbax(temp: str, reader, keys: list[str], graph: TrackableObjectGraph):
    values: dict[str, Any] = {}
    for key in keys:
        python = reader.python_value(key)  # a Python value stays one (an int step, a str)
        values[key] = python if python is not None else reader.get(key)
    out.write_orbax(temp, values, graph)
    return lambda: None

