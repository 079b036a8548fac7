"""The graphs of structures saved before (`checkpoint/_graph/_cache.py`): a match gives what a fresh build gives.

Reference: `_graph.build` itself. Every case builds the graph both ways and
compares the serialized proto, the keys with their attributes, and the
values (the very objects of the new roots); a case that must not match also
shows that the builder ran.
"""

import gc
import os
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import checkpoint
import varstate
from checkpoint import _graph
from checkpoint._graph import _cache
from varstate.optimizers import Adam, GradientDescent


@pytest.fixture
def builds(monkeypatch):
    """The number of times `graph_of` ran the builder (a list, so the test reads it as it grows)."""
    monkeypatch.setattr(_cache, "_SEEN", {})
    count = [0]
    real = _cache.build

    def counting(roots, **kw):
        count[0] += 1
        return real(roots, **kw)

    monkeypatch.setattr(_cache, "build", counting)
    return count


def same_as_built(roots):
    """graph_of(roots), checked against a fresh build: same proto, keys, attributes and objects."""
    got, want = _graph.graph_of(roots), _graph.build(roots)
    assert got.proto.SerializeToString() == want.proto.SerializeToString()
    assert [(s.key, s.attribute) for s in got.saveables] == [(s.key, s.attribute) for s in want.saveables]
    assert all(a.obj is b.obj for a, b in zip(got.saveables, want.saveables, strict=True))
    assert got.paths == want.paths
    return got


def model():
    a = varstate.Variable(jnp.ones((2, 3)), name="a")
    b = varstate.Variable(jnp.zeros(3), name="b")
    return {"dense": {"a": a, "b": b}, "table": [jnp.arange(4.0), np.float32(2.0)], "note": "hi", "n": 3}


def test_new_versions_of_the_same_variables_take_the_graph_and_give_their_own_values(builds):
    params = model()
    opt = Adam(0.1)
    state = opt.init(params["dense"])
    same_as_built({"model": params, "optimizer": state})
    assert builds[0] == 1
    dense, state = opt.apply_gradients(jax.tree.map(jnp.ones_like, params["dense"]), params["dense"], state)
    stepped = {**params, "dense": dense, "n": 4}
    graph = same_as_built({"model": stepped, "optimizer": state})
    assert builds[0] == 1  # matched: not built again
    values = _graph.values(graph)
    assert values["model/dense/a/.ATTRIBUTES/VARIABLE_VALUE"] is dense["a"].value
    assert values["model/n/.ATTRIBUTES/py_state"] == 4
    m = state.get_slot(dense["a"], "m")
    assert values["model/dense/a/.OPTIMIZER_SLOT/optimizer/m/.ATTRIBUTES/VARIABLE_VALUE"] is m.value
    assert np.asarray(values["optimizer/beta1_power/.ATTRIBUTES/VARIABLE_VALUE"]) == np.float32(0.9) ** 2


@pytest.mark.parametrize("change", [
    "another variable", "a renamed key", "a list for a tuple", "a shared dict", "a shared state", "a prng key",
    "a bool for an int", "another optimizer state", "a new root",
])
def test_a_structure_that_differs_is_built_again(builds, change):
    params = model()
    state = Adam(0.1).init(params["dense"])
    base = {"model": params, "optimizer": state}
    same_as_built(base)
    dense = dict(params["dense"])
    if change == "another variable":  # the same name and shape: the handle tells it apart
        roots = {**base, "model": {**params, "dense": {**dense, "b": varstate.Variable(jnp.zeros(3), name="b")}}}
    elif change == "a renamed key":
        roots = {**base, "model": {**params, "dense": {"a": dense["a"], "c": dense["b"]}}}
    elif change == "a list for a tuple":
        roots = {**base, "model": {**params, "table": tuple(params["table"])}}
    elif change == "a shared dict":  # one node with two parents; the containers' treedef is the same
        base = {**base, "model": {**params, "again": dict(dense)}}
        same_as_built(base)
        builds[0] -= 1
        roots = {**base, "model": {**params, "again": params["dense"]}}
    elif change == "a shared state":  # a state without Variables (GradientDescent's): one node, not two
        base = {**base, "sgd": [GradientDescent(0.1).init(dense), GradientDescent(0.1).init(dense)]}
        same_as_built(base)
        builds[0] -= 1
        roots = {**base, "sgd": [base["sgd"][0]] * 2}
    elif change == "a prng key":  # stored with its implementation's name beside it
        roots = {**base, "model": {**params, "table": [jax.random.key(0), np.float32(2.0)]}}
    elif change == "a bool for an int":
        roots = {**base, "model": {**params, "n": True}}
    elif change == "another optimizer state":
        roots = {**base, "optimizer": Adam(0.1).init(params["dense"])}  # new slot Variables
    else:
        roots = {**base, "extra": {"z": varstate.Variable(jnp.ones(1), name="z")}}
    same_as_built(roots)
    assert builds[0] == 2


