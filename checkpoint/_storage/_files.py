"""File helpers every storage format shares: durable writes, bounded reads, the inside-the-directory guard."""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import shutil
import stat
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from checkpoint._errors import CheckpointFormatError

ORBAX_METADATA = os.path.join("meta", "metadata")  # the orbax format's own metadata file; its presence marks one
_SYNC_THREADS = 16  # fsyncs in flight at once (`sync_tree`)
_POOLS: dict[str, ThreadPoolExecutor] = {}
os.register_at_fork(after_in_child=_POOLS.clear)  # a forked child has none of its parent's threads


def shared_pool(name: str, workers: int) -> ThreadPoolExecutor:
    """The process's thread pool `name` (made on first use, kept): a save or restore of small values is a few
    milliseconds of work, and starting its threads anew each time cost as much on a busy machine."""
    pool = _POOLS.get(name)
    if pool is None:
        pool = _POOLS.setdefault(name, ThreadPoolExecutor(workers, thread_name_prefix=name))
    return pool


def sync_path(path: str) -> None:
    """Fsyncs the file (or directory) `path`, tolerating filesystems that have no fsync."""
    # On disk before the rename that publishes it: after a power loss the checkpoint state file
    # (fsynced too) never names a checkpoint whose bytes were still in the page cache, when the
    # manager may already have deleted the one before it.
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as e:
        if e.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP):
            raise  # EIO and the like: the bytes may not be on disk
        # A filesystem without fsync (some FUSE and network mounts): as durable as it can be.
    finally:
        os.close(fd)


@contextlib.contextmanager
def replacing(*paths: str, tempstate: bool = False) -> Iterator[list[str]]:
    """Temporary names beside `paths` for the body to write; then each is fsynced and renamed over its path.

    The renames go in order (the last file is the one that makes the whole
    readable: a TF index), then the directory is fsynced: a reader, even
    after a crash or a power loss, sees the old files or the new ones. If the
    body or a rename fails, the temporaries left are removed. The names are
    ``.<name>.tmp-<hex>``, or with `tempstate` ``<name>.tempstate<hex>`` as
    TF's bundle writer names its own; in a checkpoint directory the next
    save removes those a crash left of a bundle, the state file and the
    manager's journal (`_publish.clean`).
    """
    token = secrets.token_hex(8)
    temps = [f"{p}.tempstate{token}" if tempstate else
             os.path.join(os.path.dirname(p), f".{os.path.basename(p)}.tmp-{token}") for p in paths]
    try:
        yield temps
        for temp in temps:
            sync_path(temp)
        for temp, path in zip(temps, paths, strict=True):
            os.replace(temp, path)
        sync_directory(os.path.dirname(os.path.abspath(paths[-1])))
    finally:
        for temp in temps:
            if os.path.isdir(temp) and not os.path.islink(temp):
                shutil.rmtree(temp, ignore_errors=True)
            elif os.path.lexists(temp):
                os.remove(temp)


def sync_directory(directory: str) -> None:
    """Makes the renames in `directory` durable (POSIX); a no-op where directories cannot be opened or synced."""
    # Some filesystems refuse to open or fsync a directory; the data files are synced already.
    with contextlib.suppress(OSError):
        sync_path(directory)


def sync_tree(path: str) -> None:
    """Fsyncs every file and directory under the directory `path` (itself included), all at once.

    What makes an unpublished orbax-format checkpoint durable before the
    rename that publishes it: orbax and tensorstore fsync their data files
    but not all of their small ones (the tree metadata, the commit markers),
    nor the directories. A file synced already costs a system call, and the
    calls run in threads, so that the filesystem commits them together (one
    after another, each costs a journal commit). Files that vanish meanwhile
    (another process of a `jax.distributed` job renaming its own) are
    skipped. A TF prefix needs none of it: `write_bundle` syncs its files.
    """
    if not os.path.isdir(path) or os.path.islink(path):
        return
    paths = [os.path.join(root, name) for root, dirs, files in os.walk(path) for name in [*files, *dirs]]
    list(shared_pool("checkpoint-sync", _SYNC_THREADS).map(_sync_if_there, [*paths, path]))


