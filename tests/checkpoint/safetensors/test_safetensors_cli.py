"""`varstate-ckpt inspect` of safetensors files and indexes, and `convert` to and from safetensors.

References: TF-written fixtures (tests/data/tf_checkpoints, tests/data/tf_name_based), files the safetensors
package writes, and `checkpoint.safetensors.save`'s names; every conversion is read back.
"""

import json
import os
import re

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import save_file

import checkpoint
import checkpoint._cli._main as cli
import checkpoint._cli._out as cli_out
import checkpoint.safetensors as st
import varstate
from checkpoint import read_checkpoint
from checkpoint._storage import _safetensors as storage
from varstate.optimizers import Adam

DATA = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(__file__))), "data")
TF_DIR = os.path.join(DATA, "tf_checkpoints")
NAME_BASED = os.path.join(DATA, "tf_name_based", "model.ckpt-1234")
SUFFIX = "/.ATTRIBUTES/VARIABLE_VALUE"


@pytest.fixture
def run(capsys):
    def run(*argv):
        code = cli.main(list(argv))
        out, err = capsys.readouterr()
        return code, out, err

    return run


def assert_one_line_error(code, err, pattern):
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    assert re.fullmatch(r"varstate-ckpt: error: " + pattern + r"\n", err, re.S), err


def _tree():
    params = {"kernel": varstate.Variable(jnp.arange(6.0).reshape(2, 3)),
              "bias": varstate.Variable(jnp.ones(3, jnp.bfloat16))}
    return {"model": params, "optimizer": Adam(0.1).init(params), "step": 5}


def test_inspect_a_file_lists_names_dtypes_shapes_and_metadata(run, tmp_path):
    path = save = st.save(tmp_path / "m.safetensors", {"a": np.zeros((2, 3), ml_dtypes.bfloat16),
                                                       "b": np.ones(4, np.int64), "n": 3})
    code, out, err = run("inspect", save)
    assert code == 0 and err == ""
    lines = out.splitlines()
    assert lines[0] == f"{path}: safetensors"
    assert re.fullmatch(r"\s+a\s+bfloat16\s+\(2, 3\)\s+12 B", lines[1]) and re.fullmatch(
        r"\s+b\s+int64\s+\(4,\)\s+32 B", lines[2])
    assert '  metadata varstate.python: {"n": 3}' in lines and lines[-1] == "2 tensors, 44 B"
    code, out, _ = run("inspect", path, "--json")
    report = json.loads(out)
    assert report["tensors"] == [{"name": "a", "dtype": "bfloat16", "shape": [2, 3], "bytes": 12,
                                  "file": "m.safetensors"},
                                 {"name": "b", "dtype": "int64", "shape": [4], "bytes": 32, "file": "m.safetensors"}]
    assert (report["shards"], report["bytes"], report["metadata"]["varstate.names"]) == (0, 44, "object-graph paths")
    code, out, _ = run("inspect", path, "--key", "b")
    assert code == 0 and "min: 1" in out and "first values: [1, 1, 1, 1]" in out


def test_inspect_an_index_shows_the_shards(run, tmp_path, monkeypatch):
    index = st.save(tmp_path / "model.safetensors", {f"w{i}": np.zeros(10, np.float32) for i in range(3)},
                    max_shard_size=50)
    report = json.loads(run("inspect", index, "--json")[1])
    assert report["shards"] == 3 and report["files"] == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    assert [t["file"] for t in report["tensors"]] == report["files"]
    code, out, _ = run("inspect", str(tmp_path))  # the directory of the index
    assert code == 0 and out.splitlines()[0] == f"{index}: safetensors (3 shards)"
    assert out.splitlines()[1].endswith("model-00001-of-00003.safetensors")
    monkeypatch.setattr(cli_out, "is_terminal", lambda: True)
    code, out, _ = run("inspect", index)
    assert code == 0 and "model-00003-of-00003.safetensors" in out and "3 tensors" in out


def test_inspect_a_damaged_file_is_one_line(run, tmp_path):
    path = tmp_path / "bad.safetensors"
    path.write_bytes(b"\xff" * 16)
    code, _, err = run("inspect", str(path))
    assert_one_line_error(code, err, re.escape(str(path)) + r": the header length says \d+ bytes, .*")


