"""Damaged HDF5 files end in bounded time with the library's error (issue 26 item 3): libhdf5 looped forever on a
one-byte change of a global heap collection, crashed on a damaged variable-length type, and zeroed gigabytes for a
damaged heap id. Each damaged file is read in a child process with a timeout, so that a regression fails the test
instead of hanging or crashing the suite.
"""

import json
import pathlib
import shutil
import subprocess
import sys

import h5py
import numpy as np
import pytest

from checkpoint import CheckpointFormatError, keras
from checkpoint.keras import _hdf5
from varstate.optimizers import keras as keras_opt

_DATA = pathlib.Path(__file__).parents[2] / "data"
_LEGACY = _DATA / "keras_weights" / "tf_keras" / "mlp.h5"
_REPRO = _DATA / "keras_weights" / "hostile" / "heap-one-byte.h5"

# Reads each damaged copy of a file and prints one JSON line per input: its outcome, the exception's type and
# message, the seconds it took. "start" lines come first, so that the parent names the input a hang was on.
_CHILD = r"""
import json, random, sys, time
from checkpoint import keras
source, out, spec = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
original = open(source, "rb").read()
if spec["seed"] is None:
    flips = spec["flips"]
else:
    rng = random.Random(spec["seed"])
    flips = [(rng.randrange(len(original)), rng.randrange(1, 256)) for _ in range(spec["count"])]
for offset, xor in flips:
    data = bytearray(original)
    data[offset] ^= xor
    with open(out, "wb") as f:
        f.write(data)
    print(json.dumps({"start": [offset, xor]}), flush=True)
    started = time.monotonic()
    try:
        keras.load_weights(out)
        result = {"type": None, "message": ""}
    except Exception as e:
        result = {"type": type(e).__name__, "message": str(e)}
    result.update(input=[offset, xor], seconds=time.monotonic() - started)
    print(json.dumps(result), flush=True)
"""


def _read_damaged(source, tmp_path, *, flips=None, seed=None, count=0, timeout=120):
    out = tmp_path / pathlib.Path(source).name
    spec = json.dumps({"flips": flips, "seed": seed, "count": count})
    try:
        done = subprocess.run([sys.executable, "-c", _CHILD, str(source), str(out), spec], capture_output=True,
                              text=True, timeout=timeout, cwd=pathlib.Path(__file__).parents[3])
    except subprocess.TimeoutExpired as e:
        output = e.stdout.decode() if isinstance(e.stdout, bytes) else e.stdout or ""
        lines = output.splitlines()
        pytest.fail(f"reading damaged copies of {source} did not end in {timeout} s; the last input started: "
                    f"{lines[-1] if lines else 'none'}")
    assert done.returncode == 0, f"reader crashed (exit {done.returncode}): {done.stdout[-2000:]}{done.stderr[-2000:]}"
    results = [json.loads(line) for line in done.stdout.splitlines() if '"start"' not in line]
    return out, results


def test_the_one_byte_heap_repro_ends_in_the_librarys_error(tmp_path):
    # heap-one-byte.h5 is tf_keras/mlp.h5 with byte 2145 (a heap object's size, in the collection holding
    # layer_names) 0x00 -> 0x04: libhdf5's walk of the collection then lands on a free-space object of size 0 and
    # never ends.
    original, damaged = _LEGACY.read_bytes(), _REPRO.read_bytes()
    assert [i for i in range(len(original)) if original[i] != damaged[i]] == [2145]
    out, [result] = _read_damaged(_REPRO, tmp_path, flips=[[0, 0]])  # xor 0: the repro as it is
    assert result["type"] == "CheckpointFormatError", result
    assert result["message"].startswith(f"{out}: /: attribute 'layer_names' cannot be read (KeyError: 5); the file "
                                        "is damaged"), result
    assert result["seconds"] < 10, result


def test_damaged_variable_length_data_is_refused_or_read_from_the_heap(tmp_path):
    # 11921: the vlen type of out's weight_names, made a sequence (libhdf5 crashed converting it);
    # 11971: the top byte of a heap id's length (libhdf5 zeroed 4 GiB before comparing it with the heap's object).
    out, results = _read_damaged(_LEGACY, tmp_path, flips=[[11921, 4], [11921, 255], [11971, 255], [11987, 128]])
    for result in results[:2]:
        assert result["type"] == "CheckpointFormatError", result
        assert result["message"] == (f"{out}: out: attribute 'weight_names' is of HDF5 type class 9, where Keras "
                                     "writes numbers or strings; the file is damaged or was not written by Keras")
    # The strings are read from the heap's objects, whose sizes are checked; the ids' own lengths are not used.
    assert [r["type"] for r in results[2:]] == [None, None], results
    assert all(r["seconds"] < 10 for r in results), results


@pytest.mark.parametrize("fixture", ["tf_keras/mlp.h5", "keras3/mlp.weights.h5", "ours/mlp.weights.h5"])
def test_single_byte_changes_end_in_the_librarys_errors_in_bounded_time(tmp_path, fixture):
    out, results = _read_damaged(_DATA / "keras_weights" / fixture, tmp_path, seed=26_3, count=150, timeout=240)
    assert len(results) == 150
    for r in results:
        if r["type"] is not None:
            assert r["type"] in ("CheckpointFormatError", "DataLossError"), r
            assert str(out) in r["message"], r
        assert r["seconds"] < 10, r
    assert sum(r["type"] is not None for r in results) >= 10  # the changes reach the reader's checks


