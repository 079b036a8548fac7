"""`export_saved_model`: a TensorFlow SavedModel written without TensorFlow, which TF loads and serves.

The layout and protos are the ones TF 2.21 writes for a `tf.Module` with
variables and signatures:

    saved_model.pb          SavedModel: one MetaGraphDef tagged "serve" with
                            - a GraphDef: a `VarHandleOp` per variable, a
                              `<signature>_<input>` `Placeholder` per input, a
                              `StatefulPartitionedCall` per signature, and the
                              restore function the session loader runs;
                            - a SaverDef naming that restore function;
                            - a SignatureDef per signature
                              ("tensorflow/serving/predict");
                            - the SavedObjectGraph (`tf.saved_model.load`), whose
                              "signatures" child holds a bare concrete function
                              per signature
    variables/variables.*   the TensorBundle, as `export` and `Checkpoint` write it

A signature's function reads each variable it needs (`ReadVariableOp` of a
resource argument) and passes the values, with the inputs, to one
`XlaCallModule` op carrying `jax.export`'s serialized StableHLO: variables
stay variables (restored from the bundle), never constants in the graph.
"""

from __future__ import annotations

import inspect
import os
import pathlib
import re
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np

from checkpoint import _dtypes, _graph, _keys, _storage
from checkpoint._export import _save
from checkpoint._export._format import GENERIC, SIGNATURE_MAP, SIGNATURES, Asset
from checkpoint._storage import SAVED_MODEL_FILE
from checkpoint._storage._bundle_writer import tf_tensors
from checkpoint._storage._files import replacing
from checkpoint.protos import graph_pb2 as gpb
from checkpoint.protos import meta_graph_pb2 as mpb
from checkpoint.protos import saved_object_graph_pb2 as pb
from checkpoint.protos import types_pb2
from checkpoint.protos.tensor_shape_pb2 import TensorShapeProto
from checkpoint.protos.versions_pb2 import VersionDef
from varstate import PartitionedVariable

_attr = gpb.AttrValue

TFVariable = tuple[str, np.dtype, tuple[int, ...]]  # a TF variable: its key in the bundle, dtype (as stored), shape

# The GraphDef versions TF 2.21 writes: its producer, and the oldest consumer that may read the graph.
GRAPH_PRODUCER, GRAPH_MIN_CONSUMER = 2474, 12
# XlaCallModule calling conventions TF runs: 10 since TF 2.20 (May 2025); tested with TF 2.21.
CALLING_CONVENTIONS = (9, 10)
OLDEST_TF = "2.20"
# Custom calls TF's XlaCallModule handles itself: shape checks of symbolic dimensions (TF ran them in the
# fixtures, tests/data/tf_serving) and sharding annotations. Any other target (a LAPACK or cuSOLVER kernel of
# jaxlib, a Pallas kernel) is registered by jaxlib only: TF fails when it compiles the function (fixtures too).
TF_CUSTOM_CALLS = frozenset({"shape_assertion", "Sharding", "SPMDFullToShardShape", "SPMDShardToFullShape"})
PREDICT = "tensorflow/serving/predict"
_OP_NAME = re.compile(r"[A-Za-z0-9.][A-Za-z0-9_.\-/]*")
_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_CUSTOM_CALL = re.compile(r"custom_call\s*@([\w.$-]+)|call_target_name\s*=\s*\"([^\"]+)\"")


