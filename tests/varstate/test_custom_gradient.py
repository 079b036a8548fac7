"""custom_gradient: TF parity from fixtures, variables, transformations, TF's checks."""

import builtins
import json
import pathlib
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import varstate
from varstate import _variable

DATA = pathlib.Path(__file__).resolve().parent.parent / "data"  # tests/data
FIX = json.loads((DATA / "tf_custom_gradient.json").read_text())
CASES, ERRORS = FIX["cases"], FIX["errors"]


def close(a, b):
    np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=1e-6, atol=1e-6)


@varstate.custom_gradient
def log1pexp(x):
    e = jnp.exp(x)
    return jnp.log(1 + e), lambda dy: dy * (1 - 1 / (1 + e))


@pytest.mark.parametrize("jit", [False, True])
def test_log1pexp_matches_tf(jit):
    c = CASES["log1pexp"]

    def loss(x):
        y = log1pexp(x)
        return jnp.where(jnp.isfinite(y), y, 0.0).sum(), y

    fn = jax.grad(loss, has_aux=True)
    dx, y = (jax.jit(fn) if jit else fn)(jnp.array(c["x"]))
    close(y, c["y"])
    close(dx, c["dx"])


def test_clip_by_norm_matches_tf():
    c = CASES["clip_by_norm"]

    @varstate.custom_gradient
    def clip_grad(x):
        def grad_fn(dy):
            norm = jnp.sqrt((dy**2).sum())
            return dy * c["clip_norm"] / jnp.maximum(norm, c["clip_norm"])
        return x, grad_fn

    close(jax.grad(lambda x: (c["scale"] * clip_grad(x)).sum())(jnp.array(c["x"])), c["dx"])


def test_two_arguments_two_outputs_match_tf():
    c = CASES["two_outputs"]

    @varstate.custom_gradient
    def two_outputs(x, y):
        return (x * y, x + y), lambda d1, d2: (d1 * y + d2, d1 * x + 2.0 * d2)

    def loss(x, y):
        a, b = two_outputs(x, y)
        return (2.0 * a + 3.0 * b).sum()

    dx, dy = jax.jit(jax.grad(loss, argnums=(0, 1)))(jnp.array(c["x"]), jnp.array(c["y"]))
    close(dx, c["dx"])
    close(dy, c["dy"])


def _variables_loss(seen=None):
    """TF's case 4: f closes over two variables of `params`; the rule for w is not the true one."""
    def loss(params, x):
        w, b = params["w"], params["b"]

        @varstate.custom_gradient
        def uses_variables(x):
            out = (w * x**2).sum() + b

            def grad_fn(dy, variables):
                if seen is not None:
                    seen.append([v.name for v in variables])
                rules = {"w": dy * 3.0 * x, "b": dy * 5.0}
                return dy * 2.0 * x * w.value, [rules[v.name] for v in variables]

            return out, grad_fn

        return 2.0 * uses_variables(x)
    return loss


def _tf_case_params(c):
    reg = varstate.Registry()  # TF's variable names, unsuffixed
    return {"w": varstate.Variable(jnp.array(c["w"]), name="w", registry=reg),
            "b": varstate.Variable(c["b"], name="b", registry=reg)}


@pytest.mark.parametrize("jit", [False, True])
def test_variable_gradients_reach_outer_grad_as_tf(jit):
    c = CASES["variables"]
    params = _tf_case_params(c)
    seen = []
    fn = jax.grad(_variables_loss(seen), argnums=(0, 1))
    g_params, dx = (jax.jit(fn) if jit else fn)(params, jnp.array(c["x"]))
    close(dx, c["dx"])
    close(g_params["w"].value, c["dw"])
    close(g_params["b"].value, c["db"])
    assert g_params["w"].resource_id == params["w"].resource_id
    assert seen and all(names == ["b", "w"] for names in seen)  # sorted by name, as TF's graph mode

    def plain(params, x):  # the undecorated function: its gradient is TF's true gradient
        return 2.0 * ((params["w"].value * x**2).sum() + params["b"].value)

    true = jax.grad(plain)(params, jnp.array(c["x"]))
    close(true["w"].value, c["true_dw"])
    close(true["b"].value, c["true_db"])
    assert not np.allclose(true["w"].value, g_params["w"].value)


