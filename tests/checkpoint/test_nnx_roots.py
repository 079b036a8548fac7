"""flax nnx Modules, nnx.State and PRNG keys as checkpoint roots.

Reference: TF's own checkpoint of a tf.Module of the same structure
(tests/data/tf_object_graph, written by make_tf_object_graph_fixtures.py):
an nnx Module saves under the same keys and restores from TF's file. PRNG
keys are checked by the random numbers the restored key draws.
"""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import checkpoint
import varstate

DATA = os.path.join(os.path.dirname(__file__), "..", "data", "tf_object_graph")
SUFFIX = "/.ATTRIBUTES/VARIABLE_VALUE"


class Model(nnx.Module):
    """The nnx twin of the fixture's tf.Module (kernel, bias, a list holding `scale`, `nested` reaching kernel)."""

    def __init__(self, fill: float = 0.0):
        self.kernel = nnx.Param(jnp.full((2, 3), fill, jnp.float32))
        self.bias = nnx.Param(jnp.full((3,), fill, jnp.float32))
        self.layers = nnx.List([nnx.Param(jnp.asarray(fill, jnp.float32))])
        self.nested = nnx.Dict(deep=self.kernel)


class WithRngs(nnx.Module):
    def __init__(self, seed: int):
        self.dense = nnx.Linear(2, 3, rngs=nnx.Rngs(seed))
        self.rngs = nnx.Rngs(seed, dropout=seed + 1)


def _tf_values():
    with open(os.path.join(DATA, "graph.json")) as f:
        return json.load(f)["values"]


@pytest.mark.parametrize("fmt", ["orbax", "tf"])
def test_nnx_module_saves_under_tf_keys(tmp_path, fmt):
    tf_model_keys = {k for k in _tf_values() if k.startswith("model/") and ".OPTIMIZER_SLOT" not in k}
    path = checkpoint.Checkpoint(model=Model(1.0)).save(str(tmp_path / "ckpt"), format=fmt)
    reader = checkpoint.read_checkpoint(path)
    ours = {k for k in reader.keys() if k.startswith("model/")}
    assert ours == tf_model_keys  # no nnx "value" level; the shared kernel stored once, as TF does
    assert reader.get("model/kernel" + SUFFIX).tolist() == [[1.0] * 3] * 2
    assert reader.object_graph.nodes[0].children[0].local_name == "model"


def test_restore_tf_checkpoint_into_nnx_module():
    values = _tf_values()
    template = Model()
    status = checkpoint.Checkpoint(model=template).restore(os.path.join(DATA, "ckpt-1"))
    status.assert_existing_objects_matched().expect_partial()  # the optimizer's values are not asked for
    restored = status.model
    assert isinstance(restored, Model) and restored is not template
    for name, got in [("kernel", restored.kernel), ("bias", restored.bias), ("layers/0", restored.layers[0])]:
        want = values[f"model/{name}{SUFFIX}"]
        assert isinstance(got, nnx.Param)
        np.testing.assert_array_equal(np.asarray(got[...]).ravel(), np.asarray(want["values"], np.float32))
    assert restored.nested["deep"] is restored.kernel  # sharing survives, as nnx.merge keeps it
    assert float(template.kernel[...].sum()) == 0.0  # the template is not changed


@pytest.mark.parametrize("fmt", ["orbax", "tf"])
def test_rngs_and_key_arrays_round_trip(tmp_path, fmt):
    model = WithRngs(3)
    model.rngs.dropout()  # advance the count: it must come back too
    key = jax.random.key(7, impl="rbg")
    var = varstate.Variable(jax.random.split(jax.random.key(11), 4), name="keys")
    path = checkpoint.Checkpoint(model=model, key=key, var=var).save(str(tmp_path / "ckpt"), format=fmt)
    reader = checkpoint.read_checkpoint(path)
    assert reader.get("key/.ATTRIBUTES/VARIABLE_VALUE").tolist() == jax.random.key_data(key).tolist()
    assert np.asarray(reader.get("key/.ATTRIBUTES/PRNG_KEY_IMPL")).item() in ("rbg", b"rbg")

    template = checkpoint.Checkpoint(model=WithRngs(0), key=jax.random.key(0, impl="rbg"),
                                     var=varstate.Variable(jax.random.split(jax.random.key(0), 4), name="keys"))
    status = template.restore(path).assert_consumed()
    assert status.var.resource_id == template.var.resource_id
    np.testing.assert_array_equal(jax.random.key_data(status.var.value), jax.random.key_data(var.value))
    np.testing.assert_array_equal(jax.random.uniform(status.key, (5,)), jax.random.uniform(key, (5,)))
    got, want = status.model, model
    np.testing.assert_array_equal(got.dense.kernel[...], want.dense.kernel[...])
    for _ in range(2):  # the same stream: same numbers, call after call
        np.testing.assert_array_equal(jax.random.normal(got.rngs.dropout(), (3,)),
                                      jax.random.normal(want.rngs.dropout(), (3,)))
        np.testing.assert_array_equal(jax.random.normal(got.rngs(), (3,)), jax.random.normal(want.rngs(), (3,)))


