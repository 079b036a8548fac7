"""Fused slots (`opt.init(params, fused=True)`): the unfused step's numbers, per-variable slots outside.

The reference is the unfused step, itself checked against TF's fixtures and
closed forms in test_optimizers.py. The fused step runs the same elementwise
formula over a longer buffer, and XLA:CPU compiles a longer loop into other
vector code: it rewrites ``1 / sqrt(x)`` as ``rsqrt(x)`` (whose vector form is
within 1 ulp of the correctly rounded value, and which elements it rounds the
other way depends on the vector width and the loop's remainder), contracts a
multiply and an add into one FMA in one loop and not in another, and
approximates pow. Each such op moves its result by at most 1 ulp, and an
optimizer's update is a value of at most the order of the variable's
magnitude, so one step moves an element by at most 1 ulp of the array's largest
element. The promise, for every optimizer on every CPU: fused equals unfused
within one ulp of the array's largest element per step (an ulp of the element
itself has no bound near zero, where an update nearly cancels it).
"""

import os
import sys

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest

import checkpoint
from varstate import IndexedSlices, PartitionedVariable, Variable, pack
from varstate.optimizers import (
    Adagrad,
    Adam,
    Momentum,
    OptimizerState,
    from_optax,
)
from varstate.optimizers._core import _step
from varstate.optimizers._core._packed import FUSE_MAX_SIZE

sys.path.insert(0, os.path.dirname(__file__))
from optimizer_cases import pick

OPTIMIZERS = pick("gd", "momentum", "adam", "lazy_adam", "adagrad", "rmsprop", "adadelta", "adagrad_da", "ftrl",
                  "proximal_adagrad", "proximal_gd", "keras_adam", "keras_adamw", "keras_nadam", "keras_lion",
                  "keras_ftrl", "loss_scale_adam")


def _ulps_of_largest(a, b):
    """max |a - b| in ulps of the largest finite magnitude in ``a``; NaNs must sit at the same places."""
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    np.testing.assert_array_equal(np.isnan(a64), np.isnan(b64))
    a64, b64 = a64[~np.isnan(a64)], b64[~np.isnan(b64)]
    if np.array_equal(a64, b64):
        return 0.0
    largest = np.max(np.abs(a64))
    ulp = 2.0 ** (np.floor(np.log2(largest)) - ml_dtypes.finfo(a.dtype).nmant)  # bfloat16 too
    return float(np.max(np.abs(a64 - b64)) / ulp)


def _model(tag):
    """Small f32 params (one group), two bf16 (another), one too large to pack, a plain array, a frozen one,
    a tied weight, and a small embedding that gets IndexedSlices."""
    shared = Variable(jnp.linspace(-1.0, 1.0, 6).reshape(2, 3), name=f"{tag}shared")
    return {
        "small": [Variable(jnp.full((3, 2), 0.5 + i), name=f"{tag}s{i}") for i in range(5)],
        "scalar": Variable(jnp.asarray(0.25), name=f"{tag}scalar"),
        "half": [Variable(jnp.full((4,), 1.5 + i, jnp.bfloat16), name=f"{tag}h{i}") for i in range(2)],
        "big": Variable(jnp.ones((FUSE_MAX_SIZE + 1,)) * 0.1, name=f"{tag}big"),
        "plain": jnp.arange(4.0),
        "frozen": Variable(jnp.ones(2), name=f"{tag}frozen", trainable=False),
        "tied_a": shared,
        "tied_b": shared,
        "emb": Variable(jnp.arange(24.0).reshape(8, 3) / 10, name=f"{tag}emb"),
    }


def _grads(t, params):
    def dense(x):
        return jnp.cos(jnp.arange(x.size, dtype=jnp.float32).reshape(x.shape) + t).astype(x.dtype)

    grads = jax.tree.map(lambda p: dense(p.value if isinstance(p, Variable) else p), params,
                         is_leaf=lambda x: isinstance(x, Variable))
    grads["frozen"] = None
    if t == 1:  # rows with duplicates into a packed param, and a packed param and the big one without a gradient
        grads["emb"] = IndexedSlices(jnp.ones((3, 3)) * 0.3, jnp.array([1, 6, 1]), (8, 3))
        grads["small"][2] = None
        grads["big"] = None
    return grads