def test_an_array_that_becomes_a_weight_brings_back_the_optimizer_check(builds):
    """A rank-1 array is a model's weight (an nnx Module's values are arrays), a scalar is not: with a weight
    saved and none of the optimizer's Variables, the save is refused rather than losing every slot."""
    state = Adam(0.1).init({"x": varstate.Variable(jnp.ones(2), name="x")})
    same_as_built({"model": {"t": jnp.float32(1.0)}, "optimizer": state})  # no weight: TF's rule, saved
    with pytest.raises(ValueError, match=r"^Cannot checkpoint the optimizer \(root\)\.optimizer: none of its slots "
                                         r"belongs to a saved Variable\. .*the model saved starts at "
                                         r"\(root\)\.model\.t\)"):
        _graph.graph_of({"model": {"t": jnp.arange(2.0)}, "optimizer": state})
    assert builds[0] == 2


def test_a_tied_variable_takes_the_graph_only_while_its_places_hold_one_version(builds):
    """Flattened, ``a[0]`` comes before ``b``; walked breadth first (TF's order, which picks the saved place),
    ``b`` comes first."""
    w = varstate.Variable(jnp.ones(2), name="tied")
    same_as_built({"model": {"a": [w], "b": w}})
    new = w.assign(jnp.full(2, 3.0))
    same_as_built({"model": {"a": [new], "b": new}})
    assert builds[0] == 1
    graph = same_as_built({"model": {"a": [w], "b": new}})  # two versions: the one the walk meets first is saved
    assert builds[0] == 2
    assert _graph.values(graph)["model/b/.ATTRIBUTES/VARIABLE_VALUE"] is new.value


@pytest.mark.parametrize("kind", ["fused state", "shared array", "nnx-like leaf", "partitioned", "prng key"])
def test_structures_it_cannot_vouch_for_are_built_every_time(builds, kind):
    w = varstate.Variable(jnp.ones(3), name="w")
    arr = jnp.arange(3.0)
    if kind == "fused state":
        roots = {"model": {"w": w}, "optimizer": Adam(0.1).init({"w": w}, fused=True)}
    elif kind == "shared array":  # one object at two places: which place a value came from is not known
        roots = {"model": {"x": arr, "y": arr}}
    elif kind == "nnx-like leaf":  # a custom pytree: its flattening is its own
        roots = {"model": {"w": w, "p": jax.tree_util.Partial(jnp.add, arr)}}
    elif kind == "partitioned":
        roots = {"model": {"w": varstate.PartitionedVariable(jnp.zeros((4, 2)), name="p", num_shards=2)}}
    else:  # its implementation's name is stored beside it, a value of no leaf
        roots = {"model": {"k": jax.random.key(0)}}
    for _ in range(2):
        same_as_built(roots)
    assert builds[0] == 2  # built by graph_of both times: never matched
    assert _cache._SEEN == {}


def test_the_cache_keeps_no_variable_alive_and_a_dead_structure_matches_nothing(builds):
    params = {"w": varstate.Variable(jnp.ones(3), name="w")}
    same_as_built({"model": params})
    handle = weakref.ref(params["w"].handle)
    del params
    gc.collect()
    assert handle() is None  # and the name is free again in its registry
    fresh = {"w": varstate.Variable(jnp.ones(3), name="w")}
    assert fresh["w"].name == "w"
    same_as_built({"model": fresh})
    assert builds[0] == 2


@pytest.mark.parametrize("fmt", ["orbax", "tf"])
def test_saves_of_a_training_loop_restore_each_step_values(tmp_path, fmt):
    params = {"w": varstate.Variable(jnp.ones(3), name="w"), "b": varstate.Variable(jnp.zeros(2), name="b")}
    opt = Adam(0.1)
    state = opt.init(params)
    grads = {"w": jnp.full(3, 0.5), "b": jnp.full(2, -1.0)}
    ckpt = checkpoint.Checkpoint(model=params, optimizer=state)
    saved = []
    for _ in range(3):
        params, state = opt.apply_gradients(grads, params, state)
        path = ckpt.save(os.path.join(tmp_path, "ckpt"), format=fmt, model=params, optimizer=state)
        saved.append((path, jax.device_get(params), jax.device_get(state.get_slot(params["w"], "m").value)))
    for path, want, m in saved:
        template = {"w": varstate.Variable(jnp.zeros(3), name="w2"), "b": varstate.Variable(jnp.zeros(2), name="b2")}
        tstate = opt.init(template)
        status = checkpoint.Checkpoint(model=template, optimizer=tstate).restore(path).assert_consumed()
        np.testing.assert_array_equal(status.model["w"].value, want["w"].value)
        np.testing.assert_array_equal(status.model["b"].value, want["b"].value)
        np.testing.assert_array_equal(status.optimizer.get_slot(status.model["w"], "m").value, m)


def test_the_cache_holds_the_last_four_structures(builds):
    models = [{f"w{i}": varstate.Variable(jnp.ones(2), name=f"w{i}")} for i in range(6)]
    for m in models:
        same_as_built({"model": m})
    assert len(_cache._SEEN) == 4 and builds[0] == 6
    same_as_built({"model": models[-1]})  # kept
    same_as_built({"model": models[0]})  # the oldest went first
    assert builds[0] == 7
