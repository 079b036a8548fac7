"""AutoCastVariable and autocast: casting reads, storage dtype, pytree, grad, optimizers, errors."""

import itertools
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import checkpoint
import varstate
from varstate.optimizers import Adam, GradientDescent, Momentum


def _acv(value, name="acv"):
    return varstate.AutoCastVariable(varstate.Variable(jnp.asarray(value, jnp.float32), name=name))


def test_rejects_non_variables_and_non_float_variables():
    with pytest.raises(ValueError, match=r"AutoCastVariable wraps a varstate.Variable, got ArrayImpl"):
        varstate.AutoCastVariable(jnp.ones(2))
    step = varstate.Variable(3, name="int_step")
    with pytest.raises(ValueError, match=r"floating-point variables only, but 'int_step' has dtype int32"):
        varstate.AutoCastVariable(step)


@pytest.mark.parametrize("compute", [jnp.bfloat16, jnp.float16])
def test_reads_cast_inside_the_scope_only(compute):
    a = _acv([1.5, -2.25, 3.0])
    assert a.dtype == jnp.float32 and a.value.dtype == jnp.float32
    with varstate.autocast(compute):
        assert a.dtype == compute and a.true_dtype == jnp.float32
        for read in (a.value, a.read_value(), a + 1.0, 1.0 + a, a * a, -a, a[1:], a.T):
            assert read.dtype == compute
        np.testing.assert_array_equal(np.asarray(a), np.asarray([1.5, -2.25, 3.0], compute))
        with varstate.autocast(None):  # nested scopes restore the outer one
            assert a.value.dtype == jnp.float32
        assert a.value.dtype == compute
    assert a.value.dtype == jnp.float32 and a.dtype == jnp.float32


def test_non_floating_autocast_dtype_means_no_cast_and_scope_is_per_thread():
    a = _acv([1.0])
    with varstate.autocast(jnp.int32):  # TF: only floating dtypes cast
        assert a.value.dtype == jnp.float32
    seen = []
    with varstate.autocast(jnp.bfloat16):
        t = threading.Thread(target=lambda: seen.append(a.value.dtype))
        t.start()
        t.join()
        assert a.value.dtype == jnp.bfloat16
    assert seen == [jnp.float32]


def test_assign_casts_back_to_storage_and_keeps_identity():
    a = _acv([1.0, 2.0])
    with varstate.autocast(jnp.bfloat16):
        b = a.assign(jnp.array([0.5, 0.25], jnp.bfloat16))
        c = b.assign_add(a.value)  # a bf16 read
        d = c.assign_sub(jnp.ones(2, jnp.bfloat16))
    for x in (b, c, d):
        assert isinstance(x, varstate.AutoCastVariable)
        assert x.true_dtype == jnp.float32 and x.__varstate_variable__().value.dtype == jnp.float32
        assert x.resource_id == a.resource_id and x.name == a.name
    assert d.__varstate_variable__().value.tolist() == [0.5, 1.25]
    rows = varstate.IndexedSlices(jnp.array([2.0], jnp.bfloat16), jnp.array([1]), (2,))
    e = d.scatter_add(rows).scatter_sub(rows).scatter_update(rows)
    assert isinstance(e, varstate.AutoCastVariable) and e.resource_id == a.resource_id
    assert e.__varstate_variable__().value.dtype == jnp.float32 and e.value.tolist() == [0.5, 2.0]
    assert a.value.tolist() == [1.0, 2.0]  # immutable versions


def test_delegates_metadata_and_acts_as_resource_variable():
    v = varstate.Variable(jnp.zeros((2, 3)), name="meta", trainable=False)
    a = varstate.AutoCastVariable(v)
    assert (a.name, a.shape, a.trainable, a.resource_id, a.handle) == ("meta", (2, 3), False, v.resource_id, v.handle)
    assert a.__varstate_variable__() is v
    assert varstate.is_resource_variable(a)
    with varstate.autocast(jnp.float16):
        assert "dtype_to_cast_to=float16" in repr(a) and "'meta'" in repr(a)


