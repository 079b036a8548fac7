"""The one module of varstate that depends on how JAX works inside.

Everything else imports trace-related names from here, so that a JAX release
that moves or drops one of them breaks in one place, with a message naming
what is missing, instead of deep in a traced function.

- `Tracer`: the public `jax.core.Tracer`.
- `ArrayImpl`, `is_deleted_array(x)`: the class of eager arrays (from the
  public `jax.Array`'s subclasses) and whether one was donated.
- `in_transformation()`: whether JAX is tracing, from the public trace-state
  API of `jax.extend.core`.
- `container_registry()`: a pytree registry of Python's containers alone, in
  which a Variable is a leaf (the optimizer step's flatten in C).
- `current_trace()` and `made_under(tracer, trace)`: the trace ancestry that
  `custom_gradient` uses to tell values read from outside the decorated
  function from those made inside it. The ancestry links are JAX internals
  (`Tracer._trace`, `parent_trace` of a transformation's trace); they are
  checked once, on first use, and a `JaxInternalsError` names any that is
  missing.

No name here is imported from `jax._src`.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.core
import jax.extend.core as _jex

# Public and not deprecated in JAX 0.10; taken from here so that a future move of it changes one line.
Tracer = jax.core.Tracer

# The concrete class of eager (non-traced) arrays, found through the public `jax.Array` without importing
# jaxlib's module: `type(x) is ArrayImpl` is the cheapest test a hot read can make (isinstance(x, jax.Array)
# costs four times as much). None if a JAX release renames it; then `is_deleted_array` falls back to isinstance.
ArrayImpl = next((c for c in jax.Array.__subclasses__() if c.__name__ == "ArrayImpl"), None)


def is_deleted_array(x: Any) -> bool:
    """True for an eager jax.Array whose buffers were deleted (donated to a jitted call, or `x.delete()`)."""
    if ArrayImpl is not None:
        return type(x) is ArrayImpl and x.is_deleted()
    return isinstance(x, jax.Array) and not isinstance(x, Tracer) and x.is_deleted()


def container_registry() -> Any:
    """A new pytree registry that knows Python's containers alone (None, tuples, named tuples, lists, dicts); None
    if this JAX cannot make one.

    Every registered class is a leaf there until registered in it too: a Variable flattens as itself, in C, where
    the default registry calls its Python flatten function once per Variable. `jax.tree_util.default_registry` is
    public; making another instance of its class is not documented, hence here.
    """
    try:
        return type(jax.tree_util.default_registry)(
            enable_none=True, enable_tuple=True, enable_namedtuple=True, enable_list=True, enable_dict=True)
    except (AttributeError, TypeError):
        return None


# take_current_trace() puts JAX in its top-level (eager) trace for the block, whatever traces are open.
with _jex.take_current_trace():
    _EVAL_TRACE_STATE = _jex.get_opaque_trace_state()


def in_transformation() -> bool:
    """True while JAX is tracing (jit, grad, vmap, eval_shape, ...); False in `jax.core.eval_context()`."""
    return _jex.get_opaque_trace_state() != _EVAL_TRACE_STATE


def current_trace() -> Any:
    """The innermost open trace (JAX's eager trace outside any transformation)."""
    with _jex.take_current_trace() as trace:
        return trace


class JaxInternalsError(RuntimeError):
    """The installed JAX lacks an internal that a varstate feature relies on."""


# The internals made_under reads: a tracer's trace, and a transformation trace's enclosing trace.
_TRACER_TRACE = "_trace"
_PARENT_TRACE = "parent_trace"
_ancestry_checked = False


def _missing(what: str, why: str) -> JaxInternalsError:
    return JaxInternalsError(
        f"varstate.custom_gradient needs jax internal {what} (found JAX {jax.__version__} without it); {why} "
        "Install a JAX release that has it (varstate requires jax>=0.10), or report this to varstate."
    )


def check_ancestry_internals() -> None:
    """Raises `JaxInternalsError` unless traces link to their enclosing trace as `made_under` expects.

    Checked by tracing once: a jvp inside an eval_shape must give a tracer
    whose trace's parent is the eval_shape's trace.
    """
    global _ancestry_checked
    if _ancestry_checked:
        return
    why = "it tells the variables a decorated function reads from outside from those it makes."
    if not hasattr(Tracer, _TRACER_TRACE):
        raise _missing(f"jax.core.Tracer.{_TRACER_TRACE}", why)
    seen: dict[str, Any] = {}

    def outer(x):
        seen["outer"] = current_trace()

        def inner(y):
            seen["inner"] = getattr(y, _TRACER_TRACE, None)
            return y

        jax.jvp(inner, (x,), (x,))
        return x

    jax.eval_shape(outer, 0.0)
    inner = seen.get("inner")
    if inner is None:
        raise _missing(f"jax.core.Tracer.{_TRACER_TRACE}", why)
    if getattr(inner, _PARENT_TRACE, None) is not seen["outer"]:
        raise _missing(f"{type(inner).__name__}.{_PARENT_TRACE}", why)
    _ancestry_checked = True


def made_under(tracer: Tracer, trace: Any) -> bool:
    """True if `tracer` belongs to `trace` or to a transformation opened inside it."""
    check_ancestry_internals()
    t = getattr(tracer, _TRACER_TRACE)
    while t is not None:
        if t is trace:
            return True
        # Root traces (JAX's eager trace, eager shard_map's) have no parent: the ancestry ends there.
        t = getattr(t, _PARENT_TRACE, None)
    return False
