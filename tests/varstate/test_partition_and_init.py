"""SaveSliceInfo, PartitionedVariable, expand_variables, uninitialized/zero_initializer, global step."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import varstate
from varstate import IndexedSlices, PartitionedVariable, SaveSliceInfo


def test_save_slice_info_spec_round_trip():
    info = SaveSliceInfo("emb", (10, 4), (4, 0), (3, 4))
    assert info.spec == "10 4 4,3:0,4"
    assert SaveSliceInfo.from_spec("emb", info.spec) == info
    with pytest.raises(ValueError, match=r"Invalid slice spec '10 4 x' for 'emb': expected e.g. '10 4 0,4:0,4'"):
        SaveSliceInfo.from_spec("emb", "10 4 x")
    with pytest.raises(ValueError, match="rank mismatch"):
        SaveSliceInfo.from_spec("emb", "10 4 0,10")


def test_fixed_partitioning_puts_remainder_on_first_shards(reg):
    full = jnp.arange(22.0).reshape(11, 2)
    pv = PartitionedVariable(full, name="emb", num_shards=3, registry=reg)
    assert [v.shape for v in pv] == [(4, 2), (4, 2), (3, 2)]  # TF: 11 = 4 + 4 + 3
    assert [v.save_slice_info.spec for v in pv] == ["11 2 0,4:0,2", "11 2 4,4:0,2", "11 2 8,3:0,2"]
    assert [v.name for v in pv] == ["emb/part_0", "emb/part_1", "emb/part_2"]
    np.testing.assert_array_equal(pv.as_array(), full)
    assert (pv.name, pv.shape, pv.dtype, len(pv)) == ("emb", (11, 2), jnp.float32, 3)
    # More shards than rows: one row each.
    assert len(PartitionedVariable(jnp.zeros((2, 2)), name="small", num_shards=5, registry=reg)) == 2


def test_max_shard_bytes_partitioning(reg):
    pv = PartitionedVariable(jnp.zeros((10, 4)), name="m", max_shard_bytes=48, registry=reg)  # 3 rows a shard
    assert [v.shape[0] for v in pv] == [3, 3, 2, 2]
    assert all(v.size * 4 <= 48 for v in pv)


def test_partitioned_variable_is_a_pytree_and_assigns(reg):
    pv = PartitionedVariable(jnp.ones((5, 3)), name="p", num_shards=2, registry=reg)
    doubled = jax.jit(lambda p: jax.tree.map(lambda x: x * 2, p))(pv)
    assert isinstance(doubled, PartitionedVariable)
    assert [v.resource_id for v in doubled] == [v.resource_id for v in pv]
    np.testing.assert_array_equal(doubled.as_array(), 2 * np.ones((5, 3)))
    new = pv.assign(jnp.arange(15.0).reshape(5, 3))
    np.testing.assert_array_equal(new.as_array(), np.arange(15.0).reshape(5, 3))
    with pytest.raises(ValueError, match=r"'p'.assign: shape mismatch: the variable has shape \(5, 3\)"):
        pv.assign(jnp.ones((4, 3)))


def test_partitioned_variable_bad_input(reg):
    with pytest.raises(ValueError, match="give exactly one of num_shards, max_shard_bytes or partitioner"):
        PartitionedVariable(jnp.ones((4, 2)), name="x", registry=reg)
    with pytest.raises(ValueError, match="cannot partition a scalar"):
        PartitionedVariable(1.0, name="x", num_shards=2, registry=reg)
    with pytest.raises(TypeError, match="name must be a non-empty string"):
        PartitionedVariable(jnp.ones((4, 2)), name=None, num_shards=2, registry=reg)
    with pytest.raises(ValueError, match="num_shards must be a positive int, got 0"):
        varstate.fixed_size_partitioner(0)
    with pytest.raises(ValueError, match=r"partitioner returned \[2, 2\]; only axis 0 may be split"):
        PartitionedVariable(jnp.ones((4, 2)), name="x", partitioner=lambda s, d: [2, 2], registry=reg)


def test_expand_variables(reg):
    pv = PartitionedVariable(jnp.ones((4, 2)), name="p", num_shards=2, registry=reg)
    b = varstate.Variable(0.0, name="b", registry=reg)
    assert varstate.expand_variables(None) is None
    assert [v.name for v in varstate.expand_variables([b, pv])] == ["b", "p/part_0", "p/part_1"]


def test_uninitialized_and_zero_initializer_on_a_mesh_without_host_transfer(reg):
    mesh = Mesh(np.array(jax.devices()), ("x",))
    sharding = NamedSharding(mesh, PartitionSpec("x"))
    u = varstate.uninitialized((16, 4), jnp.bfloat16, name="big", sharding=sharding, registry=reg)
    assert not u.is_initialized and u.shape == (16, 4) and u.dtype == jnp.bfloat16 and u.sharding == sharding
    with jax.transfer_guard("disallow"):
        z = varstate.zero_initializer(u)
    assert z.resource_id == u.resource_id and z.sharding == sharding
    assert len(z.value.addressable_shards) == 8 and float(jnp.abs(z.value).sum()) == 0.0
    with pytest.raises(ValueError, match="zero_initializer: variable 'big' is already initialized"):
        varstate.zero_initializer(z)
    with pytest.raises(TypeError, match=r"zero_initializer: expected a varstate\.Variable, got ArrayImpl"):
        varstate.zero_initializer(jnp.zeros(2))
    with pytest.raises(ValueError, match=r"negative dimension in shape \(-1,\)"):
        varstate.uninitialized((-1,), jnp.float32)
    with pytest.raises(TypeError, match="shape must be a sequence of ints"):
        varstate.uninitialized(None, jnp.float32)


def test_uninitialized_variable_flows_through_eval_shape(reg):
    u = varstate.uninitialized((3,), jnp.float32, registry=reg)
    out = jax.eval_shape(lambda v: v.assign_add(jnp.ones(3)), varstate.zero_initializer(u))
    assert out.resource_id == u.resource_id and out.value.shape == (3,)


def test_global_step(reg):
    gs = varstate.get_or_create_global_step(reg)
    assert gs is varstate.get_or_create_global_step(reg)
    assert (gs.name, gs.trainable, gs.shape, int(gs)) == ("global_step", False, (), 0)
    assert jnp.issubdtype(gs.dtype, jnp.integer)
    assert gs.dtype == (jnp.int64 if jax.config.jax_enable_x64 else jnp.int32)
    varstate.assert_global_step(gs)
    varstate.assert_global_step(gs.assign_add(jnp.ones((), gs.dtype)))
    varstate.assert_global_step(np.int64(5))
    with pytest.raises(TypeError, match=r"global_step must be a Variable or an array, got str 'step'"):
        varstate.assert_global_step("step")
    with pytest.raises(TypeError, match="global_step must have an integer dtype, got float32"):
        varstate.assert_global_step(jnp.float32(1))
    with pytest.raises(TypeError, match=r"global_step must be a scalar, got shape \(2,\)"):
        varstate.assert_global_step(jnp.zeros(2, jnp.int32))


def test_indexed_slices(reg):
    s = IndexedSlices(jnp.ones((2, 3)), jnp.array([1, 1]), (3, 3))
    leaves, treedef = jax.tree.flatten(s)
    assert len(leaves) == 2 and jax.tree.unflatten(treedef, leaves).dense_shape == (3, 3)
    np.testing.assert_array_equal(s.to_dense(), [[0, 0, 0], [2, 2, 2], [0, 0, 0]])
    assert (s.dtype, s.shape) == (jnp.float32, (3, 3))
    assert jax.jit(lambda s: s)(s).dense_shape == (3, 3)
    with pytest.raises(ValueError, match="dense_shape is unknown"):
        IndexedSlices(jnp.ones((1, 2)), jnp.array([0])).to_dense()
    with pytest.raises(TypeError, match="dense_shape must be a sequence of ints or None"):
        IndexedSlices(jnp.ones((1, 2)), jnp.array([0]), "big")


def test_convert_to_tensor_or_indexed_slices(reg):
    conv = varstate.convert_to_tensor_or_indexed_slices
    s = IndexedSlices(jnp.ones((1, 2)), jnp.array([0]), (2, 2))
    assert conv(s) is s
    assert conv(varstate.Variable([1.0, 2.0], registry=reg)).tolist() == [1.0, 2.0]
    assert conv(np.arange(3), dtype=jnp.float32).dtype == jnp.float32
    with pytest.raises(ValueError, match="requested dtype int32 for IndexedSlices with dtype float32"):
        conv(s, dtype=jnp.int32)
    for bad, kind in (("text", "str"), (None, "NoneType"), ({"a": 1}, "dict"), (object(), "object")):
        with pytest.raises(TypeError, match=f"Cannot convert {kind}"):
            conv(bad)


def test_partitioned_variable_in_a_name_scope_names_the_full_variable_with_it(reg):
    # The shards get the scope (`scope/emb/part_0`); the full name in their SaveSliceInfo (what
    # TF's name-based checkpoints and restore_by_name key on) must be `scope/emb`, as in TF.
    with varstate.name_scope("scope"):
        pv = PartitionedVariable(jnp.zeros((4, 2)), name="emb", num_shards=2, registry=reg)
    assert [v.name for v in pv] == ["scope/emb/part_0", "scope/emb/part_1"]
    assert pv.name == "scope/emb"
    assert {v.save_slice_info.full_name for v in pv} == {"scope/emb"}


def test_indexed_slices_to_dense_drops_negative_indices():
    # TF densifies with unsorted_segment_sum, which drops negative ids; they must not wrap to the last row.
    s = IndexedSlices(jnp.array([1.0, 2.0]), jnp.array([-1, 0]), (3,))
    assert s.to_dense().tolist() == [2.0, 0.0, 0.0]
    assert jax.jit(IndexedSlices.to_dense)(s).tolist() == [2.0, 0.0, 0.0]


def test_partition_axis_may_be_negative(reg):
    # As in TF (a Python index into the partitions list): axis=-1 is the last axis.
    pv = PartitionedVariable(jnp.arange(8.0).reshape(2, 4), name="cols", num_shards=2, axis=-1, registry=reg)
    assert [v.shape for v in pv] == [(2, 2), (2, 2)]
    assert [v.save_slice_info.spec for v in pv] == ["2 4 0,2:0,2", "2 4 0,2:2,2"]
    np.testing.assert_array_equal(pv.as_array(), np.arange(8.0).reshape(2, 4))
    with pytest.raises(ValueError, match=r"PartitionedVariable 'x': axis 2 is out of range for shape \(2, 4\)"):
        PartitionedVariable(jnp.zeros((2, 4)), name="x", num_shards=2, axis=2, registry=reg)


def test_convert_to_tensor_or_indexed_slices_never_casts_a_tensor(reg):
    # TF: "Tensor conversion requested dtype int32 for Tensor with dtype float32" (ValueError) for a
    # tensor or variable; jnp.asarray truncated [1.5] to [1] silently.
    conv = varstate.convert_to_tensor_or_indexed_slices
    with pytest.raises(ValueError, match=r"conversion requested dtype int32 for Tensor with dtype float32 \(g\)"):
        conv(jnp.array([1.5]), dtype=jnp.int32, name="g")
    with pytest.raises(ValueError, match="requested dtype float16 for Tensor with dtype float32"):
        conv(varstate.Variable([1.5], registry=reg), dtype=jnp.float16)
    assert conv(jnp.array([1.5]), dtype=jnp.float32).tolist() == [1.5]


def test_variable_axis_size_partitioner_refuses_a_negative_max_shards():
    # TF: ValueError "max_shards must be positive"; a negative value silently gave one shard.
    with pytest.raises(ValueError, match=r"variable_axis_size_partitioner: max_shards must be positive, got -2"):
        varstate.variable_axis_size_partitioner(64, max_shards=-2)
    assert varstate.variable_axis_size_partitioner(64, max_shards=2)((10, 4), "float32") == [2, 1]


@pytest.mark.parametrize("num_shards, axis, shape, want", [
    (3, 0, (10, 4), [3, 1]),
    (3, 1, (10, 4), [1, 3]),
    (3, 0, (2, 5), [2, 1]),  # TF: min(num_shards, shape[axis])
    (1, 0, (7,), [1]),
    (4, 0, (7,), [4]),
    (8, 2, (2, 3, 8), [1, 1, 8]),
])
def test_fixed_size_partitioner_as_tf(num_shards, axis, shape, want):
    partitioner = varstate.fixed_size_partitioner(num_shards, axis)
    assert partitioner(shape, "float32") == want
    assert partitioner(shape, "int8") == want  # the dtype does not matter, as in TF


def test_fixed_size_partitioner_splits_the_rows_as_tf_and_refuses_a_non_positive_count(reg):
    value = jnp.arange(20.0).reshape(10, 2)
    pv = PartitionedVariable(value, name="p", partitioner=varstate.fixed_size_partitioner(3), registry=reg)
    # TF's split: the first 10 % 3 shards get one more row than the others
    assert [v.shape for v in pv.variables] == [(4, 2), (3, 2), (3, 2)]
    np.testing.assert_array_equal(np.concatenate([np.asarray(v.value) for v in pv.variables]), np.asarray(value))
    for bad in (-1, 2.0, "2", None):
        with pytest.raises(ValueError, match=re.escape(
                f"fixed_size_partitioner: num_shards must be a positive int, got {bad!r}.")):
            varstate.fixed_size_partitioner(bad)
