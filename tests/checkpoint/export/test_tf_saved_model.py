"""checkpoint.export_saved_model: a TF SavedModel written without TF, checked against what TF made of it.

Reference: tests/data/tf_serving/ (make_tf_serving_fixtures.py, run by hand with TF 2.21): the
SavedModels TF loaded, the outputs TF computed from them (tf.saved_model.load and saved_model_cli
run's session loader), the variables TF restored, saved_model_cli show's listing, saved_model.pb as
TF's own protos parse it, and the structure TF writes for a tf.Module (reference.json).
"""

import importlib.util
import json
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from google.protobuf import text_format

import checkpoint
import checkpoint._cli._main as cli
import varstate
from checkpoint import _dtypes
from checkpoint._export import _tf_saved_model
from checkpoint.protos import meta_graph_pb2, types_pb2

DATA = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(__file__))), "data")
SERVING = os.path.join(DATA, "tf_serving")
_spec = importlib.util.spec_from_file_location("make_tf_serving_fixtures",
                                               os.path.join(DATA, "make_tf_serving_fixtures.py"))
assert _spec is not None and _spec.loader is not None
FIXTURES = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(FIXTURES)
RECORDS = dict(np.load(os.path.join(SERVING, "records.npz")))
INPUTS = dict(np.load(os.path.join(SERVING, "inputs.npz")))
with open(os.path.join(SERVING, "reference.json")) as f:
    REFERENCE = json.load(f)
MULTI = FIXTURES.MULTI  # mlp exported with platforms=("cpu", "cuda")
MODELS = ["mlp", "ints", "two", MULTI]
X = jax.ShapeDtypeStruct((2, 3), jnp.float32)


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """{model: (directory, root, signatures)}: the fixture models exported again, by this code."""
    out = tmp_path_factory.mktemp("serving")
    models = {name: (checkpoint.export_saved_model(out / name, root, sigs), root, sigs)
              for name, (root, sigs, _) in FIXTURES.models().items()}
    _, root, sigs = models["mlp"]
    models[MULTI] = (checkpoint.export_saved_model(out / MULTI, root, sigs, platforms=("cpu", "cuda")), root, sigs)
    return models


def _meta(directory):
    sm = meta_graph_pb2.SavedModel()
    with open(os.path.join(directory, "saved_model.pb"), "rb") as f:
        sm.ParseFromString(f.read())
    return sm


def _functions(meta):
    return {f.signature.name: f for f in meta.graph_def.library.function}


def _named(result):
    """`fn`'s result by output name: a dict's keys, else output_0, output_1... (TF's names)."""
    if isinstance(result, dict):
        return result
    return {f"output_{j}": r for j, r in enumerate(result if isinstance(result, (tuple, list)) else [result])}


def _without_modules(sm, keep_length=False):
    """`sm` with each XlaCallModule's StableHLO blanked (or its length): its debug locations name the caller's stack."""
    for fn in sm.meta_graphs[0].graph_def.library.function:
        for node in fn.node_def:
            if node.op == "XlaCallModule":
                node.attr["module"].s = b"%d bytes" % len(node.attr["module"].s) if keep_length else b""
    return sm


@pytest.mark.parametrize("model", MODELS)
def test_reexport_is_the_savedmodel_tf_loaded(exported, model):
    ours = exported[model][0]
    for rel in ("variables/variables.index", "variables/variables.data-00000-of-00001"):
        with open(os.path.join(ours, rel), "rb") as a, open(os.path.join(SERVING, model, rel), "rb") as b:
            assert a.read() == b.read(), rel
    assert _without_modules(_meta(ours)) == _without_modules(_meta(os.path.join(SERVING, model)))


@pytest.mark.parametrize("model", MODELS)
def test_tf_protos_parse_ours_to_the_same_message(model):
    """TF's own protos (tf_text_*.txt) read every field we wrote with the number and type we meant."""
    sm = _without_modules(_meta(os.path.join(SERVING, model)), keep_length=True)
    with open(os.path.join(SERVING, f"tf_text_{model}.txt")) as f:
        assert text_format.MessageToString(sm) == f.read()


