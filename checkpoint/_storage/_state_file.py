"""TF's ``checkpoint`` state file (a text CheckpointState): read and written in one place."""

from __future__ import annotations

import os
import time
from collections.abc import Sequence

from google.protobuf import text_format

from checkpoint._errors import CheckpointFormatError
from checkpoint._storage._files import inside, read_regular, replacing
from checkpoint.protos.checkpoint_state_pb2 import CheckpointState

__all__ = ["STATE_FILE", "latest_in", "read_checkpoint_state", "record_latest", "write_checkpoint_state"]

STATE_FILE = "checkpoint"
STATE_FILE_LIMIT = 16 << 20  # bytes; a state file listing 100,000 checkpoints is a few MB


def read_checkpoint_state(directory: str | os.PathLike) -> CheckpointState | None:
    """The parsed ``checkpoint`` state file of `directory` (paths as written), or None if there is none.

    >>> import tempfile
    >>> from checkpoint._storage import _state_file as r
    >>> d = tempfile.mkdtemp()
    >>> _ = r.write_checkpoint_state(d, "ckpt-2", ["ckpt-1", "ckpt-2"])
    >>> r.read_checkpoint_state(d).all_model_checkpoint_paths
    ['ckpt-1', 'ckpt-2']
    """
    path = os.path.join(os.fspath(directory), STATE_FILE)
    try:
        # A regular file, read up to a bound: a link to /dev/zero would read until memory ran out, a FIFO
        # would block forever. Real state files are a few hundred bytes a checkpoint.
        text = read_regular(path, STATE_FILE_LIMIT, "the checkpoint state file").decode("utf-8")
    except FileNotFoundError:
        return None
    except UnicodeDecodeError:
        raise CheckpointFormatError(f"{path}: not a text CheckpointState (not UTF-8)") from None
    try:
        return text_format.Parse(text, CheckpointState())
    except text_format.ParseError as e:
        raise CheckpointFormatError(f"{path}: not a text CheckpointState: {e}") from None


def latest_in(directory: str) -> str | None:
    """The checkpoint path `directory`'s state file names as the latest (inside it), or None if it names none."""
    state = read_checkpoint_state(directory)
    if state is None or not state.model_checkpoint_path:
        return None
    return inside(directory, state.model_checkpoint_path, os.path.join(directory, STATE_FILE))


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
    with replacing(os.path.join(directory, STATE_FILE)) as (temp,), open(temp, "w", encoding="utf-8") as f:
        f.write(text_format.MessageToString(state))
    return state


def relative_to(directory: str, path: str) -> str:
    """`path` relative to `directory` if it lies directly in it, else as given."""
    return os.path.relpath(path, directory) if os.path.dirname(os.path.abspath(path)) == directory else path


def record_latest(directory: str, path: str, kept: list[str] | None = None, preserved: bool = False) -> None:
    """Makes `path` the latest checkpoint in `directory`'s state file (TF's update_checkpoint_state)."""
    directory = os.path.abspath(directory)
    state = read_checkpoint_state(directory) or CheckpointState()
    now = time.time()
    stamps = dict(zip(state.all_model_checkpoint_paths, state.all_model_checkpoint_timestamps, strict=False))
    # Without a manager's list, only `path` (TF's Checkpoint.save), so no manager later adopts earlier saves.
    kept = [relative_to(directory, p) for p in (kept if kept is not None else [path])]
    write_checkpoint_state(
        directory, relative_to(directory, path), kept, [stamps.get(p, now) for p in kept],
        now if preserved else state.last_preserved_timestamp,
    )