def _values(params, state):
    leaves = jax.tree.leaves(params, is_leaf=lambda x: isinstance(x, Variable))
    out = [np.asarray(x.value if isinstance(x, Variable) else x) for x in leaves]
    for tree in state.slots.values():
        out += [np.asarray(s.value if isinstance(s, Variable) else s)
                for s in jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, Variable))]
    return out + [np.asarray(v.value) for v in state.non_slots.values()]


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_fused_steps_within_one_ulp_per_step_of_unfused(name):
    opt = OPTIMIZERS[name]()
    runs = {}
    for fused in (False, True):
        params = _model(f"{fused}/")
        state = opt.init(params, fused=fused)
        assert state.fused == (fused and bool(state.get_slot_names()))  # nothing to pack without slots
        for t in range(4):
            params, state = opt.apply_gradients(_grads(t, params), params, state, step=jnp.asarray(t))
        runs[fused] = params, state
    (p0, s0), (p1, s1) = runs[False], runs[True]
    assert sorted(s1.packed) == s0.get_slot_names()
    for n in s1.packed:  # f32 group: 5 x 6 + 1 + 4 (plain) + 6 (tied, once) + 24 (emb); bf16 group: 2 x 4
        assert [(b.dtype, b.shape) for b in s1.packed[n]] == [(jnp.float32, (65,)), (jnp.bfloat16, (8,))]
    for a, b in zip(_values(p0, s0), _values(p1, s1), strict=True):
        assert b.dtype == a.dtype
        assert _ulps_of_largest(a, b) <= 4, (name, a, b)  # the module docstring's bound: 1 per step, 4 steps
    assert p1["tied_a"].resource_id == p1["tied_b"].resource_id  # one variable, one slot, at both places
    np.testing.assert_array_equal(np.asarray(p1["tied_a"].value), np.asarray(p1["tied_b"].value))


@pytest.mark.parametrize("name", ["adam", "keras_lion", "loss_scale_adam"])
def test_fused_step_compiles_once_donates_and_keeps_identities(name, compiles):
    opt = OPTIMIZERS[name]()
    params = _model("a/")
    state = opt.init(params, fused=True)
    grads = _grads(0, params)
    slot_ids = {n: [s.resource_id for s in jax.tree.leaves(state.slots[n], is_leaf=lambda x: isinstance(x, Variable))
                    if isinstance(s, Variable)] for n in state.packed}
    buffers = [b for bs in state.packed.values() for b in bs]
    params, state = opt.apply_gradients(grads, params, state)
    assert all(b.is_deleted() for b in buffers)
    compiled = compiles("_flat_step")
    for _ in range(2):
        params, state = opt.apply_gradients(grads, params, state)
    fresh = _model("b/")  # a freshly built identical model reuses the compiled fused step
    fresh, fresh_state = opt.apply_gradients(_grads(0, fresh), fresh, opt.init(fresh, fused=True))
    assert compiles("_flat_step") == compiled
    assert fresh_state.get_slot(fresh["small"][0], state.get_slot_names()[0]).name.startswith("b/s0/")
    for n, ids in slot_ids.items():
        assert [s.resource_id for s in jax.tree.leaves(state.slots[n], is_leaf=lambda x: isinstance(x, Variable))
                if isinstance(s, Variable)] == ids


def test_update_inside_a_callers_jit_equals_apply_gradients():
    opt = Adam(0.1)
    p1, p2 = _model("a/"), _model("b/")
    s1, s2 = opt.init(p1, fused=True), opt.init(p2, fused=True)
    p1, s1 = jax.jit(opt.update)(_grads(0, p1), p1, s1)
    p2, s2 = opt.apply_gradients(_grads(0, p2), p2, s2)
    assert s1.fused
    for a, b in zip(_values(p1, s1), _values(p2, s2), strict=True):
        # One program each, compiled by XLA:CPU's two emitters (apply_gradients takes the older for a fused
        # state, the test below): the module docstring's bound, one step.
        assert _ulps_of_largest(a, b) <= 1, (a, b)