def export_saved_model(directory: str | os.PathLike, root: Any,
                       signatures: Mapping[str, tuple[Callable[..., Any], tuple[Any, ...]]],
                       *, platforms: tuple[str, ...] = ("cpu",)) -> str:
    """Writes `root`'s Variables and `signatures` as a TensorFlow SavedModel that TF loads and serves.

    TensorFlow is not needed to write it. In a TensorFlow environment (TF
    2.20 or newer; tested with 2.21), ``tf.saved_model.load(directory)``
    restores the Variables and runs each signature, and the session loader
    of ``saved_model_cli run`` and TF Serving runs them too. Each signature
    is one ``XlaCallModule`` op running the `jax.export` of
    ``fn(root, *args)`` for `platforms`; the Variables and arrays it reads
    are TF resource variables restored from ``variables/``, passed in as
    reads (not baked in), so the graph stays small whatever the model's size.

    Names: a signature's inputs are named after `fn`'s parameters after
    `root` (the graph's placeholders are ``<signature>_<input>``); its
    outputs are the keys of the dict `fn` returns, or ``output_0``,
    ``output_1``... for an array or a tuple/list of arrays (TF's own names).
    Each argument is one array (or `jax.ShapeDtypeStruct`); a dimension from
    `jax.export.symbolic_shape` is TF's unknown dimension (-1), e.g. a
    dynamic batch.

    Args:
        directory: where to write; it must not exist or be empty.
        root: a container pytree (dict, list, dataclass...) of Variables and
            arrays (each becomes a TF variable; Python scalars and `Asset`
            objects stay Python values `fn` may close over).
        signatures: ``{name: (fn, example_args)}`` as for `export`; at least
            one. Name one ``"serving_default"``: TF Serving's default.
        platforms: the platforms of the exported functions, e.g.
            ``("cpu", "cuda")``.

    Returns:
        The directory (a str).

    Raises:
        FileExistsError: `directory` exists and is not empty.
        TypeError: `root` is not a container; a signature that is not
            ``(fn, example_args)``; an argument that is not one array; a
            result that is not an array, a tuple/list of arrays or a dict of
            arrays.
        ValueError: no signatures; a name TF cannot use; a function over more
            than one device, with effects, or calling a custom call TF cannot
            run; a calling convention TF does not run; a partitioned
            Variable, an optimizer or a PRNG key in `root`.

    >>> import os, tempfile, jax, jax.numpy as jnp, varstate, checkpoint
    >>> params = {"w": varstate.Variable(jnp.full((3, 2), 0.5), name="w"), "b": varstate.Variable(jnp.ones(2))}
    >>> def predict(p, x):
    ...     return {"scores": x @ p["w"].value + p["b"].value}
    >>> batch = jax.ShapeDtypeStruct(jax.export.symbolic_shape("n, 3"), jnp.float32)
    >>> path = checkpoint.export_saved_model(os.path.join(tempfile.mkdtemp(), "model"), params,
    ...                                      {"serving_default": (predict, (batch,))})
    >>> sorted(os.listdir(path))
    ['saved_model.pb', 'variables']
    >>> sig = checkpoint.read_saved_model(path).signatures["serving_default"]
    >>> sig.inputs["x"].tensor, sig.inputs["x"].shape, sig.outputs["scores"].shape
    ('serving_default_x:0', (None, 3), (None, 2))
    """
    directory = _save.checked_target("export_saved_model", directory, root)
    signatures = dict(signatures or {})
    if not signatures:
        raise ValueError("export_saved_model: expected at least one signature, found none; pass "
                         "{'serving_default': (fn, example_args)}.")
    platforms = tuple(platforms)
    is_value = lambda x: _graph.as_variable(x) is not None or isinstance(x, (jax.Array, np.ndarray))
    # Python scalars and assets stay Python: the functions may read them, TF has no variable for them.
    stripped = jax.tree.map(lambda x: x if is_value(x) else None, root, is_leaf=is_value)
    kids = dict(_graph.children(stripped))
    if SIGNATURES in dict(_graph.children(root)):
        raise ValueError(f"export_saved_model: the root's child {SIGNATURES!r} is reserved for the signatures; "
                         "rename it.")
    graph = _graph.build(kids)
    tensors = tf_tensors(_graph.values(graph), graph.proto.SerializeToString())
    saved, variables = _object_graph(graph, tensors)
    versions = VersionDef(producer=GRAPH_PRODUCER, min_consumer=GRAPH_MIN_CONSUMER)
    meta = mpb.MetaGraphDef(meta_info_def=mpb.MetaGraphDef.MetaInfoDef(tags=["serve"], stripped_default_attrs=True),
                            graph_def=gpb.GraphDef(versions=versions))
    gdef = meta.graph_def
    handles = {}
    taken: set[str] = set()
    for i, (_, dtype, shape) in variables.items():
        name = handles[i] = _unique(_op_name(saved.nodes[i].variable.name), taken)
        gdef.node.add(name=name, op="VarHandleOp", attr={
            "dtype": _attr(type=_enum(dtype, name)), "shape": _attr(shape=_shape(shape)),
            "shared_name": _attr(s=name.encode())})
    sig_map = len(saved.nodes)
    _save._describe_container(_save._add_child(saved, 0, SIGNATURES), None, SIGNATURE_MAP)
    arrays = {i for i in variables if _graph.as_variable(graph.objects[i]) is None}
    for k, (name, entry) in enumerate(sorted(signatures.items(), key=lambda kv: str(kv[0]))):
        _signature(gdef, meta, saved, sig_map, name, entry, k, root, variables, arrays, handles, taken,
                   _unique("StatefulPartitionedCall", taken), platforms)
    _saver(gdef, meta, variables, handles, taken, tensors[_keys.OBJECT_GRAPH_KEY])
    meta.object_graph_def.CopyFrom(saved)
    model = mpb.SavedModel(saved_model_schema_version=1, meta_graphs=[meta])
    with replacing(directory) as (tmp,):
        os.makedirs(tmp)
        _storage.write_bundle(os.path.join(tmp, _storage.VARIABLES_PREFIX), tensors)
        pathlib.Path(tmp, SAVED_MODEL_FILE).write_bytes(model.SerializeToString(deterministic=True))
    return directory


