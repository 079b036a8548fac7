"""Two first-day traps that used to pass silently: an optimizer state saved beside Variables that are not the
ones it stepped (every slot dropped), and a restore root that matches nothing in the checkpoint (the model kept
its initial weights). Each now raises, naming the object and the fix; the legitimate cases (an optimizer saved
alone, a part of the model, a root new since the save with expect_partial) keep TF's behaviour."""

import gc
import logging
import os
import re

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import checkpoint
import varstate
from varstate.nnx import from_nnx
from varstate.optimizers import Adam

KEY = "/.ATTRIBUTES/VARIABLE_VALUE"


def stepped():
    """Params and an Adam state after one step, the optimizer, and the gradient used."""
    params = {"dense": {"kernel": varstate.Variable(jnp.array([1.0, 2.0]), name="dense/kernel")}}
    opt = Adam(0.1)
    grads = {"dense": {"kernel": jnp.array([0.5, -1.0])}}
    params, state = opt.apply_gradients(grads, params, opt.init(params))
    return params, state, opt, grads


# --- 1. an optimizer state saved with other Variables than those it stepped --------------------------------

def test_state_saved_beside_other_variables_is_refused(tmp_path):
    params, state, _, _ = stepped()
    rebuilt = {"dense": {"kernel": varstate.Variable(params["dense"]["kernel"].value, name="dense/kernel")}}
    ckpt = checkpoint.Checkpoint(model=rebuilt, optimizer=state)
    with pytest.raises(ValueError, match=(
            r"^Cannot checkpoint the optimizer \(root\)\.optimizer: none of its slots belongs to a saved Variable\. "
            r"The first, 'm' \('dense/kernel/m'\), is for the Variable 'dense/kernel' "
            r"\(params\['dense'\]\['kernel'\]\), "
            r"which is not among the saved Variables \(the model saved starts at \(root\)\.model\.dense\.kernel\), so "
            r"every slot would be left out.*Save the params the optimizer stepped: "
            r"Checkpoint\(model=params, optimizer=state\) with the params apply_gradients returned \(for an nnx model, "
            r"the params of varstate\.nnx\.from_nnx\(model\), not the Module\)\.")):
        ckpt.save(str(tmp_path / "ckpt"))
    assert not os.listdir(tmp_path)  # refused before anything is written


def test_params_that_became_arrays_saved_with_their_state_name_the_fix(tmp_path):
    params, state, _, _ = stepped()
    doubled = {"dense": {k: v * 2 for k, v in params["dense"].items()}}  # `v * 2` is an array, not a Variable
    with pytest.raises(ValueError, match=(
            r"none of its slots belongs to a saved Variable\..* The model saved holds plain arrays, no Variable: if "
            r"the params became arrays \(`\{k: v \* 2 for k, v in params\.items\(\)\}`\), change a value and "
            r"keep its Variable with `v\.assign\(v \* 2\)`, or `varstate\.with_values\(params, new_arrays\)` "
            r"for a tree\.$")):
        checkpoint.Checkpoint(model=doubled, optimizer=state).write(str(tmp_path / "c"))
    # The fix named: the Variables keep their slots, and the saved value is the doubled one.
    before = np.asarray(params["dense"]["kernel"].value)
    kept = {"dense": {k: v.assign(v * 2) for k, v in params["dense"].items()}}
    path = checkpoint.Checkpoint(model=kept, optimizer=state).write(str(tmp_path / "c"))
    reader = checkpoint.read_checkpoint(path)
    np.testing.assert_array_equal(reader.get("model/dense/kernel" + KEY), before * 2)
    np.testing.assert_array_equal(reader.get("model/dense/kernel/.OPTIMIZER_SLOT/optimizer/m" + KEY),
                                  np.asarray(state.get_slot(kept["dense"]["kernel"], "m").value))