def test_a_fused_state_on_cpu_steps_through_the_jit_with_xlas_older_emitters(monkeypatch):
    # XLA:CPU's fusion emitters compile each param's slice of a packed buffer as a kernel of its own (distinct
    # offsets): 13 s for 1,000 slices, its older emitters 3 s. An unfused step (1,000 alike kernels, which the new
    # emitters share) is the other way round. benchmarks/optimizers.py --first-step times both.
    used = []
    for name in ("_jitted_sliced", "_jitted_update"):
        real = getattr(_step, name)
        monkeypatch.setattr(_step, name, lambda *args, real=real, name=name: used.append(name) or real(*args))
    opt = Adam(0.1)
    for fused in (True, False):
        params = _model(f"{fused}/")
        opt.apply_gradients(_grads(0, params), params, opt.init(params, fused=fused))
    # Packed params (varstate.pack) step whole buffers, sliced nowhere: the default emitters, 2x-3x faster there.
    packed = pack(_model("packed/"))
    opt.apply_gradients(jax.tree.map(jnp.ones_like, packed), packed, opt.init(packed))
    assert used == ["_jitted_sliced", "_jitted_update", "_jitted_update"]


def test_slots_are_per_variable_views_named_and_linked():
    w = Variable(jnp.ones((2, 2)), name="dense/kernel")
    b = Variable(jnp.zeros(2), name="dense/bias")
    state = Momentum(0.1, 0.9).init({"w": w, "b": b}, fused=True)
    slot = state.get_slot(w, "momentum")
    assert slot.name == "dense/kernel/momentum" and slot.handle.slot_of == w.resource_id and slot.shape == (2, 2)
    assert state.slots["momentum"]["b"].name == "dense/bias/momentum"
    assert state.get_slot(Variable(0.0), "momentum") is None and state.get_slot(w, "m") is None
    # The layout is the buffer; the tree holds no per-slot arrays (two buffers' worth would defeat packing).
    assert [x.shape for x in jax.tree.leaves(state)] == [(6,)]
    assert "packed={'momentum': [(6,)]}" in repr(state)
    with pytest.raises(AttributeError, match=r"OptimizerState is immutable: use state.replace\(packed=...\)"):
        state.packed = {}


def test_what_is_not_packed_keeps_its_own_slot():
    mesh = jax.sharding.Mesh(np.array(jax.devices()), ("x",))

    def on_mesh(x, spec=None):
        return jax.device_put(x, jax.sharding.NamedSharding(mesh, spec or jax.sharding.PartitionSpec()))

    sharded = Variable(on_mesh(jnp.ones((16, 2)), jax.sharding.PartitionSpec("x", None)), name="sharded")
    params = {
        "small": Variable(on_mesh(jnp.ones(3)), name="small"),  # replicated: packed, its buffer replicated too
        "big": Variable(on_mesh(jnp.ones(FUSE_MAX_SIZE + 1)), name="big"),
        "sharded": sharded,
        "count": Variable(on_mesh(jnp.int32(0)), name="count"),  # integer: no gradient, and nothing to pack
        "frozen": Variable(on_mesh(jnp.ones(3)), name="frozen", trainable=False),
    }
    opt = Adagrad(0.1)
    state = opt.init(params, fused=True)
    assert [b.shape for b in state.packed["accumulator"]] == [(3,)]
    assert state.packed["accumulator"][0].sharding.is_fully_replicated
    stored = state._stored["accumulator"]
    assert {s.name for s in stored.loose if isinstance(s, Variable)} == {"big/accumulator", "sharded/accumulator",
                                                                       "count/accumulator"}
    grads = {"small": on_mesh(jnp.ones(3)), "big": on_mesh(jnp.ones(FUSE_MAX_SIZE + 1)),
             "sharded": on_mesh(jnp.ones((16, 2))), "count": None, "frozen": None}
    params, state = opt.apply_gradients(grads, params, state)
    assert params["sharded"].sharding.is_equivalent_to(sharded.sharding, 2)
    assert state.get_slot(params["sharded"], "accumulator").sharding.is_equivalent_to(sharded.sharding, 2)
    assert state.packed["accumulator"][0].sharding.is_fully_replicated
    np.testing.assert_array_equal(np.asarray(state.get_slot(params["small"], "accumulator").value),
                                  np.full(3, 1.1, np.float32))