def _object_graph(graph: Any, tensors: dict[str, Any]) -> tuple[pb.SavedObjectGraph, dict[int, TFVariable]]:
    """The SavedObjectGraph of `graph` (each value a TF variable) and {node id: (bundle key, dtype, shape)}."""
    saved = pb.SavedObjectGraph()
    variables: dict[int, TFVariable] = {}
    for i, node in enumerate(graph.proto.nodes):
        out = saved.nodes.add(children=node.children)
        if node.slot_variables:
            raise ValueError(f"export_saved_model: {graph.paths[i] or '(root)'!r} is an optimizer with slot "
                             "variables; a served model has none. Export the model's Variables without it.")
        if not node.attributes:
            _save._describe_container(out, graph.objects[i] if i else None, None if i else GENERIC)
            continue
        if len(node.attributes) != 1:
            raise ValueError(f"export_saved_model: {graph.paths[i]!r} is a PRNG key, which TF cannot hold; "
                             "pass its key data (jax.random.key_data) or close over it in fn.")
        key = node.attributes[0].checkpoint_key
        obj = next(s.obj for s in graph.saveables if s.key == key)
        if isinstance(obj, (PartitionedVariable, list)):
            raise ValueError(f"export_saved_model: {graph.paths[i]!r} is a partitioned variable, which TF "
                             "serving does not support here; export the full value as one Variable.")
        value = np.asarray(tensors[key])
        var = _graph.as_variable(obj)
        v = out.variable
        v.dtype = _enum(value.dtype, graph.paths[i])
        v.shape.CopyFrom(_shape(value.shape))
        v.trainable, v.name = (var.trainable, var.name) if var is not None else (False, graph.paths[i])
        variables[i] = (key, value.dtype, value.shape)
    return saved, variables


def _op_name(name: str) -> str:
    """A graph node name for `name` (TF's: letters, digits, ``_.-/``, not starting with ``_-/``)."""
    name = re.sub(r"[^A-Za-z0-9_.\-/]", "_", name)
    return name if _OP_NAME.fullmatch(name) else f"v{name}"


def _unique(name: str, taken: set[str]) -> str:
    base, n = name, 0
    while name in taken:
        n += 1
        name = f"{base}_{n}"
    taken.add(name)
    return name


def _types(*dtypes: Any) -> gpb.AttrValue:
    return gpb.AttrValue(list=gpb.AttrValue.ListValue(type=dtypes))


def _shape(dims: tuple[Any, ...]) -> TensorShapeProto:
    """TF's shape; a symbolic dimension (jax.export.symbolic_shape) is unknown, -1."""
    return TensorShapeProto(dim=[TensorShapeProto.Dim(size=d if isinstance(d, int) else -1) for d in dims])


def _enum(dtype: Any, where: str) -> Any:  # a types_pb2.DataType value
    enum = _dtypes.ENUM_OF.get(np.dtype(dtype))
    if enum is None or enum == types_pb2.DT_INVALID:
        raise TypeError(f"export_saved_model: {where!r} has dtype {np.dtype(dtype)}, which TF has no type for; "
                        "cast it to a TF dtype.")
    return int(enum)


