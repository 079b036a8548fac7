"""Review fixes around the wrappers: nnx with AutoCastVariable params, `values`/`with_values` on AutoCastVariable and
PartitionedVariable, and copies of an AutoCastVariable."""

import copy
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import varstate
from varstate import AutoCastVariable, PartitionedVariable, Variable, mixed_precision
from varstate.nnx import from_nnx, loss_fn, to_nnx
from varstate.optimizers import GradientDescent


def _mixed(reg):
    return {"w": AutoCastVariable(Variable(jnp.array([1.0, 2.0]), name="w", registry=reg)),
            "emb": PartitionedVariable(jnp.arange(10.0).reshape(5, 2), name="emb", num_shards=2, registry=reg),
            "n": 3}


# --- F2: nnx with AutoCastVariable params


def test_to_nnx_stores_copies_of_the_stored_values_of_autocast_params(reg):
    model = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
    params = mixed_precision.autocast_variables(from_nnx(model, registry=reg))
    kernel = params["kernel"].__varstate_variable__().value
    to_nnx(model, params)
    held = model.kernel.get_value()
    assert type(held) is type(kernel) and held.dtype == jnp.float32
    assert held is not kernel and not held.unsafe_buffer_pointer() == kernel.unsafe_buffer_pointer()
    np.testing.assert_array_equal(held, kernel)
    x = jnp.ones((1, 2))
    want = np.asarray(model(x))
    opt = GradientDescent(0.1)
    params, _ = opt.apply_gradients(jax.tree.map(jnp.ones_like, params), params, opt.init(params))  # donates
    np.testing.assert_array_equal(model(x), want)  # the Module's arrays are its own: alive, unchanged
    assert isinstance(params["kernel"], AutoCastVariable)


def test_to_nnx_inside_autocast_still_stores_float32(reg):
    model = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
    params = mixed_precision.autocast_variables(from_nnx(model, registry=reg))
    with varstate.autocast(jnp.bfloat16):
        to_nnx(model, params)
    assert model.kernel.get_value().dtype == jnp.float32 and model.bias.get_value().dtype == jnp.float32


def test_loss_fn_with_autocast_params_computes_in_the_scope_dtype_and_trains(reg):
    model = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
    params = mixed_precision.autocast_variables(from_nnx(model, registry=reg))
    seen = []

    def f(m, x):
        y = m(x)
        seen.append((m.kernel.get_value().dtype, y.dtype))
        return jnp.sum(y.astype(jnp.float32))

    loss = loss_fn(model, f)

    def scoped(p, x):
        with varstate.autocast(jnp.bfloat16):
            return loss(p, x)

    x = jnp.ones((1, 2), jnp.bfloat16)
    grads = jax.grad(scoped)(params, x)
    assert seen == [(jnp.bfloat16, jnp.bfloat16)]
    assert isinstance(grads["kernel"], AutoCastVariable)
    assert grads["kernel"].__varstate_variable__().value.dtype == jnp.float32
    np.testing.assert_array_equal(grads["kernel"].__varstate_variable__().value, np.ones((2, 3)))  # d sum(xW+b)/dW
    seen.clear()
    loss(params, jnp.ones((1, 2)))
    assert seen == [(jnp.float32, jnp.float32)]  # outside a scope: the float32 storage
    bias = np.asarray(params["bias"].__varstate_variable__().value)
    opt = GradientDescent(0.5)
    new, _ = opt.apply_gradients(grads, params, opt.init(params))
    np.testing.assert_allclose(new["bias"].__varstate_variable__().value, bias - 0.5)
    assert model.kernel.get_value().dtype == jnp.float32  # the Module itself untouched


def test_loss_fn_still_refuses_a_bfloat16_array_the_caller_passed(reg):
    model = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
    loss = loss_fn(model, lambda m, x: jnp.sum(m(x)))
    with pytest.raises(ValueError, match=re.escape(
            "loss_fn: 'bias' is bfloat16[3], the Module holds float32[3]: cast it first (.astype(jnp.float32)).")):
        loss({"bias": jnp.zeros(3, jnp.bfloat16)}, jnp.ones((1, 2)))


def test_loss_fn_checks_an_autocast_param_against_its_storage(reg):
    model = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
    loss = loss_fn(model, lambda m, x: jnp.sum(m(x)))
    wrong = AutoCastVariable(Variable(jnp.zeros(4), name="bias", registry=reg))
    with pytest.raises(ValueError, match=re.escape(
            "loss_fn: 'bias' is float32[4], the Module holds float32[3]: params come from another architecture")):
        with varstate.autocast(jnp.bfloat16):
            loss({"bias": wrong}, jnp.ones((1, 2)))


# --- F3: values / with_values on the wrappers


def test_values_unwraps_autocast_to_its_stored_value_and_partitioned_to_its_shard_values(reg):
    params = _mixed(reg)
    with varstate.autocast(jnp.float16):
        got = varstate.values(params)
    assert sorted(got) == ["emb", "n", "w"] and got["n"] == 3
    assert isinstance(got["w"], jax.Array) and got["w"] is params["w"].__varstate_variable__().value
    assert got["w"].dtype == jnp.float32
    assert isinstance(got["emb"], list) and [x is v.value for x, v in zip(got["emb"], params["emb"], strict=True)] \
        == [True, True]
    np.testing.assert_array_equal(jnp.concatenate(got["emb"]), np.arange(10.0).reshape(5, 2))
    np.testing.assert_array_equal(got["w"] * 2, [2.0, 4.0])


