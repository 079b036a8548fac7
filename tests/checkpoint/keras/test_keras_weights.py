"""checkpoint.keras.load_weights / save_weights against files Keras and TF wrote.

References (tests/data/keras_weights, written by make_keras_fixtures.py): every format's weights
as Keras listed them (path, dtype, shape, values, in Keras's order), and the outputs of Keras
models that loaded the .weights.h5 files our save_weights wrote (ours/).
"""

import json
import os
import shutil
import zipfile

import h5py
import jax
import numpy as np
import pytest

import varstate
from checkpoint import CheckpointFormatError, keras, write_name_based
from checkpoint._storage import write_bundle
from checkpoint.protos.trackable_object_graph_pb2 import TrackableObjectGraph

DATA = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(__file__))), "data", "keras_weights")
with open(os.path.join(DATA, "expected.json")) as f:
    EXPECTED = json.load(f)


def _flat(tree, prefix=()):
    for k, v in tree.items():
        if isinstance(v, dict):
            yield from _flat(v, (*prefix, k))
        else:
            yield "/".join((*prefix, k)), v


def _reference(file):
    return [(p, np.array(vals, dtype).reshape(shape)) for p, dtype, shape, vals in EXPECTED["files"][file]["weights"]]


# --- reading every format -------------------------------------------------------------------
@pytest.mark.parametrize("file", sorted(EXPECTED["files"]))
def test_load_weights_matches_what_keras_listed(file):
    weights = keras.load_weights(os.path.join(DATA, file))
    assert isinstance(weights, keras.KerasWeights)
    got = list(_flat(weights))
    want = _reference(file)
    # Same paths in Keras's order, Variables named by their path, values bit-exact.
    assert [p for p, _ in got] == [p for p, _ in want]
    for (path, var), (_, value) in zip(got, want, strict=True):
        assert isinstance(var, varstate.Variable)
        assert var.name == path
        assert var.dtype == value.dtype and var.shape == value.shape
        assert np.asarray(var.value).tobytes() == value.tobytes(), path
        assert var.trainable == (path.rsplit("/", 1)[-1] not in ("moving_mean", "moving_variance"))


def test_layer_order_and_nesting_follow_keras():
    lstm = keras.load_weights(os.path.join(DATA, "keras3", "lstm.weights.h5"))
    assert list(lstm) == ["lstm", "head"]
    assert list(lstm["lstm"]) == ["lstm_cell"]
    assert list(lstm["lstm"]["lstm_cell"]) == ["kernel", "recurrent_kernel", "bias"]
    conv = keras.load_weights(os.path.join(DATA, "keras3", "conv.weights.h5"))
    assert list(conv) == ["conv", "bn", "head"]  # the pooling layer holds no weights; the optimizer is left out
    assert list(keras.load_weights(os.path.join(DATA, "tf_keras", "lstm_bn"))) == ["lstm", "bn", "head"]


def test_layout_of_a_keras3_file_records_groups_names_and_shapes():
    weights = keras.load_weights(os.path.join(DATA, "keras3", "conv.weights.h5"))
    by_path = {lay.path: lay for lay in weights.layout}
    assert by_path[()].name == "seq_conv" and by_path[()].group == ""
    assert by_path[("bn",)].group == "layers/batch_normalization"
    assert by_path[("bn",)].weights == ("gamma", "beta", "moving_mean", "moving_variance")
    assert by_path[("conv",)].shapes == ((3, 3, 2, 3), (3,))
    assert by_path[("pool",)].weights == ()  # kept so that save_weights writes its group as Keras did
    tf_weights = keras.load_weights(os.path.join(DATA, "keras3_tf", "conv", "ckpt-1"))
    assert all(lay.group is None for lay in tf_weights.layout)