def test_convert_a_checkpoint_to_safetensors_and_back(run, tmp_path):
    tree = _tree()
    prefix = checkpoint.Checkpoint(**tree).write(str(tmp_path / "ckpt"), format="tf")
    dst = str(tmp_path / "c.safetensors")
    code, out, _ = run("convert", prefix, dst, "--to", "safetensors")
    assert code == 0 and out.startswith(f"wrote {dst} (safetensors): 8 values") and "verified" in out
    ours = st.save(tmp_path / "ours.safetensors", tree)  # the same names and values as the library's own save
    with safe_open(dst, framework="flax") as a, safe_open(ours, framework="flax") as b:
        assert sorted(a.keys()) == sorted(b.keys()) and "model/kernel/.OPTIMIZER_SLOT/optimizer/m" in a.keys()
        assert all(np.array_equal(a.get_tensor(k), b.get_tensor(k)) for k in a.keys())
        assert json.loads(a.metadata()["varstate.python"]) == {"step": 5}
    back = st.load(dst, tree)  # what convert wrote loads into the template
    np.testing.assert_array_equal(back["model"]["kernel"].value, tree["model"]["kernel"].value)
    for fmt, out_path in (("tf", str(tmp_path / "back" / "ckpt")), ("orbax", str(tmp_path / "back_orbax"))):
        assert run("convert", dst, out_path, "--to", fmt)[0] == 0
        template = _tree()
        status = checkpoint.Checkpoint(**template).restore(out_path)
        status.assert_consumed()
        assert status.step == 5
        for a, b in ((status.model["bias"], tree["model"]["bias"]),
                     (status.optimizer.slots["v"]["kernel"], tree["optimizer"].slots["v"]["kernel"])):
            np.testing.assert_array_equal(np.asarray(a.value), np.asarray(b.value))
        assert run("diff", dst, out_path)[0] == 0


def test_convert_tf_fixtures_to_safetensors(run, tmp_path):
    src = os.path.join(TF_DIR, "ours_checkpoint")
    dst = str(tmp_path / "o.safetensors")
    assert run("convert", src, dst, "--to", "safetensors", "--max-shard-size", "1B")[0] == 0
    index = str(tmp_path / "o.safetensors.index.json")
    reader, source = storage.SafetensorsReader(index), read_checkpoint(src)
    for key in source.keys():
        if key.endswith(SUFFIX):
            assert reader.get(key[: -len(SUFFIX)]).tobytes() == np.asarray(source.get(key)).tobytes(), key
    named = str(tmp_path / "named.safetensors")
    assert run("convert", NAME_BASED, named, "--to", "safetensors")[0] == 0
    assert sorted(storage.SafetensorsReader(named).keys()) == sorted(read_checkpoint(NAME_BASED).keys())
    code, _, err = run("convert", os.path.join(TF_DIR, "tf_object"), str(tmp_path / "s.safetensors"), "--to",
                       "safetensors")
    assert_one_line_error(code, err, r"'model/dtypes/string/\.ATTRIBUTES/VARIABLE_VALUE' is a string tensor, which "
                                     r"safetensors cannot hold; convert --to tf")
    assert not os.path.exists(tmp_path / "s.safetensors")
    code, _, err = run("convert", src, str(tmp_path / "x"), "--to", "tf", "--max-shard-size", "1GB")
    assert_one_line_error(code, err, "--max-shard-size is for --to safetensors only")


def test_convert_keeps_a_child_named_empty_between_the_root_and_its_children(run, tmp_path):
    # A tree {"": {"y": v}} names y "/y" (TF's join of "" and "y"); converted, the checkpoint restores into the
    # same structure, and a checkpoint of that structure converts back to the same names.
    tree = {"": {"y": varstate.Variable(jnp.arange(3.0))}, "z": varstate.Variable(jnp.ones(2))}
    src = st.save(tmp_path / "t.safetensors", tree)
    with safe_open(src, framework="numpy") as f:
        assert sorted(f.keys()) == ["/y", "z"]
    for fmt in ("tf", "orbax"):
        out_path = str(tmp_path / fmt / "ckpt")
        assert run("convert", src, out_path, "--to", fmt)[0] == 0
        template = {"": {"y": varstate.Variable(jnp.zeros(3))}, "z": varstate.Variable(jnp.zeros(2))}
        status = checkpoint.Checkpoint(**template).restore(out_path)
        status.assert_consumed()
        np.testing.assert_array_equal(np.asarray(status.roots[""]["y"].value), np.arange(3.0))
        back = str(tmp_path / f"{fmt}.safetensors")
        assert run("convert", out_path, back, "--to", "safetensors")[0] == 0
        with safe_open(back, framework="numpy") as f:
            assert sorted(f.keys()) == ["/y", "z"]


def test_convert_a_hugging_face_file_is_name_based(run, tmp_path):
    src = str(tmp_path / "hf.safetensors")
    values = {"model.embed.weight": np.arange(6, dtype=np.float16).reshape(3, 2),
              "model.norm.weight": np.ones(2, ml_dtypes.bfloat16)}
    save_file(values, src)
    dst = str(tmp_path / "ckpt")
    code, out, _ = run("convert", src, dst, "--to", "tf")
    assert code == 0 and "2 values" in out
    back = read_checkpoint(dst)
    assert back.object_graph is None and sorted(back.keys()) == sorted(values)
    for name, v in values.items():
        assert back.get(name).dtype == v.dtype and back.get(name).tobytes() == v.tobytes()


