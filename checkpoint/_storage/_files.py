"""File helpers every storage format shares: durable writes, bounded reads, the inside-the-directory guard."""

from __future__ import annotations

import errno
import os
from typing import IO

import numpy as np

from checkpoint._errors import CheckpointFormatError

ORBAX_METADATA = os.path.join("meta", "metadata")  # the orbax format's own metadata file; its presence marks one


def sync_file(f: IO) -> None:
    """Flushes and fsyncs `f`, tolerating filesystems that have no fsync."""
    # On disk before the rename that publishes it: after a power loss the checkpoint state file
    # (fsynced too) never names a checkpoint whose bytes were still in the page cache, when the
    # manager may already have deleted the one before it.
    f.flush()
    try:
        os.fsync(f.fileno())
    except OSError as e:
        if e.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP):
            raise  # EIO and the like: the bytes may not be on disk
        # A filesystem without fsync (some FUSE and network mounts): as durable as it can be.


def sync_directory(directory: str) -> None:
    """Makes the renames in `directory` durable (POSIX); a no-op where directories cannot be opened."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some filesystems refuse fsync on a directory; the data files are synced already
    finally:
        os.close(fd)


def pread(fd: int, size: int, offset: int, where: str) -> bytes:
    buf = np.empty(size, np.uint8)
    pread_into(fd, buf, offset, where)
    return buf.tobytes()


def pread_into(fd: int, buf: np.ndarray, offset: int, where: str) -> None:
    done = 0
    while done < buf.size:  # a single read can return less (e.g. over 2 GiB on Linux)
        n = os.preadv(fd, [buf[done:]], offset + done)
        if n <= 0:
            raise CheckpointFormatError(f"{where}: the file shrank while reading at offset {offset + done}")
        done += n


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
