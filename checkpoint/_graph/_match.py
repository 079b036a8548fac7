"""Restore matching: a checkpoint's TrackableObjectGraph against the caller's templates, as TF matches.

Templates are walked like saved roots; a node is matched by its path from
the root, a slot through its primary's node and slot name. Every value is
checked (shape, dtype) before any is loaded, then loaded once per key and put
where the template's value lives (its sharding). `RestoreState` is what every
status of one restore shares, so deferred restorations add to one account.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from checkpoint import _dtypes, _keys
from checkpoint._graph import _walk
from checkpoint._graph._build import PRNG_KEY_IMPL, node_names
from checkpoint._graph._walk import VALUES, Kind
from varstate import Packed, Variable, _seam

_log = logging.getLogger("checkpoint")


@dataclasses.dataclass(eq=False)
class _Cell:
    """Placeholder for one value to restore, replaced once all values are loaded."""

    template: Any
    key: str
    label: str
    kind: Kind
    info: Any = None  # a SaveSliceInfo: take this slice of the stored full value
    prng: bool = False  # a PRNG key array: the value is its key data
    impl_key: str | None = None  # where the name of the key's implementation is stored, if it is


@dataclasses.dataclass(eq=False)
class _OptCell:
    """Placeholder for an optimizer state whose slots are matched after every primary."""

    template: Any
    non_slots: dict
    plain: Any  # the plain-array slots, matched like any container
    node_id: int
    label: str
    slots: Any = None


@dataclasses.dataclass
class _Found:
    """What one `restore_roots` call collects while it walks the templates, before anything is loaded."""

    cells: list[_Cell] = dataclasses.field(default_factory=list)  # the values to load
    opts: list[_OptCell] = dataclasses.field(default_factory=list)  # optimizer states, their slots matched last
    rids: set[int] = dataclasses.field(default_factory=set)  # resource ids of every template Variable
    variable_nodes: set[int] = dataclasses.field(default_factory=set)  # nodes this call bound to Variables


@dataclasses.dataclass(eq=False)
class _Merge:
    """An nnx Module being restored: its graphdef and its state (holding cells), merged once values are loaded."""

    graphdef: Any
    state: Any


@dataclasses.dataclass(eq=False)
class _Repack:
    """Packed params being restored (`varstate.pack`): the template and its params (holding cells), packed again
    in the template's layout once values are loaded."""

    template: Any
    params: Any


@dataclasses.dataclass(eq=False)
class RestoreState:
    """What every status of one restore shares (TF's _CheckpointRestoreCoordinator): the checkpoint, and one
    account of what its restores matched and what is left, which deferred restorations add to."""

    reader: Any
    matched: dict[int, str] = dataclasses.field(default_factory=lambda: {0: "(root)"})  # node -> who took it
    unmatched: dict[str, None] = dataclasses.field(default_factory=dict)  # template objects with no saved value
    # (optimizer node, primary node, slot name) -> the slot's node, for each slot left unrestored
    pending_slots: dict[tuple[int, int, str], int] = dataclasses.field(default_factory=dict)
    node_rids: dict[int, list[int]] = dataclasses.field(default_factory=dict)  # node -> its Variables' resources
    variable_node: dict[int, int] = dataclasses.field(default_factory=dict)  # resource id -> the node it took
    opt_slots: dict[int, set] = dataclasses.field(default_factory=dict)  # optimizer node -> its (rid, slot name)s
    expect_partial: bool = False
    dead_roots: dict[str, str] = dataclasses.field(default_factory=dict)  # root given -> why it matched no value

    def __post_init__(self) -> None:
        self.proto = self.reader.object_graph

    @functools.cached_property
    def names(self) -> list[str]:
        """Each node's name, for messages: made on first use (a restore that goes well has none to write)."""
        return node_names(self.proto)

    def unresolved(self) -> list[int]:
        """The nodes holding a value that no restore has taken."""
        return [i for i, n in enumerate(self.proto.nodes) if n.attributes and i not in self.matched]

    def pending_descriptions(self) -> list[str]:
        """Each unrestored slot with why it was not restored, for the assertions."""
        out = []
        for (opt, primary, slot_name), node in sorted(self.pending_slots.items()):
            name = self._name(node)
            if primary not in self.node_rids:
                out.append(f"{name} (its Variable {self._name(primary)} was not restored)")
            elif not 0 <= node < len(self.proto.nodes) or not self.proto.nodes[node].attributes:
                out.append(f"{name} (the checkpoint holds no value for it)")
            else:
                out.append(f"{name} (the optimizer state restored at {self.matched.get(opt, self._name(opt))} "
                           f"has no slot {slot_name!r} for the Variable restored at {self.matched[primary]})")
        return out

    def _name(self, node: int) -> str:
        return self.names[node] if 0 <= node < len(self.names) else f"node {node}"

    def snapshot(self) -> dict[str, Any]:
        """The account as it is now, for `rollback` (shallow: the values held are replaced, never changed)."""
        return {f: dict(getattr(self, f)) for f in _ACCOUNT}

    def rollback(self, snapshot: dict[str, Any]) -> None:
        for f in _ACCOUNT:
            setattr(self, f, snapshot[f])

    def __del__(self) -> None:
        try:
            if not self.expect_partial and self.unresolved():
                left = self.unresolved()
                # a slot is named "<primary>'s state 'm' for <optimizer>": it is under the optimizer's root
                roots = sorted({".".join(self.names[i].rsplit(" for ", 1)[-1].split(".")[:2]) for i in left})
                _log.warning("Some values in the checkpoint were not restored: %s%s (under %s). Call "
                             "expect_partial() on the status (CheckpointManager.restore: expect_partial=True) if "
                             "this is intended.%s", self.names[left[0]],
                             f" and {len(left) - 1} more" if len(left) > 1 else "", _some(roots, "roots"),
                             "".join(f" {why}" for why in self.dead_roots.values()))
        except Exception:  # never raise from a finalizer
            pass