def test_nnx_module_saved_with_the_state_of_its_from_nnx_params_is_refused(tmp_path):
    model = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
    params = from_nnx(model, registry=varstate.Registry())
    opt = Adam(0.1)
    params, state = opt.apply_gradients(jax_zeros_like(params), params, opt.init(params))
    with pytest.raises(ValueError, match=r"optimizer \(root\)\.optimizer: none of its slots belongs to a saved "
                                         r"Variable\. The first, 'm' .* \(params\['bias'\]\), .*starts at "
                                         r"\(root\)\.model\.bias\).*from_nnx\(model\), not the Module") as e:
        checkpoint.Checkpoint(model=model, optimizer=state).write(str(tmp_path / "c"))
    assert "plain arrays" not in str(e.value)  # a Module's values are arrays, but the fix is from_nnx's params
    # The fix: the params the optimizer stepped; every slot is saved under its Variable.
    path = checkpoint.Checkpoint(model=params, optimizer=state).write(str(tmp_path / "c"))
    reader = checkpoint.read_checkpoint(path)
    np.testing.assert_array_equal(reader.get("model/bias/.OPTIMIZER_SLOT/optimizer/m" + KEY),
                                  np.asarray(state.get_slot(params["bias"], "m").value))


def jax_zeros_like(params):
    return {k: jnp.ones_like(v.value) for k, v in params.items()}


def test_the_params_the_optimizer_stepped_save_every_slot(tmp_path):
    params, state, _, _ = stepped()
    path = checkpoint.Checkpoint(model=params, optimizer=state).write(str(tmp_path / "c"))
    reader = checkpoint.read_checkpoint(path)
    for slot in ("m", "v"):
        np.testing.assert_array_equal(reader.get(f"model/dense/kernel/.OPTIMIZER_SLOT/optimizer/{slot}" + KEY),
                                      np.asarray(state.get_slot(params["dense"]["kernel"], slot).value))


def test_an_optimizer_saved_alone_keeps_its_non_slots_as_tf(tmp_path):
    # tf.train.Checkpoint(optimizer=opt) saves the optimizer's own values and leaves out the slots of Variables
    # it does not save; a checkpoint with no model (scalars such as a step beside it) is that.
    params, state, opt, _ = stepped()
    path = checkpoint.Checkpoint(optimizer=state, step=jnp.int32(1)).write(str(tmp_path / "c"))
    reader = checkpoint.read_checkpoint(path)
    assert sorted(reader.keys()) == ["optimizer/beta1_power" + KEY, "optimizer/beta2_power" + KEY, "step" + KEY]
    status = checkpoint.Checkpoint(optimizer=opt.init(params)).restore(path, expect_partial=True)
    for name in ("beta1_power", "beta2_power"):  # 0.9 ** 2 and 0.999 ** 2 after one step, as saved
        assert status.optimizer.non_slots[name].value == state.non_slots[name].value


def test_a_part_of_the_model_with_the_whole_optimizer_is_saved_as_tf(tmp_path):
    a, b = varstate.Variable(jnp.ones(2), name="a"), varstate.Variable(jnp.ones(2), name="b")
    state = Adam(0.1).init([a, b])
    path = checkpoint.Checkpoint(model={"a": a}, optimizer=state).write(str(tmp_path / "c"))
    assert sorted(k for k in checkpoint.read_checkpoint(path).keys() if "OPTIMIZER_SLOT" in k) == [
        "model/a/.OPTIMIZER_SLOT/optimizer/m" + KEY, "model/a/.OPTIMIZER_SLOT/optimizer/v" + KEY]


# --- 2. a restore root that matches nothing in the checkpoint -------------------------------------------------

def saved(tmp_path):
    model = {"dense": {"kernel": varstate.Variable(jnp.array([1.0, 2.0])), "bias": varstate.Variable(jnp.ones(1))}}
    return checkpoint.Checkpoint(model=model, step=jnp.int32(7)).write(str(tmp_path / "c"))


def template():
    return {"dense": {"kernel": varstate.Variable(jnp.zeros(2)), "bias": varstate.Variable(jnp.zeros(1))}}


