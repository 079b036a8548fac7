"""The `python -m checkpoint` command line, run in-process through `main([...])`.

References: the TF-written fixtures (tests/data/tf_name_based, tests/data/tf_checkpoints) and
what TF recorded about them; converted checkpoints are checked by reading them back.
"""

import json
import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest
from google.protobuf import text_format

import checkpoint._cli as cli
from checkpoint import read_checkpoint
from checkpoint._storage import write_bundle
from checkpoint.protos.trackable_object_graph_pb2 import TrackableObjectGraph

DATA = os.path.join(os.path.dirname(os.path.dirname(__file__)), "data")
NAME_BASED = os.path.join(DATA, "tf_name_based", "model.ckpt-1234")
with open(os.path.join(DATA, "tf_name_based", "expected.json")) as f:
    EXPECTED = json.load(f)


TF_DIR = os.path.join(DATA, "tf_checkpoints")
with open(os.path.join(TF_DIR, "expected.json")) as f:
    TF_EXPECTED = json.load(f)
SUFFIX = "/.ATTRIBUTES/VARIABLE_VALUE"


def expected(name):
    e = EXPECTED[name]
    return np.array(e["values"], dtype=e["dtype"]).reshape(e["shape"])


def run(capsys, *argv):
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def assert_one_line_error(code, err, pattern):
    assert code == 2
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert re.fullmatch(r"varstate-ckpt: error: " + pattern + r"\n", err, re.S), err


# --- inspect ---------------------------------------------------------------------
def test_inspect_name_based_lists_every_name_with_shape_dtype_bytes(capsys):
    code, out, err = run(capsys, "inspect", NAME_BASED)
    assert code == 0 and err == ""
    lines = out.splitlines()
    assert lines[0] == f"{NAME_BASED}: TF name-based checkpoint"
    total = 0
    for name in EXPECTED:
        value = expected(name)
        line = next(ln for ln in lines if ln.split()[0] == name)
        assert line.split()[1] == value.dtype.name
        assert str(value.shape) in line
        assert line.split(")")[-1].split()[:2] == [str(value.nbytes), "B"]
        total += value.nbytes
    assert lines[-1] == f"{len(EXPECTED)} values, {total} B"
    assert len(lines) == len(EXPECTED) + 2


def test_inspect_sizes_in_binary_units(capsys, tmp_path):
    write_bundle(str(tmp_path / "big"), {"a": np.zeros((3, 256, 1024), np.float16), "b": np.zeros(300, np.int32)})
    code, out, _ = run(capsys, "inspect", str(tmp_path / "big"))
    assert code == 0
    lines = out.splitlines()
    assert lines[1].split(")")[-1].split() == ["1.5", "MiB"] and lines[2].split(")")[-1].split() == ["1.2", "KiB"]
    assert lines[-1] == f"2 values, 1.5 MiB ({3 * 256 * 1024 * 2 + 1200} bytes)"


def test_inspect_name_based_shows_the_saved_slices(capsys):
    record = TF_EXPECTED["tf_name"]
    code, out, _ = run(capsys, "inspect", os.path.join(TF_DIR, "tf_name"))
    assert code == 0
    for name in record["tensors"]:
        line = next(ln for ln in out.splitlines() if ln.split()[0] == name)
        n = len(record["slices"].get(name, []))
        assert line.endswith(f"B  {n} slices" if n else "B"), line


def test_inspect_key_summarizes_one_value(capsys):
    name = "bert/embeddings/word_embeddings"
    value = expected(name)
    code, out, _ = run(capsys, "inspect", NAME_BASED, "--key", name)
    assert code == 0
    fields = dict(line.split(": ", 1) for line in out.splitlines())
    assert fields["key"] == name and fields["dtype"] == "float32" and fields["shape"] == "(6, 4)"
    assert fields["bytes"] == str(value.nbytes)
    assert float(fields["min"]) == value.min() and float(fields["max"]) == value.max()
    assert float(fields["mean"]) == pytest.approx(value.astype(np.float64).mean(), rel=1e-12)
    assert fields["first values"] == f"{value.ravel()[:10].tolist()} ..."
    code, out, _ = run(capsys, "inspect", NAME_BASED, "--key", "global_step")
    assert code == 0 and "first values: [1234]" in out and "min: 1234" in out
    # ml_dtypes' int4 and float8 have numpy kind "V": still numbers (TF wrote [[1, -2, 3], [-8, 7, 0]]).
    for key, stats in [("int4", ("-8.0", "7.0")), ("float8_e4m3fn", ("-2.0", "448.0"))]:
        code, out, _ = run(capsys, "inspect", os.path.join(TF_DIR, "tf_low_precision", "ckpt"),
                           "--key", f"model/{key}/.ATTRIBUTES/VARIABLE_VALUE")
        fields = dict(line.split(": ", 1) for line in out.splitlines())
        assert code == 0 and (fields["dtype"], fields["min"], fields["max"]) == (key, *stats)


