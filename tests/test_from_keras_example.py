"""examples/from_keras.py: a Keras checkpoint's training continues in JAX and goes back in Keras's layout."""

import importlib.util
import os

import numpy as np

import checkpoint
from checkpoint import keras
from varstate.optimizers import keras as keras_opt

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")
spec = importlib.util.spec_from_file_location("from_keras_example", os.path.join(EXAMPLES, "from_keras.py"))
example = importlib.util.module_from_spec(spec)
spec.loader.exec_module(example)


def test_continues_keras_training_and_writes_keras_layout(tmp_path, capsys):
    out = str(tmp_path / "continued" / "ckpt")
    assert example.main(["--steps", "15", "--out", out]) == 0
    printed = capsys.readouterr().out
    assert "['kernel', 'bias', 'emb']: Keras iteration 3 -> 18, loss " in printed
    first, last = (float(x) for x in printed.split("loss ")[1].split(";")[0].split(" -> "))
    assert last < first
    before, _ = keras.load_optimizer_state(example.DEFAULT, keras_opt.Adam(0.01))
    after, state = keras.load_optimizer_state(out, keras_opt.Adam(0.01))
    assert state.non_slot("iteration").value.item() == 18
    assert all(not np.array_equal(np.asarray(a.value), np.asarray(b.value)) for a, b in zip(after, before, strict=True))
    keys = checkpoint.read_checkpoint(out).keys()
    theirs = checkpoint.read_checkpoint(example.DEFAULT).keys()
    assert sorted(keys) == sorted(theirs)  # the same keys Keras wrote, so Keras reads it as its own
