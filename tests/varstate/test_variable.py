"""Variable: pytree identity, values, new versions, operators and bad input."""

import itertools
import operator

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import varstate
from varstate import IndexedSlices, Registry, Variable, VariableAggregation, VariableSynchronization


def test_pytree_has_value_as_only_child_and_handle_as_static(reg):
    v = Variable(jnp.arange(3.0), name="w", registry=reg)
    leaves, treedef = jax.tree.flatten(v)
    assert len(leaves) == 1 and leaves[0] is v.value
    v2 = jax.tree.unflatten(treedef, [jnp.zeros(3)])
    assert isinstance(v2, Variable) and v2.resource_id == v.resource_id and v2.handle is v.handle
    assert v2.name == "w" and v2.value.tolist() == [0.0, 0.0, 0.0]
    # The key path names the value, so tree_flatten_with_path users see `.value`.
    (path, _), = jax.tree_util.tree_flatten_with_path(v)[0]
    assert jax.tree_util.keystr(path) == ".value"


def test_unflatten_touches_no_registry(reg):
    v = Variable(1.0, registry=reg)
    treedef = jax.tree.structure(v)
    before = len(reg)
    copies = [jax.tree.unflatten(treedef, [jnp.float32(i)]) for i in range(100)]
    assert len(reg) == before and all(c.resource_id == v.resource_id for c in copies)


def test_identity_survives_transformations(reg):
    params = {"w": Variable(jnp.ones(3), name="w", registry=reg), "b": Variable(0.5, name="b", registry=reg)}
    ids = {k: v.resource_id for k, v in params.items()}

    out = jax.jit(lambda p: {k: v.assign_add(jnp.ones_like(v.value)) for k, v in p.items()})(params)
    assert {k: v.resource_id for k, v in out.items()} == ids
    assert out["w"].value.tolist() == [2.0, 2.0, 2.0]

    grads = jax.grad(lambda p: jnp.sum(p["w"].value * p["b"].value))(params)
    assert isinstance(grads["w"], Variable) and grads["w"].resource_id == ids["w"]
    np.testing.assert_allclose(grads["w"].value, [0.5, 0.5, 0.5])
    np.testing.assert_allclose(grads["b"].value, 3.0)

    batched = Variable(jnp.arange(6.0).reshape(2, 3), name="batched", registry=reg)
    vm = jax.vmap(lambda v: v.assign(v.value * 2))(batched)
    assert vm.resource_id == batched.resource_id and vm.value.tolist() == [[0, 2, 4], [6, 8, 10]]

    mapped = jax.tree.map(lambda x: x + 1, params)
    assert {k: v.resource_id for k, v in mapped.items()} == ids


def test_jit_cache_hit_for_new_versions(reg, compiles):
    v = Variable(jnp.zeros(2), registry=reg)
    f = jax.jit(lambda v: v.assign_add(jnp.ones(2)))
    for _ in range(3):
        v = f(v)
    assert compiles("<lambda>") == 1
    assert v.value.tolist() == [3.0, 3.0]


def test_resource_ids_unique_across_registries():
    a, b = Registry(), Registry()
    ids = [Variable(0.0, registry=r).resource_id for r in (a, b, a, b)]
    assert len(set(ids)) == 4


def test_creating_inside_a_transformation_raises(reg):
    msg = "created inside a JAX transformation"
    with pytest.raises(ValueError, match=msg):
        jax.jit(lambda x: Variable(x, registry=reg).value)(1.0)
    with pytest.raises(ValueError, match=msg):
        jax.grad(lambda x: Variable(x, registry=reg).value)(1.0)
    with pytest.raises(ValueError, match=msg):
        jax.vmap(lambda x: Variable(2.0, name="inner", registry=reg).value + x)(jnp.ones(2))
    assert len(reg) == 0


def test_properties(reg):
    v = Variable([[1, 2], [3, 4]], name="k", dtype=jnp.float32, trainable=False, registry=reg)
    assert (v.shape, v.dtype, v.ndim, v.size, v.trainable) == ((2, 2), jnp.float32, 2, 4, False)
    assert v.synchronization is VariableSynchronization.AUTO
    assert v.aggregation is VariableAggregation.NONE
    assert v.is_initialized and v.save_slice_info is None
    assert v.sharding == v.value.sharding
    assert v.read_value() is v.value
    assert varstate.is_resource_variable(v) and not varstate.is_resource_variable(v.value)


