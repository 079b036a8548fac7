"""`varstate.pack`: params in flat buffers, each Variable a view; steps, gradients, slots and checkpoints."""

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

import checkpoint
import varstate
from varstate import Variable
from varstate.optimizers import Adam, Momentum, keras

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "optimizers"))
from optimizer_cases import CASES


def _model(prefix="w", n=4):
    return {f"{prefix}{i}": Variable(jnp.arange(6.0).reshape(2, 3) / (i + 1) - 1.0, name=f"{prefix}{i}")
            for i in range(n)} | {"bias": Variable(jnp.linspace(-0.5, 0.5, 5), name=f"{prefix}_bias")}


def _variables(params):
    return jax.tree.leaves(params, is_leaf=lambda x: isinstance(x, Variable))


def _loss(params):
    return sum(jnp.sum(jnp.sin(v.value) * (k + 1)) for k, v in enumerate(_variables(params)))


def _linear_loss(params, coefficients):
    return sum(jnp.sum(v.value * c) for v, c in zip(_variables(params), coefficients, strict=True))


def test_the_leaves_are_the_buffers_and_unpack_gives_the_variables_with_their_identities():
    params = _model() | {"step": Variable(jnp.zeros((), jnp.int32), name="count"),
                         "frozen": Variable(jnp.ones(2), name="frozen", trainable=False),
                         "half": Variable(jnp.ones(3, jnp.bfloat16), name="half")}
    packed = varstate.pack(params)
    leaves = jax.tree.leaves(packed)
    assert [(x.dtype, x.shape) for x in leaves[:2]] == [(jnp.float32, (29,)), (jnp.bfloat16, (3,))]
    assert len(leaves) == 4 and repr(packed) == "Packed(buffers=['float32[29]', 'bfloat16[3]'], unpacked=2)"
    unpacked = packed.unpack()
    assert jax.tree.structure(unpacked) == jax.tree.structure(params)
    for k, v in params.items():
        assert unpacked[k].resource_id == v.resource_id and unpacked[k].name == v.name
        np.testing.assert_array_equal(unpacked[k].value, v.value)
    assert unpacked["frozen"] is params["frozen"] and unpacked["step"] is params["step"]  # left as they are
    on_host = jax.tree.map(np.asarray, packed).unpack()  # buffers of another kind (a numpy copy) unpack too
    np.testing.assert_array_equal(on_host["w1"].value, params["w1"].value)


def test_a_tied_weight_is_one_slice_and_its_gradients_add_up():
    w = Variable(jnp.ones(3), name="tied")
    packed = varstate.pack({"a": w, "b": w})
    assert jax.tree.leaves(packed)[0].shape == (3,)
    grads = jax.grad(lambda p: jnp.sum(p.unpack()["a"].value) + 2 * jnp.sum(p.unpack()["b"].value))(packed)
    assert grads.layout is packed.layout
    np.testing.assert_array_equal(grads.buffers[0], [3.0, 3.0, 3.0])


@pytest.mark.parametrize("name", sorted(n for n, make in CASES.items() if make()._elementwise
                                        and not n.startswith("optax")))
def test_a_packed_step_is_the_unpacked_steps_arithmetic_bit_for_bit(name):
    # Op by op each element of a buffer takes the operations its own array takes unpacked: the same bits.
    opt = CASES[name]()
    packed = varstate.pack(_model("p"))
    state = opt.init(packed)
    plain = _model("u")
    plain_state = opt.init(plain)
    # The gradient of sum(v * c) is c exactly, packed or not, so both steps get the same bits without taking
    # the gradients op by op (eagerly, that was 70% of this test's time).
    grad = jax.jit(jax.grad(_linear_loss))
    packed_grad = jax.jit(jax.grad(lambda p, cs: _linear_loss(p.unpack(), cs)))
    for step in range(3):
        cs = [np.cos(np.asarray(v.value) * (step + 2)) * (k + 1) for k, v in enumerate(_variables(plain))]
        grads = packed_grad(packed, cs)
        with jax.disable_jit():
            packed, state = opt.update(grads, packed, state)
            plain, plain_state = opt.update(grad(plain, cs), plain, plain_state)
    for k, v in packed.unpack().items():
        np.testing.assert_array_equal(v.value, plain[k.replace("p", "u", 1) if k != "bias" else k].value)
        for slot in plain_state.get_slot_names():
            np.testing.assert_array_equal(state.get_slot(v, slot).value,
                                          plain_state.get_slot(plain[k.replace("p", "u", 1) if k != "bias" else k],
                                                               slot).value)


