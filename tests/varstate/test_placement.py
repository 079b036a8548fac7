"""Sharding does not drift: apply_gradients returns every param, and its slots, on the param's sharding.

Reference: TF applies an update on the variable's device, whatever the
gradient's; a variable's slots are colocated with it. Before, XLA propagated
a mix of the param's and the gradient's shardings into the outputs (a param
at P(None, 'model') with a gradient at P('data', None) came back at
P('data', 'model')), and the donated buffers could not be reused (JAX warns,
which pytest here turns into an error).
"""

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from varstate import IndexedSlices, Variable
from varstate.optimizers import Adam, Momentum
from varstate.optimizers._step import _jitted_update

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
def test_params_and_slots_keep_the_params_sharding_whatever_the_gradients(name, axes):
    mesh = _mesh(axes)
    at = NamedSharding(mesh, P(None, "model"))
    opt = OPTIMIZERS[name]()
    params = {"w": Variable(jax.device_put(jnp.ones((8, 8)), at), name="w"),
              "emb": Variable(jax.device_put(jnp.ones((8, 8)), at), name="emb")}
    state = opt.init(params)
    grads = {"w": jax.device_put(jnp.full((8, 8), 0.5), NamedSharding(mesh, P("data", None))),
             "emb": IndexedSlices(jnp.ones((2, 8)), jnp.array([1, 6]), (8, 8))}
    reference = opt.apply_gradients(
        {"w": jnp.full((8, 8), 0.5), "emb": grads["emb"]},
        {k: Variable(jnp.ones((8, 8))) for k in params}, opt.init({k: Variable(jnp.ones((8, 8))) for k in params}),
    )[0]
    for step in range(3):
        params, state = opt.apply_gradients(grads, params, state)
        if step == 0:
            compiled = _jitted_update._cache_size()
            for k in params:  # the same numbers as on one device
                np.testing.assert_allclose(params[k].value, reference[k].value, rtol=1e-6)
    assert _jitted_update._cache_size() == compiled  # no recompile after the first step
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