def test_variable_gradients_under_vmap_of_grad():
    c = CASES["variables"]
    params = _tf_case_params(c)
    xs = jnp.array([c["x"], [0.5, -1.0, 2.0]])
    per_example = jax.vmap(jax.grad(_variables_loss(), argnums=(0, 1)), in_axes=(None, 0))(params, xs)
    for i in range(2):
        one = jax.grad(_variables_loss(), argnums=(0, 1))(params, xs[i])
        close(per_example[0]["w"].value[i], one[0]["w"].value)
        close(per_example[1][i], one[1])
    close(per_example[0]["w"].value[0], c["dw"])


def test_second_order_differentiates_grad_fn_as_tf():
    c = CASES["second_order"]

    @varstate.custom_gradient
    def cube(x):
        return x**3, lambda dy: dy * (3.0 * x**2 + x)

    d1 = jax.grad(lambda x: cube(x).sum())
    x = jnp.array(c["x"])
    close(d1(x), c["d1"])
    close(jax.grad(lambda x: d1(x).sum())(x), c["d2"])
    close(jax.jit(jax.grad(jax.grad(lambda x: cube(x))))(2.0), c["d2"][1])


def test_none_gradient_is_zero_as_tf():
    c = CASES["none_gradient"]

    @varstate.custom_gradient
    def half_none(x, y):
        return x * y, lambda dy: (None, dy * x)

    dx, dy = jax.grad(lambda x, y: half_none(x, y).sum(), argnums=(0, 1))(jnp.array(c["x"]), jnp.array(c["y"]))
    close(dx, c["dx"])
    close(dy, c["dy"])


def test_value_and_grad_pytree_arguments_and_variable_arguments():
    @varstate.custom_gradient
    def f(tree, v):
        y = tree["a"] * v.value + tree["b"]
        return y, lambda dy: ({"a": dy * 10.0, "b": None}, dy * 7.0)

    v = varstate.Variable(jnp.array([1.0, 2.0]), name="v_arg")
    tree = {"a": jnp.array([3.0, 4.0]), "b": jnp.array([0.5, 0.5])}
    val, (g_tree, g_v) = jax.value_and_grad(lambda t, v: f(t, v).sum(), argnums=(0, 1))(tree, v)
    close(val, 3.0 + 8.0 + 1.0)
    close(g_tree["a"], [10.0, 10.0])
    close(g_tree["b"], [0.0, 0.0])
    assert isinstance(g_v, varstate.Variable) and g_v.resource_id == v.resource_id
    close(g_v.value, [7.0, 7.0])


def test_variable_argument_also_closed_over_is_not_a_variable_of_grad_fn():
    v = varstate.Variable(2.0, name="both")

    def loss(v, x):
        @varstate.custom_gradient
        def f(u):
            return u.value * v.value * x, lambda dy: dy * 100.0  # no `variables`: v is an argument
        return f(v)

    close(jax.grad(loss)(v, 3.0).value, 100.0)


def test_closure_over_a_concrete_variable_behaves_as_plain_jax():
    w = varstate.Variable(4.0, name="module_level_w")

    @varstate.custom_gradient
    def f(x):
        return x * w.value, lambda dy, variables: (dy * variables[0].value, [dy * 1000.0])

    # w is a constant of loss (not its argument): x gets the rule, the variable rule has nowhere to go.
    close(jax.grad(lambda x: f(x))(3.0), 4.0)
    params = {"w": w}
    g = jax.grad(lambda p, x: f(x))(params, 3.0)
    close(g["w"].value, jax.grad(lambda p, x: x * w.value)(params, 3.0)["w"].value)
    close(f(3.0), 12.0)  # no transformation at all


def test_versions_made_inside_f_are_not_replaced():
    w = varstate.Variable(1.0, name="assigned_inside")

    def loss(params, x):
        @varstate.custom_gradient
        def f(x):
            w2 = params["w"].assign_add(1.0)
            return x * w2.value, lambda dy, variables: (dy * w2.value, [dy * x])
        return f(x)

    val, g = jax.value_and_grad(loss, argnums=(0, 1))({"w": w}, 3.0)
    close(val, 6.0)
    close(g[1], 2.0)
    close(g[0]["w"].value, 3.0)


