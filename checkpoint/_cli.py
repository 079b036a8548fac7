"""`python -m checkpoint` / `varstate-ckpt`: inspect, convert and diff checkpoints and exports.

Reads every format `read_checkpoint` reads (orbax, TF object-based, TF
name-based, checkpoints orbax itself wrote) and, for `inspect`, the
directories `checkpoint.export` writes and TF SavedModels (whose variables
`convert` and `diff` read too).
Output uses rich (tables, trees, a progress bar) when stdout is a terminal,
plain text otherwise, and JSON with ``--json``. Names read from a file are
printed with their control characters escaped, so a crafted key cannot
drive the terminal. Bad input ends with one line on stderr and exit status
2; `diff` exits 0 when the checkpoints match and 1 when not. Only orbax
checkpoints and exports import jax.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import unicodedata
from collections.abc import Iterator
from typing import Any

import numpy as np

from checkpoint import _dtypes, _keys, _storage

_GRAPH_KEY = _keys.OBJECT_GRAPH_KEY
_VALUE_SUFFIX = _keys.value_suffix()
_PROG = "varstate-ckpt"


class _UsageError(Exception):
    """Bad input found by the CLI itself (exit status 2)."""


def _is_terminal() -> bool:
    return sys.stdout.isatty()


def _console():
    from rich.console import Console

    return Console(file=sys.stdout)


# Control characters (C0, DEL, C1), format characters (bidi overrides, zero-width), line and paragraph
# separators, and lone surrogates: none is meant for a terminal, and ESC or a bidi override can rewrite it.
_UNPRINTABLE = frozenset(("Cc", "Cf", "Cs", "Zl", "Zp"))


def _safe(text: str) -> str:
    """`text` with every character a terminal would act on written as a Python escape (``\\x1b``)."""
    if text.isprintable():  # the common case: nothing to do
        return text
    out = []
    for ch in text:
        if unicodedata.category(ch) in _UNPRINTABLE:
            n = ord(ch)
            out.append(f"\\x{n:02x}" if n < 0x100 else f"\\u{n:04x}" if n < 0x10000 else f"\\U{n:08x}")
        else:
            out.append(ch)
    return "".join(out)


def _print(line: str = "") -> None:
    print(_safe(line))


def _print_json(data: Any) -> None:
    # ensure_ascii: every non-ASCII character, control characters of any kind included, as a \\uXXXX escape.
    print(json.dumps(data, ensure_ascii=True, allow_nan=False))


def _number(x: Any) -> Any:
    """A value for JSON: NaN and the infinities as the strings "nan", "inf", "-inf" (JSON has none)."""
    if isinstance(x, float) and not math.isfinite(x):
        return "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")
    return x


# --- values -------------------------------------------------------------------
def _human(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def _is_str(dtype: np.dtype) -> bool:
    return np.dtype(dtype).kind in "OSU"


def _nbytes(reader, key: str) -> int:
    dtype = np.dtype(reader.dtype(key))
    if _is_str(dtype):  # strings: their bytes are only known once read
        return sum(len(x) for x in np.asarray(reader.get(key)).ravel())
    return int(np.prod(reader.shape(key), dtype=np.int64)) * dtype.itemsize


def _describe(reader, key: str) -> tuple[str, str, int]:
    dtype = np.dtype(reader.dtype(key))
    return "string" if _is_str(dtype) else dtype.name, str(tuple(reader.shape(key))), _nbytes(reader, key)


def _key_list(reader) -> list[str]:
    return sorted(k for k in reader.keys() if k != _GRAPH_KEY)


def _graph(reader) -> Any:
    """The object graph, or None for a name-based checkpoint (stored in orbax as an empty graph)."""
    graph = reader.object_graph
    return graph if graph is not None and len(graph.nodes) else None


def _format_name(reader) -> str:
    own = getattr(reader, "format_name", None)  # a checkpoint orbax wrote: its object graph is synthesized
    if own is not None:
        return own
    kind = "orbax" if os.path.isdir(getattr(reader, "path", "")) else "TF"
    return f"{kind} {'object' if _graph(reader) is not None else 'name'}-based checkpoint"


# --- inspect -------------------------------------------------------------------
def _value_info(reader, key: str, attribute: str) -> dict[str, Any]:
    dtype, _, size = _describe(reader, key)
    info = {"key": key, "dtype": dtype, "shape": list(reader.shape(key)), "bytes": size}
    return info if attribute == _keys.VARIABLE_VALUE else {**info, "attribute": attribute}


def _value_label(info: dict[str, Any]) -> str:
    if info.get("missing"):
        return f"missing value {info['key']!r}"
    extra = f" [{info['attribute']}]" if "attribute" in info else ""
    return f"{info['dtype']} {tuple(info['shape'])} {_human(info['bytes'])}{extra}"


def _bfs_paths(nodes) -> dict[int, str]:
    """Each node's path (escaped local names), the first one found breadth-first, as TF names its keys."""
    paths = {0: ""}
    queue = [0]
    for node_id in queue:
        for child in nodes[node_id].children:
            if child.node_id not in paths and 0 <= child.node_id < len(nodes):
                paths[child.node_id] = f"{paths[node_id]}/{_keys.escape(child.local_name)}".lstrip("/")
                queue.append(child.node_id)
    return paths