def test_a_root_named_differently_is_named_by_every_check(tmp_path, caplog):
    path = saved(tmp_path)
    why = (rf"Root 'net' matched no value in the checkpoint '{path}': it has no root 'net'; its roots are "
           r"\['model', 'step'\]\. Rename the root to the one holding its values \(Checkpoint\(<name>=\.\.\.\)\), "
           r"or pass the template of the model this checkpoint was saved from\.")
    # Nothing matched at all: left to the status, as TF; each check and the discarded status's warning say why.
    status = checkpoint.Checkpoint(net=template()).restore(path)
    with pytest.raises(AssertionError, match=r"^Found 2 Python objects .*\]\. " + why + "$"):
        status.assert_existing_objects_matched()
    with pytest.raises(AssertionError, match=r"^Nothing except the root object matched .*\]\. " + why + "$"):
        status.assert_nontrivial_match()
    with caplog.at_level(logging.WARNING, logger="checkpoint"):
        del status
        gc.collect()
    assert re.search(r"Some values in the checkpoint were not restored: .*is intended\. " + why, caplog.text)
    with pytest.raises(ValueError, match=r"^Checkpoint\.restore\(.*, strict=True\): Found 2 Python objects .* "
                                         + why + " With strict=True"):
        checkpoint.Checkpoint(net=template()).restore(path, strict=True)


def test_a_template_of_another_structure_is_refused(tmp_path):
    path = saved(tmp_path)
    other = {"encoder": {"kernel": varstate.Variable(jnp.zeros(2))}}
    with pytest.raises(ValueError, match=(
            r"^Root 'model' matched no value in the checkpoint .*: none of its values is saved under \(root\)\.model "
            r"\(the first is \(root\)\.model\.encoder\.kernel\); the checkpoint's \(root\)\.model holds \['dense'\], "
            r"and its roots are \['model', 'step'\]\. The template is of another structure: pass the template of "
            r"the model this checkpoint was saved from")):
        checkpoint.Checkpoint(model=other, step=jnp.int32(0)).restore(path)


def test_a_root_matching_nothing_beside_roots_that_match(tmp_path, caplog):
    path = saved(tmp_path)
    ema = {"w": varstate.Variable(jnp.full(2, 3.0))}
    with caplog.at_level(logging.WARNING, logger="checkpoint"):
        with pytest.raises(ValueError, match=r"^Root 'ema' matched no value .*it has no root 'ema'"):
            checkpoint.Checkpoint(model=template(), ema=ema).restore(path)
        gc.collect()
    assert "were not restored" not in caplog.text  # the error says it all
    # A root new since the save, said so: the others restore, it comes back as given, the assertions name it.
    status = checkpoint.Checkpoint(model=template(), ema=ema).restore(path, expect_partial=True)
    assert status.model["dense"]["kernel"].value.tolist() == [1.0, 2.0]
    assert status.ema["w"].value.tolist() == [3.0, 3.0]
    status.assert_nontrivial_match()
    with pytest.raises(AssertionError, match=r"^Found 1 Python objects .*: \['\(root\)\.ema\.w'\]\. Root 'ema' "
                                             r"matched no value .*its roots are \['model', 'step'\]"):
        status.assert_existing_objects_matched()


def test_a_deferred_root_matching_nothing_is_refused(tmp_path):
    path = saved(tmp_path)
    status = checkpoint.Checkpoint(model=template()).restore(path)
    with pytest.raises(ValueError, match=r"^Root 'optimizer' matched no value .*no root 'optimizer'"):
        status.restore(optimizer={"x": jnp.zeros(1)})
    assert status.restore(step=jnp.int32(0)).step == 7


def test_roots_without_values_are_not_refused(tmp_path):
    path = saved(tmp_path)
    status = checkpoint.Checkpoint(model=template(), extra=None, empty={}).restore(path, strict=False)
    assert status.model["dense"]["bias"].value.tolist() == [1.0]
    assert status.extra is None and status.empty == {}


def test_manager_restore_honours_expect_partial(tmp_path):
    mgr = checkpoint.CheckpointManager(str(tmp_path / "m"), max_to_keep=2)
    mgr.save(1, model=template())
    with pytest.raises(ValueError, match=r"^Root 'ema' matched no value .*its roots are \['model'\]"):
        mgr.restore(model=template(), ema={"w": jnp.ones(2)})
    restored = mgr.restore(model=template(), ema={"w": jnp.ones(2)}, expect_partial=True)
    assert restored.ema["w"].tolist() == [1.0, 1.0]