def test_values_of_a_partitioned_variable_with_autocast_shards(reg):
    pv = mixed_precision.autocast_variables(
        PartitionedVariable(jnp.ones((4, 2)), name="emb", num_shards=2, registry=reg))
    assert all(isinstance(s, AutoCastVariable) for s in pv)
    with varstate.autocast(jnp.bfloat16):
        got = varstate.values(pv)
    assert [x.dtype for x in got] == [jnp.float32] * 2
    new = varstate.with_values(pv, [jnp.zeros((2, 2)), jnp.full((2, 2), 2.0)])
    assert all(isinstance(s, AutoCastVariable) for s in new)
    np.testing.assert_array_equal(new.as_array(), np.array([[0.0, 0.0]] * 2 + [[2.0, 2.0]] * 2))


def test_a_loss_of_the_values_differentiates(reg):
    params = _mixed(reg)
    grads = jax.grad(lambda p: jnp.sum(p["w"] ** 2) + jnp.sum(jnp.concatenate(p["emb"])))(
        {k: v for k, v in varstate.values(params).items() if k != "n"})
    np.testing.assert_array_equal(grads["w"], [2.0, 4.0])
    assert [g.shape for g in grads["emb"]] == [(3, 2), (2, 2)]


def test_with_values_round_trips_and_rebuilds_the_wrappers(reg):
    params = _mixed(reg)
    new = varstate.with_values(params, jax.tree.map(lambda x: x + 1, varstate.values(params)))
    assert isinstance(new["w"], AutoCastVariable) and new["w"].resource_id == params["w"].resource_id
    np.testing.assert_array_equal(new["w"].value, [2.0, 3.0])
    with varstate.autocast(jnp.bfloat16):
        assert new["w"].value.dtype == jnp.bfloat16
    assert isinstance(new["emb"], PartitionedVariable) and new["emb"].name == "emb"
    assert [s.resource_id for s in new["emb"]] == [s.resource_id for s in params["emb"]]
    np.testing.assert_array_equal(new["emb"].as_array(), np.arange(10.0).reshape(5, 2) + 1)
    assert new["n"] == 4


def test_with_values_checks_an_autocast_value_as_a_variable(reg):
    params = _mixed(reg)
    with pytest.raises(TypeError, match="bfloat16"):
        varstate.with_values({"w": params["w"]}, {"w": jnp.zeros(2, jnp.bfloat16)})


@pytest.mark.parametrize(("given", "found"), [
    (lambda: jnp.zeros((5, 2)), "a ArrayImpl of shape (5, 2)"),
    (lambda: [jnp.zeros((3, 2))], "a list of 1"),
])
def test_with_values_refuses_anything_but_the_shard_list_for_a_partitioned_variable(reg, given, found):
    params = _mixed(reg)
    with pytest.raises(ValueError, match=re.escape(
            f"with_values: PartitionedVariable 'emb' takes a list of 2 shard values (what varstate.values gives), "
            f"found {found}. Pass the shards' values in order, or the whole value to the PartitionedVariable's own "
            "assign(full_array), which slices it into the shards.")):
        varstate.with_values({"emb": params["emb"]}, {"emb": given()})


# --- F4: copies of an AutoCastVariable


def test_deepcopy_of_an_autocast_variable_is_one_with_the_value_copied_and_identity_kept(reg):
    params = mixed_precision.autocast_variables({"w": Variable(jnp.ones(2), name="w", registry=reg)})
    clone = copy.deepcopy(params)
    assert type(clone["w"]) is AutoCastVariable
    inner, original = clone["w"].__varstate_variable__(), params["w"].__varstate_variable__()
    assert inner.resource_id == original.resource_id and inner.name == "w"
    assert inner.value is not original.value
    np.testing.assert_array_equal(inner.value, original.value)
    with varstate.autocast(jnp.float16):
        assert (clone["w"] * 1).dtype == jnp.float16


def test_deepcopy_memo_keeps_shared_wrappers_shared(reg):
    w = AutoCastVariable(Variable(jnp.ones(2), name="w", registry=reg))
    a, b = copy.deepcopy([w, w])
    assert a is b and type(a) is AutoCastVariable


def test_copy_of_an_autocast_variable_wraps_the_same_version(reg):
    w = AutoCastVariable(Variable(jnp.ones(2), name="w", registry=reg))
    c = copy.copy(w)
    assert type(c) is AutoCastVariable and c is not w and c.__varstate_variable__() is w.__varstate_variable__()


def test_dunders_are_not_forwarded_to_the_wrapped_variable(reg):
    w = AutoCastVariable(Variable(jnp.ones(2), name="w", registry=reg))
    with pytest.raises(AttributeError, match=re.escape("'AutoCastVariable' object has no attribute '__foo__'")):
        w.__foo__  # noqa: B018
    assert not hasattr(w, "__array_interface__")
    assert w.name == "w" and w.resource_id == w.__varstate_variable__().resource_id  # other names still forwarded
