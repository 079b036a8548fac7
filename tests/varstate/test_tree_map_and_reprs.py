"""`varstate.tree_map` across models, and the reprs of Variables holding non-arrays and of the state objects."""

import os
import re

import jax
import jax.numpy as jnp
import pytest

import checkpoint
import varstate
from varstate.optimizers import Adam, Momentum

_FIX = "Pass trees of one structure, with Variables in the same places (their identities may differ)."


def _models(reg):
    a = {"w": varstate.Variable(jnp.ones(2), name="w", registry=reg), "n": 1}
    b = {"w": varstate.Variable(jnp.full(2, 3.0), name="w", registry=reg), "n": 2}
    return a, b


def test_jax_tree_map_across_models_raises_as_the_handles_differ(reg):
    a, b = _models(reg)
    with pytest.raises(ValueError, match="different pytree metadata at key path"):
        jax.tree.map(lambda x, y: x + y, a, b)


def test_tree_map_pairs_by_position_and_keeps_the_first_trees_identities(reg):
    a, b = _models(reg)
    c = {"w": varstate.Variable(jnp.full(2, 5.0), name="w", registry=reg), "n": 3}
    out = varstate.tree_map(lambda x, y, z: x + y + z, a, b, c)
    assert out["w"].handle is a["w"].handle and out["w"].value.tolist() == [9.0, 9.0] and out["n"] == 6
    # f sees values, not Variables; a mask keeps the Variables (as jax.tree.map's does) and prints.
    mask = varstate.tree_map(lambda x, y: isinstance(x, jax.Array) and bool((x < y).all()), a, b)
    assert repr(mask["w"]) == "<varstate.Variable 'w' value=True>" and mask["n"] is False
    assert varstate.tree_map(lambda x: x * 2, a)["w"].value.tolist() == [2.0, 2.0]


@pytest.mark.parametrize(
    ("make_other", "difference"),
    [
        (lambda bw: {"w": 1.0, "n": 2}, "at tree['w'] the first tree has a Variable, `rest[0]` a float"),
        (lambda bw: {"v": bw, "n": 2}, "the first tree has a leaf at tree['w'] where `rest[0]` has one at tree['v']"),
        (lambda bw: {"w": bw, "n": 2, "z": 3},
         "the first tree has 2 leaves, `rest[0]` 3 (the first extra at tree['z'])"),
        (lambda bw: [bw, 2], "the first tree has a leaf at tree['n'] where `rest[0]` has one at tree[0]"),
    ],
)
def test_tree_map_names_the_first_difference(reg, make_other, difference):
    a, b = _models(reg)
    expected = f"varstate.tree_map: `rest[0]` does not have the first tree's structure: {difference}. {_FIX}"
    with pytest.raises(ValueError, match=f"^{re.escape(expected)}$"):
        varstate.tree_map(lambda x, y: x, a, make_other(b["w"]))


def test_tree_map_containers_differ(reg):
    w = varstate.Variable(jnp.ones(2), name="w", registry=reg)
    with pytest.raises(ValueError, match=re.escape(
            "the containers differ: PyTreeDef([*, *]) versus PyTreeDef((*, *)). " + _FIX)):
        varstate.tree_map(lambda x, y: x, [w, 1], (w, 1))


def test_tree_map_pairs_partitioned_variables_shard_by_shard(reg):
    # The second model's PartitionedVariable is named emb_1, and its name is part of its tree structure.
    a = {"emb": varstate.PartitionedVariable(jnp.arange(20.0).reshape(10, 2), name="emb", num_shards=3,
                                             registry=reg)}
    b = {"emb": varstate.PartitionedVariable(jnp.ones((10, 2)), name="emb", num_shards=3, registry=reg)}
    out = varstate.tree_map(lambda x, y: x + y, a, b)
    assert isinstance(out["emb"], varstate.PartitionedVariable) and out["emb"].name == "emb"
    assert [s.handle for s in out["emb"]] == [s.handle for s in a["emb"]]
    assert jnp.concatenate([s.value for s in out["emb"]]).tolist() == (jnp.arange(20.0).reshape(10, 2) + 1).tolist()
    two = {"emb": varstate.PartitionedVariable(jnp.ones((10, 2)), name="emb", num_shards=2, registry=reg)}
    with pytest.raises(ValueError, match="^" + re.escape(
            "varstate.tree_map: `rest[0]` does not have the first tree's structure: at tree['emb'] the "
            "PartitionedVariables are split differently: shards of shapes [(4, 2), (3, 2), (3, 2)] versus "
            f"[(5, 2), (5, 2)]. {_FIX}") + "$"):
        varstate.tree_map(lambda x, y: x, a, two)
    with pytest.raises(ValueError, match=re.escape("at tree['emb'] the first tree has a PartitionedVariable, "
                                                   "`rest[0]` a Variable")):
        varstate.tree_map(lambda x, y: x, a, {"emb": varstate.Variable(jnp.ones((10, 2)), name="e", registry=reg)})


@pytest.mark.parametrize("value", [True, "adam", None])
def test_repr_of_a_variable_holding_a_non_array(reg, value):
    params = {"w": varstate.Variable(jnp.ones(2), name="w", registry=reg)}
    labelled = jax.tree.map(lambda v: value, params)
    assert repr(labelled["w"]) == f"<varstate.Variable 'w' value={value!r}>"


def test_optimizer_state_repr_is_short(reg):
    params = {"w": varstate.Variable(jnp.ones(2), name="w", registry=reg),
              "b": varstate.Variable(jnp.ones(3), name="b", registry=reg)}
    assert repr(Adam().init(params)) == (
        "OptimizerState(slots={'m': 2, 'v': 2}, non_slots=['beta1_power', 'beta2_power'], fused=False)")
    assert repr(Momentum(0.1, 0.9).init(params, fused=True)) == (
        "OptimizerState(slots={'momentum': 2}, non_slots=[], packed={'momentum': [(5,)]})")


def test_load_status_and_manager_reprs(reg, tmp_path):
    w = varstate.Variable(jnp.ones(3), name="w", registry=reg)
    path = checkpoint.Checkpoint(model={"w": w}).write(os.path.join(tmp_path, "c"))
    status = checkpoint.Checkpoint(model={"w": varstate.Variable(jnp.zeros(3), registry=reg)}).restore(path)
    assert repr(status) == "LoadStatus(roots=['model'], matched=3, unmatched=0)"
    manager = checkpoint.CheckpointManager(os.path.join(tmp_path, "m"), max_to_keep=2)
    manager.save(1, model={"w": w})
    assert repr(manager) == (
        f"CheckpointManager({os.path.join(str(tmp_path), 'm')!r}, steps=[1], max_to_keep=2, async_save=False)")
