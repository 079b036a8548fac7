"""Review fixes in checkpoint.keras: a missing file is named as missing, and the shape and dtype errors of
save_weights(like=) and assign_weights say how to fix them.

Reference: the fixture mlp.weights.h5 that Keras wrote (tests/data/keras_weights), read back after each fix
the messages name.
"""

import os

import jax.numpy as jnp
import numpy as np
import pytest

import varstate
from checkpoint import keras
from varstate.optimizers import keras as keras_opt

DATA = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(__file__))), "data", "keras_weights")
MLP = os.path.join(DATA, "keras3", "mlp.weights.h5")


def _plain(weights):
    return {layer: {name: np.asarray(v.value) for name, v in ws.items()} for layer, ws in weights.items()}


def _assert_same(got, want):
    assert {k: sorted(v) for k, v in got.items()} == {k: sorted(v) for k, v in want.items()}
    for layer, ws in want.items():
        for name, value in ws.items():
            np.testing.assert_array_equal(np.asarray(got[layer][name]), value)


@pytest.mark.parametrize("name", ["nope.weights.h5", "nope.keras", "nope.h5"])
def test_a_missing_keras_file_is_named_as_missing(tmp_path, name):
    path = os.fspath(tmp_path / name)
    with pytest.raises(FileNotFoundError) as e:
        keras.load_weights(path)
    assert str(e.value) == (f"load_weights: {path} does not exist: no such file or directory. Check the path (a Keras "
                            "model writes it with model.save_weights('name.weights.h5') or model.save('name.keras')).")
    assert ".index" not in str(e.value) and "orbax" not in str(e.value)


def test_a_missing_path_of_another_name_and_a_missing_directory(tmp_path):
    path = os.fspath(tmp_path / "ckpt-1")
    with pytest.raises(FileNotFoundError, match=rf"^load_weights: {path} does not exist: no such file or directory, "
                                                rf"and it is no TF checkpoint prefix \(no {path}\.index\)\. Check the "
                                                "path"):
        keras.load_weights(path)
    deep = os.fspath(tmp_path / "gone" / "m.weights.h5")
    with pytest.raises(FileNotFoundError, match=rf"^load_weights: {deep} does not exist: no such file or directory "
                                                rf"\(its directory {tmp_path / 'gone'} does not exist either\)\."):
        keras.load_weights(deep)
    with pytest.raises(FileNotFoundError, match=r"^load_optimizer_state: .*nope\.weights\.h5 does not exist: no such "
                                                "file or directory"):
        keras.load_optimizer_state(os.fspath(tmp_path / "nope.weights.h5"), keras_opt.Adam(0.01))


def test_save_weights_shape_error_says_how_to_fix_it(tmp_path):
    want = _plain(keras.load_weights(MLP))
    transposed = {layer: dict(ws) for layer, ws in want.items()}
    transposed["dense"]["kernel"] = want["dense"]["kernel"].T  # an (out, in) kernel
    out = os.fspath(tmp_path / "a.weights.h5")
    with pytest.raises(ValueError, match=r"^'dense/kernel' has shape \(3, 4\), but the Keras layout of .*mlp\.weights"
                                         r"\.h5 has \(4, 3\), so Keras's model\.load_weights would refuse the file; it "
                                         r"looks transposed: pass its transpose \(\.T\) in Keras's \(4, 3\) layout, or "
                                         r"pass like= a file Keras wrote for the model these weights belong to$"):
        keras.save_weights(out, transposed, like=MLP)
    assert not os.path.exists(out)
    wrong = {layer: dict(ws) for layer, ws in want.items()}
    wrong["out"]["bias"] = np.zeros(5, np.float32)
    with pytest.raises(ValueError, match=r"^'out/bias' has shape \(5,\), but the Keras layout of .* has \(2,\), so "
                                         r"Keras's model\.load_weights would refuse the file; pass a value of that "
                                         r"shape, or pass like= a file Keras wrote"):
        keras.save_weights(out, wrong, like=MLP)
    transposed["dense"]["kernel"] = transposed["dense"]["kernel"].T  # the fix the message names
    _assert_same(_plain(keras.load_weights(keras.save_weights(out, transposed, like=MLP))), want)


