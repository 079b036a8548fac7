"""Putting a written checkpoint in place without a moment that lacks a complete one; removing what dead saves left.

Every save writes its checkpoint under a temporary name beside the target,
``<path>.varstate-new-<token>``, and `publish` moves it in once it is
complete. Over an existing checkpoint a plain rename cannot do it: a
directory cannot be renamed over a non-empty one, and a TF checkpoint is two
files. So the old checkpoint first gets a stand-in, ``<path>.varstate-standin-
<token>``, made of hard links (no bytes copied), which the ``checkpoint``
state file names in its place while the old one goes and the new one is
renamed in; then the state file names the path again and the stand-in goes.
At every instant the state file's latest checkpoint is complete. A save that
is killed midway leaves a stand-in that the next save resolves: the path if it
holds a complete checkpoint, else the stand-in moved back.

Each step of the swap is one small function here (`link_stand_in`,
`point_state`, `retire`, `move_into_place`, `remove`, `delete_tree`):
the crash tests kill a process inside each.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import re
import secrets
import shutil
import time
from collections.abc import Callable

from checkpoint import _storage
from checkpoint._errors import CheckpointFormatError
from checkpoint._storage import ORBAX_METADATA, STATE_FILE
from checkpoint._storage._files import sync_directory, sync_path

try:
    import fcntl
except ImportError:  # no flock (Windows): leftovers are judged by age alone
    fcntl = None  # type: ignore[assignment]  # the module or None: callers test it

_log = logging.getLogger("checkpoint")

MANAGER_FILE = "checkpoint_manager.json"  # CheckpointManager's metrics and saves in flight, beside the state file
# Where the save lock cannot be taken (see `begin`), a temporary is taken for a dead save's only
# once nothing in it has changed for this long: a live save keeps writing files.
STALE_AFTER_S = 3600.0

_TEMP = re.compile(
    r"(?P<path>.+)\.varstate-(?P<kind>new|old|standin)-(?P<token>[0-9a-f]{16})(?P<part>\.index|\.data-\d{5}-of-\d{5})?"
)
_DATA = re.compile(r"(?P<prefix>.+)\.data-\d{5}-of-\d{5}")
_TEMPSTATE = re.compile(r"\.tempstate[0-9a-fA-F]+$")  # write_bundle's (and TF's) file being written
_ORBAX_TMP = ".orbax-checkpoint-tmp"  # orbax's directory being written: "<name>.orbax-checkpoint-tmp[-<time>]"
_WRITE_TEMPS = (f".{STATE_FILE}.tmp-", f".{MANAGER_FILE}.tmp-")  # files written beside and renamed over


def temporary(path: str, kind: str) -> str:
    """A fresh temporary name beside `path`: kind "new" (being written), "standin" or "old" (being deleted)."""
    return f"{path}.varstate-{kind}-{secrets.token_hex(8)}"


def exists(path: str) -> bool:
    """A complete checkpoint is at `path`: an orbax directory with its metadata, or a TF prefix with its index."""
    return _storage.is_orbax(path) or os.path.isfile(path + ".index")


def resolved(path: str) -> str:
    """`path`, or for a stand-in (a swap in progress, or killed) the path it stands for once that is complete."""
    m = _TEMP.fullmatch(os.path.basename(path))
    if m and m["kind"] == "standin" and not m["part"]:
        target = os.path.join(os.path.dirname(path), m["path"])
        if exists(target):
            return target
    return path


def data_files(prefix: str) -> list[str]:
    """The ``<prefix>.data-NNNNN-of-NNNNN`` files that exist."""
    directory, base = os.path.split(prefix)
    try:
        names = os.listdir(directory or ".")
    except FileNotFoundError:
        return []
    pattern = re.compile(re.escape(base) + r"\.data-\d{5}-of-\d{5}")
    return sorted(os.path.join(directory, n) for n in names if pattern.fullmatch(n))


def check_replaceable(path: str, format: str, where: str) -> None:
    """Refuses a target that a save would have to delete although it is no checkpoint (a user's directory)."""
    if format != "orbax" or not os.path.lexists(path):
        return
    if not os.path.isdir(path):
        raise ValueError(
            f"{where}: {path} exists and is not a directory, so an orbax checkpoint cannot be written there. "
            "Remove it, choose another path, or save with format='tf'."
        )
    if not _storage.is_orbax(path) and os.listdir(path):
        raise ValueError(
            f"{where}: {path} is a directory that is not a checkpoint (it has no {ORBAX_METADATA}); refusing to "
            "replace it. Remove it or choose another path."
        )


# ---------------------------------------------------------------------------
# the swap
# ---------------------------------------------------------------------------
def publish(temp: str, path: str) -> None:
    """Moves the complete checkpoint `temp` to `path`, over the checkpoint there if any (see the module docstring)."""
    directory = os.path.dirname(path)
    if not exists(path):
        for f in data_files(path):  # the data of a TF checkpoint whose deletion was cut short
            os.remove(f)
        move_into_place(temp, path)
        return
    stand_in = temporary(path, "standin")
    try:
        link_stand_in(path, stand_in)
        named = point_state(directory, path, stand_in)
    except BaseException:
        remove(stand_in)
        raise
    retire(path)
    move_into_place(temp, path)
    if named:
        point_state(directory, stand_in, path)
    remove(stand_in)


def _link(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except (FileNotFoundError, FileExistsError):
        raise
    except OSError:  # no hard links here (some FUSE and network filesystems): a real copy, synced
        with open(src, "rb") as fin, open(dst, "wb") as fout:
            shutil.copyfileobj(fin, fout, 1 << 20)
        sync_path(dst)


def link_stand_in(path: str, stand_in: str) -> None:
    """Makes `stand_in` a second name for the checkpoint at `path` (hard links; the marker file last)."""
    if _storage.is_orbax(path):
        marker = os.path.join(path, ORBAX_METADATA)
        made = []
        for root, _, files in os.walk(path):
            target = os.path.join(stand_in, os.path.relpath(root, path))
            os.makedirs(target, exist_ok=True)
            made.append(target)
            for name in files:
                if os.path.join(root, name) != marker:
                    _link(os.path.join(root, name), os.path.join(target, name))
        _link(marker, os.path.join(stand_in, ORBAX_METADATA))  # only now is the stand-in a checkpoint
        for d in reversed(made):
            sync_directory(d)
    if os.path.isfile(path + ".index"):
        for data in data_files(path):
            _link(data, stand_in + data[len(path):])
        _link(path + ".index", stand_in + ".index")  # the index last: it is what makes a TF checkpoint
    sync_directory(os.path.dirname(stand_in))


def point_state(directory: str, old: str, new: str) -> bool:
    """Rewrites the directory's ``checkpoint`` state file to name `new` wherever it names `old`; True if it did."""
    state = _storage.read_checkpoint_state(directory)
    if state is None or not state.model_checkpoint_path:
        return False
    where = os.path.join(directory, STATE_FILE)
    old = os.path.abspath(old)

    def swapped(entry: str) -> str:
        try:
            resolved = _storage.inside(directory, entry, where)
        except CheckpointFormatError:  # outside the directory: never ours to rename
            return entry
        return new if os.path.abspath(resolved) == old else entry

    latest = swapped(state.model_checkpoint_path)
    paths = [swapped(p) for p in state.all_model_checkpoint_paths]
    if latest == state.model_checkpoint_path and paths == list(state.all_model_checkpoint_paths):
        return False
    stamps = list(state.all_model_checkpoint_timestamps)
    if len(stamps) != len(paths) or not paths or paths[-1] != latest:
        stamps = []  # not in the shape TF writes: dropped rather than misattributed
    _storage.write_checkpoint_state(directory, latest, paths, stamps, state.last_preserved_timestamp)
    return True


def retire(path: str) -> None:
    """Unpublishes the checkpoint at `path` in one step (a rename, or the removal of the index), then deletes it."""
    directory = os.path.dirname(path)
    if _storage.is_orbax(path):
        junk = temporary(path, "old")
        os.rename(path, junk)
        sync_directory(directory)
        delete_tree(junk)
    if os.path.isfile(path + ".index"):
        os.remove(path + ".index")  # from here the data files are garbage, removed now or by the next save
        sync_directory(directory)
        for data in data_files(path):
            os.remove(data)


def move_into_place(src: str, dst: str) -> None:
    """Renames the complete checkpoint `src` to `dst` (a TF checkpoint's index last, so it appears complete)."""
    if os.path.isdir(src):
        os.rename(src, dst)
    if os.path.isfile(src + ".index"):
        for data in data_files(src):
            os.replace(data, dst + data[len(src):])
        os.replace(src + ".index", dst + ".index")
    sync_directory(os.path.dirname(dst))


def remove(path: str) -> None:
    """Deletes whatever an unpublished checkpoint (a temporary, a stand-in) has at `path`."""
    for directory in (path, path + _ORBAX_TMP):
        if os.path.isdir(directory):
            delete_tree(directory)
    for f in [path + ".index", *data_files(path)]:
        with contextlib.suppress(FileNotFoundError):
            os.remove(f)


def delete_tree(path: str) -> None:
    """Deletes an unpublished directory; what a crash leaves of it is a leftover the next save removes."""
    shutil.rmtree(path, ignore_errors=True)


# ---------------------------------------------------------------------------
# the save lock and the leftovers
# ---------------------------------------------------------------------------
def _flock(fd: int, operation: int) -> None:
    fcntl.flock(fd, operation)


class SaveLock:
    """Marks a save in progress in a directory: a shared flock on the directory itself, until `release`."""

    def __init__(self, directory: str) -> None:
        self.fd = os.open(directory, os.O_RDONLY)

    def release(self) -> None:
        if self.fd >= 0:
            fd, self.fd = self.fd, -1
            os.close(fd)  # closing drops the lock


def begin(directory: str, then: Callable[[float], None] | None = None) -> SaveLock:
    """Starts a save in `directory`: removes the leftovers of saves that died, and holds the lock until `release`.

    `then(older_than)` runs where the leftovers are removed, to remove more
    of them: those at least `older_than` seconds old (0: all).

    How a temporary is known to be stale: every save holds a shared flock on
    the checkpoint directory from before it creates its first temporary until
    its last one is gone (an asynchronous save: until its commit). A save that
    gets the lock exclusively knows that no other save, in this process or any
    other, is in progress there, so every temporary in it belongs to a save
    that died: the kernel drops a process's locks when it exits, SIGKILL
    included. When the lock is busy the leftovers stay for a later save. A pid
    and host name in a lock file would be wrong after a pid is reused and
    cannot be checked from another host; an age alone cannot tell a slow save
    from a dead one. Where the filesystem has no flock (some network mounts),
    only temporaries unchanged for `STALE_AFTER_S` are taken for stale.
    """
    os.makedirs(directory, exist_ok=True)
    lock = SaveLock(directory)
    try:
        if fcntl is None:
            older_than = STALE_AFTER_S
        else:
            try:
                _flock(lock.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                older_than = 0.0
            except BlockingIOError:  # another save is in progress here: its temporaries are alive
                _flock(lock.fd, fcntl.LOCK_SH)
                return lock
            except OSError:  # this filesystem has no flock
                older_than = STALE_AFTER_S
        clean(directory, older_than)
        if then is not None:
            then(older_than)
        if older_than == 0.0:
            # Converting is not atomic: another save may clean in between, before this one has a temporary.
            _flock(lock.fd, fcntl.LOCK_SH)
    except BaseException:
        lock.release()
        raise
    return lock


def _newest_change(paths: list[str]) -> float:
    inside = [os.path.join(root, n) for p in paths if os.path.isdir(p) and not os.path.islink(p)
              for root, dirs, files in os.walk(p) for n in dirs + files]
    return max(map(_changed, paths + inside), default=0.0)


def _changed(path: str) -> float:
    try:
        return os.lstat(path).st_mtime
    except OSError:  # gone meanwhile
        return 0.0


def clean(directory: str, older_than: float) -> None:
    """Resolves the stand-ins and removes the temporaries that saves left in `directory` (best effort)."""
    try:
        names = os.listdir(directory)
    except OSError:
        return
    now = time.time()

    def stale(paths: list[str]) -> bool:
        return older_than <= 0 or now - _newest_change(paths) >= older_than

    temps: dict[str, tuple[str, str]] = {}  # temporary -> (its kind, the path it is for)
    for m in filter(None, map(_TEMP.fullmatch, names)):
        temps[os.path.join(directory, f"{m['path']}.varstate-{m['kind']}-{m['token']}")] = (m["kind"], m["path"])
    for temp, (kind, path) in sorted(temps.items(), key=lambda kv: kv[1][0] != "standin"):  # stand-ins first
        if not stale([temp, temp + ".index", *data_files(temp), temp + _ORBAX_TMP]):
            continue
        try:
            if kind == "standin":
                path = os.path.join(directory, path)
                # The swap stopped after the old checkpoint went and before the new one came: the old one returns.
                if not exists(path) and exists(temp):
                    move_into_place(temp, path)
                if exists(path):
                    point_state(directory, temp, path)
            remove(temp)
        except OSError as e:
            _log.warning("Could not remove %s, left by a save that did not finish: %s", temp, e)
    for name in os.listdir(directory):
        target = os.path.join(directory, name)
        data = _DATA.fullmatch(name)
        leftover = (
            _TEMPSTATE.search(name)
            or name.startswith(_WRITE_TEMPS)
            or (data and not os.path.exists(os.path.join(directory, data["prefix"]) + ".index"))
            or (_ORBAX_TMP in name and os.path.isdir(target) and _orbax_temporary(target))
        )
        if not leftover or not stale([target]):
            continue
        try:
            if os.path.isdir(target) and not os.path.islink(target):
                delete_tree(target)
            else:
                os.remove(target)
        except OSError as e:
            if e.errno != errno.ENOENT:
                _log.warning("Could not remove %s, left by a save that did not finish: %s", target, e)


def _orbax_temporary(path: str) -> bool:
    from checkpoint._storage import _orbax  # imports orbax: only when something looks like its temporary

    return _orbax.is_temporary(path)
