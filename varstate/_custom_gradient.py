"""`custom_gradient`: TF's decorator built on `jax.custom_vjp`, variables included.

How variables get gradients. A `custom_vjp` function may not close over
tracers of an enclosing `jax.grad` (UnexpectedTracerError), yet a TF-style
function reads the variables it needs from its closure. So the decorated call
runs `f` twice:

1. under `jax.eval_shape` with a *recording* read hook: every Variable read
   whose value comes from outside `f` (a concrete array, or a tracer of an
   enclosing transformation) is noted, as TF's tape watches variable reads;
2. inside the `custom_vjp`, whose primal inputs are the arguments plus the
   recorded values, with a *substituting* read hook that hands `f` the
   custom_vjp's own traced copies in place of the recorded values.

The hook keys on the identity of the value object, not on the resource id, so
a version that `f` makes itself (`v.assign(...)` inside `f`) is never replaced.
`grad_fn`'s closure travels to the backward pass closure-converted (as
`jax.closure_convert` does, but hoisting integer tracers too): the converted
function rides in the residuals as static pytree data, its hoisted constants
as ordinary residual arrays.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import threading
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp

from varstate import _jax_compat, _variable
from varstate._variable import Variable, version

# ---------------------------------------------------------------------------
# Read hook: a per-thread stack of contexts, installed in _variable while any
# thread has one open.

_local = threading.local()
_lock = threading.Lock()
_open_contexts = 0


def _hook(v: Variable) -> Any:
    val = v._value
    for read in getattr(_local, "stack", ()):  # bottom to top: outer custom_gradients resolve first
        val = read(v, val)
    return val


@contextlib.contextmanager
def _reading(read: Callable[[Variable, Any], Any]) -> Iterator[None]:
    """Within the block, this thread's Variable reads return `read(v, value)`."""
    global _open_contexts
    stack = _local.__dict__.setdefault("stack", [])
    stack.append(read)
    with _lock:
        _open_contexts += 1
        _variable._read_hook = _hook
    try:
        yield
    finally:
        stack.pop()
        with _lock:
            _open_contexts -= 1
            if not _open_contexts:
                _variable._read_hook = None


def _is_outside(val: Any, trace: Any) -> bool:
    """True if `val` was not made under `trace` (f's own eval_shape trace)."""
    if isinstance(val, _jax_compat.Tracer):
        return not _jax_compat.made_under(val, trace)
    return isinstance(val, jax.Array)  # an uninitialized value (a ShapeDtypeStruct) has nothing to lift


def _closure_convert(fn: Callable, example: Any) -> jax.tree_util.Partial:
    """`fn` as a function of (consts, args) bound to its consts, every tracer it closes over hoisted: a `Partial`,
    a pytree whose function is static data and whose bound consts are its children (custom_vjp residuals).

    Unlike `jax.closure_convert`, integer tracers (e.g. argmax indices) are
    hoisted too: a forward trace's values must not leak into the backward one.
    """
    closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(example)
    jaxpr, consts, out_tree = closed.jaxpr, list(closed.consts), jax.tree.structure(out_shape)
    hoist = [isinstance(c, _jax_compat.Tracer) for c in consts]
    kept = [c for c, h in zip(consts, hoist, strict=True) if not h]

    def converted(hoisted: list, args: Any) -> Any:
        it_kept, it_hoisted = iter(kept), iter(hoisted)
        merged = [next(it_hoisted) if h else next(it_kept) for h in hoist]
        return jax.tree.unflatten(out_tree, jax.core.eval_jaxpr(jaxpr, merged, *jax.tree.leaves(args)))

    return jax.tree_util.Partial(converted, [c for c, h in zip(consts, hoist, strict=True) if h])


def _is_var(x: Any) -> bool:
    return isinstance(x, Variable) or hasattr(x, "__varstate_variable__")


