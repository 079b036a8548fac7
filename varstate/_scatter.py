"""TF's scatter and gather methods of `Variable`, each a function of the variable returning the new value or the read.

Bit for bit as TF's CPU kernels, which apply an update after another in index
order: `mul` and `div`, and `max`/`min` of floats, run as a loop in that
order, because XLA's scatter fixes no order for duplicate indices (a product
of duplicates rounds differently, `.at[].divide` divides once by their
product) and its max propagates NaN and orders -0 below +0, where TF keeps the
element unless an update is strictly greater (a NaN in the variable stays, a
NaN update is ignored, of equal zeros the first wins). Sums (`add`, `sub`),
writes, and `max`/`min` of integers use XLA's scatter: exact on the CPU,
where XLA also applies duplicates in order; on a GPU the order of a float sum
of duplicates is XLA's (TF's GPU kernels fix none either). Indices are checked
outside jit (IndexError, as `scatter_add` always raised; TF raises
InvalidArgumentError); under jit they cannot be, and out-of-range ones are
dropped by a scatter and read as zeros by a gather (TF's GPU kernels do so).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from varstate._array_ops import _as_array, _unwrap
from varstate._indexed_slices import IndexedSlices
from varstate._jax_compat import Tracer

if TYPE_CHECKING:
    from varstate._variable import Variable

_DROP = {"mode": "drop", "wrap_negative_indices": False}
_FILL = {"mode": "fill", "fill_value": 0, "wrap_negative_indices": False}
# By the last part of an op's name: the `.at[]` method of XLA's scatter, or the combiner of the ordered loop.
_SCATTER = {"add": "add", "sub": "add", "update": "set", "max": "max", "min": "min"}
_IN_ORDER = {
    "mul": lax.mul,
    "div": lax.div,  # truncates an integer quotient toward zero, as C++ (TF)
    "max": lambda x, u: jnp.where(x < u, u, x),  # TF's kernel: std::max, the element kept unless u is greater
    "min": lambda x, u: jnp.where(u < x, u, x),
}


def _where(var: Variable, op: str) -> str:
    return f"Variable {var.name!r}.{op}"


def _rows_in_range(var: Variable, indices: jax.Array | np.ndarray, op: str) -> None:
    if isinstance(indices, Tracer) or not indices.size:
        return
    n = var.shape[0]
    bad = [i for i in (int(indices.min()), int(indices.max())) if not 0 <= i < n]
    if bad:  # the lowest index when it is negative, else the highest
        raise IndexError(
            f"{_where(var, op)}: index {bad[0]} is out of range for a first dimension of size {n} "
            f"(valid: 0..{n - 1})."
        )


def _host_indices(var: Variable, indices: Any, op: str) -> Any:
    """Numpy or Python `indices` as numpy, range-checked first when JAX would narrow them.

    With 64-bit types off, jnp.asarray wraps an int64 index into int32
    (2**32 + 1 becomes 1, a valid row), so the range check after it would pass.
    """
    nd = op == "gather_nd" or op.startswith("scatter_nd_")
    try:
        host = np.asarray(indices)
    except (TypeError, ValueError):
        return indices  # jnp.asarray says what is wrong with it
    if host.dtype == object:  # Python ints beyond int64 (or not numbers: left to jnp.asarray's message)
        huge = [i for i in host.ravel().tolist() if isinstance(i, int) and not isinstance(i, bool)]
        if huge and len(huge) == host.size:
            n = var.shape[0]
            valid = (f"the variable's shape {var.shape} (index j must be in 0..shape[j] - 1)" if nd else
                     f"a first dimension of size {n} (valid: 0..{n - 1})")
            raise IndexError(f"{_where(var, op)}: index {max(huge, key=abs)} is out of range for {valid}.")
        return indices
    if host.dtype.kind in "iu" and host.size:
        info = np.iinfo(jax.dtypes.canonicalize_dtype(host.dtype))
        if host.min() < info.min or host.max() > info.max:
            # Past every dimension JAX can hold, so these checks raise, naming the index.
            if nd:
                _depth(var, host, op)
            else:
                _rows_in_range(var, host, op)
    return host


def _value_and_indices(var: Variable, indices: Any, op: str) -> tuple[Any, jax.Array]:
    """`var`'s value, checked to have rows, and `indices`, checked to be integers."""
    if not var.shape:
        what, fix = ("a gather", "read_value()") if op in ("sparse_read", "gather_nd") else (
            "a scatter", "assign_add/assign_sub/assign")
        raise ValueError(
            f"{_where(var, op)}: {what} needs a variable of rank >= 1 (its rows), but {var.name!r} is a scalar; "
            f"use {fix}."
        )
    value = var.read_value()
    indices = _unwrap(indices)
    if not isinstance(indices, jax.Array):
        indices = _host_indices(var, indices, op)
    indices = jnp.asarray(indices)
    if not jnp.issubdtype(indices.dtype, jnp.integer):
        raise TypeError(f"{_where(var, op)}: indices must be integers, got {indices.dtype}.")
    return value, indices


def _updates(var: Variable, updates: Any, want: tuple[int, ...], why: str, op: str) -> Any:
    updates = _unwrap(updates)
    if isinstance(updates, (int, float, bool, list, tuple)) or (
            isinstance(updates, (np.ndarray, np.generic)) and np.can_cast(updates.dtype, var.dtype, "same_kind")):
        # As TF converts Python and numpy values to the variable's dtype; as `assign`, no fraction or overflow lost.
        updates = _as_array(updates, var.dtype, _where(var, op))
    if tuple(updates.shape) != want:
        raise ValueError(f"{_where(var, op)}: updates have shape {tuple(updates.shape)}, expected {want} ({why}).")
    if updates.dtype != var.dtype:
        raise TypeError(
            f"{_where(var, op)}: dtype mismatch: the variable is {var.dtype}, the updates are {updates.dtype}."
        )
    return updates


