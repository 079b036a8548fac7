"""Sharding does not drift: apply_gradients returns every param, and its slots, on the param's sharding.

Reference: TF applies an update on the variable's device, whatever the
gradient's; a variable's slots are colocated with it. Before, XLA propagated
a mix of the param's and the gradient's shardings into the outputs (a param
at P(None, 'model') with a gradient at P('data', None) came back at
P('data', 'model')), and the donated buffers could not be reused (JAX warns,
which pytest here turns into an error).
"""

import os
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import varstate
from varstate import IndexedSlices, Variable
from varstate.optimizers import Adam, Momentum

sys.path.insert(0, os.path.dirname(__file__))
from optimizer_cases import pick

OPTIMIZERS = pick("gd", "momentum", "adam", "lazy_adam", "adagrad", "rmsprop", "optax_adam", "loss_scale_adam")
AXES = {"auto": (AxisType.Auto, AxisType.Auto), "explicit": (AxisType.Explicit, AxisType.Explicit)}


def _mesh(axes):
    return jax.make_mesh((2, 4), ("data", "model"), axis_types=AXES[axes])


def _slots(state):
    return [s for s in jax.tree.leaves(state.slots, is_leaf=lambda x: isinstance(x, Variable))]


@pytest.mark.parametrize("axes", sorted(AXES))
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_params_and_slots_keep_the_params_sharding_whatever_the_gradients(name, axes, compiles):
    mesh = _mesh(axes)
    at = NamedSharding(mesh, P(None, "model"))
    opt = OPTIMIZERS[name]()
    params = {"w": Variable(jax.device_put(jnp.ones((8, 8)), at), name="w"),
              "emb": Variable(jax.device_put(jnp.ones((8, 8)), at), name="emb")}
    state = opt.init(params)
    grads = {"w": jax.device_put(jnp.full((8, 8), 0.5), NamedSharding(mesh, P("data", None))),
             "emb": IndexedSlices(jnp.ones((2, 8)), jnp.array([1, 6]), (8, 8))}
    on_one = {k: Variable(jnp.ones((8, 8))) for k in params}
    reference = opt.apply_gradients({"w": jnp.full((8, 8), 0.5), "emb": grads["emb"]}, on_one, opt.init(on_one))[0]
    for step in range(3):
        params, state = opt.apply_gradients(grads, params, state)
        if step == 0:
            compiled = compiles("_flat_step")
            for k in params:  # the same numbers as on one device
                np.testing.assert_allclose(params[k].value, reference[k].value, rtol=1e-6)
    assert compiles("_flat_step") == compiled  # no recompile after the first step
    for k, v in params.items():
        assert v.sharding.is_equivalent_to(at, 2) and v.sharding.mesh == mesh, (k, v.sharding)
    for s in _slots(state):
        assert s.sharding.is_equivalent_to(at, 2), (s.name, s.sharding)
    for v in state.non_slots.values():  # scalars stay replicated over the mesh
        assert v.sharding.is_fully_replicated, (v.name, v.sharding)


def test_a_param_resharded_between_steps_keeps_its_new_sharding():
    mesh = _mesh("auto")
    opt = Adam(0.1)
    w = Variable(jax.device_put(jnp.ones((8, 8)), NamedSharding(mesh, P(None, "model"))), name="w")
    grad = jax.device_put(jnp.ones((8, 8)), NamedSharding(mesh, P("data", None)))
    (w,), state = opt.apply_gradients([grad], [w], opt.init([w]))
    # With Auto axes jit reuses the trace across input shardings: the placement must follow the inputs.
    moved = jax.device_put(w, NamedSharding(mesh, P("model", None)))
    slots = jax.device_put(state.slots, NamedSharding(mesh, P("model", None)))
    state = type(state)(slots=slots, non_slots=state.non_slots)
    (w,), state = opt.apply_gradients([grad], [moved], state)
    now = NamedSharding(mesh, P("model", None))
    assert w.sharding.is_equivalent_to(now, 2) and all(s.sharding.is_equivalent_to(now, 2) for s in _slots(state))


