"""`checkpoint.safetensors`: pytrees <-> safetensors, named by object-graph path, restored through the one matcher.

A tree is walked as `Checkpoint` walks a root (`_graph._build`), so a value's
safetensors name is its checkpoint key's node path: ``model/dense/kernel``
for ``(root).model.dense.kernel``, an optimizer slot
``model/w/.OPTIMIZER_SLOT/optimizer/m``. Loading into a template builds the
template's graph, points each value attribute at its name in the file, and
hands that reader to `_graph._match`, as `Checkpoint.restore` does: identity,
shape and dtype checks and placement are the same code.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np

from checkpoint import _keys
from checkpoint._errors import CheckpointFormatError
from checkpoint._graph import _build, _match
from checkpoint._storage._bundle_writer import assembled
from checkpoint._storage._safetensors import (
    NAMES_ARE_PATHS,
    PATHS,
    PRNG_IMPL,
    PYTHON,
    SafetensorsReader,
    parse_size,
    unescape,
    write,
)
from checkpoint._storage._save import collector_paused
from varstate import PartitionedVariable, Variable, _seam

NameMap = Mapping[str, str] | Callable[[str], str] | None


def _namer(name_map: NameMap, where: str) -> Callable[[str], str]:
    if name_map is None:
        return lambda path: path
    if isinstance(name_map, Mapping):
        return lambda path: name_map.get(path, path)
    if callable(name_map):
        return name_map
    raise TypeError(f"{where}: name_map must be a mapping or a function from object-graph path to name, got "
                    f"{type(name_map).__name__}")


def _graph(tree: Any) -> _build.Graph:
    # The tree is the one root, the top of the paths: its children's paths start there ("model/w", not "/model/w").
    return _build.build({"": tree}, top="")


@collector_paused()
def save(path: str | os.PathLike, tree: Any, *, max_shard_size: int | str | None = None,
         name_map: NameMap = None) -> str:
    """Writes the arrays of `tree` to a safetensors file, or to Hugging Face's shards and index.

    Each value is named by its object-graph path, as `Checkpoint` keys it
    (``{"model": {"dense": {"kernel": v}}}`` -> ``model/dense/kernel``; a
    ``/`` or ``.`` inside a name is escaped as ``.S`` or ``..``), or by
    `name_map`. What a tensor cannot hold goes into ``__metadata__``: Python
    values (``varstate.python``, JSON by path), a PRNG key's implementation
    (``varstate.prng_impl``; the key is stored as its key data), and
    ``varstate.names`` when names are paths. A `PartitionedVariable` is
    stored whole. Every file is written under a temporary name, fsynced and
    renamed into place (the index last).

    Args:
        path: the file to write (``model.safetensors``); with shards, the
            index is ``model.safetensors.index.json`` beside the shards
            ``model-00001-of-0000N.safetensors``.
        tree: a pytree of Variables, arrays, optimizer states and Python values
            (anything `Checkpoint` saves).
        max_shard_size: None for one file; else the most bytes of a shard, as
            an int or a string such as ``"5GB"`` or ``"500MiB"`` (a larger
            tensor gets a shard of its own; if all fit in one, one file).
        name_map: {object-graph path: name} (paths not in it keep their path),
            or a function from path to name: to write Hugging Face's names
            (``model.layers.0.weight``).

    Returns:
        The path to load: the file, or the index.

    Raises:
        ValueError: a dtype safetensors has no name for (float8_e4m3b11fnuz,
            complex128, int4, strings), two values mapped to one name, a
            sharded `path` not ending in ``.safetensors``.

    >>> import os, tempfile, jax.numpy as jnp, varstate, checkpoint.safetensors as st
    >>> tree = {"dense": {"kernel": varstate.Variable(jnp.ones((2, 3), jnp.bfloat16)), "bias": jnp.zeros(3)}}
    >>> path = st.save(os.path.join(tempfile.mkdtemp(), "model.safetensors"), tree)
    >>> from safetensors import safe_open
    >>> with safe_open(path, framework="flax") as f:
    ...     sorted(f.keys()), f.get_tensor("dense/kernel").dtype
    (['dense/bias', 'dense/kernel'], dtype(bfloat16))
    """
    where = f"checkpoint.safetensors.save({os.fspath(path)!r})"
    path = os.path.abspath(os.fspath(path))
    namer = _namer(name_map, where)
    graph = _graph(tree)
    values = _build.values(graph)
    tensors: dict[str, Any] = {}
    python: dict[str, Any] = {}
    impls: dict[str, str] = {}
    origin: dict[str, str] = {}
    for s in graph.saveables:
        node = _keys.node_path(s.key)
        value = values[s.key]
        if s.attribute == _keys.PY_STATE:
            python[node] = value
        elif s.attribute == _build.PRNG_KEY_IMPL:
            impls[node] = value
        else:
            name = namer(node)
            if not isinstance(name, str) or not name or name == "__metadata__" or name in origin:
                raise ValueError(f"{where}: name_map gives {node!r} the name {name!r}, " + (
                    f"which {origin[name]!r} has too" if name in origin else "which safetensors cannot hold") +
                    "; map each path to its own non-empty name")
            origin[name] = node
            tensors[name] = assembled(value) if isinstance(value, list) else value
    metadata = {}
    if name_map is None:
        metadata[NAMES_ARE_PATHS] = PATHS
    if python:
        metadata[PYTHON] = json.dumps(python, sort_keys=True)
    if impls:
        metadata[PRNG_IMPL] = json.dumps(impls, sort_keys=True)
    size = None if max_shard_size is None else parse_size(max_shard_size, where)
    return write(path, tensors, metadata, size)


class _TemplateReader:
    """A safetensors file seen through a template's object graph: its value attributes name tensors of the file,
    its Python values and PRNG implementations come from the metadata."""

    def __init__(self, st: SafetensorsReader, graph: _build.Graph, namer: Callable[[str], str]) -> None:
        self.st, self.path, self.format_name = st, st.path, st.format_name
        self.object_graph = graph.proto
        self.extra: dict[str, Any] = {}
        meta = {k: _json(st, k) for k in (PYTHON, PRNG_IMPL)}
        labels = [n.replace("(root)..", "(root).") for n in _build.node_names(graph.proto)]
        for i, node in enumerate(graph.proto.nodes):
            for attr in node.attributes:
                path = _keys.node_path(attr.checkpoint_key)
                if attr.name == _keys.PY_STATE or attr.name == _build.PRNG_KEY_IMPL:
                    found = meta[PYTHON if attr.name == _keys.PY_STATE else PRNG_IMPL].get(path)
                    if found is None and attr.name == _keys.PY_STATE:
                        raise ValueError(f"checkpoint.safetensors.load: {st.path} holds no Python value for "
                                         f"{labels[i]} (path {path!r} in its {PYTHON} metadata); leave it out "
                                         "of the template or save it with checkpoint.safetensors.save")
                    if found is not None:
                        # a string as the bytes a TF reader gives, which the matcher decodes
                        self.extra[attr.checkpoint_key] = np.asarray(found.encode() if isinstance(found, str)
                                                                     else found)
                    continue
                name = namer(path)
                if name not in st:
                    near = [k for k in st.keys() if k.rsplit("/", 1)[-1] == path.rsplit("/", 1)[-1]][:3]
                    raise ValueError(
                        f"checkpoint.safetensors.load: {st.path} holds no tensor {name!r} for {labels[i]}"
                        + (f" (similar names: {near})" if near else f" (it holds {len(st.keys())} tensors)")
                        + "; pass name_map={path: name} for names other than object-graph paths, or leave the "
                        "value out of the template")
                attr.checkpoint_key = name

    def keys(self) -> list[str]:
        return [*self.st.keys(), *self.extra]

    def __contains__(self, key: str) -> bool:
        return key in self.extra or key in self.st

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self.extra[key].shape) if key in self.extra else self.st.shape(key)

    def dtype(self, key: str) -> np.dtype:
        return self.extra[key].dtype if key in self.extra else self.st.dtype(key)

    def get(self, key: str) -> Any:
        return self.extra[key] if key in self.extra else self.st.get(key)

    def get_slices(self, key: str) -> list[tuple[slice, ...]]:
        return []

    def get_into(self, key: str, sharding: Any) -> Any:
        return self.st.get_into(key, sharding)

    def get_many(self, requests: dict[str, Any]) -> dict[str, Any]:
        stored = self.st.get_many({k: s for k, s in requests.items() if k not in self.extra})
        return {k: self.extra[k] if k in self.extra else stored[k] for k in requests}

    def stored_together(self, keys: list[str]) -> list[list[str]]:
        return self.st.stored_together(keys)

    def release(self) -> None:
        self.st.release()


def _json(st: SafetensorsReader, key: str) -> dict[str, Any]:
    text = st.metadata.get(key)
    if text is None:
        return {}
    try:
        value = json.loads(text)
    except ValueError:
        value = None
    if not isinstance(value, dict):
        raise CheckpointFormatError(f"{st.path}: __metadata__ entry {key!r} is not a JSON object; the file is "
                                    "damaged")
    for path, item in value.items():  # Python scalars, or a PRNG implementation's name
        if not isinstance(item, str if key == PRNG_IMPL else (bool, int, float, str)) or (
                type(item) is int and not -(2**63) <= item < 2**63):
            raise CheckpointFormatError(f"{st.path}: __metadata__ entry {key!r} holds {item!r:.40} at {path!r}, "
                                        f"expected {'a name' if key == PRNG_IMPL else 'a bool, int64, float or str'}; "
                                        "the file is damaged")
    return value


def _is_variable(x: Any) -> bool:
    return isinstance(x, Variable)


def _placed(template: Any, sharding: Any) -> Any:
    """The template with each Variable's value and each array an uninitialized value on its sharding."""

    def one(leaf: Any, s: Any) -> Any:
        if not isinstance(s, jax.sharding.Sharding):
            raise TypeError(f"checkpoint.safetensors.load: sharding must be a jax.sharding.Sharding or a tree of "
                            f"them matching the template, found {type(s).__name__} {s!r:.60}")
        if isinstance(leaf, Variable):
            return _seam.with_value(leaf, jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=s))
        if isinstance(leaf, (jax.Array, np.ndarray, jax.ShapeDtypeStruct)):
            return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=s)
        return leaf

    if isinstance(sharding, jax.sharding.Sharding):
        return jax.tree.map(lambda leaf: one(leaf, sharding), template, is_leaf=_is_variable)
    try:
        return jax.tree.map(one, template, sharding, is_leaf=_is_variable)
    except ValueError as e:
        raise ValueError(f"checkpoint.safetensors.load: the sharding tree does not match the template ({e}); give "
                         "one jax.sharding.Sharding, or a tree with a Sharding where the template has each "
                         "Variable or array") from None


