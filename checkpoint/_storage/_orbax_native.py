"""Reading checkpoints orbax itself wrote: a PyTree directory, a step of a CheckpointManager, flax nnx's.

`StandardCheckpointer` and `PyTreeCheckpointer` write a directory holding
orbax's ``_METADATA`` (the tree: each leaf's path and type); a
`CheckpointManager` writes ``<root>/<step>/<item>/`` with such a directory
per item; flax nnx saves ``nnx.state(model)`` with `StandardCheckpointer`.
A value's key is its tree path joined with ``/`` (``params/dense/kernel``;
nnx's ``layers/0/kernel/value``). Items of a step are the tree's first level,
except orbax's lone ``default`` item, which is the tree itself.

Such a checkpoint has no TrackableObjectGraph: the reader synthesizes one
from the tree paths, naming each node as `Checkpoint` names a nested dict of
Variables, so templates restore from it by structure. A leaf saved by nnx
(``.../kernel/value``) is reachable both with and without that last
``value`` level, so an nnx Module or State restores from it as from a tree.
"""

from __future__ import annotations

import collections
import json
import os
import re
from typing import Any

import numpy as np

from checkpoint import _keys
from checkpoint._errors import CheckpointFormatError, DataLossError
from checkpoint._storage._files import read_regular, within
from checkpoint._storage._host import one_by_one
from checkpoint.protos.trackable_object_graph_pb2 import TrackableObjectGraph

TREE_METADATA = "_METADATA"  # orbax's PyTree metadata: its presence marks a PyTree directory
STEP_METADATA = "_CHECKPOINT_METADATA"  # orbax's metadata of a step (a composite of items)
DEFAULT_ITEM = "default"  # the item name orbax gives a step saved without naming its item
_META_LIMIT = 256 << 20
_NNX_VALUE = "value"  # the level nnx's Variables add to a tree path


def _orbax() -> tuple[Any, Any, Any]:
    """(jax, orbax.checkpoint, epath), imported when a reader is made: finding a checkpoint imports none of them."""
    import jax
    import orbax.checkpoint as ocp
    from etils import epath

    return jax, ocp, epath


def is_tree(path: str) -> bool:
    """True for a directory orbax wrote a PyTree into (checked without importing orbax)."""
    return os.path.isfile(os.path.join(path, TREE_METADATA))


def items_of(path: str) -> dict[str, str] | None:
    """{item name: directory} of an orbax step directory (a composite of PyTree items), else None."""
    if not os.path.isfile(os.path.join(path, STEP_METADATA)) or is_tree(path):
        return None
    items = {name: os.path.join(path, name) for name in sorted(os.listdir(path))
             if os.path.isdir(os.path.join(path, name)) and is_tree(os.path.join(path, name))}
    return items or None


def latest_step(path: str) -> str | None:
    """The newest committed step directory of an orbax CheckpointManager's directory, else None."""
    steps = [(int(name), name) for name in os.listdir(path)
             if re.fullmatch(r"\d+", name) and items_of(os.path.join(path, name)) is not None]
    return os.path.join(path, max(steps)[1]) if steps else None


def is_native(path: str) -> bool:
    """True for a checkpoint orbax wrote (a PyTree directory or a step of a CheckpointManager)."""
    return is_tree(path) or items_of(path) is not None


class KeyedReader:
    """The reader protocol's lookups, shared by the orbax readers: `_entries` holds what a reader knows of each key."""

    path: str
    _entries: dict[str, Any]
    _cache: dict[str, np.ndarray]  # host copies read before, kept for later (deferred) restores

    def keys(self) -> list[str]:
        return sorted(self._entries)

    def stored_together(self, keys: list[str]) -> list[list[str]]:
        return one_by_one(keys)

    def release(self) -> None:
        self._cache.clear()

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    def _lookup(self, key: str) -> Any:
        try:
            return self._entries[key]
        except KeyError:
            raise KeyError(f"Key {key!r} not found in checkpoint {self.path!r}.") from None

    def get(self, key: str) -> np.ndarray:
        return self.get_many({key: None})[key]

    def get_into(self, key: str, sharding: Any) -> Any:
        return self.get_many({key: sharding})[key]

    def get_many(self, requests: dict[str, Any]) -> dict[str, Any]:
        raise NotImplementedError


