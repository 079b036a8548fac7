"""`CheckpointManager`'s journal: ``checkpoint_manager.json`` beside the state file, and the metrics it keeps."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping
from typing import Any

import numpy as np

from checkpoint._errors import CheckpointFormatError
from checkpoint._storage._files import read_regular, replacing, sync_directory
from checkpoint._storage._publish import MANAGER_FILE, exists

_JOURNAL_FORMAT = "varstate-checkpoint-manager"
_JOURNAL_LIMIT = 64 << 20  # bytes; metrics of 100,000 checkpoints are a few MB


def checked_metrics(metrics: Any) -> dict[str, Any] | None:
    if metrics is None:
        return None
    if not isinstance(metrics, Mapping):
        raise ValueError(
            f"CheckpointManager.save: metrics must be a dict of str to numbers, got {type(metrics).__name__}. "
            "The keyword 'metrics' is reserved for them: save a root of that name under another name."
        )
    out = {}
    for name, value in metrics.items():
        if not isinstance(name, str):
            raise ValueError(f"CheckpointManager.save: metric names must be str, got {name!r}.")
        arr = np.asarray(value)
        if arr.shape != () or arr.dtype.kind not in "biuf":
            raise ValueError(
                f"CheckpointManager.save: metrics[{name!r}] must be a real number, got {value!r}; pass a scalar "
                "(e.g. float(loss))."
            )
        out[name] = arr.item()
    return out


def _numbers(m: Any) -> bool:
    return isinstance(m, dict) and all(isinstance(k, str) and type(v) in (int, float, bool) for k, v in m.items())


class Journal:
    """``checkpoint_manager.json`` beside the state file: metrics of kept checkpoints, and saves in flight.

    ``{"metrics": {name: {metric: number}}, "saving": {name: {"since": time,
    "metrics": ... or null, "replaces": bool}}}``, by checkpoint name. A save
    is entered under "saving" before its checkpoint is moved into place and
    leaves it once recorded; a name still there afterwards is a save that was
    killed: its checkpoint, if listed in the state file, committed (with
    those metrics), else it is an orphan that the next save deletes (unless
    it replaced a checkpoint that was there unlisted). The file exists only
    while it holds something.
    """

    def __init__(self, directory: str) -> None:
        self.path = os.path.join(directory, MANAGER_FILE)
        self.metrics: dict[str, dict[str, Any]] = {}
        self.saving: dict[str, dict[str, Any]] = {}
        try:  # a regular file of bounded size: a FIFO or a device in its place must not block or fill memory
            raw = read_regular(self.path, _JOURNAL_LIMIT, "the CheckpointManager journal")
        except FileNotFoundError:
            return
        try:
            try:
                data = json.loads(raw.decode("utf-8"))
            except RecursionError:  # json recurses once per level: a hostile file chooses the depth
                raise ValueError("it nests too deeply; a journal nests 3 levels") from None
            if not isinstance(data, dict) or data.get("format") != _JOURNAL_FORMAT:
                raise ValueError(f"expected an object with format {_JOURNAL_FORMAT!r}")
            if type(data.get("version")) is not int or data["version"] > 1:
                raise ValueError(f"version {data.get('version')!r}; this reader knows version 1")
            metrics, saving = data.get("metrics", {}), data.get("saving", {})
            if not isinstance(metrics, dict) or not isinstance(saving, dict):
                raise ValueError("its 'metrics' or 'saving' is not an object")
            for name, m in metrics.items():
                if not _numbers(m):
                    raise ValueError(f"the metrics of {name!r} are not an object of numbers")
            for name, entry in saving.items():
                if not isinstance(entry, dict) or type(entry.get("since")) not in (int, float) or not (
                        entry.get("metrics") is None or _numbers(entry["metrics"])) or type(
                        entry.get("replaces", False)) is not bool:
                    raise ValueError(f"the save in flight {name!r} is not {{'since': time, 'metrics': ..., "
                                     "'replaces': bool}")
        except ValueError as e:  # UnicodeDecodeError and JSONDecodeError among them
            raise CheckpointFormatError(
                f"{self.path}: not a CheckpointManager file ({e}). Delete it to forget the metrics; the "
                "checkpoints themselves are unaffected."
            ) from None
        self.metrics, self.saving = metrics, saving

    def enter(self, path: str, metrics: dict[str, Any] | None) -> None:
        """Stores the save of the checkpoint `path` as in flight, before it is moved into place.

        If the save dies before recording it, the next save knows the
        checkpoint at `path` for an orphan (and this save's metrics, if it
        was recorded).
        """
        self.saving[os.path.basename(path)] = {"since": time.time(), "metrics": metrics, "replaces": exists(path)}
        self.store()

    def store(self) -> None:
        if not self.metrics and not self.saving:
            if os.path.exists(self.path):
                os.remove(self.path)
                sync_directory(os.path.dirname(self.path))
            return
        data = {"format": _JOURNAL_FORMAT, "version": 1, "metrics": self.metrics, "saving": self.saving}
        with replacing(self.path) as (temp,), open(temp, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=1, sort_keys=True)