@collector_paused()
def load(path_or_index: str | os.PathLike, template: Any = None, *, sharding: Any = None,
         name_map: NameMap = None) -> Any:
    """Reads a safetensors file or sharded index into `template`, or as a nested dict.

    Values are read with pread into fresh 64-byte-aligned buffers (never an
    mmap, so truncating the file later cannot crash the process), and a value
    bound for a `jax.sharding.Sharding` reads, for each distinct shard, only
    the bytes that shard holds, straight onto its device.

    Args:
        path_or_index: a ``.safetensors`` file, a ``.safetensors.index.json``,
            or a directory holding one index or one safetensors file.
        template: None, or a pytree as `save` takes it. Its values are matched
            by object-graph path (or `name_map`), checked (shape, dtype) and
            restored as `Checkpoint.restore` does: Variables keep their
            identity (same handle), tensors of the file the template lacks
            are not read.
        sharding: None (a template's own placement; numpy arrays without
            one), one `jax.sharding.Sharding` for every value, or (with a
            template) a tree of them with the template's structure, a Sharding
            where it has each Variable or array.
        name_map: as for `save`: {object-graph path: name in the file} or a
            function; e.g. Hugging Face's ``model.layers.0.weight`` for a
            template path ``model/layers/0/weight``.

    Returns:
        The restored tree; without a template, a dict: nested by path for a
        file `save` wrote with path names (a slot under its optimizer, then
        its slot name, then its variable's path, as `restore_arrays` nests
        them), else flat by the file's names.

    Raises:
        ValueError: a template value missing from the file, of another shape,
            or a sharding tree that does not match the template.
        TypeError: a dtype the template's value cannot take.
        CheckpointFormatError: a damaged or hostile file (header too large or
            not JSON, byte ranges outside the file or overlapping, byte counts
            not matching dtype and shape, an index naming a file outside its
            directory), naming the file and the tensor.
        FileNotFoundError: nothing at `path_or_index`.

    >>> import os, tempfile, jax.numpy as jnp, varstate, checkpoint.safetensors as st
    >>> w = varstate.Variable(jnp.arange(4.0))
    >>> path = st.save(os.path.join(tempfile.mkdtemp(), "model.safetensors"), {"w": w, "step": 3})
    >>> back = st.load(path, {"w": w, "step": 0})
    >>> back["w"].handle is w.handle, back["w"].value.tolist(), back["step"]
    (True, [0.0, 1.0, 2.0, 3.0], 3)
    >>> st.load(path)["w"].tolist()
    [0.0, 1.0, 2.0, 3.0]
    """
    st = SafetensorsReader(path_or_index)
    if template is None:
        return _as_dict(st, sharding)
    if isinstance(template, (Variable, PartitionedVariable)) or not jax.tree.leaves(template, is_leaf=_is_variable):
        raise TypeError(f"checkpoint.safetensors.load: the template must be a pytree of Variables and arrays (a "
                        f"dict, list, dataclass, nnx Module), found {type(template).__name__}")
    if sharding is not None:
        template = _placed(template, sharding)
    graph = _graph(template)
    reader = _TemplateReader(st, graph, _namer(name_map, "checkpoint.safetensors.load"))
    try:
        return _match.restore_roots(_match.RestoreState(reader, expect_partial=True), {"": template})[""]
    except (ValueError, TypeError) as e:  # the matcher's errors name the tensor; the file is said here
        raise type(e)(f"{st.path}: {str(e).replace('(root)..', '(root).')}") from None


