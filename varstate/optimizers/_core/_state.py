"""`OptimizerState`: slot Variables per primary and non-slot Variables by name."""

from __future__ import annotations

import copy
from typing import Any

import jax
import jax.numpy as jnp

from varstate._autocast import AutoCastVariable, flatten_autocast, unflatten_autocast
from varstate._jax_compat import ArrayImpl, container_registry
from varstate._variable import Variable, version, versions
from varstate.optimizers._core import _packed, _traced


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
        traced: ``{name: (float32 value, float32 1 - value)}``, the traced
            hyperparameters (`varstate.optimizers.traced`); read them as
            `hyperparameters`, set them with `with_hyperparameters`.

    Checkpoints record slots against their primary's node (`slot_variables`)
    and non-slots as children of the optimizer's node, as TF does. Traced
    hyperparameters are not saved (TF v1's checkpoints hold none): a restore
    keeps the template state's values. Keras's ``learning_rate`` is a
    non-slot, saved and restored as Keras does.

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

    # Set through object.__setattr__, which mypy cannot follow. _parts: (stored slots, non_slots, packed, traced), made
    # from _flat on first read when a step returned this state; _flat: (the step's `LeafLayout`, its values) or
    # None; _views: like the stored slots once built (a fused state's), None before.
    _parts: tuple | None
    _flat: tuple | None
    _views: Any
    __slots__ = ("_flat", "_parts", "_views")

    def __init__(self, slots: dict[str, Any], non_slots: dict[str, Variable],
                 packed: dict[str, tuple] | None = None, traced: dict[str, tuple] | None = None) -> None:
        # `slots` may hold `_packed.PackedSlot` markers where `packed` holds the values (the internal layout).
        object.__setattr__(self, "_parts", (slots, non_slots, packed or {}, traced or {}))
        object.__setattr__(self, "_flat", None)
        object.__setattr__(self, "_views", None)

    @classmethod
    def _from_flat(cls, layout: LeafLayout, values: list) -> OptimizerState:
        """The state a step returned, as its flat values: its Variables are made when first read.

        A training loop hands the state straight back to the next step, which
        then takes `values` as they are: no Variable per slot is made, read
        or checked on the way (`_step._recall`).
        """
        state = object.__new__(cls)
        object.__setattr__(state, "_parts", None)
        object.__setattr__(state, "_flat", (layout, values))
        object.__setattr__(state, "_views", None)
        return state

    def _made(self) -> tuple:
        parts = self._parts
        if parts is None:
            layout, values = self._flat  # type: ignore[misc]  # one of the two is always set
            parts = layout.rebuild(values)
            object.__setattr__(self, "_parts", parts)
        return parts

    @property
    def _stored(self) -> dict[str, Any]:
        return self._made()[0]

    @property
    def non_slots(self) -> dict[str, Variable]:
        """The non-slot Variables by name (Adam's ``beta1_power``, Keras's ``iteration``...)."""
        return self._made()[1]

    @property
    def packed(self) -> dict[str, tuple]:
        """The buffers of a fused state (``{slot name: tuple of 1-D buffers}``), empty when unfused."""
        return self._made()[2]

    @property
    def _traced(self) -> dict[str, tuple]:
        return self._made()[3]

    @property
    def hyperparameters(self) -> dict[str, Any]:
        """The hyperparameter values this state holds, the traced ones and Keras's ``learning_rate`` non-slot.

        A traced hyperparameter (`varstate.optimizers.traced`) is a float32
        scalar here (with a leading run axis in a stacked state); the step
        reads it from the state, so a new value needs no new compile.

        >>> import jax.numpy as jnp
        >>> from varstate.optimizers import Momentum, traced
        >>> state = Momentum(traced(0.1), momentum=traced(0.9)).init([jnp.zeros(2)])
        >>> {k: round(float(v), 4) for k, v in state.hyperparameters.items()}
        {'learning_rate': 0.1, 'momentum': 0.9}
        """
        out = {name: value for name, (value, _) in self._traced.items()}
        lr = self.non_slots.get("learning_rate")
        if isinstance(lr, Variable) and "learning_rate" not in out:
            out["learning_rate"] = lr.value
        return out

    def with_hyperparameters(self, **values: Any) -> OptimizerState:
        """A new state with these hyperparameter values (traced ones, or Keras's ``learning_rate``).

        A Python float is rounded to float32 as the static path rounds it
        (and Keras's host constants such as ``1 - beta_1`` from its double);
        an array, or a traced value inside ``jax.vmap`` or ``jax.jit``, is
        taken as float32. An array with a leading axis sets a stacked
        state's values, one per run. A concrete value is placed as the one
        it replaces, so the next step does not compile again.

        Args:
            **values: ``name=value`` for hyperparameters this state holds.

        Returns:
            The new `OptimizerState` (this one is unchanged).

        Raises:
            TypeError: a name the state holds no value for (the message lists
                those it holds, and how to declare one traced), or a value
                that is not a real number.

        >>> import jax.numpy as jnp
        >>> from varstate.optimizers import Adam, traced
        >>> state = Adam(traced(0.1)).init([jnp.zeros(2)])
        >>> float(state.with_hyperparameters(learning_rate=0.25).hyperparameters["learning_rate"])
        0.25
        """
        traced, non_slots = dict(self._traced), dict(self.non_slots)
        for name, value in values.items():
            where = f"OptimizerState.with_hyperparameters({name}=...)"
            if name in traced:
                old = traced[name][0]
                new, one_minus = (_shaped_as(x, old, name) for x in _traced.entry(value, where))
                traced[name] = (_placed_as(new, old), _placed_as(one_minus, traced[name][1]))
                power = non_slots.get(f"{name}_power")
                if isinstance(power, Variable):
                    # TF's Adam starts beta1_power at beta1 and multiplies it by beta1 each step. Where it still
                    # holds the beta it started at (no step yet), it starts at the new one: the run is then the
                    # run made with that beta. After a step it keeps the product of the betas used, as in TF
                    # when a fed beta changes.
                    fresh = power.value == old
                    non_slots[name + "_power"] = power._with_value(
                        _placed_as(jnp.where(fresh, new, power.value), power.value))
            elif name == "learning_rate" and isinstance(non_slots.get(name), Variable):
                old = non_slots[name]
                non_slots[name] = old._with_value(_placed_as(_traced.entry(value, where)[0], old.value))
            else:
                raise TypeError(
                    f"OptimizerState.with_hyperparameters: the state holds no value of {name!r} (it holds "
                    f"{sorted(self.hyperparameters)}). Declare the hyperparameter traced when making the "
                    f"optimizer ({name}=varstate.optimizers.traced(value), a float the step reads; a schedule "
                    "needs none), and make the state with its init (or opt.with_hyperparameters(state, ...), "
                    "which adds it)."
                )
        return OptimizerState(self._stored, non_slots, self.packed, traced)

    def _non_slot_values(self) -> list:
        """The non-slots' values in `non_slots`' order (None for one that is not a Variable), read from a step's
        flat values when this state is one's (no Variable made)."""
        flat = self._flat
        if flat is not None and flat[0].non_slots is not None:
            return flat[1][slice(*flat[0].non_slots)]
        return [v._value if isinstance(v, Variable) else None for v in self.non_slots.values()]

    def __copy__(self) -> OptimizerState:
        return self  # immutable: its copy is the same state, as for a tuple

    def __deepcopy__(self, memo: dict) -> OptimizerState:
        # Values copied, identities kept (as a Variable's deep copy), so each slot stays linked to its primary.
        return OptimizerState(*(copy.deepcopy(part, memo) for part in self._made()))

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"OptimizerState is immutable: use state.replace({name}=...) for a new one.")

    def __repr__(self) -> str:
        # Counts, not values: a model's worth of slot Variables would print for pages.
        counts = {n: sum(x is not None for x in (t.leaves() if isinstance(t, _packed.PackedTree) else
                                                  jax.tree.leaves(t, is_leaf=_packed.is_slot_leaf)))
                  for n, t in self._stored.items()}
        packed = {n: [b.shape for b in bs] for n, bs in self.packed.items()} if self.packed else None
        fused = f"packed={packed}" if packed else "fused=False"
        traced = f", traced={sorted(self._traced)}" if self._traced else ""
        return f"OptimizerState(slots={counts}, non_slots={sorted(self.non_slots)}, {fused}{traced})"

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
            return OptimizerState(self._stored, non_slots, self.packed, self._traced)
        if not self.packed:
            return OptimizerState(slots, non_slots, None, self._traced)
        stored, packed = _packed.repack(self._stored, self.packed, slots)
        return OptimizerState(stored, non_slots, packed, self._traced)

    def get_slot_names(self) -> list[str]:
        """Slot names, sorted (TF's `get_slot_names`).

        Returns:
            A list of str.
        """
        return sorted(self._stored)

    def get_slot(self, var: Variable | AutoCastVariable, name: str) -> Variable | None:
        """The slot `name` of primary `var`, matched by resource id (TF's `get_slot`).

        Args:
            var: the primary Variable (any version of it), or a wrapper of
                it such as an `AutoCastVariable` (as TF's `get_slot` takes one).
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
        if hasattr(var, "__varstate_variable__"):  # the wrappers' protocol (AutoCastVariable), as grads and saves
            var = var.__varstate_variable__()
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


def _shaped_as(new: Any, old: Any, name: str) -> Any:
    """A hyperparameter's new value in the shape of the one it replaces: a scalar is every run's value in a stacked
    state; another shape is refused (a vector given to one run would become a value per element)."""
    if new.shape == old.shape:
        return new
    if new.shape == ():
        return jnp.broadcast_to(new, old.shape)
    raise ValueError(
        f"OptimizerState.with_hyperparameters: {name} has shape {tuple(new.shape)}, but the state holds it with "
        f"shape {tuple(old.shape)} ({'one value per run of a stacked state' if old.shape else 'one value'}). Give a "
        f"scalar{f' or an array of shape {tuple(old.shape)}' if old.shape else ''}; to run several values at "
        "once, stack the state (a run axis on every leaf) and vmap the step."
    )


def _placed_as(new: Any, old: Any) -> Any:
    """`new` placed as the concrete array `old` (committed where it is) when both are concrete; else `new`."""
    if (type(old) is ArrayImpl and old.committed and type(new) is ArrayImpl and new.shape == old.shape
            and old.is_fully_addressable):
        return jax.device_put(new, old.sharding)
    return new


def flatten_state(s: OptimizerState) -> tuple[tuple, None]:
    """The state's pytree children and static data."""
    return s._made(), None


