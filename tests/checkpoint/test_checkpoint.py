"""Checkpoint: object graph (against TF's), round trips, restore by structure, deferred restoration, errors."""

import dataclasses
import enum
import gc
import json
import logging
import os
import shutil
import types
from typing import NamedTuple

import flax.struct
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import checkpoint
import varstate
from checkpoint import _graph, _keys, _storage
from checkpoint._storage import _orbax, _orbax_layout
from checkpoint.protos.trackable_object_graph_pb2 import TrackableObjectGraph
from varstate.optimizers import Adam, Momentum

DATA = os.path.join(os.path.dirname(os.path.dirname(__file__)), "data", "tf_object_graph")
KEY = "/.ATTRIBUTES/VARIABLE_VALUE"


def canonical(proto: TrackableObjectGraph) -> dict:
    """The graph by node path, as tests/data/make_tf_object_graph_fixtures.py writes TF's."""
    paths = {0: ""}
    queue = [0]
    while queue:
        i = queue.pop(0)
        for ref in proto.nodes[i].children:
            if ref.node_id not in paths:
                paths[ref.node_id] = (paths[i] + "/" if paths[i] else "") + ref.local_name
                queue.append(ref.node_id)
    for i, node in enumerate(proto.nodes):
        for ref in node.slot_variables:
            paths[ref.slot_variable_node_id] = f"{paths[ref.original_variable_node_id]}#{ref.slot_name}@{paths[i]}"
    return {
        paths[i]: {
            "children": sorted(r.local_name for r in node.children),
            "attributes": sorted([a.name, a.checkpoint_key] for a in node.attributes),
            "slots": sorted(
                [paths[r.original_variable_node_id], r.slot_name, paths[r.slot_variable_node_id]]
                for r in node.slot_variables
            ),
        }
        for i, node in enumerate(proto.nodes)
    }


def tf_like_model():
    kernel = varstate.Variable(jnp.arange(6, dtype=jnp.float32).reshape(2, 3) / 10, name="kernel")
    bias = varstate.Variable(jnp.array([0.5, -0.5, 1.0], jnp.float32), name="bias")
    scale = varstate.Variable(jnp.float32(2.0), name="scale")
    return {"kernel": kernel, "bias": bias, "layers": [scale], "nested": {"deep": kernel}}


def test_graph_keys_and_values_match_tensorflow(tmp_path):
    with open(os.path.join(DATA, "graph.json")) as f:
        tf = json.load(f)
    model = tf_like_model()
    params = [model["kernel"], model["bias"], model["layers"][0]]
    opt = Adam(0.1)
    state = opt.init(params)
    grads = [2 * params[0].value, jnp.full(3, 3.0), 3 * params[2].value ** 2]
    params, state = opt.apply_gradients(grads, params, state)
    model = {"kernel": params[0], "bias": params[1], "layers": [params[2]], "nested": {"deep": params[0]}}
    path = checkpoint.Checkpoint(model=model, optimizer=state).save(str(tmp_path / "ckpt"))
    reader = _orbax.OrbaxReader(path)
    assert canonical(reader.object_graph) == tf["nodes"]
    tf_graph = checkpoint.read_checkpoint(os.path.join(DATA, "ckpt-1")).object_graph
    assert len(tf_graph.nodes) == len(reader.object_graph.nodes)
    assert all(n.has_checkpoint_values.value for n in tf_graph.nodes)
    assert all(n.HasField("has_checkpoint_values") and n.has_checkpoint_values.value for n in reader.object_graph.nodes)
    empty = _graph.build({"model": {"w": jnp.ones(1)}, "opt": Momentum(0.1, momentum=0.9).init({})}).proto
    # root, model, the empty optimizer (a node, as TF's, without values), model/w
    assert [n.has_checkpoint_values.value for n in empty.nodes] == [True, True, False, True]
    assert reader.keys() == sorted(tf["values"])
    for key, want in tf["values"].items():
        got = reader.get(key)
        assert got.dtype == np.dtype(want["dtype"]), key
        assert list(got.shape) == want["shape"], key
        np.testing.assert_allclose(got.ravel(), want["values"], rtol=2e-6, err_msg=key)


class Pair(NamedTuple):
    a: object
    b: object


@dataclasses.dataclass
class Box:
    x: object
    n: int


jax.tree_util.register_dataclass(Box, data_fields=["x", "n"], meta_fields=[])


@flax.struct.dataclass
class FlaxState:
    w: object
    step: object


def test_round_trip_of_every_container_and_leaf_kind(tmp_path):
    tree = {
        "pair": Pair(varstate.Variable(jnp.arange(4.0)), (jnp.int8(3), np.arange(3, dtype=np.int16))),
        "box": Box(jnp.ones((2, 2), jnp.bfloat16), n=7),
        "flax": FlaxState(w=varstate.Variable(jnp.array([True, False])), step=jnp.int32(5)),
        "py": {"i": 3, "f": 0.25, "b": True, "s": "héllo", "none": None},
        "np_scalar": np.float64(1.5),
    }
    path = checkpoint.Checkpoint(tree=tree).write(str(tmp_path / "c"))
    template = {
        "pair": Pair(varstate.Variable(jnp.zeros(4)), (jnp.int8(0), np.zeros(3, np.int16))),
        "box": Box(jnp.zeros((2, 2), jnp.bfloat16), n=0),
        "flax": FlaxState(w=varstate.Variable(jnp.array([False, False])), step=jnp.int32(0)),
        "py": {"i": 0, "f": 0.0, "b": False, "s": "", "none": None},
        "np_scalar": np.float64(0.0),
    }
    status = checkpoint.Checkpoint(tree=template).restore(path).assert_consumed()
    got = status.tree
    assert jax.tree.structure(got) == jax.tree.structure(template)
    assert got["pair"].a.resource_id == template["pair"].a.resource_id
    assert got["pair"].a.value.tolist() == [0.0, 1.0, 2.0, 3.0]
    assert int(got["pair"].b[0]) == 3 and isinstance(got["pair"].b[0], jax.Array)
    assert isinstance(got["pair"].b[1], np.ndarray) and got["pair"].b[1].tolist() == [0, 1, 2]
    assert got["box"].x.dtype == ml_dtypes.bfloat16 and got["box"].x.tolist() == [[1.0, 1.0], [1.0, 1.0]]
    assert got["box"].n == 7 and type(got["box"].n) is int
    assert got["flax"].w.value.tolist() == [True, False] and int(got["flax"].step) == 5
    assert got["py"] == {"i": 3, "f": 0.25, "b": True, "s": "héllo", "none": None}
    assert type(got["py"]["b"]) is bool and type(got["np_scalar"]) is np.float64 and got["np_scalar"] == 1.5


