"""Matching gradients to params: the checks and conversions before an optimizer's kernels run.

Each param leaf (a Variable or a plain array) is paired with the gradient
leaf at the same place; None gradients and non-trainable Variables are
skipped; gradients are converted to arrays or `IndexedSlices` and checked
against their variable (dtype, shape, row indices); the gradients of a
variable found at several places (tied weights) are summed.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from varstate._conversion import convert_to_tensor_or_indexed_slices
from varstate._indexed_slices import IndexedSlices
from varstate._jax_compat import Tracer
from varstate._variable import Variable
from varstate.optimizers._core._rows import add_rows

# The entry point a step's messages name: `apply_gradients` sets it for its whole call, an optimizer's `update`
# called on its own (eagerly or in the user's jit) for its own; None: neither is running.
_entry: contextvars.ContextVar[str | None] = contextvars.ContextVar("varstate_step_entry", default=None)


def entry() -> str:
    """``apply_gradients`` or ``Adam.update``: where a message of the running step says it happened."""
    return _entry.get() or "apply_gradients"


@contextlib.contextmanager
def _holding(var: contextvars.ContextVar, value: Any) -> Iterator[None]:
    token = var.set(value)
    try:
        yield
    finally:
        var.reset(token)


def entered(name: str) -> contextlib.AbstractContextManager:
    """Makes `name` the entry point of the messages raised inside, unless one is running already."""
    return _holding(_entry, name) if _entry.get() is None else contextlib.nullcontext()


def is_var(x: Any) -> bool:
    return isinstance(x, Variable)


def array_of(p: Any) -> Any:
    return p._value if isinstance(p, Variable) else p


def with_value(x: Any, value: Any) -> Any:
    """A new version of the Variable `x` holding `value`; a plain-array param or slot is the value itself."""
    return x._with_value(value) if isinstance(x, Variable) else value


# While a packed step runs its update over [*unpacked params, *buffers], the labels of those list positions as
# the caller knows them (the Packed's keys); None otherwise.
_packed_labels: contextvars.ContextVar[list[str] | None] = contextvars.ContextVar("varstate_packed_labels",
                                                                                   default=None)


def labelled_as(labels: list[str]) -> contextlib.AbstractContextManager:
    return _holding(_packed_labels, labels)


def path_label(path: tuple, p: Any) -> str:
    labels = _packed_labels.get()
    if labels is not None and len(path) == 1 and isinstance(path[0], jax.tree_util.SequenceKey):
        return labels[path[0].idx]
    where = jax.tree_util.keystr(path) or "<root>"
    return f"{p.name!r} (params{where})" if isinstance(p, Variable) else f"params{where}"


def _explicit_sharding(value: Any) -> Any:
    """The sharding in `value`'s type when its mesh has Explicit axes (then it is part of the type), else None."""
    sharding = getattr(jax.typeof(value), "sharding", None)
    mesh = getattr(sharding, "mesh", None)
    if any(t == jax.sharding.AxisType.Explicit for t in getattr(mesh, "axis_types", ())):
        return sharding
    return None


def cast_like(new: Any, param: Any) -> Any:
    """`new` (a gradient, a new value or slot of `param`) on `param`'s sharding when that is part of the type.

    TF applies an update on the variable's device; with Explicit mesh axes the
    shardings are types, so a gradient sharded otherwise is moved to the
    param's first (else the arithmetic mixes both, or refuses), and the
    results keep the param's type (a `lax.cond` over the step needs it).
    """
    want = _explicit_sharding(param)
    if want is None or tuple(new.shape) != tuple(param.shape) or jax.typeof(new).sharding == want:
        return new
    return jax.sharding.reshard(new, want)


