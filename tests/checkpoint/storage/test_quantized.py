"""TF's quantized dtypes (qint8, quint8, qint16, quint16, qint32): read as integer storage, written back as TF's type.

Fixtures: tests/data/make_tf_quantized_fixtures.py (TF writes, then TF checks what
tests/data/write_quantized_ours.py wrote back from what we read).
"""

import importlib.util
import json
import os

import jax.numpy as jnp
import numpy as np
import pytest

import checkpoint
import varstate
from checkpoint import _dtypes
from checkpoint._storage import write_bundle

DATA = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(__file__))), "data")
OUT = os.path.join(DATA, "tf_quantized")
with open(os.path.join(OUT, "expected.json")) as f:
    EXPECTED = json.load(f)
with open(os.path.join(OUT, "tf_readback.json")) as f:
    TF_SAW = json.load(f)
STORAGE = {"qint8": np.int8, "quint8": np.uint8, "qint16": np.int16, "quint16": np.uint16, "qint32": np.int32}


def _writer():
    spec = importlib.util.spec_from_file_location("write_quantized_ours", os.path.join(DATA, "write_quantized_ours.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("prefix", ["tf_object-1", "tf_name"])
def test_tf_written_quantized_values_read_as_integer_storage(prefix):
    reader = checkpoint.read_checkpoint(os.path.join(OUT, prefix))
    seen = 0
    for key in reader.keys():
        want = EXPECTED.get(f"{prefix}:{key}")
        if want is None:
            continue
        value = reader.get(key)
        storage = STORAGE[want["dtype"]] if want["dtype"] in STORAGE else np.dtype(want["dtype"])
        assert value.dtype == storage and reader.dtype(key) == storage
        assert _dtypes.tf_name(value.dtype) == (want["dtype"] if want["dtype"] in STORAGE else None)
        np.testing.assert_array_equal(value, np.array(want["values"], storage).reshape(want["shape"]))
        # The integer storage computes as a plain integer array.
        assert (value.astype(np.int64) + 1).tolist() == (np.array(want["values"], np.int64) + 1).reshape(
            want["shape"]).tolist()
        seen += 1
    assert seen == sum(k.startswith(prefix + ":") for k in EXPECTED)


@pytest.mark.parametrize("ours, theirs", [("ours_object-1", "tf_object-1"), ("ours_name", "tf_name")])
def test_written_back_with_the_tf_dtype_and_read_by_tensorflow(tmp_path, ours, theirs):
    target = _writer().write_back(os.path.join(OUT, theirs), str(tmp_path / ours))
    # What we write today is byte for byte the file TF checked (step 3 of the fixture script).
    for suffix in (".index", ".data-00000-of-00001"):
        with open(target + suffix, "rb") as a, open(os.path.join(OUT, ours + suffix), "rb") as b:
            assert a.read() == b.read(), suffix
    checked = 0
    for what, seen in TF_SAW.items():
        verb, _, rest = what.partition(" ")
        prefix, _, key = rest.partition(":")
        if prefix != ours:
            continue
        full_key = key if verb != "Checkpoint.read" else f"{key}/.ATTRIBUTES/VARIABLE_VALUE"
        want = EXPECTED[f"{theirs}:{full_key}"]
        assert seen["dtype"] == want["dtype"], what  # TF saw its own quantized type, not the storage integer
        assert seen["values"] == want["values"], what
        checked += 1
    assert checked == {"ours_name": 10, "ours_object-1": 8}[ours]


def test_tagging_an_array_writes_a_quantized_type(tmp_path):
    prefix = str(tmp_path / "q")
    tagged = np.array([-3, 4], np.int16).astype(_dtypes.quantized("qint16"))
    write_bundle(prefix, {"q": tagged, "plain": np.array([-3, 4], np.int16)})
    reader = checkpoint.read_checkpoint(prefix)
    assert _dtypes.tf_name(reader.dtype("q")) == "qint16" and _dtypes.tf_name(reader.dtype("plain")) is None
    assert reader.get("q").tolist() == [-3, 4]
    assert _dtypes.ENUM_OF[reader.dtype("q")] == 15 and _dtypes.ENUM_OF[reader.dtype("plain")] == 5
    with pytest.raises(ValueError, match=r"'qint4' is not a TF quantized type; expected one of \['qint16', "
                                         r"'qint32', 'qint8', 'quint16', 'quint8'\]"):
        _dtypes.quantized("qint4")


def test_quantized_values_restore_into_integer_variables():
    r = varstate.Registry()
    q8 = varstate.Variable(jnp.zeros((2, 3), jnp.int8), name="q8", registry=r)
    status = checkpoint.restore_by_name(os.path.join(OUT, "tf_name"), {"q": q8}, {"qint8": "q8"})
    np.testing.assert_array_equal(status.params["q"].value, np.array(EXPECTED["tf_name:qint8"]["values"],
                                                                     np.int8).reshape(2, 3))
    u8 = varstate.Variable(jnp.zeros((2, 3), jnp.uint8), name="u", registry=r)
    restored = checkpoint.Checkpoint(quint8=u8).restore(os.path.join(OUT, "tf_object-1")).expect_partial()
    np.testing.assert_array_equal(restored.quint8.value, np.array(EXPECTED["tf_object-1:quint8/.ATTRIBUTES/"
                                                                        "VARIABLE_VALUE"]["values"]).reshape(2, 3))
    wrong = varstate.Variable(jnp.zeros((2, 3), jnp.int16), name="w", registry=r)
    with pytest.raises(TypeError, match=r"Dtype of variable 'w' \(int16\) does not match the dtype of tensor "
                                        r"'qint8' \(int8\)"):
        checkpoint.restore_by_name(os.path.join(OUT, "tf_name"), [wrong], {"qint8": "w"})