@pytest.mark.parametrize("model", MODELS)
def test_our_outputs_equal_what_tf_computed(exported, model):
    _, root, sigs = exported[model]
    for sig, (fn, _) in sigs.items():
        source = "mlp" if model == MULTI else model  # whose inputs TF ran it on
        feed = {k.split("/")[2]: v for k, v in INPUTS.items() if k.startswith(f"{source}/{sig}/")}
        names = _tf_saved_model._arg_names(fn, len(feed), sig)
        ours = _named(fn(root, *(jnp.asarray(feed[n]) for n in names)))
        assert ours and {k for k in RECORDS if k.startswith(f"{model}/{sig}/")} == {f"{model}/{sig}/{k}" for k in ours}
        for key, value in ours.items():
            for source in (f"{model}/{sig}/{key}", f"session/{model}/{sig}/{key}"):
                tf_value = RECORDS[source]
                assert tf_value.dtype == value.dtype and tf_value.shape == value.shape, source
                if np.issubdtype(tf_value.dtype, np.floating):
                    np.testing.assert_allclose(value, tf_value, rtol=1e-6, atol=0, err_msg=source)
                else:
                    np.testing.assert_array_equal(value, tf_value, err_msg=source)


@pytest.mark.parametrize("model", MODELS)
def test_tf_restored_our_variables_bit_for_bit(exported, model):
    _, root, _ = exported[model]
    leaves = jax.tree.leaves(root, is_leaf=lambda x: isinstance(x, varstate.Variable))
    ours = {v.name: np.asarray(v.value) for v in leaves if isinstance(v, varstate.Variable)}
    if model in ("mlp", MULTI):
        ours["scale"] = np.asarray(root["scale"])  # an array leaf: a non-trainable TF variable named by its path
    recorded = {k.split("/", 2)[2]: v for k, v in RECORDS.items() if k.startswith(f"variables/{model}/")}
    assert recorded.keys() == ours.keys()
    for name, value in ours.items():
        assert recorded[name].dtype == value.dtype and recorded[name].tobytes() == value.tobytes(), name


def test_structure_is_tfs_own():
    """Ours (the mlp) against what TF 2.21 writes for a tf.Module with one variable and one signature."""
    sm = _meta(os.path.join(SERVING, "mlp"))
    meta = sm.meta_graphs[0]
    fns = _functions(meta)
    assert list(meta.meta_info_def.tags) == REFERENCE["tags"]
    assert {n.op for n in meta.graph_def.node} <= set(REFERENCE["graph_ops"])
    assert "VarHandleOp" in REFERENCE["graph_ops"] and [n.op for n in meta.graph_def.node].count("VarHandleOp") == 5
    sig = meta.signature_def["serving_default"]
    assert sig.method_name == REFERENCE["method_name"] and sig.inputs["x"].name == REFERENCE["placeholder"]
    assert dict(REFERENCE["versions"]) == {"producer": meta.graph_def.versions.producer,
                                           "min_consumer": meta.graph_def.versions.min_consumer}
    call = next(n for n in meta.graph_def.node if n.name == sig.outputs["scores"].name.split(":")[0])
    assert call.op == REFERENCE["signature_call_op"]
    body = fns[call.attr["f"].func.name]
    # Resource arguments -> ReadVariableOp -> XlaCallModule (TF's: ReadVariableOp -> the ops).
    assert "ReadVariableOp" in REFERENCE["signature_ops"]
    reads = {n.name for n in body.node_def if n.op == "ReadVariableOp"}
    xla = next(n for n in body.node_def if n.op == "XlaCallModule")
    assert len(reads) == 5 and {i.split(":")[0] for i in xla.input} == reads | {"x"}
    assert sorted(xla.attr) == ["Sout", "Tin", "Tout", "module", "platforms", "version"]
    assert list(xla.attr["platforms"].list.s) == [b"CPU"] and xla.attr["version"].i == 10
    saver = meta.saver_def
    assert saver.filename_tensor_name == REFERENCE["saver_def"]["filename_tensor_name"]
    assert saver.version == REFERENCE["saver_def"]["version"]
    restore = next(n for n in meta.graph_def.node if n.name == saver.restore_op_name)
    assert restore.op == REFERENCE["saver_def"]["restore_op"]
    assert {n.op for n in fns[restore.attr["f"].func.name].node_def} <= set(REFERENCE["restore_ops"])
    objects = meta.object_graph_def
    sig_map = next(c.node_id for c in objects.nodes[0].children if c.local_name == "signatures")
    assert objects.nodes[sig_map].user_object.identifier == REFERENCE["signature_map_identifier"]
    assert [objects.nodes[c.node_id].WhichOneof("kind") for c in objects.nodes[sig_map].children] == \
        REFERENCE["signature_node_kinds"]


@pytest.mark.parametrize("model", MODELS)
def test_saved_model_cli_show_lists_what_read_saved_model_reads(exported, model):
    with open(os.path.join(SERVING, f"show_{model}.txt")) as f:
        shown = f.read()
    contents = checkpoint.read_saved_model(exported[model][0])
    assert set(re.findall(r"signature_def\['(\w+)'\]", shown)) == set(contents.signatures) == set(exported[model][2])
    for sig in contents.signatures.values():
        for kind, specs in (("inputs", sig.inputs), ("outputs", sig.outputs)):
            for key, spec in specs.items():
                dims = ", ".join("-1" if d is None else str(d) for d in spec.shape)
                dtype = types_pb2.DataType.Name(_dtypes.ENUM_OF[spec.dtype])
                assert (f"{kind}['{key}'] tensor_info:\n        dtype: {dtype}\n"
                        f"        shape: ({dims})\n        name: {spec.tensor}\n") in shown
        assert sig.method_name == "tensorflow/serving/predict"