def _plain(tree: Any) -> Any:
    """`tree` with each Variable (or AutoCastVariable) replaced by its stored value."""
    def leaf(x):
        if hasattr(x, "__varstate_variable__"):
            x = x.__varstate_variable__()
        return x._value if isinstance(x, Variable) else x
    return jax.tree.map(leaf, tree, is_leaf=_is_var)


def _cotangent(g: Any, primal: Any, where: str) -> Any:
    """`g` checked and cast as the cotangent of `primal` (None: zero)."""
    primal = jax.typeof(primal)
    if g is None or not jnp.issubdtype(primal.dtype, jnp.inexact):
        return None
    g = jnp.asarray(_plain(g))
    if g.shape != primal.shape:
        raise ValueError(
            f"custom_gradient: grad_fn returned a gradient of shape {g.shape} for {where}, which has "
            f"shape {primal.shape}; return one array per input with the input's shape (or None)."
        )
    return g.astype(primal.dtype)


def _matches(arg: Any, g: Any) -> bool:
    plain = _plain(arg)
    if isinstance(g, (tuple, list)) and not isinstance(plain, (tuple, list)):
        return False
    try:
        jax.tree.structure(plain).flatten_up_to(_plain(g))
    except (ValueError, TypeError):
        return False
    return True


def _arg_cotangents(grads: Any, args: tuple, fname: str) -> list:
    """Flat cotangent list for the leaves of `args`, from grad_fn's input gradients."""
    n = len(args)
    # One gradient per argument in a sequence, except that the one argument's may come bare (a sequence
    # shaped like that argument is its gradient, not a sequence of one).
    if not (isinstance(grads, (tuple, list)) and (n != 1 or not _matches(args[0], grads))):
        grads = (grads,)
    if len(grads) != n:
        raise ValueError(
            f"custom_gradient: {fname} has {n} argument(s) but its grad_fn returned {len(grads)} gradient(s); "
            f"return {n} gradient(s), one per argument{' as a tuple' if n > 1 else ''} (None for no gradient)."
        )
    out: list[Any] = []
    for i, (arg, g) in enumerate(zip(args, grads, strict=True)):
        leaves, treedef = jax.tree.flatten(_plain(arg))
        if g is None:
            out.extend([None] * len(leaves))
            continue
        try:
            flat = treedef.flatten_up_to(_plain(g))
        except (ValueError, TypeError):
            raise ValueError(
                f"custom_gradient: the gradient grad_fn returned for argument {i} of {fname} has structure "
                f"{jax.tree.structure(_plain(g))}, expected the argument's structure {treedef}."
            ) from None
        out.extend(_cotangent(gl, pl, f"argument {i} of {fname}") for gl, pl in zip(flat, leaves, strict=True))
    return out


class _CustomGradient:
    """The decorated function; binds like a method when used on a class."""

    def __init__(self, f: Callable) -> None:
        self._f = f
        functools.update_wrapper(self, f)

    def __get__(self, instance: Any, owner: Any = None) -> Any:
        if instance is None:
            return self
        return _CustomGradient(self._f.__get__(instance, owner))

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        fname = getattr(self._f, "__name__", repr(self._f))
        if kwargs:
            raise ValueError(
                f"custom_gradient: {fname} was called with keyword arguments {sorted(kwargs)}. As in TF's graph "
                "mode (and every JAX trace is one), only positional arguments are supported: pass them "
                "positionally, or bind non-differentiable ones with functools.partial before decorating."
            )
        return _call(self._f, fname, args)


def _split(out: Any, fname: str) -> tuple[Any, Callable]:
    if not (isinstance(out, (tuple, list)) and len(out) == 2 and callable(out[1])):
        raise TypeError(
            f"custom_gradient: {fname} must return a pair (outputs, grad_fn) with grad_fn callable, "
            f"got {_described(out)}."
        )
    return out[0], out[1]


def _described(x: Any) -> str:
    """What a wrong return value is, in the user's terms: under a trace its type is JAX's tracer class."""
    if hasattr(x, "shape") and hasattr(x, "dtype"):
        return f"one array of shape {tuple(x.shape)} and dtype {x.dtype}"
    if isinstance(x, (tuple, list)):
        return f"a {type(x).__name__} of {len(x)}"
    return type(x).__name__


