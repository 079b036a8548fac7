"""A TF quantized variable restored by `Checkpoint` saves back as its TF type (needs the lead's _seam/_build change).

Fixture: tests/data/tf_quantized/ (tests/data/make_tf_quantized_fixtures.py).
"""

import os

import jax.numpy as jnp
import numpy as np

import checkpoint
import varstate
from checkpoint import _dtypes

DATA = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(__file__))), "data", "tf_quantized")


def test_restored_quantized_variables_save_back_with_their_tf_dtype(tmp_path):
    r = varstate.Registry()
    template = {"qint8": varstate.Variable(jnp.zeros((2, 3), jnp.int8), name="a", registry=r),
                "quint8": varstate.Variable(jnp.zeros((2, 3), jnp.uint8), name="b", registry=r),
                "qint32": varstate.Variable(jnp.zeros((2, 3), jnp.int32), name="c", registry=r),
                "f": varstate.Variable(jnp.zeros(2), name="f", registry=r)}
    status = checkpoint.Checkpoint(**template).restore(os.path.join(DATA, "tf_object-1"))
    status.assert_consumed()
    roots = {k: getattr(status, k) for k in template}
    path = checkpoint.Checkpoint(**roots).write(str(tmp_path / "c"), format="tf")
    theirs, ours = checkpoint.read_checkpoint(os.path.join(DATA, "tf_object-1")), checkpoint.read_checkpoint(path)
    for key in theirs.keys():
        assert _dtypes.tf_name(ours.dtype(key)) == _dtypes.tf_name(theirs.dtype(key)), key
        np.testing.assert_array_equal(ours.get(key), theirs.get(key))
    assert _dtypes.tf_name(ours.dtype("qint8/.ATTRIBUTES/VARIABLE_VALUE")) == "qint8"
