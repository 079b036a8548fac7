"""examples/tf_checkpoint_into_nnx.py: TF checkpoints restored into flax nnx models reproduce TF/Keras.

Reference: what TF and Keras recorded when they wrote the fixtures (the Keras model's outputs on a probe
batch in tests/data/keras_weights/expected.json, the checkpoint's values in tests/data/tf_object_graph).
"""

import importlib.util
import json
import os
import subprocess
import sys

import jax.numpy as jnp
import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "tf_checkpoint_into_nnx.py")
spec = importlib.util.spec_from_file_location("tf_checkpoint_into_nnx", EXAMPLE)
example = importlib.util.module_from_spec(spec)
spec.loader.exec_module(example)


def test_runs_and_reports_ok(newcomer_env):
    out = subprocess.run([sys.executable, EXAMPLE], env=newcomer_env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().endswith("OK: the nnx models hold TF's values")


def test_the_nnx_mlp_gives_keras_outputs_and_the_module_tfs_values(capsys):
    assert example.keras_checkpoint() and example.object_graph_checkpoint()
    with open(os.path.join(ROOT, "tests", "data", "keras_weights", "expected.json")) as f:
        recorded = json.load(f)["models"]["tf_keras/mlp"]
    printed = capsys.readouterr().out
    first = np.asarray(recorded["outputs"], np.float64).round(4).tolist()[0]
    assert str(first) in printed
    # A model left with its own initial weights does not give Keras's outputs: the check can fail.
    fresh = example.MLP(example.nnx.Rngs(0))
    assert not np.allclose(fresh(jnp.asarray(recorded["probe"])), recorded["outputs"], atol=1e-6)