def test_save_weights_dtype_error_says_how_to_fix_it(tmp_path):
    want = _plain(keras.load_weights(MLP))
    half = {layer: {n: jnp.asarray(v, jnp.bfloat16) for n, v in ws.items()} for layer, ws in want.items()}
    out = os.fspath(tmp_path / "b.weights.h5")
    with pytest.raises(ValueError, match=r"^'dense/kernel' is bfloat16, but the Keras layout of .* stores float32; "
                                         r"cast it \(value\.astype\('float32'\)\), or pass like= a file Keras wrote "
                                         r"for the model with bfloat16 weights$"):
        keras.save_weights(out, half, like=MLP)
    cast = {layer: {n: v.astype("float32") for n, v in ws.items()} for layer, ws in half.items()}
    back = _plain(keras.load_weights(keras.save_weights(out, cast, like=MLP)))
    _assert_same(back, {layer: {n: np.asarray(v) for n, v in ws.items()} for layer, ws in cast.items()})


def test_assign_weights_dtype_error_says_how_to_fix_it():
    weights = keras.load_weights(MLP)
    want = _plain(weights)
    ints = {layer: {n: np.zeros(v.shape, np.int32) for n, v in ws.items()} for layer, ws in want.items()}
    with pytest.raises(ValueError, match=r"^target leaf 'dense/bias' is int32, but Keras weight 'dense/bias' is "
                                         r"float32: a weight loads into a leaf of any float precision, never into one "
                                         r"of kind int\. Make the leaf float \(e\.g\. float32\) as in the model that "
                                         r"wrote the file$"):
        keras.assign_weights(ints, weights)
    mapped = {"w": np.zeros((4, 3), np.int32)}
    with pytest.raises(ValueError, match=r"Make the leaf float \(e\.g\. float32\) as in the model that wrote the file; "
                                         r"or fix name_map, if that is not this leaf's weight$"):
        keras.assign_weights(mapped, weights, {"w": "dense/kernel"}, strict=False)
    # Layers and weights paired by position (other names): the weight may be another leaf's.
    positional = [{"a": np.zeros((4, 3), np.float32), "b": np.zeros(3, np.int32)}, {"a": np.zeros((3, 3))},
                  {"a": np.zeros((3, 2)), "b": np.zeros(2)}]
    with pytest.raises(ValueError, match=r"^target leaf '0/b' is int32, but Keras weight 'dense/bias' is float32: .*"
                                         r"; or, if the leaves pair with Keras's weights in another order, pass a "
                                         r"name_map$"):
        keras.assign_weights(positional, weights)
    # The fix the message names: float leaves of any precision take the weights.
    halves = {layer: {n: jnp.zeros(v.shape, jnp.bfloat16) for n, v in ws.items()} for layer, ws in want.items()}
    got = keras.assign_weights(halves, weights)
    _assert_same({k: {n: np.asarray(v, np.float32) for n, v in ws.items()} for k, ws in got.items()},
                 {k: {n: np.asarray(jnp.asarray(v, jnp.bfloat16), np.float32) for n, v in ws.items()}
                  for k, ws in want.items()})


def test_assign_weights_shape_error_through_name_map_says_to_check_it():
    weights = keras.load_weights(MLP)
    with pytest.raises(ValueError, match=r"^target leaf 'w' has shape \(4, 3\), but Keras weight 'dense/bias' has "
                                         r"\(3,\); check name_map, which maps this leaf to that weight$"):
        keras.assign_weights({"w": np.zeros((4, 3))}, weights, {"w": "dense/bias"}, strict=False)
    got = keras.assign_weights({"w": varstate.Variable(jnp.zeros((4, 3)))}, weights, {"w": "dense/kernel"},
                               strict=False)
    np.testing.assert_array_equal(got["w"].value, _plain(weights)["dense"]["kernel"])
