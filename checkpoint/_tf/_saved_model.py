"""Reads a TensorFlow SavedModel directory without TensorFlow: object tree, variable values, signatures, assets.

A SavedModel written by TF2 (``tf.saved_model.save``, Keras's ``model.export``) is

    saved_model.pb              SavedModel: MetaGraphDef(s) with the SavedObjectGraph, SignatureDefs, assets
    variables/variables.*       an object-based TensorBundle checkpoint of every variable
    assets/<file>               files the model needs (vocabularies...)

The object tree comes from the SavedObjectGraph; a variable's value is found
by its node's path in the checkpoint's own object graph (both graphs name the
same children). Functions are listed as nodes but not converted: their
graphs are never read, so nothing from the file is executed.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping

import numpy as np
from google.protobuf.message import DecodeError

from checkpoint import _dtypes, _keys
from checkpoint._errors import CheckpointFormatError
from checkpoint._storage import SAVED_MODEL_FILE, VARIABLES_PREFIX, BundleReader

__all__ = ["SavedModelContents", "SavedNode", "SignatureSpec", "TensorSpec", "read_saved_model"]

ASSETS_DIR = "assets"
INIT_OP_SIGNATURE = "__saved_model_init_op"  # TF's internal initializer "signature"; not one a caller can run


@dataclasses.dataclass(frozen=True)
class TensorSpec:
    """One input or output of a signature.

    `shape` has None for an unknown dimension and is None for an unknown
    rank; `dtype` is None where TF recorded none and `object` for strings;
    `tensor` is the graph tensor's name (``"serving_default_x:0"``), or, for
    a sparse or composite value, ``""`` with `encoding` saying which.
    """

    dtype: np.dtype | None
    shape: tuple[int | None, ...] | None
    tensor: str
    encoding: str = "name"


@dataclasses.dataclass(frozen=True)
class SignatureSpec:
    """A SignatureDef: what a serving signature takes and returns, by name."""

    name: str
    method_name: str
    inputs: dict[str, TensorSpec]
    outputs: dict[str, TensorSpec]


@dataclasses.dataclass(frozen=True)
class SavedNode:
    """One node of the SavedObjectGraph.

    `path` is the node's first breadth-first path from the root, parts
    escaped as in checkpoint keys (``""`` for the root; a slot variable's is
    ``<primary>/.OPTIMIZER_SLOT/<optimizer>/<slot>``; None if nothing reaches
    it). `kind` is the SavedObject's kind (``"user_object"``, ``"variable"``,
    ``"function"``, ``"bare_concrete_function"``, ``"asset"``,
    ``"constant"``, ``"resource"``, ``"captured_tensor"``; ``""`` if unset).
    `identifier` is a user object's type (``"_generic_user_object"``,
    ``"trackable_list_wrapper"``, ``"signature_map"``...). For a variable,
    `name`, `dtype`, `shape`, `trainable` are what TF recorded; for an asset,
    `asset_path` is the file's absolute path.
    """

    id: int
    path: str | None
    kind: str
    children: dict[str, int]
    identifier: str = ""
    name: str = ""
    dtype: np.dtype | None = None
    shape: tuple[int | None, ...] | None = None
    trainable: bool | None = None
    asset_path: str | None = None


@dataclasses.dataclass(frozen=True)
class SavedModelContents:
    """What `read_saved_model` returns: a SavedModel's objects, variable values and signatures, read without TF.

    Attributes:
        path: the SavedModel directory read.
        tags: the tags of the MetaGraphDef read (``("serve",)`` for TF2's).
        tensorflow_version: the TF version that wrote it, as recorded (``""`` if none).
        nodes: the SavedObjectGraph in node id order (``nodes[0]`` is the root), each a `SavedNode` with
            its path, kind and children.
        variables: every variable's value (numpy, bit-exact, checksums verified) by node path, e.g.
            ``"sub/s"``; a variable reached through several paths is listed under its first.
        signatures: name -> `SignatureSpec` (inputs and outputs with dtype and shape), without TF's
            internal ``__saved_model_init_op``.
        assets: node path -> absolute path of the file under ``assets/``.
        variables_prefix: the checkpoint of the variables, readable with `read_checkpoint`; None if the
            SavedModel has none.
    """

    path: str
    tags: tuple[str, ...]
    tensorflow_version: str
    nodes: tuple[SavedNode, ...]
    variables: dict[str, np.ndarray]
    signatures: dict[str, SignatureSpec]
    assets: dict[str, str]
    variables_prefix: str | None


def read_saved_model(path: str | os.PathLike, tags: str | tuple[str, ...] | None = None) -> SavedModelContents:
    """Reads the TF SavedModel directory `path` without TensorFlow (functions are not converted).

    Args:
        path: the SavedModel directory (holding ``saved_model.pb``).
        tags: the tag or tags of the MetaGraphDef to read when the file holds
            several (TF1's ``SavedModelBuilder``); None reads the only one, or
            the one tagged ``"serve"`` (TF2 writes one, tagged so).

    Returns:
        A `SavedModelContents` (described under "Objects returned" in the
        reference) with the object graph as ``nodes``, every variable's value by node path
        (``variables["sub/s"]``, numpy, bit-exact, checksums verified), the
        ``signatures`` with their inputs and outputs, the ``assets`` and the
        ``variables_prefix`` that `read_checkpoint` opens.

    Raises:
        TypeError: `path` is not a string or path.
        FileNotFoundError: no ``saved_model.pb`` at `path`.
        ValueError: no MetaGraphDef has the `tags` asked for (the message
            lists those it has).
        CheckpointFormatError: a corrupt or unsupported file (the text format
            ``saved_model.pbtxt``, a TF1 SavedModel without object graph).

    >>> import os
    >>> from checkpoint._tf._saved_model import read_saved_model
    >>> here = os.path.dirname(os.path.abspath(read_saved_model.__code__.co_filename))
    >>> sm = read_saved_model(os.path.join(here, "..", "..", "tests", "data", "tf_saved_model", "module"))
    >>> sorted(sm.variables), sm.variables["sub/s"], sm.signatures["serving_default"].inputs["x"].shape
    (['b', 'sub/s', 'tag', 'w'], array(1.5, dtype=float32), (None, 2))
    """
    directory = _directory(path)
    pb_path = os.path.join(directory, SAVED_MODEL_FILE)
    meta = _meta_graph(pb_path, tags)
    graph = meta.object_graph_def
    prefix = os.path.join(directory, VARIABLES_PREFIX)
    has_variables = os.path.isfile(prefix + ".index")
    if not graph.nodes:
        hint = (f"its variables are a name-based checkpoint: read them with checkpoint.read_checkpoint({prefix!r})"
                if has_variables else "it holds no variables either")
        raise CheckpointFormatError(f"{pb_path}: the MetaGraphDef has no object graph (a TF1 SavedModel, written by "
                                    "SavedModelBuilder); only TF2 SavedModels (tf.saved_model.save, Keras's "
                                    f"model.export) are read: {hint}")
    paths = _paths(graph.nodes, pb_path)
    assets_dir = os.path.join(directory, ASSETS_DIR)
    nodes = tuple(_node(i, node, paths.get(i), meta, assets_dir, pb_path) for i, node in enumerate(graph.nodes))
    variable_nodes = {n.path: n for n in nodes if n.kind == "variable" and n.path is not None}
    if variable_nodes and not has_variables:
        raise CheckpointFormatError(f"{pb_path}: the object graph has {len(variable_nodes)} variables but "
                                    f"{prefix}.index is missing; copy the SavedModel's variables/ directory with it")
    values = _read_values(prefix, variable_nodes) if variable_nodes else {}
    signatures = {name: SignatureSpec(name=name, method_name=sig.method_name, inputs=_specs(sig.inputs),
                                      outputs=_specs(sig.outputs))
                  for name, sig in sorted(meta.signature_def.items()) if name != INIT_OP_SIGNATURE}
    return SavedModelContents(
        path=directory, tags=tuple(meta.meta_info_def.tags), tensorflow_version=meta.meta_info_def.tensorflow_version,
        nodes=nodes, variables=values, signatures=signatures,
        assets={n.path: n.asset_path for n in nodes if n.asset_path is not None and n.path is not None},
        variables_prefix=prefix if has_variables else None)


def _directory(path) -> str:
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"SavedModel path must be a string, got {type(path).__name__} {path!r}.")
    path = os.fspath(path)
    if os.path.basename(path) == SAVED_MODEL_FILE and os.path.isfile(path):
        path = os.path.dirname(path) or "."
    if os.path.isfile(os.path.join(path, SAVED_MODEL_FILE)):
        return path
    if os.path.isfile(os.path.join(path, "saved_model.pbtxt")):
        raise CheckpointFormatError(f"{path}: holds saved_model.pbtxt (the text format), which this reader does not "
                                    "read; save the model again without as_text=True to get saved_model.pb")
    if os.path.isdir(path):
        raise FileNotFoundError(f"No SavedModel in directory {path}: expected a {SAVED_MODEL_FILE} file (written by "
                                "tf.saved_model.save or Keras's model.export).")
    raise FileNotFoundError(f"No SavedModel at {path}: expected a directory holding {SAVED_MODEL_FILE}.")


def _meta_graph(pb_path: str, tags):
    from checkpoint.protos import saved_model_pb2

    with open(pb_path, "rb") as f:
        data = f.read()
    try:
        metas = list(saved_model_pb2.SavedModel.FromString(data).meta_graphs)
    except DecodeError:
        raise CheckpointFormatError(f"{pb_path}: not a valid SavedModel protocol buffer (truncated or corrupt); copy "
                                    "it again from its source") from None
    if not metas:
        raise CheckpointFormatError(f"{pb_path}: the SavedModel holds no MetaGraphDef")
    if tags is None and len(metas) == 1:
        return metas[0]
    wanted = ["serve"] if tags is None else sorted([tags] if isinstance(tags, str) else tags)
    tag_sets = [sorted(m.meta_info_def.tags) for m in metas]
    if wanted not in tag_sets:
        raise ValueError(f"{pb_path}: no MetaGraphDef tagged {wanted}; the SavedModel has {tag_sets}. Pass one of "
                         "those as tags=.")
    return metas[tag_sets.index(wanted)]


def _check_ref(node_id: int, count: int, pb_path: str, where: str) -> None:
    if not 0 <= node_id < count:
        raise CheckpointFormatError(f"{pb_path}: {where} refers to node {node_id}, but the object graph has {count} "
                                    "nodes")


def _paths(nodes, pb_path: str) -> dict[int, str]:
    """Each node's first breadth-first path (TF's rule for checkpoint keys), then slot variables' paths."""
    paths = _keys.key_paths(nodes)
    for i in paths:  # in the order the walk reached them, so the first bad reference met is the one reported
        for ref in nodes[i].children:
            _check_ref(ref.node_id, len(nodes), pb_path, f"a child {ref.local_name!r} of node {i}")
    for i, node in enumerate(nodes):
        for ref in node.slot_variables:
            for n in (ref.original_variable_node_id, ref.slot_variable_node_id):
                _check_ref(n, len(nodes), pb_path, f"a slot variable reference of node {i}")
            primary = paths.get(ref.original_variable_node_id)
            if ref.slot_variable_node_id not in paths and primary is not None and i in paths:
                paths[ref.slot_variable_node_id] = _keys.slot_path(primary, paths[i], ref.slot_name)
    return paths


def _dtype(enum: int) -> np.dtype | None:
    # None for DT_INVALID (e.g. the init op's NoOp) and types numpy lacks
    return np.dtype(object) if enum == _dtypes.STRING_ENUM else _dtypes.BY_ENUM.get(enum)


def _shape(proto) -> tuple[int | None, ...] | None:
    return None if proto.unknown_rank else tuple(d.size if d.size >= 0 else None for d in proto.dim)


def _node(i: int, node, path: str | None, meta, assets_dir: str, pb_path: str) -> SavedNode:
    kind = node.WhichOneof("kind") or ""
    children: dict[str, int] = {}
    for ref in node.children:
        children.setdefault(ref.local_name, ref.node_id)
    fields: dict = {}
    if kind == "user_object":
        fields["identifier"] = node.user_object.identifier
    elif kind == "variable":
        v = node.variable
        fields.update(name=v.name, dtype=_dtype(v.dtype), shape=_shape(v.shape), trainable=v.trainable)
    elif kind == "asset":
        index = node.asset.asset_file_def_index
        if not 0 <= index < len(meta.asset_file_def):
            raise CheckpointFormatError(f"{pb_path}: asset node {i} ({path!r}) refers to asset file {index}, but the "
                                        f"MetaGraphDef lists {len(meta.asset_file_def)}")
        fields["asset_path"] = _asset_file(assets_dir, meta.asset_file_def[index].filename, pb_path, path)
    return SavedNode(id=i, path=path, kind=kind, children=children, **fields)


def _asset_file(assets_dir: str, filename: str, pb_path: str, path: str | None) -> str:
    # A file name read from the SavedModel must name a file inside its assets/ directory, never outside; and
    # assets/ itself must not lead out (a link to /etc would hand out any file on this machine as an asset).
    model, root = os.path.realpath(os.path.dirname(assets_dir)), os.path.realpath(assets_dir)
    if os.path.commonpath([model, root]) != model or root == model:
        raise CheckpointFormatError(f"{pb_path}: asset {path!r}: the assets directory {assets_dir} is a symbolic link "
                                    f"to {root}, outside the SavedModel {model}, which read_saved_model refuses (as "
                                    "checkpoint.load does); copy the files themselves into assets/")
    target = os.path.realpath(os.path.join(assets_dir, filename))
    if not filename or os.path.isabs(filename) or os.path.commonpath([root, target]) != root or target == root:
        raise CheckpointFormatError(f"{pb_path}: asset {path!r} names file {filename!r}, which is not inside "
                                    f"{assets_dir}; an asset must be a file under the SavedModel's assets/ directory")
    if not os.path.isfile(target):
        raise CheckpointFormatError(f"{pb_path}: asset {path!r} file {os.path.join(assets_dir, filename)} is missing; "
                                    "copy the SavedModel's assets/ directory with it")
    return os.path.abspath(os.path.join(assets_dir, filename))


def _checkpoint_keys(reader: BundleReader) -> dict[str, str]:
    """Node path -> the key of its VARIABLE_VALUE, from the checkpoint's own object graph."""
    graph = reader.object_graph
    if graph is None:
        raise CheckpointFormatError(f"{reader.index_path}: the SavedModel's variables checkpoint has no object graph "
                                    f"({_keys.OBJECT_GRAPH_KEY}); it was not written by tf.saved_model.save")
    paths = _paths(graph.nodes, reader.index_path)
    return {paths[i]: attr.checkpoint_key for i, node in enumerate(graph.nodes) for attr in node.attributes
            if attr.name == _keys.VARIABLE_VALUE and i in paths}


def _read_values(prefix: str, variable_nodes: dict[str, SavedNode]) -> dict[str, np.ndarray]:
    with BundleReader(prefix) as reader:
        keys = _checkpoint_keys(reader)
        values = {}
        for path, node in variable_nodes.items():
            key = keys.get(path)
            if key is None or key not in reader:
                raise CheckpointFormatError(f"{reader.index_path}: no value for variable {node.name!r} at path "
                                            f"{node.path!r} of the SavedModel's object graph; the variables/ "
                                            "directory belongs to another SavedModel or is incomplete")
            value = reader.get(key)
            if (node.dtype is not None and value.dtype != node.dtype) or (
                    node.shape is not None and not _shape_fits(value.shape, node.shape)):
                raise CheckpointFormatError(
                    f"{reader.index_path}: key {key!r} holds {value.dtype}{list(value.shape)}, but the SavedModel "
                    f"declares variable {node.name!r} ({node.path!r}) as {node.dtype}{list(node.shape or ())}")
            values[path] = value
        return values


def _shape_fits(shape: tuple[int, ...], declared: tuple[int | None, ...]) -> bool:
    return len(shape) == len(declared) and all(d is None or d == s for s, d in zip(shape, declared, strict=True))


def _specs(entries: Mapping) -> dict[str, TensorSpec]:
    """A signature's inputs or outputs (TensorInfo protos by name) as TensorSpecs, sorted by name."""
    return {k: TensorSpec(dtype=_dtype(v.dtype), shape=_shape(v.tensor_shape), tensor=v.name,
                          encoding=v.WhichOneof("encoding") or "name") for k, v in sorted(entries.items())}
