"""`OptimizerState`: slot Variables per primary and non-slot Variables by name."""

from __future__ import annotations

from typing import Any

import jax

from varstate._variable import Variable
from varstate.optimizers._core import _packed


class OptimizerState:
    """An optimizer's variables, as a pytree: what `Optimizer.init` returns and every step takes and returns.

    Immutable (`replace` makes a changed copy). A fused state keeps the slots of
    many small params in a few packed buffers and updates each buffer with one
    computation; `slots` still shows every slot as a Variable (a view of its
    slice), so `get_slot`, checkpoints and restore see per-variable slots with
    TF's names and keys.

    Args:
        slots: ``{slot name: pytree with the params' structure}``; a leaf is the
            slot Variable of the param at the same position, or None where the
            param has no slot (None gradient never seen, non-trainable).
        non_slots: ``{name: Variable}``, e.g. Adam's ``beta1_power`` (scalars).
        packed: ``{slot name: tuple of 1-D buffers}``, one buffer per (dtype,
            sharding), when the state is fused (``opt.init(params, fused=True)``);
            None or empty otherwise.

    Checkpoints record slots against their primary's node (`slot_variables`)
    and non-slots as children of the optimizer's node, as TF does.

    >>> import jax.numpy as jnp, varstate
    >>> from varstate.optimizers import Adam
    >>> w = varstate.Variable(jnp.zeros(2), name="kernel")
    >>> state = Adam().init({"w": w})
    >>> state.get_slot(w, "m").name, state.get_slot_names(), sorted(state.non_slots)
    ('kernel/m', ['m', 'v'], ['beta1_power', 'beta2_power'])
    >>> b = varstate.Variable(jnp.zeros(3), name="bias")
    >>> fused = Adam().init({"w": w, "b": b}, fused=True)
    >>> fused.fused, fused.get_slot(b, "m").name, [x.shape for x in fused.packed["m"]]
    (True, 'bias/m', [(5,)])
    """

    _stored: dict[str, Any]
    _views: Any  # like _stored once built, None before (set through object.__setattr__, which mypy cannot follow)
    non_slots: dict[str, Variable]
    packed: dict[str, tuple]
    __slots__ = ("_stored", "_views", "non_slots", "packed")

    def __init__(self, slots: dict[str, Any], non_slots: dict[str, Variable],
                 packed: dict[str, tuple] | None = None) -> None:
        # `slots` may hold `_packed.PackedSlot` markers where `packed` holds the values (the internal layout).
        object.__setattr__(self, "_stored", slots)
        object.__setattr__(self, "non_slots", non_slots)
        object.__setattr__(self, "packed", packed or {})
        object.__setattr__(self, "_views", None)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"OptimizerState is immutable: use state.replace({name}=...) for a new one.")

    def __repr__(self) -> str:
        # Counts, not values: a model's worth of slot Variables would print for pages.
        counts = {n: sum(x is not None for x in (t.leaves() if isinstance(t, _packed.PackedTree) else
                                                  jax.tree.leaves(t, is_leaf=_packed.is_slot_leaf)))
                  for n, t in self._stored.items()}
        packed = {n: [b.shape for b in bs] for n, bs in self.packed.items()} if self.packed else None
        fused = f"packed={packed}" if packed else "fused=False"
        return f"OptimizerState(slots={counts}, non_slots={sorted(self.non_slots)}, {fused})"

    @property
    def slots(self) -> dict[str, Any]:
        """The slot Variables by slot name, each a tree with the params' structure.

        A fused state's are views of its packed buffers (made once, on first use).
        """
        if not self.packed:
            return self._stored
        if self._views is None:
            object.__setattr__(self, "_views", _packed.views(self._stored, self.packed))
        return self._views

    @property
    def fused(self) -> bool:
        """True if slots live in packed buffers (``opt.init(params, fused=True)``)."""
        return bool(self.packed)

    def replace(self, *, slots: dict[str, Any] | None = None, non_slots: dict[str, Variable] | None = None,
                ) -> OptimizerState:
        """A new state with these `slots` and/or `non_slots`; a fused state packs the given slots into its layout.

        Args:
            slots: ``{slot name: tree}`` replacing those of the same names;
                None keeps the slots.
            non_slots: ``{name: Variable}`` replacing all non-slots; None
                keeps them.

        Returns:
            The new `OptimizerState` (this one is unchanged).

        >>> import jax.numpy as jnp, varstate
        >>> from varstate.optimizers import Momentum
        >>> w = varstate.Variable(jnp.zeros(2), name="w")
        >>> state = Momentum(0.1, momentum=0.9).init([w], fused=True)
        >>> ones = {"momentum": [state.get_slot(w, "momentum").assign(jnp.ones(2))]}
        >>> state.replace(slots=ones).packed["momentum"][0].tolist()
        [1.0, 1.0]
        """
        non_slots = self.non_slots if non_slots is None else non_slots
        if slots is None:
            return OptimizerState(self._stored, non_slots, self.packed)
        if not self.packed:
            return OptimizerState(slots, non_slots)
        stored, packed = _packed.repack(self._stored, self.packed, slots)
        return OptimizerState(stored, non_slots, packed)

    def get_slot_names(self) -> list[str]:
        """Slot names, sorted (TF's `get_slot_names`).

        Returns:
            A list of str.
        """
        return sorted(self._stored)

    def get_slot(self, var: Variable, name: str) -> Variable | None:
        """The slot `name` of primary `var`, matched by resource id (TF's `get_slot`).

        Args:
            var: the primary Variable (any version of it).
            name: the slot's name (``"m"``, ``"momentum"``...).

        Returns:
            The slot Variable, or None when there is no such slot (as TF).

        Raises:
            TypeError: `var` is not a Variable (a plain-array param's slot is
                at the param's position in ``state.slots[name]``).
        """
        tree = self.slots.get(name)
        if tree is None:
            return None
        if not isinstance(var, Variable):
            raise TypeError(
                f"get_slot finds slots by their variable's identity; got {type(var).__name__}, which has none. "
                f"A plain-array param's slot sits at the param's position in state.slots[{name!r}]."
            )
        return next((s for s in jax.tree.leaves(tree, is_leaf=_packed.is_slot_leaf)
                     if isinstance(s, Variable) and s.handle.slot_of == var.resource_id), None)

    def non_slot(self, name: str) -> Variable:
        """The non-slot variable `name` (Adam's ``beta1_power``, Keras's ``iteration``...).

        Args:
            name: the non-slot's name.

        Returns:
            The Variable.

        Raises:
            KeyError: no non-slot has that name (the message lists them).
        """
        try:
            return self.non_slots[name]
        except KeyError:
            raise KeyError(
                f"OptimizerState has no non-slot variable {name!r}; it has {sorted(self.non_slots)}."
            ) from None


_KEYS = (jax.tree_util.GetAttrKey("slots"), jax.tree_util.GetAttrKey("non_slots"), jax.tree_util.GetAttrKey("packed"))
jax.tree_util.register_pytree_with_keys(
    OptimizerState,
    lambda s: (tuple(zip(_KEYS, (s._stored, s.non_slots, s.packed), strict=True)), None),
    lambda _, children: OptimizerState(*children),
    lambda s: ((s._stored, s.non_slots, s.packed), None),
)