def test_pytree_child_is_the_variable_and_jit_keeps_it():
    a = _acv([1.0, 2.0], name="tree")
    leaves, treedef = jax.tree.flatten(a)
    assert len(leaves) == 1 and leaves[0].dtype == jnp.float32
    back = jax.tree.unflatten(treedef, leaves)
    assert isinstance(back, varstate.AutoCastVariable) and back.resource_id == a.resource_id
    # as a checkpoint restores: unflatten the wrapper around the restored Variable
    restored = varstate.Variable(jnp.array([7.0, 8.0]), name="restored")
    assert jax.tree.unflatten(jax.tree.structure(a, is_leaf=lambda x: isinstance(x, varstate.Variable)),
                              [restored]).__varstate_variable__() is restored

    @jax.jit
    def step(a):
        with varstate.autocast(jnp.bfloat16):
            return a.assign(a.value * 2), a.value

    new, read = step(a)
    assert isinstance(new, varstate.AutoCastVariable) and new.resource_id == a.resource_id
    assert read.dtype == jnp.bfloat16 and new.__varstate_variable__().value.tolist() == [2.0, 4.0]


def test_gradients_land_on_float32_storage():
    w = _acv([0.5, -1.0, 2.0], name="g_w")
    x = jnp.array([1.0, 3.0, -2.0])

    def loss(w):
        with varstate.autocast(jnp.bfloat16):
            y = w * x.astype(jnp.bfloat16)
            return (y.astype(jnp.float32) ** 2).sum()

    g = jax.jit(jax.grad(loss))(w)
    assert isinstance(g, varstate.AutoCastVariable)
    gv = g.__varstate_variable__().value
    assert gv.dtype == jnp.float32
    np.testing.assert_allclose(gv, 2 * np.array([0.5, -1.0, 2.0]) * np.array([1.0, 3.0, -2.0]) ** 2, rtol=1e-2)


@pytest.mark.parametrize("opt", [GradientDescent(0.1), Momentum(0.1, momentum=0.9)])
def test_optimizers_update_it_like_its_variable(opt):
    plain = {"w": varstate.Variable(jnp.array([1.0, -2.0]), name="opt_w")}
    wrapped = varstate.mixed_precision.autocast_variables(
        {"w": varstate.Variable(jnp.array([1.0, -2.0]), name="opt_w_acv")})
    g = jnp.array([0.5, 0.25])
    s_plain, s_wrapped = opt.init(plain), opt.init(wrapped)
    for _ in range(3):
        plain, s_plain = opt.apply_gradients({"w": g}, plain, s_plain)
        grads = jax.tree.map(lambda _: g, wrapped)  # the structure jax.grad gives: the wrapper around g
        wrapped, s_wrapped = opt.apply_gradients(grads, wrapped, s_wrapped)
    assert isinstance(wrapped["w"], varstate.AutoCastVariable)
    assert wrapped["w"].__varstate_variable__().value.dtype == jnp.float32
    np.testing.assert_array_equal(wrapped["w"].__varstate_variable__().value, plain["w"].value)
    for name in s_plain.get_slot_names():
        slot = s_wrapped.get_slot(wrapped["w"].__varstate_variable__(), name)
        assert slot.name == wrapped["w"].name + "/" + name
        np.testing.assert_array_equal(slot.value, s_plain.get_slot(plain["w"], name).value)


def test_read_by_a_custom_gradient_function():
    w = _acv([2.0], name="cg_w")

    def loss(params, x):
        @varstate.custom_gradient
        def f(x):
            with varstate.autocast(jnp.bfloat16):
                y = (params["w"] * x.astype(jnp.bfloat16)).astype(jnp.float32)
            return y.sum(), lambda dy, variables: (dy * 3.0 * jnp.ones_like(x), [dy * 10.0 * jnp.ones(1)])
        return f(x)

    g, dx = jax.grad(loss, argnums=(0, 1))({"w": w}, jnp.array([1.0]))
    assert isinstance(g["w"], varstate.AutoCastVariable)
    assert g["w"].__varstate_variable__().value.tolist() == [10.0] and dx.tolist() == [3.0]