def _tree_rows(nodes, describe) -> list[dict[str, Any]]:
    """The object graph as rows, depth first: each object under its first path, later paths as `same_as`.

    `describe(node_id)` gives a row's fields for a node. A stack, not recursion: the depth of the graph is
    the file's to choose, and a chain of thousands of objects must print.
    """
    paths = _bfs_paths(nodes)
    rows: list[dict[str, Any]] = []
    stack = [(0, 0, iter(nodes[0].children))]
    while stack:
        node_id, depth, children = stack[-1]
        child = next(children, None)
        if child is None:
            stack.pop()
            for slot in nodes[node_id].slot_variables:  # after the node's children, as TF lists them
                if 0 <= slot.slot_variable_node_id < len(nodes):
                    rows.append({"depth": depth, "slot": slot.slot_name,
                                 "of": paths.get(slot.original_variable_node_id, "?"),
                                 **describe(slot.slot_variable_node_id)})
            continue
        path = f"{paths[node_id]}/{_keys.escape(child.local_name)}".lstrip("/")
        if paths.get(child.node_id) != path:
            rows.append({"depth": depth, "name": child.local_name, "path": path,
                         "same_as": paths.get(child.node_id, "?")})
            continue
        rows.append({"depth": depth, "name": child.local_name, "path": path, **describe(child.node_id)})
        stack.append((child.node_id, depth + 1, iter(nodes[child.node_id].children)))
    return rows


def _graph_rows(graph, reader) -> tuple[list[dict[str, Any]], set[str]]:
    """The checkpoint's object graph as rows (see `_tree_rows`), and the keys it reaches."""
    nodes, reader_keys = graph.nodes, set(reader.keys())
    seen: set[str] = set()

    def describe(node_id: int) -> dict[str, Any]:
        values = []
        for attr in nodes[node_id].attributes:
            seen.add(attr.checkpoint_key)
            values.append(_value_info(reader, attr.checkpoint_key, attr.name) if attr.checkpoint_key in reader_keys
                          else {"key": attr.checkpoint_key, "missing": True})
        return {"values": values}

    return _tree_rows(nodes, describe), seen


def _row_label(row: dict[str, Any]) -> str:
    if "same_as" in row:
        return f"{row['name']} -> same object as {row['same_as']}"
    head = f"slot {row['slot']!r} of {row['of']}" if "slot" in row else row["name"]
    info = "; ".join(map(_value_label, row.get("values", [])))
    if "kind" in row:  # an export's object, or a key outside the object graph
        info = " ".join(x for x in (row["kind"], info) if x) + (f", {row['note']}" if "note" in row else "")
    return f"{head}  {info}" if info else head


# Deeper than this, rich's tree guides leave no room for the names: the tree is printed as indented text.
_RICH_TREE_DEPTH = 24


def _print_tree(title: str, rows: list[dict[str, Any]], footer: str) -> None:
    if _is_terminal() and max((r["depth"] for r in rows), default=0) < _RICH_TREE_DEPTH:
        from rich.text import Text
        from rich.tree import Tree

        # Text, not markup: names may hold brackets.
        root = Tree(Text(_safe(title)))
        stack = [root]
        for row in rows:
            del stack[row["depth"] + 1:]
            stack.append(stack[row["depth"]].add(Text(_safe(_row_label(row)))))
        console = _console()
        console.print(root)
        console.print(_safe(footer), markup=False)
        return
    _print(title)
    for row in rows:
        _print("  " * (row["depth"] + 1) + _row_label(row))
    _print(footer)