def test_variable_reachable_twice_is_stored_once_under_its_shortest_path(tmp_path):
    v = varstate.Variable(jnp.ones(2))
    graph = _graph.build({"a": {"deep": {"deeper": v}}, "b": v})
    assert [s.key for s in graph.saveables] == ["b" + KEY]
    path = checkpoint.Checkpoint(a={"deep": {"deeper": v}}, b=v).write(str(tmp_path / "c"))
    t = varstate.Variable(jnp.zeros(2))
    status = checkpoint.Checkpoint(a={"deep": {"deeper": t}}, b=t).restore(path).assert_consumed()
    assert status.a["deep"]["deeper"].value.tolist() == status.b.value.tolist() == [1.0, 1.0]


def test_local_names_are_escaped_like_tf():
    assert _keys.escape("a.b/c") == "a..b.Sc"
    graph = _graph.build({"m": {"a.b/c": jnp.ones(1)}})
    assert graph.saveables[0].key == "m/a..b.Sc" + KEY


def test_key_paths_are_each_nodes_first_path_escaped_and_joined_like_the_keys_a_save_writes():
    # Node 3 is reached twice (its first path wins), 4 has an empty name, -1 and 9 lie outside the graph.
    graph = TrackableObjectGraph()
    for _ in range(6):
        graph.nodes.add()
    for parent, child, name in [(0, 1, "m"), (0, 2, "a.b/c"), (1, 3, "x"), (2, 3, "late"), (2, 4, ""), (4, 5, "y"),
                                (1, -1, "outside"), (3, 9, "outside")]:
        graph.nodes[parent].children.add(node_id=child, local_name=name)
    assert _keys.first_paths(graph.nodes) == {0: (), 1: ("m",), 2: ("a.b/c",), 3: ("m", "x"), 4: ("a.b/c", ""),
                                              5: ("a.b/c", "", "y")}
    assert _keys.key_paths(graph.nodes) == {0: "", 1: "m", 2: "a..b.Sc", 3: "m/x", 4: "a..b.Sc/", 5: "a..b.Sc//y"}
    built = _graph.build({"m": {"a.b/c": {"": {"y": jnp.ones(1)}}}})
    assert _keys.key_paths(built.proto.nodes)[4] + KEY == built.saveables[0].key == "m/a..b.Sc//y" + KEY


def test_a_root_named_empty_keeps_its_empty_part_in_every_key_below_it(tmp_path):
    # TF joins a node's names with "/" (a root named "" and its child "y": "/y"); the root's own path is "".
    params = {"w": varstate.Variable(jnp.ones(2))}
    roots = {"": {"p": params, "opt": Adam(0.1).init(params)}}
    built = _graph.build(roots)
    assert sorted(s.key for s in built.saveables) == [
        "/opt/beta1_power" + KEY, "/opt/beta2_power" + KEY, "/p/w" + KEY,
        "/p/w/.OPTIMIZER_SLOT//opt/m" + KEY, "/p/w/.OPTIMIZER_SLOT//opt/v" + KEY]
    paths = set(_keys.key_paths(built.proto.nodes).values())  # the graph's reader agrees with its writer
    assert {"", "/p", "/opt"} <= paths and {_keys.node_path(s.key) for s in built.saveables} - paths == {
        "/p/w/.OPTIMIZER_SLOT//opt/m", "/p/w/.OPTIMIZER_SLOT//opt/v"}  # slots are not children
    # `top` names the root whose children start the paths (checkpoint.safetensors names a tree's values so).
    assert sorted(s.key for s in _graph.build(roots, top="").saveables) == [
        "opt/beta1_power" + KEY, "opt/beta2_power" + KEY, "p/w" + KEY,
        "p/w/.OPTIMIZER_SLOT/opt/m" + KEY, "p/w/.OPTIMIZER_SLOT/opt/v" + KEY]
    path = checkpoint.Checkpoint(**roots).write(str(tmp_path / "c"), format="tf")
    assert "/p/w" + KEY in checkpoint.read_checkpoint(path).keys()
    template = {"w": varstate.Variable(jnp.zeros(2))}
    status = checkpoint.Checkpoint(**{"": {"p": template, "opt": Adam(0.1).init(template)}}).restore(path)
    status.assert_consumed()
    np.testing.assert_array_equal(np.asarray(status.roots[""]["p"]["w"].value), np.ones(2))


def test_restore_matches_structure_not_variable_names(tmp_path):
    path = checkpoint.Checkpoint(m={"w": varstate.Variable(jnp.ones(2), name="first")}).write(str(tmp_path / "c"))
    other = varstate.Variable(jnp.zeros(2), name="completely/different")
    assert checkpoint.Checkpoint(m={"w": other}).restore(path).m["w"].value.tolist() == [1.0, 1.0]


def test_slots_are_matched_through_their_primary_not_the_optimizer_layout(tmp_path):
    a, b = varstate.Variable(jnp.ones(2), name="a"), varstate.Variable(jnp.full(3, 2.0), name="b")
    opt = Momentum(0.1, momentum=0.9)
    params = {"a": a, "b": b}
    state = opt.init(params)
    params, state = opt.apply_gradients({"a": jnp.ones(2), "b": jnp.full(3, 2.0)}, params, state)
    path = checkpoint.Checkpoint(model=params, opt=state).write(str(tmp_path / "c"))
    ta, tb = varstate.Variable(jnp.zeros(2)), varstate.Variable(jnp.zeros(3))
    template_state = opt.init([tb, ta])  # a list, in the other order
    status = checkpoint.Checkpoint(model={"a": ta, "b": tb}, opt=template_state).restore(path).assert_consumed()
    restored = status.opt
    assert restored.get_slot(ta, "momentum").value.tolist() == [1.0, 1.0]
    assert restored.get_slot(tb, "momentum").value.tolist() == [2.0, 2.0, 2.0]
    assert restored.slots["momentum"][0].resource_id == template_state.slots["momentum"][0].resource_id


def test_slot_whose_primary_is_not_saved_is_skipped_as_tf_does():
    a, b = varstate.Variable(jnp.ones(2)), varstate.Variable(jnp.ones(2))
    state = Adam(0.1).init([a, b])
    keys = sorted(s.key for s in _graph.build({"model": {"a": a}, "opt": state}).saveables)
    assert keys == [
        "model/a" + KEY,
        "model/a/.OPTIMIZER_SLOT/opt/m" + KEY,
        "model/a/.OPTIMIZER_SLOT/opt/v" + KEY,
        "opt/beta1_power" + KEY,
        "opt/beta2_power" + KEY,
    ]


def adam_checkpoint(tmp_path):
    model = {"w": varstate.Variable(jnp.array([1.0, 2.0]), name="w")}
    opt = Adam(0.1)
    state = opt.init(model)
    model, state = opt.apply_gradients({"w": jnp.array([0.5, -1.0])}, model, state)
    path = checkpoint.Checkpoint(model=model, optimizer=state).save(str(tmp_path / "ckpt"))
    return path, model, state, opt