def test_checkpoint_directory_and_index_path_are_accepted():
    ref = _reference("keras3_tf/lstm/ckpt-1")
    for path in (os.path.join(DATA, "keras3_tf", "lstm"), os.path.join(DATA, "keras3_tf", "lstm", "ckpt-1.index")):
        assert [p for p, _ in _flat(keras.load_weights(path))] == [p for p, _ in ref]


def test_each_load_gets_exact_names_in_a_new_registry_unless_one_is_given():
    path = os.path.join(DATA, "tf_keras", "mlp")
    a, b = keras.load_weights(path), keras.load_weights(path)
    assert a["dense"]["kernel"].name == b["dense"]["kernel"].name == "dense/kernel"
    registry = varstate.Registry()
    first = keras.load_weights(path, registry=registry)
    again = keras.load_weights(path, registry=registry)
    # TF's unique-name rule inside one registry, while the first Variables live.
    assert (first["dense"]["kernel"].name, again["dense"]["kernel"].name) == ("dense/kernel", "dense/kernel_1")


def _layer_group(f, group, name):
    """A hand-made Keras 3 weights file's model entry and one layer's variables group, as Keras lays them out."""
    f.create_group("vars").attrs["name"] = "model"
    g = f.create_group(f"{group}/vars")
    g.attrs["name"] = name
    return g


def test_weight_names_names_positional_weights(tmp_path):
    path = str(tmp_path / "custom.weights.h5")
    with h5py.File(path, "w") as f:
        g = _layer_group(f, "layers/my_layer", "mine")
        g["0"] = np.ones((2, 2), np.float32)
        g["1"] = np.zeros(2, np.float32)
    assert list(keras.load_weights(path)["mine"]) == ["0", "1"]  # an unknown layer keeps positions
    named = keras.load_weights(path, weight_names={"mine": ["w", "b"]})
    assert list(named["mine"]) == ["w", "b"] and named["mine"]["w"].name == "mine/w"
    with pytest.raises(ValueError, match=r"weight_names\['mine'\] = \['w'\], but layer 'mine' \(layers/my_layer\) "
                                         r"stores 2 weights: give 2 distinct names"):
        keras.load_weights(path, weight_names={"mine": ["w"]})


def test_int64_and_bfloat16_values(tmp_path):
    import ml_dtypes

    path = str(tmp_path / "t.weights.h5")
    with h5py.File(path, "w") as f:
        g = _layer_group(f, "layers/normalization", "norm")
        g["0"] = np.array([1.5], np.float32)
        g["1"] = np.array([2.5], np.float32)
        g["2"] = np.array(7, np.int64)
        ds = g.create_dataset("3", data=np.array([1.5, -2.0], ml_dtypes.bfloat16))
        ds.attrs["dtype"] = "bfloat16"
    with pytest.raises(ValueError, match="weight_names"):
        keras.load_weights(path, weight_names={"norm": ["a"]})
    w = keras.load_weights(path, weight_names={"norm": ["mean", "variance", "count", "half"]})
    assert w["norm"]["count"].dtype == jax.numpy.int32  # narrowed as JAX holds it (64-bit types off)
    assert w["norm"]["half"].dtype == ml_dtypes.bfloat16 and w["norm"]["half"].value.tolist() == [1.5, -2.0]
    out = keras.save_weights(str(tmp_path / "back.weights.h5"), w)
    with h5py.File(out) as f:
        assert f["layers/normalization/vars/2"].dtype == np.int64  # widened back to the stored dtype
        assert f["layers/normalization/vars/3"].attrs["dtype"] == "bfloat16"
    assert keras.load_weights(out, weight_names={"norm": ["m", "v", "c", "h"]})["norm"]["h"].value.tolist() == [
        1.5, -2.0]


