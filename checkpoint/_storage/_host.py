"""Host buffers that become device arrays without a copy, and the reads that fill them ahead of their use.

XLA's CPU client takes a C-contiguous NumPy buffer whose data starts on a
64-byte boundary as it is (the jax.Array aliases it); NumPy's own
allocations are 16-byte aligned, and a buffer so placed is copied. A restore
reads each stored value into `aligned_empty` and places it with `place`:
on CPU the restored arrays are those very buffers, so a restore holds the
data once, plus the values being read ahead (`READ_AHEAD` bytes).
"""

from __future__ import annotations

import collections
import concurrent.futures
import ctypes
import ctypes.util
import math
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar

import numpy as np

from checkpoint._storage._files import pread_into, shared_pool

ALIGN = 64  # bytes: what XLA's CPU client takes without a copy
READ_AHEAD = 256 << 20  # bytes of values read (and checksummed) ahead of the one being placed
GROUP_BYTES = 1 << 20  # small values are read and placed in lists of about this many bytes (`groups`)
READERS = 16  # threads reading ahead: one per stored array of a typical large checkpoint; a disk (NVMe) wants
# many reads in flight, and a thread waiting on one costs nothing (as many as tensorstore's file I/O uses)

T = TypeVar("T")
R = TypeVar("R")