def _spec_value(name: str, dims: tuple[Any, ...], dtype: Any) -> pb.StructuredValue:
    return pb.StructuredValue(tensor_spec_value=pb.TensorSpecProto(name=name, shape=_shape(dims),
                                                                   dtype=_enum(dtype, name)))


def _arg_names(fn: Callable[..., Any], count: int, sig: str) -> list[str]:
    """`fn`'s parameter names after root, for `count` arguments (a ``*rest`` gives ``rest_0``, ``rest_1``...)."""
    try:
        params = list(inspect.signature(fn).parameters.values())[1:]
    except (TypeError, ValueError):
        params = []
    names: list[str] = []
    for p in params:
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and len(names) < count:
            names.append(p.name)
        elif p.kind == p.VAR_POSITIONAL:
            names += [f"{p.name}_{j}" for j in range(count - len(names))]
    if len(names) != count:
        raise TypeError(f"export_saved_model: signature {sig!r} has {count} example arguments but its function "
                        f"takes {len(names)} named ones after root; expected fn(root, *args) with a named "
                        "parameter (or *rest) for each.")
    return names


def _output_keys(tree: Any, sig: str) -> dict[str, int]:
    """{output name: flat index} for `fn`'s result with leaves numbered by their flat index."""
    if isinstance(tree, int):
        return {"output_0": tree}
    if isinstance(tree, (tuple, list)) and all(isinstance(x, int) for x in tree):
        return {f"output_{j}": x for j, x in enumerate(tree)}
    if isinstance(tree, dict) and all(isinstance(x, int) for x in tree.values()):
        bad = [k for k in tree if not (isinstance(k, str) and _KEY.fullmatch(k))]
        if bad:
            raise ValueError(f"export_saved_model: signature {sig!r} returns keys {bad}; TF needs identifiers "
                             "(letters, digits, _), e.g. 'scores'. Rename them.")
        return dict(tree)
    raise TypeError(f"export_saved_model: signature {sig!r} returns {jax.tree.structure(tree)}; a SignatureDef "
                    "holds a flat set of arrays. Return an array, a tuple/list of arrays or a dict of arrays.")


def _check_exported(exported: jax.export.Exported, sig: str) -> None:
    if exported.nr_devices != 1:
        raise ValueError(f"export_saved_model: signature {sig!r} runs over {exported.nr_devices} devices; "
                         "expected 1 (TF's XlaCallModule runs a module on one device). Export a function "
                         "without sharding constraints or shard_map.")
    if exported.ordered_effects or exported.unordered_effects:
        raise ValueError(f"export_saved_model: signature {sig!r} has effects "
                         f"{[*exported.ordered_effects, *exported.unordered_effects]}; a served function must be "
                         "pure. Remove debug callbacks and prints from it.")
    if exported.calling_convention_version not in CALLING_CONVENTIONS:
        raise ValueError(f"export_saved_model: signature {sig!r} uses XlaCallModule calling convention "
                         f"{exported.calling_convention_version}; TF {OLDEST_TF} and newer run "
                         f"{list(CALLING_CONVENTIONS)}. Set jax_export_calling_convention_version to "
                         f"{CALLING_CONVENTIONS[-1]}.")
    targets = {a or b for a, b in _CUSTOM_CALL.findall(exported.mlir_module())} - TF_CUSTOM_CALLS
    if targets:
        raise ValueError(f"export_saved_model: signature {sig!r} calls {sorted(targets)}, custom calls that only "
                         f"jaxlib provides, so TF cannot run it (TF runs {sorted(TF_CUSTOM_CALLS)}). Compute "
                         "that part without them (e.g. no jnp.linalg decompositions on CPU) or outside the model.")