class OrbaxTreeReader(KeyedReader):
    """Reads a checkpoint written by orbax itself (the reader protocol of `read_checkpoint`).

    >>> import os, tempfile, numpy as np, orbax.checkpoint as ocp
    >>> path = os.path.join(tempfile.mkdtemp(), "tree")
    >>> with ocp.StandardCheckpointer() as c:
    ...     c.save(path, {"dense": {"kernel": np.ones((2, 3), np.float32)}})
    >>> r = OrbaxTreeReader(path)
    >>> r.keys(), r.shape("dense/kernel"), r.get("dense/kernel").sum()
    (['dense/kernel'], (2, 3), np.float32(6.0))
    >>> [ref.local_name for ref in r.object_graph.nodes[0].children]
    ['dense']
    """

    format_name = "orbax PyTree checkpoint (written by orbax)"

    def __init__(self, path: str) -> None:
        self.path = os.path.abspath(path)
        items = items_of(self.path)
        if is_tree(self.path):
            parts = {"": self.path}
        elif items is not None:
            lone = list(items) == [DEFAULT_ITEM]
            parts = {"": items[DEFAULT_ITEM]} if lone else {f"{k}/": v for k, v in items.items()}
        else:
            raise ValueError(f"{path!r} is not an orbax checkpoint: it holds neither {TREE_METADATA} nor a "
                             f"{STEP_METADATA} with items.")
        self._entries: dict[str, tuple[str, tuple, Any]] = {}  # key -> (item directory, tree path, metadata)
        for prefix, directory in parts.items():
            self._read_tree(prefix, directory)
        self.object_graph = _synthesize({key: path for key, (_, path, _) in self._entries.items()})
        self._cache: dict[str, np.ndarray] = {}

    def _read_tree(self, prefix: str, directory: str) -> None:
        within(self.path, directory)
        meta_file = os.path.join(directory, TREE_METADATA)
        within(self.path, meta_file)
        try:  # orbax parses it too; read first so that damage is reported as this library reports it
            json.loads(read_regular(meta_file, _META_LIMIT, "orbax's tree metadata"))
        except (ValueError, RecursionError) as e:
            raise DataLossError(f"Checkpoint {self.path!r}: {meta_file} is corrupted ({str(e)[:200]}).") from None
        jax, ocp, epath = _orbax()
        handler = ocp.PyTreeCheckpointHandler()
        try:
            tree = handler.metadata(epath.Path(directory))
        except Exception as e:  # orbax raises many types for a damaged tree
            raise DataLossError(f"Checkpoint {self.path!r}: orbax cannot read the tree metadata of {directory} "
                                f"({str(e).splitlines()[0][:200] if str(e) else type(e).__name__}).") from None
        finally:
            handler.close()
        tree = getattr(tree, "tree", tree)
        for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
            parts = tuple(_keys.local_name(p) for p in path)
            if not hasattr(leaf, "shape") or not hasattr(leaf, "dtype"):
                raise CheckpointFormatError(
                    f"Checkpoint {self.path!r}: the value at {'/'.join(parts)!r} is a {type(leaf).__name__}, not an "
                    "array or a number; this reader reads arrays and numbers only."
                )
            self._entries[prefix + "/".join(parts)] = (directory, path, leaf)

    # --- the reader protocol ------------------------------------------------------
    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self._lookup(key)[2].shape or ())

    def dtype(self, key: str) -> np.dtype:
        return np.dtype(self._lookup(key)[2].dtype)

    def get_slices(self, key: str) -> list[tuple[slice, ...]]:
        self._lookup(key)
        return []  # orbax stores each value whole

    def get_many(self, requests: dict[str, Any]) -> dict[str, Any]:
        """{key: target sharding or None} -> {key: jax.Array on that sharding, or np.ndarray}; one restore per item."""
        by_dir: dict[str, dict[str, Any]] = {}
        for key, sharding in requests.items():
            directory = self._lookup(key)[0]
            if sharding is not None or key not in self._cache:
                by_dir.setdefault(directory, {})[key] = sharding
        got: dict[str, Any] = {}
        for directory, wanted in by_dir.items():
            got.update(self._restore(directory, wanted))
        self._cache.update((k, v) for k, v in got.items() if isinstance(v, np.ndarray))
        return {k: got[k] if k in got else self._cache[k] for k in requests}

    def _restore(self, directory: str, wanted: dict[str, Any]) -> dict[str, Any]:
        jax, ocp, epath = _orbax()
        handler = ocp.PyTreeCheckpointHandler()
        try:
            tree = getattr(handler.metadata(epath.Path(directory)), "tree", None)
            paths = {self._entries[k][1]: k for k in wanted}

            def pick(path, meta, restore: bool):
                key = paths.get(path)
                if key is None:
                    return ocp.PLACEHOLDER
                sharding, shape, dtype = wanted[key], self.shape(key), self.dtype(key)
                if not restore:
                    return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding) if sharding else np.empty(0)
                if sharding is not None:
                    return ocp.ArrayRestoreArgs(sharding=sharding, global_shape=shape, dtype=dtype)
                return ocp.RestoreArgs(restore_type=np.ndarray) if type(meta).__name__ == "ArrayMetadata" \
                    else ocp.RestoreArgs()

            item = jax.tree_util.tree_map_with_path(lambda p, m: pick(p, m, False), tree)
            args = jax.tree_util.tree_map_with_path(lambda p, m: pick(p, m, True), tree)
            restored = handler.restore(epath.Path(directory), args=ocp.args.PyTreeRestore(item=item,
                                                                                          restore_args=args))
        except Exception as e:  # tensorstore reports damaged files as exceptions of many types
            raise DataLossError(f"Checkpoint {self.path!r}: cannot read {sorted(wanted)[:3]} from {directory} "
                                f"({str(e).splitlines()[0][:200] if str(e) else type(e).__name__}). The value "
                                "files are damaged.") from None
        finally:
            handler.close()
        out = {}
        flat = dict(jax.tree_util.tree_flatten_with_path(restored)[0])
        for key in wanted:
            value = flat.get(self._entries[key][1])
            if isinstance(value, (int, float, complex, np.generic)) and not isinstance(value, bool):
                # a number orbax stored as a scalar comes back as a Python number: in the dtype it recorded
                cast = np.asarray(value).astype(self.dtype(key))
                value = cast if cast == value else np.asarray(value)
            value = value if isinstance(value, jax.Array) else np.asarray(value)
            if tuple(value.shape) != self.shape(key) or np.dtype(value.dtype) != self.dtype(key):
                raise DataLossError(
                    f"Checkpoint {self.path!r}: value {key!r} is stored as {tuple(value.shape)} {value.dtype}, its "
                    f"metadata says {self.shape(key)} {self.dtype(key)}. The checkpoint is corrupted."
                )
            out[key] = value
        return out


