"""`varstate-ckpt strip-optimizer SRC DST`: a copy without the optimizer state that restores into a model.

References: checkpoints written here with TF v1 and Keras optimizers, and one TensorFlow wrote
(tests/data/tf_optimizer_ckpt: tf.train.Checkpoint(model=..., optimizer=AdamOptimizer)); the keys that
must go are found from the key names TF gives slots and optimizer values (``.OPTIMIZER_SLOT``, the
``optimizer/`` root), not from the object graph the command rewrites.
"""

import os
import re

import jax.numpy as jnp
import numpy as np
import pytest

import checkpoint
import varstate
import varstate.optimizers.keras as keras_opt
from checkpoint import read_checkpoint
from checkpoint._cli._strip import stripped_graph
from checkpoint.protos.trackable_object_graph_pb2 import TrackableObjectGraph
from varstate.optimizers import Adam

DATA = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(__file__))), "data")
TF_ADAM = os.path.join(DATA, "tf_optimizer_ckpt", "adam")


def _model(fill=None):
    kernel = np.arange(6.0, dtype=np.float32).reshape(3, 2) / 4
    bias = np.array([0.5, -0.0], np.float32)
    if fill is not None:
        kernel, bias = np.full_like(kernel, fill), np.full_like(bias, fill)
    return {"kernel": varstate.Variable(jnp.asarray(kernel), name="kernel"),
            "bias": varstate.Variable(jnp.asarray(bias), name="bias")}


def _optimizer_keys(keys):
    return {k for k in keys if k.startswith("optimizer/") or "/.OPTIMIZER_SLOT/" in k}


def _values(path):
    r = read_checkpoint(path)
    return {k: np.asarray(r.get(k)) for k in r.keys()}


def _valid(graph):
    """Every reference of `graph` lands inside it, every node is reachable, and no slot is left."""
    n = len(graph.nodes)
    seen, queue = {0}, [0]
    for i in queue:
        for c in graph.nodes[i].children:
            assert 0 <= c.node_id < n, (i, c)
            if c.node_id not in seen:
                seen.add(c.node_id)
                queue.append(c.node_id)
        assert not graph.nodes[i].slot_variables
    assert seen == set(range(n))


@pytest.mark.parametrize("fmt", ["tf", "orbax"])
@pytest.mark.parametrize("make", [lambda m: Adam(0.1).init(m), lambda m: keras_opt.Adam(0.1).init(m)],
                         ids=["tf_v1_adam", "keras_adam"])
def test_stripped_copy_restores_the_model_bit_for_bit(run, tmp_path, fmt, make):
    model = _model()
    manager = checkpoint.CheckpointManager(str(tmp_path / "run"), format=fmt)
    manager.save(3, model=model, optimizer=make(model))
    src, dst = str(tmp_path / "run" / "ckpt-3"), str(tmp_path / "stripped")
    code, out, err = run("strip-optimizer", src, dst)
    assert (code, err) == (0, ""), err
    source, result = _values(src), _values(dst)
    dropped = _optimizer_keys(source)
    assert dropped and sorted(result) == sorted(set(source) - dropped)
    for key, value in result.items():
        assert value.dtype == source[key].dtype and value.tobytes() == source[key].tobytes(), key
    assert result["save_counter/.ATTRIBUTES/VARIABLE_VALUE"] == 3
    reader = read_checkpoint(dst)
    assert reader.format_name == read_checkpoint(src).format_name
    _valid(reader.object_graph)
    lines = out.splitlines()
    assert re.fullmatch(rf"dropped the optimizer state of optimizer: \d+ objects \(4 slot variables\), "
                        rf"{len(dropped)} values, \d+ B", lines[0]), lines[0]
    size = sum(v.nbytes for v in result.values())
    assert lines[1] == f"wrote {dst} ({fmt}): {len(result)} values, {size} B; verified by reading it back"
    # A checkpoint that never had an optimizer: a model-only Checkpoint consumes all of it.
    fresh = _model(fill=7.0)
    status = checkpoint.Checkpoint(model=fresh).restore(dst, strict=True)
    status.assert_consumed()
    for name in ("kernel", "bias"):
        assert np.asarray(status.model[name].value).tobytes() == np.asarray(model[name].value).tobytes()
    with pytest.raises(AssertionError, match=r"Unresolved object in checkpoint \(root\)\.optimizer"):
        checkpoint.Checkpoint(model=_model(fill=7.0)).restore(src).assert_consumed()
    assert sorted(os.listdir(tmp_path)) == ["run", *(["stripped"] if fmt == "orbax" else
                                                     ["stripped.data-00000-of-00001", "stripped.index"])]
    assert run("verify", dst)[0] == 0