def test_callable_initial_value_and_enum_strings(reg):
    v = Variable(lambda: jnp.ones(2), synchronization="ON_WRITE", aggregation="mean", registry=reg)
    assert v.value.tolist() == [1.0, 1.0]
    assert v.synchronization is VariableSynchronization.ON_WRITE and v.aggregation is VariableAggregation.MEAN


def test_on_read_defaults_to_non_trainable_and_rejects_trainable(reg):
    assert not Variable(0.0, synchronization="ON_READ", registry=reg).trainable
    with pytest.raises(ValueError, match=r"'acc': synchronization ON_READ is only allowed for non-trainable"):
        Variable(0.0, name="acc", synchronization="ON_READ", trainable=True, registry=reg)


def test_assign_family_returns_new_versions(reg):
    v = Variable(jnp.array([1.0, 2.0]), name="x", registry=reg)
    a = v.assign([5.0, 6.0])
    b = a.assign_add(jnp.array([1.0, 1.0]))
    c = b.assign_sub(0.5 * jnp.ones(2))
    assert v.value.tolist() == [1.0, 2.0]
    assert (a.value.tolist(), b.value.tolist(), c.value.tolist()) == ([5, 6], [6, 7], [5.5, 6.5])
    assert {x.resource_id for x in (v, a, b, c)} == {v.resource_id}
    assert v.assign(Variable(jnp.zeros(2), registry=reg)).value.tolist() == [0.0, 0.0]


def test_scatter_ops_match_dense_reference(reg):
    v = Variable(jnp.arange(8.0).reshape(4, 2), name="t", registry=reg)
    s = IndexedSlices(jnp.ones((3, 2)), jnp.array([0, 2, 0]), (4, 2))
    ref = np.arange(8.0).reshape(4, 2)
    added = ref.copy()
    np.add.at(added, [0, 2, 0], 1.0)
    np.testing.assert_array_equal(v.scatter_add(s).value, added)
    subbed = ref.copy()
    np.add.at(subbed, [0, 2, 0], -1.0)
    np.testing.assert_array_equal(v.scatter_sub(s).value, subbed)
    upd = v.scatter_update(IndexedSlices(jnp.full((2, 2), 9.0), jnp.array([1, 3]), (4, 2)))
    np.testing.assert_array_equal(upd.value, [[0, 1], [9, 9], [4, 5], [9, 9]])
    jitted = jax.jit(lambda v, s: v.scatter_add(s))(v, s)
    np.testing.assert_array_equal(jitted.value, added)


def test_operators_and_array_protocol(reg):
    v = Variable(jnp.array([1.0, 2.0, 3.0]), registry=reg)
    x = np.array([2.0, 2.0, 2.0])
    for op in (operator.add, operator.sub, operator.mul, operator.truediv, operator.pow,
               operator.lt, operator.ge, operator.eq, operator.ne):
        np.testing.assert_array_equal(op(v, x), op(np.array([1.0, 2.0, 3.0]), x))
        # Either side, the arithmetic is the variable's (float32), as with a jax.Array or a TF variable.
        np.testing.assert_array_equal(op(x, v), op(x.astype(np.float32), np.array([1.0, 2.0, 3.0], np.float32)))
    np.testing.assert_array_equal(-v, [-1.0, -2.0, -3.0])
    assert float(v @ x) == 12.0
    assert v[1].item() == 2.0 and len(v) == 3
    assert np.asarray(v).tolist() == [1.0, 2.0, 3.0]
    assert float(Variable(2.5, registry=reg)) == 2.5 and int(Variable(3, registry=reg)) == 3
    with pytest.raises(TypeError, match="unhashable"):
        hash(v)
    assert {v.ref(): 1}[v.assign_add(jnp.ones(3)).ref()] == 1


