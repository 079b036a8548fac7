"""Fuzzing checkpoint.load: a damaged export.pb (sealed again or not) or a damaged function file's jax.export
envelope gives CheckpointFormatError or DataLossError naming the export, or loads; never another exception.

Seeded: each run tries the same inputs, so a failure reproduces (the message names the input and mutations).
Nothing loaded is called. Short by default; for a long run by hand:

    EXPORT_FUZZ_EXAMPLES=20000 .venv/bin/python -m pytest tests/checkpoint/export/test_export_fuzz.py -q
"""

import dataclasses
import hashlib
import os
import pathlib
import random
import re

import jax
import jax.numpy as jnp
import pytest

import checkpoint
import varstate
from checkpoint import CheckpointFormatError, DataLossError
from checkpoint._export import _format
from checkpoint.protos import saved_object_graph_pb2 as pb

EXAMPLES = int(os.environ.get("EXPORT_FUZZ_EXAMPLES", "300"))
BATCH = jax.ShapeDtypeStruct(jax.export.symbolic_shape("n, 3"), jnp.float32)


def mutate(data: bytes, rng: random.Random, lo: int = 0, hi: int | None = None) -> tuple[bytes, list]:
    """`data` with one to four flips, byte overwrites, truncations or insertions in [lo, hi), and what was done."""
    out, done = bytearray(data), []
    hi = len(data) if hi is None else hi
    for _ in range(rng.choice((1, 1, 2, 4))):
        kind, at = rng.choice(("flip", "byte", "truncate", "overwrite", "insert")), rng.randrange(lo, max(hi, lo + 1))
        at = min(at, len(out))
        if kind == "flip" and at < len(out):
            out[at] ^= 1 << rng.randrange(8)
        elif kind == "byte" and at < len(out):
            out[at] = rng.randrange(256)
        elif kind == "truncate":
            del out[at:]
        elif kind == "overwrite":
            out[at:at + 4] = rng.randbytes(min(4, max(hi - at, 0)))
        elif kind == "insert":
            out[at:at] = rng.randbytes(rng.randrange(1, 5))
        done.append((kind, at))
    return bytes(out), done


@pytest.fixture(scope="module")
def export(tmp_path_factory):
    root = {"w": varstate.Variable(jnp.arange(6.0).reshape(3, 2), name="w"), "b": varstate.Variable(jnp.ones(2)),
            "steps": 3, "label": "m", "parts": [jnp.ones(1), {"scale": 1.5}]}
    return str(checkpoint.export(tmp_path_factory.mktemp("fuzz") / "m", root,
                                 {"serve": (lambda r, x: x @ r["w"].value + r["b"].value, (BATCH,))}))


def _body(path):
    """export.pb without its sha256 trailer: the ExportDef as serialized."""
    definition = pb.ExportDef.FromString(pathlib.Path(path, "export.pb").read_bytes())
    definition.DiscardUnknownFields()
    return definition.SerializeToString()


def _load_or_raise(path, where):
    """1 when load raised the library's error naming the export, 0 when it loaded; any other outcome fails."""
    try:
        checkpoint.load(path)
    except (CheckpointFormatError, DataLossError) as e:
        assert path in str(e), f"{where}: the message does not name the export: {e}"
        return 1
    except Exception as e:  # any other exception is the finding
        pytest.fail(f"{where}: {type(e).__name__}: {e}")
    return 0


@pytest.mark.parametrize("seal", [False, True], ids=["as damaged", "sealed again"])
def test_a_damaged_export_pb_raises_the_librarys_error(export, seal):
    top = pathlib.Path(export, "export.pb")
    intact, body = top.read_bytes(), _body(export)
    rng, raised = random.Random(f"export.pb {seal}"), 0
    try:
        for i in range(EXAMPLES):
            # Sealed again, the damage passes the sha256 (as a crafted file's does) and reaches the loader proper.
            damaged, mutations = mutate(body, rng) if seal else mutate(intact, rng)
            top.write_bytes(_format.seal(damaged) if seal else damaged)
            raised += _load_or_raise(export, f"input {i}: export.pb {mutations}")
    finally:
        top.write_bytes(intact)
    assert raised > EXAMPLES // 2 and checkpoint.load(export).signatures


def test_a_damaged_function_envelope_raises_the_librarys_error(export):
    # The flatbuffer around the StableHLO module, which jax reads in Python: KeyError, AttributeError and
    # AssertionError came out of jax.export.deserialize before. The module's own bytes are left alone here: each
    # distinct module is read in a child process (0.3 s), and test_export_module_sandbox.py covers damaged ones.
    (name,) = os.listdir(os.path.join(export, "functions"))
    file, top = pathlib.Path(export, "functions", name), pathlib.Path(export, "export.pb")
    intact, intact_top = file.read_bytes(), top.read_bytes()
    module = jax.export.deserialize(bytearray(intact)).mlir_module_serialized
    start = intact.index(module)
    rng, raised = random.Random("function envelope"), 0
    definition = pb.ExportDef.FromString(_body(export))
    try:
        for i in range(EXAMPLES):
            region = rng.choice(((0, start), (start + len(module), len(intact))))
            damaged, mutations = mutate(intact, rng, *region)
            if module not in damaged:  # a truncation reached into the module
                continue
            file.write_bytes(damaged)
            definition.function_sha256[name] = hashlib.sha256(damaged).digest()
            top.write_bytes(_format.seal(definition.SerializeToString()))
            raised += _load_or_raise(export, f"input {i}: {name} {mutations}")
    finally:
        file.write_bytes(intact)
        top.write_bytes(intact_top)
    assert raised > EXAMPLES // 4 and checkpoint.load(export).signatures


def test_a_call_target_that_is_not_utf8_is_refused_as_unknown(tmp_path):
    from jax.extend import mlir as jax_mlir
    from jax.extend.mlir.dialects import stablehlo

    path = checkpoint.export(tmp_path / "m", {"w": varstate.Variable(jnp.ones(3), name="w")},
                             {"serve": (lambda r, x: x * r["w"].value, (jnp.zeros(3),))})
    (name,) = os.listdir(os.path.join(path, "functions"))
    honest = jax.export.deserialize(bytearray(pathlib.Path(path, "functions", name).read_bytes()))
    text = honest.mlir_module()
    multiply = re.search(r"(%\d+) = stablehlo\.multiply (%\w+), (%\w+) : tensor<3xf32>", text)
    crafted_call = (f'{multiply.group(1)} = stablehlo.custom_call @"\\FFkernel"({multiply.group(2)}, '
                    f"{multiply.group(3)}) : (tensor<3xf32>, tensor<3xf32>) -> tensor<3xf32>")
    version = stablehlo.get_version_from_compatibility_requirement(stablehlo.StablehloCompatibilityRequirement.WEEK_4)
    data = jax_mlir.serialize_portable_artifact(text.replace(multiply.group(0), crafted_call), version)
    crafted = dataclasses.replace(honest, mlir_module_serialized=data).serialize()
    pathlib.Path(path, "functions", name).write_bytes(crafted)
    definition = pb.ExportDef.FromString(_body(path))
    definition.function_sha256[name] = hashlib.sha256(crafted).digest()
    pathlib.Path(path, "export.pb").write_bytes(_format.seal(definition.SerializeToString()))
    with pytest.raises(CheckpointFormatError, match=r"functions/\w+: signature 'serve' calls XLA custom call "
                                                    r"target\(s\) \['\\\\xffkernel'\], which jax\.export does not"):
        checkpoint.load(path)
