"""checkpoint.export / load: SavedObjectGraph, variables bundle, jax.export functions, assets, revived types."""

import dataclasses
import logging
import os
import pathlib
import re
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import checkpoint
import varstate
from checkpoint._export import _format, _load
from checkpoint._storage import write_bundle
from checkpoint.protos import saved_object_graph_pb2 as pb
from checkpoint.protos.versions_pb2 import VersionDef

BATCH = jax.ShapeDtypeStruct(jax.export.symbolic_shape("n, 3"), jnp.float32)


def _model():
    w = varstate.Variable(jnp.arange(6.0).reshape(3, 2), name="dense/kernel")
    b = varstate.Variable(jnp.array([0.5, -1.0]), name="dense/bias", trainable=False,
                          synchronization="on_read", aggregation="mean")
    return {"dense": {"kernel": w, "bias": b}, "tied": w, "scale": jnp.float32(2.0),
            "meta": [7, 2.5, "relu", True], "pair": (jnp.arange(3), 1)}


def _serve(root, x):
    d = root["dense"]
    return {"y": (x @ d["kernel"].value + d["bias"].value) * root["scale"], "k": root["meta"][0]}


def _definition(path):
    return pb.ExportDef.FromString(pathlib.Path(path, "export.pb").read_bytes())


def _edit(path, change):
    """Rewrites the export's ExportDef through `change(definition)`, sealed with its new sha256 as export does."""
    definition = _definition(path)
    definition.DiscardUnknownFields()  # the old sha256
    change(definition)
    pathlib.Path(path, "export.pb").write_bytes(_format.seal(definition.SerializeToString()))


@pytest.fixture
def exported(tmp_path):
    root = _model()
    return checkpoint.export(tmp_path / "m", root, {"serve": (_serve, (BATCH,))}), root


def test_round_trip_mirrors_the_root(exported):
    path, root = exported
    loaded = checkpoint.load(path)
    kernel, bias = loaded.dense["kernel"], loaded.dense["bias"]
    assert isinstance(kernel, varstate.Variable) and loaded.tied is kernel  # one variable, reachable twice
    assert (kernel.name, kernel.trainable, bias.name, bias.trainable) == ("dense/kernel", True, "dense/bias", False)
    assert (bias.synchronization.name, bias.aggregation.name) == ("ON_READ", "MEAN")
    np.testing.assert_array_equal(kernel.value, root["dense"]["kernel"].value)
    assert loaded.meta == [7, 2.5, "relu", True] and [type(x) for x in loaded.meta] == [int, float, str, bool]
    assert isinstance(loaded.pair, tuple) and loaded.pair[1] == 1
    np.testing.assert_array_equal(loaded.pair[0], np.arange(3))
    assert float(loaded.scale) == 2.0 and sorted(loaded.signatures) == ["serve"]


def test_signature_matches_the_function_for_any_batch(exported):
    path, root = exported
    serve = checkpoint.load(path).signatures["serve"]
    for n in (1, 5):
        x = jnp.arange(n * 3, dtype=jnp.float32).reshape(n, 3)
        got, want = serve(x), _serve(root, x)
        np.testing.assert_array_equal(got["y"], want["y"])
        assert int(got["k"]) == 7


