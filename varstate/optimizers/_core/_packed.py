"""Fused slots: the slots of many small params in one flat buffer per dtype and device.

A step over a thousand 16x4 params is a thousand tiny kernels per slot,
each costing more in launch and loop overhead than in arithmetic; one
update over a packed buffer costs one kernel (PyTorch's fused/foreach
optimizers and `optax.flatten` exist for the same reason). Only the slots
are packed: params stay the caller's per-variable arrays. The unfused engine
does not know about packing: the jitted step runs an optimizer's `update`
through `fused_update`, which hands it each group as one flat param whose
slots are the buffers (one elementwise computation per group, where the
params' own would be a kernel per param) and slices the results back.
Elsewhere (`update` under a caller's own jit, `get_slot`, checkpoints) the
state shows its slots as views of the buffers (`OptimizerState.slots`), and
`OptimizerState.replace` packs given slots into new buffers.

Layout: `OptimizerState.packed[slot name]` is a tuple of 1-D buffers, one
per group (params of one dtype and one sharding: one device, or replicated). The slot tree of a packed
name is one `PackedTree` node: its children are the slots left unpacked
(large or sharded params), its static data a `Layout` with, per param leaf,
a `PackedSlot` (group, offset, shape and the slot Variable that gives the
slot its identity; its own value unused) or None. One node, not a node per
slot: a step flattens and rebuilds it in O(1) Python calls.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from varstate._indexed_slices import IndexedSlices
from varstate._pack import Packed, group_key, joined
from varstate._variable import Variable
from varstate.optimizers._core._matching import (
    array_of,
    cast_like,
    entry,
    flatten_grads,
    gradients_by_owner,
    labelled_as,
    owner_positions,
    path_label,
    with_value,
)

# Largest param (in elements) whose slots are packed. Above it a tensor's own kernels are already long enough
# that launch overhead is small, and packing would add a copy of its gradient and value per step
# (benchmarks/optimizers.py: 1,000 x 16x4 gains, 200 x 256x64 does not).
FUSE_MAX_SIZE = 4096


class PackedSlot:
    """Where a packed slot lives: buffer `group`, elements [offset, offset + size), viewed with `shape`."""

    __slots__ = ("group", "offset", "shape", "size", "slot")

    def __init__(self, group: int, offset: int, shape: tuple[int, ...], slot: Variable | None) -> None:
        self.group, self.offset, self.shape, self.slot = group, offset, tuple(shape), slot
        self.size = int(np.prod(shape, dtype=np.int64))

    def _key(self) -> tuple:
        return self.group, self.offset, self.shape, None if self.slot is None else self.slot.handle

    def __eq__(self, other: object) -> bool:
        return isinstance(other, PackedSlot) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def __repr__(self) -> str:
        name = "" if self.slot is None else f"{self.slot.name!r}, "
        return f"PackedSlot({name}group={self.group}, offset={self.offset}, shape={self.shape})"

    def of(self, buffer: Any) -> Any:
        """This slot's slice of its group's `buffer`, in its shape."""
        return jax.lax.slice(buffer, (self.offset,), (self.offset + self.size,)).reshape(self.shape)

    def view(self, buffers: tuple) -> Any:
        """The slot as a Variable holding its slice of the buffer (a plain array for a plain-array param)."""
        value = self.of(buffers[self.group])
        return value if self.slot is None else self.slot._with_value(value)


class Layout:
    """The static half of a `PackedTree`: the params' treedef and, per param leaf, its `PackedSlot` or None."""

    __slots__ = ("_hash", "marks", "p_def")

    def __init__(self, p_def: Any, marks: tuple) -> None:
        self.p_def, self.marks = p_def, marks
        self._hash = hash((p_def, marks))  # once: a step hashes the state's treedef on every call

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        return self is other or (isinstance(other, Layout) and self._hash == other._hash
                                 and self.p_def == other.p_def and self.marks == other.marks)

    def signature(self, position: Any) -> tuple:
        """This layout without identities (the jitted step's key): each slot's primary by `position(resource id)`."""
        return Layout, self.p_def, tuple(None if m is None else (
            m.group, m.offset, m.shape, None if m.slot is None else position(m.slot.handle.slot_of),
            None if m.slot is None else m.slot.handle.slot_name) for m in self.marks)