def test_buffers_are_placed_as_the_unfused_slots_and_replace_keeps_the_placement():
    for value in (jax.device_put(jnp.ones(3), jax.devices()[3]), jnp.ones(3)):
        params = {"a": Variable(value, name="a")}
        slot = Adam(0.1).init(params).get_slot(params["a"], "m").value
        state = Adam(0.1).init(params, fused=True)
        for buffer in state.packed["m"] + state.packed["v"]:
            assert (buffer.devices(), buffer.committed) == (slot.devices(), slot.committed)
        twos = {"a": jnp.full(3, 2.0)}  # uncommitted, on the default device: packed where the buffer is
        replaced = state.replace(slots={"m": twos, "v": twos}).packed["m"][0]
        assert (replaced.devices(), replaced.committed) == (slot.devices(), slot.committed)
        np.testing.assert_array_equal(np.asarray(replaced), np.full(3, 2.0, np.float32))


def test_checkpoints_of_fused_and_unfused_states_are_the_same_and_restore_into_each_other(tmp_path):
    opt = Adam(0.1)
    saved = {}
    for fused in (False, True):
        params = _model(f"{fused}/")
        state = opt.init(params, fused=fused)
        params, state = opt.apply_gradients(_grads(0, params), params, state)
        path = checkpoint.Checkpoint(model=params, opt=state).write(str(tmp_path / f"fused_{fused}"))
        reader = checkpoint.read_checkpoint(path)
        saved[fused] = {k: reader.get(k) for k in reader.keys() if "OBJECT_GRAPH" not in k}
    assert saved[False].keys() == saved[True].keys()
    assert any(".OPTIMIZER_SLOT/opt/m/" in k for k in saved[True])
    for k, v in saved[False].items():
        np.testing.assert_array_equal(saved[True][k], v, err_msg=k)
    for fused_from in (False, True):
        for fused_into in (False, True):
            params = _model("r/")
            status = checkpoint.Checkpoint(model=params, opt=opt.init(params, fused=fused_into)).restore(
                str(tmp_path / f"fused_{fused_from}"))
            status.assert_consumed()
            assert status.opt.fused == fused_into
            params, state = opt.apply_gradients(_grads(1, status.model), status.model, status.opt)
            ref_params = _model("ref/")
            ref_state = opt.init(ref_params)
            for t in range(2):
                ref_params, ref_state = opt.apply_gradients(_grads(t, ref_params), ref_params, ref_state)
            for a, b in zip(_values(params, state), _values(ref_params, ref_state), strict=True):
                np.testing.assert_array_equal(a, b)


def test_a_fused_state_given_other_params_grows_fused():
    opt = Adam(0.1)
    old = _model("old/")
    state = opt.init(old, fused=True)
    new = _model("new/")  # a re-created model: apply_gradients creates its slots, in the state's layout
    new, state = opt.apply_gradients(_grads(0, new), new, state, reinitialize_slots=True)
    assert state.fused and state.get_slot(new["small"][0], "m").name == "new/s0/m"
    ref = _model("ref/")
    ref, _ = opt.apply_gradients(_grads(0, ref), ref, opt.init(ref))
    np.testing.assert_array_equal(np.asarray(new["small"][0].value), np.asarray(ref["small"][0].value))