def first_difference(a: Any, b: Any, names: tuple[str, str] = ("grads", "params"),
                     items: tuple[str, str] = ("param", "gradient")) -> str:
    """The first place where two trees differ (a key path, a container's type, a Variable), as a readable string."""
    def flat(tree):
        return [(jax.tree_util.keystr(p), x) for p, x in jax.tree_util.tree_flatten_with_path(tree, _is_leaf)[0]]

    a_flat, b_flat = flat(a), flat(b)
    for (at, _), (bt, _) in zip(a_flat, b_flat, strict=False):
        if at != bt:
            # One tree lacking an entry the other has (a missing gradient) shifts every later pair: say which.
            in_a, in_b = bt in {p for p, _ in a_flat}, at in {p for p, _ in b_flat}
            if in_b and not in_a:
                return f"{names[1]}{bt or '<root>'} has no matching {items[1]}"
            if in_a and not in_b:
                return f"{names[0]}{at or '<root>'} has no matching {items[0]}"
            return f"{names[0]}{at or '<root>'} vs {names[1]}{bt or '<root>'}"
    if len(a_flat) != len(b_flat):
        (longer, name, item), n = ((a_flat, names[0], items[0]) if len(a_flat) > len(b_flat) else
                                   (b_flat, names[1], items[1])), min(len(a_flat), len(b_flat))
        return f"{name}{longer[n][0]} has no matching {item}"
    found = _container_difference(a, b, "", names)
    for (at, x), (_, y) in zip(a_flat, b_flat, strict=True):
        if found is None and (is_var(x) != is_var(y) or (is_var(x) and x.resource_id != y.resource_id)):
            found = f"{names[0]}{at or '<root>'} is {_what(x)} where {names[1]}{at or '<root>'} is {_what(y)}"
    return found or "a container's static data differs (same keys)"


def _is_leaf(x: Any) -> bool:
    return x is None or isinstance(x, (Variable, IndexedSlices))


def _what(x: Any) -> str:
    return f"Variable {x.name!r}" if isinstance(x, Variable) else f"a {type(x).__name__}"


def _container_difference(a: Any, b: Any, at: str, names: tuple[str, str]) -> str | None:
    """Where two trees with the same key paths differ in a container's type (a list for a tuple), or None."""
    def is_leaf(x):
        return _is_leaf(x) or jax.tree_util.treedef_is_leaf(jax.tree_util.tree_structure(x))

    if is_leaf(a) or is_leaf(b):
        return None
    if type(a) is not type(b):
        return f"{names[0]}{at} is a {type(a).__name__} where {names[1]}{at} is a {type(b).__name__}"

    def children(x):  # one level down, with the key of each child
        return jax.tree_util.tree_flatten_with_path(x, is_leaf=lambda y: y is not x)[0]

    for (path, x), (_, y) in zip(children(a), children(b), strict=False):
        found = _container_difference(x, y, at + jax.tree_util.keystr(path), names)
        if found:
            return found
    return None


def flatten_grads(grads: Any, params: Any) -> tuple[list, list, Any, list]:
    """(param leaves, grad leaves, param treedef, key paths), grads matched to params' structure."""
    flat, p_def = jax.tree_util.tree_flatten_with_path(params, is_leaf=is_var)
    try:
        g_leaves = p_def.flatten_up_to(grads)
    except (ValueError, TypeError):
        raise ValueError(
            f"{entry()}: grads do not have the structure of params; first difference: "
            f"{first_difference(grads, params)}. Pass grads with exactly the structure of params "
            "(None for a param without gradient)."
        ) from None
    paths = [p for p, _ in flat]
    return [x for _, x in flat], g_leaves, p_def, paths


def owner_positions(leaves: list) -> list[int]:
    """For each leaf, the index of the first leaf holding the same variable (itself if none)."""
    first: dict[int, int] = {}
    return [first.setdefault(p.resource_id, i) if isinstance(p, Variable) else i for i, p in enumerate(leaves)]


def _sum_grads(a: Any, b: Any, shape: tuple) -> Any:
    """The sum of two gradients of one variable, sparse while both are."""
    if isinstance(a, IndexedSlices) and isinstance(b, IndexedSlices):
        return IndexedSlices(jnp.concatenate([a.values, b.values]), jnp.concatenate([a.indices, b.indices]), shape)

    def dense(g):
        return add_rows(jnp.zeros(shape, g.values.dtype), g.indices, g.values) if isinstance(g, IndexedSlices) else g

    return dense(a) + dense(b)


def check_indices_range(indices: Any, nrows: int, label: str) -> None:
    """IndexError (TF: InvalidArgumentError) for concrete out-of-range indices."""
    if isinstance(indices, Tracer):
        return
    idx = np.asarray(indices).reshape(-1)
    bad = np.flatnonzero((idx < 0) | (idx >= nrows))
    if bad.size:
        k = int(bad[0])
        raise IndexError(
            f"{entry()}: IndexedSlices gradient for {label}: index {int(idx[k])} at offset {k} in "
            f"indices is out of range for a first dimension of size {nrows} (valid: 0..{nrows - 1})."
        )


