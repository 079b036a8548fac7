"""checkpoint._tf._saved_model.read_saved_model against SavedModels TF wrote.

Reference: tests/data/tf_saved_model/expected.json, TF's own view of each SavedModel (object
graph, variable values through tf.saved_model.load, signatures, assets), written by
make_tf_saved_model_fixtures.py.
"""

import json
import os
import shutil

import numpy as np
import pytest

from checkpoint import CheckpointFormatError, write_name_based
from checkpoint._tf._saved_model import read_saved_model
from checkpoint.protos import saved_model_pb2

DATA = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(__file__))), "data", "tf_saved_model")
with open(os.path.join(DATA, "expected.json")) as f:
    EXPECTED = json.load(f)
MODELS = sorted(EXPECTED)


def _value(entry):
    if entry["dtype"] == "string":
        return np.array([v.encode() for v in entry["values"]], object).reshape(entry["shape"])
    return np.array(entry["values"], entry["dtype"]).reshape(entry["shape"])


@pytest.mark.parametrize("name", MODELS)
def test_nodes_match_tf(name):
    sm = read_saved_model(os.path.join(DATA, name))
    want = EXPECTED[name]["nodes"]
    assert len(sm.nodes) == len(want)
    for node, w in zip(sm.nodes, want, strict=True):
        assert (node.path, node.kind) == (w["path"], w["kind"]), node.id
        assert node.identifier == w.get("identifier", "")
        if w["kind"] == "variable":
            dtype = np.dtype(object) if w["dtype"] == "string" else np.dtype(w["dtype"])
            assert (node.name, node.dtype, node.shape, node.trainable) == (w["name"], dtype, tuple(w["shape"]),
                                                                           w["trainable"])
    assert sm.tags == tuple(EXPECTED[name]["tags"]) and sm.tensorflow_version == EXPECTED[name]["tensorflow_version"]


@pytest.mark.parametrize("name", MODELS)
def test_variable_values_are_what_tf_restores(name):
    sm = read_saved_model(os.path.join(DATA, name))
    want = EXPECTED[name]["variables"]
    assert sorted(sm.variables) == sorted(want)
    for path, entry in want.items():
        value = sm.variables[path]
        expected = _value(entry)
        assert value.dtype == expected.dtype and value.shape == expected.shape, path
        if value.dtype == object:
            assert value.tolist() == expected.tolist()
        else:
            assert value.tobytes() == expected.tobytes(), path


@pytest.mark.parametrize("name", MODELS)
def test_signatures_match_tf(name):
    sm = read_saved_model(os.path.join(DATA, name))
    want = {k: v for k, v in EXPECTED[name]["signatures"].items() if k != "__saved_model_init_op"}
    assert sorted(sm.signatures) == sorted(want)  # TF's internal init op is not a signature to call
    for sig_name, w in want.items():
        sig = sm.signatures[sig_name]
        assert sig.name == sig_name and sig.method_name == w["method_name"]
        for got, expected in ((sig.inputs, w["inputs"]), (sig.outputs, w["outputs"])):
            assert sorted(got) == sorted(expected)
            for key, spec in expected.items():
                assert got[key].dtype == np.dtype(spec["dtype"])
                assert got[key].shape == tuple(spec["shape"])
                assert got[key].tensor == spec["tensor"] and got[key].encoding == "name"


def test_assets_point_at_the_copied_files():
    sm = read_saved_model(os.path.join(DATA, "module"))
    want = EXPECTED["module"]["assets"]
    assert sorted(sm.assets) == sorted(want)
    for path, entry in want.items():
        assert os.path.isabs(sm.assets[path]) and os.path.basename(sm.assets[path]) == entry["filename"]
        with open(sm.assets[path]) as f:
            assert f.read() == entry["text"]
    assert sm.nodes[sm.nodes[0].children["vocab"]].asset_path == sm.assets["vocab"]


