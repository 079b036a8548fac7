"""Storage: checkpoint values <-> bytes on disk. Knows nothing of object graphs or Variables.

Every format is read through one `Reader` protocol, and `open_reader` is the
one dispatch from a path to a reader: a TF TensorBundle prefix (object-based
or name-based), an orbax-format directory (this library's), a directory whose
``checkpoint`` state file names one of those, the variables of a TF
SavedModel or of an export, or a checkpoint orbax itself wrote (a PyTree
directory, a CheckpointManager step or, for the manager's directory, its
latest step; `_orbax_native`). Reading a TF checkpoint imports neither jax
nor orbax; the orbax backends are imported on first use.
"""

from __future__ import annotations

import os
from typing import Any, Protocol

import numpy as np

from checkpoint._storage._bundle import BundleReader, data_filename
from checkpoint._storage._bundle_writer import Sliced, write_bundle
from checkpoint._storage._files import ORBAX_METADATA, inside
from checkpoint._storage._state_file import (
    STATE_FILE,
    latest_in,
    read_checkpoint_state,
    record_latest,
    write_checkpoint_state,
)

__all__ = ["EXPORT_FILE", "ORBAX_METADATA", "SAVED_MODEL_FILE", "STATE_FILE", "VARIABLES_PREFIX", "BundleReader",
           "Reader", "Sliced", "data_filename", "inside", "is_orbax", "latest_in", "open_reader",
           "read_checkpoint_state", "record_latest", "write_bundle", "write_checkpoint_state"]

SAVED_MODEL_FILE = "saved_model.pb"
EXPORT_FILE = "export.pb"
VARIABLES_PREFIX = os.path.join("variables", "variables")  # a SavedModel's or an export's TF checkpoint


class Reader(Protocol):
    """What restore, the CLI and `read_checkpoint` need of any stored checkpoint; every reader has all of it."""

    @property
    def path(self) -> str: ...  # the checkpoint read: a TF prefix or a directory
    @property
    def format_name(self) -> str: ...  # what kind of checkpoint it is, for people
    @property
    def object_graph(self) -> Any: ...  # a TrackableObjectGraph, or None for a name-based checkpoint
    def keys(self) -> list[str]: ...
    def __contains__(self, key: str) -> bool: ...
    def shape(self, key: str) -> tuple[int, ...]: ...
    def dtype(self, key: str) -> np.dtype: ...
    def get(self, key: str) -> np.ndarray: ...
    def get_slices(self, key: str) -> list[tuple[slice, ...]]: ...  # where each saved slice sits; [] if whole
    def get_into(self, key: str, sharding: Any) -> Any: ...  # a jax.Array on `sharding`
    # {key: sharding or None} -> {key: value}, on that sharding where the reader places it, else on the host
    def get_many(self, requests: dict[str, Any]) -> dict[str, Any]: ...
    # `keys` in the order to read them all, grouped as one read loads them (an orbax batch); else one by one
    def stored_together(self, keys: list[str]) -> list[list[str]]: ...
    def release(self) -> None: ...  # forget the host copies kept for later reads (the orbax readers keep them)


def is_orbax(path: str) -> bool:
    """True for an orbax-format checkpoint directory (checked without importing orbax)."""
    # Anything by that name: a FIFO or a link in its place is then refused by the reader, naming it.
    return os.path.lexists(os.path.join(path, ORBAX_METADATA))


def _ours_damaged(path: str) -> bool:
    """This library's orbax layout (values/ and meta/) without its metadata: refused by our reader, saying so."""
    return os.path.isdir(os.path.join(path, "values")) and os.path.isdir(os.path.join(path, "meta"))


def open_reader(path: str | os.PathLike) -> Reader:
    """A reader for the checkpoint at `path` (see the module docstring); FileNotFoundError says what was expected."""
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"Checkpoint path must be a string, got {type(path).__name__} {path!r}.")
    target = _resolve(os.fspath(path))
    # Ours first: it is an orbax composite too.
    if os.path.isdir(target) and (is_orbax(target) or _ours_damaged(target)):
        from checkpoint._storage._orbax import OrbaxReader  # imports orbax and jax: only for orbax checkpoints

        return OrbaxReader(target)
    if os.path.isdir(target):
        from checkpoint._storage._orbax_native import OrbaxTreeReader

        return OrbaxTreeReader(target)
    return BundleReader(target)


def _resolve(path: str, follow_state: bool = True) -> str:
    if path.endswith(".index") and os.path.isfile(path):
        path = path[: -len(".index")]
    if os.path.isfile(path + ".index"):
        return path
    if os.path.isdir(path):
        if is_orbax(path) or _ours_damaged(path):
            return path
        for marker, what in ((SAVED_MODEL_FILE, "SavedModel"), (EXPORT_FILE, "export")):
            if os.path.lexists(os.path.join(path, marker)):  # read for its variables
                prefix = os.path.join(path, VARIABLES_PREFIX)
                if not os.path.isfile(prefix + ".index"):
                    raise FileNotFoundError(f"{path}: the {what} has no variables ({VARIABLES_PREFIX}.index is "
                                            "missing)")
                return prefix
        if follow_state and _present(os.path.join(path, STATE_FILE)):
            return _resolve(_latest(path), follow_state=False)
        from checkpoint._storage import _orbax_native as native  # imports nothing heavy until a reader is made

        if native.is_native(path):
            return path
        step = native.latest_step(path)
        if step is not None:
            return step
        raise FileNotFoundError(
            f"No checkpoint in directory {path}: it holds no {STATE_FILE!r} state file and is not an orbax "
            "checkpoint. Pass a checkpoint prefix (the path before '.index') instead, or an orbax checkpoint "
            "directory: this library's (with meta/metadata), orbax's own (with _METADATA), or an orbax "
            "CheckpointManager's directory or step."
        )
    if follow_state and os.path.basename(path) == STATE_FILE and _present(path):
        return _resolve(_latest(os.path.dirname(path) or "."), follow_state=False)
    raise FileNotFoundError(
        f"No checkpoint at {path}: expected a prefix with a {os.path.basename(path)}.index file, a directory "
        f"with a {STATE_FILE!r} state file, or an orbax checkpoint directory."
    )


def _latest(directory: str) -> str:
    latest = latest_in(directory)
    if latest is None:
        raise FileNotFoundError(f"{os.path.join(directory, STATE_FILE)} names no checkpoint (model_checkpoint_path "
                                "is empty).")
    return latest


def _present(path: str) -> bool:
    # A state file in any form but a directory: a FIFO or a link to a device is refused by the reader, naming
    # it, rather than passed over as if there were no state file.
    return os.path.exists(path) and not os.path.isdir(path)