def _signature(gdef: gpb.GraphDef, meta: mpb.MetaGraphDef, saved: pb.SavedObjectGraph, sig_map: int, name: Any,
               entry: Any, k: int, root: Any, variables: dict[int, TFVariable], arrays: set[int],
               handles: dict[int, str], taken: set[str], call: str, platforms: tuple[str, ...]) -> None:
    """Adds signature `name`: its function, its placeholders and call in the graph, its SignatureDef and node.

    `arrays` are the nodes of `variables` that hold a plain array of the root rather than a Variable.
    """
    if not isinstance(name, str) or not _KEY.fullmatch(name):
        raise ValueError(f"export_saved_model: signature name {name!r} is not an identifier (letters, digits, "
                         "_); TF serves signatures by such names, e.g. 'serving_default'.")
    fn, example_args = _save.signature_entry("export_saved_model", name, entry)
    arg_names = _arg_names(fn, len(example_args), name)
    arg_specs = []
    for arg, a in zip(arg_names, example_args, strict=True):
        if not isinstance(a, (jax.Array, np.ndarray, jax.ShapeDtypeStruct, np.generic)):
            raise TypeError(f"export_saved_model: argument {arg!r} of signature {name!r} is a "
                            f"{type(a).__name__}; a SignatureDef input is one array. Pass an array or a "
                            "jax.ShapeDtypeStruct per argument.")
        arg_specs.append(_save._spec(a))
    exported, bound = _export(fn, root, saved, handles, arg_specs, platforms, name)
    _check_exported(exported, name)
    for node, aval in zip(bound, exported.in_avals, strict=False):
        stored, read = variables[node][1], np.dtype(aval.dtype)
        if read != stored and node in arrays:
            # A numpy 64-bit array with JAX's 64-bit types off: the trace narrowed it, TF would not.
            raise TypeError(f"export_saved_model: {saved.nodes[node].variable.name!r} is a plain numpy {stored} "
                            f"array (not a Variable), but signature {name!r} reads it as {read} (JAX narrows it "
                            f"while 64-bit types are off); TF reads a value in its stored dtype. Store it as "
                            f"np.{read.name} in the root (np.asarray(value, np.{read.name})), or export with "
                            "jax.config.update('jax_enable_x64', True) so that the function reads it as "
                            f"{stored}.")
        if read != stored:
            raise TypeError(f"export_saved_model: Variable {saved.nodes[node].variable.name!r} is stored as "
                            f"{variables[node][1]} but signature {name!r} reads it as {np.dtype(aval.dtype)}; TF "
                            "reads a variable in its stored dtype. Store it in the dtype it is read in.")
    outputs = _output_keys(exported.out_tree.unflatten(list(range(len(exported.out_avals)))), name)
    fname = f"__inference_signature_wrapper_{name}_{k}"
    # The function's arguments: the inputs by name (TF flattens keyword arguments in sorted order), then the
    # variables it reads. OpDef argument names must be lower case. The graph: a placeholder per input and one
    # call, which the SignatureDef names.
    fdef = gdef.library.function.add()
    op = fdef.signature
    op.name, op.is_stateful = fname, True
    sdef = meta.signature_def[name]
    sdef.method_name = PREDICT
    local: set[str] = set()
    arg_of: dict[str, str] = {}
    in_order = sorted(arg_names)
    spec_of = dict(zip(arg_names, arg_specs, strict=True))
    for arg in in_order:
        arg_of[arg], ph = _unique(_lower(arg), local), _unique(f"{name}_{arg}", taken)
        shape, dtype = _shape(spec_of[arg].shape), _enum(spec_of[arg].dtype, arg)
        op.input_arg.add(name=arg_of[arg], type=dtype)
        gdef.node.add(name=ph, op="Placeholder", attr={"dtype": _attr(type=dtype), "shape": _attr(shape=shape)})
        sdef.inputs[arg].CopyFrom(mpb.TensorInfo(name=f"{ph}:0", dtype=dtype, tensor_shape=shape))
    resources = [_unique(f"resource_{j}", local) for j in range(len(bound))]
    op.input_arg.extend(gpb.OpDef.ArgDef(name=r, type=types_pb2.DT_RESOURCE) for r in resources)
    operands = []
    for i in exported.module_kept_var_idx:
        if i < len(bound):
            read = f"ReadVariableOp_{i}"
            fdef.node_def.add(name=read, op="ReadVariableOp", input=[resources[i]],
                              attr={"dtype": _attr(type=_enum(exported.in_avals[i].dtype, read))})
            operands.append(f"{read}:value:0")
        else:
            operands.append(arg_of[arg_names[i - len(bound)]])
    outs = exported.out_avals
    fdef.node_def.add(name="XlaCallModule", op="XlaCallModule", input=operands, attr={
        "version": _attr(i=exported.calling_convention_version),
        "module": _attr(s=exported.mlir_module_serialized),
        "Sout": _attr(list=gpb.AttrValue.ListValue(shape=[_shape(a.shape) for a in outs])),
        "Tout": _types(*(_enum(a.dtype, name) for a in outs)),
        "Tin": _types(*(_enum(exported.in_avals[i].dtype, name) for i in exported.module_kept_var_idx)),
        "platforms": _attr(list=gpb.AttrValue.ListValue(s=[p.upper().encode() for p in exported.platforms]))})
    out_order = sorted(outputs)
    for j, key in enumerate(out_order):
        a, out = outs[outputs[key]], _unique(_lower(key), local)
        op.output_arg.add(name=out, type=_enum(a.dtype, key))
        fdef.ret[out] = f"XlaCallModule:output:{outputs[key]}"
        sdef.outputs[key].CopyFrom(mpb.TensorInfo(name=f"{call}:{j}", dtype=_enum(a.dtype, key),
                                                  tensor_shape=_shape(a.shape)))
    _call(gdef, call, op, [*(t.name[:-2] for t in (sdef.inputs[a] for a in in_order)), *(handles[n] for n in bound)])
    # The object graph: a bare concrete function under "signatures", called with keyword arguments.
    cf = saved.concrete_functions[fname]
    cf.bound_inputs.extend(bound)
    kwargs = pb.DictValue(fields={a: _spec_value(a, spec_of[a].shape, spec_of[a].dtype) for a in in_order})
    cf.canonicalized_input_signature.tuple_value.values.extend(
        [pb.StructuredValue(tuple_value=pb.TupleValue()), pb.StructuredValue(dict_value=kwargs)])
    cf.output_signature.dict_value.CopyFrom(pb.DictValue(fields={
        key: _spec_value(key, outs[outputs[key]].shape, outs[outputs[key]].dtype) for key in out_order}))
    bare = _save._add_child(saved, sig_map, name).bare_concrete_function
    bare.concrete_function_name = fname
    bare.argument_keywords.extend(in_order)