def test_bfloat16_optimizer_slots_carry_kerass_mark_too(tmp_path):
    # Keras marks every bf16 value it writes (its H5 store's one rule for layer and optimizer variables alike) and
    # reads back as bf16 only what is marked: an unmarked slot would come back as opaque 2-byte records.
    import ml_dtypes

    from varstate.optimizers import keras as keras_opt

    path = str(tmp_path / "bf16.weights.h5")
    with h5py.File(path, "w") as f:
        g = _layer_group(f, "layers/dense", "dense")
        for i, v in enumerate([np.full((2, 3), 1.5), np.full(3, -2.0)]):
            g.create_dataset(str(i), data=v.astype(ml_dtypes.bfloat16)).attrs["dtype"] = "bfloat16"
    w = keras.load_weights(path)
    opt = keras_opt.Adam(0.1)
    grads = jax.tree.map(lambda v: jax.numpy.ones(v.shape, v.dtype), w,
                         is_leaf=lambda x: isinstance(x, varstate.Variable))
    w, state = opt.apply_gradients(grads, w, opt.init(w))
    out = keras.save_weights(str(tmp_path / "out.weights.h5"), w, optimizer=opt, optimizer_state=state)
    with h5py.File(out) as f:
        marks = {k: (ds.dtype.kind, dict(ds.attrs)) for k, ds in f["optimizer/vars"].items()}
    # the iteration (int64) and learning_rate (float32), then both moments of kernel and bias in bf16, each marked
    assert marks == {"0": ("i", {}), "1": ("f", {}), **{str(i): ("V", {"dtype": "bfloat16"}) for i in range(2, 6)}}
    _, back = keras.load_optimizer_state(out, keras_opt.Adam(0.1))
    for name in ("momentum", "velocity"):
        for leaf in ("kernel", "bias"):
            got, want = back.slots[name]["dense"][leaf].value, state.slots[name]["dense"][leaf].value
            assert got.dtype == jax.numpy.bfloat16
            np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


# --- errors when reading ---------------------------------------------------------------------
def test_bad_paths():
    with pytest.raises(TypeError, match="Keras weights path must be a string, got int 3"):
        keras.load_weights(3)
    with pytest.raises(FileNotFoundError, match=r"missing\.weights\.h5 does not exist: no such file or directory"):
        keras.load_weights(os.path.join(DATA, "missing.weights.h5"))


def test_a_file_of_another_kind(tmp_path):
    path = tmp_path / "notes.txt"
    path.write_text("hello")
    with pytest.raises(CheckpointFormatError, match=r"notes.txt: not a Keras weights file: expected an HDF5 file"):
        keras.load_weights(path)


def test_an_archive_without_weights(tmp_path):
    path = tmp_path / "m.keras"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("config.json", "{}")
    with pytest.raises(CheckpointFormatError, match=r"a zip archive without model.weights.h5; .*\['config.json'\]"):
        keras.load_weights(path)


def test_an_hdf5_file_that_is_not_keras(tmp_path):
    path = str(tmp_path / "x.h5")
    with h5py.File(path, "w") as f:
        f["data"] = np.ones(3)
    with pytest.raises(CheckpointFormatError, match="an HDF5 file without Keras's 'vars' or 'layers' groups"):
        keras.load_weights(path)


def _keras3_file(path, build):
    with h5py.File(path, "w") as f:
        f.create_group("vars").attrs["name"] = "model"
        build(f)
    return path


