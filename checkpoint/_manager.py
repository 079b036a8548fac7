"""`CheckpointManager` and `latest_checkpoint`; its journal of metrics is in `_journal.py`."""

from __future__ import annotations

import atexit
import math
import operator
import os
import re
import sys
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from checkpoint import _storage
from checkpoint._checkpoint import Checkpoint, check_format, start_write
from checkpoint._status import LoadStatus
from checkpoint._storage import _publish, _save, read_checkpoint_state, record_latest
from checkpoint._storage._journal import Journal, checked_metrics


def latest_checkpoint(directory: str) -> str | None:
    """The newest committed checkpoint in `directory` (from its ``checkpoint`` state file), or None.

    Args:
        directory: the directory of the checkpoints (and their state file).

    Returns:
        The checkpoint's path (prefix or orbax directory), or None when the
        directory has no state file or its latest checkpoint is not complete.

    >>> import os, tempfile, jax.numpy as jnp, checkpoint
    >>> d = tempfile.mkdtemp()
    >>> ckpt = checkpoint.Checkpoint(w=jnp.zeros(2))
    >>> _ = ckpt.save(os.path.join(d, "ckpt")); _ = ckpt.save(os.path.join(d, "ckpt"))
    >>> os.path.basename(checkpoint.latest_checkpoint(d))
    'ckpt-2'
    """
    path = _storage.latest_in(os.path.abspath(os.fspath(directory)))
    if path is None:
        return None
    path = _publish.resolved(path)  # the state file may name a swap's stand-in; its path is as good once complete
    return path if _publish.exists(path) else None


class StepAlreadyExistsError(ValueError):
    """`CheckpointManager.save` of a step that is already saved, without ``overwrite=True``.

    The message names the step and its path. Nothing was written.

    >>> import tempfile, jax.numpy as jnp, checkpoint
    >>> mgr = checkpoint.CheckpointManager(tempfile.mkdtemp())
    >>> _ = mgr.save(1, w=jnp.zeros(2))
    >>> try:
    ...     mgr.save(1, w=jnp.ones(2))
    ... except ValueError as e:
    ...     print(type(e).__name__)
    StepAlreadyExistsError
    >>> _ = mgr.save(1, overwrite=True, w=jnp.ones(2))
    """


# ---------------------------------------------------------------------------
# asynchronous saves still running when the program ends
# ---------------------------------------------------------------------------
_WATCHED: set[CheckpointManager] = set()
_WATCH_LOCK = threading.Lock()
_hooked = False


def _watch(manager: CheckpointManager) -> None:
    global _hooked
    with _WATCH_LOCK:
        _WATCHED.add(manager)
        if _hooked:
            return
        _hooked = True
    # At the end of the program Python first runs threading's exit hooks, in reverse order, then joins
    # the threads. concurrent.futures' hook (registered when it was imported) refuses new work from
    # then on, and orbax's commit needs its executors: so ours must be registered after it to run
    # before it. atexit would be too late; it only runs after the threads are joined.
    import concurrent.futures.thread  # noqa: F401

    try:
        threading._register_atexit(_commit_at_exit)  # type: ignore[attr-defined]  # private: not in typeshed
    except RuntimeError:  # the interpreter is already shutting down: threading's hooks have run
        atexit.register(_commit_at_exit)


def _commit_at_exit() -> None:
    """Waits for every pending asynchronous save; if one fails, says which and ends the process with status 1."""
    failures = []
    for manager in list(_WATCHED):
        path = manager._pending_path
        try:
            manager.wait_until_finished()
        except BaseException as e:
            failures.append(f"{path}: {type(e).__name__}: {e}")
    if failures:
        print(
            "checkpoint: an asynchronous save still running when the program ended failed and was not "
            f"committed: {'; '.join(failures)}. The previous checkpoint is still the latest.",
            file=sys.stderr,
        )
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)  # the exit status is fixed before the exit hooks run: this is the only way to change it


def _as_step(step: Any, where: str) -> int:
    try:
        if isinstance(step, bool):  # True would be step 1
            raise TypeError
        step = operator.index(step)
    except TypeError:
        raise ValueError(f"{where}: step must be an int, got {step!r} ({type(step).__name__}); pass the step "
                         "number, e.g. 100.") from None
    if step < 0:
        raise ValueError(f"{where}: step must be >= 0, got {step}.")
    return step