def test_graph_and_variables_bundle_use_tf_keys(exported):
    path, _ = exported
    definition = _definition(path)
    nodes = definition.object_graph.nodes
    kinds = {ref.local_name: nodes[ref.node_id].WhichOneof("kind") for ref in nodes[0].children}
    assert kinds == {"dense": "user_object", "tied": "variable", "scale": "constant", "meta": "user_object",
                     "pair": "user_object", "signatures": "user_object"}
    assert nodes[0].user_object.identifier == "trackable_dict_wrapper"
    reader = checkpoint.read_checkpoint(os.path.join(path, "variables", "variables"))
    # BFS order, as TF: the kernel's first path is root.tied; the bias is root.dense.bias.
    assert {"tied/.ATTRIBUTES/VARIABLE_VALUE", "dense/bias/.ATTRIBUTES/VARIABLE_VALUE"} <= set(reader.keys())
    np.testing.assert_array_equal(reader.get("dense/bias/.ATTRIBUTES/VARIABLE_VALUE"), [0.5, -1.0])
    tied = nodes[next(r.node_id for r in nodes[0].children if r.local_name == "tied")].variable
    assert (tied.name, [d.size for d in tied.shape.dim], tied.trainable) == ("dense/kernel", [3, 2], True)
    (name, fn), = definition.object_graph.concrete_functions.items()
    # bound_inputs: exactly what serve reads (kernel, bias, scale, not meta/pair), as TF's captures.
    read = {"tied", "dense/bias", "scale"}
    labels = {i: p for i, p in enumerate(_node_paths(nodes))}
    assert {labels[i] for i in fn.bound_inputs} == read
    spec = fn.canonicalized_input_signature.tuple_value.values[0].tuple_value.values[0].tensor_spec_value
    assert [(d.size, d.name) for d in spec.shape.dim] == [(-1, "n"), (3, "")]
    assert sorted(fn.output_signature.dict_value.fields) == ["k", "y"]
    assert sorted(os.listdir(os.path.join(path, "functions"))) == [name]


def _node_paths(nodes):
    paths = {0: ""}
    for i, node in enumerate(nodes):
        for ref in node.children:
            paths.setdefault(ref.node_id, f"{paths[i]}/{ref.local_name}".lstrip("/"))
    return [paths.get(i) for i in range(len(nodes))]


def test_loaded_function_reads_the_restored_values(exported):
    path, root = exported
    prefix = os.path.join(path, "variables", "variables")
    reader = checkpoint.read_checkpoint(prefix)
    tensors = {k: reader.get(k) for k in reader.keys()}
    tensors["tied/.ATTRIBUTES/VARIABLE_VALUE"] = tensors["tied/.ATTRIBUTES/VARIABLE_VALUE"] * 10
    tensors["_CHECKPOINTABLE_OBJECT_GRAPH"] = reader.object_graph.SerializeToString()
    write_bundle(prefix, tensors)
    loaded = checkpoint.load(path)
    x = jnp.ones((2, 3))
    changed = dict(root, dense=dict(root["dense"], kernel=root["dense"]["kernel"].assign(root["tied"].value * 10)))
    np.testing.assert_array_equal(loaded.signatures["serve"](x)["y"], _serve(changed, x)["y"])


DEFS = '''
import dataclasses, jax, jax.numpy as jnp

@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Mlp:
    w: object
    b: object

def forward(model, x):
    return jnp.tanh(x @ model.w.value + model.b.value)
'''

LOAD_ELSEWHERE = '''
import sys, numpy as np, checkpoint
loaded = checkpoint.load(sys.argv[1])
assert "mlp_defs" not in sys.modules
try:
    import mlp_defs
except ImportError:
    pass
else:
    raise SystemExit("the defining module is importable")
y = loaded.signatures["forward"](np.ones((2, 3), np.float32))
print(type(loaded.model).__name__, loaded.model.w.name, np.asarray(y).round(6).tolist())
'''


