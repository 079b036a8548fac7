"""A TF checkpoint written by 2 processes (tests/data/tf_multiprocess, made by hand): TensorFlow read it, and so do we.

tests/data/write_multiprocess_for_tf.py wrote it with 2 jax.distributed
processes (each its own data file, one merged index);
make_tf_multiprocess_readback.py recorded what TensorFlow read.
"""

import json
import os

import numpy as np

import checkpoint
from checkpoint._storage import BundleReader

DATA = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data", "tf_multiprocess")
EXPECTED = {  # what child_tf_fixture.py saved, by formula
    "model/rows/.ATTRIBUTES/VARIABLE_VALUE": np.arange(16 * 3, dtype=np.float32).reshape(16, 3),
    "model/cols/.ATTRIBUTES/VARIABLE_VALUE": np.arange(2 * 8, dtype=np.int32).reshape(2, 8) - 5,
    "model/rep/.ATTRIBUTES/VARIABLE_VALUE": np.linspace(0, 1, 5).astype(np.float32),  # jax without x64
    "model/emb/.ATTRIBUTES/VARIABLE_VALUE": np.arange(16 * 2, dtype=np.float32).reshape(16, 2) / 4,
}


def test_tensorflow_read_every_value_of_the_two_process_bundle():
    with open(os.path.join(DATA, "tf_read.json")) as f:
        seen = json.load(f)["tensors"]
    assert sorted(seen) == sorted(EXPECTED)
    for key, want in EXPECTED.items():
        assert seen[key]["shape"] == list(want.shape) and seen[key]["dtype"] == str(want.dtype), key
        np.testing.assert_array_equal(np.asarray(seen[key]["value"], want.dtype), want, err_msg=key)


def test_our_reader_reads_the_merged_index_and_both_data_files():
    prefix = os.path.join(DATA, "ckpt")
    bundle = BundleReader(prefix)
    assert bundle.num_shards == 2
    shards = {bundle.entry(k).shard_id for k in EXPECTED if not bundle.get_slices(k)}
    assert shards == {0}  # values every process holds whole: process 0's file
    assert len(bundle.get_slices("model/rows/.ATTRIBUTES/VARIABLE_VALUE")) == 8
    assert len(bundle.get_slices("model/emb/.ATTRIBUTES/VARIABLE_VALUE")) == 16  # 2 shards x 8 devices
    reader = checkpoint.read_checkpoint(prefix)
    for key, want in EXPECTED.items():
        np.testing.assert_array_equal(reader.get(key), want, err_msg=key)
    # Process 1's data file holds the slices of its devices (4 of "rows", 4 of "cols", 8 of "emb").
    in_second = [k for k in EXPECTED if bundle.get_slices(k)]
    assert sorted(in_second) == sorted(set(EXPECTED) - {"model/rep/.ATTRIBUTES/VARIABLE_VALUE"})
    assert os.path.getsize(prefix + ".data-00001-of-00002") == 4 * (2 * 3 * 4 + 2 * 1 * 4 + 2 * 2 * 4)