def test_deferred_restoration_of_an_optimizer_created_after_the_model(tmp_path):
    path, model, state, opt = adam_checkpoint(tmp_path)
    status = checkpoint.Checkpoint(model={"w": varstate.Variable(jnp.zeros(2))}).restore(path)
    status.assert_existing_objects_matched().assert_nontrivial_match()
    with pytest.raises(AssertionError, match=r"Unresolved object in checkpoint \(root\)\.optimizer\.beta1_power"):
        status.assert_consumed()
    new_state = opt.init(status.model)  # slots created only now, from the restored model
    opt_status = status.restore(optimizer=new_state)
    restored = opt_status.optimizer
    w = status.model["w"]
    for name in ("m", "v"):
        np.testing.assert_array_equal(restored.get_slot(w, name).value, state.get_slot(model["w"], name).value)
    for name in ("beta1_power", "beta2_power"):  # _preload_simple_restoration's non-slot variables
        np.testing.assert_array_equal(restored.non_slot(name).value, state.non_slot(name).value)
    status.assert_consumed()  # the first status accounts for the deferred restore
    assert opt_status.assert_consumed() is opt_status


def test_slots_restored_before_their_primary_are_refused_then_given_again(tmp_path):
    path, model, state, opt = adam_checkpoint(tmp_path)
    w = varstate.Variable(jnp.zeros(2))
    status = checkpoint.Checkpoint(optimizer=opt.init({"w": w})).restore(path)
    with pytest.raises(AssertionError, match=r"Unresolved slot restorations: .*\(root\)\.model\.w's state 'm' "
                                             r"for \(root\)\.optimizer \(its Variable \(root\)\.model\.w was not "
                                             r"restored\)"):
        status.assert_consumed()
    # The optimizer state was returned without its slots and cannot change: the model alone is refused.
    with pytest.raises(ValueError, match=r"Cannot restore \(root\)\.model\.w after the optimizer state "
                                         r"\(root\)\.optimizer: .*give the optimizer state again"):
        status.restore(model={"w": w})
    again = status.restore(model={"w": w}, optimizer=opt.init({"w": w})).optimizer  # given again beside it
    np.testing.assert_array_equal(again.get_slot(w, "m").value, state.get_slot(model["w"], "m").value)
    status.assert_consumed()


def test_assertion_messages_name_the_unmatched_paths(tmp_path, caplog):
    path, *_ = adam_checkpoint(tmp_path)
    extra = {"w": varstate.Variable(jnp.zeros(2)), "extra": varstate.Variable(jnp.zeros(1))}
    status = checkpoint.Checkpoint(model=extra).restore(path)
    with pytest.raises(AssertionError, match=r"Found 1 Python objects .* \['\(root\)\.model\.extra'\]"):
        status.assert_existing_objects_matched()
    status.assert_nontrivial_match()
    unrelated = checkpoint.Checkpoint(other={"x": varstate.Variable(jnp.zeros(2))}).restore(path)
    with pytest.raises(AssertionError, match=r"Nothing except the root object matched.*\(root\)\.other\.x"):
        unrelated.assert_nontrivial_match()
    with pytest.raises(AssertionError, match="Nothing to load"):
        checkpoint.Checkpoint().restore(path).assert_nontrivial_match()


def test_discarded_partial_restore_logs_unless_expect_partial(tmp_path, caplog):
    path, *_ = adam_checkpoint(tmp_path)
    gc.collect()
    with caplog.at_level(logging.WARNING, logger="checkpoint"):
        checkpoint.Checkpoint(model={"w": varstate.Variable(jnp.zeros(2))}).restore(path)
        gc.collect()
        assert "were not restored: (root).optimizer.beta1_power" in caplog.text
        caplog.clear()
        status = checkpoint.Checkpoint(model={"w": varstate.Variable(jnp.zeros(2))}).restore(path)
        assert status.expect_partial() is status
        del status
        gc.collect()
        assert caplog.text == ""


def test_shape_and_dtype_mismatch_name_the_object_path(tmp_path):
    path, *_ = adam_checkpoint(tmp_path)
    with pytest.raises(ValueError, match=r"\(root\)\.model\.w: .*has shape \(2,\), the object has shape \(3,\)"):
        checkpoint.Checkpoint(model={"w": varstate.Variable(jnp.zeros(3))}).restore(path)
    with pytest.raises(TypeError, match=r"\(root\)\.model\.w: .*has dtype float32, the object has dtype int32"):
        checkpoint.Checkpoint(model={"w": varstate.Variable(jnp.zeros(2, jnp.int32))}).restore(path)


def test_bad_paths_and_newer_versions_are_refused(tmp_path):
    # One dispatch for every reader: restore accepts what read_checkpoint accepts, with its messages.
    with pytest.raises(FileNotFoundError, match=r"No checkpoint at .*missing: expected a prefix with a missing\.index "
                                                r"file, a directory with a 'checkpoint' state file, or an orbax"):
        checkpoint.Checkpoint().restore(str(tmp_path / "missing"))
    with pytest.raises(FileNotFoundError, match=r"No checkpoint in directory .*: it holds no 'checkpoint' state file "
                                                r"and is not an orbax checkpoint\. Pass a checkpoint prefix"):
        checkpoint.Checkpoint().restore(str(tmp_path))
    with pytest.raises(TypeError, match=r"Checkpoint path must be a string, got int 3"):
        checkpoint.Checkpoint().restore(3)
    # A directory restores the latest checkpoint its state file names.
    saver = checkpoint.Checkpoint(w=jnp.full(2, 5.0))
    saver.save(str(tmp_path / "run" / "ckpt"))
    assert checkpoint.Checkpoint(w=jnp.zeros(2)).restore(str(tmp_path / "run")).w.tolist() == [5.0, 5.0]
    # TF's idiom `ckpt.restore(latest_checkpoint(d))` on a first run: TF's InitializationOnlyStatus.
    template = {"w": varstate.Variable(jnp.zeros(2))}
    fresh = checkpoint.Checkpoint(model=template).restore(None)
    assert fresh.model is template and fresh.expect_partial() is fresh and fresh.restore(o=3).o == 3
    for check in (fresh.assert_consumed, fresh.assert_existing_objects_matched, fresh.assert_nontrivial_match):
        with pytest.raises(AssertionError, match=r"No checkpoint specified \(save_path=None\); nothing is being "
                                                 r"restored\. The roots are returned as given"):
            check()
    path = checkpoint.Checkpoint(w=jnp.ones(2)).write(str(tmp_path / "c"))
    meta_file = os.path.join(path, _orbax.META_FILE)
    with open(meta_file) as f:
        meta = json.load(f)
    meta["version"] = _orbax.VERSION + 1
    with open(meta_file, "w") as f:
        json.dump(meta, f)
    with pytest.raises(ValueError, match=f"format version {_orbax.VERSION + 1}, newer than .* upgrade varstate"):
        checkpoint.Checkpoint(w=jnp.zeros(2)).restore(path)
    with open(meta_file, "w") as f:
        f.write("{not json")
    with pytest.raises(checkpoint.DataLossError, match="is corrupted"):
        checkpoint.Checkpoint(w=jnp.zeros(2)).restore(path)