def _check_signature(grad_fn: Callable, fname: str, var_names: list[str]) -> None:
    try:
        params = inspect.signature(grad_fn).parameters.values()
    except (TypeError, ValueError):
        return  # builtins and the like: let the call decide
    named = any(p.name == "variables" and p.kind != p.POSITIONAL_ONLY for p in params)
    if var_names and not (named or any(p.kind == p.VAR_KEYWORD for p in params)):
        raise TypeError(
            f"custom_gradient: grad_fn of {fname} must accept a keyword argument 'variables', because "
            f"{fname} reads trainable Variables that are not among its arguments: {var_names}. Define "
            "grad_fn(*dys, variables=None) and return (input_grads, variable_grads)."
        )
    if named and not var_names:
        warnings.warn(
            f"custom_gradient: grad_fn of {fname} has a 'variables' parameter, but {fname} read no "
            "trainable Variable outside its arguments; grad_fn will be called without 'variables'.",
            UserWarning,
            stacklevel=4,
        )


def _call(f: Callable, fname: str, args: tuple) -> Any:
    _jax_compat.check_ancestry_internals()  # before any tracing: a missing internal fails here, named
    # 1. Discover, abstractly (no FLOPs), the variables f reads from outside, and those its grad_fn reads.
    arg_leaves = jax.tree.leaves(args)
    arg_ids = {id(x) for x in arg_leaves}
    found: dict[str, Any] = {}

    def record(*a: Any) -> Any:
        trace = _jax_compat.current_trace()
        reads: dict[int, tuple[Any, Any]] = {}

        def read(v, val):
            if id(val) not in reads and id(val) not in arg_ids and _is_outside(val, trace):
                reads[id(val)] = (v._handle, val)
            return val

        with _reading(read):
            y, grad_fn = _split(f(*a), fname)
        forward = sorted(reads.values(), key=lambda r: r[0].name)
        # TF hands grad_fn the trainable float variables read in the forward pass; the rest get no gradient.
        variables = [r for r in forward if r[0].trainable and jnp.issubdtype(r[1].dtype, jnp.inexact)]
        _check_signature(grad_fn, fname, [h.name for h, _ in variables])
        dys = jax.tree.map(jnp.zeros_like, y)
        dys = tuple(dys) if isinstance(y, (tuple, list)) else (dys,)
        kw = {"variables": [version(val, h) for h, val in variables]} if variables else {}
        # grad_fn may read variables f did not: they must be lifted too. A probe only: a faulty grad_fn is
        # reported when it is differentiated.
        with _reading(read), contextlib.suppress(Exception):
            grad_fn(*dys, **kw)
        # Lifted, each once: the variables grad_fn gets, then f's other reads, then those only grad_fn made.
        lifted = {id(r[1]): r for r in [*variables, *forward, *reads.values()]}
        found["lifted"], found["n_vars"] = list(lifted.values()), len(variables)
        return y

    jax.eval_shape(record, *args)
    reads, n_vars = found["lifted"], found["n_vars"]
    var_names = [h.name for h, _ in reads[:n_vars]]
    originals = [val for _, val in reads]

    # 2. The custom_vjp over (args, lifted values).
    def substitute(a, lifted):
        table = dict(zip(map(id, arg_leaves), jax.tree.leaves(a), strict=True))
        table.update(zip(map(id, originals), lifted, strict=True))
        return _reading(lambda v, val: table.get(id(val), val))

    @jax.custom_vjp
    def primal(a, lifted):
        with substitute(a, lifted):
            return _split(f(*a), fname)[0]

    def fwd(a, lifted):
        with substitute(a, lifted):  # grad_fn's own reads see the lifted values too
            y, grad_fn = _split(f(*a), fname)
            variables = [version(x, h) for (h, _), x in zip(reads[:n_vars], lifted, strict=False)]
            a_tree = jax.tree.structure(a)

            def backward(dys):
                dys = tuple(dys) if isinstance(y, (tuple, list)) else (dys,)
                if n_vars:
                    out = grad_fn(*dys, variables=variables)
                    if not (isinstance(out, (tuple, list)) and len(out) == 2):
                        raise ValueError(
                            f"custom_gradient: {fname} reads Variables {var_names}, so its grad_fn must return "
                            f"a pair (input_grads, variable_grads); got {_described(out)}."
                        )
                    input_grads, var_grads = out
                    if var_grads is None or len(var_grads) != n_vars:
                        raise ValueError(
                            f"custom_gradient: grad_fn of {fname} returned "
                            f"{0 if var_grads is None else len(var_grads)} variable gradients for {n_vars} "
                            f"variables {var_names}; return one gradient (or None) per variable, in order."
                        )
                else:
                    input_grads, var_grads = grad_fn(*dys), ()
                arg_cts = _arg_cotangents(input_grads, a, fname)
                var_cts = [_cotangent(g, x, f"variable {n!r}")
                           for g, x, n in zip(var_grads, lifted, var_names, strict=False)]
                var_cts += [None] * (len(lifted) - n_vars)
                return jax.tree.unflatten(a_tree, arg_cts), var_cts

            return y, _closure_convert(backward, y)

    primal.defvjp(fwd, lambda backward, dys: backward(dys))
    return primal(args, originals)


