"""`pack`: params held in flat buffers, one per dtype and placement, each Variable a view of its slice.

A step over a thousand small params moves a thousand arrays in and out of
the compiled program; the arithmetic is a small part of its time. Packed,
the program takes one buffer per dtype: the model reads each Variable as a
slice of it (`Packed.unpack`, inside the jitted step, where XLA fuses the
slices away), `jax.grad` with respect to the `Packed` gives the gradients
packed alike (a split's transpose is one concatenation), and an optimizer
updates each buffer with one computation (`Optimizer.update`; its slots are
packed the same way, as a fused state's).

Rules:

- the pytree's leaves are the buffers (then the params left unpacked); the
  Variables are made on access, each with its name, identity and slots;
- the `PackLayout` is one object shared by every version of a `Packed`
  (steps, restores), so jit's cache checks stay one identity comparison;
- a param is packed when it is a trainable, floating-point (real or complex) Variable or array
  on one device or replicated; the rest (sharded, integer, non-trainable)
  stays as it is, beside the buffers;
- a view is a value, not a reference: ``v.assign(x)`` returns a new version
  of that Variable, as everywhere; put changed views back with
  ``packed.repacked(tree)``.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from varstate._jax_compat import is_deleted_array
from varstate._values import _is_var
from varstate._variable import Variable, donated_error, version


class PackLayout:
    """Where each param of a `Packed` lives: per leaf of the params' treedef, (group, offset, shape) or None.

    Compared by identity: every version of one `Packed` shares its layout.
    """

    __slots__ = ("_keys", "handles", "n_groups", "p_def", "places", "starts")

    def __init__(self, p_def: Any, places: tuple, handles: tuple, n_groups: int) -> None:
        self.p_def, self.places, self.handles, self.n_groups = p_def, places, handles, n_groups
        # Per group, its members' (leaf index, offset, size) in buffer order, for one split per buffer.
        members: list[list[tuple[int, int, int]]] = [[] for _ in range(n_groups)]
        seen = set()
        for i, place in enumerate(places):
            if place is not None and place not in seen:  # a tied weight's later places share the first's slice
                seen.add(place)
                group, offset, shape = place
                members[group].append((i, offset, int(np.prod(shape, dtype=np.int64))))
        self.starts = tuple(tuple(sorted(m, key=lambda x: x[1])) for m in members)
        self._keys: tuple | None = None

    def __repr__(self) -> str:
        return f"PackLayout({sum(p is not None for p in self.places)} packed in {self.n_groups} buffers)"

    def buffer_names(self, group: int) -> str:
        """"'a', 'b' and 3 more": the Variables buffer `group` holds, for messages."""
        names = [h.name for h in (self.handles[i] for i, _, _ in self.starts[group]) if h is not None]
        return f"{', '.join(map(repr, names[:3]))}{f' and {len(names) - 3} more' if len(names) > 3 else ''}"

    def keys(self) -> tuple:
        """The key of each child in key paths: a buffer's names what it holds, so that an error about the
        gradient or slot of ``params[0]`` says which Variables that is."""
        if self._keys is None:
            self._keys = tuple(_BufferKey(g, self.buffer_names(g)) for g in range(self.n_groups))
        return self._keys


class _BufferKey(jax.tree_util.SequenceKey):
    """``[0] (the Packed buffer of 'a', 'b')`` in a key path."""

    def __init__(self, idx: int, names: str) -> None:
        super().__init__(idx)
        self.names = names

    def __str__(self) -> str:
        return f"[{self.idx}] (the Packed buffer of {self.names})"


class Packed:
    """Params packed into flat buffers (`varstate.pack`); ``unpack()`` gives the params, each a view.

    A pytree whose leaves are the buffers, then the params left unpacked.
    Made by `varstate.pack`; a step, a gradient or a restore makes new ones
    of the same layout.

    Args:
        buffers: the flat buffers, one per group (dtype and placement).
        loose: the params left unpacked, in leaf order.
        layout: where each param lives (`PackLayout`), shared by every
            version of one packed model.

    >>> import jax, jax.numpy as jnp, varstate
    >>> params = {"w": varstate.Variable(jnp.ones((2, 2)), name="w"), "b": varstate.Variable(jnp.zeros(2), name="b")}
    >>> packed = varstate.pack(params)
    >>> [x.shape for x in jax.tree.leaves(packed)], packed.unpack()["w"].name
    ([(6,)], 'w')
    """

    __slots__ = ("buffers", "layout", "loose")

    def __init__(self, buffers: tuple, loose: tuple, layout: PackLayout) -> None:
        self.buffers, self.loose, self.layout = tuple(buffers), tuple(loose), layout

    def unpack(self) -> Any:
        """The params as given to `pack`: each packed one a view of its slice (a Variable keeps its identity).

        Returns:
            A tree with the structure of the packed params.
        """
        layout = self.layout
        values: list[Any] = [None] * len(layout.places)
        for g, members in enumerate(layout.starts):
            buffer = self.buffers[g]
            if is_deleted_array(buffer):  # a step donated it: name what it held, not JAX's anonymous error
                raise donated_error(f"Packed buffer {g} (of {layout.buffer_names(g)})")
            shapes = [layout.places[i][2] for i, _, _ in members]
            if len(members) == 1:
                parts = [buffer.reshape(shapes[0])]
            elif not isinstance(buffer, jax.Array) or isinstance(buffer, jax.core.Tracer) or (
                    not buffer.is_fully_addressable):
                # One split: under jax.grad its transpose is one concatenation.
                parts = [p.reshape(s) for p, s in zip(
                    jnp.split(buffer, [offset for _, offset, _ in members[1:]]), shapes, strict=True)]
            else:  # concrete: sliced on the host (an eager split of n pieces compiles an n-output program)
                host = np.asarray(buffer)
                pieces = [host[o:o + n].reshape(s) for (_, o, n), s in zip(members, shapes, strict=True)]
                parts = (jax.device_put(pieces, [buffer.sharding] * len(pieces)) if buffer.committed
                         else [jnp.asarray(p) for p in pieces])
            for (i, _, _), part in zip(members, parts, strict=True):
                values[i] = part
        loose = iter(self.loose)
        leaves = []
        for i, place in enumerate(layout.places):
            if place is None:
                leaves.append(next(loose))
                continue
            value = values[i] if values[i] is not None else values[layout.places.index(place)]  # a tied weight
            handle = layout.handles[i]
            leaves.append(value if handle is None else version(value, handle))
        return layout.p_def.unflatten(leaves)

    def repacked(self, params: Any) -> Packed:
        """A `Packed` of this layout holding the values of `params` (laid out as `unpack()` returns).

        Args:
            params: a tree with the structure of the packed params.

        Returns:
            The new `Packed`; this one is unchanged.

        Raises:
            ValueError: `params` has another structure, or a value another
                shape, than this layout's.
            TypeError: a value has another dtype than its buffer (never cast
                silently).
        """
        layout = self.layout
        try:
            leaves = layout.p_def.flatten_up_to(params)
        except (ValueError, TypeError):
            raise ValueError(f"Packed.repacked: params must have the packed params' structure {layout.p_def}, got "
                             f"{jax.tree.structure(params, is_leaf=_is_var)}.") from None
        loose = [x for x, place in zip(leaves, layout.places, strict=True) if place is None]
        buffers = []
        for g, members in enumerate(layout.starts):
            parts = []
            for i, _, _ in members:
                value = leaves[i].value if isinstance(leaves[i], Variable) else jnp.asarray(leaves[i])
                what = f"Variable {leaves[i].name!r}" if isinstance(leaves[i], Variable) else f"leaf {i}"
                if tuple(value.shape) != layout.places[i][2]:
                    raise ValueError(f"Packed.repacked: {what} must have shape {layout.places[i][2]}, as packed; "
                                     f"got {tuple(value.shape)}.")
                want = self.buffers[g].dtype
                if value.dtype != want:  # a cast here would be silent: float64 past float32's range became inf
                    raise TypeError(f"Packed.repacked: {what} must have dtype {want}, as packed; got {value.dtype}. "
                                    f"Cast it first (x.astype(jnp.{want})), or pack the params again.")
                parts.append(value.reshape(-1))
            buffers.append(joined(parts, self.buffers[g]))
        return Packed(tuple(buffers), tuple(loose), layout)

    def __repr__(self) -> str:
        shapes = [f"{b.dtype}[{b.shape[0]}]" for b in self.buffers]
        return f"Packed(buffers={shapes}, unpacked={len(self.loose)})"


def joined(parts: list, like: Any) -> Any:
    """`parts` raveled into one buffer, placed as `like` is (committed only if it is).

    Joined on the host when the parts are addressable: an eager `jnp.concatenate`
    compiles a kernel per layout, 2.6 s for 1,000 operands on CPU, where
    copying the bytes takes a millisecond.
    """
    if any(isinstance(p, jax.core.Tracer) or not p.is_fully_addressable for p in [*parts, like]):
        out = jnp.concatenate([p.reshape(-1) for p in parts])
        return out if isinstance(like, jax.core.Tracer) else jax.device_put(out, like.sharding)
    host = np.concatenate([np.asarray(p).reshape(-1) for p in parts])
    return jax.device_put(host, like.sharding) if like.committed else jnp.asarray(host)


def group_key(x: Any) -> tuple | None:
    """(dtype, sharding) of a param that can share a buffer (`pack`; a fused state's slots), else None: not
    trainable, empty, not floating (real or complex), or sharded (a buffer cannot keep a sharding of its own)."""
    if isinstance(x, Variable) and not x.trainable:
        return None
    value = x.value if isinstance(x, Variable) else x
    if not isinstance(value, jax.Array) or value.size == 0 or not jnp.issubdtype(value.dtype, jnp.inexact):
        return None
    sharding = value.sharding
    if len(sharding.device_set) > 1 and not sharding.is_fully_replicated:
        return None
    return np.dtype(value.dtype), sharding


def pack(params: Any) -> Packed:
    """`params` held in flat buffers, one per dtype and placement; each Variable becomes a view of its slice.

    Use the `Packed` as the params of an optimizer (``opt.init(packed)``,
    ``opt.apply_gradients(grads, packed, state)``, whose gradients come from
    ``jax.grad`` with respect to the `Packed`) and read the model with
    ``packed.unpack()`` inside the jitted loss: a step then moves one buffer
    per dtype in and out of the program. Variables keep their names,
    identities, slots (``state.get_slot``) and checkpoint keys: a checkpoint
    of a `Packed` holds each variable under its own key, exactly as unpacked.
    Packed are the trainable floating-point (real or complex) params on one device or
    replicated; others stay as they are. Optimizers whose step is not
    elementwise (Keras's Adafactor, Lamb and Muon; optax transformations)
    refuse packed params.

    Args:
        params: a pytree whose leaves are Variables or arrays (made outside jit).

    Returns:
        The `Packed` pytree.

    Raises:
        ValueError: `params` holds a traced value (pack outside jit).

    >>> import jax, jax.numpy as jnp, varstate
    >>> from varstate.optimizers import Adam
    >>> params = [varstate.Variable(jnp.ones(3), name=f"w{i}") for i in range(4)]
    >>> packed = varstate.pack(params)
    >>> opt = Adam(0.1)
    >>> state = opt.init(packed)
    >>> grads = jax.grad(lambda p: sum(jnp.sum(v.value ** 2) for v in p.unpack()))(packed)
    >>> packed, state = opt.apply_gradients(grads, packed, state)
    >>> [round(x, 4) for x in packed.unpack()[2].value.tolist()], state.get_slot(params[2], "m").name
    ([0.9, 0.9, 0.9], 'w2/m')
    """
    leaves, p_def = jax.tree.flatten(params, is_leaf=_is_var)
    if any(isinstance(x.value if isinstance(x, Variable) else x, jax.core.Tracer) for x in leaves):
        raise ValueError("varstate.pack: params hold traced values; pack them outside jit (the buffers are the "
                         "params every later step takes).")
    groups: dict[tuple, list[int]] = {}
    first: dict[int, int] = {}  # a Variable's first place (tied weights share one slice)
    for i, x in enumerate(leaves):
        if isinstance(x, Variable) and first.setdefault(x.resource_id, i) != i:
            continue
        key = group_key(x)
        if key is not None:
            groups.setdefault(key, []).append(i)
    places: list[Any] = [None] * len(leaves)
    buffers = []
    for g, members in enumerate(groups.values()):
        offset, parts = 0, []
        for i in members:
            value = leaves[i].value if isinstance(leaves[i], Variable) else leaves[i]
            places[i] = (g, offset, tuple(value.shape))
            parts.append(value.reshape(-1))
            offset += value.size
        like = leaves[members[0]]
        buffers.append(joined(parts, like.value if isinstance(like, Variable) else like))
    for i, x in enumerate(leaves):
        if isinstance(x, Variable) and places[first[x.resource_id]] is not None:
            places[i] = places[first[x.resource_id]]
    handles = tuple(x._handle if isinstance(x, Variable) else None for x in leaves)
    layout = PackLayout(p_def, tuple(places), handles, len(buffers))
    return Packed(tuple(buffers), tuple(x for x, p in zip(leaves, places, strict=True) if p is None), layout)


def _flatten(p: Packed) -> tuple[tuple, PackLayout]:
    return (*p.buffers, *p.loose), p.layout


def _unflatten(layout: PackLayout, children: Any) -> Packed:
    children = tuple(children)
    return Packed(children[:layout.n_groups], children[layout.n_groups:], layout)


jax.tree_util.register_pytree_with_keys(
    Packed,
    lambda p: ((*zip(p.layout.keys(), p.buffers, strict=True),
                *((jax.tree_util.SequenceKey(p.layout.n_groups + j), x) for j, x in enumerate(p.loose))), p.layout),
    _unflatten,
    _flatten,
)