def test_slots_follow_their_param_when_a_restored_state_lies_elsewhere():
    mesh = _mesh("auto")
    opt = Momentum(0.1, 0.9)
    w = Variable(jax.device_put(jnp.ones((8, 8)), NamedSharding(mesh, P(None, "model"))), name="w")
    state = opt.init([w])
    elsewhere = jax.device_put(state.slots, NamedSharding(mesh, P("data", None)))
    state = type(state)(slots=elsewhere, non_slots=state.non_slots)
    (w,), state = opt.apply_gradients([jnp.ones((8, 8))], [w], state)
    # Colocated with the primary, as TF's slots.
    assert state.get_slot(w, "momentum").sharding.is_equivalent_to(NamedSharding(mesh, P(None, "model")), 2)


def test_inputs_on_different_devices_are_named_and_a_state_per_device_steps_them():
    d = jax.devices()
    a = Variable(jax.device_put(jnp.ones(4), d[1]), name="a")
    b = Variable(jax.device_put(jnp.ones(4), d[2]), name="b")
    opt = Adam(0.1)
    fix = ("One step runs as one XLA program on one set of devices (TF would run each variable's update on its own "
           "device): put every param and gradient on the same devices")
    with pytest.raises(ValueError, match=r"^apply_gradients: Variable 'a' \(params\['a'\]\) is on cpu:1 but "
                       r"Variable 'b' \(params\['b'\]\) is on cpu:2\. " + re.escape(fix)):
        opt.apply_gradients({"a": jnp.ones(4), "b": jnp.ones(4)}, {"a": a, "b": b}, opt.init({"a": a, "b": b}))
    mesh = jax.make_mesh((4,), ("x",), devices=d[:4], axis_types=(AxisType.Auto,))
    c = Variable(jax.device_put(jnp.ones(8), NamedSharding(mesh, P("x"))), name="c")
    with pytest.raises(ValueError, match=r"Variable 'a' \(params\[0\]\) is on cpu:1 but Variable 'c' "
                       r"\(params\[1\]\) is on devices \[0, 1, 2, 3\]\. "):
        opt.apply_gradients([jnp.ones(4), jnp.ones(8)], [a, c], opt.init([a, c]))
    with pytest.raises(ValueError, match=r"Variable 'a' \(params\[0\]\) is on cpu:1 but grads\[0\] is on cpu:2\. "):
        opt.apply_gradients([jax.device_put(jnp.ones(4), d[2])], [a], opt.init([a]))
    # The fix the message gives: a state per device, each step on its own device, as TF's per-variable updates.
    (a2,), _ = opt.apply_gradients([jnp.ones(4)], [a], opt.init([a]))
    (b2,), _ = opt.apply_gradients([jnp.ones(4)], [b], opt.init([b]))
    assert a2.sharding.device_set == {d[1]} and b2.sharding.device_set == {d[2]}
    np.testing.assert_allclose(np.asarray(a2.value), np.asarray(b2.value))
    np.testing.assert_allclose(np.asarray(a2.value), 1 - 0.1, rtol=1e-6)  # Adam's first step: lr * sign(g)


@pytest.mark.parametrize("where", ["device 1", "mesh"])
def test_a_global_step_made_on_device_0_joins_params_placed_elsewhere_with_one_compile(where, compiles):
    # TF runs the increment on the global step's own device; here it joins the step's devices once (replicated
    # over a mesh), as jit's outputs are placed, so step 2 runs the same executable as step 1.
    if where == "mesh":
        mesh = jax.make_mesh((4,), ("x",), devices=jax.devices()[4:], axis_types=(AxisType.Explicit,))
        value, want = jax.device_put(jnp.ones(8), NamedSharding(mesh, P("x"))), NamedSharding(mesh, P())
    else:
        value = jax.device_put(jnp.ones(8), jax.devices()[1])
        want = jax.sharding.SingleDeviceSharding(jax.devices()[1])
    w = Variable(value, name="w")
    global_step = varstate.get_or_create_global_step()
    assert not global_step.value.committed and global_step.value.sharding.device_set == {jax.devices()[0]}
    opt = Adam(0.1)
    params, state = [w], opt.init([w])
    compiled = compiles("_flat_step")
    for _ in range(3):
        params, state, global_step = opt.apply_gradients([jnp.ones(8)], params, state, global_step=global_step)
    assert compiles("_flat_step") == compiled + 1
    assert int(global_step.value) == 3 and global_step.value.sharding == want
    assert params[0].value.sharding == value.sharding
