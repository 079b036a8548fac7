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

Every barrier goes through the key-value store of jax's distributed runtime
(its coordination service), with a bounded timeout: a process that died or
hangs makes the others raise `ProcessGroupError` naming it, never wait for
ever. A dead one is named sooner: each process taking part in a save keeps a
pulse in the store (a counter a thread bumps every second), and a barrier
that sees a missing process's pulse stop for `PEER_TIMEOUT_S` names it then.
That must come before jax's own verdict: after ``heartbeat_timeout_seconds``
(`jax.distributed.initialize`, 100 s by default) without a heartbeat,
jax's runtime ends every other process with SIGABRT and a C++ stack.
"""

from __future__ import annotations

import atexit
import hashlib
import os
import threading
import time

import numpy as np

from checkpoint._storage import _orbax_private

# Seconds a process waits at a barrier for the others; a process that does not arrive by then is
# reported (dead or stuck). Long enough for a slow writer of a large checkpoint, short enough that a
# job whose peer died fails rather than hangs until the scheduler kills it.
BARRIER_TIMEOUT_S = float(os.environ.get("VARSTATE_BARRIER_TIMEOUT_S", "600"))
# Seconds without a pulse after which a process missing at a barrier is reported dead: well under jax's default
# heartbeat timeout (100 s), after which jax's runtime aborts the survivors; well over the longest a live
# process's pulse thread can be kept from running (it needs the GIL once a second).
PEER_TIMEOUT_S = float(os.environ.get("VARSTATE_PEER_TIMEOUT_S", "30"))
PULSE_S = 1.0
_PREFIX = "varstate"


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
_PASSED: list[str] = []  # this process's keys of the barriers it passed, newest last
_PULSE: list[threading.Event] = []  # set to stop the pulse; empty until it starts


def _pulse(client, me: int) -> None:
    """Starts this process's pulse (once): a counter in the key-value store, bumped every `PULSE_S` seconds."""
    with _USES_LOCK:
        if _PULSE:
            return
        stop = threading.Event()
        _PULSE.append(stop)

    def beat() -> None:
        n = 0
        while not stop.is_set():
            n += 1
            try:
                client.key_value_set(f"{_PREFIX}/pulse/{me}", str(n), allow_overwrite=True)
            except Exception:  # the runtime is shutting down or gone: a barrier reports what follows
                return
            stop.wait(PULSE_S)

    thread = threading.Thread(target=beat, name="varstate-pulse", daemon=True)
    thread.start()

    def end() -> None:  # before jax's own exit handler (registered earlier, run later) shuts the client down
        stop.set()
        thread.join(2 * PULSE_S)

    atexit.register(end)


def _dir(client, directory: str) -> list[tuple[str, str]]:
    """The keys under `directory` (ending in a process index) with their values; none if the runtime is gone."""
    try:
        return client.key_value_dir_get(directory)
    except Exception:  # the runtime is shutting down or gone: the missing stay missing until the timeout
        return []


def barrier(name: str, timeout_s: float | None = None) -> None:
    """Blocks until every process reaches the barrier `name` (unique per save), or raises ProcessGroupError.

    The error names the processes that did not arrive: at once dead where
    their pulse stopped for `PEER_TIMEOUT_S`, else after `timeout_s`.
    """
    if process_count() == 1:
        return
    import jax

    timeout_s = BARRIER_TIMEOUT_S if timeout_s is None else timeout_s
    with _USES_LOCK:  # the k-th barrier of a name is the same on every process (each save of a path is ordered)
        _USES[name] = _USES.get(name, 0) + 1
        name = f"{name}#{_USES[name]}"
    client = _orbax_private.jax_distributed_client()
    me, n = jax.process_index(), jax.process_count()
    _pulse(client, me)
    here = f"{_PREFIX}/barrier/{name}/"
    mine = f"{here}{me}"
    try:
        client.key_value_set(mine, "1", allow_overwrite=True)
    except Exception as e:  # jax's JaxRuntimeError: the coordination service is gone (process 0 died)
        raise ProcessGroupError(
            f"Process {me} of {n}: cannot reach jax's coordination service (run by process 0) at the barrier "
            f"{name!r} ({str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__}); process 0 died "
            "or left. The save was abandoned; check process 0's log, then restart the job.") from e
    start = checked = time.monotonic()
    waiting, delay = set(range(n)) - {me}, 0.002
    beats: dict[int, tuple[str, float]] = {}  # process -> its last pulse seen, and when it was first seen
    # Two directory reads per look, whatever the number of processes (the coordinator serves every process),
    # looking more rarely the longer the wait: a quick barrier stays quick, a long one costs a few reads a second.
    while waiting:
        waiting -= {int(key.rsplit("/", 1)[1]) for key, _ in _dir(client, here)}
        if not waiting:
            break
        now = time.monotonic()
        if now - checked >= PULSE_S:  # a process that never pulsed is not judged: only the timeout speaks for it
            checked = now
            for key, beat in _dir(client, f"{_PREFIX}/pulse/"):
                p = int(key.rsplit("/", 1)[1])
                if beats.get(p, (None,))[0] != beat:
                    beats[p] = (beat, now)
        dead = sorted(p for p in waiting if p in beats and now - beats[p][1] > PEER_TIMEOUT_S)
        if dead or now - start > timeout_s:
            raise _missing(name, timeout_s, sorted(waiting), dead)
        time.sleep(delay)
        delay = min(2 * delay, 0.25)
    # Every process passed the previous barrier before any could pass this one: its key is read by no one now.
    _PASSED.append(mine)
    if len(_PASSED) > 1:
        try:
            client.key_value_delete(_PASSED.pop(0))
        except Exception:  # a key left behind costs a few bytes; the next barrier reports a runtime that is gone
            pass


def _missing(name: str, timeout_s: float, missing: list[int], dead: list[int]) -> ProcessGroupError:
    import jax

    states = ", ".join(f"process {p}" for p in missing)
    abandoned = "The save was abandoned: the checkpoint being written is not published and the latest checkpoint is " \
                "unchanged."
    if dead:
        return ProcessGroupError(
            f"Process {jax.process_index()} of {jax.process_count()}: {states} did not reach the barrier {name!r}: "
            f"{('it' if len(dead) == 1 else 'they') if dead == missing else ', '.join(f'process {p}' for p in dead)} "
            f"died or exited (no pulse for {PEER_TIMEOUT_S:g} s, "
            f"VARSTATE_PEER_TIMEOUT_S). {abandoned} Every process must call each save and restore; check the log of "
            f"process {', '.join(map(str, dead))}, then restart the job.")
    return ProcessGroupError(
        f"Process {jax.process_index()} of {jax.process_count()}: {states} did not reach the barrier {name!r} "
        f"within {timeout_s:g} s (it died or is stuck). {abandoned} If that process is alive, it did not call this "
        "save or restore: every process must call it, not only process 0. Otherwise check that process's log, then "
        "restart the job."
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
    import jax
    from jax.experimental import multihost_utils

    _pulse(_orbax_private.jax_distributed_client(), jax.process_index())  # a save's first exchange: pulse from here

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