def test_string_attributes_read_as_before(tmp_path):
    path = str(tmp_path / "strings.h5")
    with h5py.File(path, "w") as f:
        f.attrs["vlen"] = "model"
        f.attrs["vlen_list"] = np.array(["a", "bé"], dtype=h5py.string_dtype())
        f.attrs["fixed"] = np.bytes_("fixed")
        f.attrs["number"] = 3
        f.attrs["bad_utf8"] = np.array([b"\xff"], dtype=h5py.string_dtype("ascii"))
        f.attrs.create("compound", np.zeros(1, [("a", "i4")]))
    with _hdf5.open_file(path) as f:
        assert _hdf5.attribute(f, "vlen", None, "here") == "model"
        assert _hdf5.attribute(f, "vlen_list", None, "here") == ["a", "bé"]
        assert _hdf5.attribute(f, "fixed", None, "here") == b"fixed"
        assert _hdf5.attribute(f, "number", None, "here") == 3
        assert _hdf5.attribute(f, "missing", "default", "here") == "default"
        with pytest.raises(CheckpointFormatError, match=r"here: attribute 'bad_utf8' is not UTF-8 text"):
            _hdf5.attribute(f, "bad_utf8", None, "here")
        with pytest.raises(CheckpointFormatError, match=r"here: attribute 'compound' is of HDF5 type class 6, where "
                                                        "Keras writes numbers or strings"):
            _hdf5.attribute(f, "compound", None, "here")


def test_the_string_reader_has_a_bounded_budget(monkeypatch):
    # pyfive reads the strings through a file that counts what it reads: a damaged header chain (a continuation
    # pointing back at itself) ends at the budget. Here the budget is set below what an honest file needs.
    monkeypatch.setattr(_hdf5, "_BUDGET_FLOOR", 64)
    monkeypatch.setattr(_hdf5, "_BUDGET_RATIO", 0)
    with pytest.raises(CheckpointFormatError, match=r"mlp.h5: reading its string attributes takes more than 64 "
                                                    r"bytes of reads; the file's metadata is damaged or crafted"):
        keras.load_weights(str(_LEGACY))


def test_optimizer_state_reads_only_datasets_stored_in_the_file(tmp_path):
    source = _DATA / "keras_optimizers" / "keras3_h5" / "adam.weights.h5"
    optimizer = keras_opt.Adam(0.01, amsgrad=True)
    params, _ = keras.load_optimizer_state(str(source), optimizer)  # as Keras wrote it

    outside = tmp_path / "outside.bin"
    external, soft = tmp_path / "external.weights.h5", tmp_path / "soft.weights.h5"
    for path in (external, soft):
        shutil.copyfile(source, path)
    with h5py.File(external, "a") as f:
        value = f["optimizer/vars/3"][()]
        outside.write_bytes(value.tobytes())
        del f["optimizer/vars/3"]
        f["optimizer/vars"].create_dataset("3", shape=value.shape, dtype=value.dtype,
                                           external=[(str(outside), 0, value.nbytes)])
    with pytest.raises(CheckpointFormatError, match=r"external.weights.h5: optimizer/vars/3 is not a dataset stored "
                                                    "in this file"):
        keras.load_optimizer_state(str(external), optimizer, params)
    with h5py.File(soft, "a") as f:
        del f["optimizer/vars/3"]
        f["optimizer/vars/3"] = h5py.SoftLink("/optimizer/vars/4")
    with pytest.raises(CheckpointFormatError, match=r"soft.weights.h5: optimizer/vars/3 is a SoftLink; links are not "
                                                    "followed"):
        keras.load_optimizer_state(str(soft), optimizer, params)


def test_a_member_name_that_is_not_utf8_is_named(tmp_path):
    # One byte of a dataset's link name (h5py lists such a name as bytes, which the reader sorted with str).
    path = tmp_path / "mlp.weights.h5"
    data = bytearray((_DATA / "keras_weights" / "keras3" / "mlp.weights.h5").read_bytes())
    data[10224] ^= 218
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointFormatError, match=r"mlp.weights.h5: layers/dense/vars holds a member whose name is "
                                                    r"not UTF-8 \(b'\\xeb'\); the file is damaged"):
        keras.load_weights(str(path))


def test_one_file_opened_twice_reads_its_strings_in_both():
    # libhdf5 gives both opens one file number; closing the inner one must leave the outer one readable.
    with _hdf5.open_file(str(_LEGACY)) as outer:
        with _hdf5.open_file(str(_LEGACY)) as inner:
            assert _hdf5.attribute(inner, "layer_names", None, "inner") == ["input_1", "dense", "proj", "out"]
        assert _hdf5.attribute(outer, "layer_names", None, "outer") == ["input_1", "dense", "proj", "out"]
    with h5py.File(_LEGACY, "r") as f, pytest.raises(
            RuntimeError, match=r"here: the file was not opened by checkpoint.keras._hdf5; open it with open_file"):
        _hdf5.attribute(f, "layer_names", None, "here")
