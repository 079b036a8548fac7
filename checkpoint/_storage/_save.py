"""The one save sequence of `Checkpoint.save`/`write` and `CheckpointManager.save`.

lock (and leftovers) -> temporary name -> barrier -> write -> fsync of every
file written -> barrier -> publish -> record -> barrier -> unlock. In a `jax.distributed` job only
process 0 touches what is shared (the lock, the leftovers, the publish, the
state file); every process writes its own shards between the barriers
(`_distributed.py`). What is written and how it is recorded come in as
callables: this layer knows no object graph.
"""

from __future__ import annotations

import contextlib
import gc
import os
from collections.abc import Callable, Iterator

from checkpoint._storage import _distributed, _publish
from checkpoint._storage._files import sync_tree


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off for a save or restore run in the caller's thread (as a decorator too).

    Both allocate a few Python objects per value (graph nodes, keys, arrays); with thousands of values the
    collector runs repeatedly during them, each run walking every object of the process and calling jax's
    own collection hook: 10-25 ms of a 100 ms save or restore of 1,500 small values. Not used in the thread
    that finishes an asynchronous save: that would pause the collector for the training loop beside it.
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def start(
    path: str,
    format: str,
    where: str,
    write: Callable[[str], Callable[[], None]],
    record: Callable[[bool], None],
    *,
    before_publish: Callable[[], None] | None = None,
    leftovers: Callable[[float], None] | None = None,
) -> Callable[[], None]:
    """Starts saving a checkpoint at `path`; returns the function that completes it (call it once, in any thread).

    `write(temp)` starts writing the checkpoint under the temporary name
    `temp` and returns the function that finishes writing it. Once it is
    published, `record(primary)` makes it the latest on every process (only
    the primary writes). `before_publish()` runs on the primary just before
    the publish; `leftovers(older_than)` removes more leftovers (see
    `_publish.begin`). The directory's save lock is held until the returned
    function returns or this one raises: a failed save leaves no temporary.
    """
    _publish.check_replaceable(path, format, where)
    primary = _distributed.process_index() == 0  # the process that writes what is shared
    lock = _publish.begin(os.path.dirname(path), leftovers) if primary else None
    temp = _publish.temporary(path, "new")
    try:
        temp = _distributed.agree(temp)  # process 0's, on every process
        _distributed.barrier(f"varstate-begin:{path}")
        finish = _collective(write, temp)
    except BaseException:
        _end(temp if primary else None, lock)
        raise

    def complete() -> None:
        try:
            _collective(finish)
            sync_tree(temp)  # every byte on disk before anything names the checkpoint
            _distributed.barrier(f"varstate-written:{path}")  # every process's shards are on disk
            if primary:
                if before_publish is not None:
                    before_publish()
                _publish.publish(temp, path)
        except BaseException:
            _end(temp if primary else None, lock)
            raise
        try:
            record(primary)
            _distributed.barrier(f"varstate-published:{path}")  # no process goes on before it is the latest
        finally:
            _end(None, lock)

    return complete


def _collective(fn: Callable, *args: str):
    try:
        return fn(*args)
    except Exception as e:  # orbax's own collectives fail this way when a process dies
        raise _distributed.lost_peer(e, "writing the checkpoint") from e


def _end(temp: str | None, lock: _publish.SaveLock | None) -> None:
    """Removes what there is of the unpublished `temp` (if given), then releases the save lock (if held)."""
    try:
        if temp is not None:
            _publish.remove(temp)
    finally:
        if lock is not None:
            lock.release()
