"""`export`: a pytree with its jitted functions as a directory that runs without the code that made it.

`load` (in `_load`) reads it back; the layout and the revived-type registry
are in `_format`.

Functions take the variables and constants they read as explicit inputs (the
`bound_inputs` of their SavedConcreteFunction), so a loaded function computes
with the restored values. Nothing loaded executes Python code from the files.
"""

from __future__ import annotations

import hashlib
import itertools
import os
import pathlib
import re
import shutil
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Literal

from checkpoint import _dtypes, _graph, _keys, _storage
from checkpoint._export import _jax_private
from checkpoint._export._coder import encode_structure
from checkpoint._export._format import (
    GENERIC,
    IDENTIFIER_OF,
    REVIVED,
    SIGNATURE_MAP,
    SIGNATURES,
    VERSION,
    WRAPPERS,
    Asset,
    seal,
)
from checkpoint._graph import _walk
from checkpoint._storage import EXPORT_FILE
from checkpoint._storage._bundle_writer import tf_tensors
from checkpoint._storage._files import replacing
from checkpoint.protos import saved_object_graph_pb2 as pb
from checkpoint.protos import types_pb2
from checkpoint.protos.tensor_shape_pb2 import TensorShapeProto
from checkpoint.protos.versions_pb2 import VersionDef
from varstate import PartitionedVariable, _seam


def export(directory: str | os.PathLike, root: Any,
           signatures: Mapping[str, tuple[Callable[..., Any], tuple[Any, ...]]] | None = None,
           *, platforms: tuple[str, ...] | None = None) -> str:
    """Exports `root` (Variables, arrays, Python scalars, `Asset` files) and its signatures to `directory`.

    `signatures` maps a name to ``(fn, example_args)``: ``fn(root, *args)`` is
    exported with `jax.export` for the shapes and dtypes of `example_args`
    (arrays or `jax.ShapeDtypeStruct`s, pytrees of them; a dimension from
    `jax.export.symbolic_shape` accepts any size). The Variables and arrays
    of `root` that `fn` reads become inputs of the exported function, so the
    loaded one computes with the restored values; anything else `fn` closes
    over is baked in. `platforms` (e.g. ``("cpu", "cuda")``) defaults to the
    current backend. A PRNG key array (bare or in a Variable) is stored as
    a checkpoint stores it, its key data and implementation's name, and
    `load` gives back the key.

    Args:
        directory: where to write; it must not exist or be empty.
        root: a container pytree (dict, list, dataclass...) of Variables,
            arrays, Python scalars and `Asset` objects.
        signatures: ``{name: (fn, example_args)}``, as above; None exports
            none.
        platforms: the platforms the functions are compiled for (e.g.
            ``("cpu", "cuda")``); None is the current backend.

    Returns:
        The directory (a str).

    Raises:
        FileExistsError: `directory` exists and is not empty.
        TypeError: `root` is not a container; a signature that is not
            ``(fn, example_args)`` or whose name is not a non-empty string.
        ValueError: a child named ``signatures`` (reserved), a
            `PartitionedVariable` (not supported), or two Variables with one
            name (from different registries; `load` keeps names exactly).
        FileNotFoundError: an `Asset`'s file is missing.

    >>> import os, tempfile, jax, jax.numpy as jnp, varstate, checkpoint
    >>> params = {"w": varstate.Variable(jnp.full((3, 2), 0.5), name="w"), "b": varstate.Variable(jnp.ones(2))}
    >>> predict = lambda p, x: x @ p["w"].value + p["b"].value
    >>> batch = jax.ShapeDtypeStruct(jax.export.symbolic_shape("n, 3"), jnp.float32)
    >>> path = checkpoint.export(os.path.join(tempfile.mkdtemp(), "model"), params, {"serve": (predict, (batch,))})
    >>> sorted(os.listdir(path))
    ['export.pb', 'functions', 'variables']
    >>> loaded = checkpoint.load(path)
    >>> loaded.w.name, loaded.signatures["serve"](jnp.ones((4, 3))).shape
    ('w', (4, 2))
    """
    directory = checked_target("export", directory, root)
    signatures = dict(signatures or {})
    is_asset = lambda x: isinstance(x, Asset)
    stripped = jax.tree.map(lambda x: None if is_asset(x) else x, root, is_leaf=is_asset)
    kids = dict(_graph.children(stripped))
    if SIGNATURES in kids or (signatures and SIGNATURES in dict(_graph.children(root))):
        raise ValueError(f"export: the root's child {SIGNATURES!r} is reserved for the signatures; rename it.")
    graph = _graph.build(kids)
    saved = pb.SavedObjectGraph()
    by_key = {s.key: s for s in graph.saveables}
    path_of_name: dict[str, str] = {}
    for i, node in enumerate(graph.proto.nodes):
        out = saved.nodes.add(children=node.children, slot_variables=node.slot_variables)
        if node.attributes:
            _describe_value(out, by_key[node.attributes[0].checkpoint_key], graph.paths[i])
            if out.WhichOneof("kind") == "variable":
                _check_name_unique(path_of_name, out.variable.name, graph.paths[i])
        else:
            _describe_container(out, graph.objects[i] if i else stripped)
    # Replaces an empty directory, or none; never leaves a half export there.
    with replacing(directory) as (tmp,):
        os.makedirs(tmp)
        definition = pb.ExportDef(version=VersionDef(producer=VERSION, min_consumer=1))
        _add_assets(definition, saved, root, tmp)
        _storage.write_bundle(os.path.join(tmp, _storage.VARIABLES_PREFIX),
                              tf_tensors(_graph.values(graph), graph.proto.SerializeToString()))
        _add_signatures(definition, saved, root, signatures, graph, tmp, platforms)
        definition.object_graph.CopyFrom(saved)
        pathlib.Path(tmp, EXPORT_FILE).write_bytes(seal(definition.SerializeToString()))
    return directory


