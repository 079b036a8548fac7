"""`values` and `with_values`: a pytree of Variables to the same pytree of arrays, and back."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import varstate
from varstate import Variable


def _params(reg):
    return {"w": Variable(jnp.ones(2), name="w", registry=reg),
            "b": [Variable(jnp.arange(3.0), name="b", registry=reg), 7, None]}


def test_values_replaces_each_variable_by_its_value_and_keeps_the_rest(reg):
    params = _params(reg)
    got = varstate.values(params)
    assert jax.tree.structure(got) == jax.tree.structure({"w": 0, "b": [0, 0, None]})
    assert got["w"] is params["w"].value and got["b"][0] is params["b"][0].value and got["b"][1:] == [7, None]
    assert varstate.values(3.0) == 3.0 and varstate.values([]) == []


def test_values_is_what_grad_differentiates(reg):
    params = {"w": Variable(jnp.ones(2), name="w", registry=reg), "b": [Variable(jnp.arange(3.0), registry=reg)]}
    grads = jax.grad(lambda p: jnp.sum(p["w"] ** 2) + jnp.sum(p["b"][0]))(varstate.values(params))
    np.testing.assert_array_equal(grads["w"], 2 * np.ones(2))  # d/dw sum(w^2) = 2w
    np.testing.assert_array_equal(grads["b"][0], np.ones(3))


def test_with_values_makes_new_versions_with_the_same_identities(reg):
    params = _params(reg)
    new = varstate.with_values(params, {"w": jnp.zeros(2), "b": [jnp.full(3, 5.0), 8, None]})
    for old, fresh in ((params["w"], new["w"]), (params["b"][0], new["b"][0])):
        assert (fresh.resource_id, fresh.name, fresh.dtype) == (old.resource_id, old.name, old.dtype)
    assert new["w"].value.tolist() == [0.0, 0.0] and new["b"][0].value.tolist() == [5.0, 5.0, 5.0]
    assert new["b"][1:] == [8, None]  # other leaves come from `arrays`
    assert params["w"].value.tolist() == [1.0, 1.0]  # the template is untouched
    round_trip = varstate.with_values(params, varstate.values(params))
    assert [round_trip["w"].resource_id, round_trip["b"][0].resource_id] == [params["w"].resource_id,
                                                                             params["b"][0].resource_id]


def test_with_values_refuses_another_structure_naming_both(reg):
    params = _params(reg)
    with pytest.raises(ValueError, match=re.escape(
        "with_values: `arrays` does not have the template's structure PyTreeDef({'b': [*, *, None], 'w': *}): "
        "Dict key mismatch; expected keys: ['b', 'w']; present keys: ['w']. "
        "Pass arrays in the structure varstate.values(template) returns.")):
        varstate.with_values(params, {"w": jnp.zeros(2)})
    with pytest.raises(ValueError, match=r"^with_values: .* List arity mismatch: 2 != 3; .* Pass arrays in the"):
        varstate.with_values(params, {"w": jnp.zeros(2), "b": [jnp.zeros(3), 1]})


def test_with_values_checks_shape_and_dtype_as_assign_does(reg):
    params = _params(reg)
    with pytest.raises(ValueError, match=re.escape(
            "Variable 'w'.assign: shape mismatch: the variable has shape (2,), the value has shape (3,).")):
        varstate.with_values(params, {"w": jnp.zeros(3), "b": [jnp.zeros(3), 1, None]})
    with pytest.raises(TypeError, match=re.escape(
            "Variable 'w'.assign: dtype mismatch: the variable is float32, the value is int32. "
            "Cast it first with .astype(float32).")):
        varstate.with_values(params, {"w": jnp.zeros(2, jnp.int32), "b": [jnp.zeros(3), 1, None]})
