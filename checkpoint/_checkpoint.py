"""`Checkpoint`: roots -> object graph (`_graph`) -> storage (`_storage`) and back; orchestration only."""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from typing import Any

import numpy as np

from checkpoint import _graph, _keys, _storage
from checkpoint._errors import CheckpointFormatError, DataLossError
from checkpoint._status import InitializationOnlyStatus, LoadStatus
from checkpoint._storage import _distributed, _save


def read_checkpoint(path: str | os.PathLike) -> _storage.Reader:
    """Opens any checkpoint this package reads: orbax, TF object-based (TF2) or TF name-based (TF1 Saver).

    The reader offers ``keys()``, ``get(key) -> np.ndarray`` (checksums
    verified), ``shape(key)``, ``dtype(key)``, ``object_graph`` (the
    TrackableObjectGraph; None for a name-based checkpoint) and, for TF
    checkpoints, ``get_slices(key)`` (the saved slices of a partitioned
    variable, which ``get`` reassembles).

    Args:
        path: a checkpoint prefix (the path before ``.index``), a directory
            (its ``checkpoint`` state file names the latest checkpoint, which
            must lie inside it), the state file itself, or an orbax checkpoint
            directory.

    Returns:
        A reader, described under "Objects returned" in the reference.

    Raises:
        FileNotFoundError: no checkpoint at `path` (the message says what was
            expected).
        CheckpointFormatError: a corrupt file, naming it (and, reading a
            value, its key).

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


@_save.collector_paused()
def restore_arrays(path: str | os.PathLike, *, sharding: Any = None) -> dict[str, Any]:
    """Reads every value of an object-based checkpoint into a nested dict by object-graph path, without templates.

    For scripts without the model's code: ``(root).model.w`` is
    ``arrays["model"]["w"]``. An optimizer's slot for a Variable is under the
    optimizer, by slot name then by the Variable's path
    (``arrays["optimizer"]["m"]["model"]["w"]``). An object holding several
    values (a PRNG key and its implementation, say) is a dict by value name.

    Args:
        path: an orbax directory or a TF object-based prefix (anything
            `read_checkpoint` opens).
        sharding: None for numpy arrays; a `jax.sharding.Sharding` to place
            every value on it with `jax.device_put`.

    Returns:
        The nested dict of arrays.

    Raises:
        ValueError: a name-based checkpoint (no object graph: read it with
            `read_checkpoint`); two values at one path (a slot named as a
            child of its optimizer); a root object that is itself a value.
        FileNotFoundError: no checkpoint at `path`.
        CheckpointFormatError: a corrupt file, or an object graph with no
            nodes or a slot reference outside it.

    >>> import os, tempfile, jax.numpy as jnp, varstate, checkpoint
    >>> model = {"w": varstate.Variable(jnp.ones(2)), "b": jnp.zeros(1)}
    >>> path = checkpoint.Checkpoint(model=model).write(os.path.join(tempfile.mkdtemp(), "c"))
    >>> arrays = checkpoint.restore_arrays(path)
    >>> arrays["model"]["w"].tolist(), sorted(arrays)
    ([1.0, 1.0], ['model'])
    """
    reader = _storage.open_reader(path)
    proto = reader.object_graph
    if proto is None:
        raise ValueError(f"checkpoint.restore_arrays: {os.fspath(path)!r} is a name-based checkpoint (no object "
                         "graph); read its values by name with checkpoint.read_checkpoint(path).get(key).")
    paths = _keys.first_paths(proto.nodes)
    for i, node in enumerate(proto.nodes):  # slots after the walk: a primary may sit deeper than its optimizer
        for ref in node.slot_variables:
            if not 0 <= ref.slot_variable_node_id < len(proto.nodes):
                raise CheckpointFormatError(
                    f"checkpoint.restore_arrays: {os.fspath(path)!r}: a slot variable reference of node {i} refers to "
                    f"node {ref.slot_variable_node_id}, but the object graph has {len(proto.nodes)} nodes")
            if i in paths and ref.original_variable_node_id in paths:
                paths.setdefault(ref.slot_variable_node_id,
                                 paths[i] + (ref.slot_name,) + paths[ref.original_variable_node_id])
    out: dict[str, Any] = {}
    for i, where in paths.items():
        attributes = proto.nodes[i].attributes
        for a in attributes:
            value = reader.get(a.checkpoint_key)
            if sharding is not None:
                import jax

                value = jax.device_put(value, sharding)
            full = where if len(attributes) == 1 and a.name == _keys.VARIABLE_VALUE else (*where, a.name)
            if not full:
                raise ValueError(f"checkpoint.restore_arrays: the root object of {os.fspath(path)!r} is itself a "
                                 f"value ({a.checkpoint_key!r}), which has no path below the root; read it by key "
                                 "with checkpoint.read_checkpoint(path).get(key).")
            tree = out
            for part in full[:-1]:
                tree = tree.setdefault(part, {})
                if not isinstance(tree, dict):
                    break
            if not isinstance(tree, dict) or full[-1] in tree:
                raise ValueError(f"checkpoint.restore_arrays: two values at {'.'.join(('(root)', *full))} of "
                                 f"{os.fspath(path)!r} (one is {a.checkpoint_key!r}); read them by key with "
                                 "checkpoint.read_checkpoint(path).get(key).")
            tree[full[-1]] = value
    return out


def check_format(format: str, where: str) -> None:
    if format not in ("orbax", "tf"):
        raise ValueError(f"{where}: unknown format {format!r}; expected 'orbax' or 'tf'.")


def _checked_graph(roots: dict[str, Any], what: str) -> tuple[Any, dict[str, Any]]:
    """The object graph of `roots` and its values, checked in a `jax.distributed` job to agree between processes.

    What must agree: the graph (names, structure) and every value's shape and dtype.
    """
    graph = _graph.graph_of(roots)
    values = _graph.values(graph)
    if _distributed.process_count() > 1:
        kinds = [f"{k}:{getattr(v, 'shape', None)}:{getattr(v, 'dtype', type(v).__name__)}"
                 for k, v in sorted(values.items()) if not isinstance(v, list)]
        fingerprint = graph.proto.SerializeToString(deterministic=True) + "\n".join(kinds).encode()
        _distributed.check_same(what, fingerprint, kinds)
    return graph, values


def _tf_of_processes(temp: str, values: dict[str, Any], graph: bytes):
    """A TensorBundle written by every process: its own data file each, one merged index (process 0's)."""
    from checkpoint._storage._bundle_writer import Sliced, tf_tensors, write_bundle_of_processes

    python = {k: v for k, v in values.items() if isinstance(v, (bool, int, float, str))}
    tensors = tf_tensors(python, graph)  # Python values as TF stores them, and the object graph
    for key, v in values.items():
        if isinstance(v, list):  # a PartitionedVariable: its shards (each maybe split over processes) as slices
            tensors[key] = Sliced(tuple(v[0][0].full_shape), [(tuple(info.var_offset), part) for info, part in v])
        elif key not in python:
            tensors[key] = v
    index, count = _distributed.process_index(), _distributed.process_count()
    return lambda: write_bundle_of_processes(temp, tensors, index, count, _distributed.allgather_bytes)


class Checkpoint:
    """Groups pytrees (roots) to save and restore by object-graph structure, as `tf.train.Checkpoint`.

    Roots may hold Variables, PartitionedVariables, OptimizerStates, plain
    arrays and Python scalars, in dicts, lists, tuples, NamedTuples and
    dataclasses. `save` numbers checkpoints (``prefix-1``, ``prefix-2``...);
    `restore` returns a `LoadStatus` holding new roots with the templates'
    structure and resource ids.

    Args:
        **roots: the roots by name (``model=params, optimizer=state``); each
            name is the first part of its values' checkpoint keys
            (``model/kernel/.ATTRIBUTES/VARIABLE_VALUE``).

    An optimizer state's slots are saved under their Variables' nodes, as TF
    saves them, so a slot whose Variable is not among the roots is left out
    (an optimizer saved alone keeps only its non-slot values, as
    ``tf.train.Checkpoint(optimizer=opt)``; a part of the model keeps the
    slots of that part). Saving a state beside a model that holds none of
    its slots' Variables (an nnx Module, or params rebuilt, instead of the
    params the optimizer stepped) raises ValueError at `save` and `write`.

    Raises:
        ValueError: a root named ``save_counter`` (the checkpoint's own counter).

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

    def write(self, path: str, format: str = "orbax", *, packed: bool = True) -> str:
        """Writes the roots to `path` and returns it once committed (no numbering).

        An existing checkpoint at `path` is replaced, never
        leaving a moment without one: the new checkpoint is written completely
        under a temporary name first, and where the directory's ``checkpoint``
        state file names the old one, it names a stand-in for it (hard links)
        while the two are swapped.

        Args:
            path: where to write: an orbax directory, or a TF prefix (the path
                before ``.index``) with ``format="tf"``.
            format: ``"orbax"``, or ``"tf"`` for a TensorBundle (``path.index``
                + data files) that TensorFlow reads.
            packed: (orbax) pack small values together; False stores each
                value as its own orbax array (below).

        Returns:
            The absolute path written.

        Raises:
            ValueError: an unknown `format`.

        >>> import os, tempfile, jax.numpy as jnp, checkpoint
        >>> path = os.path.join(tempfile.mkdtemp(), "weights")
        >>> _ = checkpoint.Checkpoint(w=jnp.zeros(2)).write(path)
        >>> _ = checkpoint.Checkpoint(w=jnp.ones(2)).write(path, format="tf")  # replaces it
        >>> checkpoint.read_checkpoint(path).get("w/.ATTRIBUTES/VARIABLE_VALUE").tolist()
        [1.0, 1.0]

        ``packed=False`` (orbax format) stores every value as its own orbax
        array named by its checkpoint key, instead of packing small values
        together, so plain orbax reads it without this package into
        {checkpoint key: numpy array} (a sliced value's slice i under
        ``<key>@slice_<i>``; strings only in ``meta/``); slower with many
        small values:

        >>> import jax, numpy as np, orbax.checkpoint as ocp
        >>> path = checkpoint.Checkpoint(w=jnp.arange(3.0)).write(path + "-plain", packed=False)
        >>> values = os.path.join(path, "values")
        >>> ckptr = ocp.PyTreeCheckpointer()
        >>> tree = ckptr.metadata(values).item_metadata.tree
        >>> arrays = ckptr.restore(values, restore_args=jax.tree.map(
        ...     lambda _: ocp.RestoreArgs(restore_type=np.ndarray), tree))
        >>> arrays["w/.ATTRIBUTES/VARIABLE_VALUE"].tolist()
        [0.0, 1.0, 2.0]
        """
        path = os.path.abspath(os.fspath(path))
        check_format(format, "Checkpoint.write")
        with _save.collector_paused():
            _save.start(path, format, "Checkpoint.write",
                        lambda temp: start_write(self, temp, format, packed=packed), lambda primary: None)()
        return path

    def save(self, file_prefix: str, format: str = "orbax", *, packed: bool = True, **roots: Any) -> str:
        """Writes ``file_prefix-N`` (N = the new `save_counter`) and records it as the latest.

        Updates the directory's ``checkpoint`` state file, as TF does. A
        checkpoint already at ``file_prefix-N`` (a new process whose counter
        was not restored) is replaced as `write` replaces one. `roots` given
        here replace the roots of the same names first (the new values after
        a training step), so one Checkpoint serves a whole training loop and
        its counter keeps counting.

        In a `jax.distributed` job every process calls `save` with the same
        roots: each writes only the shards it holds, process 0 writes the
        object graph and the state file, and the checkpoint becomes the
        latest once every process has written (see `checkpoint/_storage/
        _distributed.py`).

        Args:
            file_prefix: the path before ``-N``; its directory gets the state file.
            format: ``"orbax"``, or ``"tf"`` for a TensorBundle TF reads.
            packed: as `write`'s.
            **roots: new values for roots of those names.

        Returns:
            The absolute path of ``file_prefix-N``.

        Raises:
            ValueError: an unknown `format`; a name in `roots` that is not a
                root of this Checkpoint; an optimizer state saved beside a
                model holding none of its slots' Variables (see the class).

        >>> import os, tempfile, jax.numpy as jnp, checkpoint
        >>> prefix = os.path.join(tempfile.mkdtemp(), "ckpt")
        >>> ckpt = checkpoint.Checkpoint(w=jnp.zeros(2))
        >>> paths = [os.path.basename(ckpt.save(prefix, w=jnp.full(2, float(i)))) for i in (1, 2)]
        >>> paths, ckpt.save_counter, checkpoint.read_checkpoint(prefix + "-2").get("w/.ATTRIBUTES/VARIABLE_VALUE")
        (['ckpt-1', 'ckpt-2'], 2, array([2., 2.], dtype=float32))
        """
        check_format(format, "Checkpoint.save")
        unknown = sorted(set(roots) - set(self._roots))
        if unknown:
            hint = " ('save_counter' is the checkpoint's own)" if _keys.SAVE_COUNTER in unknown else ""
            raise ValueError(
                f"Checkpoint.save: {unknown} {'is not a root' if len(unknown) == 1 else 'are not roots'} of this "
                f"Checkpoint{hint}; its roots are {sorted(self._roots)}. Pass new values only for roots given to "
                "Checkpoint(...), or build a Checkpoint with the new roots."
            )
        self._roots.update(roots)
        self._counter_tracked = True
        self.save_counter += 1
        path = os.path.abspath(f"{os.fspath(file_prefix)}-{self.save_counter}")

        def record(primary: bool) -> None:
            if primary:
                _storage.record_latest(os.path.dirname(path), path)

        with _save.collector_paused():
            _save.start(path, format, "Checkpoint.save", lambda temp: start_write(self, temp, format, packed=packed),
                        record)()
        return path

    def restore(self, save_path: str | None, *, strict: bool = False, expect_partial: bool = False) -> LoadStatus:
        """Restores the roots from `save_path` by object-graph structure; see `LoadStatus`.

        Args:
            save_path: a checkpoint: an orbax directory or a TF object-based
                prefix (anything `read_checkpoint` opens). None (what
                `latest_checkpoint` returns for an empty directory) returns the
                roots unchanged in a status whose assertions fail, as TF's
                InitializationOnlyStatus.
            strict: False allows a partial match, as TF (check it with the
                status's assertions, or restore the rest later with
                ``status.restore``); True requires every value of the roots and
                every value in the checkpoint to match.
            expect_partial: True says that a partial restore is intended: a
                root that matches no value of the checkpoint (a root new since
                it was saved) is returned as given, and no warning is logged
                for the checkpoint's values left unrestored
                (`LoadStatus.expect_partial`). The assertions still check.

        Returns:
            A `LoadStatus`, whose ``status.<root>`` is the restored root.

        Raises:
            ValueError: beside roots that matched, a root holding values
                that matches none of the checkpoint's (not in it, or of
                another structure), naming it and the checkpoint's roots,
                unless `expect_partial` (when nothing matched at all, the
                status's assertions name it, as TF leaves it to them); with
                `strict`, a value unmatched on either side; a
                name-based checkpoint (use `restore_by_name`); a value whose
                shape does not fit its template; a template that uses one
                Variable at two paths where the checkpoint saved two
                distinct Variables; with JAX's 64-bit types off, a 64-bit
                value its template's 32-bit type cannot hold (an integer
                out of range, a float that would become 0 or inf), for a
                Variable or a plain array alike.
            TypeError: a value whose dtype does not fit its template.
            CheckpointFormatError: a corrupt or unsupported file.
            FileNotFoundError: no checkpoint at `save_path`.

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
            status = self._restore(save_path, strict=strict, expect_partial=expect_partial)
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

    @_save.collector_paused()
    def _restore(self, save_path: str, *, strict: bool = False, expect_partial: bool = False) -> LoadStatus:
        if _distributed.process_count() > 1:  # every process must load the same values onto the same shardings
            _checked_graph(dict(self._roots), "object graph of the restore templates")
        reader = _storage.open_reader(save_path)
        if reader.object_graph is None:
            raise ValueError(
                f"{save_path!r} is a name-based checkpoint (no object graph): restore it by variable name "
                "with checkpoint.restore_by_name(path, params)."
            )
        state = _graph.RestoreState(reader)
        state.expect_partial = expect_partial
        try:
            return self._restore_into(state, save_path, strict=strict)
        except BaseException:
            # The caller gets the error and never this state: it must not warn later of values left unrestored.
            state.expect_partial = True
            raise

    def _restore_into(self, state: _graph.RestoreState, save_path: str, *, strict: bool) -> LoadStatus:
        reader = state.reader
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
        # With strict, a root matching nothing fails the assertions below, with the message strict gives
        return LoadStatus(state, _graph.restore_roots(state, self._roots, raise_dead=not strict))


