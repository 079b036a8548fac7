"""The manager's journal `checkpoint_manager.json` is read as every other file: regular, bounded, our error."""

from __future__ import annotations

import os
import re

import pytest

import checkpoint
from checkpoint import CheckpointFormatError


def _journal(tmp_path) -> str:
    return os.path.join(tmp_path, "checkpoint_manager.json")


def test_a_fifo_in_place_of_the_journal_is_refused_not_waited_on(tmp_path):
    os.mkfifo(_journal(tmp_path))
    with pytest.raises(CheckpointFormatError, match=re.escape(_journal(tmp_path)) + r": the CheckpointManager journal "
                       r"is not a regular file \(it is a FIFO\)"):
        checkpoint.CheckpointManager(str(tmp_path))


def test_a_journal_of_invalid_utf8_names_the_file(tmp_path):
    with open(_journal(tmp_path), "wb") as f:
        f.write(b'{"format": "\xff\xfe"}')
    with pytest.raises(CheckpointFormatError, match=re.escape(_journal(tmp_path)) + r": not a CheckpointManager "
                       r"file \('utf-8' codec can't decode .*\)\. Delete it to forget the metrics"):
        checkpoint.CheckpointManager(str(tmp_path))


def test_a_deeply_nested_journal_names_the_file(tmp_path):
    with open(_journal(tmp_path), "w") as f:
        f.write("[" * 200_000 + "]" * 200_000)
    with pytest.raises(CheckpointFormatError, match=re.escape(_journal(tmp_path)) + r": not a CheckpointManager "
                       r"file \(it nests too deeply; a journal nests 3 levels\)"):
        checkpoint.CheckpointManager(str(tmp_path))


def test_a_journal_over_its_bound_is_refused_before_it_is_read(tmp_path, monkeypatch):
    monkeypatch.setattr("checkpoint._storage._journal._JOURNAL_LIMIT", 10)
    with open(_journal(tmp_path), "w") as f:
        f.write('{"format": "varstate-checkpoint-manager"}')
    with pytest.raises(CheckpointFormatError, match=re.escape(_journal(tmp_path)) + r": the CheckpointManager journal "
                       r"is 41 bytes, more than the 10 this reader accepts"):
        checkpoint.CheckpointManager(str(tmp_path))