# What one restore call adds to a RestoreState: put back as it was when the call raises, so the statuses the
# caller already holds still account for what was really restored.
_ACCOUNT = ("matched", "unmatched", "pending_slots", "node_rids", "variable_node", "opt_slots", "dead_roots")


def _some(items: list[str], what: str, n: int = 10) -> str:
    """At most `n` of `items`, comma-separated, then how many more (a model has hundreds of them)."""
    return ", ".join(items[:n]) + (f" and {len(items) - n} more {what}" if len(items) > n else "")


def restore_roots(st: RestoreState, roots: dict[str, Any], raise_dead: bool = True) -> dict[str, Any]:
    """Matches `roots` against the checkpoint's graph and loads their values; returns the restored roots.

    A root that holds values and matched none of the checkpoint's is recorded
    in `st.dead_roots` (for the status's assertions and warning) and, when
    other values did match, with `raise_dead` unless `st.expect_partial`,
    raises ValueError before anything is loaded. When this raises, `st` is
    left as it was before the call.
    """
    before = st.snapshot()
    try:
        return _restore_roots(st, roots, raise_dead)
    except BaseException:
        st.rollback(before)
        raise


def _restore_roots(st: RestoreState, roots: dict[str, Any], raise_dead: bool) -> dict[str, Any]:
    top = {r.local_name: r.node_id for r in st.proto.nodes[0].children}
    found = _Found()
    tree, took, missed = {}, {}, {}  # per root: values matched, template values without a saved one
    owner: dict[int, str] = {}  # id of an _OptCell -> its root
    for name, obj in roots.items():
        cells, left, opts = len(found.cells), len(st.unmatched), len(found.opts)
        tree[name] = _match(st, _walk.unwrap(obj), top.get(name), f"(root).{name}", found)
        owner.update((id(opt), name) for opt in found.opts[opts:])
        took[name], missed[name] = len(found.cells) - cells, len(st.unmatched) - left
    # Slots after every root's primaries, but counted for the optimizer's root: roots are taken in name order,
    # and an optimizer root may come before the root holding its Variables ("adam" before "model").
    for opt in found.opts:
        cells, left = len(found.cells), len(st.unmatched)
        _match_slots(st, opt, found)
        took[owner[id(opt)]] += len(found.cells) - cells
        missed[owner[id(opt)]] += len(st.unmatched) - left
    _check_slot_order(st, found)
    for name in roots:
        if not took[name] and missed[name]:
            st.dead_roots[name] = _dead_root(st, name, top)
        else:
            st.dead_roots.pop(name, None)
    dead = [name for name in roots if name in st.dead_roots]
    # Nothing matched at all is left to the status (assert_nontrivial_match), as TF; beside values that
    # matched, a root matching nothing is a misnamed root or a wrong template that would pass unnoticed.
    others = any(label != f"(root).{_keys.SAVE_COUNTER}" and 0 <= i < len(st.proto.nodes)
                 and st.proto.nodes[i].attributes for i, label in st.matched.items())
    if dead and others and raise_dead and not st.expect_partial:
        raise ValueError(f"{st.dead_roots[dead[0]]} Or, if the root is new and not in this checkpoint, restore "
                         "with expect_partial=True.")
    loaded = _load(st, found.cells)

    def resolve(x):
        if isinstance(x, _OptCell):
            slots = jax.tree.map(resolve, x.slots, is_leaf=_is_cell)
            non_slots = jax.tree.map(resolve, x.non_slots, is_leaf=_is_cell)
            return x.template.replace(slots=slots, non_slots=non_slots)
        if isinstance(x, _Merge):  # merged whole: mapping over a Module as a pytree would unshare its Variables
            return _walk.nnx_merge(x.graphdef, jax.tree.map(resolve, x.state, is_leaf=_is_cell))
        if isinstance(x, _Repack):
            return x.template.repacked(jax.tree.map(resolve, x.params, is_leaf=_is_cell))
        if isinstance(x, _Cell):
            return _finish(x, loaded[x.key], loaded[x.impl_key] if x.impl_key is not None else None)
        return x

    out = {name: jax.tree.map(resolve, t, is_leaf=_is_cell) for name, t in tree.items()}
    for name, obj in roots.items():
        if _walk.unwrap(obj) is not obj:  # an nnx Variable as a root: a new one of its type, as inside a Module
            out[name] = obj.replace(out[name])
    return out