def test_runs_in_a_fresh_process_without_the_defining_code(tmp_path, monkeypatch):
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "mlp_defs.py").write_text(textwrap.dedent(DEFS))
    monkeypatch.syspath_prepend(str(tmp_path / "src"))
    import mlp_defs

    model = mlp_defs.Mlp(varstate.Variable(jnp.full((3, 2), 0.25), name="w"), varstate.Variable(jnp.ones(2), name="b"))
    path = checkpoint.export(tmp_path / "m", {"model": model},
                             {"forward": (lambda r, x: mlp_defs.forward(r["model"], x), (BATCH,))})
    want = np.asarray(mlp_defs.forward(model, jnp.ones((2, 3)))).round(6).tolist()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run([sys.executable, "-c", LOAD_ELSEWHERE, path], capture_output=True, text=True, env=env,
                          cwd=tmp_path, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split(" ", 2) == ["RevivedObject", "w", f"{want}\n"]


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Block:
    kernel: varstate.Variable
    rate: float = dataclasses.field(metadata={"static": False}, default=0.5)


@pytest.fixture
def revived():
    # The registries are module-level dicts shared by save and load: emptied here, restored after.
    saved = dict(_format.REVIVED), dict(_format.IDENTIFIER_OF)
    _format.REVIVED.clear()
    _format.IDENTIFIER_OF.clear()
    yield
    for registry, before in zip((_format.REVIVED, _format.IDENTIFIER_OF), saved, strict=True):
        registry.clear()
        registry.update(before)


def _export_block(tmp_path, **registration):
    checkpoint.register_revived_type("test.Block", Block, **registration)
    return checkpoint.export(tmp_path / "m", {"block": Block(varstate.Variable(jnp.ones(2), name="k"))})


def test_revived_type_comes_back_as_its_class(tmp_path, revived):
    path = _export_block(tmp_path, version=2, min_consumer_version=1)
    uo = _definition(path).object_graph.nodes[1].user_object
    assert (uo.identifier, uo.version.producer, uo.version.min_consumer) == ("test.Block", 2, 1)
    block = checkpoint.load(path).block
    assert isinstance(block, Block) and block.kernel.name == "k" and block.rate == 0.5


@pytest.mark.parametrize("written, loader, why", [
    (dict(version=3, min_consumer_version=3), dict(version=2), "no registered version accepts version 3"),
    (dict(version=2, bad_consumers=(1,)), dict(version=1), r"bad_consumers \[1\]"),
    (dict(version=1), dict(version=1, min_producer_version=2), "no registered version accepts version 1"),
    (dict(version=1), None, "the type is not registered here"),
])
def test_incompatible_revived_type_loads_as_generic_and_says_so(tmp_path, revived, caplog, written, loader, why):
    path = _export_block(tmp_path, **written)
    _format.REVIVED.clear()
    _format.IDENTIFIER_OF.clear()
    if loader is not None:
        checkpoint.register_revived_type("test.Block", Block, **loader)
    with caplog.at_level(logging.WARNING, logger="checkpoint"):
        block = checkpoint.load(path).block
    assert isinstance(block, _load.RevivedObject) and block.kernel.name == "k" and block.rate == 0.5
    assert "(root).block" in caplog.text and "test_export.Block" in caplog.text
    assert "loaded as a generic object" in caplog.text
    assert re.search(why, caplog.text)


def test_loader_uses_its_highest_compatible_version(tmp_path, revived):
    path = _export_block(tmp_path, version=3, min_consumer_version=2, bad_consumers=(3,))
    checkpoint.register_revived_type("test.Block", Block, version=1, from_children=lambda c: ("v1", c))
    checkpoint.register_revived_type("test.Block", Block, version=2, from_children=lambda c: ("v2", c))
    checkpoint.register_revived_type("test.Block", Block, version=3, from_children=lambda c: ("v3", c))
    assert checkpoint.load(path).block[0] == "v2"  # 3 is a bad consumer, 1 is below min_consumer


def test_register_revived_type_errors(revived):
    with pytest.raises(ValueError, match="identifier must be a new non-empty string, got 'trackable_dict_wrapper'"):
        checkpoint.register_revived_type("trackable_dict_wrapper", Block)
    checkpoint.register_revived_type("test.Block", Block)
    with pytest.raises(ValueError, match=r"Block is already registered as 'test\.Block'"):
        checkpoint.register_revived_type("other", Block)


def test_assets_are_copied_and_stay_inside(tmp_path):
    for sub in ("a", "b"):
        (tmp_path / sub).mkdir()
        (tmp_path / sub / "vocab.txt").write_text(f"words {sub}")
    root = {"v": checkpoint.Asset(tmp_path / "a" / "vocab.txt"), "tables": {"other": checkpoint.Asset(
        tmp_path / "b" / "vocab.txt")}, "w": varstate.Variable(jnp.ones(1))}
    path = checkpoint.export(tmp_path / "m", root)
    assert sorted(os.listdir(os.path.join(path, "assets"))) == ["vocab.txt", "vocab_1.txt"]
    loaded = checkpoint.load(path)
    assert pathlib.Path(loaded.v.asset_path).read_text() == "words a"
    assert pathlib.Path(loaded.tables["other"].asset_path).read_text() == "words b"
    assert os.path.dirname(loaded.v.asset_path) == os.path.realpath(os.path.join(path, "assets"))

    _edit(path, lambda d: setattr(d.asset_file_def[0], "filename", "../../escape.txt"))
    with pytest.raises(checkpoint.CheckpointFormatError, match=r"asset file name '../../escape.txt' leads outside"):
        checkpoint.load(path)
    _edit(path, lambda d: setattr(d.asset_file_def[0], "filename", "vocab.txt"))
    os.remove(os.path.join(path, "assets", "vocab.txt"))
    os.symlink(tmp_path / "a" / "vocab.txt", os.path.join(path, "assets", "vocab.txt"))
    with pytest.raises(checkpoint.CheckpointFormatError, match=r"node \d+ \(\(root\)\.[a-z.]+\): asset 'vocab\.txt' is "
                                                             r"a symbolic link \(.*\), which load refuses"):
        checkpoint.load(path)


def test_load_refuses_what_is_not_an_export(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"is not an export written by checkpoint\.export"):
        checkpoint.load(tmp_path)
    (tmp_path / "saved_model.pb").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match="It is a TensorFlow SavedModel"):
        checkpoint.load(tmp_path)
    (tmp_path / "export.pb").write_bytes(b"\xff\xff\xff")
    with pytest.raises(checkpoint.CheckpointFormatError, match="not a valid ExportDef"):
        checkpoint.load(tmp_path)
    (tmp_path / "export.pb").write_bytes(b"")
    with pytest.raises(checkpoint.CheckpointFormatError, match="no format version"):
        checkpoint.load(tmp_path)