def _total(n: int, total: int) -> str:
    return f"{n} values, {_human(total)}" + (f" ({total} bytes)" if total >= 1024 else "")


def _inspect(args) -> int:
    if _is_export(args.path):
        return _inspect_export(args)
    if _is_saved_model(args.path):
        return _inspect_saved_model(args)
    reader = _storage.open_reader(args.path)
    if args.key is not None:
        return _inspect_key(reader, args.key, args.json)
    keys = _key_list(reader)
    total = 0
    for key in keys:
        total += _nbytes(reader, key)
    where = getattr(reader, "prefix", None) or getattr(reader, "path", args.path)
    title = f"{where}: {_format_name(reader)}"
    footer = _total(len(keys), total)
    graph = _graph(reader)
    rows, seen = _graph_rows(graph, reader) if graph is not None else ([], set())
    slices = getattr(reader, "get_slices", lambda key: [])
    if args.json:
        _print_json({"path": where, "format": _format_name(reader), "values": len(keys), "bytes": total,
                     "objects": rows if graph is not None else None,
                     "keys": [{**_value_info(reader, k, _keys.VARIABLE_VALUE), "slices": len(slices(k)),
                               "in_object_graph": k in seen} for k in keys]})
        return 0
    if graph is not None:
        rows += [{"depth": 0, "name": f"{k} (outside the object graph)", "kind": " ".join(map(str, _describe(
            reader, k)[:2]))} for k in keys if k not in seen]
        _print_tree(title, rows, footer)
        return 0
    table = [(k, *_describe(reader, k), f"{len(slices(k))} slices" if slices(k) else "") for k in keys]
    if _is_terminal():
        from rich.table import Table
        from rich.text import Text

        t = Table(title=Text(_safe(title)), caption=footer)
        for col in ("name", "dtype", "shape", "bytes", "saved as"):
            t.add_column(col, justify="right" if col == "bytes" else "left")
        for name, dtype, shape, size, note in table:
            t.add_row(Text(_safe(name)), dtype, shape, _human(size), note)
        _console().print(t)
    else:
        _print(title)
        width = max((len(_safe(r[0])) for r in table), default=4)
        for name, dtype, shape, size, note in table:
            _print(f"  {_safe(name):<{width}}  {dtype:<8} {shape:<14} {_human(size):>9}  {note}".rstrip())
        _print(footer)
    return 0


def _inspect_key(reader, key: str, as_json: bool = False) -> int:
    keys = set(reader.keys())
    if key not in keys and key + _VALUE_SUFFIX in keys:
        key += _VALUE_SUFFIX
    if key not in keys:
        near = sorted(k for k in keys if key.split("/")[-1] in k)[:5]
        hint = f"; similar keys: {near}" if near else "; list them with `inspect PATH`"
        raise _UsageError(f"no key {key!r} in the checkpoint{hint}")
    value = np.asarray(reader.get(key))
    dtype, shape, size = _describe(reader, key)
    fields: dict[str, Any] = {"key": key, "dtype": dtype, "shape": shape, "bytes": size}
    flat = value.ravel()
    if _dtypes.is_real(value.dtype) and flat.size:
        x = flat if value.dtype.kind in "iu" else flat.astype(np.float64)
        fields.update(min=x.min().item(), max=x.max().item(), mean=x.astype(np.float64).mean().item())
    elif value.dtype.kind == "c" and flat.size:
        fields.update({"max abs": np.abs(flat).max().item(), "mean": flat.mean().item()})
    first = ([x if len(x) <= 40 else x[:40] + b"..." for x in flat[:10]] if _is_str(value.dtype)
             else flat[:10].tolist())
    if as_json:
        fields.update({"shape": list(reader.shape(key)), "first values": [_json_value(x) for x in first],
                       "more values": flat.size > 10})
        _print_json({k.replace(" ", "_"): v if isinstance(v, list) else _json_value(v) for k, v in fields.items()})
        return 0
    for name, v in fields.items():
        _print(f"{name}: {v}")
    _print(f"first values: {first}{' ...' if flat.size > 10 else ''}")
    return 0


def _json_value(x: Any) -> Any:
    """One value of a checkpoint as JSON data: bytes as text, complex as [re, im], ml_dtypes' numbers as float."""
    if isinstance(x, bytes):
        return x.decode("utf-8", "backslashreplace")
    if isinstance(x, complex):
        return [_number(x.real), _number(x.imag)]
    if isinstance(x, (bool, int, str)):
        return x
    return _number(float(x))