def test_nested_custom_gradients_share_a_variable():
    w = varstate.Variable(3.0, name="nested_w")

    def loss(params, x):
        @varstate.custom_gradient
        def inner(x):
            return x * params["w"].value, lambda dy, variables: (dy * 100.0, [dy * 100.0])

        @varstate.custom_gradient
        def outer(x):
            return inner(x) + params["w"].value, lambda dy, variables: (dy * 2.0, [dy * 7.0])

        return outer(x)

    g_params, dx = jax.jit(jax.grad(loss, argnums=(0, 1)))({"w": w}, 2.0)
    close(g_params["w"].value, 7.0)
    close(dx, 2.0)
    close(loss({"w": w}, 2.0), 9.0)


def test_variable_read_only_by_grad_fn_is_lifted_without_gradient():
    w = varstate.Variable(3.0, name="late_w")

    def loss(params, x):
        @varstate.custom_gradient
        def f(x):
            return x * 2.0, lambda dy: dy * params["w"].value  # no `variables`: f itself reads none (TF's rule)
        return f(x)

    for fn in (jax.grad(loss, argnums=(0, 1)), jax.jit(jax.grad(loss, argnums=(0, 1)))):
        g, dx = fn({"w": w}, 2.0)
        close(dx, 3.0)
        close(g["w"].value, 0.0)


def test_non_trainable_variables_are_lifted_but_not_passed():
    w = varstate.Variable(2.0, name="nt_w")
    stat = varstate.Variable(5.0, name="nt_stat", trainable=False)

    def loss(params, x):
        @varstate.custom_gradient
        def f(x):
            def grad_fn(dy, variables):
                assert [v.name for v in variables] == ["nt_w"]
                return dy * params["stat"].value, [dy]
            return x * params["w"].value * params["stat"].value, grad_fn
        return f(x)

    g, dx = jax.grad(loss, argnums=(0, 1))({"w": w, "stat": stat}, 3.0)
    close(dx, 5.0)
    close(g["w"].value, 1.0)
    close(g["stat"].value, 0.0)


def test_integer_residuals_under_jit_and_grad():
    @varstate.custom_gradient
    def top1(x):
        i = jnp.argmax(x)
        return x[i], lambda dy: jnp.zeros_like(x).at[i].set(dy)

    x = jnp.array([1.0, 5.0, 2.0])
    close(jax.jit(jax.grad(top1))(x), [0.0, 1.0, 0.0])
    close(jax.grad(jax.jit(top1))(x), [0.0, 1.0, 0.0])


def test_decorated_method_binds_self():
    class Layer:
        def __init__(self):
            self.k = 3.0

        @varstate.custom_gradient
        def __call__(self, x):
            return self.k * x, lambda dy: dy * 10.0

    close(jax.grad(Layer())(2.0), 10.0)


