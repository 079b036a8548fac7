"""Per-shard checksums of sharded arrays (what a multi-process save writes, where no host holds a whole array)."""

import json
import os

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import checkpoint
from checkpoint._storage import _orbax

KEY = "w/.ATTRIBUTES/VARIABLE_VALUE"


def _save(tmp_path):
    mesh = Mesh(np.array(jax.devices()), ("x",))
    value = np.arange(512 * 512, dtype=np.float32).reshape(512, 512)  # 1 MB: its own array, not packed
    sharded = jax.device_put(value, NamedSharding(mesh, P("x", None)))
    path = checkpoint.Checkpoint(w=sharded).write(str(tmp_path / "c"))
    return path, value, NamedSharding(mesh, P("x", None))


def _edit(path, change):
    meta_path = os.path.join(path, _orbax.META_FILE)
    with open(meta_path) as f:
        meta = json.load(f)
    change(meta["entries"][KEY])
    with open(meta_path, "w") as f:
        json.dump(_orbax.seal(meta), f)


def test_sharded_arrays_carry_a_checksum_per_shard(tmp_path):
    path, value, sharding = _save(tmp_path)
    with open(os.path.join(path, _orbax.META_FILE)) as f:
        entry = json.load(f)["entries"][KEY]
    assert [s["box"] for s in entry["shards"]] == [[[64 * i, 64], [0, 512]] for i in range(8)]
    from checkpoint._storage._crc import crc32c

    assert [s["crc32c"] for s in entry["shards"]] == [crc32c(value[64 * i:64 * i + 64]) for i in range(8)]
    # As a multi-process save writes it (no whole-array checksum): read back and checked shard by shard.
    _edit(path, lambda e: e.pop("crc32c"))
    reader = checkpoint.read_checkpoint(path)
    np.testing.assert_array_equal(reader.get(KEY), value)
    np.testing.assert_array_equal(np.asarray(reader.get_into(KEY, sharding)), value)


def test_a_damaged_shard_is_named(tmp_path):
    path, _, sharding = _save(tmp_path)

    def damage(e):
        e.pop("crc32c")
        e["shards"][3]["crc32c"] ^= 1

    _edit(path, damage)
    with pytest.raises(checkpoint.DataLossError, match=r"checksum mismatch for 'w/\.ATTRIBUTES/VARIABLE_VALUE' in "
                                                       r"its shard at \[192, 0\] of shape \[64, 512\]"):
        checkpoint.read_checkpoint(path).get_into(KEY, sharding)


def test_shards_that_do_not_tile_the_array_are_refused(tmp_path):
    path, _, _ = _save(tmp_path)
    _edit(path, lambda e: e["shards"].pop())
    with pytest.raises(checkpoint.DataLossError, match=r"entry 'w/\.ATTRIBUTES/VARIABLE_VALUE': its shards overlap "
                                                       r"or do not cover shape \[512, 512\]"):
        checkpoint.read_checkpoint(path)
