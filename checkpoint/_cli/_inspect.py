"""`varstate-ckpt inspect`: a checkpoint's object graph or name list, one value, an export, a TF SavedModel."""

from __future__ import annotations

import argparse
import os
from typing import Any

import numpy as np

from checkpoint import _dtypes, _keys, _storage
from checkpoint._cli import _out as out

_VALUE_SUFFIX = _keys.value_suffix()


# --- inspect -------------------------------------------------------------------
def _value_info(reader, key: str, attribute: str = _keys.VARIABLE_VALUE) -> dict[str, Any]:
    if key not in reader:
        return {"key": key, "missing": True}
    dtype, _, size = out.describe_value(reader, key)
    info = {"key": key, "dtype": dtype, "shape": list(reader.shape(key)), "bytes": size}
    return info if attribute == _keys.VARIABLE_VALUE else {**info, "attribute": attribute}


def _value_label(info: dict[str, Any]) -> str:
    if info.get("missing"):
        return f"missing value {info['key']!r}"
    extra = f" [{info['attribute']}]" if "attribute" in info else ""
    return f"{info['dtype']} {tuple(info['shape'])} {out.human(info['bytes'])}{extra}"


def _tree_rows(nodes, describe) -> list[dict[str, Any]]:
    """The object graph as rows, depth first: each object under its first path, later paths as `same_as`.

    `describe(node_id)` gives a row's fields for a node. A stack, not recursion: the depth of the graph is
    the file's to choose, and a chain of thousands of objects must print.
    """
    paths = _keys.key_paths(nodes)
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
        path = _keys.child_path(None if node_id == 0 else paths[node_id], child.local_name)
        if paths.get(child.node_id) != path:
            rows.append({"depth": depth, "name": child.local_name, "path": path,
                         "same_as": paths.get(child.node_id, "?")})
            continue
        rows.append({"depth": depth, "name": child.local_name, "path": path, **describe(child.node_id)})
        stack.append((child.node_id, depth + 1, iter(nodes[child.node_id].children)))
    return rows


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
    if out.is_terminal() and max((r["depth"] for r in rows), default=0) < _RICH_TREE_DEPTH:
        from rich.text import Text
        from rich.tree import Tree

        # Text, not markup: names may hold brackets.
        root = Tree(Text(out.safe(title)))
        stack = [root]
        for row in rows:
            del stack[row["depth"] + 1:]
            stack.append(stack[row["depth"]].add(Text(out.safe(_row_label(row)))))
        console = out.console()
        console.print(root)
        console.print(out.safe(footer), markup=False)
        return
    out.say(title)
    for row in rows:
        out.say("  " * (row["depth"] + 1) + _row_label(row))
    out.say(footer)


def _total(n: int, total: int) -> str:
    return f"{n} values, {out.human(total)}" + (f" ({total} bytes)" if total >= 1024 else "")


