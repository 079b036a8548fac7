"""Review fixes: PRNG keys through checkpoint.export/load, and export_saved_model's message for a numpy int64 array.

Reference for the keys: the signature run on the original root, and the key data and implementation of the keys
exported (`jax.random.key_data`, `jax.random.key_impl`).
"""

import os
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import checkpoint
import varstate
from checkpoint._errors import CheckpointFormatError
from checkpoint._storage import write_bundle
from checkpoint.protos import saved_object_graph_pb2 as pb
from checkpoint.protos import types_pb2

X = jax.ShapeDtypeStruct((3,), jnp.float32)


def _sample(root, x):
    return x + jax.random.normal(root["key"], x.shape) + jax.random.uniform(root["rng"].value, x.shape)


def _root():
    return {"key": jax.random.key(7), "rng": varstate.Variable(jax.random.key(3, impl="rbg"), name="rng"),
            "keys": jax.random.split(jax.random.key(1, impl="threefry2x32"), 4),
            "unread": varstate.Variable(jax.random.key(5, impl="philox4x32"), name="unread")}


def _same_key(got, want):
    assert str(jax.random.key_impl(got)) == str(jax.random.key_impl(want))
    assert got.shape == want.shape
    np.testing.assert_array_equal(jax.random.key_data(got), jax.random.key_data(want))


def test_prng_keys_round_trip_bare_and_in_variables(tmp_path):
    root = _root()
    path = checkpoint.export(tmp_path / "m", root, {"sample": (_sample, (X,))})
    loaded = checkpoint.load(path)
    _same_key(loaded.key, root["key"])
    _same_key(loaded.keys, root["keys"])
    for name in ("rng", "unread"):
        var = getattr(loaded, name)
        assert isinstance(var, varstate.Variable) and var.name == name
        _same_key(var.value, root[name].value)
    x = jnp.arange(3.0)
    np.testing.assert_array_equal(loaded.signatures["sample"](x), _sample(root, x))


def test_a_key_variable_is_described_as_its_key_data(tmp_path):
    path = checkpoint.export(tmp_path / "m", _root())
    nodes = pb.ExportDef.FromString(pathlib.Path(path, "export.pb").read_bytes()).object_graph.nodes
    described = {n.variable.name: (n.variable.dtype, [d.size for d in n.variable.shape.dim])
                 for n in nodes if n.WhichOneof("kind") == "variable"}
    # rbg keys are 4 words of key data, philox4x32 keys 2.
    assert described == {"rng": (types_pb2.DT_UINT32, [4]), "unread": (types_pb2.DT_UINT32, [2])}


def test_loaded_key_variable_exports_again_identically(tmp_path):
    root = _root()
    loaded = checkpoint.load(checkpoint.export(tmp_path / "a", root))
    again = checkpoint.load(checkpoint.export(tmp_path / "b", {"rng": loaded.rng, "key": loaded.key}))
    _same_key(again.rng.value, root["rng"].value)
    _same_key(again.key, root["key"])


def _rewrite_values(path, change):
    prefix = os.path.join(path, "variables", "variables")
    reader = checkpoint.read_checkpoint(prefix)
    tensors = {k: reader.get(k) for k in reader.keys()}
    change(tensors)
    tensors["_CHECKPOINTABLE_OBJECT_GRAPH"] = reader.object_graph.SerializeToString()
    write_bundle(prefix, tensors)


def test_damaged_key_implementation_is_a_format_error(tmp_path):
    path = checkpoint.export(tmp_path / "m", _root(), {"sample": (_sample, (X,))})
    _rewrite_values(path, lambda t: t.update({"key/.ATTRIBUTES/PRNG_KEY_IMPL": np.array(b"nope", dtype=object)}))
    with pytest.raises(CheckpointFormatError, match=r"node \d+ \(\(root\)\.key\): its key data \(uint32\[2\]\) is "
                                                    r"not a PRNG key of implementation 'nope' \(ValueError: "
                                                    r"unrecognized PRNG implementation.*export it again"):
        checkpoint.load(path)


