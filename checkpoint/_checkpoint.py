"""`Checkpoint`: save pytrees by TF's object graph (orbax or TF format); `restore` hands off to `_status`."""

from __future__ import annotations

import os
from typing import Any

import jax
import numpy as np

from checkpoint import _graph, _orbax
from checkpoint._errors import DataLossError
from checkpoint._status import LoadStatus, _InitializationOnlyStatus, _RestoreState
from varstate._partition import PartitionedVariable


def _values(graph: _graph.Graph) -> dict[str, Any]:
    """{checkpoint key: array | Python scalar | [(SaveSliceInfo, array), ...]} for storage."""
    out: dict[str, Any] = {}
    for s in graph.saveables:
        obj = s.obj
        if isinstance(obj, (PartitionedVariable, list)):
            shards = list(obj)
            for v in shards:
                if v.save_slice_info is None:
                    raise ValueError(f"Cannot save {s.key!r}: shard {v.name!r} has no SaveSliceInfo.")
                _initialized(s.key, v.value)
            out[s.key] = [(v.save_slice_info, v.value) for v in shards]
        else:
            var = _graph.as_variable(obj)
            out[s.key] = _initialized(s.key, var.value if var is not None else obj)
            if var is not None and var.handle.saved_dtype not in (None, var.dtype):
                out[s.key] = np.asarray(jax.device_get(out[s.key])).astype(var.handle.saved_dtype)
            if isinstance(out[s.key], jax.Array) and jax.dtypes.issubdtype(out[s.key].dtype, jax.dtypes.prng_key):
                raise TypeError(
                    f"Cannot save {s.key!r}: a PRNG key array ({out[s.key].dtype}) has no storable dtype. Save "
                    "jax.random.key_data(key) and rebuild the key with jax.random.wrap_key_data after restoring."
                )
    return out


def _initialized(key: str, value: Any) -> Any:
    if isinstance(value, jax.ShapeDtypeStruct):
        raise ValueError(
            f"Cannot save {key!r}: the value is uninitialized (shape {value.shape}, {value.dtype}). "
            "Initialize it (varstate.zero_initializer, assign, or restore) before saving."
        )
    return value


def _tf_tensors(values: dict[str, Any], proto) -> dict[str, Any]:
    """The same values as host arrays for TF's TensorBundle (slices assembled)."""
    tensors: dict[str, Any] = {}
    for key, v in values.items():
        if isinstance(v, list):
            full = np.zeros(v[0][0].full_shape, np.dtype(v[0][1].dtype))
            for info, part in v:
                full[tuple(slice(o, o + n) for o, n in zip(info.var_offset, info.var_shape, strict=True))] = part
            tensors[key] = full
        elif isinstance(v, str):
            tensors[key] = v.encode()
        elif isinstance(v, (bool, int, float)):
            if type(v) is int and not -(2**63) <= v < 2**63:
                raise OverflowError(
                    f"Cannot save {key!r} in the TF format: the Python int {v} does not fit in int64. Save with "
                    "format='orbax' (any int), or store the number as a string."
                )
            tensors[key] = np.asarray(v, np.int64 if type(v) is int else None)
        else:
            tensors[key] = np.asarray(jax.device_get(v))
    tensors[_graph.OBJECT_GRAPH_KEY] = proto.SerializeToString()
    return tensors


def open_reader(path: str) -> Any:
    """A reader for `path`: a TF checkpoint (``path.index``) or an orbax-format directory."""
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"Checkpoint path must be a string, got {type(path).__name__} {path!r}.")
    path = os.fspath(path)
    if os.path.isfile(path + ".index"):
        from checkpoint._reader import read_checkpoint  # written separately; imported when needed

        return read_checkpoint(path)
    if _orbax.is_checkpoint(path) or os.path.isdir(path):
        return _orbax.OrbaxReader(path)
    raise FileNotFoundError(
        f"No checkpoint found at {path!r} (neither a directory written by Checkpoint.save/write nor "
        f"a TF checkpoint prefix with {path + '.index'!r}). Use checkpoint.latest_checkpoint(directory)."
    )


