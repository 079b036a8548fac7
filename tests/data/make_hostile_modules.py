"""Makes tests/data/hostile_exports/: exports whose StableHLO module crashes or hangs MLIR's reader.

Run by hand with the project's venv (no TensorFlow): ``.venv/bin/python tests/data/make_hostile_modules.py``.
Each is a valid export of ``sin(2 * w + x)`` whose module has two bytes changed and whose checksums are sealed
again, as a crafted file's would be. The script tries seeds (each changes two random bytes) until reading the
module as jax does, in a fresh process, ends it with SIGSEGV (``segv``) or SIGABRT (``abort``), or does not return
within 10 s (``hang``); with jaxlib 0.10.x each takes a few hundred seeds.
"""

import hashlib
import os
import pathlib
import random
import shutil
import struct
import subprocess
import sys

import jax
import jax.numpy as jnp

import checkpoint
import varstate
from checkpoint._export import _format
from checkpoint.protos import saved_object_graph_pb2 as pb

HERE = pathlib.Path(__file__).parent / "hostile_exports"
CHILD = pathlib.Path(__file__).parents[2] / "checkpoint" / "_export" / "_module_child.py"
OUTCOME = {-11: "segv", -6: "abort"}


def outcome(module: bytes) -> str:
    try:
        done = subprocess.run([sys.executable, "-I", str(CHILD)], input=struct.pack("<Q", len(module)) + module,
                              capture_output=True, timeout=10)
    except subprocess.TimeoutExpired:
        return "hang"
    return OUTCOME.get(done.returncode, "read")


def damaged(module: bytes, seed: int) -> bytes:
    rng, out = random.Random(seed), bytearray(module)
    for _ in range(2):
        out[rng.randrange(len(out))] = rng.randrange(256)
    return bytes(out)


def main() -> None:
    shutil.rmtree(HERE, ignore_errors=True)
    seeds: dict[str, int] = {}
    for name in ("segv", "abort", "hang"):
        root = {"w": varstate.Variable(jnp.arange(3.0), name="w")}
        path = checkpoint.export(str(HERE / name), root,
                                 {"f": (lambda r, x: jnp.sin(2 * r["w"].value + x), (jnp.zeros(3),))})
        (function,) = os.listdir(os.path.join(path, "functions"))
        file, top = pathlib.Path(path, "functions", function), pathlib.Path(path, "export.pb")
        data = bytearray(file.read_bytes())
        module = jax.export.deserialize(bytearray(data)).mlir_module_serialized
        if not seeds:
            for seed in range(5000):
                seeds.setdefault(outcome(damaged(module, seed)), seed)
                if {"segv", "abort", "hang"} <= seeds.keys():
                    break
        start = data.index(module)
        data[start:start + len(module)] = damaged(module, seeds[name])
        file.write_bytes(bytes(data))
        definition = pb.ExportDef.FromString(top.read_bytes())
        definition.DiscardUnknownFields()  # the old seal
        definition.function_sha256[function] = hashlib.sha256(bytes(data)).digest()
        top.write_bytes(_format.seal(definition.SerializeToString()))
        print(name, "seed", seeds[name], path)


if __name__ == "__main__":
    main()