def convert_grad(g: Any, var: Any, label: str) -> Any:
    """The gradient as an array or IndexedSlices of values, checked against the variable."""
    if not jnp.issubdtype(var.dtype, jnp.inexact):
        raise ValueError(
            f"{entry()}: {label} has dtype {var.dtype}; optimizers update floating-point or complex "
            "variables only (as TF's). Make it trainable=False, or pass None as its gradient."
        )
    if isinstance(g, IndexedSlices):
        values = array_of(g.values)
        indices = array_of(g.indices)
        if not hasattr(values, "shape") or not hasattr(indices, "shape"):
            values, indices = jnp.asarray(values), jnp.asarray(indices)
        if not jnp.issubdtype(indices.dtype, jnp.integer) or indices.ndim != 1:
            raise TypeError(
                f"{entry()}: IndexedSlices gradient for {label}: indices must be a 1-D integer array, "
                f"got shape {tuple(indices.shape)} dtype {indices.dtype}."
            )
        if var.ndim == 0 or tuple(values.shape) != (indices.shape[0], *var.shape[1:]):
            raise ValueError(
                f"{entry()}: IndexedSlices gradient for {label}: values have shape {tuple(values.shape)}, "
                f"expected {(indices.shape[0], *var.shape[1:])} (indices shape {tuple(indices.shape)} + "
                f"variable shape {tuple(var.shape)}[1:])."
            )
        if g.dense_shape is not None and tuple(g.dense_shape) != tuple(var.shape):
            raise ValueError(
                f"{entry()}: IndexedSlices gradient for {label}: dense_shape {tuple(g.dense_shape)} "
                f"differs from the variable's shape {tuple(var.shape)}."
            )
        _check_dtype(values.dtype, var.dtype, label)
        return IndexedSlices(values, indices, g.dense_shape)
    try:
        g = convert_to_tensor_or_indexed_slices(g)
    except TypeError:
        raise TypeError(
            f"{entry()}: gradient for {label} must be convertible to a Tensor or IndexedSlices, "
            f"or None: got {type(g).__name__} {g!r:.60}."
        ) from None
    if tuple(g.shape) != tuple(var.shape):
        raise ValueError(
            f"{entry()}: gradient for {label} has shape {tuple(g.shape)}, "
            f"the variable has shape {tuple(var.shape)}."
        )
    _check_dtype(g.dtype, var.dtype, label)
    return g


def _check_dtype(got: Any, want: Any, label: str) -> None:
    if got != want:
        raise TypeError(
            f"{entry()}: gradient for {label} has dtype {got}, the variable has dtype {want}. "
            f"Cast the gradient with .astype({want})."
        )


def gradients_by_owner(p_leaves: list, g_leaves: list, paths: list, owners: list[int]) -> dict[int, Any]:
    """{owner index: converted gradient} for every trainable param with a gradient.

    One entry per variable: the gradients of a variable found at several
    places (tied weights) add up, as TF's tape adds the contributions of every
    read. ValueError when no param has a gradient.
    """
    work: dict[int, Any] = {}
    for i, (p, g) in enumerate(zip(p_leaves, g_leaves, strict=True)):
        if g is None or (isinstance(p, Variable) and not p.trainable):
            continue
        label = path_label(paths[i], p)
        g = convert_grad(g, array_of(p), label)
        if isinstance(g, IndexedSlices):
            check_indices_range(g.indices, array_of(p).shape[0], label)
        else:
            g = cast_like(g, array_of(p))
        work[owners[i]] = g if owners[i] not in work else _sum_grads(work[owners[i]], g, array_of(p).shape)
    if not work:
        raise ValueError(
            f"{entry()}: no gradients provided for any variable (every gradient is None or its "
            f"variable is non-trainable): {[path_label(paths[i], p) for i, p in enumerate(p_leaves)]}."
        )
    return work


def _validate_grads(grads: Any, params: Any) -> None:
    p_leaves, g_leaves, _, paths = flatten_grads(grads, params)
    for i, (p, g) in enumerate(zip(p_leaves, g_leaves, strict=True)):
        if g is not None:
            convert_grad(g, array_of(p), path_label(paths[i], p))


def _check_sparse_indices(grads: Any, params: Any) -> None:
    """Checks concrete IndexedSlices indices before jit, where they are still visible."""
    try:
        p_leaves, g_leaves, _, paths = flatten_grads(grads, params)
    except ValueError:
        return  # reported with its path when the step is traced
    for i, (p, g) in enumerate(zip(p_leaves, g_leaves, strict=True)):
        if isinstance(g, IndexedSlices) and hasattr(array_of(p), "shape") and array_of(p).ndim:
            check_indices_range(array_of(g.indices), array_of(p).shape[0], path_label(paths[i], p))