def checked_target(who: str, directory: str | os.PathLike, root: Any) -> str:
    """`directory` made absolute, once it is free to write to and `root` is a container; `who` names the caller."""
    directory = os.path.abspath(os.fspath(directory))
    if os.path.exists(directory) and (not os.path.isdir(directory) or os.listdir(directory)):
        raise FileExistsError(f"{who}: {directory!r} exists and is not an empty directory; pick a new one.")
    if _graph.kind(root) != _graph.Kind.CONTAINER or isinstance(root, Asset):
        raise TypeError(f"{who}: root must be a container pytree (dict, list, dataclass, ...), got "
                        f"{type(root).__name__}; wrap it, e.g. {{'model': root}}.")
    _walk.leaves(root, f"{who}'s root")  # a dict JAX cannot flatten, named before anything is traced
    return directory


def _describe_value(out: pb.SavedObject, s: _graph.Saveable, path: str) -> None:
    var = _graph.as_variable(s.obj)
    if isinstance(s.obj, (PartitionedVariable, list)):
        raise ValueError(f"export: {path!r} is a partitioned variable, which export does not support; "
                         "export the full value as one Variable.")
    if var is None:
        out.constant.operation = s.key  # the value's key in the variables bundle
        return
    v = out.variable
    if _walk.is_prng_key(var.value):
        # Described as the key data the bundle holds; `load` rebuilds the key from it and the node's
        # PRNG_KEY_IMPL value in the variables' object graph, as a checkpoint restore does.
        data = jax.eval_shape(jax.random.key_data, var.value)
        dtype, shape = np.dtype(data.dtype), data.shape
    else:
        dtype, shape = _seam.saved_dtype(var), var.shape
    v.dtype = _dtypes.ENUM_OF.get(dtype, types_pb2.DT_INVALID)  # as stored in the bundle
    v.shape.dim.extend(TensorShapeProto.Dim(size=d) for d in shape)
    v.trainable, v.name = var.trainable, var.name
    v.synchronization = int(var.synchronization)  # type: ignore[assignment]  # the proto's enum: TF's, same values
    v.aggregation = int(var.aggregation)  # type: ignore[assignment]  # the proto's enum: TF's, same values


def _check_name_unique(path_of_name: dict[str, str], name: str, path: str) -> None:
    """Refuses a second Variable named `name`: `load` keeps names exactly, and one registry holds each name once."""
    first = path_of_name.setdefault(name, path)
    if first != path:
        raise ValueError(f"export: {first!r} and {path!r} are Variables both named {name!r} (made in different "
                         "registries); expected each exported Variable's name once, found it twice, and load would "
                         f"have to rename the second {name + '_1'!r}. Give one of them another name "
                         "(Variable(..., name=...)) or make both in one registry, which names the second itself.")


