"""Review findings on Variable: int64 indices past int32 (F1), lossy scatter updates and initial values (F6),
PartitionedVariables sharing a name (F7), a global step found by name (F8), and messages (F11).

The reference is TF's behaviour: its kernels check an int64 index against the first dimension, its conversion
refuses a Python float with a fraction for an int dtype and a float Tensor for an int Variable, TF1 names a second
partitioned ``emb`` ``emb_1`` and finds its global step by the name ``global_step`` (a registry keeps no current
value to hand back, so ours refuses rather than make a ``global_step_1`` no TF checkpoint knows).
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import varstate
from varstate import IndexedSlices, PartitionedVariable, Variable

BIG = 2**32 + 1  # int32 keeps its low bits: 1, a valid row of the tables below


def _table(reg):
    return Variable(jnp.arange(6.0).reshape(3, 2), name="table", registry=reg)


# --- F1: an int64 index past int32 is refused before JAX narrows it ------------------------------------

@pytest.mark.parametrize("ids", [np.array([BIG], np.int64), [BIG], np.array([2**33], np.uint64)],
                         ids=["numpy-int64", "list", "numpy-uint64"])
@pytest.mark.parametrize("op", ["scatter_update", "scatter_add", "scatter_max", "scatter_mul"])
def test_scatter_with_an_index_past_int32_raises_index_error(reg, ids, op):
    assert not jax.config.jax_enable_x64
    v = _table(reg)
    bad = int(np.asarray(ids).reshape(-1)[0])
    with pytest.raises(IndexError, match=re.escape(
            f"Variable 'table'.{op}: index {bad} is out of range for a first dimension of size 3 (valid: 0..2).")):
        getattr(v, op)(IndexedSlices(jnp.full((1, 2), 9.0), ids))


@pytest.mark.parametrize("ids", [np.array([BIG], np.int64), BIG, [BIG], np.int64(-2**40), [2**64]],
                         ids=["numpy-int64", "python-int", "list", "numpy-negative", "past-int64"])
def test_sparse_read_with_an_index_past_int32_raises_index_error(reg, ids):
    bad = np.asarray(ids).reshape(-1)[0]
    with pytest.raises(IndexError, match=re.escape(
            f"Variable 'table'.sparse_read: index {bad} is out of range for a first dimension of size 3 "
            "(valid: 0..2).")):
        _table(reg).sparse_read(ids)


@pytest.mark.parametrize("ids", [np.array([[BIG + 1, 1]], np.int64), [[BIG + 1, 1]]], ids=["numpy", "list"])
def test_gather_nd_and_scatter_nd_with_an_index_past_int32_raise_index_error(reg, ids):
    v = _table(reg)
    for op, call in [("gather_nd", lambda: v.gather_nd(ids)),
                     ("scatter_nd_update", lambda: v.scatter_nd_update(ids, jnp.array([7.0]))),
                     ("scatter_nd_add", lambda: v.scatter_nd_add(ids, jnp.array([7.0])))]:
        with pytest.raises(IndexError, match=re.escape(
                f"Variable 'table'.{op}: indices[0] = [{BIG + 1}, 1] is out of range for the variable's shape "
                "(3, 2) (index j must be in 0..shape[j] - 1).")):
            call()


def test_int64_indices_in_range_still_work(reg):
    v = _table(reg)
    ids = np.array([2, 0], np.int64)
    assert v.sparse_read(ids).tolist() == [[4.0, 5.0], [0.0, 1.0]]
    assert v.scatter_update(IndexedSlices(jnp.full((1, 2), 9.0), [1])).value.tolist() == [
        [0.0, 1.0], [9.0, 9.0], [4.0, 5.0]]
    assert v.gather_nd(np.array([[2, 1]], np.int64)).tolist() == [5.0]


# --- F6: no silent truncation of a float into an int variable --------------------------------------------

def _counts(reg):
    return Variable(jnp.array([10, 20]), name="counts", registry=reg)


@pytest.mark.parametrize(("op", "call"), [
    ("scatter_nd_update", lambda v: v.scatter_nd_update([[0]], [1.7])),
    ("scatter_nd_add", lambda v: v.scatter_nd_add([[0]], [1.7])),
    ("scatter_update", lambda v: v.scatter_update(IndexedSlices([1.7], [0]))),
    ("scatter_max", lambda v: v.scatter_max(IndexedSlices([1.7], [0]))),
])
def test_scatters_refuse_a_float_with_a_fraction_for_an_int_variable_as_assign_does(reg, op, call):
    v = _counts(reg)
    with pytest.raises(TypeError) as assigned:
        v.assign([1.7, 2.0])
    with pytest.raises(TypeError, match=re.escape(
            f"Variable 'counts'.{op}: cannot convert [1.7] to int32 without losing its fractional part; "
            "pass an integer.")) as scattered:
        call(v)
    # One check, one wording: only the method and the value differ.
    assert str(scattered.value).replace(f".{op}", ".assign").replace("[1.7]", "[1.7, 2.0]") == str(assigned.value)


def test_scatters_take_whole_floats_and_ints_for_an_int_variable(reg):
    v = _counts(reg)
    assert v.scatter_nd_update([[0]], [3.0]).value.tolist() == [3, 20]
    assert v.scatter_add(IndexedSlices([2], [1])).value.tolist() == [10, 22]


def test_scatter_of_an_int_past_the_dtype_names_the_variable_range_and_fix(reg):
    with pytest.raises(OverflowError, match=re.escape(
            f"Variable 'counts'.scatter_nd_update: [{2**40}] does not fit in int32 (range -2147483648..2147483647); "
            "JAX's 64-bit types are off")):
        _counts(reg).scatter_nd_update([[0]], [2**40])


@pytest.mark.parametrize("initial", [lambda: jnp.array([1.5]), lambda: Variable(jnp.array([1.5]))],
                         ids=["array", "variable"])
def test_a_float_jax_array_is_refused_as_an_int_variables_initial_value(reg, initial):
    # TF converts no Tensor to another dtype (a float Tensor for an int32 Variable is refused).
    with pytest.raises(TypeError, match=re.escape(
            "Variable 'n' initial_value: cannot convert a float32 array to int32: it would drop the fractional "
            "part. Round or cast it first (jnp.round(x).astype(int32)).")):
        Variable(initial(), name="n", dtype=jnp.int32, registry=reg)


def test_other_initial_value_conversions_are_unchanged(reg):
    assert Variable(jnp.array([1, 2]), dtype=jnp.float32, registry=reg).value.tolist() == [1.0, 2.0]
    assert Variable(jnp.array([1.5]), dtype=jnp.bfloat16, registry=reg).dtype == jnp.bfloat16
    # A numpy value is converted, as TF converts one (it is not a Tensor).
    assert Variable(np.array([1.0, 2.0]), dtype=jnp.int32, registry=reg).value.tolist() == [1, 2]


# --- F7: a second PartitionedVariable of the same name gets its own full name -------------------------

def test_two_partitioned_variables_named_alike_get_tf1s_unique_full_names(reg):
    a = PartitionedVariable(jnp.zeros((4, 2)), name="emb", num_shards=2, registry=reg)
    b = PartitionedVariable(jnp.zeros((4, 2)), name="emb", num_shards=2, registry=reg)
    assert (a.name, b.name) == ("emb", "emb_1")
    assert [v.name for v in b] == ["emb_1/part_0", "emb_1/part_1"]
    assert {v.save_slice_info.full_name for v in b} == {"emb_1"}
    assert [v.name for v in a] == ["emb/part_0", "emb/part_1"]


def test_a_partitioned_full_name_is_unique_with_variables_and_name_scopes(reg):
    plain = Variable(1.0, name="emb", registry=reg)  # would share the checkpoint key "emb"
    pv = PartitionedVariable(jnp.zeros((4, 2)), name="emb", num_shards=2, registry=reg)
    assert (plain.name, pv.name, pv[1].name) == ("emb", "emb_1", "emb_1/part_1")
    with varstate.name_scope("s"):
        first = PartitionedVariable(jnp.zeros((4, 2)), name="t", num_shards=2, registry=reg)
        second = PartitionedVariable(jnp.zeros((4, 2)), name="t", num_shards=2, registry=reg)
    assert (first.name, second.name, second[0].name) == ("s/t", "s/t_1", "s/t_1/part_0")


# --- F8: a variable named global_step already in the registry ----------------------------------------------

def test_get_or_create_global_step_refuses_a_global_step_it_did_not_make(reg):
    mine = Variable(7, name="global_step", trainable=False, registry=reg)
    with pytest.raises(ValueError, match=re.escape(
            "get_or_create_global_step: this registry already has a variable named 'global_step' that it did not "
            "make, so the global step made now would be 'global_step_1', a name TF's checkpoints do not know (TF1 "
            "would take that variable, but a registry keeps identities, not its current value). Use that variable "
            "as the global step (apply_gradients(..., global_step=it); varstate.assert_global_step checks it), or "
            "rename it, or give the global step a registry of its own: "
            "get_or_create_global_step(varstate.Registry()).")):
        varstate.get_or_create_global_step(reg)
    assert reg.names() == ["global_step"]  # no global_step_1 made
    del mine  # the registry holds names weakly: once it is gone, the name is free again
    gs = varstate.get_or_create_global_step(reg)
    assert gs.name == "global_step" and varstate.get_or_create_global_step(reg) is gs


def test_a_scoped_global_step_is_not_the_global_step(reg):
    with varstate.name_scope("train"):
        scoped = Variable(0, name="global_step", registry=reg)
    gs = varstate.get_or_create_global_step(reg)
    assert (gs.name, scoped.name) == ("global_step", "train/global_step")
    assert reg.names() == ["global_step", "train/global_step"]


# --- F11: messages ------------------------------------------------------------------------------------------

def test_on_read_trainable_without_a_name_says_a_new_variable(reg):
    with pytest.raises(ValueError, match=re.escape(
            "A new Variable (no name given): synchronization ON_READ is only allowed for non-trainable variables; "
            "pass trainable=False.")):
        Variable(1.0, synchronization="on_read", trainable=True, registry=reg)


X64_FIX = ("JAX's 64-bit types are off, so int64 is held as int32: turn them on at startup with "
           "jax.config.update(\"jax_enable_x64\", True), then pass an int64 value (np.int64(...)) to an int64 "
           "variable.")


def test_an_int_past_int32_names_the_variable_the_range_and_x64(reg):
    with pytest.raises(OverflowError, match=re.escape(
            f"Variable 'big' initial_value: {2**40} does not fit in int32 (range -2147483648..2147483647); "
            + X64_FIX)):
        Variable(2**40, name="big", registry=reg)
    gs = varstate.get_or_create_global_step(reg)
    with pytest.raises(OverflowError, match=re.escape(
            f"Variable 'global_step'.assign_add: {2**40} does not fit in int32 (range -2147483648..2147483647); "
            + X64_FIX)):
        gs.assign_add(2**40)


def test_an_int_past_a_narrow_dtype_suggests_a_wider_dtype(reg):
    v = Variable(jnp.zeros(2, jnp.uint8), name="small", registry=reg)
    with pytest.raises(OverflowError, match=re.escape(
            "Variable 'small'.assign: [300, 1] does not fit in uint8 (range 0..255); pass a value in that range, "
            "or create the variable with a wider dtype.")):
        v.assign([300, 1])


def test_a_numpy_int64_value_that_int32_cannot_hold_is_refused_not_wrapped(reg):
    # With 64-bit types off JAX holds int64 as int32: a numpy int64 past its range would wrap (2**40 -> 0).
    v = Variable(jnp.zeros(2, jnp.int32), name="c", registry=reg)
    fix = ("JAX's 64-bit types are off, so int64 is held as int32: turn them on at startup with "
           "jax.config.update(\"jax_enable_x64\", True), then pass an int64 value (np.int64(...)) to an int64 "
           "variable.")
    for op, call in (("assign", v.assign), ("assign_add", v.assign_add)):
        with pytest.raises(OverflowError, match=re.escape(
                f"Variable 'c'.{op}: {2**40} does not fit in int32 (range -2147483648..2147483647); {fix}")):
            call(np.array([2**40, 1]))
    with pytest.raises(OverflowError, match=re.escape(f"Variable 'd' initial_value: {-(2**35)} does not fit in int32")):
        Variable(np.array([1, -(2**35)]), name="d", registry=reg)
    with pytest.raises(OverflowError, match=re.escape("Variable 'c'.scatter_update: 4294967296 does not fit in int32")):
        v.scatter_update(IndexedSlices(np.array([2**32]), np.array([0]), (2,)))
    assert v.assign(np.array([7, -8])).value.tolist() == [7, -8]  # in range: converted, as TF converts numpy