def _sync_if_there(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        if os.path.isdir(path):
            sync_directory(path)
        else:
            sync_path(path)


def pread(fd: int, size: int, offset: int, where: str) -> bytes:
    buf = np.empty(size, np.uint8)
    pread_into(fd, buf, offset, where)
    return buf.tobytes()


_IOV_MAX = 1024  # buffers one vectored read or write takes (Linux's limit)


def vectored(buffers: list[Any], call: Callable[[list[Any]], int]) -> None:
    """Moves every byte of `buffers` (1-D uint8 arrays or byte memoryviews) with `call`, a vectored read or write
    of up to 1,024 of them that returns the bytes it moved: a call can move fewer (e.g. over 2 GiB on Linux, or
    when a signal arrives), even stopping inside a buffer, and the next goes on from there."""
    pending = [b for b in buffers if b.nbytes]
    first = 0
    while first < len(pending):
        n = call(pending[first:first + _IOV_MAX])
        while n and first < len(pending):  # the buffers moved whole, and the rest of one moved in part
            if n >= pending[first].nbytes:
                n -= pending[first].nbytes
                first += 1
            else:
                pending[first], n = pending[first][n:], 0


def pread_into(fd: int, buf: np.ndarray | list[np.ndarray], offset: int, where: str) -> None:
    """Fills `buf`, a uint8 array or a list of them stored back to back, with the bytes of `fd` from `offset`
    (a list: each in its own buffer, with one system call per 1,024 of them)."""

    def read(part: list[np.ndarray]) -> int:
        nonlocal offset
        n = os.preadv(fd, part, offset)  # type: ignore[arg-type]  # ndarray __buffer__: 3.12 stubs
        if n <= 0:
            raise CheckpointFormatError(f"{where}: the file shrank while reading at offset {offset}")
        offset += n
        return n

    vectored([buf] if isinstance(buf, np.ndarray) else buf, read)


def inside(directory: str, path: str, where: str) -> str:
    """`path` (read from a file in `directory`) as a path inside `directory`; never outside it."""
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


def open_regular(path: str, what: str) -> tuple[int, int]:
    """(fd, size) of the regular file `path`; CheckpointFormatError naming it for anything else.

    Opened without blocking, so a FIFO put in a checkpoint's place cannot hang
    the reader, and checked on the open descriptor, so a device (a link to
    /dev/zero, endless) is refused before a byte is read. FileNotFoundError
    passes through: callers say what was expected.
    """
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_BINARY", 0) | getattr(os, "O_CLOEXEC", 0))
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise CheckpointFormatError(
                f"{path}: {what} is not a regular file (it is {_kind(st.st_mode)}); a checkpoint's files must be "
                "plain files"
            )
    except BaseException:
        os.close(fd)
        raise
    return fd, st.st_size


def read_regular(path: str, limit: int, what: str) -> bytes:
    """The whole of the regular file `path`, refused (CheckpointFormatError naming it) past `limit` bytes."""
    fd, size = open_regular(path, what)
    try:
        if size > limit:
            raise CheckpointFormatError(
                f"{path}: {what} is {size} bytes, more than the {limit} this reader accepts; it is not one this "
                "library wrote"
            )
        return pread(fd, size, 0, path)
    finally:
        os.close(fd)


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "not a file"


def within(root: str, path: str) -> None:
    """Refuses `path` (a checkpoint's file or directory) if it resolves outside `root`, the checkpoint's directory.

    One rule for both formats: a checkpoint is the files in its directory, so
    a symlink out of it (to another user's file, or to a device) is refused,
    as `inside` refuses a state file naming a path outside. Links within the
    directory are followed.
    """
    real_root = os.path.realpath(root)
    target = os.path.realpath(path)
    if target != real_root and os.path.commonpath([real_root, target]) != real_root:
        raise CheckpointFormatError(
            f"{path}: a symlink to {target}, outside the checkpoint's directory {real_root}; a checkpoint may "
            "only use files in its own directory. Copy the file into it instead of linking."
        )


def stored_bytes(directory: str, root: str) -> int:
    """Bytes in the regular files under `directory` (links checked with `within` first); 0 if it is absent.

    Anything else there (a FIFO, a device) is refused: the storage library
    would block on it or read it without end.
    """
    if not os.path.lexists(directory):
        return 0
    within(root, directory)
    if not os.path.isdir(directory):
        raise CheckpointFormatError(f"{directory}: not a directory; the checkpoint is damaged")
    total, seen, todo = 0, set(), [directory]
    while todo:
        here = todo.pop()
        real = os.path.realpath(here)
        if real in seen:  # two links to one directory (or a loop): counted once
            continue
        seen.add(real)
        with os.scandir(here) as entries:
            for entry in entries:
                if entry.is_symlink():
                    within(root, entry.path)
                try:
                    st = os.stat(entry.path)
                except FileNotFoundError:
                    raise CheckpointFormatError(f"{entry.path}: a symlink to nothing; the checkpoint is incomplete") \
                        from None
                if stat.S_ISDIR(st.st_mode):
                    todo.append(entry.path)
                elif stat.S_ISREG(st.st_mode):
                    total += st.st_size
                else:
                    raise CheckpointFormatError(
                        f"{entry.path}: is {_kind(st.st_mode)}, not a regular file; a checkpoint's files must be "
                        "plain files"
                    )
    return total