def _data_files(path):
    out = []
    for root, _, files in os.walk(os.path.join(path, "values")):
        out += [os.path.join(root, f) for f in files if os.sep + "d" + os.sep in os.path.join(root, f) + os.sep]
    return [f for f in out if os.path.basename(os.path.dirname(f)) == "d"]


@pytest.mark.parametrize("size", [16, 300_000], ids=["packed", "own-array"])
def test_corrupted_or_truncated_values_are_detected(tmp_path, size):
    value = jnp.arange(size, dtype=jnp.float32)
    for damage in ("flip", "truncate"):
        path = checkpoint.Checkpoint(w=value).write(str(tmp_path / damage))
        files = _data_files(path)
        assert files
        for name in files:
            with open(name, "r+b") as f:
                data = bytearray(f.read())
                if damage == "flip":
                    for i in range(len(data) // 3, len(data), max(1, len(data) // 7)):
                        data[i] ^= 0x5A
                else:
                    data = data[: len(data) // 2]
                f.seek(0)
                f.truncate()
                f.write(bytes(data))
        # tensorstore notices damaged files (its metadata and b-tree nodes are checked) itself
        with pytest.raises(checkpoint.DataLossError, match=r"cannot read stored values"):
            checkpoint.Checkpoint(w=jnp.zeros(size)).restore(path)
    # Well-formed values that are not the ones saved (files mixed up between checkpoints): the crc32c.
    good = checkpoint.Checkpoint(w=value).write(str(tmp_path / "good"))
    other = checkpoint.Checkpoint(w=value + 1).write(str(tmp_path / "other"))
    shutil.rmtree(os.path.join(good, "values"))
    shutil.copytree(os.path.join(other, "values"), os.path.join(good, "values"))
    with pytest.raises(checkpoint.DataLossError, match=r"checksum mismatch for 'w/.ATTRIBUTES/VARIABLE_VALUE'"):
        checkpoint.Checkpoint(w=jnp.zeros(size)).restore(good)


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "own-array"])
def test_a_flipped_bit_in_stored_bytes_fails_the_checksum(tmp_path, packed):
    # Values are stored uncompressed: silent bit rot reads back as a wrong value, which only the
    # crc32c notices. Flip one bit in the middle of one value's bytes and restore.
    n = 2_000 if packed else 300_000
    tree = {f"v{i}": jnp.arange(n, dtype=jnp.float32) + 1000 * i for i in range(40 if packed else 1)}
    path = checkpoint.Checkpoint(**tree).write(str(tmp_path / "c"))
    target = np.asarray(tree["v0"]).tobytes()
    hits = []
    for name in _data_files(path):
        with open(name, "rb") as f:
            at = f.read().find(target)
        if at >= 0:
            hits.append((name, at))
    assert len(hits) == 1, hits
    name, at = hits[0]
    with open(name, "r+b") as f:
        f.seek(at + len(target) // 2)
        byte = f.read(1)[0]
        f.seek(at + len(target) // 2)
        f.write(bytes([byte ^ 0x04]))
    with pytest.raises(checkpoint.DataLossError, match=r"checksum mismatch for 'v0/.ATTRIBUTES/VARIABLE_VALUE'"):
        checkpoint.Checkpoint(**{k: jnp.zeros(n) for k in tree}).restore(path)


def test_uninitialized_values_cannot_be_saved(tmp_path):
    v = varstate.uninitialized((2,), jnp.float32, name="u")
    with pytest.raises(ValueError, match=r"Cannot save 'm/u/.ATTRIBUTES/VARIABLE_VALUE': the value is uninitialized"):
        checkpoint.Checkpoint(m={"u": v}).write(str(tmp_path / "c"))


def test_save_counter_is_int64_numbers_saves_and_survives_restore(tmp_path):
    ckpt = checkpoint.Checkpoint(w=jnp.ones(1))
    assert [os.path.basename(ckpt.save(str(tmp_path / "ckpt"))) for _ in range(2)] == ["ckpt-1", "ckpt-2"]
    reader = _orbax.OrbaxReader(str(tmp_path / "ckpt-2"))
    counter = reader.get("save_counter" + KEY)
    assert counter.dtype == np.int64 and counter.item() == 2
    fresh = checkpoint.Checkpoint(w=jnp.zeros(1))
    fresh.restore(str(tmp_path / "ckpt-2")).assert_consumed()
    assert fresh.save_counter == 2 and os.path.basename(fresh.save(str(tmp_path / "ckpt"))) == "ckpt-3"
    assert "save_counter" + KEY not in _orbax.OrbaxReader(
        checkpoint.Checkpoint(w=jnp.ones(1)).write(str(tmp_path / "plain"))).keys()


def test_abstract_templates_are_restored_straight_onto_their_shardings(tmp_path):
    mesh4 = jax.sharding.Mesh(np.array(jax.devices()[:4]), ("x",))
    big = jax.device_put(jnp.arange(2 ** 19, dtype=jnp.float32).reshape(1024, 512),
                         jax.sharding.NamedSharding(mesh4, jax.sharding.PartitionSpec("x")))
    small = jnp.arange(16.0).reshape(8, 2)
    path = checkpoint.Checkpoint(m={"big": varstate.Variable(big), "small": varstate.Variable(small)},
                                 raw=small).write(str(tmp_path / "c"))
    mesh8 = jax.sharding.Mesh(np.array(jax.devices()).reshape(4, 2), ("a", "b"))
    s_big = jax.sharding.NamedSharding(mesh8, jax.sharding.PartitionSpec("b", "a"))
    s_small = jax.sharding.NamedSharding(mesh8, jax.sharding.PartitionSpec("a"))
    one = jax.sharding.SingleDeviceSharding(jax.devices()[5])
    template = {
        "big": varstate.uninitialized((1024, 512), jnp.float32, sharding=s_big),
        "small": varstate.uninitialized((8, 2), jnp.float32, sharding=s_small),
    }
    raw = jax.ShapeDtypeStruct((8, 2), jnp.float32, sharding=one)
    status = checkpoint.Checkpoint(m=template, raw=raw).restore(path)
    got = status.assert_consumed().m
    assert got["big"].sharding == s_big and got["small"].sharding == s_small and status.raw.sharding == one
    assert got["big"].resource_id == template["big"].resource_id
    np.testing.assert_array_equal(got["big"].value, big)
    np.testing.assert_array_equal(got["small"].value, small)
    np.testing.assert_array_equal(status.raw, small)


class Wrapper:
    """A minimal stand-in for AutoCastVariable: a pytree whose one child is a Variable."""

    def __init__(self, variable):
        self.variable = variable

    def __varstate_variable__(self):
        return self.variable


jax.tree_util.register_pytree_node(Wrapper, lambda w: ((w.variable,), None), lambda _, c: Wrapper(c[0]))


def test_objects_with_varstate_variable_are_saved_as_their_variable(tmp_path):
    v = varstate.Variable(jnp.ones(2), name="k")
    state = Momentum(0.1, momentum=0.9).init([v])
    wrapped = {"k": Wrapper(v)}
    graph = _graph.build({"model": wrapped, "opt": state})
    assert graph.saveables[0].key == "model/k" + KEY and len(graph.saveables) == 2  # value + slot
    plain = _graph.build({"model": {"k": v}, "opt": state})
    assert canonical(graph.proto) == canonical(plain.proto)
    path = checkpoint.Checkpoint(model=wrapped).write(str(tmp_path / "c"))
    t = Wrapper(varstate.Variable(jnp.zeros(2)))
    got = checkpoint.Checkpoint(model={"k": t}).restore(path).assert_consumed().model["k"]
    assert isinstance(got, Wrapper) and got.variable.resource_id == t.variable.resource_id
    assert got.variable.value.tolist() == [1.0, 1.0]


def test_tf_format_is_written_through_write_bundle_and_read_through_read_checkpoint(tmp_path, monkeypatch):
    written = {}
    monkeypatch.setattr(_storage, "write_bundle", lambda prefix, tensors: written.update(prefix=prefix,
                                                                                       tensors=tensors))
    model = {"w": varstate.Variable(jnp.arange(3.0)), "n": 4, "s": "x"}
    ckpt = checkpoint.Checkpoint(model=model)
    prefix = ckpt.save(str(tmp_path / "tf" / "ckpt"), format="tf")
    tensors = written["tensors"]
    assert written["prefix"].startswith(prefix + ".varstate-new-") and prefix.endswith("ckpt-1")
    assert isinstance(tensors[_keys.OBJECT_GRAPH_KEY], bytes)
    proto = TrackableObjectGraph.FromString(tensors[_keys.OBJECT_GRAPH_KEY])
    assert canonical(proto)["model/w"]["attributes"] == [["VARIABLE_VALUE", "model/w" + KEY]]
    assert tensors["save_counter" + KEY].dtype == np.int64 and tensors["save_counter" + KEY] == 1
    # The array itself: the writer reads each value to the host as it writes it (test_manager_staging.py).
    assert tensors["model/w" + KEY] is model["w"].value and tensors["model/s/.ATTRIBUTES/py_state"] == b"x"
    assert checkpoint.latest_checkpoint(str(tmp_path / "tf")) is None  # no files were really written

    # A TF checkpoint (prefix.index) restores through the storage's one open_reader, as our own.
    ours = checkpoint.Checkpoint(model=model).write(str(tmp_path / "orbax"))
    open(str(tmp_path / "fake.index"), "wb").close()

    class TFLikeReader:  # another class of reader: restore uses the reader protocol alone
        def __init__(self):
            self._r = _orbax.OrbaxReader(ours)
            self.object_graph = self._r.object_graph
            self.keys, self.shape, self.dtype, self.get = self._r.keys, self._r.shape, self._r.dtype, self._r.get
            self.get_many = self._r.get_many

    monkeypatch.setattr(_storage, "open_reader", lambda p: TFLikeReader())
    template = {"w": varstate.Variable(jnp.zeros(3)), "n": 0, "s": ""}
    got = checkpoint.Checkpoint(model=template).restore(str(tmp_path / "fake")).assert_consumed().model
    assert got["w"].value.tolist() == [0.0, 1.0, 2.0] and got["n"] == 4 and got["s"] == "x"
    monkeypatch.setattr(_storage, "open_reader", lambda p: types.SimpleNamespace(object_graph=None))
    with pytest.raises(ValueError, match=r"name-based checkpoint \(no object graph\).*restore_by_name"):
        checkpoint.Checkpoint(model=template).restore(str(tmp_path / "fake"))


def test_unknown_format_and_reserved_root_name(tmp_path):
    with pytest.raises(ValueError, match="unknown format 'zip'"):
        checkpoint.Checkpoint(w=jnp.ones(1)).write(str(tmp_path / "c"), format="zip")
    with pytest.raises(ValueError, match="'save_counter' is reserved"):
        checkpoint.Checkpoint(save_counter=1)
    with pytest.raises(AttributeError, match=r"Checkpoint has no root 'nope'; its roots are \['w'\]"):
        _ = checkpoint.Checkpoint(w=1).nope


def test_tensorflows_checkpoint_restores_exactly_as_our_own(tmp_path):
    with open(os.path.join(DATA, "graph.json")) as f:
        tf = json.load(f)
    model = tf_like_model()
    zeros = jax.tree.map(lambda v: v.assign(jnp.zeros_like(v.value)), model,
                         is_leaf=lambda x: isinstance(x, varstate.Variable))
    status = checkpoint.Checkpoint(model=zeros).restore(os.path.join(DATA, "ckpt-1"))
    status.assert_existing_objects_matched()
    params = [status.model["kernel"], status.model["bias"], status.model["layers"][0]]
    state = status.restore(optimizer=Adam(0.1).init(params)).optimizer
    status.assert_consumed()
    got = {
        "model/kernel" + KEY: params[0].value,
        "model/bias/.OPTIMIZER_SLOT/optimizer/m" + KEY: state.get_slot(params[1], "m").value,
        "model/layers/0/.OPTIMIZER_SLOT/optimizer/v" + KEY: state.get_slot(params[2], "v").value,
        "optimizer/beta2_power" + KEY: state.non_slot("beta2_power").value,
    }
    for key, value in got.items():
        np.testing.assert_array_equal(np.ravel(value), np.asarray(tf["values"][key]["values"], np.float32), key)
    assert status.model["nested"]["deep"].value.tolist() == params[0].value.tolist()
    # and our TF-format save reads back through the same path
    prefix = checkpoint.Checkpoint(model=status.model, optimizer=state).save(str(tmp_path / "ckpt"), format="tf")
    assert os.path.isfile(prefix + ".index") and checkpoint.latest_checkpoint(str(tmp_path)) == prefix
    again = checkpoint.Checkpoint(model=zeros, optimizer=Adam(0.1).init(zeros)).restore(prefix)
    again.assert_consumed()
    np.testing.assert_array_equal(again.optimizer.non_slot("beta1_power").value, state.non_slot("beta1_power").value)
    assert canonical(checkpoint.read_checkpoint(prefix).object_graph) == tf["nodes"]


def test_node_names_follow_tf_pretty_printing_even_for_deep_primaries():
    v = varstate.Variable(jnp.ones(2))
    state = Momentum(0.1, momentum=0.9).init([v])
    graph = _graph.build({"a_opt": state, "z": {"deep": {"w": v}}})
    names = _graph.node_names(graph.proto)
    assert "(root).z.deep.w" in names
    assert "(root).z.deep.w's state 'momentum' for (root).a_opt" in names


@pytest.mark.parametrize("edit, detail", [
    (lambda e: e["w" + KEY].update(array="../../escape"), "bad array name '../../escape'"),
    (lambda e: e["s" + KEY].update(offset=10 ** 9), r"lie outside pack 0"),
    (lambda e: e["s" + KEY].update(pack=7), r"no pack 7"),
    (lambda e: e["s" + KEY].update(dtype="object"), "unsupported dtype 'object'"),
    (lambda e: e["s" + KEY].update(shape=[-1]), r"bad shape \[-1\]"),
    (lambda e: e["p" + KEY]["slices"][1].update(spec="10 7 8,3:0,7"), "does not fit shape"),
    (lambda e: e["p" + KEY]["slices"].pop(), r"slices overlap or do not cover shape \[10, 7\]"),
    (lambda e: e["p" + KEY]["slices"][1].update(spec="10 7 0,5:0,7"), r"slices overlap or do not cover"),
    (lambda e: e["n/.ATTRIBUTES/py_state"].update(value="3"), "does not match its type 'int'"),
    (lambda e: e.update(bad=[1]), "entry 'bad' is not an object"),
])
def test_malformed_metadata_is_refused_before_use(tmp_path, edit, detail):
    tree = {"w": jnp.zeros(300_000), "s": jnp.ones(3), "n": 3,
            "p": varstate.PartitionedVariable(jnp.zeros((10, 7)), name="p", num_shards=2)}
    path = checkpoint.Checkpoint(**tree).write(str(tmp_path / "c"))
    meta_file = os.path.join(path, _orbax.META_FILE)
    with open(meta_file) as f:
        meta = json.load(f)
    edit(meta["entries"])
    with open(meta_file, "w") as f:
        json.dump(meta, f)
    with pytest.raises(checkpoint.DataLossError, match=f"meta/metadata is corrupted .*{detail}"):
        checkpoint.Checkpoint(**tree).restore(path)


def test_plain_array_params_checkpoint_with_their_optimizer_slots(tmp_path):
    params = {"plain": jnp.array([1.0, 2.0]), "var": varstate.Variable(jnp.array([3.0]), name="var")}
    opt = Adam(0.1)
    state = opt.init(params)
    params, state = opt.apply_gradients({"plain": jnp.array([0.5, -1.0]), "var": jnp.array([2.0])}, params, state)
    path = checkpoint.Checkpoint(model=params, opt=state).write(str(tmp_path / "c"))
    keys = _orbax.OrbaxReader(path).keys()
    assert "opt/slots/m/plain" + KEY in keys and "opt/slots/v/plain" + KEY in keys
    assert "model/var/.OPTIMIZER_SLOT/opt/m" + KEY in keys and not any(k.startswith("opt/slots/m/var") for k in keys)
    t_params = {"plain": jnp.zeros(2), "var": varstate.Variable(jnp.zeros(1))}
    status = checkpoint.Checkpoint(model=t_params, opt=opt.init(t_params)).restore(path).assert_consumed()
    for name in ("m", "v"):
        np.testing.assert_array_equal(status.opt.slots[name]["plain"], state.slots[name]["plain"])
        np.testing.assert_array_equal(status.opt.get_slot(status.model["var"], name).value,
                                      state.get_slot(params["var"], name).value)
    np.testing.assert_array_equal(status.model["plain"], params["plain"])
    # and training continues identically from the restored state
    grads = {"plain": jnp.array([1.0, 1.0]), "var": jnp.array([1.0])}
    a, _ = opt.apply_gradients(grads, params, state)
    b, _ = opt.apply_gradients(grads, status.model, status.opt)
    np.testing.assert_array_equal(a["plain"], b["plain"])
    np.testing.assert_array_equal(a["var"].value, b["var"].value)


def test_restoring_a_root_again_after_donating_the_first_result(tmp_path):
    path = checkpoint.Checkpoint(m={"big": jnp.arange(300_000.0), "small": jnp.arange(4.0)}).write(str(tmp_path / "c"))
    template = {"big": varstate.Variable(jnp.zeros(300_000)), "small": varstate.Variable(jnp.zeros(4))}
    status = checkpoint.Checkpoint(m=template).restore(path)
    first = status.m
    jax.jit(lambda t: jax.tree.map(lambda v: v + 1, t), donate_argnums=0)(first)
    with pytest.raises(varstate.DonatedVariableError):
        _ = first["big"].value
    again = status.restore(m=template).m
    np.testing.assert_array_equal(again["big"].value, np.arange(300_000.0, dtype=np.float32))
    np.testing.assert_array_equal(again["small"].value, np.arange(4.0, dtype=np.float32))


def test_autocast_variables_checkpoint_as_their_float32_variable(tmp_path):
    kernel = varstate.Variable(jnp.arange(4.0).reshape(2, 2), name="kernel")
    path = checkpoint.Checkpoint(model={"k": varstate.AutoCastVariable(kernel)}).write(str(tmp_path / "a"))
    plain = checkpoint.Checkpoint(model={"k": kernel}).write(str(tmp_path / "p"))
    assert canonical(_orbax.OrbaxReader(path).object_graph) == canonical(_orbax.OrbaxReader(plain).object_graph)
    template = varstate.AutoCastVariable(varstate.Variable(jnp.zeros((2, 2)), name="other"))
    got = checkpoint.Checkpoint(model={"k": template}).restore(plain).assert_consumed().model["k"]
    assert type(got) is varstate.AutoCastVariable and got.true_dtype == jnp.float32
    assert got.__varstate_variable__().resource_id == template.__varstate_variable__().resource_id
    with varstate.autocast(jnp.bfloat16):
        assert got.value.dtype == jnp.bfloat16 and got.value.astype(jnp.float32).tolist() == [[0, 1], [2, 3]]


def test_small_values_fill_several_batches_and_one_value_reads_one_batch(tmp_path, monkeypatch):
    monkeypatch.setattr(_orbax_layout, "BATCH_BYTES", 1000)
    tree = {f"v{i}": jnp.full(100, float(i)) for i in range(7)}  # 400 bytes each
    path = checkpoint.Checkpoint(**tree).write(str(tmp_path / "c"))
    reader = _orbax.OrbaxReader(path)
    assert reader._batches == [896, 896, 896, 448]  # two values (400 bytes + 48 of alignment) a batch
    np.testing.assert_array_equal(reader.get("v3" + KEY), np.full(100, 3.0, np.float32))
    assert sorted(reader._cache) == ["p1"]
    got = checkpoint.Checkpoint(**{k: jnp.zeros(100) for k in tree}).restore(path).assert_consumed()
    for i in range(7):
        np.testing.assert_array_equal(got.roots[f"v{i}"], np.full(100, float(i), np.float32))


@pytest.mark.parametrize("roots", [
    {},
    {"none": None},
    {"cfg": {"lr": 0.5, "name": "run"}},
    {"empty": jnp.zeros((0, 3)), "v": varstate.Variable(jnp.zeros((2, 0)))},
], ids=["no-roots", "only-none", "only-python", "only-zero-size"])
def test_write_without_any_stored_bytes(tmp_path, roots):
    # save() always has save_counter's 8 bytes; write() may have none (orbax refuses empty trees and empty arrays).
    path = checkpoint.Checkpoint(**roots).write(str(tmp_path / "c"))
    template = jax.tree.map(lambda x: jnp.ones_like(x) if isinstance(x, jax.Array) else x, roots)
    got = checkpoint.Checkpoint(**template).restore(path).assert_consumed().roots
    assert jax.tree.structure(got) == jax.tree.structure(roots)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(roots), strict=True):
        assert type(a) is type(b) and np.shape(a) == np.shape(b) and np.asarray(a).tolist() == np.asarray(b).tolist()


@pytest.mark.parametrize("fmt", ["orbax", "tf"])
def test_python_values_restore_only_into_their_own_type(tmp_path, fmt):
    saved = {"f": 0.25, "i": 3, "b": True, "arr": jnp.arange(3.0), "wide": 7}
    path = checkpoint.Checkpoint(**saved).write(str(tmp_path / "c"), format=fmt)
    # an int widens to a float, as in JSON; every other change of type would silently change the value
    assert checkpoint.Checkpoint(wide=0.0).restore(path).expect_partial().wide == 7.0
    assert type(checkpoint.Checkpoint(wide=0.0).restore(path).expect_partial().wide) is float
    for name, template, found in [("f", 0, "float"), ("i", False, "int"), ("b", 0, "bool"), ("i", "", "int"),
                                  ("f", "", "float")]:
        want = (rf"Cannot restore \(root\)\.{name}: the checkpoint value '{name}/\.ATTRIBUTES/py_state' is a Python "
                rf"{found}, the object is a Python {type(template).__name__}\. ")
        with pytest.raises(TypeError, match=want):
            checkpoint.Checkpoint(**{name: template}).restore(path)
    with pytest.raises(TypeError, match=r"Cannot restore \(root\)\.arr: the checkpoint value 'arr/\.ATTRIBUTES/"
                                        r"VARIABLE_VALUE' is an array of shape \(3,\), the object is a Python int\. "):
        checkpoint.Checkpoint(arr=0).restore(path)


class Opaque:
    pass


@pytest.mark.parametrize("leaf", [b"bytes", Opaque(), jnp.float32], ids=["bytes", "object", "dtype"])
def test_unsupported_leaves_are_refused_with_their_path(tmp_path, leaf):
    tree = {"ok": jnp.ones(1), "deep": [{"x": leaf}]}
    where = r"\(root\)\.model\.deep\.0\.x"
    with pytest.raises(ValueError, match=rf"Cannot checkpoint {where}: {type(leaf).__name__} .* is not a Variable"):
        checkpoint.Checkpoint(model=tree).write(str(tmp_path / "c"))
    path = checkpoint.Checkpoint(model={"ok": jnp.ones(1)}).write(str(tmp_path / "ok"))
    with pytest.raises(ValueError, match=rf"Cannot checkpoint {where}: {type(leaf).__name__} .* is not a Variable"):
        checkpoint.Checkpoint(model=tree).restore(path)


def test_a_pack_size_in_the_metadata_allocates_nothing(tmp_path):
    # Metadata is data: a lying pack size must not become a huge allocation before the bytes are read.
    path = checkpoint.Checkpoint(w=jnp.ones(3)).write(str(tmp_path / "c"))
    meta_file = os.path.join(path, _orbax.META_FILE)
    with open(meta_file) as f:
        meta = json.load(f)
    meta["packs"] = [1 << 50]
    with open(meta_file, "w") as f:
        json.dump(meta, f)
    want = r"'w/\.ATTRIBUTES/VARIABLE_VALUE' lies in pack 0, which holds 64 bytes; the metadata says 1125899906842624"
    with pytest.raises(checkpoint.DataLossError, match=want):
        checkpoint.Checkpoint(w=jnp.zeros(3)).restore(path)


def test_python_ints_beyond_int64_in_the_tf_format(tmp_path):
    want = (r"Cannot save 'cfg/seed/\.ATTRIBUTES/py_state' in the TF format: the Python int 1180591620717411303424 "
            r"does not fit in int64\. .*format='orbax'")
    with pytest.raises(OverflowError, match=want):
        checkpoint.Checkpoint(cfg={"seed": 2 ** 70}).write(str(tmp_path / "tf"), format="tf")
    path = checkpoint.Checkpoint(cfg={"seed": 2 ** 70, "low": -2 ** 63}).write(str(tmp_path / "orbax"))
    assert checkpoint.Checkpoint(cfg={"seed": 0, "low": 0}).restore(path).cfg == {"seed": 2 ** 70, "low": -2 ** 63}


@pytest.mark.parametrize("fmt", ["orbax", "tf"])
def test_64_bit_values_restore_into_jaxs_32_bit_variables(tmp_path, fmt):
    # TF checkpoints hold int64 variables (global_step, a Keras optimizer's iterations); with JAX's 64-bit types
    # off their Variables are int32, as in restore_by_name. Values that do not fit are refused, never wrapped.
    assert not jax.config.jax_enable_x64
    big = np.arange(300_000, dtype=np.int64)  # stored as its own array, loaded straight onto a sharding
    saved = {"step": np.int64(7), "x": np.float64(0.1), "big": big, "far": np.array([1, 2 ** 40], np.int64)}
    path = checkpoint.Checkpoint(**saved).write(str(tmp_path / "c"), format=fmt)
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("x",))
    sharded = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("x"))
    template = {"step": varstate.Variable(jnp.int32(0)), "x": varstate.Variable(jnp.float32(0)),
                "big": varstate.uninitialized((300_000,), jnp.int32, sharding=sharded)}
    got = checkpoint.Checkpoint(**template).restore(path).expect_partial().roots
    assert got["step"].value.dtype == jnp.int32 and int(got["step"].value) == 7
    assert got["x"].value.dtype == jnp.float32 and float(got["x"].value) == np.float32(0.1)
    assert got["big"].sharding == sharded and got["big"].value.dtype == jnp.int32
    np.testing.assert_array_equal(got["big"].value, big)
    want = (r"'far/\.ATTRIBUTES/VARIABLE_VALUE' \(int64\) holds 1099511627776, out of range for variable "
            r"'\(root\)\.far' \(int32; JAX's 64-bit types are disabled\)")
    with pytest.raises(ValueError, match=want):
        checkpoint.Checkpoint(far=varstate.Variable(jnp.zeros(2, jnp.int32))).restore(path)
    with pytest.raises(TypeError, match=r"has dtype int64, the object has dtype int16"):
        checkpoint.Checkpoint(step=varstate.Variable(jnp.int16(0))).restore(path)