def test_damaged_keras3_files(tmp_path):
    def gap(f):
        g = f.create_group("layers/dense/vars")
        g["0"] = np.ones(2)
        g["2"] = np.ones(2)

    with pytest.raises(CheckpointFormatError, match=r"layers/dense/vars holds \['0', '2'\]; Keras names a layer's "
                                                    r"weights '0', '1', ... in order"):
        keras.load_weights(_keras3_file(str(tmp_path / "a.h5"), gap))

    def group_not_dataset(f):
        f.create_group("layers/dense/vars/0")

    with pytest.raises(CheckpointFormatError, match=r"layers/dense/vars/0 is a group; Keras stores each weight as "
                                                    "a dataset"):
        keras.load_weights(_keras3_file(str(tmp_path / "b.h5"), group_not_dataset))

    def strings(f):
        f.create_group("layers/dense/vars")["0"] = np.array([b"x"])

    with pytest.raises(CheckpointFormatError, match=r"layers/dense/vars/0 has dtype \|S1; Keras weights are numbers"):
        keras.load_weights(_keras3_file(str(tmp_path / "c.h5"), strings))

    def bomb(f):
        # 1 GiB declared, nothing stored: reading it would allocate the lot.
        f.create_group("layers/dense/vars").create_dataset("0", shape=(1 << 28,), dtype=np.float32, chunks=(1 << 16,),
                                                           compression="gzip")

    with pytest.raises(CheckpointFormatError, match=r"layers/dense/vars/0 declares 1073741824 bytes but stores 0; "
                                                    "refusing to expand it"):
        keras.load_weights(_keras3_file(str(tmp_path / "d.h5"), bomb))

    def same_names(f):
        for group in ("dense", "dense_1"):
            g = f.create_group(f"layers/{group}/vars")
            g.attrs["name"] = "twin"
            g["0"] = np.ones(2)

    with pytest.raises(CheckpointFormatError, match=r"two layers are both named 'twin' \(groups layers/dense_1 and "
                                                    r"layers/dense\)"):
        keras.load_weights(_keras3_file(str(tmp_path / "e.h5"), same_names))


def test_links_are_not_followed(tmp_path):
    other = str(tmp_path / "other.h5")
    with h5py.File(other, "w") as f:
        f["secret"] = np.ones(2)

    def external(f):
        f.create_group("layers/dense/vars")["0"] = h5py.ExternalLink(other, "secret")

    with pytest.raises(CheckpointFormatError, match=r"layers/dense/vars/0 is a ExternalLink; a Keras weights file "
                                                    "holds plain groups and datasets"):
        keras.load_weights(_keras3_file(str(tmp_path / "a.h5"), external))

    def soft(f):
        f.create_group("layers/dense/vars")["0"] = np.ones(2)
        f["layers/alias"] = h5py.SoftLink("/layers/dense")

    with pytest.raises(CheckpointFormatError, match=r"layers/alias is a SoftLink"):
        keras.load_weights(_keras3_file(str(tmp_path / "b.h5"), soft))


def test_legacy_hdf5_link_is_refused(tmp_path):
    path = str(tmp_path / "legacy.h5")
    shutil.copy(os.path.join(DATA, "tf_keras", "mlp.h5"), path)
    with h5py.File(path, "a") as f:
        del f["dense/dense/kernel:0"]
        f["dense/dense/kernel:0"] = h5py.SoftLink("/out/out/kernel:0")
    with pytest.raises(CheckpointFormatError, match=r"legacy.h5: dense/dense/kernel:0 is a SoftLink; links are not "
                                                    "followed"):
        keras.load_weights(path)
    with h5py.File(path, "a") as f:
        f.attrs["layer_names"] = [b"dense", b"gone"]
        del f["dense/dense/kernel:0"]
        f["dense/dense/kernel:0"] = np.ones((4, 3), np.float32)
    with pytest.raises(CheckpointFormatError, match="layer 'gone' is listed in layer_names but has no group"):
        keras.load_weights(path)


def test_tf_checkpoints_that_are_not_keras(tmp_path):
    prefix = str(tmp_path / "model.ckpt")
    write_name_based(prefix, {"dense/kernel": np.ones(2, np.float32)})
    with pytest.raises(CheckpointFormatError, match=r"a name-based checkpoint \(no object graph\), not one Keras "
                                                    "writes; read its values with checkpoint.read_checkpoint"):
        keras.load_weights(prefix)
    with pytest.raises(ValueError, match=r"no object 'net' in the checkpoint \(at 'net', the children are "
                                         r"\['layer-0', 'layer-1', "):
        keras.load_weights(os.path.join(DATA, "tf_keras", "mlp"), node="net")