def custom_gradient(f: Callable | None = None) -> Any:
    """Decorates `f(*args) -> (y, grad_fn)` so that `grad_fn` is its gradient (TF's `tf.custom_gradient`).

    `grad_fn(*dys)` returns one gradient per argument (a pytree like the
    argument, or None for zero); `dys` are the cotangents of `y` (one per
    element when `y` is a tuple or list). If `f` reads trainable Variables
    that are not among its arguments, `grad_fn(*dys, variables=[...])`
    receives them (sorted by name) and returns `(input_grads,
    variable_grads)`; those gradients reach an enclosing `jax.grad` over the
    pytree that holds the variables. Works under `jit`, `grad`, `vmap` and
    higher-order differentiation (when `grad_fn` is differentiable).

    Which variables count: those whose value `f` reads from outside (closed
    over, possibly tracers of an enclosing `jax.grad`); variables passed as
    arguments get input gradients instead, and variables only `grad_fn`
    reads get none (as TF). A variable version `f` makes itself (`assign`
    inside `f`) is internal. `f` runs twice per trace: once abstractly, to
    find what it reads, then inside the `custom_vjp`.

    Args:
        f: the function ``f(*args) -> (y, grad_fn)``; None (``@custom_gradient()``)
            returns the decorator itself.

    Returns:
        A function with `f`'s arguments returning `y`, differentiable by JAX
        through `grad_fn`.

    Raises:
        ValueError: (when called, as TF) keyword arguments to `f`, or
            `grad_fn` returning a wrong number of gradients or a gradient of
            the wrong shape.
        TypeError: (when called, as TF) `f` reads variables and `grad_fn` has
            no `variables` keyword.

    A UserWarning, as TF, when `grad_fn` names `variables` but `f` read none.

    >>> import jax, jax.numpy as jnp, varstate
    >>> @varstate.custom_gradient
    ... def clip_grad(x):
    ...     return x, lambda dy: jnp.clip(dy, -1.0, 1.0)
    >>> jax.grad(lambda x: 5.0 * clip_grad(x))(2.0).item()
    1.0
    >>> w = varstate.Variable(3.0, name="w")
    >>> def loss(params, x):
    ...     @varstate.custom_gradient
    ...     def scale(x):
    ...         def grad_fn(dy, variables):
    ...             return dy * params["w"].value, [dy * x * 10.0]  # a deliberately non-true rule
    ...         return x * params["w"].value, grad_fn
    ...     return scale(x)
    >>> g = jax.grad(loss)({"w": w}, 2.0)
    >>> g["w"].value.item()
    20.0
    """
    if f is None:
        return custom_gradient
    return _CustomGradient(f)