def test_keras_export_variables_compute_the_exported_model():
    # Keras's export lists its variables in "variables"; with them, the model's forward pass gives TF's outputs.
    sm = read_saved_model(os.path.join(DATA, "keras_export"))
    listed = [n for n in sm.nodes if n.kind == "variable" and n.path.startswith("variables/")]
    by_name = {n.name: sm.variables[n.path] for n in listed}
    probe = EXPECTED["keras_export"]["probe"]
    x = np.array(probe["inputs"], np.float32) @ by_name["dense/kernel"] + by_name["dense/bias"]
    x = (x - by_name["bn/moving_mean"]) / np.sqrt(by_name["bn/moving_variance"] + 1e-3) * by_name["bn/gamma"]
    x = (x + by_name["bn/beta"]) @ by_name["out/kernel"] + by_name["out/bias"]
    np.testing.assert_allclose(x, np.array(probe["outputs"], np.float32), rtol=1e-5, atol=1e-6)


def test_accepts_the_pb_file_and_pathlike(tmp_path):
    import pathlib

    a = read_saved_model(pathlib.Path(DATA) / "module" / "saved_model.pb")
    assert a.path == os.path.join(DATA, "module")
    assert a.variables_prefix == os.path.join(DATA, "module", "variables", "variables")


# --- errors --------------------------------------------------------------------------------------
def _copy(tmp_path, name="module"):
    dst = tmp_path / name
    shutil.copytree(os.path.join(DATA, name), dst)
    return dst


def _edit(directory, change):
    pb = directory / "saved_model.pb"
    sm = saved_model_pb2.SavedModel.FromString(pb.read_bytes())
    change(sm)
    pb.write_bytes(sm.SerializeToString())


def test_bad_paths(tmp_path):
    with pytest.raises(TypeError, match="SavedModel path must be a string, got int 7"):
        read_saved_model(7)
    with pytest.raises(FileNotFoundError, match=r"No SavedModel in directory .*: expected a saved_model.pb file "
                                                r"\(written by tf.saved_model.save or Keras's model.export\)"):
        read_saved_model(tmp_path)
    with pytest.raises(FileNotFoundError, match=r"No SavedModel at .*nowhere: expected a directory holding "
                                                "saved_model.pb"):
        read_saved_model(tmp_path / "nowhere")
    (tmp_path / "saved_model.pbtxt").write_text("")
    with pytest.raises(CheckpointFormatError, match=r"holds saved_model.pbtxt \(the text format\), which this reader "
                                                    "does not read; save the model again without as_text=True"):
        read_saved_model(tmp_path)


def test_corrupt_or_empty_pb(tmp_path):
    d = _copy(tmp_path)
    (d / "saved_model.pb").write_bytes((d / "saved_model.pb").read_bytes()[:100])
    with pytest.raises(CheckpointFormatError, match=r"saved_model.pb: not a valid SavedModel protocol buffer "
                                                    r"\(truncated or corrupt\)"):
        read_saved_model(d)
    (d / "saved_model.pb").write_bytes(b"")
    with pytest.raises(CheckpointFormatError, match=r"saved_model.pb: the SavedModel holds no MetaGraphDef"):
        read_saved_model(d)


def test_tags_pick_the_meta_graph(tmp_path):
    d = _copy(tmp_path)

    def second(sm):
        extra = sm.meta_graphs.add()
        extra.CopyFrom(sm.meta_graphs[0])
        del extra.meta_info_def.tags[:]
        extra.meta_info_def.tags.extend(["train"])
        extra.object_graph_def.Clear()

    _edit(d, second)
    assert read_saved_model(d).tags == ("serve",)  # several: "serve" by default
    with pytest.raises(CheckpointFormatError, match="the MetaGraphDef has no object graph"):
        read_saved_model(d, tags="train")
    with pytest.raises(ValueError, match=r"no MetaGraphDef tagged \['gpu', 'serve'\]; the SavedModel has "
                                         r"\[\['serve'\], \['train'\]\]. Pass one of those as tags="):
        read_saved_model(d, tags=("serve", "gpu"))


def test_tf1_saved_model_points_at_its_name_based_checkpoint(tmp_path):
    d = _copy(tmp_path)
    _edit(d, lambda sm: sm.meta_graphs[0].object_graph_def.Clear())
    shutil.rmtree(d / "variables")
    write_name_based(str(d / "variables" / "variables"), {"w": np.ones(2, np.float32)})
    with pytest.raises(CheckpointFormatError, match=r"no object graph \(a TF1 SavedModel, written by "
                                                    r"SavedModelBuilder\); .*read them with "
                                                    r"checkpoint.read_checkpoint\('.*variables'\)"):
        read_saved_model(d)