def _check_bools(where: str, **options: Any) -> None:
    for name, value in options.items():
        if type(value) is not bool:  # "no" is truthy: it would turn the option on
            raise TypeError(f"{where}: {name} must be a bool (True or False), got {value!r} "
                            f"({type(value).__name__}); pass {name}={bool(value)!r} if that is what you mean.")


# restore's keywords: a root of that name could be saved but never restored (save's own keywords, and `step`,
# which _step_of takes, never reach its **roots).
_RESTORE_KEYWORDS = ("strict", "expect_partial")


def _step_of(step: Any, roots: dict[str, Any], where: str) -> Any:
    """The step passed positionally or as ``step=``; a root cannot be named ``step``."""
    if "step" in roots:
        if step is not None:
            raise ValueError(f"{where}: a root named 'step' collides with the parameter step (given as "
                             f"{step!r}); rename the root, e.g. global_step=...")
        step = roots.pop("step")
    return step


# ---------------------------------------------------------------------------
# the manager
# ---------------------------------------------------------------------------
class CheckpointManager:
    """Numbered checkpoints ``<directory>/ckpt-<step>``: keeps the newest (or the best), deletes the others.

    `save(step, **roots)` writes the roots (as `Checkpoint(**roots)` would,
    with ``save_counter`` = step) and records them in TF's ``checkpoint``
    state file once committed. With ``async_save=True`` it returns as soon
    as the values are copied off the arrays (later updates, even donated
    ones, do not change what is saved); `wait_until_finished()` waits for the
    commit, and so does the end of the program: a pending save is committed
    before the interpreter exits, or the process exits with status 1 and a
    message naming the checkpoint; a failed asynchronous save is raised
    again by the next `save`, `restore` or `wait_until_finished`. The copies
    are bounded by ``max_staging_bytes``: past it, ``format="tf"`` writes
    values in the calling thread until the rest fit, and the orbax format
    writes the whole checkpoint before `save` returns (orbax's asynchronous
    save copies all or nothing); only the commit is then left to the
    background. Every file is fsynced before the checkpoint is published
    (both formats). Used as a context manager, the manager waits for its
    pending save and closes on leaving the block.

    Guarantees: at every instant (a SIGKILL included) the latest checkpoint
    in the state file is complete. Saving a step that exists raises
    `StepAlreadyExistsError` unless ``overwrite=True``; an overwrite writes
    the new checkpoint completely before the old one goes. Temporaries of
    saves that died are removed by the next save in the directory (by any
    manager or `Checkpoint`), never those of a save still running; a manager
    that only restores (an evaluator beside the trainer) deletes nothing. One
    manager saves to a directory at a time, as with TF's and orbax's.

    Which checkpoints are kept: ``max_to_keep`` (None: all) most recent ones;
    with ``best_fn`` (metrics -> number) the ``max_to_keep`` best by
    ``best_fn(metrics)`` (``best_mode`` "max" or "min") plus the latest,
    which is always kept, being what training resumes from. A checkpoint
    saved without metrics, or whose metrics lack a key ``best_fn`` reads
    (KeyError), or for which it returns None or NaN, ranks below every
    checkpoint with a score; ties go to the more recent. The metrics are kept
    in ``checkpoint_manager.json`` beside the state file (written atomically;
    it exists while a save is in flight or a kept checkpoint has metrics), so
    a reopened manager ranks the same way. ``keep_every_n_steps`` preserves,
    as TF's, a checkpoint leaving the kept list whose step is a multiple of
    it: it is no longer managed and never deleted. ``format="tf"`` writes TF
    TensorBundles (``ckpt-N.index`` + data) that TensorFlow restores;
    ``packed=False`` writes every value as its own orbax array, named by its
    checkpoint key, that plain orbax reads (see `Checkpoint.write`).

    Args:
        directory: where the checkpoints and the state file live (created on
            the first save).
        max_to_keep: how many checkpoints to keep (the most recent, or the best
            with `best_fn`); None keeps all.
        keep_every_n_steps: also keep for good, unmanaged, every checkpoint
            leaving the kept list whose step is a multiple of it; None: none.
        async_save: `save` returns once the values are copied off the arrays
            and commits in a background thread.
        checkpoint_name: the checkpoints' name before ``-<step>``.
        save_interval_steps: what `should_save` asks of a step (a multiple).
        best_fn: ``metrics -> number`` ranking checkpoints saved with metrics;
            None keeps the most recent.
        best_mode: ``"max"`` or ``"min"``: which scores are best.
        format: ``"orbax"``, or ``"tf"`` for TF TensorBundles.
        packed: (orbax) as `Checkpoint.write`'s.
        max_staging_bytes: with `async_save`, the most bytes of host copies
            a save keeps for its background write; None: no bound (the whole
            checkpoint). A save whose copies would hold more writes the rest
            before `save` returns (see below).

    Raises:
        TypeError: an `async_save` or `packed` that is not a bool.
        ValueError: a `max_to_keep`, `keep_every_n_steps` or
            `save_interval_steps` that is not a positive int; a
            `max_staging_bytes` that is not a non-negative int, or given
            without `async_save`; a
            `checkpoint_name` with characters other than letters, digits and
            ``_.-``; a `best_fn` that is not callable; an unknown `best_mode` or
            `format`.

    >>> import os, tempfile, jax.numpy as jnp, varstate, checkpoint
    >>> w = varstate.Variable(jnp.zeros(2))
    >>> with checkpoint.CheckpointManager(tempfile.mkdtemp(), max_to_keep=2) as mgr:
    ...     for step in range(1, 4):
    ...         w = w.assign_add(jnp.ones(2))
    ...         _ = mgr.save(step, model={"w": w})
    >>> [os.path.basename(p) for p in mgr.checkpoints], mgr.latest_step()
    (['ckpt-2', 'ckpt-3'], 3)
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
        *,
        save_interval_steps: int = 1,
        best_fn: Callable[[dict[str, Any]], Any] | None = None,
        best_mode: str = "max",
        format: str = "orbax",
        packed: bool = True,
        max_staging_bytes: int | None = None,
    ) -> None:
        for name, value in (("max_to_keep", max_to_keep), ("keep_every_n_steps", keep_every_n_steps)):
            if value is not None and (type(value) is not int or value < 1):
                raise ValueError(f"CheckpointManager: {name} must be a positive int or None, got {value!r}.")
        if type(save_interval_steps) is not int or save_interval_steps < 1:
            raise ValueError(
                f"CheckpointManager: save_interval_steps must be a positive int, got {save_interval_steps!r}."
            )
        if not re.fullmatch(r"[A-Za-z0-9_.-]+", checkpoint_name):
            raise ValueError(f"CheckpointManager: invalid checkpoint_name {checkpoint_name!r}.")
        if best_fn is not None and not callable(best_fn):
            raise ValueError(f"CheckpointManager: best_fn must be callable (metrics -> number), got {best_fn!r}.")
        if best_mode not in ("max", "min"):
            raise ValueError(f"CheckpointManager: best_mode must be 'max' or 'min', got {best_mode!r}.")
        check_format(format, "CheckpointManager")
        _check_bools("CheckpointManager", async_save=async_save, packed=packed)
        if max_staging_bytes is not None:
            if type(max_staging_bytes) is not int or max_staging_bytes < 0:
                raise ValueError(f"CheckpointManager: max_staging_bytes must be a non-negative int (bytes) or None, "
                                 f"got {max_staging_bytes!r}.")
            if not async_save:
                raise ValueError(f"CheckpointManager: max_staging_bytes={max_staging_bytes} bounds the copies an "
                                 "asynchronous save holds, and async_save is False (a save then copies nothing); "
                                 "pass async_save=True, or leave max_staging_bytes out.")
        self.max_staging_bytes = max_staging_bytes
        self.directory = os.path.abspath(os.fspath(directory))
        self.max_to_keep, self.keep_every_n_steps = max_to_keep, keep_every_n_steps
        self.save_interval_steps = save_interval_steps
        self.format = format
        self._packed = packed
        self._name = checkpoint_name
        self._best_fn, self._best_mode = best_fn, best_mode
        self._step_pattern = re.compile(re.escape(checkpoint_name) + r"-(\d+)(\.varstate-standin-[0-9a-f]{16})?")
        os.makedirs(self.directory, exist_ok=True)
        state = read_checkpoint_state(self.directory)
        listed = state.all_model_checkpoint_paths if state is not None else []
        # In the state file's order, oldest saved first (not by step number), as TF's manager recovers it.
        # A stand-in (a save killed while replacing a checkpoint) stands for its step until a save resolves it.
        self._standins: dict[int, str] = {}
        steps = []
        for p in listed:
            m = self._step_pattern.fullmatch(os.path.basename(p))
            if not m:
                continue
            step = int(m.group(1))
            if m.group(2):
                self._standins[step] = os.path.join(self.directory, os.path.basename(p))
            if _publish.exists(self._locate(step)):
                steps.append(step)
        self._steps = list(dict.fromkeys(reversed(steps)))[::-1]  # a step listed twice: its last place
        self._journal = Journal(self.directory)
        for name, entry in list(self._journal.saving.items()):
            if self._plain_step(name) in self._steps:  # killed after it was recorded: it committed
                self._keep_metrics(name, entry["metrics"])
        self._scores = {s: self._score(self._metrics_of(s), self._path(s)) for s in self._steps}
        self._async = async_save
        self._checkpointer: Any = None
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._pending_path: str | None = None
        self._pending_step: int | None = None

    def _path(self, step: int) -> str:
        return os.path.join(self.directory, f"{self._name}-{step}")

    def _plain_step(self, name: str) -> int | None:
        m = self._step_pattern.fullmatch(name)
        return int(m.group(1)) if m and not m.group(2) else None

    def _keep_metrics(self, name: str, metrics: dict[str, Any] | None) -> None:
        if metrics is None:
            self._journal.metrics.pop(name, None)
        else:
            self._journal.metrics[name] = metrics

    def _metrics_of(self, step: int) -> dict[str, Any] | None:
        return self._journal.metrics.get(os.path.basename(self._path(step)))

    def _locate(self, step: int) -> str:
        path, stand_in = self._path(step), self._standins.get(step)
        if stand_in is not None and not _publish.exists(path) and _publish.exists(stand_in):
            return stand_in
        return path

    def _score(self, metrics: dict[str, Any] | None, where: str) -> float | None:
        try:
            value = None if self._best_fn is None or metrics is None else self._best_fn(dict(metrics))
        except KeyError:  # the metric best_fn reads is missing: ranked as a checkpoint without metrics
            return None
        if value is None:
            return None
        try:
            value = float(value)
        except (TypeError, ValueError):
            raise ValueError(
                f"CheckpointManager: best_fn returned {value!r} for the metrics {metrics} of {where}; it must "
                "return a number (or None for no score)."
            ) from None
        return None if math.isnan(value) else value

    def __repr__(self) -> str:
        return (f"CheckpointManager({self.directory!r}, steps={self._steps}, max_to_keep={self.max_to_keep}, "
                f"async_save={self._async})")

    # --- what is saved --------------------------------------------------------
    @property
    def checkpoints(self) -> list[str]:
        """The paths of the kept checkpoints, oldest saved first."""
        return [self._locate(s) for s in self._steps]

    @property
    def latest_checkpoint(self) -> str | None:
        """The path of the newest committed checkpoint, or None."""
        return self._locate(self._steps[-1]) if self._steps else None

    def latest_step(self) -> int | None:
        """The step of the most recent save (by time, not the largest step); None before the first.

        An asynchronous save counts from `save` on; `latest_checkpoint` names
        the newest one committed.

        Returns:
            The step (int), or None.

        >>> import tempfile, jax.numpy as jnp, checkpoint
        >>> mgr = checkpoint.CheckpointManager(tempfile.mkdtemp())
        >>> mgr.latest_step() is None
        True
        >>> _ = mgr.save(20, w=jnp.zeros(2)); _ = mgr.save(10, w=jnp.zeros(2))
        >>> mgr.latest_step()
        10
        """
        if self._pending_step is not None:
            return self._pending_step
        return self._steps[-1] if self._steps else None

    def all_steps(self) -> list[int]:
        """The steps of the kept checkpoints, ascending (an asynchronous save counts from `save` on).

        Returns:
            A list of int.

        >>> import tempfile, jax.numpy as jnp, checkpoint
        >>> mgr = checkpoint.CheckpointManager(tempfile.mkdtemp(), max_to_keep=2)
        >>> for step in (30, 10, 20):
        ...     _ = mgr.save(step, w=jnp.zeros(2))
        >>> mgr.all_steps()
        [10, 20]
        """
        steps = set(self._steps)
        if self._pending_step is not None:
            steps.add(self._pending_step)
        return sorted(steps)

    def best_step(self) -> int | None:
        """The step of the best kept checkpoint by ``best_fn`` and ``best_mode`` (ties: the more recent).

        Without ``best_fn`` nothing is ranked and it returns None: use
        `latest_step`. Checkpoints without a score (saved without metrics,
        or ``best_fn`` gave None or NaN) are never the best.

        Returns:
            The step (int), or None without ``best_fn`` or a scored checkpoint.

        >>> import tempfile, jax.numpy as jnp, checkpoint
        >>> mgr = checkpoint.CheckpointManager(tempfile.mkdtemp(), best_fn=lambda m: m["loss"], best_mode="min")
        >>> for step, loss in ((1, 0.5), (2, 0.2), (3, 0.4)):
        ...     _ = mgr.save(step, metrics={"loss": loss}, w=jnp.zeros(2))
        >>> mgr.best_step(), mgr.metrics(2)
        (2, {'loss': 0.2})
        """
        scored = [s for s in reversed(self._steps) if self._scores.get(s) is not None]  # newest first: wins ties
        return max(scored, key=self._rank) if scored else None

    def metrics(self, step: int) -> dict[str, Any] | None:
        """The metrics saved with the kept checkpoint of `step` (None if it was saved without).

        Args:
            step: the step of a kept checkpoint (see `all_steps`).

        Returns:
            A new ``{name: number}`` dict, or None.

        Raises:
            KeyError: no kept checkpoint of that step.
        """
        step = _as_step(step, "CheckpointManager.metrics")
        if step not in self._steps:
            raise KeyError(f"CheckpointManager.metrics: no kept checkpoint of step {step} in {self.directory!r}; "
                           f"the kept steps are {sorted(self._steps)}. Ask for one of them (all_steps()).")
        metrics = self._metrics_of(step)
        return None if metrics is None else dict(metrics)

    def should_save(self, step: int) -> bool:
        """True if `step` is a multiple of ``save_interval_steps`` and not saved yet.

        `save` does not ask it: call it in the training loop.

        Args:
            step: the training step (a non-negative int).

        Returns:
            Whether to save at `step`.

        Raises:
            ValueError: `step` is not a non-negative int.

        >>> import tempfile, jax.numpy as jnp, checkpoint
        >>> mgr = checkpoint.CheckpointManager(tempfile.mkdtemp(), save_interval_steps=100)
        >>> [s for s in (50, 100, 150, 200) if mgr.should_save(s)]
        [100, 200]
        >>> _ = mgr.save(100, w=jnp.zeros(2))
        >>> mgr.should_save(100)
        False
        """
        step = _as_step(step, "CheckpointManager.should_save")
        return (
            step % self.save_interval_steps == 0
            and step not in self.all_steps()
            and not _publish.exists(self._path(step))
        )

    # --- saving ---------------------------------------------------------------
    def save(
        self, step: int | None = None, /, *, overwrite: bool = False, metrics: Mapping[str, Any] | None = None,
        **roots: Any,
    ) -> str:
        """Writes ``ckpt-<step>``; returns its path (committed unless ``async_save``).

        Waits for a pending asynchronous save first; then deletes the
        checkpoints no longer kept (see the class docstring).

        Args:
            step: the step (a non-negative int, positional or ``step=``), the
                checkpoint's number and its ``save_counter``.
            overwrite: replace a checkpoint of that step; the previous one
                stays readable (and the latest) until the new one is complete.
            metrics: ``{name: number}``, what `best_fn` ranks; kept beside
                the state file.
            **roots: the roots to save, as `Checkpoint(**roots)`. The names of
                the parameters of `save` and `restore` (``step``,
                ``overwrite``, ``metrics``, ``strict``, ``expect_partial``)
                cannot name roots.

        Returns:
            The checkpoint's path (committed unless `async_save`).

        Raises:
            StepAlreadyExistsError: `step` is already saved and not `overwrite`.
            ValueError: a step that is not a non-negative int (a bool
                included); a root named as a parameter of `save` or
                `restore`; metrics that are not ``{str: number}``; `best_fn`
                returning something other than a number or None.
            TypeError: an `overwrite` that is not a bool.

        >>> import tempfile, jax.numpy as jnp, checkpoint
        >>> mgr = checkpoint.CheckpointManager(tempfile.mkdtemp(), max_to_keep=2, best_fn=lambda m: m["acc"])
        >>> for step, acc in ((1, 0.5), (2, 0.9), (3, 0.7), (4, 0.6)):
        ...     _ = mgr.save(step, metrics={"acc": acc}, w=jnp.full(2, step))
        >>> mgr.all_steps()  # the two best, and the latest
        [2, 3, 4]
        """
        step = _as_step(_step_of(step, roots, "CheckpointManager.save"), "CheckpointManager.save")
        _check_bools("CheckpointManager.save", overwrite=overwrite)
        clash = [name for name in _RESTORE_KEYWORDS if name in roots]
        if clash:
            raise ValueError(f"CheckpointManager.save: a root named {clash[0]!r} collides with the parameter "
                             f"{clash[0]} of CheckpointManager.restore, which could not restore it; rename the "
                             f"root, e.g. {clash[0]}_=...")
        self.wait_until_finished()
        path = self._path(step)
        metrics = checked_metrics(metrics)
        score = self._score(metrics, path)
        ckpt = Checkpoint(**roots)

        def write(temp: str) -> Callable[[], None]:
            if not overwrite and (step in self._steps or _publish.exists(path)):
                raise StepAlreadyExistsError(
                    f"CheckpointManager.save: step {step} is already saved ({path}). Pass overwrite=True to "
                    "replace it (the old checkpoint stays the latest until the new one is complete), or save "
                    "another step."
                )
            if self.format == "orbax" and self._checkpointer is None:
                from checkpoint._storage import _orbax

                self._checkpointer = _orbax.checkpointer(self._async)
            return start_write(ckpt, temp, self.format, packed=self._packed, background=self._async, counter=step,
                               checkpointer=self._checkpointer, max_staging_bytes=self.max_staging_bytes)

        with _save.collector_paused():  # the part run in this thread: an asynchronous save's commit runs beside it
            complete = _save.start(path, self.format, "CheckpointManager.save", write,
                                   lambda primary: self._commit(step, metrics, score, primary),
                                   before_publish=lambda: self._journal.enter(path, metrics),
                                   leftovers=self._remove_unrecorded)
            if not self._async:
                complete()
                return path
        self._pending_step, self._pending_path = step, path
        _watch(self)
        self._thread = threading.Thread(target=self._finish, args=(complete,), name="checkpoint-commit")
        self._thread.start()
        return path

    def _finish(self, complete: Callable[[], None]) -> None:
        try:
            complete()
        except BaseException as e:  # raised by wait_until_finished in the caller's thread
            self._error = e
        finally:
            self._pending_step = None

    def _remove_unrecorded(self, older_than: float) -> None:
        """Deletes the checkpoints of saves killed after moving them into place and before recording them."""
        now, changed = time.time(), False
        for name, entry in list(self._journal.saving.items()):
            step = self._plain_step(name)
            # 0 (the save lock was free: whoever wrote the entry is dead) never looks at the clock, which may
            # have gone backwards since and put the entry in the future.
            if step is None or (older_than > 0 and now - entry["since"] < older_than):
                continue
            # Replacing a checkpoint the state file does not list (one kept for good by keep_every_n_steps,
            # say), it left the checkpoint where it found one: unlisted, and as complete.
            if step not in self._steps and not entry.get("replaces") and _publish.exists(self._path(step)):
                _publish.retire(self._path(step))
            del self._journal.saving[name]
            changed = True
        if changed:
            self._journal.store()

    def _commit(self, step: int, metrics: dict[str, Any] | None, score: float | None, primary: bool) -> None:
        path = self._path(step)
        name = os.path.basename(path)
        self._standins.pop(step, None)
        self._keep_metrics(name, metrics)
        self._scores[step] = score
        steps = [s for s in self._steps if s != step] + [step]
        removed = set(self._to_remove(steps))
        preserved = {s for s in removed if self.keep_every_n_steps and s % self.keep_every_n_steps == 0}
        doomed = [s for s in steps if s in removed - preserved]
        # Those to delete stay listed until they are gone: a kill in between leaves them listed (the next
        # commit deletes them), never unlisted and on disk for good.
        listed = [s for s in steps if s not in preserved]
        if primary:  # the other processes of a jax.distributed job only keep the same lists
            record_latest(self.directory, path, [self._locate(s) for s in listed], preserved=bool(preserved))
        self._steps = listed
        for s in doomed:
            if primary:
                _publish.retire(self._locate(s))
            self._standins.pop(s, None)
        if doomed:
            self._steps = [s for s in listed if s not in removed]
            if primary:
                record_latest(self.directory, path, [self._locate(s) for s in self._steps])
        for s in removed:
            self._journal.metrics.pop(os.path.basename(self._path(s)), None)
            self._scores.pop(s, None)
        self._journal.saving.pop(name, None)
        if primary:
            self._journal.store()

    def _to_remove(self, steps: list[int]) -> list[int]:
        """The steps (in saving order, newest last) that `max_to_keep` and `best_fn` leave out."""
        if self.max_to_keep is None or len(steps) <= self.max_to_keep:
            return []
        if self._best_fn is None:
            return steps[: -self.max_to_keep]
        # Newest first into a stable sort: ties go to the more recent.
        best = set(sorted(reversed(steps), key=self._rank, reverse=True)[: self.max_to_keep])
        return [s for s in steps[:-1] if s not in best]  # the latest stays: it is what training resumes from

    def _rank(self, step: int) -> tuple[bool, float]:
        """How good `step`'s checkpoint is by `best_fn` (greater is better); one without a score ranks lowest."""
        score = self._scores.get(step)
        return (False, 0.0) if score is None else (True, score if self._best_mode == "max" else -score)

    def wait_until_finished(self) -> None:
        """Blocks until an asynchronous save is committed; raises its error if it failed.

        Raises:
            Exception: whatever the asynchronous save raised, in this thread.

        >>> import tempfile, jax.numpy as jnp, checkpoint
        >>> mgr = checkpoint.CheckpointManager(tempfile.mkdtemp(), async_save=True)
        >>> path = mgr.save(1, w=jnp.zeros(2))
        >>> mgr.wait_until_finished()
        >>> checkpoint.latest_checkpoint(mgr.directory) == path
        True
        >>> mgr.close()
        """
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        _WATCHED.discard(self)  # atomic: the lock guards only the first watch's hook
        self._pending_path = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    # --- restoring and closing ---------------------------------------------------
    def restore(
        self, step: int | None = None, /, *, strict: bool = False, expect_partial: bool = False, **templates: Any
    ) -> LoadStatus:
        """Restores `templates` from ``ckpt-<step>`` (default: the latest); see `Checkpoint.restore`.

        Waits for a pending asynchronous save first.

        Args:
            step: the step to restore (positional or ``step=``); None for the
                latest.
            strict: as `Checkpoint.restore`'s: True raises ValueError unless
                every value of the templates and every value in the checkpoint
                matched.
            expect_partial: the values in the checkpoint that the templates
                leave out (the optimizer's, restoring the model alone) are left
                out on purpose: no warning. Without it, one line is logged
                naming the first and how many.
            **templates: the roots to restore into, by name, as saved.

        Returns:
            A `LoadStatus`, whose ``status.<name>`` is the restored root.

        Raises:
            FileNotFoundError: no checkpoint saved yet (step None), or none of
                that step.
            ValueError: as `Checkpoint.restore`; a template named ``step``
                besides a positional step.
            TypeError: a `strict` or `expect_partial` that is not a bool.

        >>> import tempfile, jax.numpy as jnp, checkpoint
        >>> mgr = checkpoint.CheckpointManager(tempfile.mkdtemp())
        >>> _ = mgr.save(5, w=jnp.ones(2))
        >>> mgr.restore(w=jnp.zeros(2), strict=True).w.tolist()
        [1.0, 1.0]
        """
        step = _step_of(step, templates, "CheckpointManager.restore")
        _check_bools("CheckpointManager.restore", strict=strict, expect_partial=expect_partial)
        self.wait_until_finished()
        if step is None:
            path = self.latest_checkpoint
            if path is None:
                raise FileNotFoundError(
                    f"CheckpointManager: no checkpoint in {self.directory!r} yet; save one first, or restore "
                    "from another directory."
                )
        else:
            path = self._locate(_as_step(step, "CheckpointManager.restore"))
        status = Checkpoint(**templates).restore(path, strict=strict, expect_partial=expect_partial)
        return status.expect_partial() if expect_partial else status

    def close(self) -> None:
        """Waits for a pending save and releases orbax's threads; a later `save` starts them again.

        Leaving a ``with CheckpointManager(...)`` block calls it.
        """
        try:
            self.wait_until_finished()
        finally:
            if self._checkpointer is not None:
                checkpointer, self._checkpointer = self._checkpointer, None
                checkpointer.close()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()