def nested_path(name: str) -> list[str]:
    """The nested-dict path of a name written from object-graph paths; a slot goes under its optimizer."""
    primary, slot, rest = name.partition(f"/{_keys.OPTIMIZER_SLOT}/")
    parts = [unescape(p) for p in primary.split("/")]
    if not slot:
        return parts
    optimizer, _, slot_name = rest.rpartition("/")
    return [*(unescape(p) for p in optimizer.split("/")), unescape(slot_name), *parts]


def _as_dict(st: SafetensorsReader, sharding: Any) -> dict[str, Any]:
    if sharding is not None and not isinstance(sharding, jax.sharding.Sharding):
        raise TypeError(f"checkpoint.safetensors.load: without a template, sharding must be one "
                        f"jax.sharding.Sharding, found {type(sharding).__name__}")
    nested = st.metadata.get(NAMES_ARE_PATHS) == PATHS
    if sharding is not None:
        for key in st.keys():
            try:
                sharding.shard_shape(st.shape(key))
            except (ValueError, IndexError) as e:  # IndexError: a spec with more axes than the value has
                raise ValueError(
                    f"checkpoint.safetensors.load: {st.path}: tensor {key!r} of shape {st.shape(key)} cannot take "
                    f"{sharding} ({e if isinstance(e, ValueError) else 'its spec has more axes than the value'}); give "
                    "a template with a sharding per value, or one sharding every value allows (PartitionSpec() "
                    "replicates)") from None
    values: dict[str, Any] = st.get_many(dict.fromkeys(st.keys(), sharding))
    if not nested:
        return values
    python = _json(st, PYTHON)
    for name in python:
        if name in values:
            raise CheckpointFormatError(f"{st.path}: {name!r} is both a tensor and a Python value of its "
                                        f"{PYTHON} metadata; the file is damaged")
    values.update(python)
    out: dict[str, Any] = {}
    for name, value in values.items():
        where = nested_path(name)
        tree = out
        for part in where[:-1]:
            tree = tree.setdefault(part, {})
            if not isinstance(tree, dict):
                break
        if not isinstance(tree, dict) or where[-1] in tree:
            raise ValueError(f"checkpoint.safetensors.load: {st.path}: two values at {'.'.join(where)} (one is "
                             f"{name!r}); load it with a template, or read it by name with safetensors' safe_open")
        tree[where[-1]] = value
    return out
