"""`Checkpoint`: roots -> object graph (`_graph`) -> storage (`_storage`) and back; orchestration only."""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from checkpoint import _graph, _keys, _publish, _storage
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


def _check_format(format: str, where: str) -> None:
    if format not in ("orbax", "tf"):
        raise ValueError(f"{where}: unknown format {format!r}; expected 'orbax' or 'tf'.")


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

    def write(self, path: str, format: str = "orbax") -> str:
        """Writes the roots to `path` and returns it once committed (no numbering).

        `format="tf"` writes a TensorBundle (``path.index`` + data files) that
        TensorFlow reads. An existing checkpoint at `path` is replaced, never
        leaving a moment without one: the new checkpoint is written completely
        under a temporary name first, and where the directory's ``checkpoint``
        state file names the old one, it names a stand-in for it (hard links)
        while the two are swapped.

        >>> import os, tempfile, jax.numpy as jnp, checkpoint
        >>> path = os.path.join(tempfile.mkdtemp(), "weights")
        >>> _ = checkpoint.Checkpoint(w=jnp.zeros(2)).write(path)
        >>> _ = checkpoint.Checkpoint(w=jnp.ones(2)).write(path, format="tf")  # replaces it
        >>> checkpoint.read_checkpoint(path).get("w/.ATTRIBUTES/VARIABLE_VALUE").tolist()
        [1.0, 1.0]
        """
        path = os.path.abspath(os.fspath(path))
        _check_format(format, "Checkpoint.write")
        _publish.check_replaceable(path, format, "Checkpoint.write")
        lock = _publish.begin(os.path.dirname(path))
        try:
            self._write_now(path, format)
        finally:
            lock.release()
        return path

    def save(self, file_prefix: str, format: str = "orbax") -> str:
        """Writes ``file_prefix-N`` (N = the new `save_counter`) and records it as the latest.

        Updates the directory's ``checkpoint`` state file, as TF does. A
        checkpoint already at ``file_prefix-N`` (a new process whose counter
        was not restored) is replaced as `write` replaces one.
        """
        _check_format(format, "Checkpoint.save")
        self._counter_tracked = True
        self.save_counter += 1
        path = os.path.abspath(f"{os.fspath(file_prefix)}-{self.save_counter}")
        _publish.check_replaceable(path, format, "Checkpoint.save")
        directory = os.path.dirname(path)
        lock = _publish.begin(directory)
        try:
            self._write_now(path, format)
            _storage.record_latest(directory, path)
        finally:
            lock.release()
        return path

    def _write_now(self, path: str, format: str) -> None:
        temp = _publish.temporary(path, "new")
        try:
            self._start_write(temp, format)()
            _publish.publish(temp, path)
        except BaseException:
            _publish.remove(temp)
            raise

    def _start_write(self, temp: str, format: str, checkpointer: Any = None, background: bool = False):
        """Starts writing the roots to the unpublished name `temp`; returns the function that finishes it.

        With `background` the values are copied off the arrays before this
        returns, so the caller may update (or donate) them while the returned
        function runs in another thread.
        """
        graph = self._graph()
        values = _graph.values(graph)
        if format == "tf":
            from checkpoint._storage._tensors import tf_tensors

            tensors = tf_tensors(values, graph.proto.SerializeToString())
            if background:  # np.asarray of a CPU jax.Array may share its buffer
                tensors = {k: np.array(v) if isinstance(v, np.ndarray) else v for k, v in tensors.items()}
            return lambda: _storage.write_bundle(temp, tensors)
        from checkpoint._storage import _orbax

        tree, meta = _orbax.layout(values, graph.proto)
        if checkpointer is None:
            checkpointer = _orbax.checkpointer()
            try:
                checkpointer.save(temp, args=_orbax.save_args(tree, meta))
            finally:
                checkpointer.close()
            return lambda: None
        checkpointer.save(temp, args=_orbax.save_args(tree, meta))
        return getattr(checkpointer, "wait_until_finished", lambda: None)

    def restore(self, save_path: str | None, *, strict: bool = False) -> LoadStatus:
        """Restores the roots from `save_path` by object-graph structure; see `LoadStatus`.

        `save_path=None` (``latest_checkpoint`` found none) returns the roots
        unchanged in a status whose assertions fail, as TF's
        InitializationOnlyStatus. By default a partial match is allowed, as in
        TF (check it with the status's assertions, or restore the rest later
        with ``status.restore``); ``strict=True`` raises ValueError unless
        every value of the roots and every value in the checkpoint matched.

        >>> import os, tempfile, jax.numpy as jnp, varstate, checkpoint
        >>> path = checkpoint.Checkpoint(a=jnp.ones(2), b=jnp.ones(2)).write(os.path.join(tempfile.mkdtemp(), "c"))
        >>> checkpoint.Checkpoint(a=jnp.zeros(2)).restore(path, strict=True)
        Traceback (most recent call last):
        ...
        ValueError: Checkpoint.restore(..., strict=True): Unresolved object in checkpoint (root).b: ...
        """
        if save_path is None:
            status: LoadStatus = InitializationOnlyStatus(dict(self._roots))
        else:
            status = self._restore(save_path)
        if strict:
            try:
                status.assert_consumed()
            except AssertionError as e:
                status.expect_partial()
                raise ValueError(
                    f"Checkpoint.restore({save_path!r}, strict=True): {e} With strict=True every value of the "
                    "roots and every value in the checkpoint must match; restore with strict=False to accept a "
                    "partial match."
                ) from None
        return status

    def _restore(self, save_path: str) -> LoadStatus:
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
            dtype, shape = np.dtype(reader.dtype(key)), tuple(reader.shape(key))
            if dtype.kind not in "iu" or shape != ():
                # TF's counter is a scalar int64 variable and TF refuses anything else; rounding 3.9 to 3
                # would number the next save wrongly.
                raise DataLossError(
                    f"Checkpoint {save_path!r}: save_counter ({key!r}) holds {dtype} with shape {shape}; expected "
                    "a scalar integer (TF saves an int64). The checkpoint is corrupted or was not written by "
                    "Checkpoint.save; read its values with checkpoint.read_checkpoint(path) and save them again."
                )
            self.save_counter = int(np.asarray(reader.get(key)).item())
            self._counter_tracked = True
            state.matched[counter] = "(root).save_counter"
            state.restored_keys.add(key)
        return LoadStatus(state, _graph.restore_roots(state, self._roots))