class PackedTree:
    """A packed slot name's tree: the unpacked slots (children, in leaf order) and the `Layout`."""

    __slots__ = ("layout", "loose")

    def __init__(self, layout: Layout, loose: tuple) -> None:
        self.layout, self.loose = layout, tuple(loose)

    def leaves(self) -> list:
        """Per param leaf: its `PackedSlot`, or the unpacked slot (Variable, array or None)."""
        loose = iter(self.loose)
        return [m if m is not None else next(loose) for m in self.layout.marks]

    @staticmethod
    def build(p_def: Any, leaves: list, layout: Layout | None = None) -> PackedTree:
        marks = tuple(x if isinstance(x, PackedSlot) else None for x in leaves)
        if layout is None or layout.marks != marks:
            layout = Layout(p_def, marks)
        return PackedTree(layout, tuple(x for x in leaves if not isinstance(x, PackedSlot)))

    def __repr__(self) -> str:
        return f"PackedTree({sum(m is not None for m in self.layout.marks)} packed, {len(self.loose)} unpacked)"


def flatten_packed(t: PackedTree) -> tuple[tuple, Layout]:
    """The tree's pytree children and static data (also registered by the step's container registry)."""
    return t.loose, t.layout


def unflatten_packed(layout: Layout, loose: Any) -> PackedTree:
    return PackedTree(layout, loose)


jax.tree_util.register_pytree_with_keys(
    PackedTree,
    lambda t: (tuple((jax.tree_util.SequenceKey(i), x) for i, x in enumerate(t.loose)), t.layout),
    unflatten_packed,
    flatten_packed,
)


def is_slot_leaf(x: Any) -> bool:
    return x is None or isinstance(x, (Variable, PackedSlot))


def _group_key(p: Any) -> tuple | None:
    """(dtype, sharding) of a param whose slots can be packed, else None: too large, or not packable by
    `varstate.pack`'s rule (sharded, not trainable, not floating)."""
    value = array_of(p)
    if isinstance(value, jax.Array) and value.size > FUSE_MAX_SIZE:
        return None
    return group_key(p)


def pack(slots: dict[str, Any], names: list[str], p_leaves: list, p_def: Any, owners: list[int]) -> tuple[dict, dict]:
    """`slots` (per-variable trees) with the `names` slots of small params moved into buffers: (stored, packed).

    One buffer per (dtype, sharding): one device, or replicated over a mesh.
    """
    flat = {n: p_def.flatten_up_to(slots[n]) for n in names}
    groups: dict[tuple, list[int]] = {}
    for i, p in enumerate(p_leaves):
        key = _group_key(p)
        if key is not None and owners[i] == i and all(flat[n][i] is not None for n in names):
            groups.setdefault(key, []).append(i)
    return _in_buffers(slots, names, p_def, list(groups.values()), owners)


def pack_as(slots: dict[str, Any], names: list[str], params: Packed) -> tuple[dict, dict]:
    """`slots` (per-variable trees of ``params.unpack()``'s structure) packed as `params` are: (stored, packed).

    Each slot buffer is laid out as its param buffer (same groups and offsets), so a step updates a param buffer
    and its slot buffers with one computation.
    """
    layout = params.layout
    first: dict[tuple, int] = {}
    owners = [i if place is None else first.setdefault(place, i) for i, place in enumerate(layout.places)]
    return _in_buffers(slots, names, layout.p_def, [[i for i, _, _ in m] for m in layout.starts], owners)


def _in_buffers(slots: dict[str, Any], names: list[str], p_def: Any, groups: list[list[int]],
                owners: list[int]) -> tuple[dict, dict]:
    """`slots` with the `names` slots of each group's members (leaf positions, in buffer order) in one buffer per
    group: (stored, packed). A tied weight's later places take its first place's marker."""
    stored, packed = dict(slots), {}
    for n in names:
        leaves, buffers = list(p_def.flatten_up_to(slots[n])), []
        for g, members in enumerate(groups):
            offset, parts = 0, []
            for i in members:
                s = leaves[i]
                value = array_of(s)
                parts.append(value)
                spec = jax.ShapeDtypeStruct(value.shape, value.dtype)  # the slot Variable's own value is unused
                leaves[i] = PackedSlot(g, offset, value.shape, s._with_value(spec) if isinstance(s, Variable) else None)
                offset += value.size
            buffers.append(joined(parts, parts[0]))
        leaves = [leaves[i] if isinstance(leaves[i], PackedSlot) else s  # a tied weight's one slot, at every place
                  for s, i in zip(leaves, owners, strict=True)]
        stored[n], packed[n] = PackedTree.build(p_def, leaves), tuple(buffers)
    return stored, packed


def views(stored: dict[str, Any], packed: dict[str, tuple]) -> dict[str, Any]:
    """`stored` with every marker replaced by its slot's view."""
    out = dict(stored)
    for n, buffers in packed.items():
        out[n] = stored[n].layout.p_def.unflatten([x.view(buffers) if isinstance(x, PackedSlot) else x
                                                   for x in stored[n].leaves()])
    return out


