"""TF's scatter/gather methods of Variable, bit for bit against TF 2.21 (tests/data/tf_variable_methods.npz, written
by tests/data/make_tf_variable_methods_fixtures.py), eagerly and under jit; their errors; get_shape and device."""

import pathlib

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import varstate
from varstate import IndexedSlices, Registry, Variable

FIXTURES = np.load(pathlib.Path(__file__).resolve().parent.parent / "data" / "tf_variable_methods.npz")
CASES = sorted({k.rsplit("/", 1)[0] for k in FIXTURES.files if k.count("/") == 3})
READS = ("sparse_read", "gather_nd")


@pytest.fixture
def reg():
    return Registry()


def _load(case, what):
    x = FIXTURES[f"{case}/{what}"]
    return x.view(ml_dtypes.bfloat16) if case.startswith("bfloat16/") else x


def _run(v, op, indices, updates):
    if op in READS:
        return getattr(v, op)(indices)
    if op.startswith("scatter_nd_"):
        return getattr(v, op)(indices, updates).value
    return getattr(v, op)(IndexedSlices(updates, indices)).value


def test_the_fixture_covers_every_op_and_dtype():
    ops = {c.split("/")[1] for c in CASES}
    assert ops == {"scatter_add", "scatter_sub", "scatter_update", "scatter_max", "scatter_min", "scatter_mul",
                   "scatter_div", "scatter_nd_add", "scatter_nd_sub", "scatter_nd_update", "scatter_nd_max",
                   "scatter_nd_min", "sparse_read", "gather_nd"}
    assert {c.split("/")[0] for c in CASES} == {"float32", "float16", "bfloat16", "int32"}
    assert FIXTURES["unsupported"].size == 0  # TF 2.21 has a CPU kernel for every pair