def test_load_refuses_a_newer_format(exported):
    path, _ = exported
    _edit(path, lambda d: d.version.CopyFrom(VersionDef(producer=5, min_consumer=2)))
    _edit(path, lambda d: d.version.CopyFrom(VersionDef(producer=5, min_consumer=3)))
    newer = r"format version 5 for readers of version >= 3 except \[\]; this reader is version 2\. Upgrade varstate"
    with pytest.raises(ValueError, match=newer):
        checkpoint.load(path)
    _edit(path, lambda d: d.version.CopyFrom(VersionDef(producer=5, min_consumer=1, bad_consumers=[2])))
    with pytest.raises(ValueError, match=r">= 1 except \[2\]; this reader is version 2"):
        checkpoint.load(path)


def test_load_refuses_a_tampered_function_file(exported):
    path, _ = exported
    (name,) = os.listdir(os.path.join(path, "functions"))
    file = os.path.join(path, "functions", name)
    data = bytearray(pathlib.Path(file).read_bytes())
    data[len(data) // 2] ^= 1
    pathlib.Path(file).write_bytes(bytes(data))
    with pytest.raises(checkpoint.CheckpointFormatError, match=f"{name}: the function file does not match its sha256"):
        checkpoint.load(path)


def test_load_refuses_a_damaged_graph(exported):
    path, _ = exported
    _edit(path, lambda d: d.object_graph.nodes[1].children.add(node_id=0, local_name="loop"))
    with pytest.raises(checkpoint.CheckpointFormatError, match="refers to node 0, outside"):
        checkpoint.load(path)
    _edit(path, lambda d: setattr(d.object_graph.nodes[1].children[-1], "node_id", 1))
    with pytest.raises(checkpoint.CheckpointFormatError, match=r"node 1 \(\(root\)\.dense\): .*cycle"):
        checkpoint.load(path)


def test_signature_checks_its_arguments(exported):
    serve = checkpoint.load(exported[0]).signatures["serve"]
    what = f"Signature 'serve' of {exported[0]}"
    assert serve(jnp.ones((2, 3)))["y"].shape == (2, 2)  # accepted once: later calls of other shapes still checked
    with pytest.raises(ValueError, match=rf"{what}: input 0 expects float32\[n,3\], got float32\[2,4\]"):
        serve(jnp.ones((2, 4)))
    with pytest.raises(TypeError, match=r"input 0 expects float32\[n,3\], got int32\[2,3\]"):
        serve(jnp.ones((2, 3), jnp.int32))
    with pytest.raises(TypeError, match=rf"{what} takes 1 positional argument\(s\), got 2"):
        serve(jnp.ones((2, 3)), jnp.ones(3))
    with pytest.raises(TypeError, match=r"argument 0 has structure PyTreeDef\(\[\*\]\), expected PyTreeDef\(\*\)"):
        serve([jnp.ones((2, 3))])
    with pytest.raises(TypeError, match=r"input 0 expects float32\[n,3\], got float64\[2,3\]"):
        serve(np.ones((2, 3)))  # numpy's float64, not converted behind the caller's back
    assert serve(np.ones((5, 3), np.float32))["y"].shape == (5, 2) and serve(2 * jnp.ones((2, 3)))["k"] == 7


def test_export_errors(tmp_path):
    root = {"w": varstate.Variable(jnp.ones(2))}
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    with pytest.raises(FileExistsError, match="exists and is not an empty directory"):
        checkpoint.export(tmp_path / "full", root)
    with pytest.raises(TypeError, match=r"root must be a container pytree .* got Variable"):
        checkpoint.export(tmp_path / "a", root["w"])
    with pytest.raises(ValueError, match="the root's child 'signatures' is reserved"):
        checkpoint.export(tmp_path / "a", {"signatures": jnp.ones(1)})
    with pytest.raises(TypeError, match="signature 'f' must be \\(fn, example_args\\)"):
        checkpoint.export(tmp_path / "a", root, {"f": lambda r, x: x})
    with pytest.raises(ValueError, match="'p' is a partitioned variable"):
        checkpoint.export(tmp_path / "a", {"p": varstate.PartitionedVariable(jnp.ones((4, 2)), name="p", num_shards=2)})
    with pytest.raises(FileNotFoundError, match=r"asset 'vocab' names .*missing.txt'?, not a file"):
        checkpoint.export(tmp_path / "a", {"vocab": checkpoint.Asset(tmp_path / "missing.txt")})

    def broken(r, x):
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom") as info:
        checkpoint.export(tmp_path / "a", root, {"f": (broken, (jnp.ones(2),))})
    assert "while exporting signature 'f' with jax.export" in info.value.__notes__
    assert not os.path.exists(tmp_path / "a") and os.listdir(tmp_path) == ["full"]  # nothing half-written left


def test_outputs_may_be_variables_and_unread_inputs_are_not_bound(tmp_path):
    root = {"w": varstate.Variable(jnp.ones(2), name="w"), "unused": varstate.Variable(jnp.zeros(3))}
    path = checkpoint.export(tmp_path / "m", root, {"step": (lambda r, g: r["w"].assign_sub(g), (jnp.ones(2),))})
    fn = _definition(path).object_graph.concrete_functions
    assert [len(f.bound_inputs) for f in fn.values()] == [1]
    out = checkpoint.load(path).signatures["step"](jnp.array([0.5, 2.0]))
    np.testing.assert_array_equal(out, [0.5, -1.0])


def test_sharded_variables_and_several_platforms(tmp_path):
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("x",))
    table = varstate.Variable(jax.device_put(jnp.arange(16.0).reshape(8, 2),
                                             jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("x"))))
    lookup = lambda r, ids: r["table"].value[ids]
    path = checkpoint.export(tmp_path / "m", {"table": table}, {"lookup": (lookup, (jnp.zeros(3, jnp.int32),))},
                             platforms=("cpu", "cuda", "tpu"))
    sig = checkpoint.load(path).signatures["lookup"]
    assert sig.exported.platforms == ("cpu", "cuda", "tpu") and sig.exported.nr_devices == 1
    ids = jnp.array([7, 0, 3])
    np.testing.assert_array_equal(sig(ids), lookup({"table": table}, ids))