def test_tf_written_checkpoint_is_stripped(run, tmp_path):
    dst = str(tmp_path / "adam")
    code, out, err = run("strip-optimizer", TF_ADAM, dst)
    assert (code, err) == (0, "")
    source, result = _values(TF_ADAM), _values(dst)
    size = sum(v.nbytes for v in result.values())
    assert out.splitlines()[1] == f"wrote {dst} (tf): {len(result)} values, {size} B; verified by reading it back"
    assert sorted(result) == sorted(set(source) - _optimizer_keys(source)) == [
        f"model/{n}/.ATTRIBUTES/VARIABLE_VALUE" for n in ("b", "emb", "vec", "w")]
    assert all(result[k].tobytes() == source[k].tobytes() for k in result)
    _valid(read_checkpoint(dst).object_graph)
    template = {n: varstate.Variable(jnp.zeros(v.shape, v.dtype)) for n, v in
                ((k.split("/")[1], v) for k, v in source.items() if k in result)}
    status = checkpoint.Checkpoint(model=template).restore(dst, strict=True)
    assert all(np.asarray(status.model[n].value).tobytes() == source[f"model/{n}/.ATTRIBUTES/VARIABLE_VALUE"].tobytes()
               for n in template)


def test_renumbering_keeps_nodes_after_the_optimizer():
    # root -> opt (1) with slot m (2) of w; root -> w (3) -> inner (4): w and inner become 1 and 2.
    g = TrackableObjectGraph()
    root, opt, _, w, _ = (g.nodes.add() for _ in range(5))
    root.children.add(node_id=1, local_name="opt")
    root.children.add(node_id=3, local_name="w")
    w.children.add(node_id=4, local_name="inner")
    opt.children.add(node_id=2, local_name="only_through_the_optimizer")
    opt.slot_variables.add(original_variable_node_id=3, slot_name="m", slot_variable_node_id=2)
    w.attributes.add(name="VARIABLE_VALUE", checkpoint_key="w/.ATTRIBUTES/VARIABLE_VALUE")
    new, kept = stripped_graph(g, [1])
    assert kept == [0, 3, 4]
    assert [(c.local_name, c.node_id) for c in new.nodes[0].children] == [("w", 1)]
    assert [(c.local_name, c.node_id) for c in new.nodes[1].children] == [("inner", 2)]
    assert new.nodes[1].attributes[0].checkpoint_key == "w/.ATTRIBUTES/VARIABLE_VALUE"
    _valid(new)


def test_name_based_checkpoint_is_refused(run, tmp_path):
    src = os.path.join(DATA, "tf_name_based", "model.ckpt-1234")
    code, out, err = run("strip-optimizer", src, str(tmp_path / "x"))
    assert (code, out) == (2, "")
    assert err == (f"varstate-ckpt: error: {src} (TF name-based checkpoint) has no object graph, so which of its "
                   "values are optimizer state is not recorded; nothing can be stripped\n")
    assert os.listdir(tmp_path) == []


def test_checkpoint_without_optimizer_is_refused_with_status_1(run, tmp_path):
    src = checkpoint.Checkpoint(model=_model()).write(str(tmp_path / "model"), format="tf")
    code, out, err = run("strip-optimizer", src, str(tmp_path / "x"))
    assert (code, out) == (1, "")
    assert err == (f"varstate-ckpt: {src}: no optimizer state (no object holds slot variables); nothing to strip, "
                   f"{tmp_path / 'x'} not written\n")
    assert not any(n.startswith("x") for n in os.listdir(tmp_path))


def test_existing_destination_is_refused(run, tmp_path):
    model = _model()
    src = checkpoint.Checkpoint(model=model, optimizer=Adam(0.1).init(model)).write(str(tmp_path / "a"), format="tf")
    code, out, err = run("strip-optimizer", src, src)
    assert (code, out) == (2, "")
    assert err == f"varstate-ckpt: error: destination {src!r} already exists; remove it or choose another path\n"


def test_orbax_python_values_stay_python_values(run, tmp_path):
    from checkpoint._storage._orbax import OrbaxReader

    model = _model()
    src = checkpoint.Checkpoint(model=model, optimizer=Adam(0.1).init(model), step=7, name="run-a").write(
        str(tmp_path / "a"))
    dst = str(tmp_path / "b")
    assert run("strip-optimizer", src, dst)[0] == 0
    before, after = OrbaxReader(src), OrbaxReader(dst)
    for key, value in (("step/.ATTRIBUTES/py_state", 7), ("name/.ATTRIBUTES/py_state", "run-a")):
        assert before.python_value(key) == after.python_value(key) == value
        assert type(after.python_value(key)) is type(value)
    assert after.python_value("model/kernel/.ATTRIBUTES/VARIABLE_VALUE") is None  # an array


def test_orbax_written_tree_is_refused(run, tmp_path):
    import orbax.checkpoint as ocp

    src = str(tmp_path / "tree")
    with ocp.StandardCheckpointer() as c:
        c.save(src, {"params": {"w": np.ones(2, np.float32)}, "opt": {"mu": np.zeros(2, np.float32)}})
    code, out, err = run("strip-optimizer", src, str(tmp_path / "x"))
    assert (code, out) == (2, "")
    assert err == (f"varstate-ckpt: error: {src} (orbax PyTree checkpoint (written by orbax)) has no object graph of "
                   "its own, so which of its values are optimizer state is not recorded; strip-optimizer reads TF "
                   "object-based checkpoints and this library's orbax format\n")
