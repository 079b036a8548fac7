"""varstate: TensorFlow's resource variables as functional JAX pytrees.

A Variable keeps its name and identity across new versions of its value, inside `jax.jit` too:

>>> import jax, jax.numpy as jnp, varstate
>>> w = varstate.Variable(jnp.ones(2), name="w")
>>> w2 = jax.jit(lambda w: w.assign_add(jnp.ones(2)))(w)
>>> w2.name, w2.value.tolist(), w2.resource_id == w.resource_id
('w', [2.0, 2.0], True)
"""

from importlib import metadata as _metadata

from varstate import mixed_precision, nnx, optimizers
from varstate._autocast import AutoCastVariable, autocast
from varstate._conversion import convert_to_tensor_or_indexed_slices
from varstate._custom_gradient import custom_gradient
from varstate._global_step import assert_global_step, get_or_create_global_step
from varstate._indexed_slices import IndexedSlices
from varstate._initializers import uninitialized, zero_initializer
from varstate._pack import Packed, pack
from varstate._partition import (
    PartitionedVariable,
    SaveSliceInfo,
    expand_variables,
    fixed_size_partitioner,
    variable_axis_size_partitioner,
)
from varstate._registry import Registry, name_scope
from varstate._values import tree_map, values, with_values
from varstate._variable import (
    DonatedVariableError,
    ResourceHandle,
    Variable,
    VariableAggregation,
    VariableSynchronization,
    format_device,
    is_resource_variable,
)

try:  # the version lives in pyproject.toml only: the installed distribution's, as checkpoint.__version__
    __version__ = _metadata.version("varstate")
except _metadata.PackageNotFoundError:
    __version__ = "unknown (varstate is not installed; running from a source tree)"

__all__ = [
    "AutoCastVariable",
    "DonatedVariableError",
    "IndexedSlices",
    "Packed",
    "PartitionedVariable",
    "Registry",
    "ResourceHandle",
    "SaveSliceInfo",
    "Variable",
    "VariableAggregation",
    "VariableSynchronization",
    "assert_global_step",
    "autocast",
    "convert_to_tensor_or_indexed_slices",
    "custom_gradient",
    "expand_variables",
    "fixed_size_partitioner",
    "format_device",
    "get_or_create_global_step",
    "is_resource_variable",
    "mixed_precision",
    "name_scope",
    "nnx",
    "optimizers",
    "pack",
    "tree_map",
    "uninitialized",
    "values",
    "variable_axis_size_partitioner",
    "with_values",
    "zero_initializer",
]
