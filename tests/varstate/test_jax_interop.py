"""Variables wherever JAX takes an array: `__jax_array__` (jnp, jax.nn), lax primitives, `.numpy()`.

The reference for every result is the same function applied to the variable's value (or its cast value
inside `autocast`), eagerly, under jit with the variable as an argument, and under grad.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import varstate
from varstate import AutoCastVariable, Variable

X = jnp.array([0.5, -1.0, 2.0])
V0 = jnp.array([1.0, -2.0, 3.0])

FUNCTIONS = {
    "sum": jnp.sum,
    "dot": lambda a: jnp.dot(X, a),
    "relu": lambda a: jnp.sum(jax.nn.relu(a)),
    "softmax": lambda a: jnp.sum(jax.nn.softmax(a) * X),
    "gelu": lambda a: jnp.sum(jax.nn.gelu(a)),
    "where": lambda a: jnp.sum(jnp.where(a > 0, a, 0.0)),
    "stack": lambda a: jnp.sum(jnp.stack([a, a]) * X),
    "einsum": lambda a: jnp.einsum("i,i->", a, X),
    "lax.add": lambda a: jnp.sum(jax.lax.add(a, X)),
    "lax.mul": lambda a: jnp.sum(jax.lax.mul(a, a)),
}


@pytest.mark.parametrize("name", sorted(FUNCTIONS))
def test_functions_take_a_variable_eagerly_under_jit_and_grad(name, reg):
    f = FUNCTIONS[name]
    v = Variable(V0, name="v", registry=reg)
    np.testing.assert_array_equal(f(v), f(V0))

    seen = []

    def traced(v):
        seen.append(type(v))  # a jit argument is flattened, then rebuilt as a Variable around a tracer
        return f(v)

    np.testing.assert_array_equal(jax.jit(traced)(v), jax.jit(f)(V0))
    assert seen == [Variable]

    g = jax.grad(f)(v)
    assert isinstance(g, Variable) and g.resource_id == v.resource_id
    np.testing.assert_array_equal(g.value, jax.grad(f)(V0))
    g_jit = jax.jit(jax.grad(f))(v)
    np.testing.assert_array_equal(g_jit.value, jax.jit(jax.grad(f))(V0))


def test_relu_gradient_matches_its_closed_form(reg):
    # relu's custom JVP hands the tangent (a Variable: it has the primal's structure) to lax.select.
    v = Variable(jnp.array([1.0, -2.0, 0.0, 3.0]), name="v", registry=reg)
    g = jax.grad(lambda v: jnp.sum(jax.nn.relu(v) * jnp.arange(1.0, 5.0)))(v)
    assert g.value.tolist() == [1.0, 0.0, 0.0, 4.0]


def test_vmap_and_list_of_variables(reg):
    m = Variable(jnp.arange(6.0).reshape(2, 3), name="m", registry=reg)
    assert jax.vmap(jnp.sum)(m).tolist() == [3.0, 12.0]
    a, b = Variable(jnp.ones(2), registry=reg), Variable(jnp.zeros(2), registry=reg)
    assert jnp.array([a, b]).tolist() == [[1.0, 1.0], [0.0, 0.0]]
    assert jnp.concatenate([a, b]).tolist() == [1.0, 1.0, 0.0, 0.0]


def test_conversions_and_tree_functions_unchanged(reg):
    v = Variable(V0, name="v", registry=reg)
    out = jnp.asarray(v)
    assert isinstance(out, jax.Array) and out.tolist() == V0.tolist()
    assert np.asarray(v).tolist() == V0.tolist() and np.asarray(v, np.float64).dtype == np.float64
    # Pytree functions still see the value as the one leaf, not a converted array.
    assert jax.tree.leaves(v)[0] is v.value
    mapped = jax.tree.map(lambda x: x * 2, {"v": v})["v"]
    assert isinstance(mapped, Variable) and mapped.resource_id == v.resource_id and mapped.value.tolist() == [
        2.0, -4.0, 6.0]
    assert jnp.ndim(v) == 1 and jnp.shape(v) == (3,)


def test_autocast_variable_gives_the_cast_value(reg):
    a = AutoCastVariable(Variable(V0, name="a", registry=reg))
    assert jnp.sum(a).dtype == jnp.float32
    with varstate.autocast(jnp.bfloat16):
        out = jnp.dot(X.astype(jnp.bfloat16), a)
        assert out.dtype == jnp.bfloat16 and out == jnp.dot(X.astype(jnp.bfloat16), V0.astype(jnp.bfloat16))
        assert jax.lax.add(a, jnp.ones(3, jnp.bfloat16)).dtype == jnp.bfloat16
        assert a.numpy().dtype == jnp.bfloat16

    def loss(a):
        with varstate.autocast(jnp.bfloat16):
            y = jax.nn.relu(a)
            assert y.dtype == jnp.bfloat16
            return jnp.sum(y.astype(jnp.float32) * X)

    for fn in (jax.grad(loss), jax.jit(jax.grad(loss))):
        g = fn(a)
        assert isinstance(g, AutoCastVariable)
        inner = g.__varstate_variable__()
        assert inner.value.dtype == jnp.float32 and inner.value.tolist() == [0.5, 0.0, 2.0]


def test_numpy(reg):
    v = Variable(V0, name="v", registry=reg)
    out = v.numpy()
    assert isinstance(out, np.ndarray) and out.dtype == np.float32 and out.tolist() == V0.tolist()
    with pytest.raises(TypeError, match=r"Variable 'v'\.numpy\(\) inside a JAX transformation .* call \.numpy\(\) on"):
        jax.jit(lambda v: v.numpy())(v)


def test_uninitialized_and_donated_variables_say_so(reg):
    # Conversions (jnp.asarray, lax primitives, .numpy()) read the variable: varstate's messages.
    u = varstate.uninitialized((2,), jnp.float32, name="u", registry=reg)
    for convert in (jnp.asarray, jax.lax.neg, lambda v: v.numpy()):
        with pytest.raises(ValueError, match=r"Variable 'u' is uninitialized .* initialize it with"):
            convert(u)
    w = Variable(jnp.ones(2), name="w", registry=reg)
    opt = varstate.optimizers.GradientDescent(0.1)
    opt.apply_gradients([jnp.ones(2)], [w], opt.init([w]))
    for convert in (jnp.asarray, jax.lax.neg, lambda v: v.numpy()):
        with pytest.raises(varstate.DonatedVariableError, match="Variable 'w': this version's buffer was donated"):
            convert(w)
    # jnp functions that are jitted themselves (sum, dot, exp...) flatten the variable at their boundary, as
    # any pytree argument: JAX reports the value it finds there, naming it `.value`.
    with pytest.raises(TypeError, match=r"'a\.value' .*ShapeDtypeStruct'> is not a valid JAX type"):
        jnp.sum(u)
    with pytest.raises(RuntimeError, match="Array has been deleted"):
        jnp.sum(w)