def _graph(nodes):
    """A TrackableObjectGraph from [(children [(name, id)], full_name or None)]."""
    g = TrackableObjectGraph()
    keys = {}
    for i, (children, full_name) in enumerate(nodes):
        n = g.nodes.add()
        for name, j in children:
            n.children.add(node_id=j, local_name=name)
        if full_name is not None:
            keys[i] = f"v{i}/.ATTRIBUTES/VARIABLE_VALUE"
            n.attributes.add(name="VARIABLE_VALUE", full_name=full_name, checkpoint_key=keys[i])
    return g, keys


def _write(prefix, nodes):
    g, keys = _graph(nodes)
    write_bundle(prefix, {"_CHECKPOINTABLE_OBJECT_GRAPH": g.SerializeToString(),
                          **{k: np.full(2, i, np.float32) for i, k in keys.items()}})
    return prefix


def test_crafted_object_graphs(tmp_path):
    two_models = [
        ([("a", 1), ("b", 2)], None),
        ([("layer_with_weights-0", 3)], None),
        ([("layer_with_weights-0", 3)], None),
        ([("kernel", 4)], None),
        ([], "dense/kernel"),
    ]
    prefix = _write(str(tmp_path / "two"), two_models)
    with pytest.raises(ValueError, match=r"several Keras models in the checkpoint \(\['a', 'b'\]\); pick one with "
                                         r"load_weights\(node=...\)"):
        keras.load_weights(prefix)
    assert keras.load_weights(prefix, node="b")["dense"]["kernel"].value.tolist() == [4.0, 4.0]

    dangling = [([("layer_with_weights-0", 7)], None)]
    with pytest.raises(CheckpointFormatError, match=r"node 0's child 'layer_with_weights-0' refers to node 7, but the "
                                                    "object graph has 1 nodes"):
        keras.load_weights(_write(str(tmp_path / "dangling"), dangling))

    hidden = [  # a Keras 3 subclassed model whose list of layers only its optimizer reaches
        ([("model", 1)], None),
        ([("d1", 2), ("optimizer", 3)], None),
        ([("_kernel", 4)], None),
        ([("_trainable_variables", 5)], None),
        ([], "sub/kernel"),
        ([("0", 4), ("1", 6)], None),
        ([], "sub/kernel"),
    ]
    with pytest.raises(CheckpointFormatError, match=r"1 trainable variables of model 'model' \(first: 'sub/kernel'\) "
                                                    r"are reachable only through its optimizer"):
        keras.load_weights(_write(str(tmp_path / "hidden"), hidden))

    empty = [([("model", 1)], None), ([("layer_with_weights-0", 2)], None), ([], None)]
    with pytest.raises(CheckpointFormatError, match=r"no layer weights found under 'model' of the object graph; it is "
                                                    "not a checkpoint of a Keras model"):
        keras.load_weights(_write(str(tmp_path / "empty"), empty))


# --- writing -----------------------------------------------------------------------------------
@pytest.mark.parametrize("file", sorted(EXPECTED["ours"]))
def test_keras_loaded_what_we_wrote_and_computed_the_same_outputs(file):
    # Keras (in make_keras_fixtures.py) loaded ours/<file> into a freshly initialised model: its outputs
    # equal those of the model the weights came from.
    record = EXPECTED["ours"][file]
    assert record["outputs"] == EXPECTED["models"][record["reference"]]["outputs"]


@pytest.mark.parametrize("file", sorted(EXPECTED["ours"]))
def test_our_writer_still_writes_what_keras_accepted(file, tmp_path):
    # Rewrite ours/<file> from its source now: the same groups, attributes, dataset names, dtypes and bytes.
    source, like = EXPECTED["ours"][file]["source"], EXPECTED["ours"][file]["like"]
    weights = keras.load_weights(os.path.join(DATA, source))
    out = keras.save_weights(str(tmp_path / file), weights, like=None if like is None else os.path.join(DATA, like))
    assert _contents(out) == _contents(os.path.join(DATA, "ours", file))