# --- exports -----------------------------------------------------------------------
def _is_export(path: str) -> bool:
    return os.path.isdir(path) and os.path.lexists(os.path.join(path, "export.pb"))


def _is_saved_model(path: str) -> bool:
    from checkpoint._saved_model import is_saved_model  # protos only: no jax

    return os.path.isdir(path) and is_saved_model(path)


def _open(path: str):
    """A reader for a checkpoint, or for the variables of an export or a TF SavedModel."""
    if _is_saved_model(path):
        from checkpoint._saved_model import VARIABLES_PREFIX

        prefix = os.path.join(path, VARIABLES_PREFIX)
        if not os.path.isfile(prefix + ".index"):
            raise _UsageError(f"{path}: the SavedModel has no variables ({VARIABLES_PREFIX}.index is missing)")
        return _storage.open_reader(prefix)
    return _storage.open_reader(os.path.join(path, "variables", "variables") if _is_export(path) else path)


class _Node:
    """A SavedModel node shaped as `_tree_rows` walks an object graph's nodes."""

    def __init__(self, children: dict[str, int]) -> None:
        self.children = [argparse.Namespace(node_id=i, local_name=name) for name, i in children.items()]
        self.slot_variables: list = []


def _spec_json(spec) -> dict[str, Any]:
    return {"dtype": "string" if spec.dtype is not None and _is_str(spec.dtype) else
            None if spec.dtype is None else spec.dtype.name,
            "shape": None if spec.shape is None else list(spec.shape), "tensor": spec.tensor,
            **({} if spec.encoding == "name" else {"encoding": spec.encoding})}


def _spec_text(name: str, spec: dict[str, Any]) -> str:
    shape = "unknown rank" if spec["shape"] is None else "(" + ", ".join(
        "?" if d is None else str(d) for d in spec["shape"]) + ("," if len(spec["shape"]) == 1 else "") + ")"
    return f"{name}: {spec['dtype'] or 'unknown dtype'} {shape}"


def _inspect_saved_model(args) -> int:
    """A TF SavedModel: tags, signatures with their inputs and outputs, the object tree with variables and assets."""
    from checkpoint._saved_model import read_saved_model

    if args.key is not None:
        return _inspect_key(_open(args.path), args.key, args.json)
    sm = read_saved_model(args.path)
    nodes = [_Node(n.children) for n in sm.nodes]

    def describe(node_id: int) -> dict[str, Any]:
        n = sm.nodes[node_id]
        if n.kind == "variable":
            value = sm.variables.get(n.path) if n.path is not None else None
            info: dict[str, Any] = {"dtype": "string" if n.dtype is not None and _is_str(n.dtype) else
                                    None if n.dtype is None else n.dtype.name,
                                    "shape": None if n.shape is None else list(n.shape)}
            if value is not None:
                info["bytes"] = (sum(len(x) for x in np.asarray(value).ravel()) if _is_str(value.dtype)
                                 else int(value.nbytes))
            label = f"variable {n.name!r}" + ("" if n.trainable else ", not trainable")
            return {"kind": label, "variable": {"name": n.name, "trainable": n.trainable, **info}}
        if n.kind == "asset":
            return {"kind": f"asset {os.path.basename(n.asset_path or '')}", "asset": n.asset_path}
        if n.kind == "user_object":
            return {"kind": n.identifier or "object", "type": n.identifier}
        return {"kind": n.kind or "unknown kind"}

    rows = _tree_rows(nodes, describe)
    for row in rows:
        v = row.get("variable")
        if v is not None and "same_as" not in row:
            shape = "unknown rank" if v["shape"] is None else str(tuple(v["shape"]))
            size = f" {_human(v['bytes'])}" if "bytes" in v else ""
            row["kind"] = f"{row['kind']}  {v['dtype']} {shape}{size}"
    signatures = [{"name": sig.name, "method_name": sig.method_name,
                   "inputs": {k: _spec_json(x) for k, x in sig.inputs.items()},
                   "outputs": {k: _spec_json(x) for k, x in sig.outputs.items()}} for sig in sm.signatures.values()]
    total = sum(r["variable"].get("bytes", 0) for r in rows if "variable" in r and "same_as" not in r)
    n_values = len(sm.variables)
    if args.json:
        _print_json({"path": sm.path, "format": "saved_model", "tags": list(sm.tags),
                     "tensorflow_version": sm.tensorflow_version, "values": n_values, "bytes": total,
                     "variables_prefix": sm.variables_prefix, "objects": rows, "signatures": signatures,
                     "assets": dict(sm.assets)})
        return 0
    title = (f"{sm.path}: TF SavedModel (tags: {', '.join(sm.tags) or 'none'}; "
             f"written by TensorFlow {sm.tensorflow_version or 'unknown'})")
    _print_tree(title, rows, _total(n_values, total))
    for sig in signatures:
        ins = ", ".join(_spec_text(k, v) for k, v in sig["inputs"].items())
        outs = ", ".join(_spec_text(k, v) for k, v in sig["outputs"].items())
        _print(f"signature {sig['name']}: ({ins}) -> ({outs})")
    for path, file in sm.assets.items():
        _print(f"asset {path}: {file}")
    return 0


