"""Mixed precision: TF/Keras's `Policy`, wrapping a params pytree for autocasting, loss scaling.

A training step in ``mixed_bfloat16``: keep the Variables in float32, wrap the
float ones with `autocast_variables`, compute inside
``varstate.autocast(policy.compute_dtype)``; with ``mixed_float16`` also wrap
the optimizer in `LossScaleOptimizer`.

>>> from varstate import mixed_precision
>>> policy = mixed_precision.Policy("mixed_bfloat16")
>>> policy.compute_dtype, policy.variable_dtype
('bfloat16', 'float32')
"""

from __future__ import annotations

from typing import Any as _Any

import jax as _jax
import jax.numpy as _jnp

from varstate._autocast import AutoCastVariable as _AutoCastVariable
from varstate._variable import Variable as _Variable
from varstate.optimizers._loss_scale import LossScaleOptimizer

__all__ = ["LossScaleOptimizer", "Policy", "autocast_variables"]

_REMOVED = {
    "infer_float32_vars": "'mixed_float16' or 'mixed_bfloat16'",
    "infer_with_float32_vars": "'mixed_float16' or 'mixed_bfloat16'",
    "float16_with_float32_vars": "'mixed_float16'",
    "bfloat16_with_float32_vars": "'mixed_bfloat16'",
}


# TF's dtype names that are not numpy's (numpy reads "float" as float64).
_TF_ALIASES = {"float": "float32", "half": "float16", "double": "float64"}
_MIXED = {"mixed_float16": "float16", "mixed_bfloat16": "bfloat16"}  # compute dtypes, with float32 variables


class Policy:
    """A dtype policy (TF's `tf.keras.mixed_precision.Policy`): compute and variable dtypes by name.

    ``"mixed_float16"`` / ``"mixed_bfloat16"`` compute in float16 / bfloat16
    with float32 variables; any dtype name (``"float32"``) uses that dtype for
    both.

    Args:
        name: the policy's name: ``"mixed_float16"``, ``"mixed_bfloat16"`` or
            a dtype name (TF's aliases such as ``"float"`` included).

    Raises:
        TypeError: `name` is not a string (a dtype object: pass its name).
        ValueError: `name` is unknown, or a removed ``*_float32_vars`` policy
            (as TF).

    >>> from varstate import mixed_precision
    >>> p = mixed_precision.Policy("mixed_bfloat16")
    >>> p, p.compute_dtype, p.variable_dtype
    (<Policy "mixed_bfloat16">, 'bfloat16', 'float32')
    """

    def __init__(self, name: str) -> None:
        if not isinstance(name, str):
            hint = " (a dtype: pass its name, e.g. 'float32')" if isinstance(name, (type, _jnp.dtype)) else ""
            raise TypeError(f"Policy name must be a string, got {type(name).__name__} {name!r}{hint}.")
        self._name = name
        self._compute_dtype, self._variable_dtype = _parse(name)

    @property
    def name(self) -> str:
        """The policy's name, as given."""
        return self._name

    @property
    def compute_dtype(self) -> str:
        """The dtype computations (and autocast reads) use, as a string."""
        return self._compute_dtype

    @property
    def variable_dtype(self) -> str:
        """The dtype variables are stored in, as a string."""
        return self._variable_dtype

    def __repr__(self) -> str:
        return f'<Policy "{self._name}">'

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Policy) and other._name == self._name

    def __hash__(self) -> int:
        return hash(self._name)


def _parse(name: str) -> tuple[str, str]:
    if name.endswith("_float32_vars"):
        use = _REMOVED.get(name)
        raise ValueError(
            f"Policy {name!r}: policies ending in '_float32_vars' were removed from TensorFlow"
            + (f"; use {use} instead." if use else "; use 'mixed_float16' or 'mixed_bfloat16'.")
        )
    if name in _MIXED:
        return _MIXED[name], "float32"
    if name in _TF_ALIASES:
        return _TF_ALIASES[name], _TF_ALIASES[name]
    try:
        dtype = _jnp.dtype(name)
    except TypeError:
        dtype = None
    if dtype is None or dtype.name != name:
        raise ValueError(
            f"Cannot make a mixed precision Policy from {name!r}: expected 'mixed_float16', "
            "'mixed_bfloat16' or a dtype name such as 'float32'."
        )
    return dtype.name, dtype.name


def autocast_variables(params: _Any) -> _Any:
    """`params` with each floating-point Variable wrapped in `AutoCastVariable` (others unchanged).

    Args:
        params: a pytree of Variables (and other leaves).

    Returns:
        The same structure, floating-point Variables wrapped; reads inside
        `varstate.autocast` then give the compute dtype.

    >>> import jax.numpy as jnp, varstate
    >>> from varstate import mixed_precision
    >>> params = {"w": varstate.Variable(jnp.ones(2), name="w"), "step": varstate.Variable(0, name="step")}
    >>> wrapped = mixed_precision.autocast_variables(params)
    >>> type(wrapped["w"]).__name__, type(wrapped["step"]).__name__
    ('AutoCastVariable', 'Variable')
    """
    def wrap(x: _Any) -> _Any:
        if isinstance(x, _Variable) and _jnp.issubdtype(x.dtype, _jnp.floating):
            return _AutoCastVariable(x)
        return x

    return _jax.tree.map(wrap, params, is_leaf=lambda x: isinstance(x, (_Variable, _AutoCastVariable)))