def inspect(args) -> int:
    if os.path.isdir(args.path):
        if os.path.lexists(os.path.join(args.path, _storage.EXPORT_FILE)):
            return _inspect_export(args)
        # With --key, a SavedModel's variables are read as the checkpoint they are, below.
        if args.key is None and os.path.isfile(os.path.join(args.path, _storage.SAVED_MODEL_FILE)):
            return _inspect_saved_model(args)
    reader = _storage.open_reader(args.path)
    if args.key is not None:
        return _inspect_key(reader, args.key, args.json)
    keys = out.key_list(reader)
    total = sum(out.nbytes(reader, k) for k in keys)
    title, footer = f"{reader.path}: {reader.format_name}", _total(len(keys), total)
    graph = out.object_graph(reader)
    rows = [] if graph is None else _tree_rows(graph.nodes, lambda node_id: {"values": [
        _value_info(reader, attr.checkpoint_key, attr.name) for attr in graph.nodes[node_id].attributes]})
    seen = {value["key"] for row in rows for value in row.get("values", ())}  # the keys the object graph reaches
    slices = reader.get_slices
    if args.json:
        out.print_json({"path": reader.path, "format": reader.format_name, "values": len(keys), "bytes": total,
                        "objects": rows if graph is not None else None,
                        "keys": [{**_value_info(reader, k), "slices": len(slices(k)), "in_object_graph": k in seen}
                                 for k in keys]})
        return 0
    if graph is not None:
        rows += [{"depth": 0, "name": f"{k} (outside the object graph)", "kind": " ".join(map(str, out.describe_value(
            reader, k)[:2]))} for k in keys if k not in seen]
        _print_tree(title, rows, footer)
        return 0
    table = [(k, *out.describe_value(reader, k), f"{len(slices(k))} slices" if slices(k) else "") for k in keys]
    if out.is_terminal():
        from rich.table import Table
        from rich.text import Text

        t = Table(title=Text(out.safe(title)), caption=footer)
        for col in ("name", "dtype", "shape", "bytes", "saved as"):
            t.add_column(col, justify="right" if col == "bytes" else "left")
        for name, dtype, shape, size, note in table:
            t.add_row(Text(out.safe(name)), dtype, shape, out.human(size), note)
        out.console().print(t)
    else:
        out.say(title)
        width = max((len(out.safe(r[0])) for r in table), default=4)
        for name, dtype, shape, size, note in table:
            out.say(f"  {out.safe(name):<{width}}  {dtype:<8} {shape:<14} {out.human(size):>9}  {note}".rstrip())
        out.say(footer)
    return 0


def _inspect_key(reader, key: str, as_json: bool = False) -> int:
    keys = set(reader.keys())
    if key not in keys and key + _VALUE_SUFFIX in keys:
        key += _VALUE_SUFFIX
    if key not in keys:
        near = sorted(k for k in keys if key.split("/")[-1] in k)[:5]
        hint = f"; similar keys: {near}" if near else "; list them with `inspect PATH`"
        raise out.UsageError(f"no key {key!r} in the checkpoint{hint}")
    value = np.asarray(reader.get(key))
    dtype, shape, size = out.describe_value(reader, key)
    fields: dict[str, Any] = {"key": key, "dtype": dtype, "shape": shape, "bytes": size}
    flat = value.ravel()
    if _dtypes.is_real(value.dtype) and flat.size:
        x = flat if value.dtype.kind in "iu" else flat.astype(np.float64)
        counts = {}
        if value.dtype.kind not in "biu":  # a diverged run's NaN would make every statistic NaN: count them apart
            finite, nan = np.isfinite(x), int(np.isnan(x).sum())
            counts = {"nan": nan, "inf": x.size - int(finite.sum()) - nan}
            x = x[finite]
        if x.size:
            fields.update(min=x.min().item(), max=x.max().item(), mean=x.astype(np.float64).mean().item())
        fields.update(counts)
    elif value.dtype.kind == "c" and flat.size:
        fields.update({"max abs": np.abs(flat).max().item(), "mean": flat.mean().item()})
    first = ([x if len(x) <= 40 else x[:40] + b"..." for x in flat[:10]] if out.is_str(value.dtype)
             else flat[:10].tolist())
    if as_json:
        fields.update({"shape": list(reader.shape(key)), "first values": [_json_value(x) for x in first],
                       "more values": flat.size > 10})
        out.print_json({k.replace(" ", "_"): v if isinstance(v, list) else _json_value(v) for k, v in fields.items()})
        return 0
    finite_only = fields.get("nan", 0) + fields.get("inf", 0) > 0
    for name, v in fields.items():
        out.say(f"{name}: {v}{' (of the finite values)' if finite_only and name in ('min', 'max', 'mean') else ''}")
    out.say(f"first values: {first}{' ...' if flat.size > 10 else ''}")
    return 0