def repack(stored: dict[str, Any], packed: dict[str, tuple], slots: dict[str, Any]) -> tuple[dict, dict]:
    """`slots` (per-variable trees laid out as `stored`) with the packed places written into new buffers."""
    out_stored, out_packed = dict(slots), {}
    for n, buffers in packed.items():
        if n not in slots:
            raise ValueError(f"OptimizerState.replace: slots has no {n!r}, which this fused state packs; "
                             f"give every packed slot name ({sorted(packed)}).")
        tree = stored[n]
        marks, p_def = tree.leaves(), tree.layout.p_def
        try:
            given = p_def.flatten_up_to(slots[n])
        except (ValueError, TypeError):
            raise ValueError(f"OptimizerState.replace: slots[{n!r}] does not have the structure of the params "
                             f"({p_def}); got {jax.tree.structure(slots[n], is_leaf=is_slot_leaf)}.") from None
        parts: list[dict[int, Any]] = [{} for _ in buffers]
        for mark, s in zip(marks, given, strict=True):
            if isinstance(mark, PackedSlot):
                value = array_of(s)
                if not isinstance(value, jax.Array) or tuple(value.shape) != mark.shape:
                    raise ValueError(
                        f"OptimizerState.replace: the {n!r} slot at {mark!r} must be an array of shape {mark.shape}, "
                        f"got {type(value).__name__} {getattr(value, 'shape', '')}."
                    )
                parts[mark.group][mark.offset] = value.astype(buffers[mark.group].dtype)
        out_stored[n] = PackedTree.build(p_def, [m if isinstance(m, PackedSlot) else s
                                                 for m, s in zip(marks, given, strict=True)], tree.layout)
        out_packed[n] = tuple(joined([p[k] for k in sorted(p)], b) for p, b in zip(parts, buffers, strict=True))
    return out_stored, out_packed


def fused_update(update: Any, grads: Any, params: Any, state: Any, step: Any, extra: dict) -> tuple[Any, Any]:
    """`update` (an optimizer's) over a fused state, one elementwise computation per packed group.

    `update` sees a problem without packing: the params not packed, as given,
    with their slots; per group one plain-array param, its members' values
    concatenated, with their gradients (zeros for a member without a dense
    one) and the buffers as its slots; a member with an `IndexedSlices`
    gradient (TF's sparse kernels differ) as itself with views of its slices.
    The results go back into place: the members' slices of the new values,
    the new buffers (kept where a member had no dense gradient), a sparse
    member's new slots written into its slices.
    """
    names = list(state.packed)
    p_leaves, g_leaves, p_def, paths = flatten_grads(grads, params)
    if not names or state._stored[names[0]].layout.p_def != p_def:
        return update(grads, params, state, step, **extra)  # steps views of the slots, or reports the mismatch
    owners = owner_positions(p_leaves)
    work = gradients_by_owner(p_leaves, g_leaves, paths, owners)
    stored = {k: state._stored[k].leaves() for k in names}
    marks, n = stored[names[0]], len(p_leaves)
    v_params, v_grads, v_slots = list(p_leaves), list(g_leaves), {k: list(stored[k]) for k in names}
    groups: dict[int, list[tuple[int, PackedSlot]]] = {}
    for i, m in enumerate(marks):
        if isinstance(m, PackedSlot):
            sparse = owners[i] == i and isinstance(work.get(i), IndexedSlices)
            v_params[i], v_grads[i] = (p_leaves[i], work[i]) if sparse else (None, None)
            for k in names:
                v_slots[k][i] = stored[k][i].view(state.packed[k]) if sparse else None
            if owners[i] == i:
                groups.setdefault(m.group, []).append((i, m))
    live = {}  # group: (members, whether each has a dense gradient now)
    for g, members in sorted(groups.items()):
        dense = [i in work and not isinstance(work[i], IndexedSlices) for i, _ in members]
        if any(dense):
            dtype = state.packed[names[0]][g].dtype
            v_params.append(jnp.concatenate([array_of(p_leaves[i]).reshape(-1) for i, _ in members]))
            v_grads.append(jnp.concatenate([jnp.asarray(work[i], dtype).reshape(-1) if d else jnp.zeros(m.size, dtype)
                                            for (i, m), d in zip(members, dense, strict=True)]))
            for k in names:
                v_slots[k].append(state.packed[k][g])
            live[g] = members, dense
    new_v, new_state = update(v_grads, v_params, type(state)(v_slots, state.non_slots, None, state._traced), step,
                              **extra)
    # What the update stepped (unpacked params, packed ones with a sparse gradient) takes its new version.
    new_p = [p if v is None else new_v[i] for i, (p, v) in enumerate(zip(p_leaves, v_params[:n], strict=True))]
    new_stored = {k: [s if isinstance(s, PackedSlot) else new_state.slots[k][i] for i, s in enumerate(stored[k])]
                  for k in names}
    buffers = {k: list(state.packed[k]) for k in names}
    for j, (g, (members, dense)) in enumerate(live.items()):
        for k in names:
            new = new_state.slots[k][n + j]
            if not all(dense):  # the members lie in the buffer in order, without gaps (see `pack`)
                mask = np.repeat(dense, [m.size for _, m in members])
                new = jnp.where(mask, new, buffers[k][g])
            buffers[k][g] = new.astype(buffers[k][g].dtype)
        for (i, m), d in zip(members, dense, strict=True):
            if d:
                new_p[i] = with_value(p_leaves[i], cast_like(m.of(new_v[n + j]), array_of(p_leaves[i])))
    for i, m in enumerate(marks):
        if isinstance(m, PackedSlot) and v_params[i] is not None:  # a sparse step: into its slices
            for k in names:
                b = buffers[k][m.group]
                value = array_of(new_state.slots[k][i]).reshape(-1).astype(b.dtype)
                buffers[k][m.group] = jax.lax.dynamic_update_slice(b, value, (m.offset,))
    new_p = [new_p[i] if isinstance(marks[i], PackedSlot) else p  # a tied weight's one version, at every place
             for p, i in zip(new_p, owners, strict=True)]
    slots = {**state._stored, **{k: PackedTree.build(p_def, new_stored[k], state._stored[k].layout) for k in names}}
    buffers_out = {k: tuple(b) for k, b in buffers.items()}
    return p_def.unflatten(new_p), type(state)(slots, new_state.non_slots, buffers_out, new_state._traced)


