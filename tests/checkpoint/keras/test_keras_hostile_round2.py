"""Hostile and unusual Keras HDF5 files, round two (issue 26 items 4, 6, 7): what a whole file may ask for, work
linear in layers, and HDF5 dtypes that are valid but rare.
"""

import h5py
import numpy as np
import pytest

from checkpoint import CheckpointFormatError, keras


def _keras3_file(path, build):
    with h5py.File(path, "w") as f:
        f.create_group("vars").attrs["name"] = "model"
        build(f)
    return str(path)


def test_a_file_may_not_ask_for_far_more_than_its_size_in_all(tmp_path):
    # 120 datasets of 64 MiB each, declared but never written: each is at the per-dataset floor, so only a
    # bound on the whole file stops a file of a few hundred KB asking for 7.5 GB.
    def many(f):
        g = f.create_group("layers/dense/vars")
        for i in range(120):
            g.create_dataset(str(i), shape=(16 << 20,), dtype=np.float32)

    path = _keras3_file(tmp_path / "many.weights.h5", many)
    with pytest.raises(CheckpointFormatError, match=r"many.weights.h5: layers/dense/vars/\d+ takes what the file's "
                                                    r"datasets declare past \d+ bytes in all \(1024x the file's size"):
        keras.load_weights(path)

    legacy = str(tmp_path / "legacy.h5")
    with h5py.File(legacy, "w") as f:
        names = [f"dense/w{i}:0".encode() for i in range(120)]
        f.attrs["layer_names"] = [b"dense"]
        f.create_group("dense").attrs["weight_names"] = names
        for name in names:
            f["dense"].create_dataset(name.decode(), shape=(16 << 20,), dtype=np.float32)
    with pytest.raises(CheckpointFormatError, match=r"legacy.h5: dense/dense/w\d+:0 takes what the file's datasets "
                                                    r"declare past \d+ bytes in all"):
        keras.load_weights(legacy)


def test_reading_is_linear_in_layers(tmp_path, monkeypatch):
    # Counted, not timed: the reader used to compare each new layer's path with every layer read before it
    # (4,000 layers: 8 million comparisons, 10 s). Reading n layers may touch a layout's path a few times per layer.
    def layers(f):
        for i in range(1000):
            f.create_group(f"layers/dense_{i}/vars")["0"] = np.ones(1, np.float32)

    path = _keras3_file(tmp_path / "wide.weights.h5", layers)
    reads = 0
    field = keras.LayerLayout.path

    def counted(self):
        nonlocal reads
        reads += 1
        return field.__get__(self)

    monkeypatch.setattr(keras.LayerLayout, "path", property(counted))
    w = keras.load_weights(path)
    assert len(w) == 1000 and len(w.layout) == 1001
    assert reads <= 4 * 1001, reads


def test_big_endian_datasets_read_as_their_values(tmp_path):
    kernel = np.arange(6, dtype=">f4").reshape(2, 3) - 2.5
    counts = np.array([1, -2, 3 << 20], ">i8")

    def big_endian(f):
        g = f.create_group("layers/dense/vars")
        g["0"], g["1"] = kernel, counts

    w = keras.load_weights(_keras3_file(tmp_path / "be.weights.h5", big_endian))
    np.testing.assert_array_equal(np.asarray(w["dense"]["kernel"].value), kernel)
    np.testing.assert_array_equal(np.asarray(w["dense"]["bias"].value), counts)
    assert w.layout[1].dtypes[0] == "float32"


@pytest.mark.parametrize(("value", "message"), [
    (np.ones(2, np.longdouble), r"has dtype float128; Keras weights are numbers of at most 64 bits"),
    (h5py.Empty("f4"), r"has a null dataspace \(no value\); Keras stores every weight with a shape"),
])
def test_unusual_datasets_are_refused_by_name(tmp_path, value, message):
    if np.dtype(np.longdouble).itemsize == 8 and not isinstance(value, h5py.Empty):
        pytest.skip("long double is float64 on this platform")

    def odd(f):
        f.create_group("layers/dense/vars").create_dataset("0", data=value)

    path = _keras3_file(tmp_path / "odd.weights.h5", odd)
    with pytest.raises(CheckpointFormatError, match=r"odd.weights.h5: layers/dense/vars/0 " + message):
        keras.load_weights(path)