def test_load_refuses_values_that_disagree_with_the_graph(exported):
    path, _ = exported
    tied = lambda d: d.object_graph.nodes[next(r.node_id for r in d.object_graph.nodes[0].children
                                               if r.local_name == "tied")]
    _edit(path, lambda d: tied(d).variable.shape.dim[0].__setattr__("size", 4))
    wrong = r"node \d+ \(\(root\)\.tied\): stored value is float32\[3, 2\], the graph says float32\[4, 2\]"
    with pytest.raises(checkpoint.CheckpointFormatError, match=wrong):
        checkpoint.load(path)
    _edit(path, lambda d: tied(d).ClearField("variable"))
    with pytest.raises(checkpoint.CheckpointFormatError, match=r"\(\(root\)\.tied\): has kind None, which load"):
        checkpoint.load(path)
    _edit(path, lambda d: tied(d).constant.__setattr__("operation", "no/such/key"))
    with pytest.raises(checkpoint.CheckpointFormatError, match="its value 'no/such/key' is missing from"):
        checkpoint.load(path)


def test_a_failing_revival_names_the_object(tmp_path, revived):
    path = _export_block(tmp_path)
    _format.REVIVED.clear()
    _format.IDENTIFIER_OF.clear()
    checkpoint.register_revived_type("test.Block", Block, from_children=lambda c: Block(**c, extra=1))
    with pytest.raises(TypeError, match="unexpected keyword argument 'extra'") as info:
        checkpoint.load(path)
    assert info.value.__notes__ == ["while reviving (root).block as 'test.Block' version 1"]