def test_hook_is_off_after_calls_and_per_thread():
    w = varstate.Variable(1.0, name="hook_w")

    def loss(p, x):
        @varstate.custom_gradient
        def f(x):
            return x * p["w"].value, lambda dy, variables: (dy, [dy])
        return f(x)

    jax.grad(loss)({"w": w}, 1.0)
    assert _variable._read_hook is None
    results = []
    threads = [threading.Thread(target=lambda: results.append(float(jax.grad(loss)({"w": w}, 2.0)["w"].value)))
               for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [1.0] * 4
    assert _variable._read_hook is None


# --- TF's checks: the exception type TF raised (fixture) and our message ------------------------

def _raises_as_tf(key, match):
    """pytest.raises for the exception type TF raised in the same situation (recorded in the fixture)."""
    return pytest.raises(getattr(builtins, ERRORS[key]["type"]), match=match)


def test_keyword_arguments_refused_as_tf_graph_mode():
    @varstate.custom_gradient
    def takes_kwargs(x, scale=1.0):
        return x * scale, lambda dy: dy * scale

    assert ERRORS["keyword_arguments/graph"]["type"] == "ValueError"
    with _raises_as_tf("keyword_arguments/graph", r"takes_kwargs was called with keyword arguments \['scale'\]"):
        jax.grad(lambda x: takes_kwargs(x, scale=2.0))(3.0)


def test_missing_variables_keyword():
    v = varstate.Variable(2.0, name="needs_kw")

    @varstate.custom_gradient
    def no_variables_kw(x):
        return x * v.value, lambda dy: dy * v.value

    for mode in ("eager", "graph"):
        assert ERRORS[f"missing_variables_keyword/{mode}"]["type"] == "TypeError"
    with _raises_as_tf("missing_variables_keyword/eager",
                       r"grad_fn of no_variables_kw must accept a keyword argument 'variables'.*\['needs_kw'\]"):
        no_variables_kw(3.0)  # raised on the forward call, as TF does


def test_wrong_number_of_variable_gradients():
    v = varstate.Variable(2.0, name="count_me")

    @varstate.custom_gradient
    def too_many(x):
        return x * v.value, lambda dy, variables: (dy * v.value, [dy * x, dy])

    close(too_many(3.0), 6.0)  # as TF: the forward pass runs; differentiating reports the fault
    with _raises_as_tf("wrong_number_of_variable_grads/eager",
                       r"returned 2 variable gradients for 1 variables \['count_me'\]"):
        jax.grad(too_many)(3.0)


def test_wrong_number_of_input_gradients():
    @varstate.custom_gradient
    def too_many_input_grads(x):
        return 2.0 * x, lambda dy: (dy, dy, dy)

    @varstate.custom_gradient
    def too_few(x, y):
        return x * y, lambda dy: dy

    assert ERRORS["wrong_number_of_input_grads/eager"]["type"] == "ValueError"
    with _raises_as_tf("wrong_number_of_input_grads/eager",
                       r"too_many_input_grads has 1 argument\(s\) but its grad_fn returned 3 gradient\(s\)"):
        jax.grad(too_many_input_grads)(3.0)
    with _raises_as_tf("wrong_number_of_input_grads/eager",
                       r"too_few has 2 argument\(s\) but its grad_fn returned 1 gradient\(s\)"):
        jax.grad(too_few)(3.0, 1.0)


def test_variables_in_signature_but_none_read_warns():
    @varstate.custom_gradient
    def f(x):
        return 2.0 * x, lambda dy, variables=None: 2.0 * dy

    with pytest.warns(UserWarning, match=r"grad_fn of f has a 'variables' parameter, but f read no trainable"):
        g = jax.grad(f)(1.0)
    close(g, 2.0)


def test_bad_returns():
    @varstate.custom_gradient
    def not_a_pair(x):
        return x

    @varstate.custom_gradient
    def wrong_shape(x):
        return x.sum(), lambda dy: jnp.ones(5)

    v = varstate.Variable(1.0, name="pair_needed")

    @varstate.custom_gradient
    def not_pair_with_vars(x):
        return x * v.value, lambda dy, variables: dy

    with pytest.raises(TypeError, match=r"not_a_pair must return a pair \(outputs, grad_fn\) with grad_fn "
                                        r"callable, got one array of shape \(\) and dtype float32\."):
        not_a_pair(1.0)
    with pytest.raises(ValueError,
                       match=r"gradient of shape \(5,\) for argument 0 of wrong_shape, which has shape \(3,\)"):
        jax.grad(wrong_shape)(jnp.ones(3))
    with pytest.raises(ValueError, match=r"grad_fn must return a pair \(input_grads, variable_grads\); got one "
                                         r"array of shape \(\) and dtype float32\."):
        jax.grad(not_pair_with_vars)(1.0)


def test_gradient_structures():
    @varstate.custom_gradient
    def wrong_structure(t):
        return t["a"] * 2.0, lambda dy: {"b": dy}

    @varstate.custom_gradient
    def one_tuple(x):
        return 2.0 * x, lambda dy: (3.0 * dy,)

    @varstate.custom_gradient
    def tuple_arg(pair):
        return pair[0] * pair[1], lambda dy: (dy * 10.0, dy * 20.0)  # the gradient of the one tuple argument

    with pytest.raises(ValueError, match=r"argument 0 of wrong_structure has structure .*expected the argument's"):
        jax.grad(wrong_structure)({"a": 1.0})
    close(jax.grad(one_tuple)(1.0), 3.0)
    close(jax.grad(tuple_arg)((1.0, 2.0)), (10.0, 20.0))


def test_vmap_over_the_variables_themselves():
    w = varstate.Variable(jnp.array([1.0, 2.0, 3.0]), name="batched_w")

    def loss(params, x):
        @varstate.custom_gradient
        def f(x):
            return x * params["w"].value, lambda dy, variables: (dy * variables[0].value, [dy * x * 10.0])
        return f(x)

    g, dx = jax.vmap(jax.grad(loss, argnums=(0, 1)), in_axes=(0, None))({"w": w}, 2.0)
    assert g["w"].resource_id == w.resource_id
    close(g["w"].value, [20.0, 20.0, 20.0])
    close(dx, [1.0, 2.0, 3.0])
