"""`Checkpoint`: roots -> object graph (`_graph`) -> storage (`_storage`) and back; orchestration only."""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from checkpoint import _graph, _keys, _storage
from checkpoint._errors import DataLossError
from checkpoint._status import InitializationOnlyStatus, LoadStatus


def read_checkpoint(path: str | os.PathLike) -> _storage.Reader:
    """Opens any checkpoint this package reads: orbax, TF object-based (TF2) or TF name-based (TF1 Saver).

    `path` is a checkpoint prefix (the path before ``.index``), a directory
    (its ``checkpoint`` state file names the latest checkpoint, which must lie
    inside it), the state file itself, or an orbax checkpoint directory.

    The reader offers ``keys()``, ``get(key) -> np.ndarray`` (checksums
    verified), ``shape(key)``, ``dtype(key)``, ``object_graph`` (the
    TrackableObjectGraph; None for a name-based checkpoint) and, for TF
    checkpoints, ``get_slices(key)`` (the saved slices of a partitioned
    variable, which ``get`` reassembles). Corrupt files raise
    `CheckpointFormatError` naming the file and key.

    >>> import numpy as np, tempfile, os, checkpoint
    >>> prefix = os.path.join(tempfile.mkdtemp(), "model.ckpt")
    >>> _ = checkpoint.write_name_based(prefix, {"dense/kernel": np.ones((2, 3), np.float32)})
    >>> reader = checkpoint.read_checkpoint(prefix)
    >>> reader.keys(), reader.shape("dense/kernel"), reader.dtype("dense/kernel"), reader.object_graph
    (['dense/kernel'], (2, 3), dtype('float32'), None)
    >>> reader.get("dense/kernel").sum()
    np.float32(6.0)
    """
    return _storage.open_reader(path)


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
        if _keys.SAVE_COUNTER in roots:
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
            roots[_keys.SAVE_COUNTER] = np.int64(self.save_counter)
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
        values = _graph.values(graph)
        if format == "tf":
            from checkpoint._storage._tensors import tf_tensors

            os.makedirs(os.path.dirname(path), exist_ok=True)
            _storage.write_bundle(path, tf_tensors(values, graph.proto.SerializeToString()))
            return path
        if format != "orbax":
            raise ValueError(f"Checkpoint.write: unknown format {format!r}; expected 'orbax' or 'tf'.")
        from checkpoint._storage import _orbax

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
        _storage.record_latest(os.path.dirname(path), path)
        return path

    def restore(self, save_path: str) -> LoadStatus:
        """Restores the roots from `save_path` by object-graph structure; see `LoadStatus`.

        `save_path=None` (``latest_checkpoint`` found none) returns the roots
        unchanged in a status whose assertions fail, as TF's
        InitializationOnlyStatus.
        """
        if save_path is None:
            return InitializationOnlyStatus(dict(self._roots))
        reader = _storage.open_reader(save_path)
        if reader.object_graph is None:
            raise ValueError(
                f"{save_path!r} is a name-based checkpoint (no object graph): restore it by variable name "
                "with checkpoint.restore_by_name(path, params)."
            )
        state = _graph.RestoreState(reader)
        root = state.proto.nodes[0]
        counter = next((r.node_id for r in root.children if r.local_name == _keys.SAVE_COUNTER), None)
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
        return LoadStatus(state, _graph.restore_roots(state, self._roots))
