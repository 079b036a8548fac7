"""Narrowing 64-bit values to JAX's 32-bit types (x64 off) refuses any value that would change class.

Reference: numpy's IEEE float64 -> float32 conversion; a value changes class when a finite one
becomes inf or a nonzero one becomes 0. Each case goes through a real restore (name-based and
object-based) so the message names the checkpoint key.
"""

import os
import re

import jax.numpy as jnp
import numpy as np
import pytest

import checkpoint
import varstate
from checkpoint import _dtypes
from checkpoint._storage import write_bundle

FIX = (r"enable them with jax\.config\.update\('jax_enable_x64', True\), or cast the value yourself and assign "
       r"it, if the change is acceptable \(from a TF or orbax checkpoint: "
       r"checkpoint\.read_checkpoint\(path\)\.get\('{key}'\)\.astype\('float32'\)\)\.")


def _restore(tmp_path, stored):
    prefix = os.path.join(tmp_path, "ckpt")
    write_bundle(prefix, {"w": stored})
    w = varstate.Variable(jnp.zeros(np.shape(stored)), name="w", registry=varstate.Registry())
    return checkpoint.restore_by_name(prefix, {"w": w}).params["w"].value


@pytest.mark.parametrize("tiny", [1e-300, -1e-300, 5e-324, 1e-46])
def test_nonzero_that_float32_rounds_to_zero_is_refused(tmp_path, tiny):
    assert np.float32(tiny) == 0 and tiny != 0  # the reference: float32 has nothing that small
    with pytest.raises(ValueError) as err:
        _restore(tmp_path, np.array([1.0, tiny, 0.0]))
    assert str(err.value).startswith(f"Tensor 'w' (float64) holds {tiny}, which float32 rounds to 0, for variable "
                                     "'w' (float32; JAX's 64-bit types are disabled): enable them with ")
    assert re.search(FIX.format(key="w") + "$", str(err.value))


def test_overflow_to_inf_is_refused_with_the_fix(tmp_path):
    with pytest.raises(ValueError, match=r"Tensor 'w' \(float64\) holds -1e\+39, out of range for variable 'w' "
                                         r"\(float32; JAX's 64-bit types are disabled\): " + FIX.format(key="w")):
        _restore(tmp_path, np.array([2.0, -1e39]))


def test_values_that_keep_their_class_narrow(tmp_path):
    # Zeros, signed zeros, subnormals float32 can hold, inf and nan: each keeps its class.
    stored = np.array([0.0, -0.0, 1e-40, 3.4e38, np.inf, -np.inf, np.nan, 0.1])
    got = np.asarray(_restore(tmp_path, stored))
    np.testing.assert_array_equal(got, stored.astype(np.float32))
    assert got[2] != 0 and np.signbit(got[1])


def test_object_based_restore_names_its_key(tmp_path):
    import jax

    with jax.enable_x64(True):  # TF's float64 variable, saved while 64-bit types were on
        w = varstate.Variable(jnp.array([1e-300, 1.0], jnp.float64), name="w", registry=varstate.Registry())
        path = checkpoint.Checkpoint(w=w).save(os.path.join(tmp_path, "c"), format="tf")
    w32 = varstate.Variable(jnp.zeros(2), name="w", registry=varstate.Registry())
    key = "w/.ATTRIBUTES/VARIABLE_VALUE"
    with pytest.raises(ValueError, match=r"Tensor 'w/\.ATTRIBUTES/VARIABLE_VALUE' \(float64\) holds 1e-300, which "
                                         r"float32 rounds to 0, for variable '\(root\)\.w' \(float32; .*: "
                                         + FIX.format(key=re.escape(key))):
        checkpoint.Checkpoint(w=w32).restore(path)


def test_complex_narrowing_keeps_class():
    with pytest.raises(ValueError, match=r"holds \(1e-300\+0j\), which complex64 rounds to 0"):
        _dtypes.narrow(np.array([1e-300 + 0j]), np.dtype("complex64"), "z", "z")
    np.testing.assert_array_equal(_dtypes.narrow(np.array([1 + 2j]), np.dtype("complex64"), "z", "z"),
                                  np.array([1 + 2j], np.complex64))
