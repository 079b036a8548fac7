"""`IndexedSlices`: a sparse set of rows of a dense tensor (TF's sparse gradient)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


class IndexedSlices:
    """Rows `values[i]` of a tensor of shape `dense_shape` at row `indices[i]`.

    A pytree: `values` and `indices` are children, `dense_shape` (a tuple or
    None) is static. Duplicate indices mean the rows add up, as in TF.

    Args:
        values: the rows, shape ``indices.shape + dense_shape[1:]``.
        indices: integer row indices into the first dimension.
        dense_shape: the full tensor's shape (a sequence of ints), or None
            when unknown (then `to_dense` cannot run).

    Raises:
        TypeError: `dense_shape` is neither None nor a sequence of ints.

    >>> import jax.numpy as jnp, varstate
    >>> s = varstate.IndexedSlices(jnp.ones((2, 3)), jnp.array([0, 2]), (4, 3))
    >>> s.to_dense().sum(axis=1).tolist()
    [3.0, 0.0, 3.0, 0.0]
    """

    __slots__ = ("dense_shape", "indices", "values")

    def __init__(self, values: Any, indices: Any, dense_shape: Any = None) -> None:
        if dense_shape is not None:
            try:
                dense_shape = tuple(int(d) for d in np.asarray(dense_shape).reshape(-1))
            except (TypeError, ValueError):
                raise TypeError(
                    f"IndexedSlices dense_shape must be a sequence of ints or None, got {dense_shape!r}."
                ) from None
        self.values = values
        self.indices = indices
        self.dense_shape = dense_shape

    @property
    def dtype(self) -> Any:
        """The dtype of `values`."""
        return self.values.dtype

    @property
    def shape(self) -> tuple[int, ...] | None:
        """The dense shape, or None when unknown (TF's ``IndexedSlices.shape``)."""
        return self.dense_shape

    def to_dense(self) -> jax.Array:
        """The dense tensor, duplicate rows summed and out-of-range rows dropped.

        Returns:
            A jax.Array of shape `dense_shape`, zeros where no row is given.

        Raises:
            ValueError: `dense_shape` is unknown (None).
        """
        if self.dense_shape is None:
            raise ValueError("IndexedSlices.to_dense: dense_shape is unknown; pass it to the constructor.")
        out = jnp.zeros(self.dense_shape, self.values.dtype)
        # Out-of-range rows, negative ones included, are dropped (TF's unsorted_segment_sum drops negatives).
        return out.at[self.indices].add(self.values, mode="drop", wrap_negative_indices=False)

    def __repr__(self) -> str:
        return (
            f"IndexedSlices(values={getattr(self.values, 'shape', '?')} {getattr(self.values, 'dtype', '')}, "
            f"indices={getattr(self.indices, 'shape', '?')}, dense_shape={self.dense_shape})"
        )


# Unflattening calls the constructor, whose dense_shape check passes the tuple it made.
jax.tree_util.register_dataclass(IndexedSlices, data_fields=["values", "indices"], meta_fields=["dense_shape"])