def _synthesize(paths: dict[str, tuple]) -> TrackableObjectGraph:
    """The object graph `Checkpoint` would save for a nested dict of Variables at these tree paths ({key: path}).

    Each path part is a node (its local name the part, unescaped, as a dict
    key names a child), each leaf a node whose VARIABLE_VALUE is the leaf's
    key. A leaf named ``value`` that is its parent's only child (an nnx
    Variable's) is the parent node itself: ``value`` is a reference back to
    it, so a template with or without that level finds the same value.
    """
    proto = TrackableObjectGraph()
    proto.nodes.add()
    index: dict[tuple, int] = {(): 0}
    children: dict[int, dict[str, int]] = collections.defaultdict(dict)  # node -> {local name: child}
    for key, path in paths.items():
        parts = tuple(_keys.local_name(p) for p in path)
        prefix = key[: len(key) - len("/".join(parts))]  # an item's name, or nothing
        parts = tuple(p for p in prefix.rstrip("/").split("/") if p) + parts if prefix else parts
        for depth in range(1, len(parts) + 1):
            here = parts[:depth]
            if here not in index:
                index[here] = len(proto.nodes)
                proto.nodes.add()
                children[index[here[:-1]]][here[-1]] = index[here]
        attr = proto.nodes[index[parts]].attributes.add()
        attr.name, attr.full_name, attr.checkpoint_key = _keys.VARIABLE_VALUE, key, key
    for parts, node_id in list(index.items()):
        parent = index[parts[:-1]] if parts else 0  # every prefix has its node; the root is skipped below
        if parts and parts[-1] == _NNX_VALUE and len(children[parent]) == 1 and parent != 0 \
                and not proto.nodes[parent].attributes:
            proto.nodes[parent].attributes.extend(proto.nodes[node_id].attributes)
            children[parent][_NNX_VALUE] = parent
            del proto.nodes[node_id].attributes[:]
    for node_id, kids in children.items():
        for name, child in kids.items():
            ref = proto.nodes[node_id].children.add()
            ref.node_id, ref.local_name = child, name
    for node in proto.nodes:
        node.has_checkpoint_values.value = True
    return _prune(proto)


def _prune(proto: TrackableObjectGraph) -> TrackableObjectGraph:
    """Drops the nodes left without a reference (the ``value`` leaves folded into their parents), renumbering."""
    used = [0]
    for node_id in used:  # breadth first: the graph is a tree but for each folded ``value``'s reference to itself
        used += [ref.node_id for ref in proto.nodes[node_id].children if ref.node_id != node_id]
    if len(used) == len(proto.nodes):
        return proto
    new_id = {old: new for new, old in enumerate(used)}
    out = TrackableObjectGraph()
    for old in used:
        node = out.nodes.add()
        node.CopyFrom(proto.nodes[old])
        for ref in node.children:
            ref.node_id = new_id[ref.node_id]
    return out
