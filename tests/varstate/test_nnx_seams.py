"""Where flax nnx meets varstate: nnx objects handed to an optimizer, donation and the Module, `loss_fn`.

References: the gradient `nnx.grad` takes of the Module itself (`loss_fn` must give the same numbers), and
the values the Module held before a step (donation must leave them readable).
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import checkpoint
import varstate
from varstate.nnx import from_nnx, loss_fn, to_nnx
from varstate.optimizers import Adam, GradientDescent, from_optax
from varstate.optimizers import keras as keras_opt


class MLP(nnx.Module):
    def __init__(self, rngs):
        self.layers = nnx.List([nnx.Linear(3, 4, rngs=rngs), nnx.Linear(4, 1, rngs=rngs)])
        self.bn = nnx.BatchNorm(4, use_running_average=True, rngs=rngs)
        self.drop = nnx.Dropout(0.5, rngs=rngs)

    def __call__(self, x):
        return self.layers[1](self.bn(jax.nn.relu(self.layers[0](x))))


X = jnp.linspace(-1.0, 1.0, 15).reshape(5, 3)
Y = jnp.ones((5, 1))


def _mse(m, x=X, y=Y):
    return jnp.mean((m(x) - y) ** 2)


_PARAMS_FIX = ("; varstate's optimizers take pytrees of varstate Variables or arrays, not nnx objects. If it came "
               "from nnx.Optimizer(model, {name}(...)), give nnx.Optimizer the optax form instead: "
               "nnx.Optimizer(model, {name}(...).to_optax(), wrt=nnx.Param). To step the model's parameters with "
               "varstate, make them Variables: `params = varstate.nnx.from_nnx(model)`, then "
               "`varstate.nnx.to_nnx(model, params)` writes them back.")
_GRADS_FIX = ("; varstate's optimizers take pytrees of varstate Variables or arrays, not nnx objects. Take the "
              "gradient with respect to the params' values, which has params' structure: "
              "`grads = jax.grad(varstate.nnx.loss_fn(model, f))(varstate.values(params))` with "
              "`params = varstate.nnx.from_nnx(model)`.")


def _params_error(where, kind, name="Adam"):
    return "^" + re.escape(f"{name}.{where}: params is {kind}" + _PARAMS_FIX.format(name=name)) + "$"


def test_a_varstate_optimizer_given_to_nnx_optimizer_says_to_pass_to_optax():
    model = MLP(nnx.Rngs(0))
    with pytest.raises(TypeError, match=_params_error("init", "an nnx.State")):
        nnx.Optimizer(model, Adam(1e-3), wrt=nnx.Param)
    with pytest.raises(TypeError, match=_params_error("init", "an nnx.State", "SGD")):
        nnx.Optimizer(model, keras_opt.SGD(0.1), wrt=nnx.Param)
    hosted = ("from_optax(tx).init: params is an nnx.State" + _PARAMS_FIX.format(name="X")).replace(
        "X(...).to_optax()", "tx").replace("X(...)", "from_optax(tx)")
    with pytest.raises(TypeError, match="^" + re.escape(hosted) + "$"):
        nnx.Optimizer(model, from_optax(optax.sgd(0.1)), wrt=nnx.Param)
    # The fix the message gives works, and steps the model.
    optimizer = nnx.Optimizer(model, Adam(1e-3).to_optax(), wrt=nnx.Param)
    before = np.asarray(model.layers[0].kernel[...])
    optimizer.update(model, nnx.grad(_mse)(model))
    assert not np.array_equal(before, model.layers[0].kernel[...])


def test_modules_and_states_as_params_or_grads_point_at_from_nnx_and_loss_fn():
    model = MLP(nnx.Rngs(0))
    opt = Adam(0.1)
    params = from_nnx(model, registry=varstate.Registry())
    state = opt.init(params)
    nnx_grads = nnx.grad(_mse)(model)
    grads = jax.grad(loss_fn(model, _mse))(varstate.values(params))
    with pytest.raises(TypeError, match=_params_error("init", "an nnx Module (MLP)")):
        opt.init(model)
    with pytest.raises(TypeError, match=_params_error("init", "an nnx.Linear")):
        opt.init(model.layers[0])
    with pytest.raises(TypeError, match=_params_error("apply_gradients", "an nnx Module (MLP)")):
        opt.apply_gradients(grads, model, state)
    with pytest.raises(TypeError, match=_params_error("update", "an nnx.State")):
        opt.update(grads, nnx.state(model), state)
    grads_error = "^" + re.escape("Adam.apply_gradients: grads is an nnx.State" + _GRADS_FIX) + "$"
    with pytest.raises(TypeError, match=grads_error):
        opt.apply_gradients(nnx_grads, params, state)
    with pytest.raises(TypeError, match=grads_error.replace("apply_gradients", "update")):
        opt.update(nnx_grads, params, state)
    # Nothing was donated by the refused calls: the fix goes through with the same params and state.
    params, state = opt.apply_gradients(grads, params, state)
    assert state.non_slot("beta1_power").value == np.float32(0.9) * np.float32(0.9)  # one step: beta1 ** 2


def _arrays(model):
    return {p: np.array(v.get_value()) for p, v in nnx.to_flat_state(nnx.state(model, nnx.Not(nnx.RngState)))}


def test_donation_never_deletes_the_modules_arrays():
    model = MLP(nnx.Rngs(0))
    opt = GradientDescent(0.5)
    params = from_nnx(model)
    state = opt.init(params)
    before = _arrays(model)
    loss = jax.jit(jax.grad(loss_fn(model, _mse)))
    for _ in range(2):
        params, state = opt.apply_gradients(loss(varstate.values(params)), params, state)
        to_nnx(model, params)  # the Module gets copies: the next step donates params' buffers, not the Module's
    written = _arrays(model)
    grads = loss(varstate.values(params))
    params, state = opt.apply_gradients(grads, params, state)
    for path, value in _arrays(model).items():
        np.testing.assert_array_equal(value, written[path])  # alive, and as to_nnx wrote them
    assert not np.array_equal(written[("layers", 0, "kernel")], before[("layers", 0, "kernel")])
    np.testing.assert_allclose(params["layers"][0]["kernel"].value,  # the step went on from what the Module got
                               written[("layers", 0, "kernel")] - 0.5 * grads["layers"][0]["kernel"], rtol=1e-6)


def test_to_nnx_copies_keep_the_sharding():
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("x",))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(None, "x"))
    model = nnx.Linear(3, 4, rngs=nnx.Rngs(0))
    kernel = varstate.Variable(jax.device_put(jnp.ones((3, 4)), sharding))
    to_nnx(model, {"kernel": kernel})
    assert model.kernel[...].sharding == sharding
    opt = GradientDescent(1.0)
    opt.apply_gradients({"kernel": jnp.ones((3, 4))}, {"kernel": kernel}, opt.init({"kernel": kernel}))
    assert model.kernel[...].tolist() == [[1.0] * 4] * 3  # kernel's buffer was donated; the Module's copy was not


def test_loss_fn_gives_nnx_grads_numbers_in_the_params_structure():
    model = MLP(nnx.Rngs(0))
    params = from_nnx(model, registry=varstate.Registry())
    reference = nnx.to_pure_dict(nnx.grad(_mse)(model))  # nnx's own gradient of the Module
    for f in (jax.grad, lambda g: jax.jit(jax.grad(g))):
        got = f(loss_fn(model, _mse))(varstate.values(params))
        assert jax.tree.structure(got) == jax.tree.structure(varstate.values(params))
        by_path = dict(jax.tree_util.tree_flatten_with_path(got)[0])
        for path, ref in jax.tree_util.tree_flatten_with_path(reference)[0]:
            np.testing.assert_allclose(by_path[path], ref, rtol=1e-6, atol=1e-7)
    # The gradient goes to the step as it is; BatchNorm's statistics (not nnx.Params) have one, but are not stepped.
    mean = np.asarray(params["bn"]["mean"].value)
    opt = GradientDescent(0.1)
    stepped, _ = opt.apply_gradients(got, params, opt.init(params))
    np.testing.assert_array_equal(stepped["bn"]["mean"].value, mean)
    np.testing.assert_allclose(stepped["bn"]["scale"].value, 1 - 0.1 * reference["bn"]["scale"], rtol=1e-6)
    # A subset of the params (the rest from the Module), extra arguments; the Module itself never changes.
    kernel = np.asarray(model.layers[0].kernel[...])
    out = jax.jit(loss_fn(model, lambda m, x: m(x)))({"layers": {0: {"kernel": 2 * kernel}}}, X)
    hidden = jax.nn.relu(X @ (2 * kernel) + model.layers[0].bias[...])
    np.testing.assert_allclose(out, model.layers[1](model.bn(hidden)), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(model.layers[0].kernel[...], kernel)
    # Variables work as well as their values.
    to_nnx(model, stepped)
    assert float(loss_fn(model, _mse)(stepped)) == pytest.approx(float(_mse(model)), rel=1e-6)


def test_loss_fn_errors():
    model = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
    with pytest.raises(TypeError, match=r"^loss_fn: expected an nnx.Module, got dict; for a pytree of Variables, "
                                        r"differentiate a function of varstate.values\(params\) directly\.$"):
        loss_fn({"w": jnp.ones(2)}, _mse)
    loss = loss_fn(model, lambda m: m(jnp.ones((1, 2))).sum())
    with pytest.raises(KeyError, match=r"loss_fn: the Module has no variable at 'kernell'; its paths are "
                                       r"\['bias', 'kernel'\]"):
        loss({"kernell": jnp.ones((2, 3))})
    with pytest.raises(ValueError, match=r"^loss_fn: 'kernel' is float32\[3, 2\], the Module holds float32\[2, 3\]: "
                                         r"params come from another architecture \(from_nnx\(module\) gives this "
                                         r"Module's\)\.$"):
        loss({"kernel": jnp.ones((3, 2))})
    with pytest.raises(ValueError, match=r"^to_nnx: 'bias' is float32\[3\], the Module holds bfloat16\[3\]: cast it "
                                         r"first \(\.astype\(jnp\.bfloat16\)\)\.$"):
        to_nnx(nnx.Linear(2, 3, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0)), {"bias": jnp.ones(3)})


def test_to_nnx_and_loss_fn_say_what_params_must_be(tmp_path):
    model = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
    other = nnx.Linear(2, 3, rngs=nnx.Rngs(1))
    head = r"params must be nested dicts keyed by nnx path, as from_nnx returns; got "
    for verb, call in (("to_nnx", lambda p: to_nnx(model, p)), ("loss_fn", loss_fn(model, lambda m: 0.0))):
        with pytest.raises(TypeError, match=rf"^{verb}: {head}Linear \(a Module\): pass from_nnx\(other\) for "
                                            r"another Module's values\.$"):
            call(other)
        with pytest.raises(TypeError, match=rf"^{verb}: {head}State: pass nnx\.to_pure_dict\(state\), or "
                                            r"from_nnx\(state\)\.$"):
            call(nnx.state(other))
    status = checkpoint.Checkpoint(model=from_nnx(other)).restore(
        checkpoint.Checkpoint(model=from_nnx(other)).write(str(tmp_path / "ckpt")))
    with pytest.raises(TypeError, match=rf"^to_nnx: {head}LoadStatus: a restore returns a LoadStatus holding each "
                                        r"root as an attribute, pass status\.model \(the root's name\)\.$"):
        to_nnx(model, status)
    to_nnx(model, status.model)  # the fix
    np.testing.assert_array_equal(model.kernel[...], other.kernel[...])


class Noisy(nnx.Module):
    def __init__(self, rngs):
        self.lin = nnx.Linear(3, 3, rngs=rngs)
        self.drop = nnx.Dropout(0.5, rngs=rngs)
        self.bn = nnx.BatchNorm(3, rngs=rngs)

    def __call__(self, x, rngs=None):
        return self.bn(self.drop(self.lin(x), rngs=rngs))


def test_loss_fn_refuses_changes_it_would_drop_and_gives_the_fix():
    model = Noisy(nnx.Rngs(0, dropout=1))
    values = varstate.values(from_nnx(model, registry=varstate.Registry()))
    x = jnp.linspace(0.0, 1.0, 6).reshape(2, 3)
    draw = re.escape("loss_fn: f drew random numbers from the Module's RNG stream at 'drop/rngs/count'; "
                     "loss_fn does not carry RNG state from call to call, so every call would draw the same numbers. "
                     "Draw from a key passed in instead, a new one each step: loss_fn(model, lambda m, x, key: "
                     "...m(x, rngs=nnx.Rngs(dropout=key)))(params, x, key) (nnx.Dropout and others take rngs= when "
                     "called); or pass discard_changes=True.")
    stats = re.escape("loss_fn: f changed 'bn/mean' (BatchStat) on the copy of the Module it was given, and the "
                      "change is not kept: loss_fn's function returns only what f returns. For a loss, put the "
                      "Module in eval mode (model.eval(): BatchNorm then uses its running statistics); to keep the "
                      "change, return it from f (jax.grad(..., has_aux=True)), write it into its Variable in params "
                      "(`v.assign(new)` returns the new version) and pass discard_changes=True.")
    for wrap in (lambda g: g, jax.jit, jax.grad):
        with pytest.raises(ValueError, match=f"^{draw}"):
            wrap(loss_fn(model, lambda m, x: m(x).sum()))(values, x)
    model.drop.deterministic = True
    with pytest.raises(ValueError, match=f"^{stats}"):
        jax.jit(loss_fn(model, lambda m, x: m(x).sum()))(values, x)
    # The fixes: eval mode; a key passed in (fresh masks per key, the Module's own streams untouched).
    model.eval()
    assert float(jax.jit(loss_fn(model, lambda m, x: m(x).sum()))(values, x)) == pytest.approx(float(model(x).sum()))
    model.train()
    model.drop.deterministic = False
    count = int(model.drop.rngs.count[...])
    keyed = jax.jit(loss_fn(model, lambda m, x, key: m.drop(m.lin(x), rngs=nnx.Rngs(dropout=key)),
                            discard_changes=True))
    a, b = keyed(values, x, jax.random.key(1)), keyed(values, x, jax.random.key(2))
    assert not np.array_equal(a, b) and np.array_equal(a, keyed(values, x, jax.random.key(1)))
    assert int(model.drop.rngs.count[...]) == count