def _in_order(value: jax.Array, index_rows: jax.Array, updates: jax.Array, combine: Any) -> jax.Array:
    """`combine` each update into the slice of `value` its index row addresses, one after another in order.

    `index_rows` has shape (n, depth), `updates` (n, *value.shape[depth:]); out-of-range rows are skipped.
    """
    depth = index_rows.shape[1]
    bounds = jnp.asarray(value.shape[:depth])

    def one(i: Any, x: jax.Array) -> jax.Array:
        row = index_rows[i]
        inside = jnp.all((row >= 0) & (row < bounds))
        at = tuple(jnp.clip(row[j], 0, value.shape[j] - 1) for j in range(depth))
        old = x[at]
        return x.at[at].set(jnp.where(inside, combine(old, updates[i]), old))

    return lax.fori_loop(0, index_rows.shape[0], one, value)


def _combine(value: jax.Array, indices: jax.Array, depth: int, updates: jax.Array, kind: str) -> jax.Array:
    """`updates` combined into `value` at `indices` (shape (..., depth)) by `kind`, TF's way."""
    if kind in ("mul", "div") or (kind in ("max", "min") and jnp.issubdtype(value.dtype, jnp.inexact)):
        return _in_order(value, indices.reshape(-1, depth), updates.reshape(-1, *value.shape[depth:]),
                         _IN_ORDER[kind])
    at = value.at[tuple(indices[..., j] for j in range(depth))]
    if kind == "sub":
        updates = -updates
    return getattr(at, _SCATTER[kind])(updates, **_DROP)


def scatter(var: Variable, sparse_delta: Any, op: str) -> jax.Array:
    """The value after TF's `Variable.<op>(sparse_delta)`, op one of scatter_{add,sub,update,max,min,mul,div}."""
    if not isinstance(sparse_delta, IndexedSlices):
        raise TypeError(
            f"{_where(var, op)}: sparse_delta must be IndexedSlices, got {type(sparse_delta).__name__}."
        )
    value, indices = _value_and_indices(var, sparse_delta.indices, op)
    want = (*indices.shape, *var.shape[1:])
    updates = _updates(var, sparse_delta.values, want,
                       f"indices shape {tuple(indices.shape)} + variable shape {var.shape}[1:]", op)
    _rows_in_range(var, indices, op)
    return _combine(value, indices[..., None], 1, updates, op.removeprefix("scatter_"))


def _depth(var: Variable, indices: jax.Array | np.ndarray, op: str) -> int:
    """How many leading dimensions each index row of TF's `*_nd` ops addresses: the last dimension of `indices`."""
    depth = indices.shape[-1] if indices.ndim else 0
    if not 1 <= depth <= len(var.shape):
        raise ValueError(
            f"{_where(var, op)}: indices have shape {tuple(indices.shape)}, but their last dimension (how many "
            f"leading dimensions each index addresses) must be in 1..{len(var.shape)} for a variable of shape "
            f"{var.shape}."
        )
    if not isinstance(indices, Tracer) and indices.size:
        flat = np.asarray(indices).reshape(-1, depth)
        bad = np.flatnonzero(((flat < 0) | (flat >= np.asarray(var.shape[:depth]))).any(axis=1))
        if bad.size:
            at = ", ".join(str(int(i)) for i in np.unravel_index(bad[0], indices.shape[:-1]))
            raise IndexError(
                f"{_where(var, op)}: indices[{at}] = {flat[bad[0]].tolist()} is out of range for the variable's "
                f"shape {var.shape} (index j must be in 0..shape[j] - 1)."
            )
    return depth


def scatter_nd(var: Variable, indices: Any, updates: Any, op: str) -> jax.Array:
    """The value after TF's `Variable.<op>(indices, updates)`, op one of scatter_nd_{add,sub,update,max,min}."""
    value, indices = _value_and_indices(var, indices, op)
    depth = _depth(var, indices, op)
    want = (*indices.shape[:-1], *var.shape[depth:])
    updates = _updates(var, updates, want,
                       f"indices shape {tuple(indices.shape)}[:-1] + variable shape {var.shape}[{depth}:]", op)
    return _combine(value, indices, depth, updates, op.removeprefix("scatter_nd_"))


def sparse_read(var: Variable, indices: Any) -> jax.Array:
    """The rows of `var` at `indices` (TF's `sparse_read`: a gather along the first dimension)."""
    value, indices = _value_and_indices(var, indices, "sparse_read")
    _rows_in_range(var, indices, "sparse_read")
    return value.at[indices].get(**_FILL)


def gather_nd(var: Variable, indices: Any) -> jax.Array:
    """The slices of `var` that the rows of `indices` address (TF's `gather_nd`)."""
    value, indices = _value_and_indices(var, indices, "gather_nd")
    depth = _depth(var, indices, "gather_nd")
    return value.at[tuple(indices[..., j] for j in range(depth))].get(**_FILL)


def device(var: Variable) -> str:
    """TF's device string for where `var`'s value lives; the lowest-numbered device of a sharded one; "" if unknown."""
    sharding = None if isinstance(var._value, Tracer) else getattr(var._value, "sharding", None)
    if sharding is None:
        return ""
    d = min(sharding.device_set, key=lambda d: d.id)
    # TF numbers a device within its task; JAX's ids are global across processes.
    index = sorted(x.id for x in jax.devices(d.platform) if x.process_index == d.process_index).index(d.id)
    return f"/job:localhost/replica:0/task:{d.process_index}/device:{d.platform.upper()}:{index}"
