"""`varstate-ckpt inspect|diff|convert` on export directories.

References: what `checkpoint.load` rebuilds from the same directory, and each
function's own `jax.export.Exported` (its platforms, input and output avals).
"""

import json
import os
import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import checkpoint
import checkpoint._cli._out as cli_out
import varstate
from checkpoint._export import _format
from checkpoint.protos import saved_object_graph_pb2 as pb

BATCH = jax.ShapeDtypeStruct(jax.export.symbolic_shape("n, 3"), jnp.float32)



@pytest.fixture
def exported(tmp_path):
    (tmp_path / "vocab.txt").write_text("a b")
    kernel = varstate.Variable(jnp.arange(6.0).reshape(3, 2), name="dense/kernel")
    root = {"dense": {"kernel": kernel, "bias": varstate.Variable(jnp.ones(2), name="bias", trainable=False)},
            "tied": kernel, "scale": jnp.float32(2.0), "meta": [7, "relu"],
            "vocab": checkpoint.Asset(tmp_path / "vocab.txt")}
    signatures = {
        "serve": (lambda r, x: {"y": x @ r["dense"]["kernel"].value * r["scale"], "k": r["meta"][0]}, (BATCH,)),
        "pair": (lambda r, a, b: (a + r["dense"]["bias"].value, [b]), (jnp.zeros(2), jnp.zeros((), jnp.int32))),
    }
    return checkpoint.export(tmp_path / "m", root, signatures, platforms=("cpu", "cuda"))


def _spec(aval):
    return {"dtype": aval.dtype.name, "shape": [d if isinstance(d, int) else str(d) for d in aval.shape]}


def test_inspect_export_json_matches_what_load_sees(run, exported):
    code, out, err = run("inspect", exported, "--json")
    assert code == 0 and err == ""
    data = json.loads(out)
    assert (data["format"], data["format_version"], data["path"]) == ("export", _format.VERSION, exported)
    loaded = checkpoint.load(exported)
    rows = {r["path"]: r for r in data["objects"]}
    for path, var in (("tied", loaded.tied), ("dense/bias", loaded.dense["bias"])):
        assert rows[path]["variable"] == {"name": var.name, "trainable": var.trainable}
        (value,) = rows[path]["values"]
        assert (value["dtype"], value["shape"], value["bytes"]) == (var.dtype.name, list(var.shape), var.value.nbytes)
    assert rows["dense/kernel"]["same_as"] == "tied"  # one variable, two paths: as load's `loaded.tied is kernel`
    assert loaded.dense["kernel"] is loaded.tied
    assert [rows[f"meta/{i}"]["python_value"] for i in range(2)] == loaded.meta
    assert rows["vocab"]["asset"] == os.path.basename(loaded.vocab.asset_path)
    assert rows["scale"]["values"][0]["dtype"] == loaded.scale.dtype.name
    signatures = {s["name"]: s for s in data["signatures"]}
    assert sorted(signatures) == sorted(loaded.signatures)
    for name, sig in loaded.signatures.items():
        got, exp = signatures[name], sig.exported
        assert got["platforms"] == list(exp.platforms) == ["cpu", "cuda"]
        n_captured = len(exp.in_avals) - len(got["inputs"])
        flat_inputs = jax.tree.leaves(got["inputs"], is_leaf=lambda x: isinstance(x, dict) and "dtype" in x)
        assert flat_inputs == [_spec(a) for a in exp.in_avals[n_captured:]]
        outputs = jax.tree.leaves(got["outputs"], is_leaf=lambda x: isinstance(x, dict) and "dtype" in x)
        assert outputs == [_spec(a) for a in exp.out_avals]
        assert len(got["reads"]) == n_captured
    assert sorted(signatures["serve"]["reads"]) == ["scale", "tied"]  # meta[0], a Python int, is baked in
    assert signatures["serve"]["outputs"] == {"dict": {"k": {"dtype": "int32", "shape": []},
                                                       "y": {"dtype": "float32", "shape": ["n", 2]}}}
    assert signatures["pair"]["inputs"] == [{"dtype": "float32", "shape": [2]}, {"dtype": "int32", "shape": []}]
    assert signatures["pair"]["outputs"] == {"tuple": [{"dtype": "float32", "shape": [2]},
                                                       {"list": [{"dtype": "int32", "shape": []}]}]}


