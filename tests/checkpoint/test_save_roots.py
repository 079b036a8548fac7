"""`Checkpoint.save(prefix, **roots)`: new versions of the roots, one Checkpoint and one counter for a whole loop."""

import os

import jax.numpy as jnp
import numpy as np
import pytest

import checkpoint
import varstate


def test_save_takes_new_roots_and_keeps_counting(tmp_path):
    registry = varstate.Registry()
    w = varstate.Variable(jnp.zeros(3), name="w", registry=registry)
    ckpt = checkpoint.Checkpoint(model={"w": w}, step=np.int64(0))
    prefix = str(tmp_path / "ckpt")
    paths = []
    for step in range(1, 4):
        w = w.assign_add(jnp.ones(3))
        paths.append(ckpt.save(prefix, model={"w": w}, step=np.int64(step)))
    assert [os.path.basename(p) for p in paths] == ["ckpt-1", "ckpt-2", "ckpt-3"]
    assert ckpt.save_counter == 3
    assert checkpoint.latest_checkpoint(str(tmp_path)) == paths[-1]
    for i, path in enumerate(paths, 1):
        reader = checkpoint.read_checkpoint(path)
        assert reader.get("model/w/.ATTRIBUTES/VARIABLE_VALUE").tolist() == [float(i)] * 3
        assert int(reader.get("step/.ATTRIBUTES/VARIABLE_VALUE")) == i
        assert int(reader.get("save_counter/.ATTRIBUTES/VARIABLE_VALUE")) == i
    # Only the roots given change: `step` keeps its last value when left out.
    ckpt.save(prefix, model={"w": w.assign(jnp.full(3, 9.0))})
    reader = checkpoint.read_checkpoint(prefix + "-4")
    assert reader.get("model/w/.ATTRIBUTES/VARIABLE_VALUE").tolist() == [9.0] * 3
    assert int(reader.get("step/.ATTRIBUTES/VARIABLE_VALUE")) == 3
    # The restored counter continues too.
    template = checkpoint.Checkpoint(model={"w": varstate.Variable(jnp.zeros(3), name="w", registry=registry)},
                                     step=np.int64(0))
    template.restore(prefix + "-4").assert_consumed()
    assert os.path.basename(template.save(prefix, model=template.model)) == "ckpt-5"


def test_save_refuses_unknown_roots(tmp_path):
    ckpt = checkpoint.Checkpoint(model=jnp.zeros(2), opt=jnp.ones(2))
    with pytest.raises(ValueError, match=r"Checkpoint.save: \['modle'\] is not a root of this Checkpoint; its roots "
                                         r"are \['model', 'opt'\]\. Pass new values only for roots given to"):
        ckpt.save(str(tmp_path / "ckpt"), modle=jnp.zeros(2))
    with pytest.raises(ValueError, match=r"\['a', 'b'\] are not roots of this Checkpoint"):
        ckpt.save(str(tmp_path / "ckpt"), a=1, b=2)
    with pytest.raises(ValueError, match=r"\['save_counter'\] is not a root of this Checkpoint \('save_counter' is "
                                         r"the checkpoint's own\)"):
        ckpt.save(str(tmp_path / "ckpt"), save_counter=5)
    # Nothing was written and the counter did not move.
    assert ckpt.save_counter == 0 and not os.listdir(tmp_path)