def test_read_saved_model_and_inspect_show_ours(exported, capsys):
    path, root, _ = exported["two"]
    contents = checkpoint.read_saved_model(path)
    assert contents.tags == ("serve",)
    assert {k: v.tobytes() for k, v in contents.variables.items()} == \
        {k: np.asarray(root[k].value).tobytes() for k in ("w", "b", "gain")}
    score = contents.signatures["score"]
    assert list(score.inputs) == ["unused", "x"] and list(score.outputs) == ["max", "total"]
    assert score.inputs["x"].shape == (None, 3) and score.inputs["x"].tensor == "score_x:0"
    assert cli.main(["inspect", str(path)]) == 0
    out = capsys.readouterr().out
    assert "gain  variable 'gain', not trainable  float32 () 4 B" in out
    assert "signature score: (unused: float32 (?, 2), x: float32 (?, 3)) -> (max: float32 (?,), total: float32 (?,))" \
        in out


def test_only_what_the_module_keeps_is_passed():
    """score reads one Variable of three and not its argument `unused`: neither the others nor it reach the op."""
    meta = _meta(os.path.join(SERVING, "two")).meta_graphs[0]
    call = next(n for n in meta.graph_def.node if n.name == meta.signature_def["score"].outputs["max"].name[:-2])
    body = _functions(meta)[call.attr["f"].func.name]
    assert [a.name for a in body.signature.input_arg] == ["unused", "x", "resource_0"]
    assert list(call.input) == ["score_unused", "score_x", "gain"]
    xla = next(n for n in body.node_def if n.op == "XlaCallModule")
    # jax keeps `unused`: its size is the batch dimension `b` the module's shapes are computed from.
    assert list(xla.input) == ["ReadVariableOp_0:value:0", "x", "unused"]
    assert len(xla.attr["Tin"].list.type) == 3


def test_one_module_for_two_platforms():
    """mlp_cpu_cuda: the same graph as mlp but for its module's platforms; TF on a CPU ran it (records)."""
    fns = [_functions(_meta(os.path.join(SERVING, m)).meta_graphs[0]) for m in ("mlp", MULTI)]
    xla = [next(n for n in f["__inference_signature_wrapper_serving_default_0"].node_def if n.op == "XlaCallModule")
           for f in fns]
    assert [list(x.attr["platforms"].list.s) for x in xla] == [[b"CPU"], [b"CPU", b"CUDA"]]
    assert len(xla[1].attr["module"].s) > len(xla[0].attr["module"].s)
    assert _without_modules(_meta(os.path.join(SERVING, "mlp"))) == _without_modules(_multi_as_cpu())


def _multi_as_cpu():
    sm = _meta(os.path.join(SERVING, MULTI))
    for fn in sm.meta_graphs[0].graph_def.library.function:
        for node in fn.node_def:
            if node.op == "XlaCallModule":
                del node.attr["platforms"].list.s[1:]
    return sm


def test_platforms_upper_case_and_unused_inputs_left_out(tmp_path):
    root = {"w": varstate.Variable(jnp.ones((3,)), name="w")}
    fn = lambda p, x, ignored: x * p["w"].value
    path = checkpoint.export_saved_model(tmp_path / "m", root, {"serving_default": (fn, (X, X))},
                                         platforms=("cpu", "cuda"))
    body = _functions(_meta(path).meta_graphs[0])["__inference_signature_wrapper_serving_default_0"]
    assert [a.name for a in body.signature.input_arg] == ["ignored", "x", "resource_0"]
    xla = next(n for n in body.node_def if n.op == "XlaCallModule")
    assert list(xla.attr["platforms"].list.s) == [b"CPU", b"CUDA"]
    assert list(xla.input) == ["ReadVariableOp_0:value:0", "x"]


def _root():
    return {"w": varstate.Variable(jnp.eye(3), name="w")}


def _export(tmp_path, sigs, root=None, **kw):
    return checkpoint.export_saved_model(tmp_path / "out", _root() if root is None else root, sigs, **kw)


