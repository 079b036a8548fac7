"""restore_by_name resumes TF1 runs with TF's own slot and non-slot names, and reads Keras full names.

Fixtures: tests/data/make_tf1_slot_names_fixtures.py (TensorFlow 2.21, run by hand): for each TF1
optimizer, a Saver checkpoint after 3 steps, the gradients of step 4 and TF's values after step 4.
"""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import checkpoint
import varstate
from varstate import optimizers

DATA = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(__file__))), "data", "tf1_slot_names")
with open(os.path.join(DATA, "expected.json")) as f:
    EXPECTED = json.load(f)
with open(os.path.join(DATA, "keras.json")) as f:
    KERAS = json.load(f)


def _model(spec):
    r = varstate.Registry()
    params = {}
    for name, shape in spec["shapes"].items():
        parts = spec["parts"].get(name)
        if parts:
            params[name] = list(varstate.PartitionedVariable(jnp.zeros(shape), name=name, num_shards=parts,
                                                             registry=r))
        else:
            params[name] = varstate.Variable(jnp.zeros(shape), name=name, registry=r)
    step = varstate.get_or_create_global_step(r)
    return params, step


def _by_full_name(*trees):
    """{full name: value} over Variables, shards reassembled along axis 0 (as TF's `emb` is saved)."""
    parts = {}
    for v in jax.tree_util.tree_leaves(trees, is_leaf=lambda x: isinstance(x, varstate.Variable)):
        if isinstance(v, varstate.Variable):
            info = v.save_slice_info
            name = v.name if info is None else info.full_name
            parts.setdefault(name, []).append(((info.var_offset[0] if info else 0), np.asarray(v.value)))
    return {n: p[0][1] if len(p) == 1 else np.concatenate([a for _, a in sorted(p, key=lambda t: t[0])])
            for n, p in parts.items()}


def _optimizer(spec):
    return getattr(optimizers, spec["optimizer"].removesuffix("Optimizer"))(**spec["kwargs"])


# Fused states (opt.init(params, fused=True)) restore the same keys into their packed buffers.
@pytest.mark.parametrize(("config", "fused"), [(c, False) for c in sorted(EXPECTED)]
                         + [("adam", True), ("rmsprop_centered", True), ("adagrad_da", True)])
def test_tf1_run_resumes_with_no_map_and_steps_as_tf(config, fused):
    spec = EXPECTED[config]
    params, step = _model(spec)
    opt = _optimizer(spec)
    status = checkpoint.restore_by_name(os.path.join(DATA, config, "model.ckpt-3"), {"model": params, "step": step},
                                        optimizer_state=opt.init(params, fused=fused), optimizer_scope=spec["scope"])
    assert status.assert_consumed() is status  # every TF1 key found its variable, and every variable a key
    assert status.optimizer_state.fused == fused
    assert sorted(status.matched.values()) == spec["keys"]
    restored, state = status.params["model"], status.optimizer_state
    assert int(status.params["step"].value) == 3
    # The TF1 names our slots took: `_k` by TF's creation order.
    tf_name = {"Adam": ("m", "v"), "RMSProp": ("rms", "mg", "momentum") if "centered" in config
               else ("rms", "momentum"), "Adadelta": ("accum", "accum_update"), "Ftrl": ("accum", "linear"),
               "AdagradDA": ("gradient_accumulator", "gradient_squared_accumulator")}
    base, scope = spec["optimizer"].removesuffix("Optimizer"), spec["scope"] and spec["scope"] + "/"
    for k, slot in enumerate(tf_name.get(base, state.get_slot_names())):
        suffix = base if k == 0 else f"{base}_{k}"
        assert status.matched[f"dense/kernel/{slot}"] == f"{scope}dense/kernel/{suffix}"
        assert status.matched[f"emb/{slot}"] == f"{scope}emb/{suffix}"

    grads = {n: jnp.asarray(np.reshape(g, spec["shapes"][n]), jnp.float32) for n, g in spec["next_grads"].items()}
    if spec["parts"]:
        grads["emb"] = [grads["emb"][:3], grads["emb"][3:]]  # one gradient per shard, TF's 3 + 2 rows
    new_params, new_state = opt.apply_gradients(grads, restored, state, step=status.params["step"])
    ours = _by_full_name(new_params, new_state.slots, new_state.non_slots)  # per-variable views when fused
    by_key = {key: name for name, key in status.matched.items()}
    compared = 0
    for key, want in spec["after"].items():
        if key == "global_step":
            continue  # TF's apply_gradients increments it; ours leaves that to the caller
        got = ours[by_key[key]]
        want = np.asarray(want["values"], want["dtype"]).reshape(want["shape"])
        np.testing.assert_allclose(got, want, rtol=2e-6, atol=1e-7, err_msg=f"{config}: {key}")
        compared += 1
    assert compared == len(spec["keys"]) - 1


def test_an_optimizer_under_a_variable_scope_needs_its_scope():
    spec = EXPECTED["adam_scoped"]
    prefix = os.path.join(DATA, "adam_scoped", "model.ckpt-3")
    params, _ = _model(spec)
    plain = checkpoint.restore_by_name(prefix, params, optimizer_state=_optimizer(spec).init(params))
    assert plain.missing_in_checkpoint == ("beta1_power", "beta2_power", "dense/bias/m", "dense/bias/v",
                                           "dense/kernel/m", "dense/kernel/v", "emb/m", "emb/v")
    for scope in ("train", "train/"):
        params, _ = _model(spec)
        scoped = checkpoint.restore_by_name(prefix, params, optimizer_state=_optimizer(spec).init(params),
                                            optimizer_scope=scope)
        assert scoped.missing_in_checkpoint == () and scoped.matched["beta2_power"] == "train/beta2_power"
        assert scoped.unused_in_checkpoint == ("global_step",)