@pytest.mark.parametrize("fmt", ["orbax", "tf"])
def test_global_step_is_saved_as_tfs_int64_and_restores_into_jaxs_int32(tmp_path, fmt):
    # TF restores a checkpoint's global_step into its own int64 variable and refuses an int32 one, so the step
    # is stored as int64 whatever width JAX gives the value.
    assert not jax.config.jax_enable_x64
    step = varstate.get_or_create_global_step().assign(41)
    other = varstate.Variable(jnp.int32(5), name="count")  # a plain int32 variable stays int32
    path = checkpoint.Checkpoint(step=step, count=other).write(str(tmp_path / "c"), format=fmt)
    reader = checkpoint.read_checkpoint(path)
    assert np.dtype(reader.dtype("step/.ATTRIBUTES/VARIABLE_VALUE")) == np.int64
    assert np.dtype(reader.dtype("count/.ATTRIBUTES/VARIABLE_VALUE")) == np.int32
    assert np.asarray(reader.get("step/.ATTRIBUTES/VARIABLE_VALUE")).item() == 41
    fresh = varstate.get_or_create_global_step(varstate.Registry())
    got = checkpoint.Checkpoint(step=fresh).restore(path).expect_partial().step
    assert (got.dtype, int(got), got.resource_id) == (jnp.int32, 41, fresh.resource_id)


