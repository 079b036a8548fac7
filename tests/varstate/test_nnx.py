"""flax nnx interop: from_nnx / to_nnx, TF-style training of an nnx Module, and checkpoint keys by nnx path."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import checkpoint
import varstate
from varstate.nnx import from_nnx, to_nnx
from varstate.optimizers import Adam


class MLP(nnx.Module):
    def __init__(self, rngs):
        self.layers = nnx.List([nnx.Linear(2, 3, rngs=rngs), nnx.Linear(3, 1, rngs=rngs)])
        self.bn = nnx.BatchNorm(3, rngs=rngs)
        self.rngs = rngs

    def __call__(self, x):
        return self.layers[1](jax.nn.relu(self.bn(self.layers[0](x))))


def _is_var(x):
    return isinstance(x, varstate.Variable)


def test_from_nnx_names_trainability_and_values():
    model = MLP(nnx.Rngs(0))
    params = from_nnx(model)
    names = jax.tree.map(lambda v: (v.name, v.trainable), params, is_leaf=_is_var)
    assert names == {
        "bn": {"bias": ("bn/bias", True), "mean": ("bn/mean", False), "scale": ("bn/scale", True),
               "var": ("bn/var", False)},
        "layers": {0: {"bias": ("layers/0/bias", True), "kernel": ("layers/0/kernel", True)},
                   1: {"bias": ("layers/1/bias", True), "kernel": ("layers/1/kernel", True)}},
    }
    assert np.array_equal(params["layers"][0]["kernel"].value, model.layers[0].kernel[...])
    assert from_nnx(nnx.state(model, nnx.Param)).keys() == {"bn", "layers"}  # an nnx.State works too


class Linears(nnx.Module):
    def __init__(self, rngs):
        self.layers = nnx.List([nnx.Linear(2, 3, rngs=rngs), nnx.Linear(3, 1, rngs=rngs)])

    def __call__(self, x):
        return self.layers[1](jax.nn.relu(self.layers[0](x)))


def test_training_an_nnx_module_with_varstate_adam_matches_optax_adam_closely():
    model = Linears(nnx.Rngs(0))
    x, y = jnp.linspace(-1, 1, 8).reshape(4, 2), jnp.ones((4, 1))
    graphdef, template = nnx.split(model)

    def loss(values):
        flat = dict(nnx.to_flat_state(template))
        for path, leaf in jax.tree_util.tree_flatten_with_path(values)[0]:
            keys = tuple(k.key for k in path)
            flat[keys] = flat[keys].replace(leaf)
        return jnp.mean((nnx.merge(graphdef, nnx.from_flat_state(flat))(x) - y) ** 2)

    params = from_nnx(model)
    opt = Adam(0.01)
    state = opt.init(params)
    reference = jax.tree.map(lambda v: jnp.array(v.value), params, is_leaf=_is_var)  # a copy: steps donate
    tx = optax.adam(0.01, eps=1e-8)
    opt_state = tx.init(reference)
    grad = jax.jit(jax.grad(loss))  # one program for both (eagerly, each of nnx's ops compiles on its own)

    @jax.jit
    def optax_step(grads, opt_state, params):
        updates, opt_state = tx.update(grads, opt_state)
        return optax.apply_updates(params, updates), opt_state

    for _ in range(3):
        values = jax.tree.map(lambda v: v.value, params, is_leaf=_is_var)
        params, state = opt.apply_gradients(grad(values), params, state)
        reference, opt_state = optax_step(grad(reference), opt_state, reference)
    got = jax.tree.map(lambda v: v.value, params, is_leaf=_is_var)
    # TF's Adam folds the bias correction into the rate and adds epsilon outside it: near, not equal.
    assert jax.tree.all(jax.tree.map(lambda a, b: bool(jnp.allclose(a, b, atol=1e-5)), got, reference))
    to_nnx(model, params)
    assert np.array_equal(model.layers[1].kernel[...], params["layers"][1]["kernel"].value)
    assert float(loss(got)) < float(loss(jax.tree.map(lambda v: v.value, from_nnx(Linears(nnx.Rngs(0))),
                                                      is_leaf=_is_var)))


def test_checkpoint_keys_follow_the_nnx_paths(tmp_path):
    params = from_nnx(MLP(nnx.Rngs(0)))
    path = checkpoint.Checkpoint(model=params).write(str(tmp_path / "c"), format="tf")
    keys = checkpoint.read_checkpoint(path).keys()
    assert "model/layers/0/kernel/.ATTRIBUTES/VARIABLE_VALUE" in keys
    assert "model/bn/mean/.ATTRIBUTES/VARIABLE_VALUE" in keys
    fresh = from_nnx(MLP(nnx.Rngs(1)))
    restored = checkpoint.Checkpoint(model=fresh).restore(path).assert_consumed().model
    assert np.array_equal(restored["layers"][0]["kernel"].value, params["layers"][0]["kernel"].value)


def test_errors():
    model = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
    with pytest.raises(TypeError, match=r"from_nnx: expected an nnx.Module or nnx.State, got dict\. For a plain "
                                        r"pytree of arrays, build Variables with varstate.Variable"):
        from_nnx({"w": jnp.ones(2)})
    with pytest.raises(TypeError, match=r"to_nnx: expected an nnx.Module, got dict"):
        to_nnx({}, {})
    with pytest.raises(KeyError, match=r"to_nnx: the Module has no variable at 'kernell'; its paths are "
                                       r"\['bias', 'kernel'\]"):
        to_nnx(model, {"kernell": jnp.ones((2, 3))})
    with pytest.raises(ValueError, match=r"to_nnx: 'kernel' is float32\[3, 2\], the Module holds float32\[2, 3\]"):
        to_nnx(model, {"kernel": jnp.ones((3, 2))})


def test_module_root_and_from_nnx_params_share_keys_and_restore_each_other(tmp_path):
    # A Module saved as it is and its from_nnx params name every parameter alike: either restores the other.
    model = MLP(nnx.Rngs(0))
    module_path = checkpoint.Checkpoint(model=model).write(str(tmp_path / "module"), format="tf")
    params_path = checkpoint.Checkpoint(model=from_nnx(model)).write(str(tmp_path / "params"), format="tf")
    module_keys = set(checkpoint.read_checkpoint(module_path).keys())
    params_keys = set(checkpoint.read_checkpoint(params_path).keys())
    extra = module_keys - params_keys
    assert params_keys < module_keys and "model/layers/1/kernel/.ATTRIBUTES/VARIABLE_VALUE" in params_keys
    assert extra and all(k.startswith("model/rngs/default/") for k in extra)  # from_nnx leaves RNG state to nnx
    into_params = checkpoint.Checkpoint(model=from_nnx(MLP(nnx.Rngs(1)))).restore(module_path)
    into_params.assert_existing_objects_matched().expect_partial()
    np.testing.assert_array_equal(into_params.model["layers"][1]["kernel"].value, model.layers[1].kernel[...])
    into_module = checkpoint.Checkpoint(model=MLP(nnx.Rngs(1))).restore(params_path).expect_partial().model
    np.testing.assert_array_equal(into_module.layers[1].kernel[...], model.layers[1].kernel[...])
    np.testing.assert_array_equal(into_module.bn.mean[...], model.bn.mean[...])
