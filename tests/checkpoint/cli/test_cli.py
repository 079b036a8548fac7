"""The `python -m checkpoint` command line, run in-process through `main([...])`.

References: the TF-written fixtures (tests/data/tf_name_based, tests/data/tf_checkpoints) and
what TF recorded about them; converted checkpoints are checked by reading them back.
"""

import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tomllib

import numpy as np
import pytest
from google.protobuf import text_format

import checkpoint
import checkpoint._cli._inspect as cli_inspect
import checkpoint._cli._out as cli_out
import varstate
from checkpoint import read_checkpoint
from checkpoint._storage import write_bundle
from checkpoint.protos.trackable_object_graph_pb2 import TrackableObjectGraph

DATA = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(__file__))), "data")
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



def assert_one_line_error(code, err, pattern):
    assert code == 2
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert re.fullmatch(r"varstate-ckpt: error: " + pattern + r"\n", err, re.S), err


# --- inspect ---------------------------------------------------------------------
def test_inspect_name_based_lists_every_name_with_shape_dtype_bytes(run):
    code, out, err = run("inspect", NAME_BASED)
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


def test_inspect_sizes_in_binary_units(run, tmp_path):
    write_bundle(str(tmp_path / "big"), {"a": np.zeros((3, 256, 1024), np.float16), "b": np.zeros(300, np.int32)})
    code, out, _ = run("inspect", str(tmp_path / "big"))
    assert code == 0
    lines = out.splitlines()
    assert lines[1].split(")")[-1].split() == ["1.5", "MiB"] and lines[2].split(")")[-1].split() == ["1.2", "KiB"]
    assert lines[-1] == f"2 values, 1.5 MiB ({3 * 256 * 1024 * 2 + 1200} bytes)"


def test_inspect_name_based_shows_the_saved_slices(run):
    record = TF_EXPECTED["tf_name"]
    code, out, _ = run("inspect", os.path.join(TF_DIR, "tf_name"))
    assert code == 0
    for name in record["tensors"]:
        line = next(ln for ln in out.splitlines() if ln.split()[0] == name)
        n = len(record["slices"].get(name, []))
        assert line.endswith(f"B  {n} slices" if n else "B"), line


def test_inspect_key_summarizes_one_value(run):
    name = "bert/embeddings/word_embeddings"
    value = expected(name)
    code, out, _ = run("inspect", NAME_BASED, "--key", name)
    assert code == 0
    fields = dict(line.split(": ", 1) for line in out.splitlines())
    assert fields["key"] == name and fields["dtype"] == "float32" and fields["shape"] == "(6, 4)"
    assert fields["bytes"] == str(value.nbytes)
    assert float(fields["min"]) == value.min() and float(fields["max"]) == value.max()
    assert float(fields["mean"]) == pytest.approx(value.astype(np.float64).mean(), rel=1e-12)
    assert fields["first values"] == f"{value.ravel()[:10].tolist()} ..."
    code, out, _ = run("inspect", NAME_BASED, "--key", "global_step")
    assert code == 0 and "first values: [1234]" in out and "min: 1234" in out
    # ml_dtypes' int4 and float8 have numpy kind "V": still numbers (TF wrote [[1, -2, 3], [-8, 7, 0]]).
    for key, stats in [("int4", ("-8.0", "7.0")), ("float8_e4m3fn", ("-2.0", "448.0"))]:
        code, out, _ = run("inspect", os.path.join(TF_DIR, "tf_low_precision", "ckpt"),
                           "--key", f"model/{key}/.ATTRIBUTES/VARIABLE_VALUE")
        fields = dict(line.split(": ", 1) for line in out.splitlines())
        assert code == 0 and (fields["dtype"], fields["min"], fields["max"]) == (key, *stats)


