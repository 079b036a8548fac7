"""The plain training loop compiles the step once: steps 2 to 5 compile nothing (issue 25, "one compile").

Reference: jit's cache is keyed by each input's placement, committed or not
(an array made outside jit, `jnp.ones`, is uncommitted; jit's outputs are
committed as soon as one input is). optax's loop over arrays made outside jit
compiles its step and the user's gradient function once. Before, the first
step's state was committed (slots made on the param's device) while the
params were not, so its outputs came back committed: the second step, and
the caller's jitted gradient function given the new params, compiled again.
Each loop below counts the programs jax lowers (its public monitoring
events), by function name, from the second step on.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import varstate
from varstate import Variable
from varstate.nnx import from_nnx
from varstate.optimizers import Adam, Momentum


def _loss(values):
    return sum(jnp.sum(jnp.tanh(v) * 2.0) for v in jax.tree.leaves(values))


def _loop(compiles, opt, params, grads_of, names, *, state=None, global_step=None, steps=5):
    """Runs `steps` steps; returns the names of the functions (of `names`) compiled after the first step."""
    state = opt.init(params) if state is None else state
    after = []
    for t in range(steps):
        before = list(compiles.names)
        grads = grads_of(params, t)
        if global_step is None:
            params, state = opt.apply_gradients(grads, params, state)
        else:
            params, state, global_step = opt.apply_gradients(grads, params, state, global_step=global_step)
        if t:
            after += [n for n in compiles.names[len(before):] if n in {f"jit({x})" for x in names}]
    return after, params, state


def _vars(n, shape, prefix, place=None):
    registry = varstate.Registry()
    values = [jnp.full(shape, float(i + 1)) for i in range(n)]
    if place is not None:
        values = jax.device_put(values, place)
    return [Variable(v, name=f"{prefix}{i}", registry=registry) for i, v in enumerate(values)]


def _dict(n, shape, prefix, place=None):
    return {f"p{i}": v for i, v in enumerate(_vars(n, shape, prefix, place))}


@pytest.mark.parametrize("container", ["dict", "list"])
def test_grads_from_a_jitted_grad_of_the_values(container, compiles):
    def grads_of_values(values):
        return jax.grad(_loss)(values)

    jitted = jax.jit(grads_of_values)
    shape = (3, 5) if container == "dict" else (5, 3)  # shapes of their own: jit caches of other tests miss
    params = _dict(3, shape, "d") if container == "dict" else _vars(3, shape, "l")
    after, params, _ = _loop(compiles, Adam(0.1), params, lambda p, t: jitted(varstate.values(p)),
                             ["_flat_step", "grads_of_values"])
    assert after == []
    assert all(not v.value.committed for v in jax.tree.leaves(params, is_leaf=lambda x: isinstance(x, Variable)))


def test_the_readme_loop_a_jitted_grad_of_the_variables(compiles):
    @jax.jit
    def grads(model):
        return jax.grad(lambda m: jnp.mean((jnp.ones((4, 3)) @ m["w"].value + m["b"].value) ** 2))(model)

    model = {"w": Variable(jnp.zeros(3), name="w"), "b": Variable(jnp.zeros(()), name="b")}
    after, _, _ = _loop(compiles, Adam(0.1), model, lambda p, t: grads(p), ["_flat_step", "grads"])
    assert after == []


def test_grads_from_a_jitted_grad_over_fresh_values_and_a_global_step(compiles):
    def fresh_grads(values):
        return jax.grad(_loss)(values)

    jitted = jax.jit(fresh_grads)
    params = _dict(2, (2, 7), "f")
    gs = varstate.get_or_create_global_step(varstate.Registry())
    after, _, _ = _loop(compiles, Adam(0.1), params, lambda p, t: jitted({k: jnp.full((2, 7), 0.1 * t) for k in p}),
                        ["_flat_step", "fresh_grads"], global_step=gs)
    assert after == []


def test_nnx_params_from_from_nnx(compiles):
    model = nnx.Linear(3, 6, rngs=nnx.Rngs(0))
    graphdef, _ = nnx.split(model)

    @jax.jit
    def nnx_grads(values):
        def loss(v):
            state = nnx.state(model)
            nnx.replace_by_pure_dict(state, v)
            return jnp.mean(nnx.merge(graphdef, state)(jnp.ones((2, 3))) ** 2)

        return jax.grad(loss)(values)

    params = from_nnx(model, registry=varstate.Registry())
    after, _, _ = _loop(compiles, Adam(0.1), params, lambda p, t: nnx_grads(varstate.values(p)),
                        ["_flat_step", "nnx_grads"])
    assert after == []


def test_a_fused_state(compiles):
    def fused_grads(values):
        return jax.grad(_loss)(values)

    jitted = jax.jit(fused_grads)
    params = _dict(3, (4, 3), "u")
    after, _, _ = _loop(compiles, Adam(0.1), params, lambda p, t: jitted(varstate.values(p)),
                        ["_flat_step", "fused_grads"], state=Adam(0.1).init(params, fused=True))
    assert after == []


@pytest.mark.parametrize("what", ["state", "global step"])
def test_uncommitted_params_with_state_committed_to_device_0(what, compiles):
    # A state committed where the params are not (placed by hand, or made by an older init): it joins its params
    # uncommitted once, so the outputs stay uncommitted and nothing compiles again.
    def committed_grads(values):
        return jax.grad(_loss)(values)

    jitted = jax.jit(committed_grads)
    d0 = jax.devices()[0]
    params = _dict(2, (6, 2) if what == "state" else (6, 1), "c")
    opt = Momentum(0.1, 0.9)
    state = opt.init(params)
    gs = None
    if what == "state":
        state = jax.device_put(state, d0)
        assert state.get_slot(params["p0"], "momentum").value.committed
    else:
        gs = Variable(jax.device_put(jnp.zeros((), jnp.int32), d0), name="global_step", trainable=False,
                      registry=varstate.Registry())
    after, params, state = _loop(compiles, opt, params, lambda p, t: jitted(varstate.values(p)),
                                 ["_flat_step", "committed_grads"], state=state, global_step=gs)
    assert after == []
    # The numbers of the same steps with an uncommitted state.
    ref = _dict(2, (6, 2) if what == "state" else (6, 1), "r")
    ref_state = opt.init(ref)
    for _ in range(5):
        ref, ref_state = opt.apply_gradients(jitted(varstate.values(ref)), ref, ref_state)
    got, want = (jax.tree.leaves(varstate.values(x)) for x in ((params, state), (ref, ref_state)))
    for a, b in zip(got, want, strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("made", ["on the mesh", "on device 0"])
def test_params_sharded_over_a_mesh_of_8_devices(made, compiles):
    def mesh_grads(values):
        return jax.grad(_loss)(values)

    jitted = jax.jit(mesh_grads)
    mesh = jax.make_mesh((8,), ("d",), axis_types=(AxisType.Auto,))
    at = NamedSharding(mesh, P("d"))
    params = _dict(3, (8, 3), "m", place=at)
    opt = Adam(0.1)
    state, gs = opt.init(params), varstate.get_or_create_global_step(varstate.Registry())
    if made == "on device 0":  # state and global step made (committed) on device 0, away from the params' mesh
        state = jax.device_put(state, jax.devices()[0])
        gs = jax.device_put(gs, jax.devices()[0])
    after, params, state = _loop(compiles, opt, params, lambda p, t: jitted(varstate.values(p)),
                                 ["_flat_step", "mesh_grads"], state=state, global_step=gs)
    assert after == []
    for name in state.get_slot_names():
        for p in params.values():  # colocated with the primary, as TF's slots
            assert state.get_slot(p, name).sharding.is_equivalent_to(at, 2)
    assert all(v.sharding.is_fully_replicated and v.sharding.mesh == mesh for v in state.non_slots.values())


def test_init_makes_the_state_of_uncommitted_params_uncommitted_and_keeps_a_committed_params_place():
    w = Variable(jnp.ones(2), name="w")
    state = Adam(0.1).init([w])
    assert not state.get_slot(w, "m").value.committed and not state.non_slot("beta1_power").value.committed
    d1 = jax.devices()[1]
    c = Variable(jax.device_put(jnp.ones(2), d1), name="c")
    state = Adam(0.1).init([c])
    for v in (state.get_slot(c, "m"), state.non_slot("beta1_power")):
        assert v.value.committed and v.value.sharding.device_set == {d1}


def test_to_optax_in_a_jitted_train_step_and_in_nnx_optimizer(compiles):
    # An eager tx.init used to return committed slots for uncommitted params: the train step compiled twice.
    tx = Adam(0.1).to_optax()

    @jax.jit
    def optax_train(p, s):
        g = jax.grad(_loss)(p)
        u, s = tx.update(g, s, p)
        return jax.tree.map(jnp.add, p, u), s

    p = {"w": jnp.ones((5, 5))}
    s = tx.init(p)
    model = nnx.Linear(5, 4, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)

    @nnx.jit
    def nnx_train(model, optimizer):
        grads = nnx.grad(lambda m: jnp.mean(m(jnp.ones((2, 5))) ** 2))(model)
        optimizer.update(model, grads)

    for t in range(5):
        before = len(compiles.names)
        p, s = optax_train(p, s)
        nnx_train(model, optimizer)
        if t:
            assert [n for n in compiles.names[before:] if n in ("jit(optax_train)", "jit(nnx_train)")] == []