def test_checkpoint_sees_the_wrapped_variable_and_formats_interchange(tmp_path):
    reg = varstate.Registry()
    plain = {"dense": {"kernel": varstate.Variable(jnp.array([[1.0, 2.0]]), name="kernel", registry=reg)}}
    wrapped = varstate.mixed_precision.autocast_variables(plain)
    for fmt in ("orbax", "tf"):
        p_path = checkpoint.Checkpoint(model=plain).write(str(tmp_path / f"plain_{fmt}"), format=fmt)
        w_path = checkpoint.Checkpoint(model=wrapped).write(str(tmp_path / f"wrapped_{fmt}"), format=fmt)
        p_reader, w_reader = checkpoint.read_checkpoint(p_path), checkpoint.read_checkpoint(w_path)
        assert sorted(w_reader.keys()) == sorted(p_reader.keys())
        key = "model/dense/kernel/.ATTRIBUTES/VARIABLE_VALUE"
        np.testing.assert_array_equal(w_reader.get(key), p_reader.get(key))
        # a plain checkpoint restores into a wrapped template (and keeps the wrapper), and back
        template = varstate.mixed_precision.autocast_variables(
            {"dense": {"kernel": varstate.Variable(jnp.zeros((1, 2)), name="kernel_t")}})
        restored = checkpoint.Checkpoint(model=template).restore(p_path).model["dense"]["kernel"]
        assert isinstance(restored, varstate.AutoCastVariable)
        assert restored.__varstate_variable__().value.tolist() == [[1.0, 2.0]]
        back = checkpoint.Checkpoint(model={"dense": {"kernel": varstate.Variable(jnp.zeros((1, 2)))}}).restore(w_path)
        assert back.model["dense"]["kernel"].value.tolist() == [[1.0, 2.0]]


def test_optimizer_slots_of_wrapped_params_checkpoint_as_tf(tmp_path):
    reg = varstate.Registry()
    params = varstate.mixed_precision.autocast_variables({"k": varstate.Variable(jnp.ones(2), name="k", registry=reg)})
    opt = Adam(0.1)
    params, state = opt.apply_gradients(jax.tree.map(lambda _: jnp.ones(2), params), params, opt.init(params))
    path = checkpoint.Checkpoint(model=params, optimizer=state).write(str(tmp_path / "c"), format="tf")
    assert sorted(checkpoint.read_checkpoint(path).keys()) == [
        "model/k/.ATTRIBUTES/VARIABLE_VALUE",
        "model/k/.OPTIMIZER_SLOT/optimizer/m/.ATTRIBUTES/VARIABLE_VALUE",
        "model/k/.OPTIMIZER_SLOT/optimizer/v/.ATTRIBUTES/VARIABLE_VALUE",
        "optimizer/beta1_power/.ATTRIBUTES/VARIABLE_VALUE",
        "optimizer/beta2_power/.ATTRIBUTES/VARIABLE_VALUE",
    ]
    fresh = varstate.mixed_precision.autocast_variables({"k": varstate.Variable(jnp.zeros(2), name="k_fresh")})
    status = checkpoint.Checkpoint(model=fresh, optimizer=opt.init(fresh)).restore(path).assert_consumed()
    m = status.optimizer.get_slot(status.model["k"].__varstate_variable__(), "m")
    np.testing.assert_array_equal(m.value, state.get_slot(params["k"].__varstate_variable__(), "m").value)


def test_iterates_and_defers_to_numpy_like_its_variable():
    w = varstate.AutoCastVariable(varstate.Variable(jnp.array([1.0, 2.0]), name="w"))
    with varstate.autocast(jnp.bfloat16):
        rows = list(itertools.islice(w, 5))  # bounded: jax clamps indices, so __getitem__ iteration never ended
        assert [r.dtype for r in rows] == [jnp.bfloat16] * 2 and [float(r) for r in rows] == [1.0, 2.0]
        out = jax.jit(lambda w: np.ones(2, np.float32) * w)(w)  # numpy on the left defers, traceable
        assert out.dtype == jnp.float32 and out.tolist() == [1.0, 2.0]


def test_an_uninitialized_wrapped_variable_reports_its_cast_value_type():
    # Its Variable's value is a ShapeDtypeStruct (a restore template); the cast read raised AttributeError.
    w = varstate.AutoCastVariable(varstate.uninitialized((2, 3), jnp.float32, name="template"))
    with varstate.autocast(jnp.float16):
        assert w.value == jax.ShapeDtypeStruct((2, 3), jnp.float16)
    assert w.value == jax.ShapeDtypeStruct((2, 3), jnp.float32)