def _inspect_export(args) -> int:
    """An export's objects, and each signature's inputs, outputs, platforms and the values it reads."""
    from checkpoint._export import _coder, _format, _load  # jax: deserializing a function needs it

    directory = os.path.abspath(args.path)
    definition = _load.read_definition(directory)
    reader = _open(directory)
    if args.key is not None:
        return _inspect_key(reader, args.key, args.json)
    graph, bundle_graph = definition.object_graph, _graph(reader)
    nodes = graph.nodes
    reader_keys = set(reader.keys())
    names = {_format.WRAPPERS[t]: t.__name__ for t in _format.WRAPPERS}
    names[_format.SIGNATURE_MAP] = "signature map"

    def describe(node_id: int) -> dict[str, Any]:
        node = nodes[node_id]
        kind = node.WhichOneof("kind")
        if kind == "variable":
            v = node.variable
            key = _variable_key(bundle_graph, node_id)
            info = _value_info(reader, key, _keys.VARIABLE_VALUE) if key in reader_keys else {"key": key,
                                                                                               "missing": True}
            return {"kind": f"variable {v.name!r}", "variable": {"name": v.name, "trainable": v.trainable},
                    "values": [info], **({} if v.trainable else {"note": "not trainable"})}
        if kind == "constant":
            key = node.constant.operation
            if key not in reader_keys:
                return {"kind": "constant", "values": [{"key": key, "missing": True}]}
            if key.endswith(_keys.value_suffix(_keys.PY_STATE)):
                item = np.asarray(reader.get(key)).item()
                item = item.decode("utf-8", "backslashreplace") if isinstance(item, bytes) else item
                shown = repr(item) if len(repr(item)) <= 40 else repr(item)[:40] + "..."
                return {"kind": f"python {type(item).__name__} {shown}", "python_value": _number(item)}
            return {"kind": "constant", "values": [_value_info(reader, key, _keys.VARIABLE_VALUE)]}
        if kind == "asset":
            i = node.asset.asset_file_def_index
            files = definition.asset_file_def
            name = files[i].filename if 0 <= i < len(files) else f"<asset index {i} outside the export>"
            return {"kind": f"asset {name}", "asset": name}
        if kind == "bare_concrete_function":
            return {"kind": f"function {node.bare_concrete_function.concrete_function_name}",
                    "function": node.bare_concrete_function.concrete_function_name}
        if kind == "user_object":
            uo = node.user_object
            shown = names.get(uo.identifier) or (uo.metadata if uo.identifier == _format.GENERIC else
                                                 f"{uo.identifier} ({uo.metadata})" if uo.metadata else uo.identifier)
            return {"kind": shown or "object", "type": uo.identifier, "python_type": uo.metadata}
        return {"kind": f"unknown kind {kind!r}"}

    rows = _tree_rows(nodes, describe)
    paths = _bfs_paths(nodes)
    signatures = []
    for row in rows:
        if "function" not in row or "same_as" in row:
            continue
        name, label = row["function"], row["path"].removeprefix("signatures/")
        fn = graph.concrete_functions.get(name)
        if fn is None:
            raise _UsageError(f"{directory}: signature {label!r} names function {name!r}, which the export does not "
                              "have (the export is damaged)")
        exported = _load.read_function(directory, definition, name, label)
        inputs = _coder.structure_json(fn.canonicalized_input_signature)
        # ((args...), {}) as TF writes it: the positional arguments, as a list
        positional = inputs["tuple"][0]["tuple"] if inputs and "tuple" in inputs and inputs["tuple"] else inputs
        signatures.append({"name": label, "function": name, "inputs": positional,
                           "outputs": _coder.structure_json(fn.output_signature),
                           "platforms": list(exported.platforms),
                           "reads": [paths.get(n, f"node {n}") for n in fn.bound_inputs]})
    keys = _key_list(reader)
    total, n_values = sum(_nbytes(reader, k) for k in keys), len(keys)
    version = definition.version.producer
    if args.json:
        _print_json({"path": directory, "format": "export", "format_version": version, "values": n_values,
                     "bytes": total, "objects": rows, "signatures": signatures})
        return 0
    text = _coder.structure_text
    args_text = lambda x: f"({', '.join(map(text, x))})" if isinstance(x, list) else text(x)
    lines = [f"signature {s['name']}: {args_text(s['inputs'])} -> {text(s['outputs'])}"
             f"  platforms: {', '.join(s['platforms'])}  reads: {', '.join(s['reads']) or 'nothing'}"
             for s in signatures]
    _print_tree(f"{directory}: export (format version {version})", rows, _total(n_values, total))
    for line in lines:
        _print(line)
    return 0


