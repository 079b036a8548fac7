"""A save never changes the caller's numpy arrays, nor makes them read-only (issue 11, item 4)."""

import ml_dtypes
import numpy as np
import pytest

import checkpoint
from checkpoint._storage import _orbax, _orbax_layout
from checkpoint.protos.trackable_object_graph_pb2 import TrackableObjectGraph


def _arrays():
    big = 300_000  # over the packing limit: its own orbax array, and a TF value checksummed beside its write
    return {
        "small": np.arange(5, dtype=np.float32),
        "small_int": np.arange(6, dtype=np.int64).reshape(2, 3),
        "small_bf16": np.arange(4).astype(ml_dtypes.bfloat16),
        "big": np.linspace(0, 1, big, dtype=np.float32),
        "big_f64": np.arange(big, dtype=np.float64),
        "big_u4": (np.arange(2 * _orbax_layout.BATCH_LIMIT) % 16).astype(ml_dtypes.uint4),  # widened for tensorstore
        "strided": np.arange(40, dtype=np.float32)[::2],  # not contiguous: copied for its bytes
        "fortran": np.asfortranarray(np.arange(12, dtype=np.float32).reshape(3, 4)),
    }


@pytest.mark.parametrize("fmt", ["orbax", "tf"])
def test_saved_arrays_stay_writeable_and_unchanged(tmp_path, fmt):
    arrays = _arrays()
    copies = {k: v.copy() for k, v in arrays.items()}
    path = checkpoint.Checkpoint(**arrays).write(str(tmp_path / "c"), format=fmt)
    reader = checkpoint.read_checkpoint(path)
    for name, array in arrays.items():
        assert array.flags.writeable, name
        assert array.dtype == copies[name].dtype and array.tobytes() == copies[name].tobytes(), name
        array[...] = 0  # the caller may go on using its array; what was saved does not change with it
    for name, want in copies.items():
        got = reader.get(f"{name}/.ATTRIBUTES/VARIABLE_VALUE")
        assert got.dtype == want.dtype and np.array_equal(got, want), name


def test_layout_neither_copies_nor_locks_large_values_it_only_reads():
    arrays = _arrays()
    tree, meta = _orbax.layout(dict(arrays), TrackableObjectGraph())
    for name, array in arrays.items():
        assert array.flags.writeable, name
    assert any(v is arrays["big"] for v in tree.values())  # handed to orbax as it is: no copy of large values
    assert meta["crc32c"] == _orbax.crc32c(_orbax_layout.canonical(meta))


def test_an_asynchronous_save_neither_locks_the_arrays_nor_sees_later_changes(tmp_path):
    arrays = _arrays()
    copies = {k: v.copy() for k, v in arrays.items()}
    tree, meta = _orbax.layout({f"{k}/.ATTRIBUTES/VARIABLE_VALUE": v for k, v in arrays.items()},
                               TrackableObjectGraph())
    saver = _orbax.checkpointer(async_save=True)
    saver.save(str(tmp_path / "c"), args=_orbax.save_args(tree, meta))
    for name, array in arrays.items():  # while the save runs
        assert array.flags.writeable, name
        array[...] = 0
    saver.wait_until_finished()
    saver.close()
    reader = _orbax.OrbaxReader(str(tmp_path / "c"))
    for name, want in copies.items():
        got = reader.get(f"{name}/.ATTRIBUTES/VARIABLE_VALUE")
        assert got.dtype == want.dtype and np.array_equal(got, want), name