def test_inspect_errors_are_one_line(capsys, tmp_path):
    code, _, err = run(capsys, "inspect", NAME_BASED, "--key", "bert/encoder/layer_9/kernel")
    assert_one_line_error(code, err, r"no key 'bert/encoder/layer_9/kernel' in the checkpoint; similar keys: "
                                     r"\['bert/encoder/layer_0/kernel'\]")
    code, _, err = run(capsys, "inspect", str(tmp_path / "nothing"))
    assert_one_line_error(code, err, r".*nothing.*")
    # A flipped bit in the index: the reader's own error, still one line.
    for suffix in (".index", ".data-00000-of-00001"):
        shutil.copy(NAME_BASED + suffix, tmp_path / ("bad" + suffix))
    raw = bytearray((tmp_path / "bad.index").read_bytes())
    raw[10] ^= 0x40
    (tmp_path / "bad.index").write_bytes(bytes(raw))
    code, _, err = run(capsys, "inspect", str(tmp_path / "bad"))
    assert_one_line_error(code, err, r".*bad\.index.*")


def test_usage_errors_exit_2(capsys):
    code, _, err = run(capsys)
    assert code == 2 and "usage: varstate-ckpt" in err
    code, _, err = run(capsys, "convert", "a", "b")
    assert code == 2 and "the following arguments are required: --to" in err
    code, out, _ = run(capsys, "--help")
    assert code == 0 and "inspect" in out and "convert" in out and "diff" in out