def test_custom_tf1_optimizer_name(tmp_path):
    """TF1's `name=` argument replaces the default name in every slot; optimizer_name says which one."""
    spec = EXPECTED["adam"]
    prefix = os.path.join(DATA, "adam", "model.ckpt-3")
    reader = checkpoint.read_checkpoint(prefix)
    renamed = {k.replace("/Adam", "/Tuned"): reader.get(k) for k in reader.keys()}
    ours = checkpoint.write_name_based(str(tmp_path / "model.ckpt"), renamed)
    params, _ = _model(spec)
    opt = _optimizer(spec)
    plain = checkpoint.restore_by_name(ours, params, optimizer_state=opt.init(params))
    assert "dense/kernel/m" in plain.missing_in_checkpoint and "dense/kernel/Tuned" in plain.unused_in_checkpoint
    params, _ = _model(spec)  # a fresh registry: a second init's slots would be uniquified (`m_1`)
    named = checkpoint.restore_by_name(ours, params, optimizer_state=opt.init(params), optimizer_name="Tuned")
    assert named.matched["dense/kernel/v"] == "dense/kernel/Tuned_1"
    np.testing.assert_array_equal(named.optimizer_state.get_slot(named.params["dense/bias"], "v").value,
                                  reader.get("dense/bias/Adam_1"))


def test_adagrad_and_proximal_adagrad_told_apart_by_the_checkpoint():
    # Both have one `accumulator` slot; TF1 names it after the optimizer.
    for config in ("adagrad", "proximal_adagrad"):
        spec = EXPECTED[config]
        params, _ = _model(spec)
        status = checkpoint.restore_by_name(os.path.join(DATA, config, "model.ckpt-3"), params,
                                            optimizer_state=optimizers.Adagrad(0.1).init(params))
        assert status.matched["dense/bias/accumulator"] == "dense/bias/" + spec["optimizer"].removesuffix("Optimizer")


def test_slots_follow_their_primary_through_an_assignment_map():
    prefix = os.path.join(DATA, "momentum", "model.ckpt-3")
    r = varstate.Registry()
    k = varstate.Variable(jnp.zeros((3, 2)), name="encoder/kernel", registry=r)
    b = varstate.Variable(jnp.zeros(2), name="encoder/bias", registry=r)
    opt = optimizers.Momentum(0.1, 0.9)
    status = checkpoint.restore_by_name(prefix, [k, b], {"dense/kernel": "encoder/kernel"},
                                        optimizer_state=opt.init([k, b]))
    assert status.matched == {"encoder/kernel": "dense/kernel", "encoder/kernel/momentum": "dense/kernel/Momentum"}
    # bias is not in the map: neither it nor its slot is restored.
    assert status.missing_in_checkpoint == ("encoder/bias", "encoder/bias/momentum")
    reader = checkpoint.read_checkpoint(prefix)
    np.testing.assert_array_equal(status.optimizer_state.get_slot(status.params[0], "momentum").value,
                                  reader.get("dense/kernel/Momentum"))
    assert not np.any(np.asarray(status.optimizer_state.get_slot(status.params[1], "momentum").value))


def test_missing_slots_are_reported_and_shapes_checked():
    spec = EXPECTED["adam"]
    prefix = os.path.join(DATA, "adam", "model.ckpt-3")
    r = varstate.Registry()
    extra = varstate.Variable(jnp.zeros(4), name="extra", registry=r)
    params, _ = _model(spec)
    params["extra"] = extra
    status = checkpoint.restore_by_name(prefix, params, optimizer_state=optimizers.Adam().init(params))
    assert status.missing_in_checkpoint == ("extra", "extra/m", "extra/v")
    with pytest.raises(AssertionError, match=r"Variables not found in the checkpoint: \['extra', 'extra/m', "
                                             r"'extra/v'\]"):
        status.assert_existing_objects_matched()
    wrong = {"k": varstate.Variable(jnp.zeros((2, 3)), name="dense/kernel", registry=varstate.Registry())}
    with pytest.raises(ValueError, match=r"Shape of variable 'dense/kernel' \(2, 3\) does not match the shape of "
                                         r"tensor 'dense/kernel' \(3, 2\)"):
        checkpoint.restore_by_name(prefix, wrong, optimizer_state=optimizers.Adam().init(wrong))
    with pytest.raises(TypeError, match=r"optimizer_state must be an OptimizerState .* got dict"):
        checkpoint.restore_by_name(prefix, params, optimizer_state={"m": 1})


def test_keras_full_names_of_an_object_based_checkpoint():
    """As TF's Saver on an object-based checkpoint: a name matches its object-graph full_name."""
    r = varstate.Registry()
    params = {"kernel": varstate.Variable(jnp.zeros((3, 2)), name="lstm_model/dense/kernel", registry=r),
              "bias": varstate.Variable(jnp.zeros(2), name="lstm_model/dense/bias", registry=r)}
    status = checkpoint.restore_by_name(os.path.join(DATA, "keras", KERAS["prefix"]), params)
    assert status.matched == {n: KERAS["full_names"][n] for n in ("lstm_model/dense/bias", "lstm_model/dense/kernel")}
    assert status.unused_in_checkpoint == ("save_counter/.ATTRIBUTES/VARIABLE_VALUE",)
    assert status.optimizer_state is None  # none was given
    for leaf, v in status.params.items():
        np.testing.assert_array_equal(np.ravel(v.value), np.float32(KERAS["values"][f"lstm_model/dense/{leaf}"]))
