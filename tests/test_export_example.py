"""examples/export_and_serve.py: the process that serves the export computes what the training code computes."""

import importlib.util
import os
import re

import numpy as np

import checkpoint

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")
spec = importlib.util.spec_from_file_location("export_and_serve_example", os.path.join(EXAMPLES, "export_and_serve.py"))
example = importlib.util.module_from_spec(spec)
spec.loader.exec_module(example)


def test_export_and_serve(tmp_path, capsys):
    path = str(tmp_path / "model")
    assert example.main(["--dir", path, "--steps", "40"]) == 0
    out = capsys.readouterr().out
    assert "served by a new process (training code imported there: []):" in out
    assert out.rstrip().endswith("OK: the export serves what the trained model computes")
    losses = [float(x) for x in re.findall(r"loss (\d+\.\d+)", out)]
    assert len(losses) == 5 and losses[-1] < losses[0] / 4  # it trained
    served = [float(x) for x in re.search(r"predictions: \[(.*)\]", out)[1].split(", ")]
    # The reference: the example's own Python forward pass, on the variables restored from the export.
    loaded = checkpoint.load(path)
    batch, _ = example.data(seed=1, n=5)
    want = np.asarray(example.serve({"layers": loaded.layers}, batch))
    np.testing.assert_allclose(served, want, atol=1e-4)
    np.testing.assert_allclose(loaded.signatures["serve"](batch), want, rtol=1e-6, atol=1e-6)
    assert re.search(r"variables: \['hidden/b', 'hidden/w', 'out/b', 'out/w'\]", out)