def test_inspect_errors_are_one_line(run, tmp_path):
    code, _, err = run("inspect", NAME_BASED, "--key", "bert/encoder/layer_9/kernel")
    assert_one_line_error(code, err, r"no key 'bert/encoder/layer_9/kernel' in the checkpoint; similar keys: "
                                     r"\['bert/encoder/layer_0/kernel'\]")
    code, _, err = run("inspect", str(tmp_path / "nothing"))
    assert_one_line_error(code, err, r".*nothing.*")
    # A flipped bit in the index: the reader's own error, still one line.
    for suffix in (".index", ".data-00000-of-00001"):
        shutil.copy(NAME_BASED + suffix, tmp_path / ("bad" + suffix))
    raw = bytearray((tmp_path / "bad.index").read_bytes())
    raw[10] ^= 0x40
    (tmp_path / "bad.index").write_bytes(bytes(raw))
    code, _, err = run("inspect", str(tmp_path / "bad"))
    assert_one_line_error(code, err, r".*bad\.index.*")


def test_usage_errors_exit_2(run):
    code, _, err = run()
    assert code == 2 and "usage: varstate-ckpt" in err
    code, _, err = run("convert", "a", "b")
    assert code == 2 and "the following arguments are required: --to" in err
    code, out, _ = run("--help")
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


def test_inspect_object_based_tree_matches_tf_keys(run):
    record = TF_EXPECTED["tf_object"]
    code, out, _ = run("inspect", os.path.join(TF_DIR, "tf_object"))
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


def test_inspect_key_by_object_path_for_every_dtype(run):
    record = TF_EXPECTED["tf_object"]["tensors"]
    for key in [k for k in record if k.startswith("model/dtypes/")]:
        rec = record[key]
        code, out, _ = run("inspect", os.path.join(TF_DIR, "tf_object"), "--key", key[: -len(SUFFIX)])
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
def test_convert_name_based_to_tf_keeps_names_and_values(run, tmp_path):
    dst = str(tmp_path / "copy")
    code, out, err = run("convert", NAME_BASED, dst, "--to", "tf")
    assert code == 0 and err == ""
    assert out == f"wrote {dst} (tf): {len(EXPECTED)} values, {sum(expected(n).nbytes for n in EXPECTED)} B; " \
                  "verified by reading it back\n"
    back = read_checkpoint(dst)
    assert back.object_graph is None and sorted(back.keys()) == sorted(EXPECTED)
    for name in EXPECTED:
        got = back.get(name)
        assert got.dtype == expected(name).dtype
        np.testing.assert_array_equal(got, expected(name))
    code, out, _ = run("diff", NAME_BASED, dst)
    assert code == 0 and out.splitlines()[-1] == f"match ({len(EXPECTED)} shared keys, atol=0)"
    code, _, err = run("convert", NAME_BASED, dst, "--to", "tf")
    assert_one_line_error(code, err, re.escape(f"destination {dst!r} already exists; remove it or choose another path"))


def test_diff_reports_keys_shapes_and_max_abs_difference(run, tmp_path):
    tensors = {n: expected(n) for n in EXPECTED}
    tensors["cls/weights"] = tensors["cls/weights"] + np.float32(0.25)
    tensors["counts"] = tensors["counts"].astype(np.int64)  # dtype differs
    del tensors["scale"]
    tensors["new/bias"] = np.zeros(3, np.float32)
    other = str(tmp_path / "other")
    write_bundle(other, tensors)
    code, out, err = run("diff", NAME_BASED, other)
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
    code, out, _ = run("diff", NAME_BASED, other, "--atol", "0.3")
    assert code == 1 and next(ln for ln in out.splitlines() if ln.startswith("cls/weights ")).endswith("match")


def test_diff_same_values_and_nan_positions(run, tmp_path):
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    write_bundle(a, {"x": np.array([1.0, np.nan], np.float32)})
    write_bundle(b, {"x": np.array([1.0, np.nan], np.float32)})
    assert run("diff", a, b)[0] == 0
    shutil.rmtree(tmp_path)
    os.makedirs(tmp_path)
    write_bundle(a, {"x": np.array([1.0, np.nan], np.float32)})
    write_bundle(b, {"x": np.array([1.0, 2.0], np.float32)})
    code, out, _ = run("diff", a, b)
    assert code == 1 and "max|A-B|=nan" in out