def _variable_key(graph, node_id: int) -> str:
    """The key of variable `node_id` in an export's bundle: the bundle's object graph numbers nodes as the export's."""
    if graph is None or not 0 <= node_id < len(graph.nodes) or not graph.nodes[node_id].attributes:
        return f"<no value for node {node_id}>"
    return graph.nodes[node_id].attributes[0].checkpoint_key


# --- convert -------------------------------------------------------------------
def _read_all(reader, keys: list[str], what: str) -> Iterator[tuple[str, np.ndarray]]:
    """Yields (key, value), with a progress bar over the bytes when stdout is a terminal."""
    if not _is_terminal():
        for key in keys:
            yield key, reader.get(key)
        return
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn

    sizes = {k: _nbytes(reader, k) for k in keys}
    columns = (TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TimeRemainingColumn())
    with Progress(*columns, console=_console(), transient=True) as progress:
        task = progress.add_task(what, total=sum(sizes.values()))
        for key in keys:
            yield key, reader.get(key)
            progress.advance(task, sizes[key])


def _same(a: np.ndarray, b: np.ndarray) -> bool:
    a, b = np.asarray(a), np.asarray(b)
    if a.shape != b.shape:
        return False
    if _is_str(a.dtype) and _is_str(b.dtype):
        return all(bytes(x) == bytes(y) for x, y in zip(a.ravel(), b.ravel(), strict=True))
    if a.dtype != b.dtype:
        return False
    # Bitwise: NaNs and signed zeros must survive a conversion unchanged.
    return a.tobytes() == b.tobytes()


def _write_orbax(path: str, tensors: dict[str, np.ndarray], graph: Any) -> None:
    from checkpoint._storage import _orbax
    from checkpoint.protos.trackable_object_graph_pb2 import TrackableObjectGraph

    values: dict[str, Any] = dict(tensors)
    for key, value in tensors.items():
        if _is_str(value.dtype):
            # A scalar string (a Python str saved as TF's py_state) is kept as a Python str value.
            try:
                values[key] = bytes(value.item()).decode() if value.shape == () else None
            except UnicodeDecodeError:
                values[key] = None
            if values[key] is None:
                raise _UsageError(f"{key!r} is a string tensor, which the orbax format cannot hold; convert --to tf")
    # A name-based checkpoint keeps its names as keys, with an empty object graph.
    tree, meta = _orbax.layout(values, graph if graph is not None else TrackableObjectGraph())
    checkpointer = _orbax.checkpointer()
    try:
        checkpointer.save(os.path.abspath(path), args=_orbax.save_args(tree, meta))
    finally:
        checkpointer.close()


