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


def test_damaged_journals_open_or_raise_the_librarys_error_naming_the_file(tmp_path):
    # A real journal (metrics of kept checkpoints, the best one chosen from them), then seeded damage: bytes
    # changed, cut off, duplicated. Opening the manager and asking for its steps, metrics and best step either
    # works or raises CheckpointFormatError naming the journal; nothing else may escape.
    import random

    import jax.numpy as jnp

    import varstate

    good = tmp_path / "good"
    manager = checkpoint.CheckpointManager(str(good), max_to_keep=2, best_fn=lambda m: m["loss"], best_mode="min")
    w = varstate.Variable(jnp.ones(2), name="w")
    for step, loss in ((1, 0.5), (2, 0.25), (3, 0.75)):
        manager.save(step, model=w, metrics={"loss": loss, "acc": 1 - loss})
    manager.close()
    original = (good / "checkpoint_manager.json").read_bytes()
    assert b'"metrics"' in original
    rng = random.Random(26)
    outcomes = {"opened": 0, "refused": 0}
    for i in range(300):
        data = bytearray(original)
        kind = i % 3
        if kind == 0:
            for _ in range(rng.randint(1, 3)):
                data[rng.randrange(len(data))] = rng.randrange(256)
        elif kind == 1:
            del data[rng.randrange(len(data)):]
        else:
            at = rng.randrange(len(data))
            data[at:at] = data[rng.randrange(len(data)):][:rng.randint(1, 40)]
        with open(_journal(good), "wb") as f:
            f.write(bytes(data))
        try:
            damaged = checkpoint.CheckpointManager(str(good), max_to_keep=2, best_fn=lambda m: m["loss"],
                                                   best_mode="min")
            damaged.all_steps(), damaged.best_step(), [damaged.metrics(s) for s in damaged.all_steps()]
            damaged.close()
            outcomes["opened"] += 1
        except CheckpointFormatError as e:
            assert _journal(good) in str(e), str(e)
            outcomes["refused"] += 1
    assert outcomes["refused"] > 100, outcomes  # most damage is seen, and a harmless change still opens
