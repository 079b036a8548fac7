"""The object-graph builder and restore matching: variables held twice, and the dtype a value is stored in.

Reference: TF's object graph stores a variable reachable at several places
once (its first path, breadth-first) and lists each of its slots once per
optimizer (`slot_variables`); a restored value keeps the dtype it was stored
in, whatever dtype JAX holds it in.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import checkpoint
import varstate
from checkpoint import _graph
from varstate import _seam
from varstate.optimizers import Adam, Momentum

KEY = "/.ATTRIBUTES/VARIABLE_VALUE"


def test_a_variable_held_twice_has_one_node_and_one_slot_node_per_slot():
    e = varstate.Variable(jnp.ones((3, 2)), name="tied")
    params = {"embed": e, "out": e, "other": [e]}
    state = Adam(0.1).init(params)
    assert len(_graph.slot_variables(state)) == 2  # m and v, once each, though found at three places
    graph = _graph.build({"model": params, "optimizer": state})
    opt_node = graph.proto.nodes[graph.paths.index("optimizer")]
    refs = [(r.original_variable_node_id, r.slot_name) for r in opt_node.slot_variables]
    assert sorted(refs) == [(graph.paths.index("model/embed"), "m"), (graph.paths.index("model/embed"), "v")]
    keys = sorted(_graph.values(graph))
    assert keys == sorted(["model/embed" + KEY, "model/embed/.OPTIMIZER_SLOT/optimizer/m" + KEY,
                           "model/embed/.OPTIMIZER_SLOT/optimizer/v" + KEY,
                           "optimizer/beta1_power" + KEY, "optimizer/beta2_power" + KEY])
    model = graph.proto.nodes[graph.paths.index("model")]
    targets = {r.local_name: r.node_id for r in model.children}
    assert targets["embed"] == targets["out"] == graph.paths.index("model/embed")


@pytest.mark.parametrize("fmt", ["orbax", "tf"])
def test_a_partitioned_variable_held_twice_saves_its_slots_once_and_restores(tmp_path, fmt):
    # Each shard's slot is found at two places; it was taken for twice the shards ("has them for 4 of its 2").
    emb = varstate.PartitionedVariable(np.arange(12.0, dtype=np.float32).reshape(6, 2), name="emb", num_shards=2)
    params = {"a": emb, "b": emb}
    opt = Momentum(0.1, 0.9)
    grads = jax.tree.map(lambda v: jnp.ones(v.shape), params, is_leaf=lambda x: isinstance(x, varstate.Variable))
    params, state = opt.apply_gradients(grads, params, opt.init(params))
    path = checkpoint.Checkpoint(model=params, optimizer=state).write(str(tmp_path / "c"), format=fmt)
    reader = checkpoint.read_checkpoint(path)
    assert sorted(reader.keys()) == ["model/a" + KEY, "model/a/.OPTIMIZER_SLOT/optimizer/momentum" + KEY]
    np.testing.assert_array_equal(np.asarray(reader.get("model/a/.OPTIMIZER_SLOT/optimizer/momentum" + KEY)),
                                  np.full((6, 2), 2.0))
    fresh = varstate.PartitionedVariable(np.zeros((6, 2), np.float32), name="emb", num_shards=2)
    template = {"a": fresh, "b": fresh}
    got = checkpoint.Checkpoint(model=template, optimizer=opt.init(template)).restore(path).assert_consumed()
    np.testing.assert_array_equal(got.optimizer.get_slot(got.model["b"][1], "momentum").value, np.full((3, 2), 2.0))


@pytest.mark.parametrize("fmt", ["orbax", "tf"])
def test_restore_records_the_stored_dtype_on_variables_slots_and_shards(tmp_path, fmt):
    stored = {"step": np.int64(41), "x": np.float64(0.5), "table": np.arange(6, dtype=np.int64).reshape(3, 2)}
    path = checkpoint.Checkpoint(m=stored).write(str(tmp_path / "c"), format=fmt)
    template = {
        "step": varstate.Variable(jnp.int32(0), name="step"),
        "x": varstate.Variable(jnp.float32(0), name="x"),
        "table": varstate.PartitionedVariable(np.zeros((3, 2), np.int32), name="table", num_shards=2),
    }
    got = checkpoint.Checkpoint(m=template).restore(path).assert_consumed().m
    assert _seam.saved_dtype(got["step"]) == np.int64 and got["step"].dtype == np.int32
    assert _seam.saved_dtype(got["x"]) == np.float64
    assert all(_seam.saved_dtype(shard) == np.int64 for shard in got["table"])
    values = _graph.values(_graph.build({"m": got}))
    assert {k: np.asarray(v).dtype for k, v in values.items() if k != "m/table" + KEY} == {
        "m/step" + KEY: np.int64, "m/x" + KEY: np.float64}
    assert [np.asarray(v).dtype for _, v in values["m/table" + KEY]] == [np.int64, np.int64]
    # A value stored in the variable's own dtype clears a recorded one: the next save writes it as stored.
    path = checkpoint.Checkpoint(m={"step": np.int32(3)}).write(str(tmp_path / "d"), format=fmt)
    again = checkpoint.Checkpoint(m={"step": got["step"]}).restore(path).assert_consumed().m["step"]
    assert _seam.saved_dtype(again) == np.int32


@pytest.mark.parametrize("fmt", ["orbax", "tf"])
def test_a_plain_array_template_of_a_64_bit_value_comes_back_as_numpy_in_its_stored_dtype(tmp_path, fmt):
    # In int32's range: a value out of it is refused (test_restore_review_fixes.py), as for a Variable.
    stored = {"c": np.array([1, 2**31 - 1], np.int64), "f": np.float64(0.1), "s": np.int64(-3)}
    path = checkpoint.Checkpoint(**stored).write(str(tmp_path / "c"), format=fmt)
    for template in ({"c": jnp.zeros(2, jnp.int32), "f": jnp.float32(0), "s": jnp.int32(0)},
                     {"c": np.zeros(2, np.int32), "f": np.float32(0), "s": np.int32(0)}):
        got = checkpoint.Checkpoint(**template).restore(path).assert_consumed()
        # Nothing narrowed (0.1 keeps its float64 digits): the value as stored.
        assert type(got.c) is np.ndarray and got.c.dtype == np.int64 and got.c.tolist() == [1, 2**31 - 1]
        assert got.f.dtype == np.float64 and got.f == 0.1
        # A 0-d array for an array template, a numpy scalar for a numpy scalar template.
        assert type(got.s) is (np.int64 if isinstance(template["s"], np.generic) else np.ndarray) and got.s == -3
        again = checkpoint.read_checkpoint(checkpoint.Checkpoint(**got.roots).write(str(tmp_path / "d"), format=fmt))
        assert {k: np.dtype(again.dtype(k + KEY)) for k in stored} == {k: v.dtype for k, v in stored.items()}