def _convert(args) -> int:
    if os.path.exists(args.dst) or os.path.exists(args.dst + ".index"):
        raise _UsageError(f"destination {args.dst!r} already exists; remove it or choose another path")
    reader = _open(args.src)
    keys = _key_list(reader)
    tensors = dict(_read_all(reader, keys, "reading"))
    graph = _graph(reader)
    if args.to == "tf":
        _storage.write_bundle(args.dst, {**tensors, _GRAPH_KEY: graph.SerializeToString()} if graph else tensors)
    else:
        _write_orbax(args.dst, tensors, graph)
    back = _storage.open_reader(args.dst)
    if set(_key_list(back)) != set(keys):
        raise _UsageError(f"verification failed: {args.dst!r} holds keys {_key_list(back)}, expected {keys}")
    if _graph(back) != graph:
        raise _UsageError(f"verification failed: the object graph of {args.dst!r} differs from the source's")
    for key, value in _read_all(back, keys, "verifying"):
        if not _same(value, tensors[key]):
            raise _UsageError(f"verification failed: {key!r} in {args.dst!r} differs from the source")
    total = sum(_nbytes(back, k) for k in keys)
    print(f"wrote {args.dst} ({args.to}): {len(keys)} values, {_human(total)}; verified by reading it back")
    return 0


# --- diff ----------------------------------------------------------------------
def _max_abs_diff(a: np.ndarray, b: np.ndarray) -> float:
    if _is_str(a.dtype):
        return 0.0 if _same(a, b) else float("inf")
    if a.size == 0:
        return 0.0
    if a.dtype.kind == "b":
        return float(np.any(a != b))
    if a.dtype.kind in "iu":
        # Exact in uint64 (modular subtraction of the larger minus the smaller): float64
        # would call 2**60 and 2**60 + 1 equal.
        wide = np.int64 if a.dtype.kind == "i" else np.uint64
        ua, ub = a.astype(wide).view(np.uint64), b.astype(wide).view(np.uint64)
        d = np.where(a.astype(wide) >= b.astype(wide), ua - ub, ub - ua)
        return float(int(d.max()))
    wide = np.complex128 if a.dtype.kind == "c" else np.float64
    a, b = a.astype(wide), b.astype(wide)
    d = np.abs(a - b)
    nan_a, nan_b = np.isnan(a), np.isnan(b)
    if np.any(nan_a != nan_b):
        return float("nan")
    d = d[~nan_a]  # NaN in both at the same place counts as equal
    return float(d.max()) if d.size else 0.0


def _diff(args) -> int:
    ra, rb = _open(args.a), _open(args.b)
    ka, kb = set(_key_list(ra)), set(_key_list(rb))
    report: dict[str, Any] = {"a": args.a, "b": args.b, "atol": args.atol}
    spec = lambda r, k: {"key": k, "dtype": _describe(r, k)[0], "shape": list(r.shape(k))}
    report["only_in_a"] = [spec(ra, k) for k in sorted(ka - kb)]
    report["only_in_b"] = [spec(rb, k) for k in sorted(kb - ka)]
    ga, gb = _graph(ra), _graph(rb)
    report["object_graph"] = ("only in A" if gb is None else "only in B") if (ga is None) != (gb is None) else (
        "differs" if ga != gb else "same" if ga is not None else "none")
    report["dtype_or_shape_differs"], report["values"] = [], []
    for key in sorted(ka & kb):
        a, b = spec(ra, key), spec(rb, key)
        if (a["dtype"], a["shape"]) != (b["dtype"], b["shape"]):
            report["dtype_or_shape_differs"].append({"key": key, "a": a, "b": b})
            continue
        d = _max_abs_diff(np.asarray(ra.get(key)), np.asarray(rb.get(key)))
        report["values"].append({"key": key, "max_abs_diff": d, "match": d <= args.atol})  # NaN: never a match
    differ = bool(report["only_in_a"] or report["only_in_b"] or report["dtype_or_shape_differs"]
                  or report["object_graph"] in ("only in A", "only in B", "differs")
                  or not all(v["match"] for v in report["values"]))
    report["shared_keys"], report["match"] = len(ka & kb), not differ
    if args.only_diff:
        report["values"] = [v for v in report["values"] if not v["match"]]
    if args.json:
        for v in report["values"]:
            v["max_abs_diff"] = _number(v["max_abs_diff"])
        _print_json(report)
        return 1 if differ else 0
    lines = [f"only in A: {x['key']}  {x['dtype']} {tuple(x['shape'])}" for x in report["only_in_a"]]
    lines += [f"only in B: {x['key']}  {x['dtype']} {tuple(x['shape'])}" for x in report["only_in_b"]]
    if report["object_graph"] in ("only in A", "only in B", "differs"):
        lines.append(f"object graph: {report['object_graph']}")
    lines += [f"differs: {x['key']}: A {x['a']['dtype']} {tuple(x['a']['shape'])}, B {x['b']['dtype']} "
              f"{tuple(x['b']['shape'])}" for x in report["dtype_or_shape_differs"]]
    rows = [(v["key"], f"{v['max_abs_diff']:.6g}", "match" if v["match"] else "DIFFERS") for v in report["values"]]
    verdict = f"{'differ' if differ else 'match'} ({len(ka & kb)} shared keys, atol={args.atol:g})"
    if _is_terminal():
        from rich.table import Table
        from rich.text import Text

        console = _console()
        for line in lines:
            console.print(_safe(line), markup=False)
        t = Table(title="shared keys" + (" that differ" if args.only_diff else ""), caption=verdict)
        for col in ("key", "max |A - B|", ""):
            t.add_column(col)
        for row in rows:
            t.add_row(Text(_safe(row[0])), *row[1:])
        console.print(t)
    else:
        for line in lines:
            _print(line)
        width = max((len(_safe(r[0])) for r in rows), default=3)
        for key, d, word in rows:
            _print(f"{_safe(key):<{width}}  max|A-B|={d:<10} {word}")
        _print(verdict)
    return 1 if differ else 0