def tf_info(record):
    """(dtype, shape, bytes) of a tensor as TF recorded it in tests/data/tf_checkpoints/expected.json."""
    if record["dtype"] == "string":
        return "string", tuple(record["shape"]), sum(len(h) // 2 for h in record["strings"])
    return record["dtype"], tuple(record["shape"]), len(record["hex"]) // 2


def parse_tree(lines):
    """The plain-text object tree -> ({checkpoint key: label info}, {path: path of the same object})."""
    found, aliases, stack = {}, {}, []
    for line in lines:
        depth = (len(line) - len(line.lstrip(" "))) // 2 - 1
        label = line.strip()
        if " -> same object as " in label:
            name, target = label.split(" -> same object as ")
            aliases["/".join([*stack[:depth], cli_escape(name)])] = target
            continue
        m = re.fullmatch(r"slot '(\w+)' of (\S+)  (.*)", label)
        if m:
            key = f"{m[2]}/.OPTIMIZER_SLOT/{'/'.join(stack[:depth])}/{m[1]}{SUFFIX}"
            found[key] = m[3]
            continue
        name, _, info = label.partition("  ")
        stack[depth:] = [cli_escape(name)]
        if info:
            found["/".join(stack) + SUFFIX] = info
    return found, aliases


def cli_escape(name):
    return name.replace(".", "..").replace("/", ".S")


def test_inspect_object_based_tree_matches_tf_keys(capsys):
    record = TF_EXPECTED["tf_object"]
    code, out, _ = run(capsys, "inspect", os.path.join(TF_DIR, "tf_object"))
    assert code == 0
    lines = out.splitlines()
    assert lines[0].endswith("tf_object/ckpt-1: TF object-based checkpoint")
    found, aliases = parse_tree(lines[1:-1])
    # Every key TF wrote is reached through the tree, with TF's dtype, shape and size.
    assert set(found) == set(record["tensors"])
    total = 0
    for key, rec in record["tensors"].items():
        dtype, shape, nbytes = tf_info(rec)
        assert found[key] == f"{dtype} {shape} {nbytes} B", key
        total += nbytes
    assert total < 1024 and lines[-1] == f"{len(record['tensors'])} values, {total} B"
    # The variable reachable twice is shown once, under its first breadth-first path (TF's key).
    graph = text_format.Parse(record["object_graph"], TrackableObjectGraph())

    def node(path):
        n = 0
        for part in path.split("/"):
            n = next(c.node_id for c in graph.nodes[n].children if cli_escape(c.local_name) == part)
        return n

    assert aliases and all(node(a) == node(b) for a, b in aliases.items())
    assert all(b + SUFFIX in record["tensors"] and a + SUFFIX not in record["tensors"] for a, b in aliases.items())


def test_inspect_key_by_object_path_for_every_dtype(capsys):
    record = TF_EXPECTED["tf_object"]["tensors"]
    for key in [k for k in record if k.startswith("model/dtypes/")]:
        rec = record[key]
        code, out, _ = run(capsys, "inspect", os.path.join(TF_DIR, "tf_object"), "--key", key[: -len(SUFFIX)])
        assert code == 0
        fields = dict(line.split(": ", 1) for line in out.splitlines())
        dtype, shape, nbytes = tf_info(rec)
        assert (fields["key"], fields["dtype"], fields["shape"], fields["bytes"]) == (key, dtype, str(shape),
                                                                                       str(nbytes))
        if dtype == "string":
            want = [bytes.fromhex(h) for h in rec["strings"]]
            want = [w if len(w) <= 40 else w[:40] + b"..." for w in want]
            assert fields["first values"] == str(want)
            continue
        import ml_dtypes  # noqa: F401 - registers bfloat16 with numpy

        value = np.frombuffer(bytes.fromhex(rec["hex"]), dtype=np.dtype(dtype)).reshape(shape)
        assert fields["first values"] == str(value.ravel()[:10].tolist())
        if value.dtype.kind in "biuf" or dtype == "bfloat16":
            x = value.astype(np.float64)
            assert float(fields["min"]) == x.min() and float(fields["max"]) == x.max()
            assert float(fields["mean"]) == pytest.approx(x.mean(), rel=1e-6)
        else:
            assert complex(fields["mean"]) == pytest.approx(complex(value.astype(np.complex128).mean()), rel=1e-6)


# --- convert / diff ---------------------------------------------------------------
def test_convert_name_based_to_tf_keeps_names_and_values(capsys, tmp_path):
    dst = str(tmp_path / "copy")
    code, out, err = run(capsys, "convert", NAME_BASED, dst, "--to", "tf")
    assert code == 0 and err == ""
    assert out == f"wrote {dst} (tf): {len(EXPECTED)} values, {sum(expected(n).nbytes for n in EXPECTED)} B; " \
                  "verified by reading it back\n"
    back = read_checkpoint(dst)
    assert back.object_graph is None and sorted(back.keys()) == sorted(EXPECTED)
    for name in EXPECTED:
        got = back.get(name)
        assert got.dtype == expected(name).dtype
        np.testing.assert_array_equal(got, expected(name))
    code, out, _ = run(capsys, "diff", NAME_BASED, dst)
    assert code == 0 and out.splitlines()[-1] == f"match ({len(EXPECTED)} shared keys, atol=0)"
    code, _, err = run(capsys, "convert", NAME_BASED, dst, "--to", "tf")
    assert_one_line_error(code, err, re.escape(f"destination {dst!r} already exists; remove it or choose another path"))


def test_diff_reports_keys_shapes_and_max_abs_difference(capsys, tmp_path):
    tensors = {n: expected(n) for n in EXPECTED}
    tensors["cls/weights"] = tensors["cls/weights"] + np.float32(0.25)
    tensors["counts"] = tensors["counts"].astype(np.int64)  # dtype differs
    del tensors["scale"]
    tensors["new/bias"] = np.zeros(3, np.float32)
    other = str(tmp_path / "other")
    write_bundle(other, tensors)
    code, out, err = run(capsys, "diff", NAME_BASED, other)
    assert code == 1 and err == ""
    lines = out.splitlines()
    assert "only in A: scale  float64 (2,)" in lines
    assert "only in B: new/bias  float32 (3,)" in lines
    assert "differs: counts: A int32 (3,), B int64 (3,)" in lines
    diff = np.abs(expected("cls/weights").astype(np.float64) - tensors["cls/weights"]).max()
    row = next(ln for ln in lines if ln.startswith("cls/weights "))
    assert row.split()[1] == f"max|A-B|={diff:.6g}" and row.endswith("DIFFERS")
    row = next(ln for ln in lines if ln.startswith("global_step "))
    assert row.split()[1] == "max|A-B|=0" and row.endswith("match")
    assert lines[-1] == f"differ ({len(EXPECTED) - 1} shared keys, atol=0)"
    # Within a tolerance only the key and dtype differences remain.
    code, out, _ = run(capsys, "diff", NAME_BASED, other, "--atol", "0.3")
    assert code == 1 and next(ln for ln in out.splitlines() if ln.startswith("cls/weights ")).endswith("match")


def test_diff_same_values_and_nan_positions(capsys, tmp_path):
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    write_bundle(a, {"x": np.array([1.0, np.nan], np.float32)})
    write_bundle(b, {"x": np.array([1.0, np.nan], np.float32)})
    assert run(capsys, "diff", a, b)[0] == 0
    shutil.rmtree(tmp_path)
    os.makedirs(tmp_path)
    write_bundle(a, {"x": np.array([1.0, np.nan], np.float32)})
    write_bundle(b, {"x": np.array([1.0, 2.0], np.float32)})
    code, out, _ = run(capsys, "diff", a, b)
    assert code == 1 and "max|A-B|=nan" in out


def test_diff_integers_exactly(capsys, tmp_path):
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    big = np.array([2**60, -(2**63), 5], np.int64)
    write_bundle(a, {"n": big, "u": np.array([2**64 - 1, 0], np.uint64)})
    write_bundle(b, {"n": big + np.array([1, 0, 0]), "u": np.array([0, 0], np.uint64)})
    code, out, _ = run(capsys, "diff", a, b)
    assert code == 1
    rows = {ln.split()[0]: ln.split()[1] for ln in out.splitlines()[:-1]}
    assert rows == {"n": "max|A-B|=1", "u": f"max|A-B|={float(2**64 - 1):.6g}"}
    write_bundle(b, {"n": np.array([-(2**63), 2**63 - 1, 5], np.int64), "u": np.array([2**64 - 1, 0], np.uint64)})
    code, out, _ = run(capsys, "diff", a, b, "--atol", "1e30")  # |(2**63 - 1) - (-(2**63))| = 2**64 - 1
    rows = {ln.split()[0]: ln.split()[1:] for ln in out.splitlines()[:-1]}
    assert code == 0 and rows == {"n": [f"max|A-B|={float(2**64 - 1):.6g}", "match"], "u": ["max|A-B|=0", "match"]}


def test_diff_error_is_exit_2(capsys, tmp_path):
    code, _, err = run(capsys, "diff", NAME_BASED, str(tmp_path / "missing"))
    assert_one_line_error(code, err, r".*missing.*")


# --- terminal output (rich) and the entry point -------------------------------------
def test_rich_output_when_stdout_is_a_terminal(capsys, monkeypatch, tmp_path):
    monkeypatch.setattr(cli, "_is_terminal", lambda: True)
    code, out, _ = run(capsys, "inspect", NAME_BASED)
    assert code == 0 and "┃ name" in out and "bert/embeddings/word_embeddings" in out
    assert f"{len(EXPECTED)} values" in out
    # Names are printed as text, never read as rich markup.
    write_bundle(str(tmp_path / "b"), {"w[bold]": np.zeros(2, np.float32), "x[/]": np.ones(1, np.float32)})
    code, out, _ = run(capsys, "inspect", str(tmp_path / "b"))
    assert code == 0 and "w[bold]" in out and "x[/]" in out
    code, out, _ = run(capsys, "diff", str(tmp_path / "b"), str(tmp_path / "b"))
    assert code == 0 and "w[bold]" in out and "x[/]" in out


def test_python_dash_m_checkpoint():
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    done = subprocess.run([sys.executable, "-m", "checkpoint", "inspect", NAME_BASED, "--key", "counts"],
                          capture_output=True, text=True, env=env, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    assert "first values: [3, -1, 7]" in done.stdout


def test_convert_object_based_keeps_graph_and_values_both_ways(capsys, tmp_path):
    src = os.path.join(TF_DIR, "ours_checkpoint")
    record = TF_EXPECTED["ours_checkpoint"]
    orbax_dst, tf_dst = str(tmp_path / "orbax"), str(tmp_path / "tf" / "ckpt")
    assert run(capsys, "convert", src, orbax_dst, "--to", "orbax")[0] == 0
    assert run(capsys, "convert", orbax_dst, tf_dst, "--to", "tf")[0] == 0
    graph = text_format.Parse(record["object_graph"], TrackableObjectGraph())
    for path in (orbax_dst, tf_dst):
        back = read_checkpoint(path)
        assert back.object_graph == graph
        assert sorted(back.keys()) == sorted(record["tensors"])
        for key, rec in record["tensors"].items():
            assert back.get(key).tobytes().hex() == rec["hex"], key
        code, out, _ = run(capsys, "diff", src, path)
        assert code == 0, out
    # The converted orbax checkpoint is one our Checkpoint restores.
    import jax.numpy as jnp

    import checkpoint
    import varstate

    kernel = record["tensors"]["model/kernel" + SUFFIX]
    template = {"kernel": varstate.Variable(jnp.zeros(kernel["shape"]), registry=varstate.Registry()),
                "bias": varstate.Variable(jnp.zeros(record["tensors"]["model/bias" + SUFFIX]["shape"]),
                                          registry=varstate.Registry())}
    status = checkpoint.Checkpoint(model=template).restore(orbax_dst)
    assert np.asarray(status.model["kernel"].value).tobytes().hex() == kernel["hex"]


def test_convert_name_based_to_orbax_reassembles_slices(capsys, tmp_path, monkeypatch):
    monkeypatch.setattr(cli, "_is_terminal", lambda: True)  # with the progress bar
    record = TF_EXPECTED["tf_name"]
    dst = str(tmp_path / "orbax")
    code, out, _ = run(capsys, "convert", os.path.join(TF_DIR, "tf_name"), dst, "--to", "orbax")
    assert code == 0 and "verified by reading it back" in out
    back = read_checkpoint(dst)
    assert cli._graph(back) is None and sorted(back.keys()) == sorted(record["tensors"])
    for key, rec in record["tensors"].items():
        assert back.get(key).tobytes().hex() == rec["hex"], key


def test_convert_strings_to_orbax_is_refused(capsys, tmp_path):
    code, _, err = run(capsys, "convert", os.path.join(TF_DIR, "tf_object"), str(tmp_path / "o"), "--to", "orbax")
    assert_one_line_error(code, err, r"'model/dtypes/string/\.ATTRIBUTES/VARIABLE_VALUE' is a string tensor, which "
                                     r"the orbax format cannot hold; convert --to tf")
    assert not os.path.exists(tmp_path / "o")


def test_rich_tree_for_an_object_graph(capsys, monkeypatch):
    monkeypatch.setattr(cli, "_is_terminal", lambda: True)
    code, out, _ = run(capsys, "inspect", os.path.join(TF_DIR, "ours_checkpoint"))
    assert code == 0
    assert "├── model" in out and "slot 'm' of model/kernel" in out


def test_convert_keeps_python_strings_of_our_own_checkpoints(capsys, tmp_path):
    # A Python str is stored as a scalar string (TF's py_state); orbax holds it as a Python value.
    import jax.numpy as jnp

    import checkpoint
    import varstate

    def model(name, w):
        return {"w": varstate.Variable(jnp.full(2, w), registry=varstate.Registry()), "name": name, "n": 3}

    src = checkpoint.Checkpoint(m=model("run-1 é", 1.0)).write(str(tmp_path / "src"))
    via_tf, back = str(tmp_path / "tf" / "ckpt"), str(tmp_path / "back")
    for a, b, to in ((src, str(tmp_path / "copy"), "orbax"), (src, via_tf, "tf"), (via_tf, back, "orbax")):
        code, out, err = run(capsys, "convert", a, b, "--to", to)
        assert code == 0 and "verified by reading it back" in out, err
    for path in (str(tmp_path / "copy"), via_tf, back):
        got = checkpoint.Checkpoint(m=model("", 0.0)).restore(path).assert_consumed().m
        assert got["name"] == "run-1 é" and got["n"] == 3 and got["w"].value.tolist() == [1.0, 1.0]
        assert run(capsys, "diff", src, path)[0] == 0


def test_a_name_based_checkpoint_converted_to_orbax_stays_name_based(capsys, tmp_path):
    import jax.numpy as jnp

    import checkpoint
    import varstate

    dst = str(tmp_path / "orbax")
    assert run(capsys, "convert", NAME_BASED, dst, "--to", "orbax")[0] == 0
    assert read_checkpoint(dst).object_graph is None  # as read_checkpoint documents for name-based checkpoints
    with pytest.raises(ValueError, match=r"is a name-based checkpoint \(no object graph\): restore it by variable "
                                         r"name with checkpoint\.restore_by_name"):
        checkpoint.Checkpoint(m={"w": varstate.Variable(jnp.zeros(2))}).restore(dst)
    name = "bert/embeddings/position_embeddings"
    params = {"e": varstate.Variable(jnp.zeros(expected(name).shape), name=name, registry=varstate.Registry())}
    np.testing.assert_array_equal(checkpoint.restore_by_name(dst, params).params["e"].value, expected(name))