@pytest.mark.parametrize("jitted", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("case", CASES)
def test_matches_tf_bit_for_bit(case, jitted, reg):
    op = case.split("/")[1]
    init, indices = _load(case, "init"), jnp.asarray(FIXTURES[f"{case}/indices"])
    updates = None if op in READS else jnp.asarray(_load(case, "updates"))
    v = Variable(jnp.asarray(init), name="v", registry=reg)
    run = jax.jit(_run, static_argnums=1) if jitted else _run
    out = np.asarray(run(v, op, indices, updates))
    want = _load(case, "result")
    assert out.dtype == want.dtype and out.shape == want.shape
    assert out.tobytes() == want.tobytes(), f"{case}: {out} != TF's {want}"
    assert np.asarray(v.value).tobytes() == init.tobytes()  # the version it came from is unchanged, NaNs included


@pytest.mark.parametrize("case", [c for c in CASES if ("/scatter_div/dup" in c and not c.startswith("int32"))
                                  or c.endswith("/nan_zero")])
def test_xla_scatter_alone_would_differ_from_tf(case):
    # What makes the ordered loop necessary: `.at[].divide` divides once by the duplicates' product, which rounds
    # differently from TF's one division after another; `.at[].max` propagates a NaN update and orders -0 below
    # +0, where TF keeps the element unless an update is strictly greater.
    op = case.split("/")[1].removeprefix("scatter_").removeprefix("nd_")
    init, indices, updates = _load(case, "init"), FIXTURES[f"{case}/indices"], jnp.asarray(_load(case, "updates"))
    x = jnp.asarray(init)
    at = x.at[tuple(np.moveaxis(indices, -1, 0))] if "_nd_" in case else x.at[indices]
    at_once = getattr(at, {"div": "divide"}.get(op, op))(updates)
    assert np.asarray(at_once).tobytes() != _load(case, "result").tobytes()


def test_returns_a_new_version_with_the_identity(reg):
    v = Variable(jnp.array([[1.0, 2.0], [3.0, 4.0]]), name="ident", registry=reg)
    rows = IndexedSlices(jnp.array([[2.0, 2.0]]), jnp.array([1]))
    for new in (v.scatter_max(rows), v.scatter_min(rows), v.scatter_mul(rows), v.scatter_div(rows),
                v.scatter_nd_add([[0, 0]], [1.0]), v.scatter_nd_sub([[0]], [[1.0, 1.0]]),
                v.scatter_nd_update([[1, 1]], [0.0]), v.scatter_nd_max([[1, 1]], [9.0]),
                v.scatter_nd_min([[1, 1]], [0.0])):
        assert type(new) is Variable and new.handle is v.handle
    assert v.scatter_div(rows).value.tolist() == [[1.0, 2.0], [1.5, 2.0]]
    assert v.scatter_nd_sub(np.array([[0]]), np.array([[1.0, 1.0]])).value.tolist() == [[0.0, 1.0], [3.0, 4.0]]


def test_integer_division_truncates_toward_zero_as_tf(reg):
    v = Variable(jnp.array([7, -7, 7]), name="ints", registry=reg)
    rows = IndexedSlices(jnp.array([2, 2, -2]), jnp.array([0, 1, 2]))
    assert v.scatter_div(rows).value.tolist() == [3, -3, -3]


def test_under_jit_out_of_range_is_dropped_or_read_as_zeros(reg):
    v = Variable(jnp.array([[1.0, 2.0], [3.0, 4.0]]), name="oob", registry=reg)
    for op in ("scatter_mul", "scatter_div", "scatter_max", "scatter_add"):
        rows = IndexedSlices(jnp.array([[2.0, 2.0], [5.0, 5.0], [7.0, 7.0]]), jnp.array([2, -1, 0]))
        new = jax.jit(lambda v, s, op=op: getattr(v, op)(s))(v, rows)
        want = {"scatter_mul": [[7.0, 14.0]], "scatter_div": [[1 / 7, 2 / 7]], "scatter_max": [[7.0, 7.0]],
                "scatter_add": [[8.0, 9.0]]}[op]
        np.testing.assert_allclose(np.asarray(new.value), [*want, [3.0, 4.0]], rtol=1e-6)
    nd = jax.jit(lambda v, i: v.scatter_nd_add(i, jnp.ones(2)))(v, jnp.array([[0, 2], [-1, 0]]))
    assert nd.value.tolist() == [[1.0, 2.0], [3.0, 4.0]]
    assert jax.jit(lambda v, i: v.sparse_read(i))(v, jnp.array([1, 2, -1])).tolist() == [[3, 4], [0, 0], [0, 0]]
    assert jax.jit(lambda v, i: v.gather_nd(i))(v, jnp.array([[1, 0], [0, 2], [-1, 0]])).tolist() == [3, 0, 0]


def test_errors_name_the_variable_the_op_and_the_fix(reg):
    v = Variable(jnp.zeros((4, 2)), name="emb", registry=reg)
    rows = IndexedSlices(jnp.ones((1, 2)), jnp.array([4]))
    with pytest.raises(IndexError, match=r"Variable 'emb'.scatter_div: index 4 is out of range for a first "
                                         r"dimension of size 4 \(valid: 0..3\)"):
        v.scatter_div(rows)
    with pytest.raises(IndexError, match=r"'emb'.scatter_max: index -1 is out of range"):
        v.scatter_max(IndexedSlices(jnp.ones((2, 2)), jnp.array([-1, 9])))
    with pytest.raises(TypeError, match=r"'emb'.scatter_mul: sparse_delta must be IndexedSlices, got ArrayImpl"):
        v.scatter_mul(jnp.ones((4, 2)))
    with pytest.raises(ValueError, match=r"'emb'.scatter_min: updates have shape \(1, 3\), expected \(1, 2\) "
                                         r"\(indices shape \(1,\) \+ variable shape \(4, 2\)\[1:\]\)"):
        v.scatter_min(IndexedSlices(jnp.ones((1, 3)), jnp.array([0])))
    with pytest.raises(TypeError, match=r"'emb'.scatter_div: dtype mismatch: the variable is float32, the updates "
                                        r"are int32"):
        v.scatter_div(IndexedSlices(jnp.ones((1, 2), jnp.int32), jnp.array([0])))
    with pytest.raises(TypeError, match=r"'emb'.scatter_nd_add: indices must be integers, got float32"):
        v.scatter_nd_add(jnp.array([[0.0]]), jnp.ones((1, 2)))
    with pytest.raises(ValueError, match=r"'emb'.scatter_nd_update: indices have shape \(1, 3\), but their last "
                                         r"dimension .* must be in 1..2 for a variable of shape \(4, 2\)"):
        v.scatter_nd_update(jnp.array([[0, 0, 0]]), jnp.ones(1))
    with pytest.raises(ValueError, match=r"'emb'.scatter_nd_max: indices have shape \(\), but"):
        v.scatter_nd_max(jnp.array(0), jnp.ones(2))
    with pytest.raises(IndexError, match=r"'emb'.scatter_nd_sub: indices\[1, 0\] = \[0, 2\] is out of range for "
                                         r"the variable's shape \(4, 2\) \(index j must be in 0..shape\[j\] - 1\)"):
        v.scatter_nd_sub(jnp.array([[[1, 1]], [[0, 2]]]), jnp.ones((2, 1)))
    with pytest.raises(IndexError, match=r"'emb'.scatter_nd_min: indices\[0\] = \[-1\] is out of range"):
        v.scatter_nd_min(jnp.array([[-1]]), jnp.ones((1, 2)))
    with pytest.raises(ValueError, match=r"'emb'.scatter_nd_add: updates have shape \(2,\), expected \(1,\) "
                                         r"\(indices shape \(1, 2\)\[:-1\] \+ variable shape \(4, 2\)\[2:\]\)"):
        v.scatter_nd_add(jnp.array([[0, 0]]), jnp.ones(2))
    with pytest.raises(IndexError, match=r"'emb'.sparse_read: index 4 is out of range for a first dimension"):
        v.sparse_read(jnp.array([0, 4]))
    with pytest.raises(TypeError, match=r"'emb'.sparse_read: indices must be integers, got float32"):
        v.sparse_read(jnp.array([0.0]))
    with pytest.raises(IndexError, match=r"'emb'.gather_nd: indices\[1\] = \[4, 0\] is out of range"):
        v.gather_nd(jnp.array([[0, 0], [4, 0]]))
    s = Variable(1.0, name="scalar", registry=reg)
    with pytest.raises(ValueError, match=r"'scalar'.scatter_nd_add: a scatter needs a variable of rank >= 1 "
                                         r"\(its rows\), but 'scalar' is a scalar; use assign_add/assign_sub/assign"):
        s.scatter_nd_add(jnp.array([[0]]), jnp.ones(1))
    with pytest.raises(ValueError, match=r"'scalar'.gather_nd: a gather needs a variable of rank >= 1 \(its rows\), "
                                         r"but 'scalar' is a scalar; use read_value\(\)"):
        s.gather_nd(jnp.array([[0]]))
    with pytest.raises(ValueError, match=r"'scalar'.sparse_read: a gather needs"):
        s.sparse_read(jnp.array([0]))


def test_get_shape_is_shape(reg):
    v = Variable(jnp.zeros((3, 1, 2)), name="shaped", registry=reg)
    assert v.get_shape() == v.shape == (3, 1, 2) and type(v.get_shape()) is tuple


def test_device_is_named_as_tf_names_it(reg):
    v = Variable(1.0, name="dev", registry=reg)
    assert v.device == str(FIXTURES["device"]) == "/job:localhost/replica:0/task:0/device:CPU:0"
    on3 = Variable(jax.device_put(jnp.ones(2), jax.devices()[3]), name="dev3", registry=reg)
    assert on3.device == "/job:localhost/replica:0/task:0/device:CPU:3"
    mesh = jax.sharding.Mesh(np.array(jax.devices()[2:6]), ("x",))
    sharded = jax.device_put(jnp.ones(8), jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("x")))
    assert Variable(sharded, name="dev_sharded", registry=reg).device.endswith("/device:CPU:2")
    seen = []
    jax.jit(lambda v: seen.append(v.device) or v)(v)
    assert seen == [""]
    assert varstate.uninitialized((2,), jnp.float32, name="dev_u", registry=reg).device == ""


