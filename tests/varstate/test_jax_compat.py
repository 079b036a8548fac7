"""varstate._jax_compat: the one place that depends on how JAX traces."""

import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec

import varstate
from varstate import _jax_compat

SEEN: list[bool] = []


def _record(x):
    SEEN.append(_jax_compat.in_transformation())
    return x


def _probe():  # a new function each time: jax caches traces by function, and a cached trace records nothing
    return lambda x: _record(x)


def _probe_in_eval_context():
    def probe(x):
        with jax.core.eval_context():
            _record(x)
        with jax.ensure_compile_time_eval():  # constant folding only: still tracing
            _record(x)
        return x

    return probe


# What each call must see, from JAX's documented semantics rather than from varstate: eager code is not traced,
# every transformation traces its function once (cond both branches), and eval_context leaves tracing.
@pytest.mark.parametrize(
    "run, expected",
    [
        (lambda: _probe()(1.0), [False]),
        (lambda: jax.jit(_probe())(1.0), [True]),
        (lambda: jax.grad(_probe())(1.0), [True]),
        (lambda: jax.vmap(_probe())(jnp.ones(2)), [True]),
        (lambda: jax.eval_shape(_probe(), 1.0), [True]),
        (lambda: jax.jvp(_probe(), (1.0,), (1.0,)), [True]),
        (lambda: jax.linearize(_probe(), 1.0), [True]),
        (lambda: jax.make_jaxpr(_probe())(1.0), [True]),
        (lambda: jax.grad(jax.checkpoint(_probe()))(1.0), [True]),
        (lambda: jax.lax.scan(lambda c, x: (_probe()(c), x), 0.0, jnp.ones(2)), [True]),
        (lambda: jax.lax.cond(True, _probe(), _probe(), 1.0), [True, True]),
        (lambda: jax.jit(_probe_in_eval_context())(1.0), [False, True]),
        (lambda: jax.shard_map(_probe(), mesh=Mesh(np.array(jax.devices()), ("d",)), in_specs=PartitionSpec("d"),
                               out_specs=PartitionSpec("d"))(jnp.ones(8)), [True]),
    ],
    ids=["eager", "jit", "grad", "vmap", "eval_shape", "jvp", "linearize", "make_jaxpr", "remat", "scan", "cond",
         "eval_context", "shard_map"],
)
def test_in_transformation_is_true_exactly_while_jax_traces(run, expected):
    SEEN.clear()
    run()
    assert SEEN == expected


def test_current_trace_is_jaxs_eager_trace_outside_any_transformation():
    seen = []
    jax.jit(lambda x: seen.append(type(_jax_compat.current_trace()).__name__) or x)(1.0)
    assert type(_jax_compat.current_trace()).__name__ == "EvalTrace" and len(seen) == 1 and seen[0] != "EvalTrace"


def test_in_transformation_is_false_in_an_eval_context_inside_jit():
    seen = []

    def f(x):
        seen.append(_jax_compat.in_transformation())
        with jax.core.eval_context():
            seen.append(_jax_compat.in_transformation())
        with jax.ensure_compile_time_eval():  # constant folding only: still tracing
            seen.append(_jax_compat.in_transformation())
        return x

    jax.jit(f)(1.0)
    assert seen == [True, False, True]


def test_variables_still_refuse_creation_under_a_transformation():
    with pytest.raises(ValueError, match="created inside a JAX transformation"):
        jax.jit(lambda x: varstate.Variable(x))(1.0)


def test_made_under_follows_nested_transformations():
    found = {}

    def outer(x):
        trace = _jax_compat.current_trace()

        def inner(y):
            found["inner"] = _jax_compat.made_under(y, trace)
            return y

        jax.jvp(inner, (x,), (x,))
        found["outer"] = _jax_compat.made_under(x, trace)
        found["other"] = _jax_compat.made_under(x, object())
        return x

    jax.eval_shape(outer, 1.0)
    assert found == {"inner": True, "outer": True, "other": False}


@pytest.fixture
def unchecked(monkeypatch):
    monkeypatch.setattr(_jax_compat, "_ancestry_checked", False)


def _identity_grad(x):
    return x, lambda dy: dy


def test_missing_tracer_trace_is_named_with_the_jax_version(unchecked, monkeypatch):
    monkeypatch.delattr(jax.core.Tracer, "_trace")
    with pytest.raises(_jax_compat.JaxInternalsError) as e:
        varstate.custom_gradient(_identity_grad)(jnp.ones(2))
    assert str(e.value).startswith(
        f"varstate.custom_gradient needs jax internal jax.core.Tracer._trace (found JAX {jax.__version__} "
        "without it); "
    )
    assert isinstance(e.value, RuntimeError)


def test_missing_parent_trace_link_is_named_with_the_jax_version(unchecked, monkeypatch):
    # As if a JAX release renamed the link from a transformation's trace to the enclosing one.
    monkeypatch.setattr(_jax_compat, "_PARENT_TRACE", "enclosing_trace")
    with pytest.raises(_jax_compat.JaxInternalsError,
                       match=rf"needs jax internal JVPTrace\.enclosing_trace \(found JAX {jax.__version__} without"):
        varstate.custom_gradient(_identity_grad)(jnp.ones(2))


def test_internals_are_checked_once_and_custom_gradient_then_works(unchecked):
    y = jax.grad(lambda x: varstate.custom_gradient(lambda x: (2 * x, lambda dy: 3 * dy))(x))(1.0)
    assert float(y) == 3.0
    assert _jax_compat._ancestry_checked


def test_no_varstate_module_imports_jax_src():
    root = pathlib.Path(varstate.__file__).parent
    offenders = [str(p.relative_to(root)) for p in root.rglob("*.py") if "jax._src" in p.read_text()
                 and p.name != "_jax_compat.py"]
    assert not offenders, f"import JAX internals through varstate._jax_compat only: {offenders}"