def _dead_root(st: RestoreState, name: str, top: dict[str, int]) -> str:
    """Why root `name` matched no value of the checkpoint: absent there, or another structure under it."""
    names = sorted(set(top) - {_keys.SAVE_COUNTER})
    roots = f"[{_some([repr(r) for r in names], 'roots')}]"
    where = f"the checkpoint {st.reader.path!r}" if getattr(st.reader, "path", None) else "the checkpoint"
    if name not in top:
        return (f"Root {name!r} matched no value in {where}: it has no root {name!r}; its roots are {roots}. "
                "Rename the root to the one holding its values (Checkpoint(<name>=...)), or pass the template of "
                "the model this checkpoint was saved from.")
    node = st.proto.nodes[top[name]] if 0 <= top[name] < len(st.proto.nodes) else None
    children = sorted(r.local_name for r in node.children) if node is not None else []
    saved = f"[{_some([repr(c) for c in children], 'values')}]"
    under = f"(root).{name}"
    first = next((label for label in st.unmatched if label == under or label.startswith((f"{under}.", f"{under}'"))),
                 under)
    return (f"Root {name!r} matched no value in {where}: none of its values is saved under (root).{name} (the "
            f"first is {first}); the checkpoint's (root).{name} holds {saved}, and its roots are {roots}. The "
            "template is of another structure: pass the template of the model this checkpoint was saved from, or "
            "the root holding the values of this one.")


def _match(st: RestoreState, obj, node_id, label, found: _Found) -> Any:
    k = _walk.kind(obj)
    if k in (Kind.VARIABLE, Kind.PARTITIONED):
        found.rids.update(v.resource_id for v in _walk.node_variables(obj))
    if k == Kind.NONE:
        return obj
    node = st.proto.nodes[node_id] if node_id is not None and 0 <= node_id < len(st.proto.nodes) else None
    if node is None or (k in VALUES and not node.attributes):
        _unmatched(st, obj, k, label)
        return obj
    if k in VALUES:
        if k in (Kind.VARIABLE, Kind.PARTITIONED):
            rids = [v.resource_id for v in _walk.node_variables(obj)]
            other = next((st.variable_node[r] for r in rids if st.variable_node.get(r, node_id) != node_id), None)
            if other is not None:
                raise _tied_error(st, other, node_id, label)
            st.node_rids[node_id] = rids
            st.variable_node.update(dict.fromkeys(rids, node_id))
            found.variable_nodes.add(node_id)
        st.matched[node_id] = label
        cell = _Cell(obj, node.attributes[0].checkpoint_key, label, k)
        if k in (Kind.VARIABLE, Kind.ARRAY) and _walk.is_prng_key(_value(cell)):
            # Without a stored implementation (key data saved by orbax or flax), the template's: the shape
            # of the key data, checked before loading, is that implementation's.
            cell.prng = True
            cell.impl_key = next((a.checkpoint_key for a in node.attributes if a.name == PRNG_KEY_IMPL), None)
        found.cells.append(cell)
        return cell
    if not node.attributes:  # a saved value is not consumed by a container standing in its place
        st.matched[node_id] = label
    ids = {r.local_name: r.node_id for r in node.children}

    def child(name, c):
        return _match(st, c, ids.get(name), f"{label}.{name}", found)

    if k == Kind.OPTIMIZER:
        non_slots = {name: child(name, v) for name, v in obj.non_slots.items()}
        opt = _OptCell(obj, non_slots, child(_walk.PLAIN_SLOTS, _walk.plain_slots(obj)), node_id, label)
        found.opts.append(opt)
        return opt
    parts = _walk.nnx_split(obj)
    if parts is not None:
        return _Merge(parts[0], _walk.rebuild(parts[1], child, label))
    if isinstance(obj, Packed):
        return _Repack(obj, _walk.rebuild(obj.unpack(), child, label))
    return _walk.rebuild(obj, child, label)