def test_autocast_variable_keeps_the_wrapper_and_casts(reg):
    a = varstate.AutoCastVariable(Variable(jnp.array([[1.0, 2.0], [3.0, 4.0]]), name="acv", registry=reg))
    with varstate.autocast(jnp.bfloat16):
        rows = IndexedSlices(jnp.array([[2.0, 8.0]], jnp.bfloat16), jnp.array([1]))
        outs = [a.scatter_max(rows), a.scatter_min(rows), a.scatter_mul(rows), a.scatter_div(rows),
                a.scatter_nd_add([[0, 0]], jnp.ones(1, jnp.bfloat16)), a.scatter_nd_sub([[0, 0]], [1.0]),
                a.scatter_nd_update([[0, 1]], [5.0]), a.scatter_nd_max([[0, 1]], [5.0]),
                a.scatter_nd_min([[0, 1]], [0.5])]
        assert a.sparse_read(jnp.array([1])).dtype == jnp.bfloat16
        assert a.gather_nd(jnp.array([[1, 1]])).tolist() == [4.0]
        assert a.gather_nd(jnp.array([[1, 1]])).dtype == jnp.bfloat16
    assert a.sparse_read(jnp.array([1])).dtype == jnp.float32
    got = [o.__varstate_variable__().value.tolist() for o in outs]
    assert all(isinstance(o, varstate.AutoCastVariable) and o.handle is a.handle and o.true_dtype == jnp.float32
               for o in outs)
    assert got == [[[1.0, 2.0], [3.0, 8.0]], [[1.0, 2.0], [2.0, 4.0]], [[1.0, 2.0], [6.0, 32.0]],
                   [[1.0, 2.0], [1.5, 0.5]], [[2.0, 2.0], [3.0, 4.0]], [[0.0, 2.0], [3.0, 4.0]],
                   [[1.0, 5.0], [3.0, 4.0]], [[1.0, 5.0], [3.0, 4.0]], [[1.0, 0.5], [3.0, 4.0]]]
