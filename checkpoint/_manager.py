"""`CheckpointManager`, `latest_checkpoint` and TF's ``checkpoint`` state file."""

from __future__ import annotations

import os
import re
import shutil
import threading
from typing import Any

from checkpoint import _storage
from checkpoint._checkpoint import Checkpoint
from checkpoint._status import LoadStatus
from checkpoint._storage import STATE_FILE, _orbax, read_checkpoint_state, record_latest


def _exists(path: str) -> bool:
    return _storage.is_orbax(path) or os.path.isfile(path + ".index")


def latest_checkpoint(directory: str) -> str | None:
    """The newest committed checkpoint in `directory` (from its ``checkpoint`` state file), or None.

    >>> import os, tempfile, jax.numpy as jnp, checkpoint
    >>> d = tempfile.mkdtemp()
    >>> ckpt = checkpoint.Checkpoint(w=jnp.zeros(2))
    >>> _ = ckpt.save(os.path.join(d, "ckpt")); _ = ckpt.save(os.path.join(d, "ckpt"))
    >>> os.path.basename(checkpoint.latest_checkpoint(d))
    'ckpt-2'
    """
    path = _storage.latest_in(os.path.abspath(os.fspath(directory)))
    return path if path is not None and _exists(path) else None


class CheckpointManager:
    """Numbered checkpoints ``<directory>/ckpt-<step>``: keeps the newest, deletes old ones, saves atomically.

    `save(step, **roots)` writes the roots (as `Checkpoint(**roots)` would,
    with ``save_counter`` = step) and records them in TF's ``checkpoint``
    state file once committed. With ``async_save=True`` it returns as soon
    as the values are copied off the arrays (later updates, even donated
    ones, do not change what is saved); `wait_until_finished()` waits for the
    commit. Leftovers of a save that crashed are removed by the first `save`;
    a manager that only restores (an evaluator beside the trainer) deletes
    nothing, so it never breaks a save in progress. One process saves to a
    directory at a time, as with TF's and orbax's managers.

    >>> import os, tempfile, jax.numpy as jnp, varstate, checkpoint
    >>> mgr = checkpoint.CheckpointManager(tempfile.mkdtemp(), max_to_keep=2)
    >>> w = varstate.Variable(jnp.zeros(2))
    >>> for step in range(1, 4):
    ...     w = w.assign_add(jnp.ones(2))
    ...     _ = mgr.save(step, model={"w": w})
    >>> [os.path.basename(p) for p in mgr.checkpoints]
    ['ckpt-2', 'ckpt-3']
    >>> mgr.restore(model={"w": varstate.Variable(jnp.zeros(2))}).model["w"].value.tolist()
    [3.0, 3.0]
    """

    def __init__(
        self,
        directory: str,
        max_to_keep: int | None = 5,
        keep_every_n_steps: int | None = None,
        async_save: bool = False,
        checkpoint_name: str = "ckpt",
    ) -> None:
        if max_to_keep is not None and (not isinstance(max_to_keep, int) or max_to_keep < 1):
            raise ValueError(f"CheckpointManager: max_to_keep must be a positive int or None, got {max_to_keep!r}.")
        if keep_every_n_steps is not None and (not isinstance(keep_every_n_steps, int) or keep_every_n_steps < 1):
            raise ValueError(
                f"CheckpointManager: keep_every_n_steps must be a positive int or None, got {keep_every_n_steps!r}."
            )
        if not re.fullmatch(r"[A-Za-z0-9_.-]+", checkpoint_name):
            raise ValueError(f"CheckpointManager: invalid checkpoint_name {checkpoint_name!r}.")
        self.directory = os.path.abspath(os.fspath(directory))
        self.max_to_keep, self.keep_every_n_steps = max_to_keep, keep_every_n_steps
        self._name = checkpoint_name
        os.makedirs(self.directory, exist_ok=True)
        self._cleaned = False
        state = read_checkpoint_state(self.directory)
        listed = state.all_model_checkpoint_paths if state is not None else []
        # In the state file's order, oldest saved first (not by step number), as TF's manager recovers it.
        steps = [s for s in (self._step_of(p) for p in listed) if s is not None and _exists(self._path(s))]
        self._steps = list(dict.fromkeys(reversed(steps)))[::-1]  # a step listed twice: its last place
        self._checkpointer: Any = _orbax.checkpointer(async_save)
        self._async = async_save
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def _path(self, step: int) -> str:
        return os.path.join(self.directory, f"{self._name}-{step}")

    def _step_of(self, path: str) -> int | None:
        m = re.fullmatch(re.escape(self._name) + r"-(\d+)", os.path.basename(path))
        return int(m.group(1)) if m else None

    @property
    def checkpoints(self) -> list[str]:
        """Paths of the kept checkpoints, oldest first."""
        return [self._path(s) for s in self._steps]

    @property
    def latest_checkpoint(self) -> str | None:
        """The newest committed checkpoint, or None."""
        return self._path(self._steps[-1]) if self._steps else None

    def save(self, step: int, /, **roots: Any) -> str:
        """Writes ``ckpt-<step>``; returns its path (committed unless ``async_save``)."""
        step = int(step)
        if step < 0:
            raise ValueError(f"CheckpointManager.save: step must be >= 0, got {step}.")
        self.wait_until_finished()
        if not self._cleaned:
            self._remove_leftovers()
        ckpt = Checkpoint(**roots)
        ckpt.save_counter, ckpt._counter_tracked = step, True
        path = self._path(step)
        if step in self._steps:
            # Saved again: unlist it first, so a crash while it is rewritten leaves the previous one as latest.
            self._steps.remove(step)
            if self._steps:
                record_latest(self.directory, self._path(self._steps[-1]), self.checkpoints)
            else:
                os.remove(os.path.join(self.directory, STATE_FILE))
        ckpt.write(path, _checkpointer=self._checkpointer)
        if self._async:
            self._thread = threading.Thread(target=self._finish, args=(step,), name="checkpoint-commit")
            self._thread.start()
        else:
            self._commit(step)
        return path

    def _remove_leftovers(self) -> None:
        # Done by the first save, not on construction: a manager that only restores (an evaluator
        # beside the trainer) must never delete a save that is still being written.
        for entry in os.listdir(self.directory):
            target = os.path.join(self.directory, entry)
            if entry.startswith(f".{STATE_FILE}.tmp-"):
                os.remove(target)
            elif os.path.isdir(target) and _orbax.is_temporary(target):
                shutil.rmtree(target, ignore_errors=True)
        self._cleaned = True

    def _finish(self, step: int) -> None:
        try:
            self._checkpointer.wait_until_finished()
            self._commit(step)
        except BaseException as e:  # reported by wait_until_finished in the caller's thread
            self._error = e

    def _commit(self, step: int) -> None:
        steps = [s for s in self._steps if s != step] + [step]
        removed: list[int] = []
        if self.max_to_keep is not None:
            while len(steps) > self.max_to_keep:
                removed.append(steps.pop(0))
        keep = [s for s in removed if self.keep_every_n_steps and s % self.keep_every_n_steps == 0]
        record_latest(self.directory, self._path(step), [self._path(s) for s in steps], preserved=bool(keep))
        self._steps = steps
        for s in removed:
            if s in keep:
                continue  # preserved for good: no longer managed, never deleted
            path = self._path(s)
            # The marker file goes first: a crash mid-delete leaves no readable half checkpoint.
            meta = os.path.join(path, _orbax.META_FILE)
            if os.path.isfile(meta):
                os.remove(meta)
            shutil.rmtree(path, ignore_errors=True)

    def wait_until_finished(self) -> None:
        """Blocks until an asynchronous save is committed; raises its error if it failed."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def restore(self, step: int | None = None, /, **templates: Any) -> LoadStatus:
        """Restores `templates` from ``ckpt-<step>`` (default: the latest); see `Checkpoint.restore`."""
        self.wait_until_finished()
        path = self.latest_checkpoint if step is None else self._path(int(step))
        if path is None:
            raise FileNotFoundError(f"CheckpointManager: no checkpoint in {self.directory!r} yet.")
        return Checkpoint(**templates).restore(path)

    def close(self) -> None:
        """Waits for a pending save and releases orbax's threads."""
        try:
            self.wait_until_finished()
        finally:
            self._checkpointer.close()
