"""Checkpoints orbax itself wrote: read, inspected, diffed, converted and restored by tree path.

Reference: each checkpoint is written here by orbax (StandardCheckpointer,
PyTreeCheckpointer, CheckpointManager) or by flax nnx's recipe (nnx.state
saved with StandardCheckpointer), and orbax's own restore of it gives the
values every read is compared with.
"""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from flax import nnx

import checkpoint
import checkpoint._cli._main as cli
import varstate
from checkpoint._storage._orbax_native import OrbaxTreeReader

TREE = {
    "dense": {"kernel": np.arange(6, dtype=np.float32).reshape(2, 3), "bias": np.array([1.0, -2.0, 3.0], np.float32)},
    "layers": [np.arange(4, dtype=np.int32), {"w": np.array(2.5, np.float32)}],
    "step": 7,
}
KEYS = {"dense/kernel": TREE["dense"]["kernel"], "dense/bias": TREE["dense"]["bias"],
        "layers/0": TREE["layers"][0], "layers/1/w": TREE["layers"][1]["w"], "step": np.int64(7)}


class Net(nnx.Module):
    def __init__(self, seed: int):
        self.lin = nnx.Linear(2, 3, rngs=nnx.Rngs(seed))
        self.bn = nnx.BatchNorm(3, rngs=nnx.Rngs(seed))
        self.rngs = nnx.Rngs(seed + 1)


def _standard(path):
    with ocp.StandardCheckpointer() as c:
        c.save(path, TREE)
    return path


def _template():
    var = varstate.Variable
    return {"dense": {"kernel": var(jnp.zeros((2, 3))), "bias": var(jnp.zeros(3))},
            "layers": [jnp.zeros(4, jnp.int32), {"w": np.float32(0)}], "step": 0}


@pytest.mark.parametrize("writer", ["standard", "pytree"])
def test_reads_a_pytree_directory_as_orbax_restores_it(tmp_path, writer):
    path = str(tmp_path / "tree")
    if writer == "standard":
        _standard(path)
    else:
        ocp.PyTreeCheckpointer().save(path, TREE)
    reference = ocp.PyTreeCheckpointer().restore(path)
    reader = checkpoint.read_checkpoint(path)
    assert isinstance(reader, OrbaxTreeReader)
    assert reader.keys() == sorted(KEYS)
    for key, want in KEYS.items():
        got = reader.get(key)
        assert reader.shape(key) == np.shape(want) and reader.dtype(key) == np.asarray(want).dtype
        np.testing.assert_array_equal(got, want)
        assert got.dtype == np.asarray(want).dtype
    np.testing.assert_array_equal(reader.get("dense/kernel"), reference["dense"]["kernel"])
    assert "dense/kernel" in reader and "dense" not in reader
    with pytest.raises(KeyError, match=r"Key 'dense' not found in checkpoint '.*tree'"):
        reader.get("dense")


def test_restores_templates_by_tree_path(tmp_path):
    path = _standard(str(tmp_path / "tree"))
    template = _template()
    status = checkpoint.Checkpoint(**template).restore(path).assert_consumed()
    assert status.dense["kernel"].resource_id == template["dense"]["kernel"].resource_id
    np.testing.assert_array_equal(status.dense["kernel"].value, TREE["dense"]["kernel"])
    np.testing.assert_array_equal(status.layers[0], TREE["layers"][0])
    assert status.layers[1]["w"] == np.float32(2.5) and status.step == 7 and type(status.step) is int
    bad = _template()
    bad["dense"]["bias"] = varstate.Variable(jnp.zeros(4))
    with pytest.raises(ValueError, match=r"Cannot restore \(root\).dense.bias: the checkpoint value 'dense/bias' has "
                                         r"shape \(3,\), the object has shape \(4,\)"):
        checkpoint.Checkpoint(**bad).restore(path)


def test_checkpoint_manager_steps_and_items(tmp_path):
    root = str(tmp_path / "mgr")
    with ocp.CheckpointManager(root) as mgr:
        mgr.save(1, args=ocp.args.StandardSave({"a": np.zeros(2, np.float32)}))
        mgr.save(2, args=ocp.args.StandardSave({"a": np.ones(2, np.float32)}))
    # One unnamed item: the step is the tree itself; the manager's directory reads its newest step.
    for path, want in [(os.path.join(root, "1"), 0.0), (os.path.join(root, "2"), 1.0), (root, 1.0)]:
        reader = checkpoint.read_checkpoint(path)
        assert reader.keys() == ["a"] and reader.get("a").tolist() == [want, want]
    named = str(tmp_path / "named")
    with ocp.CheckpointManager(named) as mgr:
        mgr.save(3, args=ocp.args.Composite(params=ocp.args.StandardSave(TREE),
                                            extra=ocp.args.StandardSave({"b": np.full(2, 4.0, np.float32)})))
    reader = checkpoint.read_checkpoint(named)
    assert reader.keys() == sorted(["extra/b", *(f"params/{k}" for k in KEYS)])
    status = checkpoint.Checkpoint(params=_template()).restore(named)
    status.assert_existing_objects_matched()
    np.testing.assert_array_equal(status.params["dense"]["kernel"].value, TREE["dense"]["kernel"])
    with pytest.raises(AssertionError, match=r"Unresolved object in checkpoint \(root\).extra.b: its value "
                                             r"\(extra/b\)"):
        status.assert_consumed()
    status.expect_partial()


