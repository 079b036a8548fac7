"""Name-based restore: TF1 `Saver` checkpoints into varstate pytrees, matched by variable name.

The assignment map follows `tf.compat.v1.train.init_from_checkpoint`: keys are
checkpoint names or scopes, values are names or scopes of the variables being
restored (or the Variables themselves). Partitioned variables match by their
full name; each shard takes its slice of the reassembled tensor, so the shard
layout need not be the one that was saved.

Two fallbacks make a TF checkpoint resume with no map, as TF's `Saver` does:
on an object-based checkpoint a name also matches an object-graph attribute's
``full_name`` (TF's `object_graph_key_mapping`), and an optimizer state's
slots match TF1's slot names. TF1's `slot_creator` names a variable's slots
``<var>/<optimizer name>`` in creation order, uniquified by variable scope:
the first ``<var>/Adam``, the next ``<var>/Adam_1`` (a partitioned variable's
slot is saved under its full name, ``emb/Adam``); non-slots (``beta1_power``)
keep their names.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable, Mapping
from typing import Any

import jax
import numpy as np

from checkpoint import _dtypes, _keys, _storage
from varstate import PartitionedVariable, Variable, _seam
from varstate.optimizers import OptimizerState


@dataclasses.dataclass(frozen=True)
class NameBasedLoadStatus:
    """What `restore_by_name` restored, and what it left on either side.

    Attributes:
      params: the restored pytree: the template's structure and resource ids.
      matched: {variable name: checkpoint key} for every variable restored
        (a partitioned variable appears once, under its full name; an
        optimizer slot under its own name, e.g. ``dense/kernel/m``).
      missing_in_checkpoint: names of the template's variables that got no value
        (they keep the template's value).
      unused_in_checkpoint: checkpoint keys that no variable took.
      optimizer_state: the restored `OptimizerState` when one was given, else None.

    >>> import numpy as np, jax.numpy as jnp, varstate, checkpoint, tempfile, os
    >>> prefix = os.path.join(tempfile.mkdtemp(), "model.ckpt")
    >>> _ = checkpoint.write_name_based(prefix, {"w": np.ones(2, np.float32), "step": np.int64(3)})
    >>> w = varstate.Variable(jnp.zeros(2), name="w", registry=varstate.Registry())
    >>> status = checkpoint.restore_by_name(prefix, {"w": w})
    >>> status.matched, status.missing_in_checkpoint, status.unused_in_checkpoint
    ({'w': 'w'}, (), ('step',))
    >>> status.assert_consumed()
    Traceback (most recent call last):
    AssertionError: Unused checkpoint values: ['step'] (not restored into any variable); ...
    """

    params: Any
    matched: dict[str, str]
    missing_in_checkpoint: tuple[str, ...]
    unused_in_checkpoint: tuple[str, ...]
    optimizer_state: Any = None

    def assert_existing_objects_matched(self) -> NameBasedLoadStatus:
        """Checks that every variable of the template was restored.

        Returns:
            This status.

        Raises:
            AssertionError: a variable got no value (the message names them).
        """
        if self.missing_in_checkpoint:
            raise AssertionError(f"Variables not found in the checkpoint: {list(self.missing_in_checkpoint)} (they "
                                 "kept their template values). Map them to checkpoint names with assignment_map, or "
                                 "list the checkpoint's names with `python -m checkpoint inspect PATH`.")
        return self

    def assert_consumed(self) -> NameBasedLoadStatus:
        """Checks that every variable was restored and every checkpoint value was used.

        Returns:
            This status.

        Raises:
            AssertionError: a variable got no value, or a checkpoint value was
                not used (the message names them).
        """
        self.assert_existing_objects_matched()
        if self.unused_in_checkpoint:
            raise AssertionError(f"Unused checkpoint values: {list(self.unused_in_checkpoint)} (not restored into any "
                                 "variable); add variables for them or map them with assignment_map.")
        return self


def _pairs(assignment_map: Any) -> list[tuple[str, Any]]:
    items = assignment_map.items() if isinstance(assignment_map, Mapping) else assignment_map
    try:
        pairs = [(k, t) for k, t in items]
    except (TypeError, ValueError):
        raise TypeError("assignment_map must be a dict or a list of (checkpoint name, variable or name) pairs, "
                        f"got {type(assignment_map).__name__}.") from None
    for k, _ in pairs:
        if not isinstance(k, str) or not k:
            raise TypeError(f"assignment_map keys must be checkpoint names or scopes (non-empty str), got {k!r}.")
    # TF sorts by checkpoint name only: later pairs for the same variable win.
    return sorted(pairs, key=lambda kv: kv[0])


def _plan(pairs, groups, by_id, ckpt_keys, where) -> dict[str, str]:
    """{variable full name: checkpoint key} from init_from_checkpoint's rules."""
    plan: dict[str, str] = {}
    for ckpt_name, target in pairs:
        if isinstance(target, (Variable, PartitionedVariable, list, tuple)):
            shards = [target] if isinstance(target, Variable) else list(target)
            names = set()
            for v in shards:
                if not isinstance(v, Variable) or v.resource_id not in by_id:
                    what = f"Variable {v.name!r}" if isinstance(v, Variable) else type(v).__name__
                    raise ValueError(f"assignment_map[{ckpt_name!r}]: the {what} is not a Variable of params. "
                                     "Pass variables from the params being restored, or their names.")
                names.add(by_id[v.resource_id])
            if len(names) != 1:
                raise ValueError(f"assignment_map[{ckpt_name!r}]: slices must all be from the same variable, got "
                                 f"{sorted(names)}.")
            name = names.pop()
        elif not isinstance(target, str):
            raise TypeError(f"assignment_map[{ckpt_name!r}]: expected a variable name, a scope ending in '/', a "
                            f"Variable or a PartitionedVariable, got {type(target).__name__}.")
        elif target in groups:
            name = target
        else:
            plan.update(_plan_scope(ckpt_name, target, groups, ckpt_keys, where))
            continue
        if ckpt_name not in ckpt_keys:
            raise ValueError(f"Tensor {ckpt_name!r} is not found in checkpoint {where} (asked for by assignment_map "
                             f"for variable {name!r}). List its names with `python -m checkpoint inspect {where}`.")
        plan[name] = ckpt_name
    return plan


def _plan_scope(ckpt_scope: str, scope: str, groups, ckpt_keys, where) -> dict[str, str]:
    if not scope.endswith("/"):
        raise ValueError(f"assignment_map[{ckpt_scope!r}] = {scope!r}: params have no variable named {scope!r}; "
                         f"to map a scope, end both sides with '/' (e.g. {ckpt_scope.rstrip('/') + '/'!r}: "
                         f"{scope + '/'!r}).")
    if not ckpt_scope.endswith("/"):
        raise ValueError(f"assignment_map[{ckpt_scope!r}] = {scope!r}: a scope must map to a checkpoint scope "
                         f"ending in '/' (e.g. {ckpt_scope + '/'!r}: {scope!r}), or name a single variable on both "
                         "sides.")
    prefix = "" if scope == "/" else scope
    plan = {}
    for name in sorted(n for n in groups if n.startswith(prefix)):
        tail = name[len(prefix):]
        key = tail if ckpt_scope == "/" else ckpt_scope + tail
        if key not in ckpt_keys:
            raise ValueError(f"Tensor {key!r} is not found in checkpoint {where}: assignment_map maps scope {scope!r} "
                             f"to {ckpt_scope!r}, and {scope!r} holds variable {name!r}. Map that variable separately, "
                             "or restore without it.")
        plan[name] = key
    return plan


def _check_dtype(have: np.dtype, want: np.dtype, name: str, key: str) -> None:
    # TF refuses to change a dtype on restore. One exception: with 64-bit types
    # disabled, JAX made the variable 32-bit (TF's int64 `global_step`).
    if not _dtypes.fits(have, want):
        raise TypeError(f"Dtype of variable {name!r} ({want}) does not match the dtype of tensor {key!r} ({have}) in "
                        f"the checkpoint. Create the variable with dtype {have}.")


# TF1's slot names: {our slot names: [(TF1 optimizer's default name, our slots in TF1's creation order)]}.
# Each optimizer's `_create_slots` makes them in this order; the k-th gets the suffix `_k` (k > 0).
# Adagrad and ProximalAdagrad share a slot set: the checkpoint's names tell which one saved it.
TF1_SLOTS: dict[frozenset[str], tuple[tuple[str, tuple[str, ...]], ...]] = {
    frozenset(order): tuple((name, order) for name in names)
    for names, order in (
        (("Adam",), ("m", "v")),
        (("Momentum",), ("momentum",)),
        (("RMSProp",), ("rms", "momentum")),
        (("RMSProp",), ("rms", "mg", "momentum")),
        (("Adagrad", "ProximalAdagrad"), ("accumulator",)),
        (("Adadelta",), ("accum", "accum_update")),
        (("Ftrl",), ("accum", "linear")),
        (("AdagradDA",), ("gradient_accumulator", "gradient_squared_accumulator")),
    )
}


def tf1_slot_name(optimizer_name: str, order: tuple[str, ...], slot: str) -> str:
    """The suffix TF1 gives slot `slot` of an optimizer named `optimizer_name` that creates `order`.

    >>> from checkpoint._tf._name_based import tf1_slot_name
    >>> tf1_slot_name("Adam", ("m", "v"), "v"), tf1_slot_name("RMSProp", ("rms", "mg", "momentum"), "mg")
    ('Adam_1', 'RMSProp_1')
    """
    k = order.index(slot)
    return optimizer_name if k == 0 else f"{optimizer_name}_{k}"


def _variables(leaves: list, start: int, stop: int) -> tuple[dict[str, list[int]], dict[int, str]]:
    """{full name: leaf indices} of the Variables in leaves[start:stop], and {resource id: full name}.

    A partitioned variable's shards share one full name.
    """
    groups: dict[str, list[int]] = {}
    by_id: dict[int, str] = {}
    for i in range(start, stop):
        leaf = leaves[i]
        if isinstance(leaf, Variable):
            name = leaf.name if leaf.save_slice_info is None else leaf.save_slice_info.full_name
            groups.setdefault(name, []).append(i)
            by_id[leaf.resource_id] = name
    return groups, by_id


def _key_by_name(reader: Any, ckpt_keys: set[str]) -> dict[str, str]:
    """{name: checkpoint key}: every key under its own name, and under an object graph's full_name for it.

    The full names are TF's object_graph_key_mapping, on an object-based checkpoint; a key's own name wins.
    """
    graph = reader.object_graph
    full_names = {} if graph is None else {
        a.full_name: a.checkpoint_key for node in graph.nodes for a in node.attributes if a.full_name}
    return {**{n: k for n, k in full_names.items() if k in ckpt_keys}, **{k: k for k in ckpt_keys}}


def _slot_layout(state: Any, ckpt_keys: set[str], optimizer_name: str | None) -> tuple[str, tuple[str, ...]] | None:
    """(TF1 optimizer name, slot creation order) for the state's slots, or None if TF1 has no such optimizer."""
    names = frozenset(n for n in state.slots if jax.tree_util.tree_leaves(
        state.slots[n], is_leaf=lambda x: isinstance(x, Variable)))
    layouts = TF1_SLOTS.get(names)
    if not layouts:
        return None
    if optimizer_name is not None:
        return optimizer_name, layouts[0][1]
    held = ((name, order) for name, order in layouts if any(k.endswith("/" + name) for k in ckpt_keys))
    return next(held, layouts[0])  # the one whose names the checkpoint holds


def _state_plan(leaves, groups, by_id_params, plan, key_by_name, layout, mapped, scope) -> dict[str, str]:
    """{state variable name: checkpoint key}: slots follow their primary, non-slots keep their names."""
    out: dict[str, str] = {}
    for name, idx in groups.items():
        link = _seam.slot_link(leaves[idx[0]])
        if link is None:
            candidates = [scope + name, name]
        else:
            rid, slot = link
            primary = by_id_params.get(rid, name[: -len(slot) - 1])
            if mapped and primary not in plan:
                continue  # the map leaves this slot's primary alone, so its slots too
            base = plan.get(primary, primary)
            candidates = [f"{base}/{slot}"]
            if layout is not None:
                candidates.append(f"{scope}{base}/{tf1_slot_name(layout[0], layout[1], slot)}")
        key = next((key_by_name[c] for c in candidates if c in key_by_name), None)
        if key is not None:
            out[name] = key
    return out


def restore_by_name(
    prefix: str | os.PathLike,
    params: Any,
    assignment_map: Mapping[str, Any] | Iterable[tuple[str, Any]] | None = None,
    *,
    optimizer_state: OptimizerState | None = None,
    optimizer_name: str | None = None,
    optimizer_scope: str = "",
) -> NameBasedLoadStatus:
    """Restores a name-based (TF1 `tf.compat.v1.train.Saver`) checkpoint into `params` by variable name.

    Every `Variable` in `params` (any pytree) is matched by its `.name`, scopes
    included; a `PartitionedVariable` (or a shard with a `save_slice_info`)
    matches by its full name, and each shard takes its slice of the
    reassembled tensor. On an object-based (TF2) checkpoint a name also
    matches the ``full_name`` its object graph records, as TF's `Saver` does:
    a tf-keras model's ``lstm_model/dense/kernel`` restores with no map.

    `optimizer_state` (an `OptimizerState` for these params) is restored
    too, into ``status.optimizer_state``: each slot from its own name
    (``<var>/m``) or TF1's (``<var>/Adam`` for ``m``, ``<var>/Adam_1`` for
    ``v``; ``<var>/Momentum``; ``<var>/RMSProp``, ``_1``, ``_2`` for ``rms``,
    ``mg`` if centered, ``momentum``; ``<var>/Adagrad`` or
    ``<var>/ProximalAdagrad``; ``<var>/Adadelta``, ``_1``; ``<var>/Ftrl``,
    ``_1``; ``<var>/AdagradDA``, ``_1``), and non-slots by name
    (``beta1_power``, ``beta2_power``), so a TF1 run resumes with no map.
    Pass `optimizer_name` if the TF1 optimizer was created with another
    ``name=``, and `optimizer_scope` if its ``minimize``/``apply_gradients``
    ran inside a ``variable_scope``: TF1 then prefixes its slots and non-slots
    with it (``train/dense/kernel/Adam``, ``train/beta1_power``; a name scope
    changes nothing). With an `assignment_map`, a slot follows its primary's checkpoint
    name, and only the slots of mapped variables are restored.

    Without `assignment_map`, every variable whose name is in the checkpoint is
    restored and the rest are reported. With one, only what it names is
    restored, with the rules of `tf.compat.v1.train.init_from_checkpoint`
    (keys: checkpoint names; values: variable names or Variables), and what it
    names must be in the checkpoint:

    - ``{"ckpt/scope/": "scope/"}``: every variable under ``scope/`` from the
      same name under ``ckpt/scope/``;
    - ``{"ckpt/name": "var/name"}`` (or a Variable, or a PartitionedVariable): one variable;
    - ``{"/": "scope/"}``: the variables under ``scope/`` from the checkpoint's
      root; ``{"ckpt/scope/": "/"}``: every variable from under ``ckpt/scope/``;
    - a list of pairs instead of a dict restores one tensor into several
      variables. Pairs apply in order of checkpoint name; a later one wins.

    Nothing is restored if any pair fails. One exception to exact dtypes:
    with JAX's 64-bit types off, an int64/float64 value (TF's int64
    ``global_step``) restores into the 32-bit variable JAX made for it, if it
    fits.

    Args:
        prefix: anything `read_checkpoint` opens: a prefix, a directory (its
            ``checkpoint`` file's latest) or an orbax checkpoint.
        params: the template, any pytree of Variables and PartitionedVariables.
        assignment_map: ``{checkpoint name or scope: variable name, scope or
            Variable}`` (or a list of pairs), as above; None matches by name.
        optimizer_state: an `OptimizerState` for `params` to restore too; None
            restores no optimizer state.
        optimizer_name: the TF1 optimizer's ``name=`` when not its class's
            default (``Adam``, ``Momentum``...).
        optimizer_scope: the ``variable_scope`` TF1's ``minimize`` or
            ``apply_gradients`` ran in (``"train"``); ``""`` for none.

    Returns:
        A `NameBasedLoadStatus` with ``params`` and ``optimizer_state`` restored,
        ``matched``, ``missing_in_checkpoint``, ``unused_in_checkpoint``.

    Raises:
        ValueError: a shape mismatch (naming both names and shapes), or a
            name of `assignment_map` missing from the checkpoint.
        TypeError: a dtype mismatch (TF refuses those too).

    >>> import numpy as np, jax.numpy as jnp, varstate, checkpoint, tempfile, os
    >>> prefix = os.path.join(tempfile.mkdtemp(), "model.ckpt")
    >>> _ = checkpoint.write_name_based(prefix, {"bert/dense/kernel": np.full((2, 2), 5.0, np.float32)})
    >>> r = varstate.Registry()
    >>> params = {"kernel": varstate.Variable(jnp.zeros((2, 2)), name="encoder/dense/kernel", registry=r)}
    >>> status = checkpoint.restore_by_name(prefix, params, {"bert/": "encoder/"})
    >>> status.params["kernel"].value.tolist(), status.matched
    ([[5.0, 5.0], [5.0, 5.0]], {'encoder/dense/kernel': 'bert/dense/kernel'})

    A TF1 Momentum run's slots (``<var>/Momentum``) resume into an optimizer state:

    >>> from varstate.optimizers import Momentum
    >>> tf1 = {"w": np.ones(2, np.float32), "w/Momentum": np.full(2, 0.5, np.float32)}
    >>> _ = checkpoint.write_name_based(prefix, tf1)
    >>> w = varstate.Variable(jnp.zeros(2), name="w", registry=r)
    >>> status = checkpoint.restore_by_name(prefix, [w], optimizer_state=Momentum(0.1, 0.9).init([w]))
    >>> status.optimizer_state.get_slot(w, "momentum").value.tolist(), status.matched
    ([0.5, 0.5], {'w': 'w', 'w/momentum': 'w/Momentum'})
    """
    where = os.fspath(prefix)
    reader = _storage.open_reader(prefix)
    ckpt_keys = set(reader.keys()) - {_keys.OBJECT_GRAPH_KEY}
    key_by_name = _key_by_name(reader, ckpt_keys)
    if optimizer_state is not None and not isinstance(optimizer_state, OptimizerState):
        raise TypeError("restore_by_name: optimizer_state must be an OptimizerState (from opt.init(params)), got "
                        f"{type(optimizer_state).__name__}.")

    given_state = optimizer_state
    if optimizer_state is not None and optimizer_state.fused:  # matched per slot Variable, packed back at the end
        optimizer_state = OptimizerState(optimizer_state.slots, optimizer_state.non_slots)
    is_var = lambda x: isinstance(x, Variable)
    n_params = len(jax.tree_util.tree_leaves(params, is_leaf=is_var))
    leaves, treedef = jax.tree_util.tree_flatten((params, optimizer_state), is_leaf=is_var)
    groups, by_id = _variables(leaves, 0, n_params)

    if assignment_map is None:
        plan = {name: key_by_name[name] for name in groups if name in key_by_name}
    else:
        plan = _plan(_pairs(assignment_map), groups, by_id, ckpt_keys, where)
    if optimizer_state is not None:
        state_groups, _ = _variables(leaves, n_params, len(leaves))
        layout = _slot_layout(optimizer_state, ckpt_keys, optimizer_name)
        scope = optimizer_scope.strip("/") + "/" if optimizer_scope.strip("/") else ""
        state_plan = _state_plan(leaves, state_groups, by_id, plan, key_by_name, layout, assignment_map is not None,
                                 scope)
        for name, idx in state_groups.items():
            groups.setdefault(name, []).extend(idx)
        plan.update({n: k for n, k in state_plan.items() if n not in plan})

    # Check everything before reading anything: a failed restore changes nothing.
    for name, key in plan.items():
        have = tuple(reader.shape(key))
        for i in groups[name]:
            info = leaves[i].save_slice_info
            want = tuple(leaves[i].shape) if info is None else tuple(info.full_shape)
            if want != have:
                raise ValueError(f"Shape of variable {name!r} {want} does not match the shape of tensor {key!r} {have} "
                                 f"in checkpoint {where}. Create the variable with shape {have}, or map it to another "
                                 "tensor.")
            _check_dtype(np.dtype(reader.dtype(key)), np.dtype(leaves[i].dtype), name, key)

    new = list(leaves)
    for name, key in plan.items():
        value = reader.get(key)
        for i in groups[name]:
            v = leaves[i]
            part = _dtypes.narrow(value, np.dtype(v.dtype), name, key)
            info = v.save_slice_info
            if info is not None:
                part = part[_keys.slice_index(info.var_offset, info.var_shape)]
            new[i] = v.assign(part)
    restored, state = jax.tree_util.tree_unflatten(treedef, new)
    if given_state is not None and given_state.fused:
        state = given_state.replace(slots=state.slots, non_slots=state.non_slots)
    return NameBasedLoadStatus(params=restored, matched=dict(sorted(plan.items())), optimizer_state=state,
                               missing_in_checkpoint=tuple(sorted(n for n in groups if n not in plan)),
                               unused_in_checkpoint=tuple(sorted(ckpt_keys - set(plan.values()))))


def write_name_based(prefix: str | os.PathLike, tensors: Mapping[str, Any]) -> str:
    """Writes a TF name-based checkpoint (what `tf.compat.v1.train.Saver` writes) at `prefix`; returns `prefix`.

    A `varstate.PartitionedVariable` is written as TF1's Saver writes
    partitioned variables: one entry for the full name listing the slices,
    and each shard's value under its slice (from its `SaveSliceInfo`). The
    result is read by `tf.train.load_checkpoint`, TF1's `Saver.restore`,
    `read_checkpoint` and `restore_by_name`.

    Args:
        prefix: the checkpoint prefix (``prefix.index`` and its data file).
        tensors: ``{TF variable name: array, Variable or PartitionedVariable}``.

    Returns:
        `prefix`.

    Raises:
        ValueError: a shard of a partitioned variable without a `SaveSliceInfo`.

    >>> import os, tempfile, numpy as np, jax.numpy as jnp, varstate, checkpoint
    >>> emb = varstate.PartitionedVariable(jnp.ones((5, 2)), name="emb", num_shards=2, registry=varstate.Registry())
    >>> prefix = checkpoint.write_name_based(os.path.join(tempfile.mkdtemp(), "model.ckpt"),
    ...                                      {"emb": emb, "global_step": np.int64(7)})
    >>> reader = checkpoint.read_checkpoint(prefix)
    >>> reader.keys(), reader.get("emb").shape, [(s[0].start, s[0].stop) for s in reader.get_slices("emb")]
    (['emb', 'global_step'], (5, 2), [(0, 3), (3, 5)])
    """
    out: dict[str, Any] = {}
    for name, value in tensors.items():
        if isinstance(value, PartitionedVariable):
            infos = [v.save_slice_info for v in value]
            if any(info is None for info in infos):
                raise ValueError(f"write_name_based: a shard of {name!r} has no SaveSliceInfo; build the "
                                 "PartitionedVariable with varstate.PartitionedVariable(...), which gives each one.")
            out[name] = _storage.Sliced(tuple(infos[0].full_shape), [
                (tuple(info.var_offset), np.asarray(v.value)) for info, v in zip(infos, value, strict=True)])
        else:
            out[name] = np.asarray(value.value if isinstance(value, Variable) else value)
    path = os.fspath(prefix)
    _storage.write_bundle(path, out)
    return path
