"""`export`: a pytree with its jitted functions as a directory that runs without the code that made it.

`load` (in `_load`) reads it back; the format constants and the revived-type
registry below are shared by both.

Layout of an export directory (TF's SavedModel layout, our own top-level file):

    export.pb                   ExportDef: format version, SavedObjectGraph, asset file names, function digests
    variables/variables.*       TensorBundle with TF's object-graph keys (variables, captured constants)
    functions/<name>            one `jax.export` serialization per signature
    assets/<file>               copies of the exported `Asset` files

Functions take the variables and constants they read as explicit inputs (the
`bound_inputs` of their SavedConcreteFunction), so a loaded function computes
with the restored values. Nothing loaded executes Python code from the files.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import re
import secrets
import shutil
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Literal

from checkpoint import _graph
from checkpoint._bundle import _ENUM_OF, write_bundle
from checkpoint._checkpoint import _tf_tensors, _values
from checkpoint.protos import saved_object_graph_pb2 as pb
from checkpoint.protos.tensor_shape_pb2 import TensorShapeProto
from checkpoint.protos.versions_pb2 import VersionDef
from varstate._partition import PartitionedVariable

_VERSION = 1  # this exporter's format version; a reader accepts min_consumer <= _VERSION
EXPORT_FILE = "export.pb"
SIGNATURES = "signatures"
_WRAPPERS = {dict: "trackable_dict_wrapper", list: "trackable_list_wrapper", tuple: "trackable_tuple_wrapper"}
_GENERIC = "_generic_user_object"
_SIGNATURE_MAP = "signature_map"
_FUNCTION_NAME = re.compile(r"[A-Za-z0-9_]+")


class Asset:
    """A file that goes with an export: copied into ``<export>/assets/``; loaded, `asset_path` points at the copy.

    >>> import pathlib, tempfile, checkpoint
    >>> tmp = pathlib.Path(tempfile.mkdtemp())
    >>> _ = (tmp / "vocab.txt").write_text("a b")
    >>> _ = checkpoint.export(tmp / "out", {"vocab": checkpoint.Asset(tmp / "vocab.txt")})
    >>> pathlib.Path(checkpoint.load(tmp / "out").vocab.asset_path).read_text().split()
    ['a', 'b']
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self.asset_path = os.fspath(path)

    def __repr__(self) -> str:
        return f"Asset({self.asset_path!r})"


@dataclasses.dataclass(frozen=True)
class _Registration:
    cls: type
    version: int
    min_producer_version: int
    min_consumer_version: int
    bad_consumers: tuple[int, ...]
    from_children: Callable[[dict[str, Any]], Any]

    def accepts(self, v: VersionDef) -> bool:  # TF's rule for a revived type
        return self.version >= v.min_consumer and v.producer >= self.min_producer_version and (
            self.version not in v.bad_consumers)


_REVIVED: dict[str, list[_Registration]] = {}  # identifier -> registrations, highest version first
_IDENTIFIER_OF: dict[type, str] = {}


def register_revived_type(identifier: str, cls: type, *, version: int = 1, min_producer_version: int = 1,
                          min_consumer_version: int = 1, bad_consumers: tuple[int, ...] = (),
                          from_children: Callable[[dict[str, Any]], Any] | None = None) -> None:
    """Registers pytree type `cls` under `identifier` so `load` rebuilds it (TF's revived types).

    `export` writes the highest registered `version` with `min_consumer_version`
    and `bad_consumers`. `load` uses the highest registration whose version is
    ``>= min_consumer`` of the file, not among its `bad_consumers`, and whose
    `min_producer_version` the file's version reaches; with none it loads a
    generic object and logs why. `from_children` builds the object from
    ``{child name: loaded child}`` (default ``cls(**children)``, which suits
    dataclasses and NamedTuples). Registering a version again replaces it.

    >>> import dataclasses, os, tempfile, jax, jax.numpy as jnp, varstate, checkpoint
    >>> @jax.tree_util.register_dataclass
    ... @dataclasses.dataclass
    ... class Dense:
    ...     kernel: varstate.Variable
    >>> checkpoint.register_revived_type("example.Dense", Dense, version=2, min_consumer_version=1)
    >>> root = {"dense": Dense(varstate.Variable(jnp.ones(2)))}
    >>> path = checkpoint.export(os.path.join(tempfile.mkdtemp(), "m"), root)
    >>> type(checkpoint.load(path).dense).__name__
    'Dense'
    """
    if not isinstance(identifier, str) or not identifier or identifier in (*_WRAPPERS.values(), _GENERIC,
                                                                           _SIGNATURE_MAP):
        raise ValueError(f"register_revived_type: identifier must be a new non-empty string, got {identifier!r}.")
    if _IDENTIFIER_OF.get(cls, identifier) != identifier:
        raise ValueError(f"register_revived_type: {cls.__qualname__} is already registered as "
                         f"{_IDENTIFIER_OF[cls]!r}; one type has one identifier.")
    reg = _Registration(cls, version, min_producer_version, min_consumer_version, tuple(bad_consumers),
                        from_children or (lambda children: cls(**children)))
    regs = [r for r in _REVIVED.get(identifier, []) if r.version != version] + [reg]
    _REVIVED[identifier] = sorted(regs, key=lambda r: -r.version)
    _IDENTIFIER_OF[cls] = identifier