class Checkpoint:
    """Groups pytrees (roots) to save and restore by object-graph structure, as `tf.train.Checkpoint`.

    Roots may hold Variables, PartitionedVariables, OptimizerStates, plain
    arrays and Python scalars, in dicts, lists, tuples, NamedTuples and
    dataclasses. `save` numbers checkpoints (``prefix-1``, ``prefix-2``...);
    `restore` returns a `LoadStatus` holding new roots with the templates'
    structure and resource ids.

    >>> import os, tempfile, jax.numpy as jnp, varstate, checkpoint
    >>> model = {"kernel": varstate.Variable(jnp.ones((2, 2))), "bias": varstate.Variable(jnp.zeros(2))}
    >>> path = checkpoint.Checkpoint(model=model).save(os.path.join(tempfile.mkdtemp(), "ckpt"))
    >>> os.path.basename(path)
    'ckpt-1'
    >>> template = {"kernel": varstate.Variable(jnp.zeros((2, 2))), "bias": varstate.Variable(jnp.ones(2))}
    >>> status = checkpoint.Checkpoint(model=template).restore(path)
    >>> status.assert_consumed().model["kernel"].value.tolist()
    [[1.0, 1.0], [1.0, 1.0]]
    """

    def __init__(self, **roots: Any) -> None:
        if _graph.SAVE_COUNTER in roots:
            raise ValueError("Checkpoint: 'save_counter' is reserved for the checkpoint's own save counter.")
        self._roots = dict(sorted(roots.items()))
        self.save_counter = 0  # number of `save` calls, saved like TF's (int64)
        self._counter_tracked = False

    def __getattr__(self, name: str) -> Any:
        roots = self.__dict__.get("_roots", {})
        if name in roots:
            return roots[name]
        raise AttributeError(f"Checkpoint has no root {name!r}; its roots are {sorted(roots)}.")

    def _graph(self) -> _graph.Graph:
        roots = dict(self._roots)
        if self._counter_tracked:
            roots[_graph.SAVE_COUNTER] = np.int64(self.save_counter)
        return _graph.build(roots)

    def write(self, path: str, format: str = "orbax", *, _checkpointer: Any = None) -> str:
        """Writes the roots to `path` and returns it once committed (no numbering).

        `format="tf"` writes a TensorBundle (``path.index`` + data files) that
        TensorFlow reads. An existing checkpoint at `path` is replaced, and the
        replacement is not atomic: `CheckpointManager` unlists a checkpoint before
        rewriting it.
        """
        path = os.path.abspath(os.fspath(path))
        graph = self._graph()
        values = _values(graph)
        if format == "tf":
            from checkpoint._bundle import write_bundle  # written separately; imported when needed

            os.makedirs(os.path.dirname(path), exist_ok=True)
            write_bundle(path, _tf_tensors(values, graph.proto))
            return path
        if format != "orbax":
            raise ValueError(f"Checkpoint.write: unknown format {format!r}; expected 'orbax' or 'tf'.")
        tree, meta = _orbax.layout(values, graph.proto)
        checkpointer = _checkpointer or _orbax.checkpointer()
        checkpointer.save(path, args=_orbax.save_args(tree, meta), force=True)
        if _checkpointer is None:
            checkpointer.close()
        return path

    def save(self, file_prefix: str, format: str = "orbax") -> str:
        """Writes ``file_prefix-N`` (N = the new `save_counter`) and records it as the latest.

        Updates the directory's ``checkpoint`` state file, as TF does.
        """
        self._counter_tracked = True
        self.save_counter += 1
        path = self.write(f"{os.fspath(file_prefix)}-{self.save_counter}", format=format)
        from checkpoint._manager import _record_checkpoint

        _record_checkpoint(os.path.dirname(path), path)
        return path

    def restore(self, save_path: str) -> LoadStatus:
        """Restores the roots from `save_path` by object-graph structure; see `LoadStatus`.

        `save_path=None` (``latest_checkpoint`` found none) returns the roots
        unchanged in a status whose assertions fail, as TF's
        InitializationOnlyStatus.
        """
        if save_path is None:
            return _InitializationOnlyStatus(dict(self._roots))
        reader = open_reader(save_path)
        if reader.object_graph is None:
            raise ValueError(
                f"{save_path!r} is a name-based checkpoint (no object graph): restore it by variable name "
                "with checkpoint.restore_by_name(path, params)."
            )
        state = _RestoreState(reader)
        root = state.proto.nodes[0]
        counter = next((r.node_id for r in root.children if r.local_name == _graph.SAVE_COUNTER), None)
        if counter is not None:
            if not 0 <= counter < len(state.proto.nodes) or not state.proto.nodes[counter].attributes:
                raise DataLossError(
                    f"Checkpoint {save_path!r}: the object graph's save_counter refers to node {counter}, which "
                    "holds no value; the checkpoint is corrupted."
                )
            key = state.proto.nodes[counter].attributes[0].checkpoint_key
            self.save_counter = int(np.asarray(reader.get(key)).item())
            self._counter_tracked = True
            state.matched[counter] = "(root).save_counter"
            state.restored_keys.add(key)
        return LoadStatus(state, {})._restore(self._roots)