def unflatten_state(_: None, children: Any) -> OptimizerState:
    return OptimizerState(*children)


_KEYS = tuple(map(jax.tree_util.GetAttrKey, ("slots", "non_slots", "packed", "traced")))
jax.tree_util.register_pytree_with_keys(
    OptimizerState,
    lambda s: (tuple(zip(_KEYS, s._made(), strict=True)), None),
    unflatten_state,
    flatten_state,
)


# A registry of Python's containers, the state's two classes and AutoCastVariable (mixed precision's params),
# registered as in the default one: the same structure and leaf order, except that a Variable is a leaf itself
# here (its value, there). A class left out is a leaf here, which sends every step with it the slow way.
CONTAINERS = container_registry()
if CONTAINERS is not None:
    CONTAINERS.register_node(OptimizerState, flatten_state, unflatten_state)
    CONTAINERS.register_node(_packed.PackedTree, _packed.flatten_packed, _packed.unflatten_packed)
    CONTAINERS.register_node(AutoCastVariable, flatten_autocast, unflatten_autocast)


class LeafLayout:
    """A tree's layout as `CONTAINERS` flattens it, for a step to read and rebuild the tree without a Python call
    per Variable.

    `c_def` is the containers' treedef; `marks` holds, per leaf, its
    Variable's handle or, for another leaf, its type: a tree with this
    `c_def` and these marks has one default treedef (identities included),
    and `rebuild` gives what that treedef's `unflatten` would. `non_slots`:
    for a state's parts, the range of its non-slots' values among the leaves
    (each a Variable), else None.
    """

    __slots__ = ("all_vars", "c_def", "handles", "marks", "non_slots")

    def __init__(self, c_def: Any, leaves: list, non_slots: tuple[int, int] | None = None) -> None:
        self.c_def, self.non_slots = c_def, non_slots
        self.handles = [x._handle if type(x) is Variable else None for x in leaves]
        self.marks = self.marks_of(leaves)
        self.all_vars = None not in self.handles

    @staticmethod
    def of(tree: Any, non_slots: Any = None) -> LeafLayout | None:
        """`tree`'s layout; None when `CONTAINERS` cannot stand in for the default registry on it (it holds a class
        registered there alone: an AutoCastVariable, IndexedSlices...; a leaf here) or there is no such registry.
        `non_slots`: the state's non-slots dict, when `tree` is a state's parts."""
        if CONTAINERS is None:
            return None
        leaves, c_def = CONTAINERS.flatten(tree)
        default = jax.tree_util.tree_flatten(tree)[0]
        if len(default) != len(leaves) or not all(
                (x._value if type(x) is Variable else x) is y for x, y in zip(leaves, default, strict=True)):
            return None
        where = None
        if non_slots is not None and all(type(v) is Variable for v in non_slots.values()):
            start = len(CONTAINERS.flatten(tree[0])[0])
            where = (start, start + len(non_slots))
        return LeafLayout(c_def, leaves, where)

    @staticmethod
    def marks_of(leaves: list) -> list:
        return [x._handle if type(x) is Variable else type(x) for x in leaves]

    def values(self, leaves: list) -> list:
        """The default registry's leaves for `CONTAINERS`' `leaves` of a tree with this layout."""
        if self.all_vars:
            return [x._value for x in leaves]
        return [x._value if type(x) is Variable else x for x in leaves]

    def rebuild(self, values: list) -> Any:
        """The tree holding `values`: a new version of each Variable, with its identity, in the same containers."""
        if self.all_vars:
            return self.c_def.unflatten(versions(values, self.handles))
        return self.c_def.unflatten([x if h is None else version(x, h)
                                     for x, h in zip(values, self.handles, strict=True)])