@pytest.mark.parametrize("fmt", ["orbax", "tf"])
def test_uninitialized_values_cannot_be_saved_in_either_format(tmp_path, fmt):
    shards = jax.tree.map(lambda v: jax.ShapeDtypeStruct(v.shape, v.dtype),
                          varstate.PartitionedVariable(jnp.zeros((6, 2)), name="emb", num_shards=2))
    for tree, key in [({"u": varstate.uninitialized((2,), jnp.float32)}, "m/u"), ({"emb": shards}, "m/emb")]:
        with pytest.raises(ValueError, match=rf"Cannot save '{key}/\.ATTRIBUTES/VARIABLE_VALUE': the value is "
                                             r"uninitialized \(shape \(\d,( \d)?\), float32\)\. Initialize it"):
            checkpoint.Checkpoint(m=tree).write(str(tmp_path / "c"), format=fmt)


def test_a_container_in_place_of_a_saved_value_leaves_it_unrestored(tmp_path):
    # TF reports the saved value of an object that took no value; matching an (empty) container must not hide it.
    saved = {"w": varstate.Variable(jnp.ones(2)), "b": jnp.ones(1)}
    path = checkpoint.Checkpoint(model=saved).write(str(tmp_path / "c"))
    status = checkpoint.Checkpoint(model={"w": {}, "b": jnp.zeros(1)}).restore(path)
    status.assert_existing_objects_matched().expect_partial()
    with pytest.raises(AssertionError, match=r"Unresolved object in checkpoint \(root\)\.model\.w: its value "
                                             r"\(model/w/\.ATTRIBUTES/VARIABLE_VALUE\) was not restored"):
        status.assert_consumed()


