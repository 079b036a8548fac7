"""`varstate-ckpt` on TF SavedModel directories: inspect (tags, signatures, objects, assets), convert, diff.

Reference: the SavedModels TF wrote (tests/data/tf_saved_model, by
make_tf_saved_model_fixtures.py) and what TF recorded about them in
expected.json: tags, signatures with their specs, variable values, assets.
"""

import json
import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest

import checkpoint

DATA = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(__file__))), "data", "tf_saved_model")
with open(os.path.join(DATA, "expected.json")) as f:
    EXPECTED = json.load(f)
SUFFIX = "/.ATTRIBUTES/VARIABLE_VALUE"



def _value(e):
    if e["dtype"] == "string":
        return np.array([v.encode() for v in e["values"]], dtype=object).reshape(e["shape"])
    return np.array(e["values"], dtype=e["dtype"]).reshape(e["shape"])


def _signatures(name):
    return {k: v for k, v in EXPECTED[name]["signatures"].items() if k != "__saved_model_init_op"}


@pytest.mark.parametrize("name", ["module", "keras_export"])
def test_inspect_json_reports_tags_signatures_variables_and_assets(run, name):
    code, out, err = run("inspect", os.path.join(DATA, name), "--json")
    assert code == 0 and err == ""
    got = json.loads(out)
    e = EXPECTED[name]
    assert got["format"] == "saved_model" and got["tags"] == e["tags"]
    assert got["tensorflow_version"] == e["tensorflow_version"]
    assert {s["name"]: {k: s[k] for k in ("inputs", "method_name", "outputs")} for s in got["signatures"]} == \
        _signatures(name)
    variables = {r["path"]: r["variable"] for r in got["objects"] if "variable" in r and "same_as" not in r}
    assert {p: (v["dtype"], v["shape"]) for p, v in variables.items()} == \
        {p: (v["dtype"], v["shape"]) for p, v in e["variables"].items()}
    assert got["values"] == len(e["variables"])
    assert got["bytes"] == sum(v["bytes"] for v in variables.values())
    assert {p: os.path.basename(f) for p, f in got["assets"].items()} == \
        {p: a["filename"] for p, a in e["assets"].items()}
    kinds = {r["path"]: r["kind"] for r in got["objects"] if "same_as" not in r}
    for node in e["nodes"]:
        if node["path"] and node["kind"] == "user_object":
            assert kinds[node["path"]] == node["identifier"]


def test_inspect_text(run):
    path = os.path.join(DATA, "module")
    code, out, err = run("inspect", path)
    assert code == 0 and err == ""
    lines = out.splitlines()
    e = EXPECTED["module"]
    assert lines[0] == f"{os.path.abspath(path)}: TF SavedModel (tags: serve; written by TensorFlow " \
                       f"{e['tensorflow_version']})"
    for vpath, v in e["variables"].items():
        shape = str(tuple(v["shape"]))
        assert any(re.fullmatch(rf"\s+{re.escape(vpath.split('/')[-1])}  variable '.*'(, not trainable)?  "
                                rf"{v['dtype']} {re.escape(shape)} \d+ B", ln) for ln in lines), vpath
    assert "    s  variable 's', not trainable  float32 () 4 B" in lines  # TF: trainable=False
    for sig, spec in _signatures("module").items():
        ins = ", ".join(f"{k}: {x['dtype']} ({', '.join('?' if d is None else str(d) for d in x['shape'])})"
                        for k, x in spec["inputs"].items())
        assert any(ln.startswith(f"signature {sig}: ({ins}) -> (") for ln in lines), sig
    asset = os.path.join(os.path.abspath(path), "assets", e["assets"]["vocab"]["filename"])
    assert f"asset vocab: {asset}" in lines
    with open(asset) as f:
        assert f.read() == e["assets"]["vocab"]["text"]
    code, out, _ = run("inspect", path, "--key", "sub/s")
    assert code == 0 and "key: sub/s/.ATTRIBUTES/VARIABLE_VALUE" in out.splitlines() and "min: 1.5" in out


@pytest.mark.parametrize("to", ["tf", "orbax"])
def test_convert_and_diff_read_its_variables(run, tmp_path, to):
    src = os.path.join(DATA, "module")
    dst = str(tmp_path / ("conv.ckpt" if to == "tf" else "conv"))
    code, out, err = run("convert", src, dst, "--to", to)
    assert code == 0 and err == "", err
    name = os.path.basename(src)
    assert out.startswith(f"wrote {dst} ({to}): {len(EXPECTED[name]['variables'])} values")
    reader = checkpoint.read_checkpoint(dst)
    for vpath, v in EXPECTED[name]["variables"].items():
        got = reader.get(vpath + SUFFIX)
        want = _value(v)
        assert got.shape == want.shape and got.tolist() == want.tolist()
    code, out, _ = run("diff", src, dst)
    assert code == 0 and out.splitlines()[-1].startswith("match")


def test_savedmodel_without_variables_is_one_line_error(run, tmp_path):
    copy = tmp_path / "sm"
    shutil.copytree(os.path.join(DATA, "module"), copy)
    shutil.rmtree(copy / "variables")
    code, _, err = run("convert", str(copy), str(tmp_path / "out"), "--to", "tf")
    assert code == 2 and err == f"varstate-ckpt: error: {copy}: the SavedModel has no variables " \
                                "(variables/variables.index is missing)\n"


@pytest.mark.parametrize("argv", [["inspect", os.path.join(DATA, "module")],
                                  ["inspect", os.path.join(DATA, "keras_export"), "--json"]])
def test_saved_models_import_neither_jax_nor_orbax(argv, tmp_path):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    done = subprocess.run([sys.executable, "-X", "importtime", "-m", "checkpoint", *argv], capture_output=True,
                          text=True, env=env, timeout=120, check=False)
    modules = {ln.split("|")[-1].strip() for ln in done.stderr.splitlines() if ln.startswith("import time:")}
    assert done.returncode == 0, done.stderr[-2000:]
    assert "numpy" in modules  # the reference: importtime saw the imports
    assert not {m for m in modules if m.split(".")[0] in ("jax", "jaxlib", "orbax", "flax")}


def test_convert_to_tf_imports_neither_jax_nor_orbax(tmp_path):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    argv = ["convert", os.path.join(DATA, "module"), str(tmp_path / "c"), "--to", "tf"]
    done = subprocess.run([sys.executable, "-X", "importtime", "-m", "checkpoint", *argv], capture_output=True,
                          text=True, env=env, timeout=120, check=False)
    modules = {ln.split("|")[-1].strip() for ln in done.stderr.splitlines() if ln.startswith("import time:")}
    assert done.returncode == 0, done.stderr[-2000:]
    assert not {m for m in modules if m.split(".")[0] in ("jax", "jaxlib", "orbax", "flax")}
