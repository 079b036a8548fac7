"""`LoadStatus`: restore by object-graph structure, TF's status assertions, deferred restoration."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import jax
import numpy as np

from checkpoint import _graph
from checkpoint._by_name import _convert
from checkpoint._graph import ARRAY, CONTAINER, OPTIMIZER, PARTITIONED, PYTHON, VARIABLE
from varstate._partition import PartitionedVariable
from varstate._variable import Variable

_log = logging.getLogger("checkpoint")


@dataclasses.dataclass(eq=False)
class _Cell:
    """Placeholder for one value to restore, replaced once all values are loaded."""

    template: Any
    key: str
    label: str
    kind: int
    info: Any = None  # a SaveSliceInfo: take this slice of the stored full value


@dataclasses.dataclass(eq=False)
class _OptCell:
    """Placeholder for an optimizer state whose slots are matched after every primary."""

    template: Any
    non_slots: dict
    plain: Any  # the plain-array slots, matched like any container
    node_id: int
    label: str
    slots: Any = None


class _RestoreState:
    """What every status of one restore shares (TF's _CheckpointRestoreCoordinator)."""

    def __init__(self, reader: Any) -> None:
        self.reader = reader
        self.proto = reader.object_graph
        self.names = _graph.node_names(self.proto)
        self.matched: dict[int, str] = {0: "(root)"}
        self.restored_keys: set[str] = set()
        self.unmatched: dict[str, None] = {}  # labels of template objects with no saved value
        self.node_rids: dict[int, list[int]] = {}
        self.pending_slots: dict[tuple[int, int, str], str] = {}
        self.python_objects = 0
        self.expect_partial = False

    def __del__(self) -> None:
        try:
            if not self.expect_partial and self._unresolved():
                _log.warning(
                    "Some values in the checkpoint were not restored: %s. Call expect_partial() on the "
                    "status if this is intended.", ", ".join(self._unresolved()[:10]))
        except Exception:  # never raise from a finalizer
            pass

    def _unresolved(self) -> list[str]:
        return [self.names[i] for i, n in enumerate(self.proto.nodes) if n.attributes and i not in self.matched]


class LoadStatus:
    """The result of `Checkpoint.restore`: restored roots, TF's assertions, deferred restoration.

    ``status.<root>`` is the restored pytree for that root (the template's
    structure and resource ids, values from the checkpoint).
    ``status.restore(**more_roots)`` restores roots created later from the
    same checkpoint (e.g. an optimizer state made after the model was
    restored); the assertions of every status of one restore see them all.

    >>> import os, tempfile, jax.numpy as jnp, varstate, checkpoint
    >>> w = varstate.Variable(jnp.ones(3), name="w")
    >>> path = checkpoint.Checkpoint(model={"w": w}, step=jnp.int32(7)).write(os.path.join(tempfile.mkdtemp(), "c"))
    >>> status = checkpoint.Checkpoint(model={"w": varstate.Variable(jnp.zeros(3))}).restore(path)
    >>> status.assert_existing_objects_matched().model["w"].value.tolist()
    [1.0, 1.0, 1.0]
    >>> int(status.restore(step=jnp.int32(0)).step)
    7
    >>> status.assert_consumed() is status
    True
    """

    def __init__(self, state: _RestoreState, roots: dict[str, Any]) -> None:
        self._state = state
        self._roots = roots

    def __getattr__(self, name: str) -> Any:
        roots = self.__dict__.get("_roots", {})
        if name in roots:
            return roots[name]
        raise AttributeError(f"LoadStatus has no restored root {name!r}; it has {sorted(roots)}.")

    @property
    def roots(self) -> dict[str, Any]:
        """The restored roots by name."""
        return dict(self._roots)

    # --- restoring ------------------------------------------------------------
    def restore(self, **roots: Any) -> LoadStatus:
        """Restores more roots from the values still pending (deferred restoration)."""
        return LoadStatus(self._state, {})._restore(roots)

    def _restore(self, roots: dict[str, Any]) -> LoadStatus:
        st = self._state
        top = {r.local_name: r.node_id for r in st.proto.nodes[0].children}
        cells: list[_Cell] = []
        opts: list[_OptCell] = []
        template_rids: set[int] = set()
        tree = {
            name: self._match(obj, top.get(name), f"(root).{name}", cells, opts, template_rids)
            for name, obj in roots.items()
        }
        for opt in opts:
            self._match_slots(opt, cells, template_rids)
        loaded = self._load(cells)

        def resolve(x):
            if isinstance(x, _OptCell):
                slots = jax.tree.map(resolve, x.slots, is_leaf=_is_cell)
                non_slots = jax.tree.map(resolve, x.non_slots, is_leaf=_is_cell)
                return dataclasses.replace(x.template, slots=slots, non_slots=non_slots)
            return _finish(x, loaded[x.key]) if isinstance(x, _Cell) else x

        self._roots = {name: jax.tree.map(resolve, t, is_leaf=_is_cell) for name, t in tree.items()}
        return self

    def _match(self, obj, node_id, label, cells, opts, rids) -> Any:
        st = self._state
        k = _graph.kind(obj)
        if k in (VARIABLE, PARTITIONED):
            rids.update(v.resource_id for v in _shards(obj))
        if k == _graph.NONE:
            return obj
        if node_id is None or not 0 <= node_id < len(st.proto.nodes):
            self._unmatched(obj, k, label)
            return obj
        node = st.proto.nodes[node_id]
        if k in (VARIABLE, PARTITIONED, ARRAY, PYTHON):
            if not node.attributes:
                self._unmatched(obj, k, label)
                return obj
            st.matched[node_id] = label
            if k in (VARIABLE, PARTITIONED):
                st.node_rids[node_id] = [v.resource_id for v in _shards(obj)]
            cell = _Cell(obj, node.attributes[0].checkpoint_key, label, k)
            cells.append(cell)
            return cell
        if not node.attributes:  # a saved value is not consumed by a container standing in its place
            st.matched[node_id] = label
        ids = {r.local_name: r.node_id for r in node.children}

        def child(name, c):
            return self._match(c, ids.get(name), f"{label}.{name}", cells, opts, rids)

        if k == OPTIMIZER:
            non_slots = {name: child(name, v) for name, v in obj.non_slots.items()}
            opt = _OptCell(obj, non_slots, child(_graph.PLAIN_SLOTS, _graph.plain_slots(obj)), node_id, label)
            opts.append(opt)
            return opt
        return _graph.rebuild(obj, child, label)

    def _unmatched(self, obj, k, label) -> None:
        if k in (VARIABLE, PARTITIONED, ARRAY, PYTHON):
            self._state.unmatched[label] = None
        elif k in (CONTAINER, OPTIMIZER):
            for name, c in _graph.children(obj, label):
                self._unmatched(c, _graph.kind(c), f"{label}.{name}")
            if k == OPTIMIZER:
                for slot in _graph.slot_variables(obj):
                    self._state.unmatched[f"{label}'s slot {slot.name!r}"] = None

    def _match_slots(self, opt: _OptCell, cells, template_rids) -> None:
        """A slot is matched through its primary's node and slot name (not the optimizer's layout)."""
        st = self._state
        templates: dict[tuple[int, str], Variable] = {}
        for slot in _graph.slot_variables(opt.template):
            templates[(slot.handle.slot_of, slot.handle.slot_name)] = slot
        rid_node = {rid: n for n, rs in st.node_rids.items() for rid in rs}
        by_rid: dict[int, _Cell] = {}
        for ref in st.proto.nodes[opt.node_id].slot_variables:
            pending = (opt.node_id, ref.original_variable_node_id, ref.slot_name)
            rids = st.node_rids.get(ref.original_variable_node_id)
            found = [templates[(r, ref.slot_name)] for r in rids or () if (r, ref.slot_name) in templates]
            slot_node = ref.slot_variable_node_id
            if not found or not 0 <= slot_node < len(st.proto.nodes) or not st.proto.nodes[slot_node].attributes:
                st.pending_slots[pending] = f"{st.names[slot_node] if 0 <= slot_node < len(st.names) else slot_node}"
                continue
            st.pending_slots.pop(pending, None)
            key = st.proto.nodes[slot_node].attributes[0].checkpoint_key
            label = f"{opt.label}'s slot {ref.slot_name!r} for {st.matched[ref.original_variable_node_id]}"
            st.matched[slot_node] = label
            for slot in found:
                info = slot.save_slice_info if len(rids) > 1 else None
                cell = _Cell(slot, key, label, VARIABLE, info)
                cells.append(cell)
                by_rid[slot.resource_id] = cell
        for (primary, _), slot in templates.items():
            if slot.resource_id not in by_rid and (primary in rid_node or primary in template_rids):
                st.unmatched[f"{opt.label}'s slot {slot.name!r}"] = None
        opt.slots = _graph.merge_slots(opt.template.slots, lambda v: by_rid.get(v.resource_id, v), opt.plain)

    def _load(self, cells: list[_Cell]) -> dict[str, Any]:
        reader = self._state.reader
        requests: dict[str, Any] = {}
        for cell in cells:
            target = None
            if _check(reader, cell):
                pass  # narrowed to JAX's 32-bit type on the host, where its range is checked
            elif cell.kind == VARIABLE and cell.info is None:
                target = _target_sharding(_graph.as_variable(cell.template).value)
            elif cell.kind == ARRAY and not isinstance(cell.template, (np.ndarray, np.generic)):
                target = _target_sharding(cell.template)
            if cell.key not in requests:
                requests[cell.key] = target
            elif requests[cell.key] != target:
                requests[cell.key] = None  # wanted on two placements: load on the host once
        if hasattr(reader, "get_many"):
            loaded = reader.get_many(requests)
        else:
            loaded = {}
            for key, sharding in requests.items():
                if sharding is not None and hasattr(reader, "get_into"):
                    loaded[key] = reader.get_into(key, sharding)
                else:
                    loaded[key] = reader.get(key)
        self._state.restored_keys.update(requests)
        return loaded

    # --- TF's assertions --------------------------------------------------------
    def assert_consumed(self) -> LoadStatus:
        """Every checkpointed value was restored and every object matched (TF's semantics)."""
        self.assert_existing_objects_matched()
        st = self._state
        if st.pending_slots:  # checked first: more specific than the unresolved slot nodes
            raise AssertionError(
                f"Unresolved slot restorations: {sorted(st.pending_slots.values())}: their primaries or the "
                "optimizer's slot variables were not given to any restore."
            )
        for i, node in enumerate(st.proto.nodes):
            if node.attributes and i not in st.matched:
                keys = ", ".join(a.checkpoint_key for a in node.attributes)
                raise AssertionError(
                    f"Unresolved object in checkpoint {st.names[i]}: its value ({keys}) was not restored "
                    "into any object. Pass the object that should receive it (status.restore(...)) or "
                    "call expect_partial() and use assert_existing_objects_matched()."
                )
        return self

    def assert_existing_objects_matched(self) -> LoadStatus:
        """Every object given to a restore (with a value) was matched in the checkpoint."""
        unmatched = list(self._state.unmatched)
        if unmatched:
            n = len(unmatched)
            raise AssertionError(
                f"Found {n} Python objects that were not bound to checkpointed values, likely due to "
                f"changes in the Python program. Showing {min(n, 10)} of {n} unmatched objects: {unmatched[:10]}"
            )
        return self

    def assert_nontrivial_match(self) -> LoadStatus:
        """Something other than the root matched (the checkpoint fits the program at all)."""
        st = self._state
        matched = [label for label in st.matched.values() if label not in ("(root)", "(root).save_counter")]
        if not matched:
            if st.unmatched:
                raise AssertionError(
                    "Nothing except the root object matched a checkpointed value. Typically this means that "
                    "the checkpoint does not match the Python program. The following objects have no matching "
                    f"checkpointed value: {list(st.unmatched)[:10]}"
                )
            raise AssertionError("Nothing to load. No dependencies have been added to the Checkpoint yet.")
        return self

    def expect_partial(self) -> LoadStatus:
        """Silences the warning about unrestored values logged when the restore is discarded."""
        self._state.expect_partial = True
        return self


class _InitializationOnlyStatus(LoadStatus):
    """`restore(None)`: nothing to restore from; the roots are returned as given and every assertion fails."""

    def __init__(self, roots: dict[str, Any]) -> None:
        self._roots = roots

    def restore(self, **roots: Any) -> LoadStatus:
        return _InitializationOnlyStatus(roots)

    def assert_consumed(self) -> LoadStatus:
        raise AssertionError(
            "No checkpoint specified (save_path=None); nothing is being restored. The roots are returned as given."
        )

    assert_existing_objects_matched = assert_nontrivial_match = assert_consumed

    def expect_partial(self) -> LoadStatus:
        return self


def _is_cell(x: Any) -> bool:
    return isinstance(x, (_Cell, _OptCell))


def _shards(obj: Any) -> list[Variable]:
    return list(obj) if isinstance(obj, PartitionedVariable) else [_graph.as_variable(obj)]


def _target_sharding(value: Any) -> Any:
    sharding = getattr(value, "sharding", None)
    return sharding if isinstance(sharding, jax.sharding.Sharding) else None


def _expected(cell: _Cell) -> tuple[tuple[int, ...], np.dtype] | None:
    t = cell.template
    if cell.kind == PYTHON:
        return None
    if cell.kind == PARTITIONED:
        return tuple(t.shape), np.dtype(t.dtype)
    v = _graph.as_variable(t) if cell.kind == VARIABLE else t
    if cell.info is not None:
        return tuple(cell.info.full_shape), np.dtype(v.dtype)
    return tuple(v.shape), np.dtype(v.dtype)


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
    if dtype != want[1] and jax.dtypes.canonicalize_dtype(dtype) != want[1]:
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


def _finish(cell: _Cell, value: Any) -> Any:
    t = cell.template
    want = _expected(cell)
    if want is not None and np.dtype(value.dtype) != want[1]:  # allowed by _check: JAX's 32-bit type
        value = _convert(np.asarray(value), want[1], cell.label, cell.key)
    if cell.kind == PYTHON:
        value = np.asarray(value)
        item = value.item() if value.shape == () else value
        if isinstance(item, bytes):
            item = item.decode()
        # The saved type, or an int into a float: any other conversion would change the value silently.
        saved_as = _graph.python_type(t)
        if type(item) is not saved_as and not (saved_as is float and type(item) is int):
            found = f"an array of shape {value.shape}" if value.shape else f"a Python {type(item).__name__}"
            raise TypeError(
                f"Cannot restore {cell.label}: the checkpoint value {cell.key!r} is {found}, the object is a Python "
                f"{type(t).__name__}. Give a template of the saved type, or leave it out of the restore."
            )
        return type(t)(item)
    if cell.kind == ARRAY:
        if isinstance(t, (np.ndarray, np.generic)):
            host = np.asarray(jax.device_get(value))
            return host.reshape(()).astype(t.dtype)[()] if isinstance(t, np.generic) else host.copy()
        return _place(value, t)
    if cell.kind == PARTITIONED:
        full = np.asarray(jax.device_get(value))
        return _graph.rebuild(t, lambda _, shard: _slice_into(shard, full))
    var = _graph.as_variable(t)
    if cell.info is not None:
        return _slice_into(var, np.asarray(jax.device_get(value)))
    return _graph.rewrap(t, var._with_value(_place(value, var.value)))


def _slice_into(shard: Variable, full: np.ndarray) -> Variable:
    info = shard.save_slice_info
    index = tuple(slice(o, o + n) for o, n in zip(info.var_offset, info.var_shape, strict=True))
    return shard._with_value(_place(np.ascontiguousarray(full[index]), shard.value))