# --- entry point ----------------------------------------------------------------
def _version() -> str:
    from importlib import metadata  # not jax: `--version` stays instant

    try:
        return metadata.version("varstate")
    except metadata.PackageNotFoundError:
        return "unknown (varstate is not installed; running from a source tree)"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=_PROG, description="Inspect, convert and compare TF and orbax checkpoints, "
                                                        "and inspect exports.")
    p.add_argument("--version", action="version", version=f"{_PROG} {_version()}")
    sub = p.add_subparsers(dest="command", required=True)
    i = sub.add_parser("inspect", help="the object graph (or name list) with shapes, dtypes and sizes; for an "
                                       "export, also each signature's inputs, outputs and platforms")
    i.add_argument("path", help="a checkpoint directory, prefix, or `checkpoint` state file, an export directory, "
                                "or a TF SavedModel directory")
    i.add_argument("--key", help="print one value's summary (min/max/mean, first values)")
    i.add_argument("--json", action="store_true", help="print JSON instead of text")
    i.set_defaults(run=_inspect)
    c = sub.add_parser("convert", help="write a checkpoint in another format and verify it")
    c.add_argument("src", help="a checkpoint, or an export or TF SavedModel directory (its variables)")
    c.add_argument("dst", help="a TF prefix for --to tf, a directory for --to orbax")
    c.add_argument("--to", required=True, choices=("orbax", "tf"))
    c.set_defaults(run=_convert)
    d = sub.add_parser("diff", help="keys, shapes, dtypes and values of two checkpoints (exit 0: match, 1: differ)")
    d.add_argument("a", help="a checkpoint, or an export or TF SavedModel directory (its variables)")
    d.add_argument("b")
    d.add_argument("--atol", type=float, default=0.0, help="largest absolute difference still a match (default 0)")
    d.add_argument("--only-diff", action="store_true", help="list only the shared keys whose values differ")
    d.add_argument("--json", action="store_true", help="print JSON instead of text")
    d.set_defaults(run=_diff)
    return p


def main(argv: list[str] | None = None) -> int:
    """Runs the command line; returns the exit status (0 ok / match, 1 differ, 2 error).

    >>> import checkpoint._cli as cli
    >>> cli.main(["inspect", "/nonexistent/ckpt"])  # the error goes to stderr, one line
    2
    """
    try:
        args = _parser().parse_args(argv)
    except SystemExit as e:  # argparse has printed usage and the error, or --help / --version
        return int(e.code or 0)
    try:
        return args.run(args)
    except BrokenPipeError:  # stdout closed early (`| head`): stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except KeyboardInterrupt:
        print(f"{_PROG}: interrupted", file=sys.stderr)
        return 130
    except RecursionError:  # a library walking a file's nesting recursively (the CLI's own walks do not)
        where = next(getattr(args, name) for name in ("path", "src", "a") if hasattr(args, name))
        print(f"{_PROG}: error: {_safe(where)}: its object graph nests too deeply for this command", file=sys.stderr)
        return 2
    except (_UsageError, OSError, ValueError, TypeError, KeyError, NotImplementedError, RuntimeError) as e:
        message = e.args[0] if isinstance(e, KeyError) and e.args else e
        text = " ".join(str(message).split())
        print(f"{_PROG}: error: {_safe(text)}", file=sys.stderr)
        return 2