def _call(gdef: gpb.GraphDef, name: str, op: gpb.OpDef, inputs: list[str]) -> None:
    """Adds node `name`: a StatefulPartitionedCall of the function whose signature is `op`, on `inputs`."""
    gdef.node.add(name=name, op="StatefulPartitionedCall", input=inputs, attr={
        "f": _attr(func=gpb.NameAttrList(name=op.name)), "Tin": _types(*(a.type for a in op.input_arg)),
        "Tout": _types(*(a.type for a in op.output_arg))})


def _lower(name: str) -> str:
    """An OpDef argument name for `name`: lower case letters, digits and _, starting with a letter."""
    low = re.sub(r"[^a-z0-9_]", "_", name.lower())
    return low if low[:1].isalpha() else f"a{low}"


def _export(fn: Callable[..., Any], root: Any, saved: pb.SavedObjectGraph, handles: dict[int, str],
            arg_specs: list[jax.ShapeDtypeStruct], platforms: tuple[str, ...],
            name: str) -> tuple[jax.export.Exported, list[int]]:
    """`fn` exported with the root's Variables and arrays it reads as inputs; their node ids, in input order."""
    is_leaf = lambda x: _graph.as_variable(x) is not None or isinstance(x, Asset)
    flat, treedef = jax.tree_util.tree_flatten_with_path(root, is_leaf=is_leaf)
    node_of_rid: dict[int, int | None] = {}
    leaf_nodes: list[int | None] = []
    for path, leaf in flat:
        node = _save._node_at(saved, [_keys.local_name(p) for p in path])
        var = _graph.as_variable(leaf)
        if var is not None:  # one Variable at two paths is one node, found at its first path
            node = node_of_rid.setdefault(var.resource_id, node)
        leaf_nodes.append(node if node in handles else None)
    return _save.export_reading(fn, flat, treedef, leaf_nodes, is_leaf, arg_specs, platforms, name)