def test_nnx_state_and_abstract_module_templates(tmp_path):
    model = WithRngs(5)
    path = checkpoint.Checkpoint(model=model).save(str(tmp_path / "ckpt"))
    as_state = checkpoint.Checkpoint(model=nnx.state(WithRngs(0))).restore(path).assert_consumed().model
    assert isinstance(as_state, nnx.State)
    np.testing.assert_array_equal(as_state["dense"]["kernel"][...], model.dense.kernel[...])
    abstract = nnx.eval_shape(lambda: WithRngs(0))  # ShapeDtypeStructs, keys included: nothing allocated
    restored = checkpoint.Checkpoint(model=abstract).restore(path).assert_consumed().model
    np.testing.assert_array_equal(restored.dense.bias[...], model.dense.bias[...])
    np.testing.assert_array_equal(jax.random.normal(restored.rngs.dropout()), jax.random.normal(model.rngs.dropout()))


def test_nnx_variable_as_root(tmp_path):
    path = checkpoint.Checkpoint(w=nnx.Param(jnp.arange(3.0))).save(str(tmp_path / "ckpt"))
    assert checkpoint.read_checkpoint(path).get("w" + SUFFIX).tolist() == [0.0, 1.0, 2.0]
    got = checkpoint.Checkpoint(w=nnx.Param(jnp.zeros(3))).restore(path).assert_consumed().w
    assert isinstance(got, nnx.Param) and got[...].tolist() == [0.0, 1.0, 2.0]


def test_key_data_without_implementation_takes_the_templates(tmp_path):
    # orbax and flax store a key as its key data alone: the template's implementation rebuilds it.
    key = jax.random.key(1, impl="rbg")
    path = checkpoint.Checkpoint(key=jax.random.key_data(key)).save(str(tmp_path / "ckpt"))
    got = checkpoint.Checkpoint(key=jax.random.key(0, impl="rbg")).restore(path).assert_consumed().key
    np.testing.assert_array_equal(jax.random.uniform(got, (4,)), jax.random.uniform(key, (4,)))
    with pytest.raises(ValueError, match=r"Cannot restore \(root\).key: the checkpoint value "
                                         r"'key/.ATTRIBUTES/VARIABLE_VALUE' has shape \(4,\), the object has "
                                         r"shape \(2,\)"):
        checkpoint.Checkpoint(key=jax.random.key(0)).restore(path)  # threefry: 2 words of key data, not 4


def test_key_of_another_implementation_is_refused(tmp_path):
    path = checkpoint.Checkpoint(key=jax.random.key(1, impl="rbg")).save(str(tmp_path / "ckpt"))
    with pytest.raises(TypeError, match=r"Cannot restore \(root\).key: the checkpoint's PRNG key "
                                        r"'key/.ATTRIBUTES/VARIABLE_VALUE' is of implementation 'rbg' .* the "
                                        r"object's is 'unsafe_rbg'. .*impl='rbg'"):
        checkpoint.Checkpoint(key=jax.random.key(0, impl="unsafe_rbg")).restore(path)
    with pytest.raises(ValueError, match=r"Cannot restore \(root\).key: the checkpoint value "
                                         r"'key/.ATTRIBUTES/VARIABLE_VALUE' has shape \(4,\), the object has "
                                         r"shape \(2,\)"):
        checkpoint.Checkpoint(key=jax.random.key(0)).restore(path)  # threefry: 2 words of key data, not 4


def test_mismatched_nnx_shape_names_the_path(tmp_path):
    path = checkpoint.Checkpoint(model=Model(1.0)).save(str(tmp_path / "ckpt"))
    bad = Model()
    bad.bias = nnx.Param(jnp.zeros(4))
    with pytest.raises(ValueError, match=r"Cannot restore \(root\).model.bias: the checkpoint value "
                                         r"'model/bias/.ATTRIBUTES/VARIABLE_VALUE' has shape \(3,\), the object has "
                                         r"shape \(4,\)"):
        checkpoint.Checkpoint(model=bad).restore(path)