class Mode(enum.IntEnum):
    TRAIN = 1
    EVAL = 2


class Split(enum.StrEnum):
    TRAIN = "train"
    TEST = "test"


@pytest.mark.parametrize("fmt", ["orbax", "tf"])
def test_int_and_str_enums_are_python_values(tmp_path, fmt):
    path = checkpoint.Checkpoint(cfg={"mode": Mode.EVAL, "split": Split.TEST}).write(str(tmp_path / "c"), format=fmt)
    got = checkpoint.Checkpoint(cfg={"mode": Mode.TRAIN, "split": Split.TRAIN}).restore(path).assert_consumed().cfg
    assert got["mode"] is Mode.EVAL and got["split"] is Split.TEST
    with pytest.raises(TypeError, match=r"'cfg/split/\.ATTRIBUTES/py_state' is a Python str, the object is a Python "
                                        r"Mode\."):
        checkpoint.Checkpoint(cfg={"split": Mode.TRAIN}).restore(path)


@pytest.mark.parametrize("text, found", [("[1, 2]", "a list"), ('{"format": "other"}', "format 'other'")])
def test_metadata_of_another_kind_is_refused(tmp_path, text, found):
    path = checkpoint.Checkpoint(w=jnp.ones(2)).write(str(tmp_path / "c"))
    with open(os.path.join(path, _orbax.META_FILE), "w") as f:
        f.write(text)
    with pytest.raises(ValueError, match=rf"is not a varstate checkpoint \({found} in meta/metadata\)"):
        checkpoint.Checkpoint(w=jnp.zeros(2)).restore(path)


def test_metadata_entries_that_are_not_an_object(tmp_path):
    path = checkpoint.Checkpoint(w=jnp.ones(2)).write(str(tmp_path / "c"))
    meta_file = os.path.join(path, _orbax.META_FILE)
    with open(meta_file) as f:
        meta = json.load(f)
    meta["entries"] = [meta["entries"]]
    with open(meta_file, "w") as f:
        json.dump(meta, f)
    with pytest.raises(checkpoint.DataLossError, match=r"meta/metadata is corrupted \(TypeError: its entries are a "
                                                       r"list, not an object\)"):
        checkpoint.Checkpoint(w=jnp.zeros(2)).restore(path)


def test_a_corrupt_save_counter_reference_is_a_data_loss_error(tmp_path):
    from checkpoint._storage import write_bundle

    graph = TrackableObjectGraph()
    graph.nodes.add().children.add(node_id=99, local_name="save_counter")
    write_bundle(str(tmp_path / "c"), {_keys.OBJECT_GRAPH_KEY: graph.SerializeToString()})
    with pytest.raises(checkpoint.DataLossError, match=r"the object graph's save_counter refers to node 99, which "
                                                       r"holds no value"):
        checkpoint.Checkpoint().restore(str(tmp_path / "c"))