def test_refuses_a_non_empty_directory_and_a_non_container(tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "f").write_text("x")
    with pytest.raises(FileExistsError, match="exists and is not an empty directory; pick a new one"):
        _export(tmp_path, {"serving_default": (lambda p, x: x, (X,))})
    with pytest.raises(TypeError, match=r"root must be a container pytree .* got Variable; wrap it"):
        checkpoint.export_saved_model(tmp_path / "o2", varstate.Variable(jnp.ones(2)), {})


@pytest.mark.parametrize(("sigs", "error", "match"), [
    ({}, ValueError, "expected at least one signature, found none"),
    ({"serving default": (lambda p, x: x, (X,))}, ValueError, "signature name 'serving default' is not an identifier"),
    ({"s": lambda p, x: x}, TypeError, r"signature 's' must be \(fn, example_args\)"),
    ({"s": (lambda p, x: x, (X, X))}, TypeError, "has 2 example arguments but its function takes 1 named ones"),
    ({"s": (lambda p, x: x, ({"a": X},))}, TypeError, "argument 'x' of signature 's' is a dict; a SignatureDef input "
                                                      "is one array"),
    ({"s": (lambda p, x: {"a": {"b": x}}, (X,))}, TypeError, "signature 's' returns .*; a SignatureDef holds a flat "
                                                              "set of arrays"),
    ({"s": (lambda p, x: {"a b": x}, (X,))}, ValueError, r"signature 's' returns keys \['a b'\]; TF needs "
                                                          "identifiers"),
])
def test_refuses_what_tf_cannot_serve(tmp_path, sigs, error, match):
    with pytest.raises(error, match=match):
        _export(tmp_path, sigs)
    assert not (tmp_path / "out").exists()


def test_refuses_the_custom_call_tf_failed_to_run(tmp_path):
    """refused_cholesky.txt: TF's error running this model exported with the refusal lifted."""
    with open(os.path.join(SERVING, "refused_cholesky.txt")) as f:
        tf_error = f.read()
    root, sigs = FIXTURES.cholesky()
    with pytest.raises(ValueError, match=r"signature 'serving_default' calls \['(\w+)'\], custom calls that only "
                                         "jaxlib provides, so TF cannot run it") as e:
        checkpoint.export_saved_model(tmp_path / "out", root, sigs)
    target = re.search(r"calls \['(\w+)'\]", str(e.value)).group(1)
    assert tf_error == f"No FFI handler registered for {target} on a platform Host (canonical host)\n"
    assert not (tmp_path / "out").exists()


def test_refuses_more_than_one_device(tmp_path):
    mesh = jax.make_mesh((2,), ("a",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:2])
    sharded = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("a"))
    fn = lambda p, x: {"y": jax.lax.with_sharding_constraint(x, sharded)}
    with pytest.raises(ValueError, match="signature 's' runs over 2 devices; expected 1"):
        _export(tmp_path, {"s": (fn, (jax.ShapeDtypeStruct((4, 3), jnp.float32),))})


def test_refuses_a_calling_convention_tf_does_not_run(tmp_path, monkeypatch):
    monkeypatch.setattr(_tf_saved_model, "CALLING_CONVENTIONS", (9,))
    with pytest.raises(ValueError, match=r"uses XlaCallModule calling convention 10; TF 2.20 and newer run \[9\]"):
        _export(tmp_path, {"s": (lambda p, x: x, (X,))})


def test_refuses_optimizer_state_and_prng_keys(tmp_path):
    w = varstate.Variable(jnp.ones(3), name="w")
    sig = {"s": (lambda p, x: x, (X,))}
    with pytest.raises(ValueError, match="'opt' is an optimizer with slot variables; a served model has none"):
        _export(tmp_path, sig, {"w": w, "opt": varstate.optimizers.Adam(0.1).init([w])})
    with pytest.raises(ValueError, match="'k' is a PRNG key, which TF cannot hold"):
        _export(tmp_path, sig, {"k": jax.random.key(0)})

    # Two Variables of one name (from two registries) are two TF variables; their graph nodes differ.
    twin = varstate.Variable(jnp.ones(3), name="w", registry=varstate.Registry())
    meta = _meta(_export(tmp_path, sig, {"a": w, "b": twin})).meta_graphs[0]
    assert [(n.name, n.attr["shared_name"].s) for n in meta.graph_def.node if n.op == "VarHandleOp"] == \
        [("w", b"w"), ("w_1", b"w_1")]


def test_refuses_a_variable_read_in_another_dtype_than_it_is_stored_in(tmp_path):
    from varstate import _seam

    w = _seam.record_saved_dtype(varstate.Variable(jnp.ones(3, jnp.int32), name="w"), np.int64)  # a restored int64
    with pytest.raises(TypeError, match="Variable 'w' is stored as int64 but signature 's' reads it as int32"):
        _export(tmp_path, {"s": (lambda p, x: x * p["w"].value[0], (X,))}, {"w": w})