def test_missing_or_foreign_variables(tmp_path):
    d = _copy(tmp_path)
    shutil.rmtree(d / "variables")
    with pytest.raises(CheckpointFormatError, match=r"the object graph has 4 variables but .*variables.index is "
                                                    "missing; copy the SavedModel's variables/ directory with it"):
        read_saved_model(d)
    other = _copy(tmp_path, "keras_export")
    shutil.copytree(other / "variables", d / "variables")
    with pytest.raises(CheckpointFormatError, match=r"no value for variable 'w' at path 'w' of the SavedModel's object "
                                                    "graph; the variables/ directory belongs to another SavedModel"):
        read_saved_model(d)
    shutil.rmtree(d / "variables")
    write_name_based(str(d / "variables" / "variables"), {"w": np.ones(2, np.float32)})
    with pytest.raises(CheckpointFormatError, match=r"the SavedModel's variables checkpoint has no object graph "
                                                    r"\(_CHECKPOINTABLE_OBJECT_GRAPH\)"):
        read_saved_model(d)


def test_declared_dtype_must_match_the_stored_value(tmp_path):
    d = _copy(tmp_path)
    _edit(d, lambda sm: setattr(sm.meta_graphs[0].object_graph_def.nodes[1].variable, "dtype", 2))  # w as float64
    with pytest.raises(CheckpointFormatError, match=r"key 'w/.ATTRIBUTES/VARIABLE_VALUE' holds float32\[2, 3\], but "
                                                    r"the SavedModel declares variable 'w' \('w'\) as float64\[2, 3\]"):
        read_saved_model(d)


def test_assets_stay_inside_the_assets_directory(tmp_path):
    d = _copy(tmp_path)
    (tmp_path / "outside.txt").write_text("x")
    _edit(d, lambda sm: setattr(sm.meta_graphs[0].asset_file_def[0], "filename", "../../outside.txt"))
    with pytest.raises(CheckpointFormatError, match=r"asset 'vocab' names file '../../outside.txt', which is not "
                                                    r"inside .*assets; an asset must be a file under the SavedModel's "
                                                    "assets/ directory"):
        read_saved_model(d)
    _edit(d, lambda sm: setattr(sm.meta_graphs[0].asset_file_def[0], "filename", "gone.txt"))
    with pytest.raises(CheckpointFormatError, match=r"asset 'vocab' file .*gone.txt is missing; copy the SavedModel's "
                                                    "assets/ directory with it"):
        read_saved_model(d)
    _edit(d, lambda sm: setattr(sm.meta_graphs[0].object_graph_def.nodes[5].asset, "asset_file_def_index", 4))
    with pytest.raises(CheckpointFormatError, match=r"asset node 5 \('vocab'\) refers to asset file 4, but the "
                                                    "MetaGraphDef lists 1"):
        read_saved_model(d)


def test_dangling_child_reference(tmp_path):
    d = _copy(tmp_path)
    _edit(d, lambda sm: setattr(sm.meta_graphs[0].object_graph_def.nodes[3].children[0], "node_id", 99))
    with pytest.raises(CheckpointFormatError, match=r"a child 's' of node 3 refers to node 99, but the object graph "
                                                    "has 12 nodes"):
        read_saved_model(d)


def test_damaged_variable_data_is_reported_by_the_bundle_reader(tmp_path):
    d = _copy(tmp_path)
    data = d / "variables" / "variables.data-00000-of-00001"
    raw = bytearray(data.read_bytes())
    raw[0] ^= 0xFF
    data.write_bytes(bytes(raw))
    with pytest.raises(CheckpointFormatError, match="checksum mismatch"):
        read_saved_model(d)


def test_a_saved_model_without_variables(tmp_path):
    d = _copy(tmp_path)

    def drop_variables(sm):
        graph = sm.meta_graphs[0].object_graph_def
        for node in graph.nodes:
            if node.WhichOneof("kind") == "variable":
                node.ClearField("variable")

    _edit(d, drop_variables)
    shutil.rmtree(d / "variables")
    sm = read_saved_model(d)
    assert sm.variables == {} and sm.variables_prefix is None and sm.nodes[1].kind == ""
