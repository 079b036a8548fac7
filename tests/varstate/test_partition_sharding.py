"""PartitionedVariable(sharding=...): every shard placed on the given sharding (a mesh of many devices)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import varstate


def test_each_shard_is_placed_on_the_sharding():
    mesh = Mesh(np.array(jax.devices()), ("x",))
    rows = NamedSharding(mesh, P("x", None))
    value = jnp.arange(32.0).reshape(16, 2)
    pv = varstate.PartitionedVariable(value, name="emb", num_shards=2, sharding=rows, registry=varstate.Registry())
    assert [v.value.sharding for v in pv] == [rows, rows]
    assert [len(v.value.addressable_shards) for v in pv] == [8, 8]
    np.testing.assert_array_equal(np.asarray(pv.as_array()), np.asarray(value))
    assert [v.save_slice_info.spec for v in pv] == ["16 2 0,8:0,2", "16 2 8,8:0,2"]


def test_sharding_must_be_a_jax_sharding():
    with pytest.raises(TypeError, match=r"PartitionedVariable 'emb': sharding must be a jax.sharding.Sharding "
                                        r"\(each shard is placed on it\), got P\."):
        varstate.PartitionedVariable(jnp.zeros((4, 2)), name="emb", num_shards=2, sharding=P("x"),
                                     registry=varstate.Registry())