def _describe_container(out: pb.SavedObject, obj: Any, identifier: str | None = None) -> None:
    uo = out.user_object
    uo.identifier = identifier or IDENTIFIER_OF.get(type(obj)) or WRAPPERS.get(type(obj), GENERIC)
    if obj is not None:
        uo.metadata = f"{type(obj).__module__}.{type(obj).__qualname__}"
    r = REVIVED.get(uo.identifier, [None])[0]
    uo.version.CopyFrom(VersionDef(producer=r.version, min_consumer=r.min_consumer_version,
                                   bad_consumers=r.bad_consumers) if r else VersionDef(producer=1, min_consumer=1))


def _add_child(saved: pb.SavedObjectGraph, parent: int, name: str) -> pb.SavedObject:
    """A new node, the child `name` of node `parent`."""
    saved.nodes[parent].children.add(node_id=len(saved.nodes), local_name=name)
    return saved.nodes.add()


def _node_at(saved: pb.SavedObjectGraph, names: list[str], node: int | None = 0) -> int | None:
    """The node that the child names `names` lead to from `node` (by default the root), or None."""
    for name in names:
        if node is not None:
            node = next((r.node_id for r in saved.nodes[node].children if r.local_name == name), None)
    return node


def _add_assets(definition: pb.ExportDef, saved: pb.SavedObjectGraph, root: Any, tmp: str) -> None:
    copied: dict[str, int] = {}
    for path, asset in jax.tree_util.tree_flatten_with_path(root, is_leaf=lambda x: isinstance(x, Asset))[0]:
        if not isinstance(asset, Asset):
            continue
        names = [_keys.local_name(k) for k in path]
        src = os.path.realpath(asset.asset_path)
        if not os.path.isfile(src):
            raise FileNotFoundError(f"export: asset {'/'.join(names)!r} names {asset.asset_path!r}, not a file.")
        if src not in copied:
            base, ext = os.path.splitext(os.path.basename(src))
            taken = {a.filename for a in definition.asset_file_def}
            candidates = itertools.chain([base + ext], (f"{base}_{n}{ext}" for n in itertools.count(1)))
            name = next(c for c in candidates if c not in taken)
            os.makedirs(os.path.join(tmp, "assets"), exist_ok=True)
            shutil.copyfile(src, os.path.join(tmp, "assets", name))
            copied[src] = len(definition.asset_file_def)
            definition.asset_file_def.add(filename=name)
        parent, obj = 0, root
        for name in names[:-1]:  # containers that held only assets were left out of the graph
            obj = dict(_graph.children(obj))[name]
            child = _node_at(saved, [name], parent)
            if child is None:
                child = len(saved.nodes)
                _describe_container(_add_child(saved, parent, name), obj)
            parent = child
        _add_child(saved, parent, names[-1]).asset.asset_file_def_index = copied[src]


def _add_signatures(definition, saved, root, signatures, graph, tmp, platforms) -> None:
    if not signatures:
        return
    node_of_path = {p: i for i, p in enumerate(graph.paths)}
    node_of_rid = {var.resource_id: node_of_path[_keys.node_path(s.key)]
                   for s in graph.saveables if (var := _graph.as_variable(s.obj)) is not None}
    sig_map = len(saved.nodes)
    _describe_container(_add_child(saved, 0, SIGNATURES), None, SIGNATURE_MAP)
    is_leaf = lambda x: _graph.as_variable(x) is not None or isinstance(x, Asset)
    flat, treedef = jax.tree_util.tree_flatten_with_path(root, is_leaf=is_leaf)
    leaf_nodes = []  # per root leaf: its node if it is passed in as an input, else None (static)
    for path, leaf in flat:
        var = _graph.as_variable(leaf)
        leaf_nodes.append(node_of_rid.get(var.resource_id) if var is not None else _node_at(
            saved, [_keys.local_name(k) for k in path]) if isinstance(leaf, (jax.Array, np.ndarray)) else None)
    for i, (name, entry) in enumerate(sorted(signatures.items())):
        if not isinstance(name, str) or not name:
            raise TypeError(f"export: signature names must be non-empty strings, got {name!r}.")
        fn, example_args = signature_entry("export", name, entry)
        arg_specs = jax.tree.map(_spec, tuple(example_args))
        exported, bound = export_reading(fn, flat, treedef, leaf_nodes, is_leaf, arg_specs, platforms, name)
        fname = f"__inference_{re.sub(r'[^A-Za-z0-9_]', '_', name)}_{i}"
        data = exported.serialize()
        os.makedirs(os.path.join(tmp, "functions"), exist_ok=True)
        pathlib.Path(tmp, "functions", fname).write_bytes(data)
        definition.function_sha256[fname] = hashlib.sha256(data).digest()
        cf = saved.concrete_functions[fname]
        cf.bound_inputs.extend(bound)
        cf.canonicalized_input_signature.CopyFrom(encode_structure((tuple(arg_specs), {})))
        cf.output_signature.CopyFrom(encode_structure(exported.out_tree.unflatten(exported.out_avals)))
        bare = _add_child(saved, sig_map, name).bare_concrete_function
        bare.concrete_function_name, bare.allowed_positional_arguments = fname, len(example_args)