def _saver(gdef: gpb.GraphDef, meta: mpb.MetaGraphDef, variables: dict[int, TFVariable],
           handles: dict[int, str], taken: set[str], object_graph: bytes) -> None:
    """The SaverDef: functions that restore every variable from a checkpoint (the session loader runs it) and save."""
    if not variables:
        return
    keys = [key for key, _, _ in variables.values()]
    dtypes = [_enum(dtype, key) for key, dtype, _ in variables.values()]
    filename = _unique("saver_filename", taken)
    gdef.node.add(name=filename, op="Placeholder", attr={
        "dtype": _attr(type=types_pb2.DT_STRING), "shape": _attr(shape=TensorShapeProto())})
    calls = []
    for kind in ("save", "restore"):
        fname = f"__inference__traced_{kind}"
        fdef = gdef.library.function.add()
        op = fdef.signature
        op.name, op.is_stateful = fname, True
        op.input_arg.add(name="file_prefix", type=types_pb2.DT_STRING)
        op.input_arg.extend(gpb.OpDef.ArgDef(name=f"resource_{j}", type=types_pb2.DT_RESOURCE)
                            for j in range(len(keys)))
        names = [*keys, _keys.OBJECT_GRAPH_KEY] if kind == "save" else keys
        _const(fdef, "tensor_names", _string_tensor([k.encode() for k in names]))
        _const(fdef, "shape_and_slices", _string_tensor([b""] * len(names)))
        io = ["file_prefix", "tensor_names:output:0", "shape_and_slices:output:0"]
        if kind == "save":
            _const(fdef, "object_graph", _string_tensor([object_graph], scalar=True))
            for j, dtype in enumerate(dtypes):
                fdef.node_def.add(name=f"ReadVariableOp_{j}", op="ReadVariableOp", input=[f"resource_{j}"],
                                  attr={"dtype": _attr(type=dtype)})
            fdef.node_def.add(name="SaveV2", op="SaveV2", attr={"dtypes": _types(*dtypes, types_pb2.DT_STRING)},
                              input=[*io, *(f"ReadVariableOp_{j}:value:0" for j in range(len(keys))),
                                     "object_graph:output:0"])
            done = ["SaveV2"]
        else:
            fdef.node_def.add(name="RestoreV2", op="RestoreV2", attr={"dtypes": _types(*dtypes)}, input=io)
            done = [f"AssignVariableOp_{j}" for j in range(len(keys))]
            for j, dtype in enumerate(dtypes):
                fdef.node_def.add(name=done[j], op="AssignVariableOp",
                                  input=[f"resource_{j}", f"RestoreV2:tensors:{j}"], attr={"dtype": _attr(type=dtype)})
        fdef.control_ret.update({d: d for d in done})
        op.control_output.extend(done)
        # Returns the prefix once the variables are written or assigned, as TF's own functions do.
        fdef.node_def.add(name="Identity", op="Identity", input=["file_prefix", *(f"^{d}" for d in done)],
                          attr={"T": _attr(type=types_pb2.DT_STRING)})
        op.output_arg.add(name="identity", type=types_pb2.DT_STRING)
        fdef.ret["identity"] = "Identity:output:0"
        call = _unique("StatefulPartitionedCall", taken)
        _call(gdef, call, op, [filename, *(handles[n] for n in variables)])
        calls.append(call)
    meta.saver_def.CopyFrom(mpb.SaverDef(filename_tensor_name=f"{filename}:0", save_tensor_name=f"{calls[0]}:0",
                                         restore_op_name=calls[1], version=mpb.SaverDef.V2))


def _const(fdef: gpb.FunctionDef, name: str, value: gpb.TensorProto) -> None:
    fdef.node_def.add(name=name, op="Const", attr={"dtype": _attr(type=value.dtype), "value": _attr(tensor=value)})


def _string_tensor(values: list[bytes], scalar: bool = False) -> gpb.TensorProto:
    dims = [] if scalar else [TensorShapeProto.Dim(size=len(values))]
    return gpb.TensorProto(dtype=types_pb2.DT_STRING, string_val=values, tensor_shape=TensorShapeProto(dim=dims))