def test_inspect_export_text(run, exported):
    code, out, _ = run("inspect", exported)
    assert code == 0
    lines = out.splitlines()
    assert lines[0] == f"{exported}: export (format version {_format.VERSION})"
    assert "    bias  variable 'bias' float32 (2,) 8 B, not trainable" in lines
    assert "    kernel -> same object as tied" in lines
    assert "  tied  variable 'dense/kernel' float32 (3, 2) 24 B" in lines
    assert "    1  python str 'relu'" in lines and "  vocab  asset vocab.txt" in lines
    assert "  signatures  signature map" in lines
    serve = next(ln for ln in lines if ln.startswith("signature serve: "))
    assert re.fullmatch(r"signature serve: \(float32\[n,3\]\) -> \{'k': int32\[\], 'y': float32\[n,2\]\}  "
                        r"platforms: cpu, cuda  reads: .*tied.*", serve), serve
    assert "signature pair: (float32[2], int32[]) -> (float32[2], [int32[]])  platforms: cpu, cuda  reads: " \
           "dense/bias" in lines
    reader = checkpoint.read_checkpoint(os.path.join(exported, "variables", "variables"))
    values = [np.asarray(reader.get(k)) for k in reader.keys() if k != "_CHECKPOINTABLE_OBJECT_GRAPH"]
    total = sum(sum(map(len, v.ravel())) if v.dtype.kind in "OSU" else v.nbytes for v in values)
    footer = lines[next(i for i, ln in enumerate(lines) if ln.startswith("signature ")) - 1]
    assert footer == f"{len(values)} values, {total} B"


def test_inspect_export_rich_tree(run, monkeypatch, exported):
    monkeypatch.setattr(cli_out, "is_terminal", lambda: True)
    code, out, _ = run("inspect", exported)
    assert code == 0 and "├── dense  dict" in out and "signature serve: " in out


def test_key_diff_and_convert_read_an_exports_variables(run, exported, tmp_path):
    code, out, _ = run("inspect", exported, "--key", "tied")
    assert code == 0 and "first values: [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]" in out
    again = checkpoint.export(tmp_path / "again", {"tied": varstate.Variable(jnp.arange(6.0).reshape(3, 2) + 1)})
    code, out, _ = run("diff", exported, again, "--only-diff", "--json")
    data = json.loads(out)
    assert code == 1 and data["values"] == [{"key": "tied/.ATTRIBUTES/VARIABLE_VALUE", "max_abs_diff": 1.0,
                                             "match": False}]
    dst = str(tmp_path / "tf" / "ckpt")
    assert run("convert", exported, dst, "--to", "tf")[0] == 0
    assert run("diff", exported, dst)[0] == 0


def test_inspect_refuses_what_load_refuses_in_one_line(run, exported):
    file = pathlib.Path(exported, "export.pb")
    assert b"dense/kernel" in file.read_bytes()
    file.write_bytes(file.read_bytes().replace(b"dense/kernel", b"dense/kerneL"))
    code, _, err = run("inspect", exported)
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err
    assert re.fullmatch(r"varstate-ckpt: error: .*/m/export\.pb: does not match the sha256 at its end, .*\n", err)
    definition = pb.ExportDef.FromString(file.read_bytes())
    definition.DiscardUnknownFields()
    name = sorted(definition.function_sha256)[0]
    definition.function_sha256[name] = b"\0" * 32
    file.write_bytes(_format.seal(definition.SerializeToString()))
    code, _, err = run("inspect", exported)
    assert code == 2 and re.fullmatch(rf"varstate-ckpt: error: .*/functions/{name}: the function file does not "
                                      r"match its sha256 in export\.pb .*\n", err)


def test_inspect_shows_an_export_whose_kernel_load_refuses(run, tmp_path):
    # inspect runs no function, so a kernel custom call (lapack, which load refuses by default) does not stop it
    a = varstate.Variable(jnp.eye(3) * 2.0, name="a")
    path = checkpoint.export(tmp_path / "solve", {"a": a},
                             {"solve": (lambda r, b: jnp.linalg.solve(r["a"].value, b), (jnp.zeros(3),))})
    with pytest.raises(checkpoint.CheckpointFormatError, match="trust_custom_calls=True"):
        checkpoint.load(path)
    code, out, err = run("inspect", path, "--json")
    assert (code, err) == (0, "")
    (signature,) = json.loads(out)["signatures"]
    assert (signature["name"], signature["reads"]) == ("solve", ["a"])
