"""The structured-value coder: a pytree of array specs as TF's StructuredValue (a signature's inputs and outputs)."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from checkpoint import _dtypes
from checkpoint.protos import saved_object_graph_pb2 as pb


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
        spec.dtype = _dtypes.ENUM_OF.get(np.dtype(tree.dtype), 0)
        for d in tree.shape:
            symbolic = jax.export.is_symbolic_dim(d)
            spec.shape.dim.add(size=-1 if symbolic else int(d), name=str(d) if symbolic else "")
    else:
        children = jax.tree_util.tree_flatten(tree, lambda x: x is not tree)[0]
        out.tuple_value.values.extend(map(encode_structure, children))
    return out