def test_diff_infinities_equal_themselves_and_atol_0_is_bit_for_bit(run, tmp_path):
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    values = np.array([np.inf, -np.inf, 1.0, -0.0], np.float32)
    write_bundle(a, {"x": values})
    write_bundle(b, {"x": values})
    code, out, err = run("diff", a, b)  # inf - inf is NaN: equal infinities must not be taken apart
    assert (code, err) == (0, "") and out.split()[1:3] == ["max|A-B|=0", "match"]
    write_bundle(b, {"x": np.array([np.inf, -np.inf, 1.0, 0.0], np.float32)})  # -0.0 and 0.0: equal, not the same bits
    code, out, _ = run("diff", a, b)
    assert code == 1 and out.split()[1:3] == ["max|A-B|=0", "DIFFERS"]
    assert run("diff", a, b, "--atol", "1e-9")[0] == 0
    write_bundle(b, {"x": np.array([np.inf, np.inf, 1.0, -0.0], np.float32)})
    code, out, _ = run("diff", a, b, "--atol", "1e30")
    assert code == 1 and out.split()[1:3] == ["max|A-B|=inf", "DIFFERS"]


def test_diff_integers_exactly(run, tmp_path):
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    big = np.array([2**60, -(2**63), 5], np.int64)
    write_bundle(a, {"n": big, "u": np.array([2**64 - 1, 0], np.uint64)})
    write_bundle(b, {"n": big + np.array([1, 0, 0]), "u": np.array([0, 0], np.uint64)})
    code, out, _ = run("diff", a, b)
    assert code == 1
    rows = {ln.split()[0]: ln.split()[1] for ln in out.splitlines()[:-1]}
    assert rows == {"n": "max|A-B|=1", "u": f"max|A-B|={float(2**64 - 1):.6g}"}
    write_bundle(b, {"n": np.array([-(2**63), 2**63 - 1, 5], np.int64), "u": np.array([2**64 - 1, 0], np.uint64)})
    code, out, _ = run("diff", a, b, "--atol", "1e30")  # |(2**63 - 1) - (-(2**63))| = 2**64 - 1
    rows = {ln.split()[0]: ln.split()[1:] for ln in out.splitlines()[:-1]}
    assert code == 0 and rows == {"n": [f"max|A-B|={float(2**64 - 1):.6g}", "match"], "u": ["max|A-B|=0", "match"]}


def test_diff_error_is_exit_2(run, tmp_path):
    code, _, err = run("diff", NAME_BASED, str(tmp_path / "missing"))
    assert_one_line_error(code, err, r".*missing.*")


# --- terminal output (rich) and the entry point -------------------------------------
def test_rich_output_when_stdout_is_a_terminal(run, monkeypatch, tmp_path):
    monkeypatch.setattr(cli_out, "is_terminal", lambda: True)
    code, out, _ = run("inspect", NAME_BASED)
    assert code == 0 and "┃ name" in out and "bert/embeddings/word_embeddings" in out
    assert f"{len(EXPECTED)} values" in out
    # Names are printed as text, never read as rich markup.
    write_bundle(str(tmp_path / "b"), {"w[bold]": np.zeros(2, np.float32), "x[/]": np.ones(1, np.float32)})
    code, out, _ = run("inspect", str(tmp_path / "b"))
    assert code == 0 and "w[bold]" in out and "x[/]" in out
    code, out, _ = run("diff", str(tmp_path / "b"), str(tmp_path / "b"))
    assert code == 0 and "w[bold]" in out and "x[/]" in out