def test_flax_nnx_checkpoint_restores_into_a_module_state(tmp_path):
    model = Net(0)
    model.rngs.default()  # the stream moves on: the count must come back
    path = str(tmp_path / "state")
    with ocp.StandardCheckpointer() as c:  # flax nnx's checkpointing recipe
        c.save(path, nnx.state(model))
    reader = checkpoint.read_checkpoint(path)
    assert "lin/kernel/value" in reader.keys() and "rngs/default/key/value" in reader.keys()
    state = nnx.state(Net(5))
    status = checkpoint.Checkpoint(**state).restore(path).assert_consumed()
    restored = Net(5)
    nnx.update(restored, nnx.State({name: getattr(status, name) for name in state}))
    np.testing.assert_array_equal(restored.lin.kernel[...], model.lin.kernel[...])
    np.testing.assert_array_equal(restored.bn.var[...], model.bn.var[...])
    np.testing.assert_array_equal(jax.random.normal(restored.rngs.default(), (3,)),
                                  jax.random.normal(model.rngs.default(), (3,)))
    # The tree as orbax holds it, `value` level included, restores too.
    pure = nnx.to_pure_dict(nnx.state(Net(5)))
    as_tree = {k: jax.tree.map(lambda x: {"value": x}, v) for k, v in pure.items()}
    got = checkpoint.Checkpoint(**as_tree).restore(path).assert_consumed()
    np.testing.assert_array_equal(got.lin["kernel"]["value"], model.lin.kernel[...])


def test_own_orbax_checkpoints_are_still_ours(tmp_path):
    path = checkpoint.Checkpoint(w=jnp.ones(2)).write(str(tmp_path / "ours"))
    reader = checkpoint.read_checkpoint(path)
    assert type(reader).__name__ == "OrbaxReader" and reader.keys() == ["w/.ATTRIBUTES/VARIABLE_VALUE"]


def test_cli_inspect_diff_convert(tmp_path, capsys):
    path = _standard(str(tmp_path / "tree"))
    assert cli.main(["inspect", path]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"{path}: orbax PyTree checkpoint (written by orbax)"
    assert any(line.split() == ["kernel", "float32", "(2,", "3)", "24", "B"] for line in out)
    assert out[-1] == f"5 values, {sum(np.asarray(v).nbytes for v in KEYS.values())} B"
    assert cli.main(["inspect", path, "--key", "dense/bias", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["first_values"] == [1.0, -2.0, 3.0] and summary["min"] == -2.0
    for to, dst in [("tf", str(tmp_path / "conv.ckpt")), ("orbax", str(tmp_path / "conv"))]:
        assert cli.main(["convert", path, dst, "--to", to]) == 0
        assert capsys.readouterr().out.startswith(f"wrote {dst} ({to}): 5 values")
        back = checkpoint.read_checkpoint(dst)
        for key, want in KEYS.items():
            np.testing.assert_array_equal(back.get(key), want)
        assert cli.main(["diff", path, dst, "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["match"] is True
        # converted, it restores by the same structure
        status = checkpoint.Checkpoint(**_template()).restore(dst).assert_consumed()
        np.testing.assert_array_equal(status.dense["bias"].value, TREE["dense"]["bias"])
    other = dict(TREE, step=8)
    with ocp.StandardCheckpointer() as c:
        c.save(str(tmp_path / "other"), other)
    assert cli.main(["diff", path, str(tmp_path / "other")]) == 1
    assert capsys.readouterr().out.splitlines()[-1] == "differ (5 shared keys, atol=0)"


def test_damaged_tree_metadata_is_reported(tmp_path):
    path = _standard(str(tmp_path / "tree"))
    with open(os.path.join(path, "_METADATA"), "w") as f:
        f.write("{not json")
    with pytest.raises(checkpoint.DataLossError, match=r"Checkpoint '.*tree': .*_METADATA is corrupted"):
        checkpoint.read_checkpoint(path)


def test_a_directory_with_nothing_orbax_wrote_is_refused(tmp_path):
    (tmp_path / "7").mkdir()
    with pytest.raises(FileNotFoundError, match=r"No checkpoint in directory .*: it holds no 'checkpoint' state "
                                                r"file and is not an orbax checkpoint\. Pass .*orbax's own "
                                                r"\(with _METADATA\)"):
        checkpoint.read_checkpoint(str(tmp_path))


def test_own_checkpoint_without_its_metadata_is_not_taken_for_orbaxs(tmp_path):
    path = checkpoint.Checkpoint(w=jnp.ones(2)).write(str(tmp_path / "ours"))
    os.remove(os.path.join(path, "meta", "metadata"))
    with pytest.raises(ValueError, match=r"is not a checkpoint: meta/metadata is missing"):
        checkpoint.read_checkpoint(path)


def test_values_go_to_the_templates_sharding(tmp_path):
    path = str(tmp_path / "tree")
    big = np.arange(64, dtype=np.float32).reshape(8, 8)
    with ocp.StandardCheckpointer() as c:
        c.save(path, {"w": big, "k": jax.random.key(3)})
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]), ("x",))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("x"))
    template = {"w": varstate.Variable(jax.device_put(jnp.zeros((8, 8)), sharding)), "k": jax.random.key(0)}
    status = checkpoint.Checkpoint(**template).restore(path).assert_consumed()
    assert status.w.value.sharding == sharding
    np.testing.assert_array_equal(status.w.value, big)
    # orbax stores a key as its key data: the template's implementation rebuilds it
    np.testing.assert_array_equal(jax.random.normal(status.k, (3,)), jax.random.normal(jax.random.key(3), (3,)))