def _tied_error(st: RestoreState, first: int, second: int, label: str) -> ValueError:
    """One template Variable at two paths (tied) whose checkpoint saved two distinct Variables there."""
    def key(node: int) -> str:
        attributes = st.proto.nodes[node].attributes
        return repr(attributes[0].checkpoint_key) if attributes else "(no value)"

    return ValueError(
        f"Cannot restore {label}: its template Variable is also the template's {st.matched.get(first, '?')} (one "
        f"Variable used at two paths, tied), but the checkpoint holds two distinct Variables there: {key(first)} at "
        f"{st._name(first)} and {key(second)} at {st._name(second)}. One Variable cannot take both values, and "
        "the next save or step would keep only one. Untie the template (a Variable of its own at each path), or "
        "restore into separate Variables and pick one of them to tie."
    )


def _check_slot_order(st: RestoreState, found: _Found) -> None:
    """Refuses Variables whose slots an optimizer state restored earlier, without them, has left unrestored.

    TF restores such slots when the Variable arrives (deferred restoration). Here the optimizer state was
    returned already, by an earlier restore, and cannot change: restoring the Variables now would leave its
    slots at their initial values, with its non-slot values (Adam's beta powers) restored.
    """
    now = {opt.node_id for opt in found.opts}
    late: dict[int, list[tuple[int, str]]] = {}  # optimizer node -> (Variable node, slot name) it would have taken
    for (opt, primary, slot_name), slot_node in st.pending_slots.items():
        linked = st.opt_slots.get(opt, set())
        if (opt not in now and primary in found.variable_nodes
                and any((r, slot_name) in linked for r in st.node_rids[primary])
                and 0 <= slot_node < len(st.proto.nodes) and st.proto.nodes[slot_node].attributes):
            late.setdefault(opt, []).append((primary, slot_name))
    if late:
        opt, slots = next(iter(late.items()))
        variables = sorted({st.matched[primary] for primary, _ in slots})
        names = sorted(f"{name!r} for {st.matched[primary]}" for primary, name in slots)
        raise ValueError(
            f"Cannot restore {_some(variables, 'Variables')} after the optimizer state "
            f"{st.matched.get(opt, st._name(opt))}: an earlier restore returned that state before its Variables "
            f"were restored, without their slots ({_some(names, 'slots')}), and it cannot change now. Restore "
            "the Variables first and the optimizer state after them (status.restore(optimizer=opt.init("
            "status.model))), or both in one restore (Checkpoint(model=..., optimizer=...).restore(path), or "
            "give the optimizer state again beside them: status.restore(model=..., optimizer=...))."
        )


def _unmatched(st: RestoreState, obj, k, label) -> None:
    if k in VALUES:
        st.unmatched[label] = None
    elif k in (Kind.CONTAINER, Kind.OPTIMIZER):
        for name, c in _walk.children(obj, label):
            _unmatched(st, c, _walk.kind(c), f"{label}.{name}")
        if k == Kind.OPTIMIZER:
            for slot in _walk.slot_variables(obj):
                st.unmatched[f"{label}'s slot {slot.name!r}"] = None