def _contents(path):
    out = {}
    with h5py.File(path) as f:
        def visit(name, obj):
            attrs = {k: (v.decode() if isinstance(v, bytes) else str(v)) for k, v in obj.attrs.items()}
            if isinstance(obj, h5py.Dataset):
                out[name] = (attrs, obj.dtype.str, obj.shape, obj[()].tobytes())
            else:
                out[name] = (attrs,)
        f.visititems(visit)
    return out


def test_round_trip_keeps_keras_files_equal_and_survives_tree_map(tmp_path):
    source = os.path.join(DATA, "keras3", "lstm.weights.h5")
    weights = keras.load_weights(source)
    out = keras.save_weights(str(tmp_path / "lstm.weights.h5"), weights)
    keras_written = {k: v for k, v in _contents(source).items()}
    ours = _contents(out)
    assert set(ours) == set(keras_written)
    for name, entry in keras_written.items():
        assert ours[name][0] == entry[0]
        if len(entry) > 1:
            assert ours[name][1:] == entry[1:], name
    # jax.tree.map rebuilds the inner dicts sorted ("bias" first); the layout still puts "kernel" in slot 0.
    doubled = jax.tree.map(lambda x: x * 2, weights)
    assert isinstance(doubled, keras.KerasWeights) and next(iter(doubled["lstm"]["lstm_cell"])) == "bias"
    out2 = keras.save_weights(str(tmp_path / "doubled.weights.h5"), doubled)
    with h5py.File(out2) as f, h5py.File(source) as g:
        for ds in ("layers/lstm/cell/vars/0", "layers/dense/vars/1"):
            assert np.array_equal(f[ds][()], g[ds][()] * 2)


def test_save_errors(tmp_path):
    weights = keras.load_weights(os.path.join(DATA, "keras3", "mlp.weights.h5"))
    with pytest.raises(TypeError, match="Keras weights path must be a string, got NoneType"):
        keras.save_weights(None, weights)
    with pytest.raises(ValueError, match=r"m.h5: Keras's model.load_weights reads this format only from a file named "
                                         r"'\*.weights.h5'; name it so"):
        keras.save_weights(str(tmp_path / "m.h5"), weights)
    with pytest.raises(TypeError, match="weights must be a dict of layers \\(as load_weights returns\\), got list"):
        keras.save_weights(str(tmp_path / "m.weights.h5"), [1])
    with pytest.raises(ValueError, match=r"save_weights needs Keras's file layout .*: they are a plain dict; pass "
                                         r"like=<a .weights.h5 or .keras file Keras wrote for the same model>"):
        keras.save_weights(str(tmp_path / "m.weights.h5"), dict(weights))
    from_tf = keras.load_weights(os.path.join(DATA, "tf_keras", "mlp"))
    with pytest.raises(ValueError, match=r"they were read from .*tf_keras/mlp, which is not a Keras 3 weights file; "
                                         "pass like="):
        keras.save_weights(str(tmp_path / "m.weights.h5"), from_tf)

    like = os.path.join(DATA, "keras3", "mlp.weights.h5")
    plain = {k: dict(v) for k, v in weights.items()}
    missing = {k: v for k, v in plain.items() if k != "proj"}
    with pytest.raises(ValueError, match=r"weights has no layer 'proj', which the Keras layout of .*mlp.weights.h5 "
                                         r"needs \(weights \['kernel'\]\)"):
        keras.save_weights(str(tmp_path / "m.weights.h5"), missing, like=like)
    no_bias = {**plain, "out": {"kernel": plain["out"]["kernel"]}}
    with pytest.raises(ValueError, match=r"weights has no 'out/bias', which the Keras layout of .* needs \(layer 'out' "
                                         r"stores \['kernel', 'bias'\]\)"):
        keras.save_weights(str(tmp_path / "m.weights.h5"), no_bias, like=like)
    wrong_shape = {**plain, "out": {**plain["out"], "bias": np.zeros(5, np.float32)}}
    with pytest.raises(ValueError, match=r"'out/bias' has shape \(5,\), but the Keras layout of .* has \(2,\)"):
        keras.save_weights(str(tmp_path / "m.weights.h5"), wrong_shape, like=like)
    wrong_dtype = {**plain, "out": {**plain["out"], "bias": np.zeros(2, np.int32)}}
    with pytest.raises(ValueError, match=r"'out/bias' is int32, but the Keras layout of .* stores float32"):
        keras.save_weights(str(tmp_path / "m.weights.h5"), wrong_dtype, like=like)
    extra = {**plain, "out": {**plain["out"], "scale": np.ones(2, np.float32)}}
    with pytest.raises(ValueError, match=r"weights has 'out/scale', which the Keras layout of .* does not hold; remove "
                                         "it or pass like= a file of the model it belongs to"):
        keras.save_weights(str(tmp_path / "m.weights.h5"), extra, like=like)
    assert os.listdir(tmp_path) == []  # everything is checked before a file is created


