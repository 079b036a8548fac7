"""safetensors in `varstate-ckpt`: inspect a file or an index, convert to it and from it (without importing jax).

A checkpoint's value ``<path>/.ATTRIBUTES/VARIABLE_VALUE`` is the tensor
``<path>`` (the names `checkpoint.safetensors.save` gives), its Python values
and PRNG implementations go to ``__metadata__``; a name-based checkpoint keeps
its names. Back from a file with object-graph paths, the object graph is
rebuilt from the paths (a slot path links the slot to its optimizer and
primary); other files (Hugging Face's names) become name-based checkpoints.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any

import numpy as np

from checkpoint import _keys
from checkpoint._cli import _out as out
from checkpoint._errors import CheckpointFormatError
from checkpoint._storage import _safetensors as st
from checkpoint.protos.trackable_object_graph_pb2 import TrackableObjectGraph

_SPECIAL = {_keys.value_suffix(_keys.PY_STATE): st.PYTHON, _keys.value_suffix(st.PRNG_ATTRIBUTE): st.PRNG_IMPL}


# --- to safetensors ---------------------------------------------------------------
def _text(value: np.ndarray, key: str) -> Any:
    """A stored Python value (a scalar) as JSON data."""
    value = np.asarray(value)
    if value.shape != ():
        raise out.UsageError(f"{key!r} is a Python value of shape {value.shape}; expected a scalar")
    item = value.item()
    return item.decode("utf-8", "backslashreplace") if isinstance(item, bytes) else item


def check_destination(dst: str) -> None:
    """Refuses a destination that is no safetensors file name, or whose files (the file itself, or a sharded
    save's index and shards, named from it) exist: a convert never replaces a checkpoint."""
    if not dst.endswith(st.SUFFIX) or dst.endswith(st.INDEX_SUFFIX):
        raise out.UsageError(f"destination {dst!r}: name it *{st.SUFFIX} (with --max-shard-size, the shards and "
                             f"the *{st.INDEX_SUFFIX} index are named from it)")
    stem = dst[: -len(st.SUFFIX)]
    folder, base = os.path.split(os.path.abspath(stem))
    shard = re.compile(re.escape(base) + r"-\d+-of-\d+" + re.escape(st.SUFFIX))
    taken = [p for p in (dst, stem + st.INDEX_SUFFIX) if os.path.lexists(p)]
    if os.path.isdir(folder):
        taken += sorted(os.path.join(folder, f) for f in os.listdir(folder) if shard.fullmatch(f))
    if taken:
        raise out.UsageError(f"destination {dst!r}: {taken[0]!r} already exists; remove it (and any shards beside "
                             "it) or choose another path")


def write(dst: str, tensors: dict[str, np.ndarray], graph: Any, max_shard_size: str | None) -> tuple[str, dict]:
    """Writes the checkpoint values `tensors` as safetensors; returns (the path to load, {name: checkpoint key})."""
    names: dict[str, str] = {}
    metadata: dict[str, dict[str, Any]] = {st.PYTHON: {}, st.PRNG_IMPL: {}}
    for key, value in tensors.items():
        special = next((m for suffix, m in _SPECIAL.items() if key.endswith(suffix)), None) if graph else None
        if special is not None:
            metadata[special][_keys.node_path(key)] = _text(value, key)
            continue
        if out.is_str(value.dtype):
            raise out.UsageError(f"{key!r} is a string tensor, which safetensors cannot hold; convert --to tf")
        names[_keys.node_path(key) if graph and key.endswith(_keys.value_suffix()) else key] = key
    meta = {name: json.dumps(v, sort_keys=True) for name, v in metadata.items() if v}
    if graph:
        meta[st.NAMES_ARE_PATHS] = st.PATHS
    size = None if max_shard_size is None else st.parse_size(max_shard_size, dst)
    try:
        path = st.write(os.path.abspath(dst), {n: tensors[k] for n, k in names.items()}, meta, size)
    except ValueError as e:
        raise out.UsageError(str(e)) from None
    return path, names


# --- from safetensors ---------------------------------------------------------------
class CheckpointView:
    """A safetensors file read as a checkpoint: keys and an object graph from its object-graph paths, when it has
    them (`checkpoint.safetensors.save`'s files), else its names as a name-based checkpoint's."""

    def __init__(self, path: str) -> None:
        self.file = st.SafetensorsReader(path)
        self.path, self.format_name = self.file.path, self.file.format_name
        self.object_graph = None
        paths = self.file.metadata.get(st.NAMES_ARE_PATHS) == st.PATHS
        # checkpoint key -> tensor name, or a Python value from the metadata
        self.values: dict[str, Any] = {_keys.attribute_key(name) if paths else name: name for name in self.file.keys()}
        if not paths:
            return
        for suffix, entry in _SPECIAL.items():
            try:
                found = json.loads(self.file.metadata.get(entry, "{}"))
            except ValueError:
                found = None
            if not isinstance(found, dict):
                raise CheckpointFormatError(f"{self.path}: __metadata__ entry {entry!r} is not a JSON object")
            for path, value in found.items():
                self.values[path + suffix] = np.array(value.encode() if isinstance(value, str) else value,
                                                      dtype=object if isinstance(value, str) else None)
        self.object_graph = graph_of(self.values)

    def keys(self) -> list[str]:
        return list(self.values)

    def __contains__(self, key: str) -> bool:
        return key in self.values

    def shape(self, key: str) -> tuple[int, ...]:
        value = self.values[key]  # a tensor's name, or a value from the metadata
        return self.file.shape(value) if isinstance(value, str) else value.shape

    def dtype(self, key: str) -> np.dtype:
        value = self.values[key]
        return self.file.dtype(value) if isinstance(value, str) else value.dtype

    def get(self, key: str) -> np.ndarray:
        value = self.values[key]
        return self.file.get(value) if isinstance(value, str) else value

    def get_slices(self, key: str) -> list:
        return []


def graph_of(keys: Any) -> TrackableObjectGraph:
    """The object graph the checkpoint keys `keys` imply: a node per path, slots linked to optimizer and primary."""
    proto = TrackableObjectGraph()
    nodes = [proto.nodes.add()]
    ids: dict[str | None, int] = {None: 0}  # path -> node; the root has none (a child named "" has the path "")

    def node(path: str) -> int:
        at: str | None = None
        for part in path.split("/"):
            parent, at = ids[at], part if at is None else f"{at}/{part}"
            if at not in ids:
                ids[at] = len(nodes)
                nodes.append(proto.nodes.add())
                nodes[parent].children.add(node_id=ids[at], local_name=st.unescape(part))
        return ids[at]

    slots: dict[str, int] = {}
    for key in keys:
        path, attribute = _keys.node_path(key), key.rpartition("/")[2]
        primary, slot, rest = path.partition(f"/{_keys.OPTIMIZER_SLOT}/")
        if slot:
            if path not in slots:
                optimizer, _, name = rest.rpartition("/")
                slots[path] = len(nodes)
                nodes.append(proto.nodes.add())
                nodes[node(optimizer)].slot_variables.add(original_variable_node_id=node(primary),
                                                          slot_name=st.unescape(name),
                                                          slot_variable_node_id=slots[path])
            i = slots[path]
        else:
            i = node(path)
        nodes[i].attributes.add(name=attribute, full_name=path, checkpoint_key=key)
    for n in nodes:  # each node leads to a value: they were made from the values' paths
        n.has_checkpoint_values.value = True
    return proto


# --- inspect ------------------------------------------------------------------------
def inspect(args) -> int:
    reader = st.SafetensorsReader(args.path)
    if args.key is not None:
        from checkpoint._cli._inspect import _inspect_key

        return _inspect_key(reader, args.key, args.json)
    shards = len(reader.files) if reader.path.endswith(".json") else 0
    rows: list[dict[str, Any]] = [{"name": e.name, "dtype": e.dtype.name, "shape": list(e.shape), "bytes": e.nbytes,
             "file": os.path.basename(e.file)} for e in sorted(reader.entries.values(), key=lambda e: e.name)]
    total = sum(r["bytes"] for r in rows)
    if args.json:
        out.print_json({"path": reader.path, "format": "safetensors", "shards": shards,
                        "files": [os.path.basename(f) for f in reader.files], "values": len(rows), "bytes": total,
                        "metadata": reader.metadata, "tensors": rows})
        return 0
    title = f"{reader.path}: {reader.format_name}"
    footer = f"{len(rows)} tensors, {out.human(total)}" + (f" ({total} bytes)" if total >= 1024 else "")
    table = [(r["name"], r["dtype"], str(tuple(r["shape"])), out.human(r["bytes"]), r["file"] if shards else "")
             for r in rows]
    if out.is_terminal():
        from rich.table import Table
        from rich.text import Text

        t = Table(title=Text(out.safe(title)), caption=footer)
        for col in ("name", "dtype", "shape", "bytes", "file" if shards else ""):
            t.add_column(col, justify="right" if col == "bytes" else "left")
        for row in table:
            t.add_row(*(Text(out.safe(x)) for x in row))
        out.console().print(t)
    else:
        out.say(out.safe(title))
        width = max((len(out.safe(r[0])) for r in table), default=4)
        for name, dtype, shape, size, file in table:
            out.say(f"  {out.safe(name):<{width}}  {dtype:<13} {shape:<14} {size:>9}  {out.safe(file)}".rstrip())
        for k, v in sorted(reader.metadata.items()):
            out.say(out.safe(f"  metadata {k}: {v if len(v) <= 200 else v[:200] + '...'}"))
        out.say(footer)
    return 0