def test_python_dash_m_checkpoint():
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    done = subprocess.run([sys.executable, "-m", "checkpoint", "inspect", NAME_BASED, "--key", "counts"],
                          capture_output=True, text=True, env=env, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    assert "first values: [3, -1, 7]" in done.stdout


def test_convert_object_based_keeps_graph_and_values_both_ways(run, tmp_path):
    src = os.path.join(TF_DIR, "ours_checkpoint")
    record = TF_EXPECTED["ours_checkpoint"]
    orbax_dst, tf_dst = str(tmp_path / "orbax"), str(tmp_path / "tf" / "ckpt")
    assert run("convert", src, orbax_dst, "--to", "orbax")[0] == 0
    assert run("convert", orbax_dst, tf_dst, "--to", "tf")[0] == 0
    graph = text_format.Parse(record["object_graph"], TrackableObjectGraph())
    for path in (orbax_dst, tf_dst):
        back = read_checkpoint(path)
        assert back.object_graph == graph
        assert sorted(back.keys()) == sorted(record["tensors"])
        for key, rec in record["tensors"].items():
            assert back.get(key).tobytes().hex() == rec["hex"], key
        code, out, _ = run("diff", src, path)
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


def test_convert_name_based_to_orbax_reassembles_slices(run, tmp_path, monkeypatch):
    monkeypatch.setattr(cli_out, "is_terminal", lambda: True)  # with the progress bar
    record = TF_EXPECTED["tf_name"]
    dst = str(tmp_path / "orbax")
    code, out, _ = run("convert", os.path.join(TF_DIR, "tf_name"), dst, "--to", "orbax")
    assert code == 0 and "verified by reading it back" in out
    back = read_checkpoint(dst)
    assert cli_out.object_graph(back) is None and sorted(back.keys()) == sorted(record["tensors"])
    for key, rec in record["tensors"].items():
        assert back.get(key).tobytes().hex() == rec["hex"], key


def test_convert_strings_to_orbax_is_refused(run, tmp_path):
    code, _, err = run("convert", os.path.join(TF_DIR, "tf_object"), str(tmp_path / "o"), "--to", "orbax")
    assert_one_line_error(code, err, r"'model/dtypes/string/\.ATTRIBUTES/VARIABLE_VALUE' is a string tensor, which "
                                     r"the orbax format cannot hold; convert --to tf")
    assert not os.path.exists(tmp_path / "o")


def test_rich_tree_for_an_object_graph(run, monkeypatch):
    monkeypatch.setattr(cli_out, "is_terminal", lambda: True)
    code, out, _ = run("inspect", os.path.join(TF_DIR, "ours_checkpoint"))
    assert code == 0
    assert "├── model" in out and "slot 'm' of model/kernel" in out


def test_convert_keeps_python_strings_of_our_own_checkpoints(run, tmp_path):
    # A Python str is stored as a scalar string (TF's py_state); orbax holds it as a Python value.
    import jax.numpy as jnp

    import checkpoint
    import varstate

    def model(name, w):
        return {"w": varstate.Variable(jnp.full(2, w), registry=varstate.Registry()), "name": name, "n": 3}

    src = checkpoint.Checkpoint(m=model("run-1 é", 1.0)).write(str(tmp_path / "src"))
    via_tf, back = str(tmp_path / "tf" / "ckpt"), str(tmp_path / "back")
    for a, b, to in ((src, str(tmp_path / "copy"), "orbax"), (src, via_tf, "tf"), (via_tf, back, "orbax")):
        code, out, err = run("convert", a, b, "--to", to)
        assert code == 0 and "verified by reading it back" in out, err
    for path in (str(tmp_path / "copy"), via_tf, back):
        got = checkpoint.Checkpoint(m=model("", 0.0)).restore(path).assert_consumed().m
        assert got["name"] == "run-1 é" and got["n"] == 3 and got["w"].value.tolist() == [1.0, 1.0]
        assert run("diff", src, path)[0] == 0


def test_a_name_based_checkpoint_converted_to_orbax_stays_name_based(run, tmp_path):
    import jax.numpy as jnp

    import checkpoint
    import varstate

    dst = str(tmp_path / "orbax")
    assert run("convert", NAME_BASED, dst, "--to", "orbax")[0] == 0
    assert read_checkpoint(dst).object_graph is None  # as read_checkpoint documents for name-based checkpoints
    with pytest.raises(ValueError, match=r"is a name-based checkpoint \(no object graph\): restore it by variable "
                                         r"name with checkpoint\.restore_by_name"):
        checkpoint.Checkpoint(m={"w": varstate.Variable(jnp.zeros(2))}).restore(dst)
    name = "bert/embeddings/position_embeddings"
    params = {"e": varstate.Variable(jnp.zeros(expected(name).shape), name=name, registry=varstate.Registry())}
    np.testing.assert_array_equal(checkpoint.restore_by_name(dst, params).params["e"].value, expected(name))


# --- names that would drive a terminal ----------------------------------------------------
EVIL = {"osc": "title\x1b]0;pwned\x07", "csi": "clear\x1b[2J", "c1": "c1\x9b31m", "bidi": "rtl\u202etxt.exe",
        "newline": "two\nlines", "del": "del\x7f"}
ESCAPED = {"osc": r"title\x1b]0;pwned\x07", "csi": r"clear\x1b[2J", "c1": r"c1\x9b31m", "bidi": r"rtl\u202etxt.exe",
           "newline": r"two\x0alines", "del": r"del\x7f"}


def _no_terminal_controls(text):
    """Nothing but printable characters and line ends: the reference is unicodedata's categories."""
    import unicodedata

    bad = [c for c in text if c != "\n" and unicodedata.category(c) in ("Cc", "Cf", "Cs", "Zl", "Zp")]
    assert not bad, bad


def _evil_checkpoints(tmp_path):
    """A name-based bundle whose keys carry control characters, and an object-based one whose object names do."""
    flat = str(tmp_path / "flat")
    write_bundle(flat, {v: np.full(2, i, np.float32) for i, v in enumerate(EVIL.values())})
    graph = TrackableObjectGraph()
    root = graph.nodes.add()
    tensors = {}
    for i, name in enumerate(EVIL.values()):
        root.children.add(node_id=i + 1, local_name=name)
        key = f"{name.replace('.', '..').replace('/', '.S')}{SUFFIX}"
        graph.nodes.add().attributes.add(name="VARIABLE_VALUE", full_name=name, checkpoint_key=key)
        tensors[key] = np.full(3, i, np.float32)
    tree = str(tmp_path / "tree")
    write_bundle(tree, {**tensors, "_CHECKPOINTABLE_OBJECT_GRAPH": graph.SerializeToString()})
    return flat, tree


@pytest.mark.parametrize("terminal", [False, True])
def test_control_characters_in_names_are_escaped_in_every_output_mode(run, monkeypatch, tmp_path, terminal):
    monkeypatch.setattr(cli_out, "is_terminal", lambda: terminal)
    flat, tree = _evil_checkpoints(tmp_path)
    other = str(tmp_path / "other")
    write_bundle(other, {v: np.full(2, i + 9 * (k == "osc"), np.float32) for i, (k, v) in enumerate(EVIL.items())})
    outputs = []
    for argv in (["inspect", flat], ["inspect", tree], ["inspect", flat, "--key", EVIL["osc"]],
                 ["diff", flat, other], ["diff", flat, other, "--only-diff"], ["diff", tree, flat]):
        code, out, err = run(*argv)
        assert code in (0, 1) and err == "", (argv, err)
        _no_terminal_controls(out)
        outputs.append(out)
    listing, objects, key, diff, only, _ = outputs
    for kind, escaped in ESCAPED.items():
        assert escaped in listing and escaped in objects and escaped in diff, kind
    assert key.startswith(f"key: {ESCAPED['osc']}\n")
    assert ESCAPED["osc"] in only and ESCAPED["csi"] not in only  # only the key whose values differ
    # An error quoting a name: one line, escaped.
    code, _, err = run("inspect", flat, "--key", "missing\x1b]0;x\x07")
    assert code == 2 and err.count("\n") == 1 and "\x1b" not in err and r"missing\x1b]0;x\x07" in err


@pytest.mark.parametrize("to", ["tf", "orbax", "safetensors"])
def test_a_destination_path_with_control_characters_is_escaped_in_the_report(run, tmp_path, to):
    flat, _ = _evil_checkpoints(tmp_path)
    dst = str(tmp_path / ("out" + EVIL["osc"] + (".safetensors" if to == "safetensors" else "")))
    code, out, err = run("convert", flat, dst, "--to", to)
    assert (code, err) == (0, "")
    _no_terminal_controls(out)
    assert out.startswith(f"wrote {tmp_path}/out{ESCAPED['osc']}") and out.count("\n") == 1


def test_json_output_escapes_every_control_character(run, tmp_path):
    flat, tree = _evil_checkpoints(tmp_path)
    for argv in (["inspect", flat], ["inspect", tree], ["diff", flat, tree]):
        code, out, _ = run(*argv, "--json")
        assert code in (0, 1) and out.isascii() and out.count("\n") == 1  # one line of ASCII: \u escapes
        keys = [k["key"] for k in json.loads(out)["keys" if argv[0] == "inspect" else "only_in_a"]]
        want = sorted(map(cli_escape, EVIL.values()) if argv[1] == tree else EVIL.values())
        assert [k.removesuffix(SUFFIX) for k in keys] == want  # the names come back exactly
    code, out, _ = run("inspect", flat, "--key", EVIL["c1"], "--json")
    assert code == 0 and out.isascii() and json.loads(out)["key"] == EVIL["c1"]


# --- a graph too deep for recursion -------------------------------------------------------
def _deep_checkpoint(tmp_path, depth=3000):
    graph = TrackableObjectGraph()
    for i in range(depth + 1):
        node = graph.nodes.add()
        if i < depth:
            node.children.add(node_id=i + 1, local_name="a")
    key = "/".join(["a"] * depth) + SUFFIX
    graph.nodes[depth].attributes.add(name="VARIABLE_VALUE", full_name="w", checkpoint_key=key)
    prefix = str(tmp_path / "deep")
    write_bundle(prefix, {key: np.arange(2, dtype=np.float32),
                          "_CHECKPOINTABLE_OBJECT_GRAPH": graph.SerializeToString()})
    return prefix, key


@pytest.mark.parametrize("terminal", [False, True])
def test_a_3000_level_object_graph_prints(run, monkeypatch, tmp_path, terminal):
    monkeypatch.setattr(cli_out, "is_terminal", lambda: terminal)
    prefix, key = _deep_checkpoint(tmp_path)
    assert sys.getrecursionlimit() < 3000  # a recursive walk would fail
    code, out, err = run("inspect", prefix)
    assert code == 0 and err == ""
    lines = out.splitlines()
    # Deeper than rich's tree can show, a terminal gets the indented text too.
    assert len(lines) == 3002 and lines[-1] == "1 values, 8 B"
    assert [len(ln) - len(ln.lstrip(" ")) for ln in lines[1:-1]] == [2 * (d + 1) for d in range(3000)]
    assert lines[-2].strip() == "a  float32 (2,) 8 B"
    code, out, _ = run("inspect", prefix, "--json")
    rows = json.loads(out)["objects"]
    assert code == 0 and [r["depth"] for r in rows] == list(range(3000)) and rows[-1]["values"][0]["key"] == key
    assert run("inspect", prefix, "--key", key[: -len(SUFFIX)])[0] == 0
    assert run("diff", prefix, prefix)[0] == 0


def test_a_recursion_error_anywhere_is_one_line(run, monkeypatch):
    def too_deep(*args):
        raise RecursionError("maximum recursion depth exceeded")

    monkeypatch.setattr(cli_inspect, "_tree_rows", too_deep)
    code, _, err = run("inspect", os.path.join(TF_DIR, "tf_object"))
    assert_one_line_error(code, err, r".*tf_object: its object graph nests too deeply for this command")


# --- --json, --only-diff, --version ----------------------------------------------------------
def test_inspect_json_lists_what_tf_wrote(run):
    record = TF_EXPECTED["tf_object"]
    code, out, _ = run("inspect", os.path.join(TF_DIR, "tf_object"), "--json")
    assert code == 0
    data = json.loads(out)
    assert data["format"] == "TF object-based checkpoint" and data["values"] == len(record["tensors"])
    keys = {k["key"]: k for k in data["keys"]}
    assert set(keys) == set(record["tensors"])
    for key, rec in record["tensors"].items():
        dtype, shape, nbytes = tf_info(rec)
        assert (keys[key]["dtype"], tuple(keys[key]["shape"]), keys[key]["bytes"]) == (dtype, shape, nbytes), key
        assert keys[key]["in_object_graph"] and keys[key]["slices"] == 0
    assert data["bytes"] == sum(k["bytes"] for k in keys.values())
    # The object rows are the text tree's lines: same order, same labels.
    _, text, _ = run("inspect", os.path.join(TF_DIR, "tf_object"))
    assert [cli_inspect._row_label(r) for r in data["objects"]] == [ln.strip() for ln in text.splitlines()[1:-1]]
    reached = {v["key"] for r in data["objects"] for v in r.get("values", [])}
    assert reached == set(record["tensors"])


def test_inspect_a_root_named_empty_lists_its_values_under_it(run, tmp_path):
    # The root "" and its child "y" key the value "/y/..." (TF's join); inspect walks the same paths.
    v = varstate.Variable(np.arange(3.0, dtype=np.float32))
    path = checkpoint.Checkpoint(**{"": {"y": v}}).write(str(tmp_path / "c"), format="tf")
    code, out, _ = run("inspect", path, "--json")
    data = json.loads(out)
    assert code == 0 and [k["key"] for k in data["keys"] if k["in_object_graph"]] == [
        "/y/.ATTRIBUTES/VARIABLE_VALUE"]
    assert [(r["name"], r["path"]) for r in data["objects"]] == [("", ""), ("y", "/y")]
    assert not any("same_as" in r for r in data["objects"])
    assert [v["key"] for v in data["objects"][1]["values"]] == ["/y/.ATTRIBUTES/VARIABLE_VALUE"]


def test_inspect_json_of_a_name_based_checkpoint_shows_slices(run):
    record = TF_EXPECTED["tf_name"]
    code, out, _ = run("inspect", os.path.join(TF_DIR, "tf_name"), "--json")
    data = json.loads(out)
    assert code == 0 and data["objects"] is None and data["format"] == "TF name-based checkpoint"
    assert {k["key"]: k["slices"] for k in data["keys"]} == {k: len(record["slices"].get(k, []))
                                                             for k in record["tensors"]}


def test_inspect_key_json(run):
    name = "bert/embeddings/word_embeddings"
    value = expected(name)
    code, out, _ = run("inspect", NAME_BASED, "--key", name, "--json")
    data = json.loads(out)
    assert code == 0 and (data["key"], data["dtype"], data["shape"], data["bytes"]) == (name, "float32", [6, 4],
                                                                                        value.nbytes)
    assert (data["min"], data["max"]) == (float(value.min()), float(value.max()))
    assert data["mean"] == pytest.approx(value.astype(np.float64).mean(), rel=1e-12)
    assert data["first_values"] == value.ravel()[:10].tolist() and data["more_values"] is True
    code, out, _ = run("inspect", os.path.join(TF_DIR, "tf_low_precision", "ckpt"), "--key",
                       f"model/float8_e4m3fn{SUFFIX}", "--json")
    assert code == 0 and (json.loads(out)["min"], json.loads(out)["max"]) == (-2.0, 448.0)


def test_inspect_key_counts_nan_and_inf_and_summarizes_the_finite_values(run, tmp_path):
    import jax.numpy as jnp

    path = checkpoint.Checkpoint(w=varstate.Variable(jnp.array([1.0, np.nan, 3.0, -np.inf, np.inf]), name="w"),
                                 dead=varstate.Variable(jnp.array([np.nan, np.inf]), name="dead"),
                                 n=varstate.Variable(jnp.array([1, 2]), name="n")).write(str(tmp_path / "c"))
    code, out, _ = run("inspect", path, "--key", "w")
    assert code == 0
    assert out.splitlines()[4:] == ["min: 1.0 (of the finite values)", "max: 3.0 (of the finite values)",
                                    "mean: 2.0 (of the finite values)", "nan: 1", "inf: 2",
                                    "first values: [1.0, nan, 3.0, -inf, inf]"]
    code, out, _ = run("inspect", path, "--key", "w", "--json")
    data = json.loads(out)
    assert (data["min"], data["max"], data["mean"], data["nan"], data["inf"]) == (1.0, 3.0, 2.0, 1, 2)
    code, out, _ = run("inspect", path, "--key", "dead")  # nothing finite: no statistics
    assert out.splitlines()[4:] == ["nan: 1", "inf: 1", "first values: [nan, inf]"]
    code, out, _ = run("inspect", path, "--key", "n")  # integers have no NaN to count
    assert out.splitlines()[4:] == ["min: 1", "max: 2", "mean: 1.5", "first values: [1, 2]"]


def _diff_pair(tmp_path):
    tensors = {n: expected(n) for n in EXPECTED}
    tensors["cls/weights"] = tensors["cls/weights"] + np.float32(0.25)
    tensors["counts"] = tensors["counts"].astype(np.int64)
    del tensors["scale"]
    tensors["new/bias"] = np.zeros(3, np.float32)
    other = str(tmp_path / "other")
    write_bundle(other, tensors)
    return other, tensors


def test_diff_json_reports_what_the_text_reports(run, tmp_path):
    other, tensors = _diff_pair(tmp_path)
    code, out, _ = run("diff", NAME_BASED, other, "--json")
    data = json.loads(out)
    assert code == 1 and data["match"] is False and data["shared_keys"] == len(EXPECTED) - 1 and data["atol"] == 0
    assert data["only_in_a"] == [{"key": "scale", "dtype": "float64", "shape": [2]}]
    assert data["only_in_b"] == [{"key": "new/bias", "dtype": "float32", "shape": [3]}]
    assert data["dtype_or_shape_differs"] == [{"key": "counts", "a": {"key": "counts", "dtype": "int32", "shape": [3]},
                                               "b": {"key": "counts", "dtype": "int64", "shape": [3]}}]
    assert data["object_graph"] == "none"
    values = {v["key"]: v for v in data["values"]}
    diff = float(np.abs(expected("cls/weights").astype(np.float64) - tensors["cls/weights"]).max())
    assert values["cls/weights"] == {"key": "cls/weights", "max_abs_diff": diff, "match": False}
    assert values["global_step"] == {"key": "global_step", "max_abs_diff": 0.0, "match": True}
    assert set(values) == set(EXPECTED) - {"scale", "counts"}


def test_diff_only_diff_lists_only_differing_values(run, tmp_path):
    other, _ = _diff_pair(tmp_path)
    _, full, _ = run("diff", NAME_BASED, other)
    code, out, _ = run("diff", NAME_BASED, other, "--only-diff")
    assert code == 1
    assert [ln.split() for ln in out.splitlines()] == [ln.split() for ln in full.splitlines()
                                                       if not ln.endswith(" match")]
    assert any(ln.startswith("cls/weights ") for ln in out.splitlines())
    code, out, _ = run("diff", NAME_BASED, other, "--only-diff", "--json")
    assert [v["key"] for v in json.loads(out)["values"]] == ["cls/weights"]
    code, out, _ = run("diff", NAME_BASED, NAME_BASED, "--only-diff")  # a match: only the verdict
    assert code == 0 and out == f"match ({len(EXPECTED)} shared keys, atol=0)\n"


def test_diff_json_writes_nan_as_a_string(run, tmp_path):
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    write_bundle(a, {"x": np.array([1.0, np.nan], np.float32)})
    write_bundle(b, {"x": np.array([1.0, 2.0], np.float32)})
    code, out, _ = run("diff", a, b, "--json")
    assert code == 1 and json.loads(out)["values"] == [{"key": "x", "max_abs_diff": "nan", "match": False}]


def test_version(run):
    from importlib import metadata

    code, out, _ = run("--version")
    assert code == 0 and out == f"varstate-ckpt {metadata.version('varstate')}\n"
    # one version, pyproject.toml's, for the distribution and both packages
    pyproject = tomllib.loads((pathlib.Path(__file__).parents[3] / "pyproject.toml").read_text())
    assert varstate.__version__ == checkpoint.__version__ == metadata.version("varstate") == pyproject["project"][
        "version"]


def _imported(argv):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    done = subprocess.run([sys.executable, "-X", "importtime", "-m", "checkpoint", *argv], capture_output=True,
                          text=True, env=env, timeout=120, check=False)
    modules = {ln.split("|")[-1].strip() for ln in done.stderr.splitlines() if ln.startswith("import time:")}
    return done, modules


@pytest.mark.parametrize("argv", [["--version"], ["inspect", os.path.join(TF_DIR, "ours_checkpoint", "ckpt-1")],
                                  ["inspect", os.path.join(TF_DIR, "ours_checkpoint", "ckpt-1"), "--json"],
                                  ["diff", NAME_BASED, NAME_BASED, "--json"]])
def test_tf_checkpoints_and_version_import_neither_jax_nor_orbax(argv):
    done, modules = _imported(argv)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "numpy" in modules or argv == ["--version"]  # the reference: importtime saw the imports
    assert not {m for m in modules if m.split(".")[0] in ("jax", "jaxlib", "orbax", "flax")}