def test_plain_dict_with_like_writes_the_same_file(tmp_path):
    like = os.path.join(DATA, "keras3", "conv.weights.h5")
    weights = keras.load_weights(like)
    plain = {k: {n: np.asarray(v.value) for n, v in layer.items()} for k, layer in weights.items()}
    out = keras.save_weights(tmp_path / "c.weights.h5", plain, like=like)
    back = keras.load_weights(out)
    for (p, a), (q, b) in zip(_flat(back), _flat(weights), strict=True):
        assert p == q and np.asarray(a.value).tobytes() == np.asarray(b.value).tobytes()
    with h5py.File(out) as f:
        assert "optimizer" not in f  # optimizer state is not written
        assert f["vars"].attrs["name"] == "seq_conv"
        assert f["layers/global_average_pooling2d/vars"].attrs["name"] == "pool"


def test_crafted_nesting_and_archive_expansion_are_refused(tmp_path, monkeypatch):
    def deep(f):
        f.create_group("/".join(["g"] * 102) + "/vars")["0"] = np.ones(1)

    with pytest.raises(CheckpointFormatError, match=r"groups nested more than 100 deep \(g/g/g/.*; Keras models nest "
                                                    "far less: the file is damaged or crafted"):
        keras.load_weights(_keras3_file(str(tmp_path / "deep.h5"), deep))

    chain = [([("layer_with_weights-0", 1)], None), *[([("sub", i + 1)], None) for i in range(1, 120)], ([], "x/k")]
    with pytest.raises(CheckpointFormatError, match="the object graph nests more than 100 levels below a layer"):
        keras.load_weights(_write(str(tmp_path / "chain"), chain))

    from checkpoint.keras import _read as _keras_read  # where the readers and their bounds live

    monkeypatch.setattr(_keras_read, "_BOMB_FLOOR_BYTES", 1000)
    monkeypatch.setattr(_keras_read, "_BOMB_MAX_RATIO", 10)
    path = tmp_path / "big.keras"
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as z:
        z.writestr("model.weights.h5", b"\0" * 100_000)
    with pytest.raises(CheckpointFormatError, match=r"big.keras: model.weights.h5 expands from \d+ to 100000 bytes; "
                                                    r"refusing to expand it \(a damaged or crafted archive\)"):
        keras.load_weights(path)


def test_h5py_is_imported_only_for_hdf5_files():
    import subprocess
    import sys

    code = (
        "import sys; from checkpoint import keras; "
        f"keras.load_weights({os.path.join(DATA, 'tf_keras', 'mlp')!r}); print('h5py' in sys.modules, end=' '); "
        f"keras.load_weights({os.path.join(DATA, 'keras3', 'mlp.weights.h5')!r}); print('h5py' in sys.modules)"
    )
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert out.stdout.split() == ["False", "True"]