def _json_value(x: Any) -> Any:
    """One value of a checkpoint as JSON data: bytes as text, complex as [re, im], ml_dtypes' numbers as float."""
    if isinstance(x, bytes):
        return x.decode("utf-8", "backslashreplace")
    if isinstance(x, complex):
        return [out.number(x.real), out.number(x.imag)]
    if isinstance(x, (bool, int, str)):
        return x
    return out.number(float(x))


def _spec_json(spec) -> dict[str, Any]:
    return {"dtype": None if spec.dtype is None else out.dtype_name(spec.dtype),
            "shape": None if spec.shape is None else list(spec.shape), "tensor": spec.tensor,
            **({} if spec.encoding == "name" else {"encoding": spec.encoding})}


def _spec_text(name: str, spec: dict[str, Any]) -> str:
    shape = "unknown rank" if spec["shape"] is None else "(" + ", ".join(
        "?" if d is None else str(d) for d in spec["shape"]) + ("," if len(spec["shape"]) == 1 else "") + ")"
    return f"{name}: {spec['dtype'] or 'unknown dtype'} {shape}"


def _inspect_saved_model(args) -> int:
    """A TF SavedModel: tags, signatures with their inputs and outputs, the object tree with variables and assets."""
    from checkpoint._tf._saved_model import read_saved_model

    sm = read_saved_model(args.path)
    # The nodes shaped as `_tree_rows` walks an object graph's nodes (a SavedModel's slot variables are not shown).
    nodes = [argparse.Namespace(slot_variables=[], children=[argparse.Namespace(node_id=i, local_name=name)
                                                             for name, i in n.children.items()]) for n in sm.nodes]

    def describe(node_id: int) -> dict[str, Any]:
        n = sm.nodes[node_id]
        if n.kind == "variable":
            value = sm.variables.get(n.path) if n.path is not None else None
            info: dict[str, Any] = {"dtype": None if n.dtype is None else out.dtype_name(n.dtype),
                                    "shape": None if n.shape is None else list(n.shape)}
            if value is not None:
                info["bytes"] = out.value_bytes(value)
            shape = "unknown rank" if n.shape is None else str(tuple(n.shape))
            size = f" {out.human(info['bytes'])}" if "bytes" in info else ""
            label = f"variable {n.name!r}{'' if n.trainable else ', not trainable'}  {info['dtype']} {shape}{size}"
            return {"kind": label, "variable": {"name": n.name, "trainable": n.trainable, **info}}
        if n.kind == "asset":
            return {"kind": f"asset {os.path.basename(n.asset_path or '')}", "asset": n.asset_path}
        if n.kind == "user_object":
            return {"kind": n.identifier or "object", "type": n.identifier}
        return {"kind": n.kind or "unknown kind"}

    rows = _tree_rows(nodes, describe)
    signatures: list[dict[str, Any]] = [
        {"name": sig.name, "method_name": sig.method_name, "inputs": {k: _spec_json(x) for k, x in sig.inputs.items()},
         "outputs": {k: _spec_json(x) for k, x in sig.outputs.items()}} for sig in sm.signatures.values()]
    total = sum(r["variable"].get("bytes", 0) for r in rows if "variable" in r)
    if args.json:
        out.print_json({"path": sm.path, "format": "saved_model", "tags": list(sm.tags),
                     "tensorflow_version": sm.tensorflow_version, "values": len(sm.variables),
                     "bytes": total, "variables_prefix": sm.variables_prefix, "objects": rows, "signatures": signatures,
                     "assets": dict(sm.assets)})
        return 0
    title = (f"{sm.path}: TF SavedModel (tags: {', '.join(sm.tags) or 'none'}; "
             f"written by TensorFlow {sm.tensorflow_version or 'unknown'})")
    _print_tree(title, rows, _total(len(sm.variables), total))
    for sig in signatures:
        ins, outs = (", ".join(_spec_text(k, v) for k, v in sig[side].items()) for side in ("inputs", "outputs"))
        out.say(f"signature {sig['name']}: ({ins}) -> ({outs})")
    for path, file in sm.assets.items():
        out.say(f"asset {path}: {file}")
    return 0