def signature_entry(who: str, name: str, entry: Any) -> tuple[Callable[..., Any], Any]:
    """Signature `name`'s `entry` as ``(fn, example_args)``; `who` names the caller."""
    if not (isinstance(entry, tuple) and len(entry) == 2 and callable(entry[0])
            and isinstance(entry[1], (tuple, list))):
        raise TypeError(f"{who}: signature {name!r} must be (fn, example_args) with fn(root, *example_args), "
                        f"example_args a tuple; got {entry!r}.")
    return entry


def export_reading(fn: Callable[..., Any], flat: list, treedef: Any, leaf_nodes: list[int | None],
                   is_leaf: Callable[[Any], bool], arg_specs: Any, platforms: tuple[str, ...] | None,
                   name: str) -> tuple[jax.export.Exported, list[int]]:
    """`fn` exported with the root leaves it reads of those with a node in `leaf_nodes` as inputs; their nodes."""
    try:
        # A first trace finds the inputs fn reads: only those are bound, as TF captures only what it reads.
        flat_fn, specs, bound = _inputs(fn, flat, treedef, leaf_nodes, is_leaf)
        jaxpr = jax.make_jaxpr(flat_fn)(specs, *arg_specs).jaxpr
        read = [*jaxpr.outvars, *(v for e in jaxpr.eqns for v in e.invars)]
        used = {v for v in read if not isinstance(v, Literal)}
        unused = {n for n, v in zip(bound, jaxpr.invars, strict=False) if v not in used}
        flat_fn, specs, bound = _inputs(fn, flat, treedef, [None if n in unused else n for n in leaf_nodes], is_leaf)
        with _jax_private.file_names_without_directories():  # the function carries no paths of the machine
            exported = jax.export.export(jax.jit(flat_fn), platforms=platforms)(specs, *arg_specs)
    except Exception as e:
        e.add_note(f"while exporting signature {name!r} with jax.export")
        raise
    return exported, bound


def _inputs(fn, flat, treedef, leaf_nodes, is_leaf):
    """``flat_fn(captured, *args)``: fn on the root rebuilt with the captured inputs; their specs and nodes."""
    bound = list(dict.fromkeys(n for n in leaf_nodes if n is not None))  # node ids, in input order
    position = {n: k for k, n in enumerate(bound)}
    slots = [position.get(n) for n in leaf_nodes]
    first = {n: leaf for (_, leaf), n in reversed(list(zip(flat, leaf_nodes, strict=True)))}

    def flat_fn(captured, *args):
        leaves = [_feed(leaf, None if k is None else captured[k]) for (_, leaf), k in zip(flat, slots, strict=True)]
        out = fn(treedef.unflatten(leaves), *args)
        return jax.tree.map(lambda x: _feed(x, None), out, is_leaf=is_leaf)  # Variables out as their values

    return flat_fn, [_spec(first[n]) for n in bound], bound


def _feed(leaf: Any, value: Any) -> Any:
    """`leaf` reading `value` (a traced input) in place of its stored value; a Variable without one: its value."""
    var = _graph.as_variable(leaf)
    if var is not None:
        return var.value if value is None else _graph.rewrap(leaf, _seam.with_value(var, value))
    return leaf if value is None else value


def _spec(x: Any) -> jax.ShapeDtypeStruct:
    x = _feed(x, None)  # a Variable's value
    # No sharding (a ShapeDtypeStruct's is dropped too): the export runs on any one device.
    return jax.ShapeDtypeStruct(np.shape(x), jnp.asarray(x).dtype if not hasattr(x, "dtype") else x.dtype)