def start_write(ckpt: Checkpoint, temp: str, format: str, *, packed: bool = True, checkpointer: Any = None,
                background: bool = False, counter: int | None = None,
                max_staging_bytes: int | None = None) -> Callable[[], None]:
    """Starts writing `ckpt`'s roots to the unpublished name `temp`; returns the function that finishes it.

    The `write` of the save sequence (`_storage/_save.py`) for
    `Checkpoint.save`/`write` and `CheckpointManager.save`, which passes its step as
    the `counter` to save and its own orbax `checkpointer`. With
    `background` the values are copied off the arrays before this returns,
    so the caller may update (or donate) them while the returned function
    runs in another thread.

    Args:
        ckpt: the Checkpoint whose roots are written.
        temp: the unpublished path to write.
        format: ``"orbax"`` or ``"tf"``.
        packed: as `write`'s.
        checkpointer: the orbax checkpointer to write with; None makes (and
            closes) one.
        background: copy the values off the arrays now (see above).
        counter: the ``save_counter`` to record; None records this
            Checkpoint's own, if it counts.
        max_staging_bytes: with `background`, the most bytes of host copies
            the returned function may hold; what does not fit is written
            before this returns (the TF format: the values in the order
            written until the rest fits; the orbax format: all of it, the
            copies of orbax's asynchronous save being all or nothing).
            None: no bound.

    Returns:
        The function that finishes the write.
    """
    roots = dict(ckpt._roots)
    if counter is not None or ckpt._counter_tracked:
        roots[_keys.SAVE_COUNTER] = np.int64(ckpt.save_counter if counter is None else counter)
    graph, values = _checked_graph(roots, "object graph of the saved roots")
    if format == "tf" and _distributed.process_count() > 1:
        finish = _tf_of_processes(temp, values, graph.proto.SerializeToString())
        if background:  # its shards are read as it writes: written now, so later (donating) steps cannot race
            finish()
            return lambda: None
        return finish
    if format == "tf":
        from checkpoint._storage._bundle_writer import start_bundle, tf_tensors

        tensors = tf_tensors(values, graph.proto.SerializeToString())
        if not background:
            return lambda: _storage.write_bundle(temp, tensors)
        return start_bundle(temp, tensors, math.inf if max_staging_bytes is None else max_staging_bytes)
    from checkpoint._storage import _orbax

    # In the background the caller may donate the arrays as soon as this returns: checksummed before, then. With
    # several processes each would write the metadata file that orbax's primary alone writes.
    later: list | None = None if background or _distributed.process_count() > 1 else []
    tree, meta = _orbax.layout(values, graph.proto, batched=packed, later=later)
    if background and max_staging_bytes is not None and _orbax.staged_bytes(tree) > max_staging_bytes:
        checkpointer = None  # copies past the bound: written now, from the arrays themselves, without copies
    own = checkpointer is None
    checkpointer = _orbax.checkpointer() if own else checkpointer
    try:
        checkpointer.save(temp, args=_orbax.save_args(tree, meta))
    except BaseException:
        _orbax.settle(later)
        raise
    finally:
        if own:
            checkpointer.close()
    written = (lambda: None) if own else getattr(checkpointer, "wait_until_finished", lambda: None)
    if not later:
        return written

    def finish_orbax() -> None:
        try:
            written()
            _orbax.complete(meta, later, temp)
        finally:
            _orbax.settle(later)  # a no-op once complete has taken every checksum

    return finish_orbax