def test_a_training_loop_compiles_its_step_once_and_matches_the_unpacked_one_within_an_ulp(compiles):
    # Jitted, a buffer's loop and an array's may be vectorised apart: within one ulp of the largest element a step.
    opt = Adam(0.05)
    packed = varstate.pack(_model("c", n=5))
    state = opt.init(packed)
    plain = _model("d", n=5)
    plain_state = opt.init(plain)
    grad = jax.jit(jax.grad(lambda p: _loss(p.unpack())))
    for _ in range(5):
        packed, state = opt.apply_gradients(grad(packed), packed, state)
        plain, plain_state = opt.apply_gradients(jax.grad(_loss)(plain), plain, plain_state)
    assert compiles("_flat_step") == 2  # one for the packed params, one for the unpacked ones
    for (k, v), want in zip(packed.unpack().items(), plain.values(), strict=True):
        scale = np.spacing(np.abs(np.asarray(want.value)).max())
        assert np.abs(np.asarray(v.value, np.float64) - np.asarray(want.value)).max() <= 5 * scale, k


def test_a_training_step_jitted_with_the_guides_cpu_compile_options_matches_the_default_jit():
    # The optimizers guide: on CPU a step reading many views compiles faster with XLA's older emitters. Two
    # programs, vectorised apart: within one ulp of the largest element per step, 3 steps.
    opt = Adam(0.05)

    def train(carry):
        packed, state = carry
        return opt.update(jax.grad(lambda p: _loss(p.unpack()))(packed), packed, state)

    runs = []
    for options in (None, {"xla_cpu_use_fusion_emitters": False}):
        packed = varstate.pack(_model("e", n=5))
        carry = (packed, opt.init(packed))
        step = jax.jit(train, compiler_options=options)
        for _ in range(3):
            carry = step(carry)
        runs.append(carry[0].unpack())
    for (k, v), want in zip(runs[1].items(), runs[0].values(), strict=True):
        scale = np.spacing(np.abs(np.asarray(want.value)).max())
        assert np.abs(np.asarray(v.value, np.float64) - np.asarray(want.value)).max() <= 3 * scale, k


def test_slots_names_and_checkpoint_keys_are_the_unpacked_ones_and_restore_goes_both_ways(tmp_path):
    opt = Momentum(0.1, momentum=0.9)
    params = _model("k", n=2)
    packed = varstate.pack(params)
    state = opt.init(packed)
    assert state.get_slot(params["k1"], "momentum").name == "k1/momentum"
    grads = jax.grad(lambda p: _loss(p.unpack()))(packed)
    packed, state = opt.apply_gradients(grads, packed, state)
    path = checkpoint.Checkpoint(model=packed, optimizer=state).write(str(tmp_path / "packed"), format="tf")
    unpacked = params  # the same Variables, unpacked: the keys a checkpoint of them has
    plain_path = checkpoint.Checkpoint(model=unpacked, optimizer=opt.init(unpacked)).write(
        str(tmp_path / "plain"), format="tf")
    assert set(checkpoint.read_checkpoint(path).keys()) == set(checkpoint.read_checkpoint(plain_path).keys())
    # into unpacked params
    fresh = _model("k", n=2)
    status = checkpoint.Checkpoint(model=fresh, optimizer=opt.init(fresh)).restore(path)
    status.assert_consumed()
    for k, v in packed.unpack().items():
        np.testing.assert_array_equal(status.model[k].value, v.value)
    # into packed params: the template's layout, values packed again
    template = varstate.pack(_model("k", n=2))
    for fmt_path in (path, checkpoint.Checkpoint(model=packed, optimizer=state).write(str(tmp_path / "orbax"))):
        status = checkpoint.Checkpoint(model=template, optimizer=opt.init(template)).restore(fmt_path)
        status.assert_consumed()
        assert isinstance(status.model, varstate.Packed) and status.model.layout is template.layout
        np.testing.assert_array_equal(status.model.buffers[0], packed.buffers[0])
        assert status.optimizer.fused
        np.testing.assert_array_equal(status.optimizer.packed["momentum"][0], state.packed["momentum"][0])


def test_a_state_made_for_the_unpacked_params_is_packed_by_apply_gradients():
    opt = Adam(0.1)
    params = _model("s", n=2)
    state = opt.init(params)
    half = jax.tree.map(lambda v: v.assign(jnp.full(v.shape, 0.5)), state.slots["m"],
                        is_leaf=lambda x: isinstance(x, Variable))
    state = state.replace(slots={"m": half, "v": state.slots["v"]})
    packed = varstate.pack(params)
    grads = jax.tree.map(jnp.zeros_like, packed)
    packed, state = opt.apply_gradients(grads, packed, state)
    assert state.fused and state.get_slot(params["s0"], "m").value[0, 0] == np.float32(0.5) * np.float32(0.9)


