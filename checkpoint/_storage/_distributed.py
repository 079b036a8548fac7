"""Saving from every process of a `jax.distributed` group: who writes what, and the barriers in between.

With one process (the usual case) every function here is a no-op or the
identity, and nothing imports orbax's multi-host code. With N processes
(one per host, `jax.distributed.initialize`) the save protocol is:

1. every process builds the same object graph; `check_same` compares a
   digest of it across processes (an allgather of a few bytes), so a process
   that built a different program fails loudly instead of writing a mix;
2. process 0 takes the directory's save lock and removes leftovers, the
   others wait at a barrier; the temporary name is process 0's (`agree`);
3. every process writes its own shards through orbax's multi-host writer
   (orbax's primary host writes the metadata), or for the TF format its own
   data file ``P.data-<i>-of-<N>`` (its devices' shards as slices), after
   which process 0 writes the merged index (`_bundle_writer`);
4. a barrier: every process has written; process 0 publishes the
   checkpoint and updates the ``checkpoint`` state file; a last barrier, so
   no process returns before the checkpoint is the latest.

Every barrier goes through jax's distributed runtime (its coordination
service), with a bounded timeout: a process that died or hangs makes the
others raise `ProcessGroupError` naming it, never wait for ever.
"""

from __future__ import annotations

import hashlib
import os
import re
import threading

import numpy as np

from checkpoint._storage import _orbax_private

# Seconds a process waits at a barrier for the others; a process that does not arrive by then is
# reported (dead or stuck). Long enough for a slow writer of a large checkpoint, short enough that a
# job whose peer died fails rather than hangs until the scheduler kills it.
BARRIER_TIMEOUT_S = float(os.environ.get("VARSTATE_BARRIER_TIMEOUT_S", "600"))


class ProcessGroupError(RuntimeError):
    """A multi-process save or restore could not proceed: another process is missing or disagrees.

    The message names the processes (their `jax.process_index()`) and the
    step that failed.

    >>> issubclass(ProcessGroupError, RuntimeError)
    True
    """


def process_count() -> int:
    """`jax.process_count()`, without importing jax where it is not loaded yet (a TF-only reader)."""
    import sys

    if "jax" not in sys.modules:
        return 1
    import jax

    return jax.process_count()


def process_index() -> int:
    import jax

    return jax.process_index() if process_count() > 1 else 0


_USES: dict[str, int] = {}
_USES_LOCK = threading.Lock()
_TIMED_OUT = re.compile(r"timed out task names:\s*((?:\s*\S*?\d+\s*)+)", re.IGNORECASE)


def barrier(name: str, timeout_s: float | None = None) -> None:
    """Blocks until every process reaches the barrier `name` (unique per save), or raises ProcessGroupError.

    The error names the processes that did not arrive (from jax's report).
    """
    if process_count() == 1:
        return
    timeout_s = BARRIER_TIMEOUT_S if timeout_s is None else timeout_s
    with _USES_LOCK:  # the k-th barrier of a name is the same on every process (each save of a path is ordered)
        _USES[name] = _USES.get(name, 0) + 1
        name = f"{name}#{_USES[name]}"
    client = _orbax_private.jax_distributed_client()
    try:
        client.wait_at_barrier(name, int(timeout_s * 1000))
    except Exception as e:  # jax raises JaxRuntimeError; its text names the tasks that timed out
        raise _missing(name, timeout_s, e) from None


def _missing(name: str, timeout_s: float, error: BaseException) -> ProcessGroupError:
    import jax

    text = str(error)
    found = _TIMED_OUT.search(text)
    missing = sorted({int(n) for n in re.findall(r"\d+", found.group(1))}) if found else []
    # Not asked of jax's runtime which are alive: get_live_nodes waits for the dead to be declared dead
    # (the heartbeat timeout, 100 s by default), which would make this bound that long.
    missing = missing or [p for p in range(jax.process_count()) if p != jax.process_index()]
    states = ", ".join(f"process {p}" for p in missing)
    first = text.strip().splitlines()[0] if text.strip() else type(error).__name__
    return ProcessGroupError(
        f"Process {jax.process_index()} of {jax.process_count()}: {states} did not reach the barrier {name!r} "
        f"within {timeout_s:g} s (it died or is stuck; {first}). The save was abandoned: the checkpoint being "
        "written is not published and the latest checkpoint is unchanged. If that process is alive, it did not "
        "call this save or restore: every process must call it, not only process 0. Otherwise check that "
        "process's log, then restart the job."
    )


