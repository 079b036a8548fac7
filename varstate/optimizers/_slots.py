"""Where optimizer state lives: slot Variables beside their primaries, non-slot scalars with the first.

A slot (TF's `slot_creator`) is a non-trainable Variable named
``<primary name>/<slot name>``, in the primary's registry, with its shape,
dtype and sharding, linked to it by resource id so that checkpoints file it
under the primary.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from varstate._registry import outside_name_scopes
from varstate._variable import Variable
from varstate.optimizers._matching import _value


def make_slot(primary: Variable, slot_name: str, value: Any) -> Variable:
    """A slot Variable for `primary` (TF's `_create_slot_var`), linked by resource id.

    Named ``<primary name>/<slot name>``, non-trainable, in the primary's
    registry; a shard's slot gets the shard's slice of a full slot named
    ``<full name>/<slot name>``.
    """
    info = primary.save_slice_info
    if info is not None:
        info = type(info)(f"{info.full_name}/{slot_name}", info.full_shape, info.var_offset, info.var_shape)
    registry = primary._handle.registry
    with outside_name_scopes():  # the primary's name has its scope already
        slot = Variable(value, name=f"{primary.name}/{slot_name}", trainable=False,
                        save_slice_info=info, registry=registry)
    slot._handle.slot_of = primary.resource_id
    slot._handle.slot_name = slot_name
    return slot


def _scalar_placement(first: Variable | None) -> Any:
    """Where a non-slot scalar lives: with the first variable (TF colocates it), replicated over its mesh."""
    sharding = getattr(first, "sharding", None) if first is not None else None
    if isinstance(sharding, jax.sharding.NamedSharding):
        return jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec())
    if isinstance(sharding, jax.sharding.SingleDeviceSharding):
        return sharding
    return None


def _make_slot(p: Any, slot_name: str, fill: float) -> Any:
    value = _value(p)
    sharding = getattr(value, "sharding", None)
    if isinstance(value, jax.ShapeDtypeStruct):
        raise ValueError(
            f"Optimizer.init: {p.name!r} is uninitialized; initialize or restore it before creating slots."
        )
    slot_value = jnp.full(value.shape, fill, value.dtype, device=sharding)
    return make_slot(p, slot_name, slot_value) if isinstance(p, Variable) else slot_value
