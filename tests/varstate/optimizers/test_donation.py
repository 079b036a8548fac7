"""Donation traps: a Variable copies its initial value (as tf.Variable does), and a donated version says so.

`apply_gradients` donates params and state. Before, `Variable(x)` held the
caller's own buffer, so the first step deleted `x` (and the arrays inside an
nnx Module whose state was wrapped); and reading an old version raised JAX's
anonymous "Array has been deleted" from deep inside.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import varstate
from varstate import DonatedVariableError, Variable
from varstate.optimizers import Adam, GradientDescent


def _step(params):
    opt = GradientDescent(0.5)
    grads = jax.tree.map(lambda v: jnp.ones(v.shape, v.dtype), params, is_leaf=lambda x: isinstance(x, Variable))
    return opt.apply_gradients(grads, params, opt.init(params))


def _mesh_sharded(x):
    mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(2, 4), ("data", "model"))
    return jax.device_put(x, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(None, "model")))


@pytest.mark.parametrize("make", [lambda: jnp.arange(8.0).reshape(2, 4),
                                  lambda: jax.device_put(jnp.arange(8.0).reshape(2, 4), jax.devices()[3]),
                                  lambda: _mesh_sharded(jnp.arange(8.0).reshape(2, 4))],
                         ids=["uncommitted", "committed", "sharded"])
def test_a_variable_copies_its_initial_value_so_a_step_never_deletes_the_callers_array(make):
    x = make()
    v = Variable(x, name="w")
    assert v.sharding == x.sharding and v.value.committed == x.committed  # same placement, another buffer
    def pointer(a):
        return a.addressable_shards[0].data.unsafe_buffer_pointer()

    assert pointer(v.value) != pointer(x)
    (new,), _ = _step([v])
    assert not x.is_deleted()
    np.testing.assert_array_equal(x, np.arange(8.0).reshape(2, 4))
    np.testing.assert_array_equal(new.value, np.arange(8.0).reshape(2, 4) - 0.5)


def test_the_copy_compiles_nothing_whatever_the_shape_and_dtype(compiles):
    # A copy made by a jitted program costs a compile per shape and dtype (about 40 ms each on CPU).
    xs = [jnp.ones((n, 17), dtype) for n in (13, 19) for dtype in (jnp.float32, jnp.bfloat16, jnp.int32)]
    before = compiles()
    vs = [Variable(x, name=f"w{i}") for i, x in enumerate(xs)]
    assert compiles() == before
    for v, x in zip(vs, xs, strict=True):
        assert v.dtype == x.dtype and v.shape == x.shape and np.array_equal(v.value, x)


def test_variable_of_a_variable_and_assign_copy_too():
    a = Variable(jnp.ones(3), name="a")
    b = Variable(a, name="b")  # tf.Variable(other_variable) copies its value
    x = jnp.full(3, 2.0)
    c = Variable(jnp.zeros(3), name="c").assign(x)  # assign copies into the variable, as TF's
    (b2, c2), _ = _step([b, c])
    assert not a.value.is_deleted() and not x.is_deleted()
    np.testing.assert_array_equal(a.value, np.ones(3))
    np.testing.assert_array_equal(b2.value, np.full(3, 0.5))
    np.testing.assert_array_equal(c2.value, np.full(3, 1.5))


def test_an_nnx_modules_arrays_survive_a_step_over_variables_made_from_its_state():
    model = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
    # What a user of nnx does by hand (or varstate.nnx.from_nnx): a Variable around each array of the Module.
    params = {"/".join(map(str, path)): Variable(var.get_value())
              for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param))}
    kernel = np.asarray(model.kernel[...])
    new, _ = _step(params)
    np.testing.assert_array_equal(model.kernel[...], kernel)  # the Module's own arrays were not donated
    assert model(jnp.ones((1, 2))).shape == (1, 3)
    np.testing.assert_array_equal(new["kernel"].value, kernel - 0.5)


def test_a_donated_version_raises_a_varstate_error_naming_it_and_the_fix(capfd):
    w = Variable(jnp.ones(2), name="w")
    opt = Adam(0.1)
    state = opt.init([w])
    (new,), new_state = opt.apply_gradients([jnp.ones(2)], [w], state)
    want = (r"^Variable 'w': this version's buffer was donated to a jitted step and deleted \(Optimizer\."
            r"apply_gradients donates the params and state it is given, as does any jax\.jit with donate_argnums\)\. "
            r"Use the params and state that apply_gradients returned: `params, state = opt\.apply_gradients\(grads, "
            r"params, state\)`\.$")
    uses = {
        "value": lambda: w.value, "read_value": w.read_value, "operator": lambda: w + 1,
        "reflected operator": lambda: 1 - w, "np.asarray": lambda: np.asarray(w), "indexing": lambda: w[0],
        "astype": lambda: w.astype(jnp.int32), "assign_add": lambda: w.assign_add(jnp.ones(2)),
        "Variable(v)": lambda: Variable(w),
    }
    for what, use in uses.items():
        with pytest.raises(DonatedVariableError, match=want):
            use()
        assert what
    assert issubclass(DonatedVariableError, RuntimeError)
    assert repr(w) == "<varstate.Variable 'w' shape=(2,) dtype=float32 (donated: use the version apply_gradients " \
                      "returned)>"
    assert "donated" in repr(state.get_slot(w, "m")) and "donated" not in repr(new)
    # The old params and state given to the step again: the error names the variable and where it is.
    with pytest.raises(DonatedVariableError, match=r"^Variable 'w' \(params\[0\]\): this version's buffer was "
                                                   r"donated"):
        opt.apply_gradients([jnp.ones(2)], [w], new_state)
    with pytest.raises(DonatedVariableError, match=r"^Variable 'w/m' \(state\.slots\['m'\]\[0\]\): this version's"):
        opt.apply_gradients([jnp.ones(2)], [new], state)
    assert capfd.readouterr().err == ""  # named before XLA ran the step (it logs a line of its own about the buffer)
    # The versions it returned work, and so does the caller's state after the error.
    (newer,), _ = opt.apply_gradients([jnp.ones(2)], [new], new_state)
    assert newer.value.shape == (2,)


def test_the_error_is_public_with_its_example():
    assert "DonatedVariableError" in varstate.__all__ and varstate.DonatedVariableError is DonatedVariableError
    assert ">>>" in DonatedVariableError.__doc__