def export(directory: str | os.PathLike, root: Any,
           signatures: Mapping[str, tuple[Callable[..., Any], tuple[Any, ...]]] | None = None,
           *, platforms: tuple[str, ...] | None = None) -> str:
    """Writes `root` (a pytree of Variables, arrays, Python scalars and `Asset`s) and its signatures.

    `signatures` maps a name to ``(fn, example_args)``: ``fn(root, *args)`` is
    exported with `jax.export` for the shapes and dtypes of `example_args`
    (arrays or `jax.ShapeDtypeStruct`s, pytrees of them; a dimension from
    `jax.export.symbolic_shape` accepts any size). The Variables and arrays
    of `root` that `fn` reads become inputs of the exported function, so the
    loaded one computes with the restored values; anything else `fn` closes
    over is baked in. `platforms` (e.g. ``("cpu", "cuda")``) defaults to the
    current backend. Returns the directory, which must not exist or be empty.

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
    directory = os.path.abspath(os.fspath(directory))
    if os.path.exists(directory) and (not os.path.isdir(directory) or os.listdir(directory)):
        raise FileExistsError(f"export: {directory!r} exists and is not an empty directory; pick a new one.")
    if _graph.kind(root) != _graph.CONTAINER or isinstance(root, Asset):
        raise TypeError(f"export: root must be a container pytree (dict, list, dataclass, ...), got "
                        f"{type(root).__name__}; wrap it, e.g. {{'model': root}}.")
    signatures = dict(signatures or {})
    is_asset = lambda x: isinstance(x, Asset)
    stripped = jax.tree.map(lambda x: None if is_asset(x) else x, root, is_leaf=is_asset)
    kids = dict(_graph.children(stripped))
    if SIGNATURES in kids or (signatures and SIGNATURES in dict(_graph.children(root))):
        raise ValueError(f"export: the root's child {SIGNATURES!r} is reserved for the signatures; rename it.")
    graph = _graph.build(kids)
    saved = pb.SavedObjectGraph()
    by_key = {s.key: s for s in graph.saveables}
    objs: dict[int, Any] = {0: stripped}
    for i, node in enumerate(graph.proto.nodes):
        out = saved.nodes.add()
        out.children.extend(node.children)
        out.slot_variables.extend(node.slot_variables)
        kids_of = dict(_graph.children(objs[i])) if node.children else {}
        for ref in node.children:
            objs.setdefault(ref.node_id, kids_of[ref.local_name])
        if node.attributes:
            _describe_value(out, by_key[node.attributes[0].checkpoint_key], graph.paths[i])
        else:
            _describe_container(out, objs[i])
    tmp = f"{directory}.tmp-{secrets.token_hex(4)}"
    os.makedirs(tmp)
    try:
        definition = pb.ExportDef(version=VersionDef(producer=_VERSION, min_consumer=1))
        _add_assets(definition, saved, root, tmp)
        write_bundle(os.path.join(tmp, "variables", "variables"), _tf_tensors(_values(graph), graph.proto))
        _add_signatures(definition, saved, root, signatures, graph, tmp, platforms)
        definition.object_graph.CopyFrom(saved)
        with open(os.path.join(tmp, EXPORT_FILE), "wb") as f:
            f.write(definition.SerializeToString())
        os.rename(tmp, directory)  # replaces an empty directory; never leaves a half export there
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
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
    v.dtype = _ENUM_OF.get(np.dtype(var.handle.saved_dtype or var.dtype), 0)  # as stored in the bundle
    v.shape.dim.extend(TensorShapeProto.Dim(size=d) for d in var.shape)
    v.trainable, v.name = var.trainable, var.name
    v.synchronization, v.aggregation = int(var.synchronization), int(var.aggregation)


def _describe_container(out: pb.SavedObject, obj: Any, identifier: str | None = None) -> None:
    uo = out.user_object
    uo.identifier = identifier or _IDENTIFIER_OF.get(type(obj)) or _WRAPPERS.get(type(obj), _GENERIC)
    if obj is not None:
        uo.metadata = f"{type(obj).__module__}.{type(obj).__qualname__}"
    r = _REVIVED.get(uo.identifier, [None])[0]
    uo.version.CopyFrom(VersionDef(producer=r.version, min_consumer=r.min_consumer_version,
                                   bad_consumers=r.bad_consumers) if r else VersionDef(producer=1, min_consumer=1))


def _child(saved: pb.SavedObjectGraph, node: int | None, name: str) -> int | None:
    return None if node is None else next((r.node_id for r in saved.nodes[node].children if r.local_name == name), None)


def _node_at(saved: pb.SavedObjectGraph, names: list[str]) -> int | None:
    node: int | None = 0
    for name in names:
        node = _child(saved, node, name)
    return node


def _add_assets(definition: pb.ExportDef, saved: pb.SavedObjectGraph, root: Any, tmp: str) -> None:
    copied: dict[str, int] = {}
    for path, asset in jax.tree_util.tree_flatten_with_path(root, is_leaf=lambda x: isinstance(x, Asset))[0]:
        if not isinstance(asset, Asset):
            continue
        names = [_graph._key_name(k) for k in path]
        src = os.path.realpath(asset.asset_path)
        if not os.path.isfile(src):
            raise FileNotFoundError(f"export: asset {'/'.join(names)!r} names {asset.asset_path!r}, not a file.")
        if src not in copied:
            base, ext = os.path.splitext(os.path.basename(src))
            taken = {a.filename for a in definition.asset_file_def}
            name, n = base + ext, 0
            while name in taken:
                n += 1
                name = f"{base}_{n}{ext}"
            os.makedirs(os.path.join(tmp, "assets"), exist_ok=True)
            shutil.copyfile(src, os.path.join(tmp, "assets", name))
            copied[src] = len(definition.asset_file_def)
            definition.asset_file_def.add(filename=name)
        parent, obj = 0, root
        for name in names[:-1]:  # containers that held only assets were left out of the graph
            obj = dict(_graph.children(obj))[name]
            child = _child(saved, parent, name)
            if child is None:
                child = len(saved.nodes)
                _describe_container(saved.nodes.add(), obj)
                saved.nodes[parent].children.add(node_id=child, local_name=name)
            parent = child
        saved.nodes[parent].children.add(node_id=len(saved.nodes), local_name=names[-1])
        saved.nodes.add().asset.asset_file_def_index = copied[src]


def _add_signatures(definition, saved, root, signatures, graph, tmp, platforms) -> None:
    if not signatures:
        return
    node_of_path = {p: i for i, p in enumerate(graph.paths)}
    node_of_rid = {var.resource_id: node_of_path[s.key.split("/.ATTRIBUTES/")[0]]
                   for s in graph.saveables if (var := _graph.as_variable(s.obj)) is not None}
    sig_map = len(saved.nodes)
    _describe_container(saved.nodes.add(), None, _SIGNATURE_MAP)
    saved.nodes[0].children.add(node_id=sig_map, local_name=SIGNATURES)
    is_leaf = lambda x: _graph.as_variable(x) is not None or isinstance(x, Asset)
    flat, treedef = jax.tree_util.tree_flatten_with_path(root, is_leaf=is_leaf)
    for i, (name, entry) in enumerate(sorted(signatures.items())):
        if not isinstance(name, str) or not name:
            raise TypeError(f"export: signature names must be non-empty strings, got {name!r}.")
        if not (isinstance(entry, tuple) and len(entry) == 2 and callable(entry[0])
                and isinstance(entry[1], (tuple, list))):
            raise TypeError(f"export: signature {name!r} must be (fn, example_args) with fn(root, *example_args), "
                            f"example_args a tuple; got {entry!r}.")
        fn, example_args = entry
        leaf_nodes = []  # per root leaf: its node if it is passed in as an input, else None (static)
        for path, leaf in flat:
            var = _graph.as_variable(leaf)
            leaf_nodes.append(node_of_rid.get(var.resource_id) if var is not None else _node_at(
                saved, [_graph._key_name(k) for k in path]) if isinstance(leaf, (jax.Array, np.ndarray)) else None)
        arg_specs = jax.tree.map(_spec, tuple(example_args))
        try:
            # A first trace finds the inputs fn reads: only those are bound, as TF captures only what it reads.
            flat_fn, specs, bound = _inputs(fn, flat, treedef, leaf_nodes, is_leaf)
            jaxpr = jax.make_jaxpr(flat_fn)(specs, *arg_specs).jaxpr
            read = [*jaxpr.outvars, *(v for e in jaxpr.eqns for v in e.invars)]
            used = {v for v in read if not isinstance(v, Literal)}
            unused = {n for n, v in zip(bound, jaxpr.invars, strict=False) if v not in used}
            flat_fn, specs, bound = _inputs(fn, flat, treedef, [None if n in unused else n for n in leaf_nodes],
                                            is_leaf)
            exported = jax.export.export(jax.jit(flat_fn), platforms=platforms)(specs, *arg_specs)
        except Exception as e:
            e.add_note(f"while exporting signature {name!r} with jax.export")
            raise
        fname = f"__inference_{re.sub(r'[^A-Za-z0-9_]', '_', name)}_{i}"
        data = exported.serialize()
        os.makedirs(os.path.join(tmp, "functions"), exist_ok=True)
        with open(os.path.join(tmp, "functions", fname), "wb") as f:
            f.write(data)
        definition.function_sha256[fname] = hashlib.sha256(data).digest()
        cf = saved.concrete_functions[fname]
        cf.bound_inputs.extend(bound)
        cf.canonicalized_input_signature.CopyFrom(_structure((tuple(arg_specs), {})))
        cf.output_signature.CopyFrom(_structure(exported.out_tree.unflatten(exported.out_avals)))
        saved.nodes[sig_map].children.add(node_id=len(saved.nodes), local_name=name)
        bare = saved.nodes.add().bare_concrete_function
        bare.concrete_function_name, bare.allowed_positional_arguments = fname, len(example_args)


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
        return var.value if value is None else _graph.rewrap(leaf, var._with_value(value))
    return leaf if value is None else value


def _spec(x: Any) -> jax.ShapeDtypeStruct:
    var = _graph.as_variable(x)
    x = var.value if var is not None else x
    if isinstance(x, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct(x.shape, x.dtype)  # no sharding: the export runs on any one device
    return jax.ShapeDtypeStruct(np.shape(x), jnp.asarray(x).dtype if not hasattr(x, "dtype") else x.dtype)


def _structure(tree: Any) -> pb.StructuredValue:
    """A pytree of specs as TF's StructuredValue (tuples, lists, dicts, None, TensorSpecs)."""
    out = pb.StructuredValue()
    if tree is None:
        out.none_value.SetInParent()
    elif isinstance(tree, dict):
        out.dict_value.SetInParent()
        for k, v in tree.items():
            out.dict_value.fields[str(k)].CopyFrom(_structure(v))
    elif isinstance(tree, (list, tuple)):
        (out.list_value if isinstance(tree, list) else out.tuple_value).values.extend(map(_structure, tree))
    elif hasattr(tree, "shape") and hasattr(tree, "dtype"):
        spec = out.tensor_spec_value
        spec.dtype = _ENUM_OF.get(np.dtype(tree.dtype), 0)
        for d in tree.shape:
            symbolic = jax.export.is_symbolic_dim(d)
            spec.shape.dim.add(size=-1 if symbolic else int(d), name=str(d) if symbolic else "")
    else:
        out.tuple_value.values.extend(map(_structure, jax.tree_util.tree_flatten(tree, lambda x: x is not tree)[0]))
    return out