# --- packed params (`varstate.pack`) -------------------------------------------------------------------------------
def packed_like(state: Any, params: Packed) -> bool:
    """Whether `state`'s slots are packed as `params` are (`pack_as`): every slot name, in the params' groups."""
    layout = params.layout
    return all(n in state.packed and state._stored[n].layout.p_def == layout.p_def
               and len(state.packed[n]) == layout.n_groups for n in state._stored)


def check_packed_grads(grads: Any, params: Packed) -> None:
    """ValueError unless `grads` are packed as `params` are (the gradients with respect to the `Packed`)."""
    if not isinstance(grads, Packed) or grads.layout is not params.layout:
        raise ValueError(
            f"{entry()}: params are packed (varstate.pack) but grads are {type(grads).__name__}"
            f"{' of another layout' if isinstance(grads, Packed) else ''}: take the gradients with respect to the "
            "Packed itself, e.g. jax.grad(lambda p: loss(p.unpack()))(packed), so that they come out packed alike."
        )


def packed_update(update: Any, grads: Any, params: Packed, state: Any, step: Any, extra: dict) -> tuple[Any, Any]:
    """`update` (an optimizer's) over packed params: one computation per buffer, the unpacked params as they are.

    `update` sees the params left unpacked, then one plain-array param per buffer whose slots are the state's
    slot buffers of that group.
    """
    layout = params.layout
    check_packed_grads(grads, params)
    names = list(state.packed)
    loose_at = [i for i, place in enumerate(layout.places) if place is None]
    n = len(loose_at)
    v_params = [*params.loose, *params.buffers]
    v_grads = [*grads.loose, *grads.buffers]
    v_slots = {k: [*(state._stored[k].leaves()[i] for i in loose_at), *state.packed[k]] for k in names}
    flat = type(state)(v_slots, state.non_slots, None, state._traced)
    labels = [*(path_label((jax.tree_util.SequenceKey(layout.n_groups + j),), x) for j, x in enumerate(params.loose)),
              *(f"params{k}" for k in layout.keys())]
    with labelled_as(labels):
        new_v, new_state = update(v_grads, v_params, flat, step, **extra)
    stored = dict(state._stored)
    for k in names:
        leaves = state._stored[k].leaves()
        for j, i in enumerate(loose_at):
            leaves[i] = new_state.slots[k][j]
        stored[k] = PackedTree.build(layout.p_def, leaves, state._stored[k].layout)
    buffers = {k: tuple(new_state.slots[k][n:]) for k in names}
    new_params = Packed(tuple(cast_like(b, old) for b, old in zip(new_v[n:], params.buffers, strict=True)),
                        tuple(new_v[:n]), layout)
    return new_params, type(state)(stored, new_state.non_slots, buffers, new_state._traced)