def test_repr(reg):
    assert repr(Variable(jnp.array([1.0, 2.0]), name="w", registry=reg)) == (
        "<varstate.Variable 'w' shape=(2,) dtype=float32, numpy=[1. 2.]>"
    )
    u = varstate.uninitialized((3,), jnp.int32, name="u", registry=reg)
    assert repr(u) == "<varstate.Variable 'u' shape=(3,) dtype=int32 (uninitialized)>"


def test_sharded_variable_keeps_sharding_through_assign_and_jit(reg):
    mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("data", "model"))
    sharding = NamedSharding(mesh, PartitionSpec("data", "model"))
    v = Variable(jax.device_put(jnp.arange(32.0).reshape(8, 4), sharding), name="s", registry=reg)
    assert v.sharding == sharding
    # A host value assigned to a sharded variable is placed on its shards.
    a = v.assign(np.ones((8, 4), np.float32))
    assert a.sharding == sharding
    j = jax.jit(lambda v: v.assign_add(jnp.ones((8, 4))))(v)
    assert j.sharding.is_equivalent_to(sharding, 2) and j.resource_id == v.resource_id
    assert "resource" in varstate.format_device(j) and "NamedSharding" in varstate.format_device(j)


def test_format_device(reg):
    v = Variable(1.0, registry=reg)
    assert varstate.format_device(v) == f"{jax.devices()[0]} (resource)"
    assert varstate.format_device(varstate.uninitialized((2,), jnp.float32, registry=reg)) == "(resource)"


# --- bad input -------------------------------------------------------------

def test_assign_shape_mismatch_names_variable_and_shapes(reg):
    v = Variable(jnp.zeros((2, 3)), name="kernel", registry=reg)
    with pytest.raises(ValueError, match=r"'kernel'.assign: shape mismatch: the variable has shape \(2, 3\), "
                                         r"the value has shape \(3, 2\)"):
        v.assign(jnp.zeros((3, 2)))
    with pytest.raises(ValueError, match=r"'kernel'.assign_add: shape mismatch"):
        v.assign_add(jnp.zeros((4,)))


def test_assign_dtype_mismatch_names_both_dtypes(reg):
    v = Variable(jnp.zeros(2), name="kernel", registry=reg)
    with pytest.raises(TypeError, match=r"'kernel'.assign: dtype mismatch: the variable is float32, "
                                        r"the value is int32. Cast it first"):
        v.assign(jnp.zeros(2, jnp.int32))
    with pytest.raises(TypeError, match=r"'kernel'.assign: expected an array, got str"):
        v.assign("zeros")


def test_scatter_bad_input(reg):
    v = Variable(jnp.zeros((4, 2)), name="emb", registry=reg)
    with pytest.raises(IndexError, match=r"'emb'.scatter_add: index 4 is out of range for a first dimension "
                                         r"of size 4 \(valid: 0..3\)"):
        v.scatter_add(IndexedSlices(jnp.ones((1, 2)), jnp.array([4])))
    with pytest.raises(IndexError, match="index -1 is out of range"):
        v.scatter_update(IndexedSlices(jnp.ones((1, 2)), jnp.array([-1])))
    with pytest.raises(TypeError, match=r"sparse_delta must be IndexedSlices, got ArrayImpl"):
        v.scatter_sub(jnp.ones((4, 2)))
    with pytest.raises(ValueError, match=r"updates have shape \(2, 3\), expected \(2, 2\)"):
        v.scatter_add(IndexedSlices(jnp.ones((2, 3)), jnp.array([0, 1])))
    with pytest.raises(TypeError, match="indices must be integers, got float32"):
        v.scatter_add(IndexedSlices(jnp.ones((1, 2)), jnp.array([0.0])))
    with pytest.raises(TypeError, match="the variable is float32, the updates are int32"):
        v.scatter_add(IndexedSlices(jnp.ones((1, 2), jnp.int32), jnp.array([0])))


@pytest.mark.parametrize("value, kind", [("abc", "str"), ({"a": 1}, "dict"), (object(), "object"), (None, "NoneType")])
def test_non_array_initial_value(reg, value, kind):
    with pytest.raises(TypeError, match=rf"initial_value: expected an array, a Python number .* got {kind}"):
        Variable(value, registry=reg)


