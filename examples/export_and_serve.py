"""Train a small model, export it, and serve a batch from a process that has none of the training code.

    python examples/export_and_serve.py                          # export into a temporary directory
    python examples/export_and_serve.py --dir /tmp/model --steps 300

The training half (this file) fits an MLP of varstate Variables with varstate
Adam and exports it with `checkpoint.export`: a `serve` signature that takes
a batch of any size, and the model's variables. The serving half is `SERVER`,
a separate script run by a new Python process: it never imports this file or
its directory, only `checkpoint` and numpy; it loads the export and answers a
batch. Its predictions are compared with the trained model's own.

Loading an export runs the compiled code in it: serve exports you made or
trust, as you would run their code.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
import tempfile

import jax
import jax.numpy as jnp
import numpy as np

import checkpoint
import varstate
from varstate.optimizers import Adam

SIZES = (4, 32, 1)
# The exported batch dimension is symbolic: the served function takes any number of rows.
BATCH_SPEC = jax.ShapeDtypeStruct(jax.export.symbolic_shape("batch, 4"), jnp.float32)

SERVER = r"""
import json, os, sys

import numpy as np

import checkpoint

model = checkpoint.load(sys.argv[1])
batch = np.asarray(json.load(sys.stdin), np.float32)
predictions = np.asarray(model.signatures["serve"](batch))
training_code = [m for m, mod in sys.modules.items()
                 if os.path.dirname(os.path.abspath(getattr(mod, "__file__", None) or os.devnull)) == sys.argv[2]]
names = sorted(v.name for layer in model.layers.values() for v in layer.values())
print(json.dumps({"predictions": predictions.tolist(), "training code imported": training_code, "variables": names}))
"""


def make_model(seed: int) -> dict:
    rng = np.random.default_rng(seed)
    layers = {}
    for name, (n_in, n_out) in zip(("hidden", "out"), itertools.pairwise(SIZES), strict=True):
        layers[name] = {
            "w": varstate.Variable(rng.standard_normal((n_in, n_out), np.float32) / np.float32(n_in**0.5),
                                   name=f"{name}/w"),
            "b": varstate.Variable(jnp.zeros(n_out), name=f"{name}/b"),
        }
    return {"layers": layers}


def serve(model: dict, x: jax.Array) -> jax.Array:
    hidden, out = model["layers"]["hidden"], model["layers"]["out"]
    h = jnp.tanh(x @ hidden["w"].value + hidden["b"].value)
    return (h @ out["w"].value + out["b"].value)[:, 0]


def data(seed: int, n: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, SIZES[0])).astype(np.float32)
    return x, (np.sin(x[:, 0]) + 0.5 * x[:, 1] * x[:, 2]).astype(np.float32)


@jax.jit
def loss_and_grads(model: dict, x: jax.Array, y: jax.Array):
    return jax.value_and_grad(lambda m: jnp.mean((serve(m, x) - y) ** 2))(model)


def train(steps: int, seed: int = 0) -> dict:
    model, opt = make_model(seed), Adam(3e-2)
    state = opt.init(model)
    x, y = data(seed, 256)
    for step in range(1, steps + 1):
        loss, grads = loss_and_grads(model, x, y)
        model, state = opt.apply_gradients(grads, model, state)
        if step == 1 or step % (steps // 4 or 1) == 0:
            print(f"  step {step:4d}  loss {float(loss):.4f}")
    return model


def serve_elsewhere(export_dir: str, batch: np.ndarray) -> dict:
    """Runs SERVER in a new process, from a directory where this file cannot be imported."""
    here = os.path.dirname(os.path.abspath(__file__))
    package_root = os.path.dirname(os.path.dirname(os.path.abspath(checkpoint.__file__)))
    env = dict(os.environ, PYTHONPATH=package_root)  # where checkpoint is; not this file's directory
    with tempfile.TemporaryDirectory() as cwd:
        done = subprocess.run([sys.executable, "-c", SERVER, export_dir, here], input=json.dumps(batch.tolist()),
                              capture_output=True, text=True, cwd=cwd, env=env, timeout=300, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"the serving process failed:\n{done.stderr}")
    return json.loads(done.stdout)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", default=None, help="export directory (new or empty; default: a temporary one)")
    p.add_argument("--steps", type=int, default=200)
    args = p.parse_args(argv)

    print(f"training an MLP {SIZES} for {args.steps} steps")
    model = train(args.steps)
    with tempfile.TemporaryDirectory() as tmp:
        path = checkpoint.export(args.dir or os.path.join(tmp, "model"), model, {"serve": (serve, (BATCH_SPEC,))})
        print(f"exported to {'the temporary directory' if args.dir is None else path}: "
              f"{sorted(os.listdir(path))}")
        batch, _ = data(seed=1, n=5)
        served = serve_elsewhere(path, batch)
    want = np.asarray(jax.jit(serve)(model, batch))
    got = np.asarray(served["predictions"], np.float32)
    print(f"served by a new process (training code imported there: {served['training code imported']}):")
    print(f"  variables: {served['variables']}")
    print(f"  predictions: {[round(float(v), 4) for v in got]}")
    print(f"  max |served - trained| = {np.abs(got - want).max():.3g}")
    ok = not served["training code imported"] and np.allclose(got, want, rtol=1e-5, atol=1e-6)
    print("OK: the export serves what the trained model computes" if ok else "MISMATCH")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