def test_64_bit_values_load_as_jaxs_32_bit_types_and_export_again_as_64_bit(tmp_path):
    # The global step is TF's int64; with JAX's 64-bit types off it is held as int32 and stored as int64.
    assert not jax.config.jax_enable_x64
    root = {"step": varstate.get_or_create_global_step().assign(5), "table": np.arange(3, dtype=np.int64)}
    path = checkpoint.export(tmp_path / "m", root, {"next": (lambda r, x: r["step"].value + x, (jnp.int32(1),))})
    graph = _definition(path).object_graph
    step_node = next(n for n in graph.nodes if n.WhichOneof("kind") == "variable")
    assert step_node.variable.dtype == 9  # DT_INT64, as TF describes its global step
    loaded = checkpoint.load(path)
    assert (loaded.step.dtype, int(loaded.step), loaded.step.name) == (jnp.int32, 5, "global_step")
    assert loaded.table.dtype == jnp.int32 and loaded.table.tolist() == [0, 1, 2]
    assert int(loaded.signatures["next"](jnp.int32(2))) == 7
    with jax.enable_x64(True):  # loaded where JAX holds int64: the step is int64, the function still int32
        wide = checkpoint.load(path, registry=varstate.Registry())
        assert wide.step.dtype == jnp.int64 and int(wide.signatures["next"](jnp.int32(2))) == 7
    again = checkpoint.load(checkpoint.export(tmp_path / "again", {"step": loaded.step}))
    assert int(again.step) == 5
    reader = checkpoint.read_checkpoint(os.path.join(tmp_path / "again", "variables", "variables"))
    assert reader.dtype("step/.ATTRIBUTES/VARIABLE_VALUE") == np.int64
    far = checkpoint.export(tmp_path / "far", {"c": np.array([1, 2 ** 40], np.int64)})
    want = (r"'c/\.ATTRIBUTES/VARIABLE_VALUE' \(int64\) holds 1099511627776, out of range for variable "
            r"'\(root\)\.c' \(int32; JAX's 64-bit types are disabled\)")
    with pytest.raises(ValueError, match=want):
        checkpoint.load(far)