def test_bad_names_and_enums(reg):
    with pytest.raises(TypeError, match="Variable name must be a string, got int 3"):
        Variable(0.0, name=3, registry=reg)
    with pytest.raises(ValueError, match="Invalid variable name 'a:0'"):
        Variable(0.0, name="a:0", registry=reg)
    with pytest.raises(ValueError, match=r"Invalid variable synchronization 'SOMETIMES': expected one of "
                                         r"VariableSynchronization.AUTO"):
        Variable(0.0, synchronization="SOMETIMES", registry=reg)
    with pytest.raises(ValueError, match=r"Invalid variable aggregation 7: expected one of VariableAggregation.NONE"):
        Variable(0.0, aggregation=7, registry=reg)
    with pytest.raises(TypeError, match="trainable must be a bool, got str"):
        Variable(0.0, trainable="yes", registry=reg)


def test_read_of_uninitialized_variable(reg):
    u = varstate.uninitialized((2,), jnp.float32, name="later", registry=reg)
    with pytest.raises(ValueError, match=r"Variable 'later' is uninitialized \(shape \(2,\), float32\)"):
        u.read_value()
    with pytest.raises(ValueError, match="is uninitialized"):
        u + 1.0


def test_iteration_stops_at_the_first_dimension(reg):
    # jax clamps out-of-range integer indices, so iteration through __getitem__ never ended.
    v = Variable(jnp.arange(6.0).reshape(3, 2), name="rows", registry=reg)
    rows = list(itertools.islice(v, 10))  # bounded: the bug was an endless iteration
    assert len(rows) == 3 and [r.tolist() for r in rows] == np.arange(6.0).reshape(3, 2).tolist()
    a, b = Variable(jnp.array([1.0, 2.0]), registry=reg)
    assert (float(a), float(b)) == (1.0, 2.0)
    with pytest.raises(TypeError, match="iteration over a 0-d array"):
        iter(Variable(1.0, registry=reg))
    assert jax.jit(lambda v: sum(v))(v).tolist() == [6.0, 9.0]  # iterates a traced value too


def test_numpy_array_on_the_left_defers_to_the_variable(reg):
    # As for a jax.Array: numpy defers, so the result is a jax value, and it works under jit.
    v = Variable(jnp.arange(3.0), name="v", registry=reg)
    out = np.ones(3) * v + np.full(3, 2.0)
    assert isinstance(out, jax.Array) and out.tolist() == [2.0, 3.0, 4.0]
    assert jax.jit(lambda v: np.ones(3, np.float32) * v)(v).tolist() == [0.0, 1.0, 2.0]
    assert (np.array([1.0, 1.0, 1.0]) < v).tolist() == [False, False, True]


def test_scatter_under_jit_drops_negative_indices(reg):
    # Concrete negative indices raise IndexError; traced ones cannot be checked and are dropped
    # like every out-of-range row (TF's kernel refuses them), never wrapped around to the last row.
    v = Variable(jnp.zeros(3), name="v", registry=reg)
    s = IndexedSlices(jnp.ones(2), jnp.array([-1, 0]), (3,))
    for op in ("scatter_add", "scatter_sub", "scatter_update"):
        out = jax.jit(lambda v, s, op=op: getattr(v, op)(s))(v, s)
        expected = [1.0 if op != "scatter_sub" else -1.0, 0.0, 0.0]
        assert out.value.tolist() == expected, op


def test_scatter_into_a_scalar_names_the_problem(reg):
    # Was a raw "tuple index out of range"; TF's scatter kernels need a variable of rank >= 1.
    s = Variable(1.0, name="scalar", registry=reg)
    with pytest.raises(ValueError, match=r"Variable 'scalar'.scatter_add: a scatter needs a variable of rank >= 1 "
                                         r"\(its rows\), but 'scalar' is a scalar; use assign_add"):
        s.scatter_add(IndexedSlices(jnp.ones(1), jnp.array([0])))


