"""`read_checkpoint`: one reader for orbax, TF object-based and TF name-based checkpoints; `checkpoint` state files."""

from __future__ import annotations

import os
import secrets
from collections.abc import Sequence

from google.protobuf import text_format

from checkpoint._bundle import BundleReader, _sync
from checkpoint._table import CheckpointFormatError
from checkpoint.protos.checkpoint_state_pb2 import CheckpointState

__all__ = ["read_checkpoint", "read_checkpoint_state", "write_checkpoint_state"]

STATE_FILE = "checkpoint"
_ORBAX_METADATA = os.path.join("meta", "metadata")  # checkpoint._orbax.META_FILE


def read_checkpoint(path: str | os.PathLike):
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
    >>> checkpoint._bundle.write_bundle(prefix, {"dense/kernel": np.ones((2, 3), np.float32)})
    >>> reader = checkpoint.read_checkpoint(prefix)
    >>> reader.keys(), reader.shape("dense/kernel"), reader.dtype("dense/kernel"), reader.object_graph
    (['dense/kernel'], (2, 3), dtype('float32'), None)
    >>> reader.get("dense/kernel").sum()
    np.float32(6.0)
    """
    target = _resolve(os.fspath(path))
    if os.path.isdir(target):
        from checkpoint._orbax import OrbaxReader  # imports orbax and jax: only for orbax checkpoints

        return OrbaxReader(target)
    return BundleReader(target)


def _is_orbax(path: str) -> bool:
    # Checked without importing orbax, so reading a TF checkpoint stays light.
    return os.path.isfile(os.path.join(path, _ORBAX_METADATA))


def _resolve(path: str, follow_state: bool = True) -> str:
    if path.endswith(".index") and os.path.isfile(path):
        path = path[: -len(".index")]
    if os.path.isfile(path + ".index"):
        return path
    if os.path.isdir(path):
        if _is_orbax(path):
            return path
        if follow_state and os.path.isfile(os.path.join(path, STATE_FILE)):
            return _resolve(_latest(path), follow_state=False)
        raise FileNotFoundError(
            f"No checkpoint in directory {path}: it holds no {STATE_FILE!r} state file and is not an orbax "
            "checkpoint. Pass a checkpoint prefix (the path before '.index') instead."
        )
    if follow_state and os.path.basename(path) == STATE_FILE and os.path.isfile(path):
        return _resolve(_latest(os.path.dirname(path) or "."), follow_state=False)
    raise FileNotFoundError(
        f"No checkpoint at {path}: expected a prefix with a {os.path.basename(path)}.index file, a directory "
        f"with a {STATE_FILE!r} state file, or an orbax checkpoint directory."
    )


def _latest(directory: str) -> str:
    state = read_checkpoint_state(directory)
    where = os.path.join(directory, STATE_FILE)
    if state is None or not state.model_checkpoint_path:
        raise FileNotFoundError(f"{where} names no checkpoint (model_checkpoint_path is empty).")
    return _inside(directory, state.model_checkpoint_path, where)


def _inside(directory: str, path: str, where: str) -> str:
    """`path` (from a state file in `directory`) as a path inside `directory`; never outside it."""
    root = os.path.realpath(directory)
    candidate = os.path.realpath(os.path.join(directory, path))
    if os.path.commonpath([root, candidate]) == root and candidate != root:
        return os.path.abspath(os.path.join(directory, path))  # checked resolved; returned as TF joins it
    moved = os.path.join(os.path.abspath(directory), os.path.basename(path))
    if os.path.isabs(path) and (os.path.exists(moved + ".index") or os.path.isdir(moved)):
        return moved  # an absolute path written before the directory was moved or copied
    raise CheckpointFormatError(
        f"{where} names checkpoint {path!r}, which is outside {directory}; a state file may only name "
        "checkpoints in its own directory. Pass the checkpoint prefix directly."
    )


def read_checkpoint_state(directory: str | os.PathLike) -> CheckpointState | None:
    """The parsed ``checkpoint`` state file of `directory` (paths as written), or None if there is none.

    >>> import tempfile, checkpoint._reader as r
    >>> d = tempfile.mkdtemp()
    >>> _ = r.write_checkpoint_state(d, "ckpt-2", ["ckpt-1", "ckpt-2"])
    >>> r.read_checkpoint_state(d).all_model_checkpoint_paths
    ['ckpt-1', 'ckpt-2']
    """
    path = os.path.join(os.fspath(directory), STATE_FILE)
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        return None
    except UnicodeDecodeError:
        raise CheckpointFormatError(f"{path}: not a text CheckpointState (not UTF-8)") from None
    try:
        return text_format.Parse(text, CheckpointState())
    except text_format.ParseError as e:
        raise CheckpointFormatError(f"{path}: not a text CheckpointState: {e}") from None


def write_checkpoint_state(
    directory: str | os.PathLike,
    model_checkpoint_path: str,
    all_model_checkpoint_paths: Sequence[str] | None = None,
    all_model_checkpoint_timestamps: Sequence[float] | None = None,
    last_preserved_timestamp: float | None = None,
) -> CheckpointState:
    """Atomically writes TF's ``checkpoint`` state file in `directory`; returns what it wrote.

    Paths inside `directory` are written relative to it (as TF does), so the
    directory can be moved. The latest path is appended to the list if it is
    not its last entry.
    """
    directory = os.fspath(directory)

    def rel(p: str) -> str:
        p = os.fspath(p)
        full = os.path.abspath(os.path.join(directory, p))
        root = os.path.abspath(directory)
        return os.path.relpath(full, root) if os.path.commonpath([root, full]) == root else p

    paths = [rel(p) for p in all_model_checkpoint_paths or ()]
    latest = rel(model_checkpoint_path)
    if not paths or paths[-1] != latest:
        paths.append(latest)
    stamps = list(all_model_checkpoint_timestamps or ())
    if stamps and len(stamps) != len(paths):
        raise ValueError(
            f"write_checkpoint_state: {len(stamps)} timestamps for {len(paths)} checkpoint paths; give one per path."
        )
    state = CheckpointState(
        model_checkpoint_path=latest,
        all_model_checkpoint_paths=paths,
        all_model_checkpoint_timestamps=stamps,
        last_preserved_timestamp=last_preserved_timestamp or 0.0,
    )
    path = os.path.join(directory, STATE_FILE)
    # Written beside and renamed over, after an fsync: readers see the old file or the
    # new one, even after a crash. CheckpointManager removes leftovers by this name.
    temp = os.path.join(directory, f".{STATE_FILE}.tmp-{secrets.token_hex(8)}")
    try:
        with open(temp, "w", encoding="utf-8") as f:
            f.write(text_format.MessageToString(state))
            _sync(f)
        os.replace(temp, path)
    finally:
        if os.path.exists(temp):
            os.remove(temp)
    return state
