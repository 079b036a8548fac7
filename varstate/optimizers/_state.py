"""`OptimizerState`: slot Variables per primary and non-slot Variables by name."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

from varstate._variable import Variable


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class OptimizerState:
    """An optimizer's variables, as a pytree.

    slots:     {slot name: pytree with the params' structure}; a leaf is the
               slot Variable of the param at the same position, or None where
               the param has no slot (None gradient never seen, non-trainable).
    non_slots: {name: Variable}, e.g. Adam's ``beta1_power`` (scalars).

    Checkpoints record slots against their primary's node (`slot_variables`)
    and non-slots as children of the optimizer's node, as TF does.

    >>> import jax.numpy as jnp, varstate
    >>> from varstate.optimizers import Adam
    >>> w = varstate.Variable(jnp.zeros(2), name="kernel")
    >>> state = Adam().init({"w": w})
    >>> state.get_slot(w, "m").name, state.get_slot_names(), sorted(state.non_slots)
    ('kernel/m', ['m', 'v'], ['beta1_power', 'beta2_power'])
    """

    slots: dict[str, Any]
    non_slots: dict[str, Variable]

    def get_slot_names(self) -> list[str]:
        """Slot names, sorted (TF's `get_slot_names`)."""
        return sorted(self.slots)

    def get_slot(self, var: Variable, name: str) -> Variable | None:
        """The slot `name` of primary `var` (matched by resource id), or None (as TF)."""
        tree = self.slots.get(name)
        if tree is None:
            return None
        if not isinstance(var, Variable):
            raise TypeError(
                f"get_slot finds slots by their variable's identity; got {type(var).__name__}, which has none. "
                f"A plain-array param's slot sits at the param's position in state.slots[{name!r}]."
            )
        rid = var.resource_id
        for slot in jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, Variable)):
            if isinstance(slot, Variable) and slot.handle.slot_of == rid:
                return slot
        return None

    def non_slot(self, name: str) -> Variable:
        """The non-slot variable `name` (KeyError naming the known ones)."""
        try:
            return self.non_slots[name]
        except KeyError:
            raise KeyError(
                f"OptimizerState has no non-slot variable {name!r}; it has {sorted(self.non_slots)}."
            ) from None