def test_convert_never_replaces_a_sharded_output_and_names_its_destination_safetensors(run, tmp_path):
    src = checkpoint.Checkpoint(model={"v": varstate.Variable(jnp.ones(64)), "w": varstate.Variable(jnp.zeros(64))}
                                ).write(str(tmp_path / "one"))
    dst = str(tmp_path / "model.safetensors")
    assert run("convert", src, dst, "--to", "safetensors", "--max-shard-size", "300")[0] == 0  # a plain byte count
    for args in ((), ("--max-shard-size", "300B")):
        code, _, err = run("convert", src, dst, "--to", "safetensors", *args)
        index = str(tmp_path / "model.safetensors.index.json")
        assert_one_line_error(code, err, re.escape(f"destination {dst!r}: {index!r} already exists; remove it (and "
                                                   "any shards beside it) or choose another path"))
    os.remove(tmp_path / "model.safetensors.index.json")  # its shards alone still block the name
    code, _, err = run("convert", src, dst, "--to", "safetensors", "--max-shard-size", "300B")
    assert_one_line_error(code, err, r".*model-00001-of-00002.safetensors' already exists.*")
    for bad in ("x.safetensors.index.json", "out"):
        code, _, err = run("convert", src, str(tmp_path / bad), "--to", "safetensors")
        assert_one_line_error(code, err, r"destination .*: name it \*.safetensors \(with --max-shard-size, the shards "
                                         r"and the \*.safetensors.index.json index are named from it\)")
        assert not os.path.exists(tmp_path / bad)
    code, _, err = run("convert", src, str(tmp_path / "z.safetensors"), "--to", "safetensors", "--max-shard-size", "0B")
    assert_one_line_error(code, err, r".*max_shard_size '0B' is not a positive number of bytes.*")


def test_verify_and_strip_on_safetensors_directories_and_missing_shards(run, tmp_path):
    hub = tmp_path / "hub"
    hub.mkdir()
    save_file({"a": np.ones(2, np.float32)}, str(hub / "pytorch_model.safetensors"))  # one file of another name
    for verb in ("inspect", "verify"):
        assert run(verb, str(hub))[0] == 0
    index = st.save(tmp_path / "m" / "model.safetensors", {"a": np.ones(64, np.float32), "b": np.ones(64, np.int8)},
                    max_shard_size=200)
    code, out, err = run("verify", str(tmp_path / "m"))  # the directory, as inspect and load take it
    assert (code, err) == (0, "") and out.splitlines()[-1] == "OK"
    os.remove(tmp_path / "m" / "model-00002-of-00002.safetensors")
    code, out, err = run("verify", index)
    assert (code, err) == (1, "")
    assert re.fullmatch(r"DAMAGED: found on opening it, before any value was read: .*model.safetensors.index.json: "
                        r"the index puts 1 tensor \('b' first\) in model-00002-of-00002.safetensors, which is "
                        r"missing from .*", out.splitlines()[1])
    code, _, err = run("strip-optimizer", str(hub / "pytorch_model.safetensors"), str(tmp_path / "s"))
    assert_one_line_error(code, err, r".*pytorch_model.safetensors is safetensors, which records no object graph, "
                                     r"so which of its values are optimizer state is not known; convert it to the TF "
                                     r"format first .*")
    (tmp_path / "empty.safetensors").mkdir()  # every verb gives load's message, not the TF/orbax one
    for argv in (("inspect",), ("verify",), ("convert", "--to", "orbax", str(tmp_path / "o"))):
        code, _, err = run(argv[0], str(tmp_path / "empty.safetensors"), *argv[1:])
        assert_one_line_error(code, err, r".*empty.safetensors: expected one \*\.safetensors\.index\.json index or "
                                         r"one \*\.safetensors file in the directory, found none; pass the file or "
                                         r"the index itself")


def test_load_without_a_template_names_a_value_its_sharding_cannot_lay_out(tmp_path):
    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    path = st.save(tmp_path / "m.safetensors", {"w": np.zeros((8, 4), np.float32), "scale": np.float32(2.0)})
    rows = NamedSharding(jax.make_mesh((2,), ("a",)), PartitionSpec("a"))
    with pytest.raises(ValueError, match=r"checkpoint.safetensors.load: .*m.safetensors: tensor 'scale' of shape \(\) "
                                         r"cannot take NamedSharding.* \(its spec has more axes than the value\); give "
                                         r"a template with a sharding per value"):
        st.load(path, sharding=rows)
    loaded = st.load(path, sharding=NamedSharding(rows.mesh, PartitionSpec()))
    assert loaded["scale"].item() == 2.0 and loaded["w"].sharding.is_fully_replicated
