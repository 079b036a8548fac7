"""Fused slots: the slots of many small params in one flat buffer per dtype and device.

A step over a thousand 16x4 params is a thousand tiny kernels per slot,
each costing more in launch and loop overhead than in arithmetic; one
update over a packed buffer costs one kernel (PyTorch's fused/foreach
optimizers and `optax.flatten` exist for the same reason). Only the slots
are packed: params stay the caller's per-variable arrays, so a fused step
concatenates the gradients and values of a group, runs the optimizer's
elementwise `_dense` once, and slices the new values back out.

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
from varstate._jax_compat import Tracer
from varstate._variable import Variable
from varstate.optimizers._core._matching import array_of

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


jax.tree_util.register_pytree_with_keys(
    PackedTree,
    lambda t: (tuple((jax.tree_util.SequenceKey(i), x) for i, x in enumerate(t.loose)), t.layout),
    lambda layout, loose: PackedTree(layout, loose),
    lambda t: (t.loose, t.layout),
)


def rebuild(p_def: Any, leaves: list, like: Any) -> Any:
    """A slot tree of `leaves` (in params' order) built as `like` is: a `PackedTree` keeps its layout."""
    return PackedTree.build(p_def, leaves, like.layout) if isinstance(like, PackedTree) else p_def.unflatten(leaves)


def is_slot_leaf(x: Any) -> bool:
    return x is None or isinstance(x, (Variable, PackedSlot))


def _group_key(p: Any) -> tuple | None:
    """(dtype, sharding) of a param whose slots can be packed, else None (too large, sharded, not trainable)."""
    if isinstance(p, Variable) and not p.trainable:
        return None
    value = array_of(p)
    if not isinstance(value, jax.Array) or value.size > FUSE_MAX_SIZE or value.size == 0:
        return None
    if not jnp.issubdtype(value.dtype, jnp.inexact):
        return None
    sharding = value.sharding
    if len(sharding.device_set) > 1 and not sharding.is_fully_replicated:
        return None  # a sharded param's slots keep its sharding, which a packed buffer could not
    return np.dtype(value.dtype), sharding


def pack(slots: dict[str, Any], names: list[str], p_leaves: list, p_def: Any, owners: list[int]) -> tuple[dict, dict]:
    """`slots` (per-variable trees) with the `names` slots of small params moved into buffers: (stored, packed).

    One buffer per (dtype, sharding): one device, or replicated over a mesh.
    """
    flat = {n: p_def.flatten_up_to(slots[n]) for n in names}
    groups: dict[tuple, list[int]] = {}
    for i, p in enumerate(p_leaves):
        if owners[i] != i or any(flat[n][i] is None for n in names):
            continue
        key = _group_key(p)
        if key is not None:
            groups.setdefault(key, []).append(i)
    stored, packed = dict(slots), {}
    for n in names:
        leaves, buffers = list(flat[n]), []
        for g, members in enumerate(groups.values()):
            offset, parts = 0, []
            for i in members:
                s = leaves[i]
                value = array_of(s)
                parts.append(value)
                leaves[i] = PackedSlot(g, offset, value.shape, s._with_value(_spec(value)) if isinstance(s, Variable)
                                       else None)
                offset += value.size
            buffers.append(_concat(parts, parts[0]))
        for j, i in enumerate(owners):
            if i != j and isinstance(leaves[i], PackedSlot):
                leaves[j] = leaves[i]  # a tied weight's one slot, at every place
        stored[n], packed[n] = PackedTree.build(p_def, leaves), tuple(buffers)
    return stored, packed


def _concat(parts: list, like: jax.Array) -> jax.Array:
    """`parts` raveled into one buffer, placed as `like` is (committed only if it is).

    Joined on the host when the parts are addressable: an eager `jnp.concatenate`
    compiles a kernel per layout, 2.6 s for 1,000 operands on CPU, where
    copying the bytes takes a millisecond.
    """
    if any(isinstance(p, Tracer) or not p.is_fully_addressable for p in [*parts, like]):
        joined = jnp.concatenate([p.reshape(-1) for p in parts])
        return joined if isinstance(like, Tracer) else jax.device_put(joined, like.sharding)
    host = np.concatenate([np.asarray(p).reshape(-1) for p in parts])
    return jax.device_put(host, like.sharding) if like.committed else jnp.asarray(host)


def _spec(value: Any) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(value.shape, value.dtype)


def views(stored: dict[str, Any], packed: dict[str, tuple]) -> dict[str, Any]:
    """`stored` with every marker replaced by its slot's view."""
    out = dict(stored)
    for n, buffers in packed.items():
        tree = stored[n]
        out[n] = tree.layout.p_def.unflatten([x.view(buffers) if isinstance(x, PackedSlot) else x
                                              for x in tree.leaves()])
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
        new = []
        for g, b in enumerate(buffers):
            pieces = [parts[g][k] for k in sorted(parts[g])]
            new.append(_concat(pieces, b) if pieces else b)
        out_stored[n] = PackedTree.build(p_def, [m if isinstance(m, PackedSlot) else s
                                                 for m, s in zip(marks, given, strict=True)], tree.layout)
        out_packed[n] = tuple(new)
    return out_stored, out_packed


def fused_step(opt: Any, h: dict, work: dict, p_leaves: list, marks: list, owners: list[int], packed: dict,
               non_slots: dict) -> tuple[dict, dict]:
    """One `_dense` per packed group over the members with a dense gradient now: ({leaf: new value}, new packed).

    `marks` are the stored leaves of one packed slot tree, in params' order.
    A member without a dense gradient (None, or `IndexedSlices`: TF's sparse
    kernels differ) keeps its slots: the buffers are masked there, and the
    caller steps a sparse member on its own.
    """
    names = list(packed)
    members: dict[int, list[tuple[int, PackedSlot]]] = {}
    for i, mark in enumerate(marks):
        if isinstance(mark, PackedSlot) and owners[i] == i:
            members.setdefault(mark.group, []).append((i, mark))
    new_values, new_packed = {}, {n: list(bs) for n, bs in packed.items()}
    for g, group in members.items():
        group.sort(key=lambda x: x[1].offset)
        live = [(i, m) for i, m in group if i in work and not isinstance(work[i], IndexedSlices)]
        if not live:
            continue
        dtype = packed[names[0]][g].dtype
        grads, values = [], []
        for i, m in group:
            p = p_leaves[i]
            values.append(array_of(p).reshape(-1))
            g_i = work.get(i)
            dense = g_i is not None and not isinstance(g_i, IndexedSlices)
            grads.append(jnp.asarray(g_i, dtype).reshape(-1) if dense else jnp.zeros(m.size, dtype))
        slots = {n: packed[n][g] for n in names}
        var, new_slots = opt._dense(h, jnp.concatenate(grads), jnp.concatenate(values), slots, non_slots)
        if len(live) != len(group):
            mask = np.zeros(slots[names[0]].shape, bool)
            for _, m in live:
                mask[m.offset:m.offset + m.size] = True
            new_slots = {n: jnp.where(mask, new_slots[n], slots[n]) for n in names}
        for n in names:
            new_packed[n][g] = new_slots[n].astype(dtype)
        for i, m in live:
            new_values[i] = m.of(var)
    return new_values, {n: tuple(bs) for n, bs in new_packed.items()}


def write_back(packed: dict, mark: PackedSlot, slots: dict) -> dict:
    """`packed` with one member's new slot values (a sparse step's) written into its slice."""
    out = {}
    for n, buffers in packed.items():
        b = list(buffers)
        b[mark.group] = jax.lax.dynamic_update_slice(b[mark.group], slots[n].reshape(-1).astype(b[mark.group].dtype),
                                                     (mark.offset,))
        out[n] = tuple(b)
    return out