def test_replace_packs_given_slots_and_names_what_does_not_fit():
    w = Variable(jnp.zeros(2), name="w")
    opt = Momentum(0.1, 0.9)
    state = opt.init([w], fused=True)
    assert state.replace(non_slots={}).packed is state.packed
    new = state.replace(slots={"momentum": [state.get_slot(w, "momentum").assign(jnp.array([1.0, 2.0]))]})
    assert new.fused and new.packed["momentum"][0].tolist() == [1.0, 2.0]
    with pytest.raises(ValueError, match=r"OptimizerState.replace: slots has no 'momentum', which this fused state "
                                         r"packs; give every packed slot name \(\['momentum'\]\)"):
        state.replace(slots={"m": [None]})
    with pytest.raises(ValueError, match=r"OptimizerState.replace: slots\['momentum'\] does not have the structure "
                                         r"of the params"):
        state.replace(slots={"momentum": {"w": None}})
    with pytest.raises(ValueError, match=r"the 'momentum' slot at PackedSlot\('w/momentum', group=0, offset=0, "
                                         r"shape=\(2,\)\) must be an array of shape \(2,\), got ArrayImpl \(3,\)"):
        state.replace(slots={"momentum": [jnp.zeros(3)]})


def test_from_optax_refuses_fused_and_names_optax_flatten():
    with pytest.raises(TypeError, match=r"an optax transformation is fused by optax itself: "
                                        r"from_optax\(optax.flatten\(optax.adam\(...\)\)\)"):
        from_optax(optax.adam(0.1)).init([jnp.zeros(2)], fused=True)


def test_optimizer_state_is_still_built_per_variable_by_hand():
    state = OptimizerState(slots={"m": [None]}, non_slots={})
    assert not state.fused and state.slots == {"m": [None]} and state.packed == {}


def test_partitioned_variables_shards_pack_and_save_as_unfused(tmp_path):
    def model():
        return {"emb": list(PartitionedVariable(jnp.arange(12.0).reshape(6, 2), name="emb", num_shards=2)),
                "w": Variable(jnp.ones(3), name="w")}

    opt = Adam(0.1)
    saved = {}
    for fused in (False, True):
        params = model()
        state = opt.init(params, fused=fused)
        grads = {"emb": [jnp.ones((3, 2)), jnp.full((3, 2), 2.0)], "w": jnp.ones(3)}
        params, state = opt.apply_gradients(grads, params, state)
        path = checkpoint.Checkpoint(model=params, opt=state).write(str(tmp_path / f"fused_{fused}"))
        reader = checkpoint.read_checkpoint(path)
        saved[fused] = {k: np.asarray(reader.get(k)) for k in reader.keys() if "OBJECT_GRAPH" not in k}
        fresh = model()
        checkpoint.Checkpoint(model=fresh, opt=opt.init(fresh, fused=fused)).restore(path).assert_consumed()
    assert saved[True].keys() == saved[False].keys()
    assert "model/emb/1/.OPTIMIZER_SLOT/opt/m/.ATTRIBUTES/VARIABLE_VALUE" in saved[True]
    for k, v in saved[False].items():
        np.testing.assert_array_equal(saved[True][k], v, err_msg=k)


@pytest.mark.parametrize("name", ["adam", "rmsprop"])
def test_update_under_a_callers_jit_steps_a_fused_state_through_views_of_its_buffers(name):
    opt = OPTIMIZERS[name]()
    runs = []
    for how in ("apply_gradients", "update"):
        params = _model(f"{how}/")
        state = opt.init(params, fused=True)
        for t in range(2):
            grads, step = _grads(t, params), jnp.asarray(t)
            if how == "update":  # the state's slots are views of its buffers; replace packs the new ones
                params, state = jax.jit(opt.update)(grads, params, state, step)
            else:
                params, state = opt.apply_gradients(grads, params, state, step=step)
        assert state.fused and [b.shape for b in state.packed[state.get_slot_names()[0]]] == [(65,), (8,)]
        runs.append(_values(params, state))
    for a, b in zip(*runs, strict=True):
        assert _ulps_of_largest(a, b) <= 2, (name, a, b)  # the bound of the test above, for 2 steps