def test_a_python_float_into_an_integer_variable_is_refused_not_truncated(reg):
    # TF: "Cannot convert 2.7 to EagerTensor of dtype int32" (TypeError); jnp.asarray truncated silently.
    iv = Variable(jnp.int32(1), name="count", registry=reg)
    with pytest.raises(TypeError, match=r"Variable 'count'.assign: cannot convert 2.7 to int32 without losing "
                                        r"its fractional part; pass an integer"):
        iv.assign(2.7)
    with pytest.raises(TypeError, match=r"Variable 'n' initial_value: cannot convert \[1, 1.5\] to int32"):
        Variable([1, 1.5], name="n", dtype=jnp.int32, registry=reg)
    assert iv.assign_add(2).value.item() == 3 and iv.assign(4.0).value.item() == 4  # whole numbers convert
    assert Variable(1, dtype=jnp.float32, registry=reg).value.item() == 1.0


def test_assign_converts_a_numpy_array_of_the_same_kind_as_tf_does(reg):
    # TF converts a numpy value to the variable's dtype (np.random's float64 into a float32 variable);
    # a jax array of another dtype (a TF tensor) and a lossy kind change are still refused.
    v = Variable(jnp.zeros(2), name="kernel", registry=reg)
    new = v.assign(np.array([0.1, 0.2]))
    assert new.dtype == jnp.float32 and new.value.tolist() == np.array([0.1, 0.2], np.float32).tolist()
    assert v.assign_add(np.arange(2)).value.tolist() == [0.0, 1.0]
    with pytest.raises(TypeError, match=r"'kernel'.assign: dtype mismatch: the variable is float32, the value is "
                                        r"complex128. Cast it first"):
        v.assign(np.array([1j, 0j]))
    iv = Variable(jnp.zeros(2, jnp.int32), name="ids", registry=reg)
    with pytest.raises(TypeError, match=r"'ids'.assign: dtype mismatch: the variable is int32, the value is float64"):
        iv.assign(np.array([1.5, 2.0]))


def test_setting_value_raises_and_names_the_assign_call(reg):
    v = Variable(jnp.zeros(2), name="w", registry=reg)
    with pytest.raises(AttributeError, match=r"^Variable 'w': \.value cannot be set; a Variable is immutable and "
                                             r"assign returns the new version: `v = v\.assign\(new_value\)` "
                                             r"\(inside jit too\)\.$"):
        v.value = jnp.ones(2)
    np.testing.assert_array_equal(v.value, np.zeros(2))
    np.testing.assert_array_equal(v.assign(jnp.ones(2)).value, np.ones(2))  # the call the message names works


def test_a_typed_prng_key_variable_has_a_repr_copies_and_steps_under_jit(reg):
    import copy

    key = jax.random.key(0)
    v = Variable(key, name="rng", trainable=False, registry=reg)
    want = np.asarray(jax.random.key_data(key))
    assert repr(v) == f"<varstate.Variable 'rng' shape=() dtype=key<fry>, key_data={np.array2string(want)}>"
    assert v.value is not key  # Variable(x) copies x, key arrays too
    np.testing.assert_array_equal(jax.random.key_data(v.value), want)
    nxt = jax.jit(lambda v: v.assign(jax.random.split(v.value)[0]))(v)
    np.testing.assert_array_equal(jax.random.key_data(nxt.value), jax.random.key_data(jax.random.split(key)[0]))
    assert nxt.resource_id == v.resource_id and "key_data=" in repr(nxt)
    shallow, deep = copy.copy(v), copy.deepcopy(v)
    assert shallow.handle is v.handle and shallow.value is v.value
    assert deep.handle is v.handle and deep.value is not v.value
    np.testing.assert_array_equal(jax.random.key_data(deep.value), want)


def test_deepcopy_copies_the_buffer_and_keeps_identity_so_a_step_leaves_the_original(reg):
    import copy

    from varstate.optimizers import GradientDescent

    w = Variable(jnp.ones(2), name="w", registry=reg)
    opt = GradientDescent(0.5)
    params = copy.deepcopy({"w": w})
    assert params["w"].resource_id == w.resource_id
    (new, _) = opt.apply_gradients({"w": jnp.ones(2)}, params, opt.init(params))
    np.testing.assert_array_equal(w.value, np.ones(2))  # the original's buffer was not the one donated
    np.testing.assert_array_equal(new["w"].value, np.full(2, 0.5))