def test_sharded_params_stay_unpacked_and_replicated_ones_are_packed():
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]), ("x",))
    sharded = Variable(jax.device_put(jnp.ones((8, 2)), NamedSharding(mesh, PartitionSpec("x"))), name="sharded")
    replicated = Variable(jax.device_put(jnp.ones(3), NamedSharding(mesh, PartitionSpec())), name="replicated")
    packed = varstate.pack({"s": sharded, "r": replicated})
    assert packed.loose[0] is sharded and packed.buffers[0].shape == (3,)
    assert packed.buffers[0].sharding.is_fully_replicated and len(packed.buffers[0].sharding.device_set) == 8
    opt = Adam(0.1)
    grads = jax.grad(lambda p: jnp.sum(p.unpack()["s"].value) + jnp.sum(p.unpack()["r"].value))(packed)
    state = opt.init(packed)
    # An unpacked param's errors give its place in the Packed (after the buffers), as its key path does.
    with pytest.raises(ValueError, match=r"^apply_gradients: gradient for 'sharded' \(params\[1\]\) has shape \(3,\)"):
        opt.apply_gradients(jax.tree.map(lambda g: jnp.ones(3), grads), packed, state)
    assert [jax.tree_util.keystr(k) for k, _ in jax.tree_util.tree_flatten_with_path(packed)[0]] == [
        "[0] (the Packed buffer of 'replicated')", "[1].value"]
    packed, _ = opt.apply_gradients(grads, packed, state)
    assert packed.loose[0].value.sharding.spec == PartitionSpec("x")


def test_errors_say_what_and_the_fix():
    packed = varstate.pack(_model("e", n=2))
    with pytest.raises(TypeError, match=r"Lamb.init: params are packed \(varstate.pack\), but Lamb's step is not "
                                        r"elementwise .* Step the unpacked params \(packed.unpack\(\)\) with Lamb"):
        keras.Lamb(0.1).init(packed)
    opt = Adam(0.1)
    state = opt.init(packed)
    with pytest.raises(ValueError, match=r"apply_gradients: params are packed \(varstate.pack\) but grads are dict: "
                                         r"take the gradients with respect to the Packed itself"):
        opt.apply_gradients({k: jnp.ones(v.shape) for k, v in packed.unpack().items()}, packed, state)
    other = varstate.pack(_model("f", n=2))
    with pytest.raises(ValueError, match=r"but grads are Packed of another layout"):
        opt.apply_gradients(jax.tree.map(jnp.zeros_like, other), packed, state)
    with pytest.raises(TypeError, match=r"Adam.init: params hold a Packed \(varstate.pack\) inside other containers; "
                                        r"a Packed must be the whole params"):
        opt.init({"packed": packed, "emb": Variable(jnp.ones((4, 2)), name="emb")})
    with pytest.raises(TypeError, match=r"Adam.init: packed params \(varstate.pack\) are all stepped together"):
        opt.init(packed, stepped=lambda path: True)
    with pytest.raises(ValueError, match=r"varstate.pack: params hold traced values; pack them outside jit"):
        jax.jit(varstate.pack)([jnp.ones(2)])
    with pytest.raises(ValueError, match=r"Packed.repacked: params must have the packed params' structure"):
        packed.repacked([jnp.ones(2)])
    with pytest.raises(ValueError, match=r"Packed.repacked: leaf 0 must have shape \(5,\), as packed; got \(3,\)"):
        packed.repacked({k: jnp.ones(3) for k in packed.unpack()})
    with pytest.raises(ValueError, match=r"Packed.repacked: Variable 'wrong' must have shape \(2, 3\), as packed"):
        packed.repacked({k: (Variable(jnp.ones(3), name="wrong") if k == "e0" else v)
                         for k, v in packed.unpack().items()})
    # Gradient errors name a buffer by the Variables it holds, and an unpacked param by its place in the Packed.
    grads = jax.grad(lambda p: sum(jnp.sum(v.value) for v in p.unpack().values()))(packed)
    with pytest.raises(TypeError, match=r"^apply_gradients: gradient for params\[0\] \(the Packed buffer of 'e_bias', "
                                        r"'e0', 'e1'\) has dtype bfloat16, the variable has dtype float32\."):
        opt.apply_gradients(jax.tree.map(lambda g: g.astype(jnp.bfloat16), grads), packed, state)
    with pytest.raises(ValueError, match=r"^apply_gradients: gradient for params\[0\] \(the Packed buffer of 'e_bias', "
                                         r"'e0', 'e1'\) has shape \(3,\), the variable has shape"):
        opt.apply_gradients(jax.tree.map(lambda g: jnp.ones(3), grads), packed, state)
    with pytest.raises(TypeError, match=r"Packed.repacked: leaf 0 must have dtype float32, as packed; got int32\. "
                                        r"Cast it first \(x.astype\(jnp.float32\)\), or pack the params again\."):
        packed.repacked({k: jnp.ones(v.shape, jnp.int32) for k, v in packed.unpack().items()})


def test_a_donated_packed_names_its_variables_when_read():
    packed = varstate.pack(_model("d", n=2))
    opt = Adam(0.1)
    grads = jax.tree.map(jnp.ones_like, packed)
    new, _ = opt.apply_gradients(grads, packed, opt.init(packed))
    with pytest.raises(varstate.DonatedVariableError, match=r"Packed buffer 0 \(of 'd_bias', 'd0', 'd1'\): this "
                                                            r"version's buffer was donated to a jitted step"):
        packed.unpack()
    assert sorted(new.unpack()) == ["bias", "d0", "d1"]  # the step's result is the one to use