def _match_slots(st: RestoreState, opt: _OptCell, found: _Found) -> None:
    """A slot is matched through its primary's node and slot name (not the optimizer's layout)."""
    templates = dict(_walk.linked_slots(opt.template))
    st.opt_slots[opt.node_id] = set(templates)
    by_rid: dict[int, _Cell] = {}
    for ref in st.proto.nodes[opt.node_id].slot_variables:
        pending = (opt.node_id, ref.original_variable_node_id, ref.slot_name)
        rids = st.node_rids.get(ref.original_variable_node_id)
        slots = [templates[(r, ref.slot_name)] for r in rids or () if (r, ref.slot_name) in templates]
        slot_node = ref.slot_variable_node_id
        if not slots or not 0 <= slot_node < len(st.proto.nodes) or not st.proto.nodes[slot_node].attributes:
            st.pending_slots[pending] = slot_node
            continue
        st.pending_slots.pop(pending, None)
        key = st.proto.nodes[slot_node].attributes[0].checkpoint_key
        label = f"{opt.label}'s slot {ref.slot_name!r} for {st.matched[ref.original_variable_node_id]}"
        st.matched[slot_node] = label
        for slot in slots:
            info = slot.save_slice_info if len(rids or ()) > 1 else None
            cell = _Cell(slot, key, label, Kind.VARIABLE, info)
            found.cells.append(cell)
            by_rid[slot.resource_id] = cell
    for (primary, _), slot in templates.items():
        if slot.resource_id not in by_rid and (primary in st.variable_node or primary in found.rids):
            st.unmatched[f"{opt.label}'s slot {slot.name!r}"] = None
    opt.slots = _walk.merge_slots(opt.template.slots, lambda v: by_rid.get(v.resource_id, v), opt.plain)

def _load(st: RestoreState, cells: list[_Cell]) -> dict[str, Any]:
    reader = st.reader
    requests: dict[str, Any] = {}
    for cell in cells:
        # On the host: key data (wrapped into a key, then placed), a value narrowed to JAX's 32-bit type (where
        # its range is checked) and a slice of a stored full value; the rest straight to the template's sharding.
        on_host = _check(reader, cell) or cell.prng or cell.info is not None
        target = None if on_host else _target_sharding(_value(cell))
        if cell.impl_key is not None:
            requests.setdefault(cell.impl_key, None)
        if cell.key not in requests:
            requests[cell.key] = target
        elif requests[cell.key] != target:
            requests[cell.key] = None  # wanted on two placements: load on the host once
    return reader.get_many(requests)


def _is_cell(x: Any) -> bool:
    return isinstance(x, (_Cell, _OptCell, _Merge, _Repack))


def _target_sharding(value: Any) -> Any:
    sharding = getattr(value, "sharding", None)
    return sharding if isinstance(sharding, jax.sharding.Sharding) else None


def _value(cell: _Cell) -> Any:
    """The template's value: a Variable's value, or the array itself."""
    return _walk.variable_of(cell.template).value if cell.kind == Kind.VARIABLE else cell.template


def _expected(cell: _Cell) -> tuple[tuple[int, ...], np.dtype] | None:
    if cell.kind == Kind.PYTHON:
        return None
    if cell.prng:
        spec = jax.eval_shape(jax.random.key_data, _value(cell))  # the key data it is saved as
        return tuple(spec.shape), np.dtype(spec.dtype)
    # a PartitionedVariable has the full shape
    v = _walk.variable_of(cell.template) if cell.kind == Kind.VARIABLE else cell.template
    return tuple(v.shape if cell.info is None else cell.info.full_shape), np.dtype(v.dtype)


def _check(reader: Any, cell: _Cell) -> bool:
    """Checks shape and dtype before anything is loaded; True if a 64-bit value goes into JAX's 32-bit type."""
    want = _expected(cell)
    if want is None:
        return False
    shape, dtype = tuple(reader.shape(cell.key)), np.dtype(reader.dtype(cell.key))
    if shape != want[0]:
        raise ValueError(
            f"Cannot restore {cell.label}: the checkpoint value {cell.key!r} has shape {shape}, the object "
            f"has shape {want[0]}. Build the object with the saved shape or leave it out of the restore."
        )
    # With JAX's 64-bit types off, a 64-bit value (TF's int64 global_step) fits the type JAX made, as in
    # restore_by_name; its range is checked when it is converted.
    if not _dtypes.fits(dtype, want[1]):
        raise TypeError(
            f"Cannot restore {cell.label}: the checkpoint value {cell.key!r} has dtype {dtype}, the object "
            f"has dtype {want[1]}. Build the object with dtype {dtype} or cast after restoring."
        )
    return dtype != want[1]