def aligned_empty(shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    """An uninitialized C-contiguous array whose data starts on a 64-byte boundary (`device_put` takes it as is).

    >>> aligned_empty((3, 5), np.float32).ctypes.data % 64
    0
    """
    dtype = np.dtype(dtype)
    n = math.prod(shape) * dtype.itemsize
    raw = np.empty(n + ALIGN, np.uint8)
    start = -raw.ctypes.data % ALIGN
    return raw[start:start + n].view(dtype).reshape(shape)


def held_here(sharding: Any) -> bool:
    """`sharding` (a Sharding or a Device) puts every shard on this process's devices."""
    import jax  # only here: reading a TF checkpoint imports no jax until a value is placed

    if isinstance(sharding, jax.Device):
        return sharding.process_index == jax.process_index()
    return isinstance(sharding, jax.sharding.Sharding) and sharding.is_fully_addressable


def place(host: np.ndarray, sharding: Any) -> Any:
    """`host` as a jax.Array on `sharding` (a Sharding or a Device), sharing its buffer wherever the devices can.

    `jax.device_put` places each shard that is a contiguous, 64-byte-aligned
    part of an aligned `host` (the whole, or a split along the first axis at
    a multiple of 64 bytes, as on a mesh of CPU devices) without a copy, and
    copies any other; an unaligned `host` is first copied into an aligned
    buffer, so that a shard that can be shared is.
    """
    return place_many([host], [sharding])[0]


def place_many(hosts: list[np.ndarray], shardings: list[Any]) -> list[Any]:
    """`place` of each host on its sharding: those for one device through `host_put` (a fifth of
    `jax.device_put`'s time), the rest in one `jax.device_put` (a call per array costs 3x the Python time).

    >>> [x.tolist() for x in place_many([np.zeros(2), np.ones(1)], [None, None])]
    [[0.0, 0.0], [1.0]]
    """
    import jax  # here: reading a TF checkpoint imports no jax until a value is placed

    from checkpoint._storage._jax_private import host_put

    def aligned(host: np.ndarray) -> np.ndarray:
        if host.flags.c_contiguous and host.ctypes.data % ALIGN == 0:
            return host
        out = aligned_empty(host.shape, host.dtype)
        np.copyto(out, host)
        return out

    hosts = [aligned(h) for h in hosts]
    put = host_put()
    out: list[Any] = [None] * len(hosts)
    rest = []
    for i, (host, sharding) in enumerate(zip(hosts, shardings, strict=True)):
        if put is not None and type(sharding) is jax.sharding.SingleDeviceSharding:
            out[i] = put(host, sharding)
        if out[i] is None:
            rest.append(i)
    if rest:
        for i, x in zip(rest, jax.device_put([hosts[i] for i in rest], [shardings[i] for i in rest]), strict=True):
            out[i] = x
    return out


def groups(items: Iterable[T], nbytes: Callable[[T], int], limit: int = GROUP_BYTES) -> Iterator[list[T]]:
    """Consecutive `items` in lists of fewer than `limit` bytes (an item of `limit` or more alone): many small
    values are read and placed a list at a time, as a thread's task and a `device_put` cost more than their bytes.

    >>> list(groups([1, 2, 3, 9, 1], lambda x: x, limit=6))
    [[1, 2], [3], [9], [1]]
    """
    group: list[T] = []
    total = 0
    for item in items:
        size = nbytes(item)
        if group and total + size >= limit:
            yield group
            group, total = [], 0
        group.append(item)
        total += size
    if group:
        yield group


def read_runs(parts: list[tuple[int, int, int, str]]) -> list[np.ndarray]:
    """The bytes of each ``(fd, offset, size, where)``, each in its own 64-byte-aligned uint8 buffer; parts stored
    back to back in one file are read with one system call (a call per small value costs more than its bytes).
    `where` names the first value of a run in the error of a file that shrank.

    >>> import os, tempfile
    >>> fd, name = tempfile.mkstemp()
    >>> _ = os.write(fd, bytes(range(10)))
    >>> [p.tolist() for p in read_runs([(fd, 0, 2, "a"), (fd, 2, 3, "b"), (fd, 8, 2, "c")])]
    [[0, 1], [2, 3, 4], [8, 9]]
    >>> os.close(fd); os.remove(name)
    """
    out = [aligned_empty((size,), np.uint8) for _, _, size, _ in parts]
    i = 0
    while i < len(parts):
        fd, start, size, where = parts[i]
        end, j = start + size, i + 1
        while j < len(parts) and parts[j][0] == fd and parts[j][1] == end:
            end += parts[j][2]
            j += 1
        pread_into(fd, out[i:j], start, where)
        i = j
    return out


def libc_function(name: str, argtypes: list, restype: Any) -> Any:
    """The C library's function `name`, typed; None where the library or the function is not there (not glibc)."""
    try:
        fn = getattr(ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6"), name)
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = argtypes, restype
    return fn


_TRIM = libc_function("malloc_trim", [ctypes.c_size_t], ctypes.c_int)  # not glibc: nothing to give back this way


def release_freed_memory() -> None:
    """Returns the memory glibc's allocator holds free to the system (a no-op without glibc).

    A storage library's read buffers of a few MB, freed in its threads, stay
    in glibc's per-thread heaps once its adaptive mmap threshold has risen past
    their size, while the next values' buffers are taken from elsewhere: a
    restore would hold that garbage beside the data. Only free pages are
    released, so this is safe at any time; it costs a walk of the heaps.
    """
    if _TRIM is not None:
        _TRIM(0)


def read_grouped(items: list[T], nbytes: Callable[[T], int],
                 read: Callable[[list[T]], R]) -> Iterator[tuple[list[T], R]]:
    """Yields (group, read(group)) over `items` in `groups`, in order, read in `read_ahead`'s threads.

    >>> [r for _, r in read_grouped([1, 2, 3], lambda x: 8, sum)]
    [6]
    """
    return read_ahead(groups(items, nbytes), read, lambda group: sum(map(nbytes, group)))


def read_ahead(items: Iterable[T], read: Callable[[T], R], nbytes: Callable[[T], int]) -> Iterator[tuple[T, R]]:
    """Yields (item, read(item)) in order, `read` running in `READERS` threads up to `READ_AHEAD` bytes ahead.

    `read` (a positioned read and its checksum, both outside the GIL) of the
    next values overlaps the caller's work on this one. An exception from
    `read` is raised when its item's turn comes; the reads still queued are
    cancelled.

    >>> [r for _, r in read_ahead([1, 2, 3], lambda x: x * 10, lambda x: 8)]
    [10, 20, 30]
    """
    pending: collections.deque = collections.deque()
    todo = iter(items)
    ahead = 0
    pool = shared_pool("checkpoint-read", READERS)
    try:
        for item in todo:
            size = nbytes(item)
            while pending and ahead + size > READ_AHEAD:
                done, future, n = pending.popleft()
                ahead -= n
                yield done, future.result()
            pending.append((item, pool.submit(read, item), size))
            ahead += size
        while pending:
            done, future, n = pending.popleft()
            yield done, future.result()
    finally:
        for _, future, _ in pending:
            future.cancel()
        # the reads already running end before the caller closes their files
        concurrent.futures.wait([future for _, future, _ in pending])


def one_by_one(keys: list[str]) -> list[list[str]]:
    """`Reader.stored_together` of a reader that reads each value on its own: by key, one to a group."""
    return [[k] for k in sorted(keys)]