def lost_peer(error: BaseException, what: str) -> BaseException:
    """`error` of a collective (gloo, NCCL) that failed because another process went away, as a ProcessGroupError.

    The transport reports a reset connection, not which process reset it;
    the message names the others as the suspects. Other errors pass through.
    """
    if process_count() == 1 or type(error).__name__ not in ("JaxRuntimeError", "XlaRuntimeError"):
        return error
    import jax

    me, n = jax.process_index(), jax.process_count()
    others = [p for p in range(n) if p != me]
    first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return ProcessGroupError(
        f"Process {me} of {n}: {what} with process{'es' if len(others) > 1 else ''} {others} failed ({first}); "
        f"{'one of them' if len(others) > 1 else 'it'} died or left the group. The save was abandoned: the "
        "checkpoint being written is not published and the latest checkpoint is unchanged. If the others are "
        "alive, they did not call this save or restore: every process must call it, not only process 0. "
        "Otherwise check the other processes' logs, then restart the job."
    )


def agree(text: str) -> str:
    """Process 0's `text` on every process (a temporary name, chosen once for all of them)."""
    return allgather_bytes(text.encode("utf-8"), "agreeing on the checkpoint's temporary name")[0].decode("utf-8")


def allgather_bytes(data: bytes, what: str = "exchanging metadata (checksums, index entries, digests)") -> list[bytes]:
    """Every process's `data`, in process order (small metadata only: offsets, checksums); `what` for errors."""
    if process_count() == 1:
        return [data]
    from jax.experimental import multihost_utils

    try:
        sizes = np.asarray(multihost_utils.process_allgather(np.array([len(data)], np.int64))).reshape(-1)
        padded = np.zeros(max(int(sizes.max()), 1), np.uint8)
        padded[: len(data)] = np.frombuffer(data, np.uint8)
        rows = np.asarray(multihost_utils.process_allgather(padded)).reshape(len(sizes), -1)
    except Exception as e:
        raise lost_peer(e, what) from e
    return [bytes(rows[i, : int(sizes[i])]) for i in range(len(sizes))]


def check_same(what: str, data: bytes, items: list[str] | None = None) -> None:
    """Raises ProcessGroupError unless every process passes the same `data` (compared by digest).

    This is how a program that builds different variables on different
    processes is caught: the object graph (names, structure, shapes) is
    compared before anything is written or read. `items` (the Variables'
    keys, shapes and dtypes) are exchanged only on a mismatch, to name the
    first that differs.
    """
    if process_count() == 1:
        return
    import jax

    digest = hashlib.sha256(data).digest()
    digests = allgather_bytes(digest)
    others = [p for p, d in enumerate(digests) if d != digest]
    if others:
        mine = [p for p, d in enumerate(digests) if d == digest]
        detail = ""
        if items is not None:
            lists = [b.decode("utf-8").split("\n") for b in allgather_bytes("\n".join(items).encode("utf-8"))]
            me, them = lists[jax.process_index()], lists[others[0]]
            first = next((i for i in range(max(len(me), len(them))) if me[i:i + 1] != them[i:i + 1]), None)
            if first is not None:
                a = repr(me[first]) if first < len(me) else "nothing more"
                b = repr(them[first]) if first < len(them) else "nothing more"
                detail = f"; the first Variable that differs: process {jax.process_index()} has {a} where " \
                         f"process {others[0]} has {b}"
        raise ProcessGroupError(
            f"Process {jax.process_index()}: the {what} differs between processes: processes {mine} have one "
            f"version, processes {others} another{detail}. Every process must create the same variables, in the "
            "same order, with the same names and shapes (run the same program on every process)."
        )
