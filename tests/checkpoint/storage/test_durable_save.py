"""Every file of a checkpoint is fsynced before the rename that publishes it, in both formats (issue 27, save)."""

import os

import jax.numpy as jnp
import numpy as np
import pytest

import checkpoint
from checkpoint._storage import _save


class Recorder:
    """Records, in order, each fsync (by the inode synced) and each rename (by its target) made from Python."""

    def __init__(self, monkeypatch):
        self.events = []
        fsync, rename, replace = os.fsync, os.rename, os.replace

        def synced(fd):
            self.events.append(("fsync", os.fstat(fd).st_ino))
            fsync(fd)

        def renamed(real):
            def move(src, dst, *args, **kwargs):
                self.events.append(("rename", os.path.abspath(os.fspath(dst))))
                real(src, dst, *args, **kwargs)
            return move

        monkeypatch.setattr(os, "fsync", synced)
        monkeypatch.setattr(os, "rename", renamed(rename))
        monkeypatch.setattr(os, "replace", renamed(replace))

    def unsynced_at_publish(self, path):
        """The files and directories of the checkpoint at `path` not fsynced before the first rename onto it."""
        published = {path, path + ".index", *(p for p in _files_of(path) if ".data-" in p)}
        at = next(i for i, e in enumerate(self.events) if e[0] == "rename" and e[1] in published)
        synced = {e[1] for e in self.events[:at] if e[0] == "fsync"}
        return sorted(p for p in _files_of(path) if os.stat(p).st_ino not in synced)


def _files_of(path):
    if os.path.isdir(path):
        return [os.path.join(root, n) for root, dirs, files in os.walk(path) for n in [*dirs, *files]] + [path]
    directory = os.path.dirname(path)
    return [os.path.join(directory, n) for n in os.listdir(directory)
            if os.path.join(directory, n).startswith(path + ".")]


def _roots(value):
    return {"model": {"big": jnp.full(300_000, value), "small": jnp.arange(5.0) + value}}


@pytest.mark.parametrize("fmt", ["orbax", "tf"])
def test_every_file_is_fsynced_before_the_rename_that_publishes_the_checkpoint(tmp_path, monkeypatch, fmt):
    recorder = Recorder(monkeypatch)
    path = checkpoint.Checkpoint(**_roots(1.0)).write(str(tmp_path / "c"), format=fmt)
    assert len(_files_of(path)) >= 2
    assert recorder.unsynced_at_publish(path) == []
    # Replacing it: the new files are synced before the one rename that puts them in place.
    recorder.events.clear()
    path = checkpoint.Checkpoint(**_roots(2.0)).write(path, format=fmt)
    assert recorder.unsynced_at_publish(path) == []
    assert checkpoint.read_checkpoint(path).get("model/big/.ATTRIBUTES/VARIABLE_VALUE")[0] == 2.0


@pytest.mark.parametrize("fmt", ["orbax", "tf"])
def test_an_async_manager_save_is_fsynced_before_it_is_published(tmp_path, monkeypatch, fmt):
    recorder = Recorder(monkeypatch)
    with checkpoint.CheckpointManager(str(tmp_path), async_save=True, format=fmt) as mgr:
        path = mgr.save(1, **_roots(3.0))
    assert recorder.unsynced_at_publish(path) == []
    np.testing.assert_array_equal(checkpoint.read_checkpoint(path).get("model/small/.ATTRIBUTES/VARIABLE_VALUE"),
                                  np.arange(5.0, dtype=np.float32) + 3)


def test_the_check_finds_the_files_orbax_leaves_unsynced(tmp_path, monkeypatch):
    # Without our sync of the whole tree, orbax's small files (tree metadata, commit markers) and the
    # directories reach the publish unsynced: the check above can fail.
    monkeypatch.setattr(_save, "sync_tree", lambda path: None)
    recorder = Recorder(monkeypatch)
    path = checkpoint.Checkpoint(**_roots(1.0)).write(str(tmp_path / "c"))
    unsynced = [os.path.relpath(p, path) for p in recorder.unsynced_at_publish(path)]
    assert "values/_METADATA" in unsynced and "." in unsynced