def _place(value: Any, like: Any) -> jax.Array:
    sharding = _target_sharding(like)
    if isinstance(value, jax.Array) and (sharding is None or value.sharding == sharding):
        return value
    return jax.device_put(np.asarray(value) if not isinstance(value, jax.Array) else value, sharding)


def _finish(cell: _Cell, value: Any, impl: Any = None) -> Any:
    t = cell.template
    if cell.prng:
        return _finish_key(cell, value, impl)
    want = _expected(cell)
    stored = np.dtype(value.dtype) if hasattr(value, "dtype") else None
    if cell.kind == Kind.ARRAY and want is not None and stored != want[1]:
        # A 64-bit value for a template of its 32-bit form (allowed by _check). A jax.Array cannot hold it while
        # JAX's 64-bit types are off, and a plain array has no handle to remember the stored dtype on: it comes
        # back as numpy, in its stored dtype, so that it saves back as stored (TF refuses an int32 into its int64
        # counters). JAX narrows it the first time it takes it, so it must pass the checks a Variable's value
        # passes here: refused now, naming the key, rather than changed then without a word.
        host = np.array(jax.device_get(value))
        _dtypes.narrow(host, want[1], cell.label, cell.key)
        return host.reshape(())[()] if isinstance(t, np.generic) else host
    if want is not None and stored != want[1]:  # allowed by _check: JAX's 32-bit type
        value = _dtypes.narrow(np.asarray(value), want[1], cell.label, cell.key)
    if cell.kind == Kind.PYTHON:
        value = np.asarray(value)
        item = value.item() if value.shape == () else value
        if isinstance(item, bytes):
            item = item.decode()
        # The saved type, or an int into a float: any other conversion would change the value silently.
        saved_as = _dtypes.python_type(t)
        if type(item) is not saved_as and not (saved_as is float and type(item) is int):
            found = f"an array of shape {value.shape}" if value.shape else f"a Python {type(item).__name__}"
            raise TypeError(
                f"Cannot restore {cell.label}: the checkpoint value {cell.key!r} is {found}, the object is a Python "
                f"{type(t).__name__}. Give a template of the saved type, or leave it out of the restore."
            )
        return type(t)(item)
    if cell.kind == Kind.ARRAY:
        if isinstance(t, (np.ndarray, np.generic)):
            host = np.asarray(jax.device_get(value))
            return host.reshape(()).astype(t.dtype)[()] if isinstance(t, np.generic) else host.copy()
        return _place(value, t)
    if cell.kind == Kind.PARTITIONED:
        full = np.asarray(jax.device_get(value))
        return _walk.rebuild(t, lambda _, shard: _slice_into(shard, full, stored))
    var = _walk.variable_of(t)
    if cell.info is not None:
        return _slice_into(var, np.asarray(jax.device_get(value)), stored)
    # The handle remembers the stored dtype (an int64 held as int32), so the variable saves back as stored.
    var = _seam.record_saved_dtype(var, stored)
    return _walk.rewrap(t, _seam.with_value(var, _place(value, var.value)))


def _slice_into(shard: Variable, full: np.ndarray, stored: np.dtype | None) -> Variable:
    info = shard.save_slice_info
    index = _keys.slice_index(info.var_offset, info.var_shape)
    shard = _seam.record_saved_dtype(shard, stored)
    return _seam.with_value(shard, _place(np.ascontiguousarray(full[index]), shard.value))


def _finish_key(cell: _Cell, data: Any, impl: Any) -> Any:
    """A PRNG key rebuilt from its saved key data and implementation, placed as the template's key."""
    want = _walk.key_impl(_value(cell))
    if impl is None:
        name: Any = want
    else:
        name = np.asarray(impl).reshape(-1)
        name = name[0] if name.size == 1 else None
        name = name.decode("utf-8", "replace") if isinstance(name, bytes) else name
    if not isinstance(name, str) or name != want:
        raise TypeError(
            f"Cannot restore {cell.label}: the checkpoint's PRNG key {cell.key!r} is of implementation {name!r} "
            f"({cell.impl_key!r}), the object's is {want!r}. Make the template's key with "
            f"jax.random.key(..., impl={name!r})."
        )
    key = jax.random.wrap_key_data(jnp.asarray(jax.device_get(data)), impl=name)
    key = _place(key, _value(cell))
    if cell.kind == Kind.ARRAY:
        return key
    var = _walk.variable_of(cell.template)
    return _walk.rewrap(cell.template, _seam.with_value(var, key))
