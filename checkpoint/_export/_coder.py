"""The structured-value coder: a pytree of array specs as TF's StructuredValue (a signature's inputs and outputs)."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from checkpoint import _dtypes
from checkpoint.protos import saved_object_graph_pb2 as pb
from checkpoint.protos import types_pb2


def encode_structure(tree: Any) -> pb.StructuredValue:
    """A pytree of specs as TF's StructuredValue (tuples, lists, dicts, None, TensorSpecs)."""
    out = pb.StructuredValue()
    if tree is None:
        out.none_value.SetInParent()
    elif isinstance(tree, dict):
        out.dict_value.SetInParent()
        for k, v in tree.items():
            out.dict_value.fields[str(k)].CopyFrom(encode_structure(v))
    elif isinstance(tree, (list, tuple)):
        (out.list_value if isinstance(tree, list) else out.tuple_value).values.extend(map(encode_structure, tree))
    elif hasattr(tree, "shape") and hasattr(tree, "dtype"):
        spec = out.tensor_spec_value
        spec.dtype = _dtypes.ENUM_OF.get(np.dtype(tree.dtype), types_pb2.DT_INVALID)
        for d in tree.shape:
            symbolic = jax.export.is_symbolic_dim(d)
            spec.shape.dim.add(size=-1 if symbolic else int(d), name=str(d) if symbolic else "")
    else:
        children = jax.tree_util.tree_flatten(tree, lambda x: x is not tree)[0]
        out.tuple_value.values.extend(map(encode_structure, children))
    return out


def structure_json(sv: pb.StructuredValue) -> Any:
    """A StructuredValue as JSON data: a TensorSpec as ``{"dtype", "shape"}`` (a symbolic dimension by its name,
    an unknown one as null), tuples and lists as ``{"tuple": [...]}`` / ``{"list": [...]}``, dicts as
    ``{"dict": {...}}``, None as null."""
    out: list[Any] = [None]  # holds the result, as any container holds a child
    # (value, parent container, key in it): depth is the file's to choose
    stack: list[tuple[Any, Any, Any]] = [(sv, out, 0)]
    while stack:
        value, parent, key = stack.pop()
        kind = value.WhichOneof("kind")
        item: Any = None  # none_value, or a kind this reader does not know
        if kind == "tensor_spec_value":
            spec = value.tensor_spec_value
            dtype = _dtypes.BY_ENUM.get(spec.dtype)
            item = {"dtype": dtype.name if dtype is not None else f"DataType {spec.dtype}",
                    "shape": [d.name or None if d.size < 0 else d.size for d in spec.shape.dim]}
        elif kind in ("tuple_value", "list_value"):
            children = getattr(value, kind).values
            item = {kind.split("_")[0]: [None] * len(children)}
            stack.extend((c, item[kind.split("_")[0]], j) for j, c in enumerate(children))
        elif kind == "dict_value":
            item = {"dict": dict.fromkeys(sorted(value.dict_value.fields))}
            stack.extend((value.dict_value.fields[k], item["dict"], k) for k in item["dict"])
        parent[key] = item
    return out[0]


def structure_text(data: Any) -> str:
    """`structure_json`'s data as one line: ``(float32[n,3], {'k': int32[]})``."""
    parts: list[str] = []
    stack: list[Any] = [data]  # strings and None are emitted as text, the rest is expanded
    while stack:
        item = stack.pop()
        if isinstance(item, str) or item is None:
            parts.append(str(item))
        elif "dtype" in item:
            parts.append(f"{item['dtype']}[{','.join('?' if d is None else str(d) for d in item['shape'])}]")
        else:
            (kind, children), = item.items()
            if kind == "dict":
                seq = [x for k, v in children.items() for x in (f"{k!r}: ", v, ", ")][:-1]
                opened, closed = "{", "}"
            else:
                seq = [x for c in children for x in (c, ", ")][:-1]
                opened, closed = ("(", ",)" if len(children) == 1 else ")") if kind == "tuple" else ("[", "]")
            stack.extend(reversed([opened, *seq, closed]))
    return "".join(parts)