def test_key_implementation_other_than_the_function_read_is_a_format_error(tmp_path):
    path = checkpoint.export(tmp_path / "m", _root(), {"sample": (_sample, (X,))})
    # threefry2x32 and philox4x32 keys have the same key data shape: the file is consistent but for the function.
    _rewrite_values(path, lambda t: t.update(
        {"key/.ATTRIBUTES/PRNG_KEY_IMPL": np.array(b"philox4x32", dtype=object)}))
    with pytest.raises(CheckpointFormatError, match=r"function '__inference_sample_0' reads \(root\)\.key as "
                                                    r"key<fry>, but the export holds it as key<phx4> "
                                                    r"\(the export is inconsistent\); export the model again"):
        checkpoint.load(path)


def test_key_implementation_that_is_not_one_string_is_a_format_error(tmp_path):
    path = checkpoint.export(tmp_path / "m", _root())
    _rewrite_values(path, lambda t: t.update({"rng/.ATTRIBUTES/PRNG_KEY_IMPL": np.zeros(2, np.int32)}))
    with pytest.raises(CheckpointFormatError, match=r"\(root\)\.rng\): its PRNG key implementation "
                                                    r"'rng/.ATTRIBUTES/PRNG_KEY_IMPL' should be one string, found 2 "
                                                    r"value\(s\) of dtype int32 \(the export is corrupt\)"):
        checkpoint.load(path)


def test_export_saved_model_names_a_numpy_int64_array_as_such(tmp_path):
    assert not jax.config.read("jax_enable_x64")
    root = {"w": varstate.Variable(jnp.ones(3), name="w"), "step": np.array(5, np.int64)}
    with pytest.raises(TypeError, match=r"export_saved_model: 'step' is a plain numpy int64 array \(not a Variable\), "
                                        r"but signature 's' reads it as int32 .* Store it as np\.int32 in the root "
                                        r"\(np\.asarray\(value, np\.int32\)\), or export with "
                                        r"jax\.config\.update\('jax_enable_x64', True\)"):
        checkpoint.export_saved_model(tmp_path / "sm", root, {"s": (lambda m, x: m["w"].value * x + m["step"], (X,))})
    # The fix the message names: the same root with an int32 array exports, and serves its value.
    root["step"] = np.asarray(root["step"], np.int32)
    path = checkpoint.export_saved_model(tmp_path / "ok", root, {"s": (lambda m, x: m["w"].value * x + m["step"],
                                                                       (X,))})
    reader = checkpoint.read_checkpoint(os.path.join(path, "variables", "variables"))
    assert reader.get("step/.ATTRIBUTES/VARIABLE_VALUE").dtype == np.int32


def test_unsortable_dict_keys_name_the_dict_and_keys(tmp_path):
    ckpt = checkpoint.Checkpoint(m={1: jnp.ones(1), "1": jnp.zeros(1)})
    with pytest.raises(ValueError, match=r"^Cannot checkpoint \(root\)\.m: it is a dict with keys 1 \(int\) and '1' "
                                         r"\(str\), which JAX cannot sort .* Use keys of one type, e\.g\. all str "
                                         r"\(\{str\(k\): v for k, v in d\.items\(\)\}\)\. Both would be saved as the "
                                         r"child '1', so rename one as well\.$"):
        ckpt.save(os.fspath(tmp_path / "a"))
    nested = checkpoint.Checkpoint(model={"layers": [{"w": jnp.ones(1), 2: jnp.ones(1)}]})
    with pytest.raises(ValueError, match=r"^Cannot checkpoint \(root\)\.model: its dict at layers\.0 has keys "
                                         r"'w' \(str\) and 2 \(int\), which JAX cannot sort"):
        nested.save(os.fspath(tmp_path / "b"))
    with pytest.raises(ValueError, match=r"^Cannot checkpoint export's root: its dict at layers\.0 has keys 'w'"):
        checkpoint.export(tmp_path / "e", {"layers": [{"w": jnp.ones(1), 2: jnp.ones(1)}]})
    # The fix the message names: keys of one type save and restore.
    fixed = {str(k): v for k, v in {2: jnp.ones(1), "w": jnp.zeros(1)}.items()}
    path = checkpoint.Checkpoint(m=fixed).save(os.fspath(tmp_path / "c"))
    np.testing.assert_array_equal(checkpoint.restore_arrays(path)["m"]["2"], np.ones(1))