def _inspect_export(args) -> int:
    """An export's objects, and each signature's inputs, outputs, platforms and the values it reads."""
    from checkpoint._export import _coder, _format, _load  # jax: deserializing a function needs it

    directory = os.path.abspath(args.path)
    definition = _load.read_definition(directory)
    reader = _storage.open_reader(directory)
    if args.key is not None:
        return _inspect_key(reader, args.key, args.json)
    graph, bundle_graph = definition.object_graph, out.object_graph(reader)
    # A variable's value is its node's first attribute in the bundle, whose object graph numbers nodes as the export's.
    value_keys = {i: n.attributes[0].checkpoint_key
                  for i, n in enumerate(bundle_graph.nodes if bundle_graph is not None else []) if n.attributes}
    names = {**{ident: t.__name__ for t, ident in _format.WRAPPERS.items()}, _format.SIGNATURE_MAP: "signature map"}

    def describe(node_id: int) -> dict[str, Any]:
        node = graph.nodes[node_id]
        kind = node.WhichOneof("kind")
        if kind == "variable":
            v = node.variable
            return {"kind": f"variable {v.name!r}", "variable": {"name": v.name, "trainable": v.trainable},
                    "values": [_value_info(reader, value_keys.get(node_id, f"<no value for node {node_id}>"))],
                    **({} if v.trainable else {"note": "not trainable"})}
        if kind == "constant":
            key = node.constant.operation
            if key in reader and key.endswith(_keys.value_suffix(_keys.PY_STATE)):
                item = np.asarray(reader.get(key)).item()
                item = item.decode("utf-8", "backslashreplace") if isinstance(item, bytes) else item
                shown = repr(item) if len(repr(item)) <= 40 else repr(item)[:40] + "..."
                return {"kind": f"python {type(item).__name__} {shown}", "python_value": out.number(item)}
            return {"kind": "constant", "values": [_value_info(reader, key)]}
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

    rows = _tree_rows(graph.nodes, describe)
    paths = _keys.key_paths(graph.nodes)
    signatures = []
    for row in rows:
        if "function" not in row:  # a later path to an object (same_as) is a row without the object's fields
            continue
        name, label = row["function"], row["path"].removeprefix("signatures/")
        fn = graph.concrete_functions.get(name)
        if fn is None:
            raise out.UsageError(f"{directory}: signature {label!r} names function {name!r}, which the export does not "
                              "have (the export is damaged)")
        # inspect runs nothing, so a kernel custom call is shown, not refused (off jax's stable list still is)
        exported = _load.read_function(directory, definition, name, label, trust_custom_calls=True)
        inputs = _coder.structure_json(fn.canonicalized_input_signature)
        # ((args...), {}) as TF writes it: the positional arguments, as a list
        positional = inputs["tuple"][0]["tuple"] if inputs and "tuple" in inputs and inputs["tuple"] else inputs
        signatures.append({"name": label, "function": name, "inputs": positional,
                           "outputs": _coder.structure_json(fn.output_signature),
                           "platforms": list(exported.platforms),
                           "reads": [paths.get(n, f"node {n}") for n in fn.bound_inputs]})
    keys = out.key_list(reader)
    total, n_values = sum(out.nbytes(reader, k) for k in keys), len(keys)
    version = definition.version.producer
    if args.json:
        out.print_json({"path": directory, "format": "export", "format_version": version, "values": n_values,
                     "bytes": total, "objects": rows, "signatures": signatures})
        return 0
    text = _coder.structure_text
    args_text = lambda x: f"({', '.join(map(text, x))})" if isinstance(x, list) else text(x)
    _print_tree(f"{directory}: export (format version {version})", rows, _total(n_values, total))
    for s in signatures:
        out.say(f"signature {s['name']}: {args_text(s['inputs'])} -> {text(s['outputs'])}"
                f"  platforms: {', '.join(s['platforms'])}  reads: {', '.join(s['reads']) or 'nothing'}")
    return 0
