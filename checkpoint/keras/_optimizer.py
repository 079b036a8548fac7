"""Keras optimizer state: Keras 3's and tf.keras 2's layouts in TF checkpoints, Keras 3's ``optimizer/vars`` in HDF5.

Keras 3 (TF backend) tracks an optimizer's variables in one list,
``_variables``: ``iteration``, ``learning_rate`` (absent for a schedule),
then each slot list in turn, a list interleaving its slots per trainable
variable (those Keras keeps for it: `KerasOptimizer.keras_slots`), then
variables made after the slots (Nadam's ``u_product``). The
optimizer also tracks ``_iterations``, ``_learning_rate`` (the same
variables) and ``_trainable_variables`` (the model's variables).
`KerasOptimizer.keras_layout` gives that order for a varstate optimizer.

tf.keras 2 (tf-keras) records ``iter`` and its hyperparameters as children
of the optimizer and each slot against its variable (``slot_variables``,
keys ``<variable path>/.OPTIMIZER_SLOT/<optimizer path>/<slot>/...``); its
slot names are tf.keras's (``m``, ``v``, ``vhat``, ``momentum``, ``rms``,
``mg``, ``accumulator``, ``accum_grad``, ``accum_var``) and are mapped to
Keras 3's.
"""

from __future__ import annotations

import os
import re
import zipfile
from collections.abc import Iterable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import varstate
from checkpoint import _keys, _storage
from checkpoint._checkpoint import Checkpoint
from checkpoint._errors import CheckpointFormatError
from checkpoint.keras import _hdf5, _order, _read
from varstate import _seam
from varstate.optimizers import OptimizerState
from varstate.optimizers.keras import KerasOptimizer

# tf.keras 2's slot names for Keras 3's, by optimizer class (tf-keras optimizer_v2).
_V2_SLOTS = {
    "SGD": {"momentum": "momentum"},
    "Adam": {"momentum": "m", "velocity": "v", "velocity_hat": "vhat"},
    "AdamW": {"momentum": "m", "velocity": "v", "velocity_hat": "vhat"},
    "Adamax": {"momentum": "m", "norm": "v"},
    "Nadam": {"momentum": "m", "velocity": "v"},
    "RMSprop": {"velocity": "rms", "momentum": "momentum", "average_gradient": "mg"},
    "Adagrad": {"accumulator": "accumulator"},
    "Adadelta": {"accumulated_grad": "accum_grad", "accumulated_delta_var": "accum_var"},
}

# tf.keras 2's hyperparameter variables (children of the optimizer), from the Keras 3 optimizer's settings.
_V2_HYPER = {
    "SGD": ("momentum",),
    "Adam": ("beta_1", "beta_2"),
    "Adamax": ("beta_1", "beta_2"),
    "RMSprop": ("rho", "momentum"),
    "Adagrad": (),
    "Adadelta": ("rho",),
}

# Optimizer variables Keras names otherwise: Nadam's u_product; Adafactor's r and c take their variable's own name
# (the last part of its path), which a read does not check.
_KERAS_NAMES = {"u_product": "variable", "r": "", "c": ""}

_MADE_BY = "; pass the state this optimizer made (opt.init / apply_gradients)"


def snake_name(cls_name: str) -> str:
    """Keras's default optimizer name for a class (``AdamW`` -> ``adam_w``, ``RMSprop`` -> ``rm_sprop``)."""
    name = re.sub(r"(.)([A-Z][a-z]+)", r"\1_\2", cls_name)
    return re.sub(r"([a-z])([A-Z])", r"\1_\2", name).lower()


def keras_order(optimizer: KerasOptimizer, trainables: list) -> list[tuple[str, int | None]]:
    """Keras's ``_variables`` for the `trainables` (in Keras's order), in order: (non-slot name, None) or (slot
    name, index of its trainable variable)."""
    lead, groups, trail = optimizer.keras_layout()
    kept = [optimizer.keras_slots(p) for p in trainables]
    order: list[tuple[str, int | None]] = [(name, None) for name in lead]
    for group in groups:
        for i in range(len(trainables)):
            order.extend((name, i) for name in group if name in kept[i])
    return order + [(name, None) for name in trail]


def _describe(order: list[tuple[str, int | None]]) -> str:
    names = [name if p is None else f"{name}[{p}]" for name, p in order]
    return ", ".join(names[:10]) + (", ..." if len(names) > 10 else "")


def _count_error(what: str, held: int, optimizer: KerasOptimizer, n_params: int,
                 order: list[tuple[str, int | None]]) -> ValueError:
    """The error for a checkpoint whose list of optimizer variables, `what`, does not hold `order`."""
    return ValueError(
        f"{what} holds {held} variables, but {type(optimizer).__name__} with these settings on {n_params} trainable "
        f"variables has {len(order)} ({_describe(order)}); make the optimizer as Keras's was made (amsgrad, "
        "momentum, centered, a schedule or a float learning rate)"
    )


def check_optimizer(optimizer: Any, state: Any = None, arg: str = "") -> None:
    """TypeError unless `optimizer` is a Keras optimizer and, when `arg` names it, `state` an OptimizerState."""
    if not isinstance(optimizer, KerasOptimizer):
        raise TypeError(
            f"optimizer must be one of varstate.optimizers.keras's optimizers (Keras's layout and names), got "
            f"{type(optimizer).__name__}; for TF v1 optimizers use checkpoint.Checkpoint"
        )
    if arg and not isinstance(state, OptimizerState):
        raise TypeError(f"{arg} must be the OptimizerState of the optimizer, got {type(state).__name__}")


def _trainable(params: Any) -> tuple[list, Any, list[int]]:
    """(leaves, treedef, the trainable leaves' positions in Keras's order).

    Keras's order is the pytree's, except for weights read from a Keras 3
    file (`KerasWeights` with a layout), whose plain-dict layers JAX flattens
    sorted: their order is the layout's.
    """
    with_paths, treedef = jax.tree_util.tree_flatten_with_path(
        params, is_leaf=lambda x: isinstance(x, varstate.Variable))
    leaves = [x for _, x in with_paths]
    at = {tuple(str(getattr(k, "key", k)) for k in path): i for i, (path, _) in enumerate(with_paths)}
    layout = getattr(params, "layout", ())
    keras = [at[full] for lay in layout for full in ((*lay.path, n) for n in lay.weights) if full in at]
    placed = set(keras)  # once, not per leaf: a model of n weights would be n^2 set builds
    order = keras + [i for i in range(len(leaves)) if i not in placed]
    idx = [i for i in order if not (isinstance(leaves[i], varstate.Variable) and not leaves[i].trainable)]
    return leaves, treedef, idx


def _put(old: Any, value: np.ndarray, where: str, what: str) -> Any:
    """`value` in place of `old` (a Variable or an array): same shape, same dtype family, old's placement."""
    old_value = old.value if isinstance(old, varstate.Variable) else jnp.asarray(old)
    if tuple(value.shape) != tuple(old_value.shape):
        raise ValueError(
            f"{where}: {what} has shape {tuple(value.shape)} in the checkpoint, but {tuple(old_value.shape)} here; "
            "are the params in Keras's order of trainable variables?"
        )
    dtype = np.dtype(old_value.dtype)
    if np.issubdtype(dtype, np.integer):
        info = np.iinfo(dtype)
        if value.size and (value.min() < info.min or value.max() > info.max):
            raise ValueError(f"{where}: {what} is {value.max()}, beyond {dtype}; enable jax_enable_x64 to hold it")
    elif np.dtype(value.dtype).kind != dtype.kind and not (np.dtype(value.dtype).kind == "V" or dtype.kind == "V"):
        raise ValueError(f"{where}: {what} is {value.dtype} in the checkpoint, but {dtype} here")
    new = jnp.asarray(value.astype(dtype, copy=False))
    sharding = getattr(old_value, "sharding", None)
    if sharding is not None:
        new = jax.device_put(new, sharding)
    if isinstance(old, varstate.Variable):
        recorded = _seam.saved_dtype(old)
        return _seam.record_saved_dtype(_seam.with_value(old, new),
                                        value.dtype if np.dtype(value.dtype) != dtype else recorded)
    return new


def _slot_leaf(x: Any) -> bool:
    return x is None or isinstance(x, varstate.Variable)


def _state_from(state: OptimizerState, idx: list[int], where: str,
                values: Iterable[tuple[str, int | None, np.ndarray, str]]) -> OptimizerState:
    """`state` with the checkpoint's `values` put in: (name, trainable variable or None for a non-slot, value, path)."""
    non_slots = dict(state.non_slots)
    slots = {n: jax.tree_util.tree_flatten(t, is_leaf=_slot_leaf) for n, t in state.slots.items()}
    for name, p, value, what in values:
        if p is None:
            non_slots[name] = _put(non_slots[name], value, where, what)
        else:
            slots[name][0][idx[p]] = _put(slots[name][0][idx[p]], value, where, what)
    return OptimizerState(slots={n: treedef.unflatten(flat) for n, (flat, treedef) in slots.items()},
                          non_slots=non_slots)


def _in_keras_order(optimizer: KerasOptimizer, leaves: list, idx: list[int], state: OptimizerState, arg: str,
                    hint: str = "") -> list[tuple[str, int | None, Any]]:
    """(name, trainable variable or None, the non-slot or slot leaf) of `state`, in Keras's ``_variables`` order."""
    order = keras_order(optimizer, [leaves[i] for i in idx])
    for kind, held, wanted in (("non-slot", state.non_slots, [n for n, p in order if p is None]),
                               ("slot", state.slots, [n for n, p in order if p is not None])):
        missing = [n for n in wanted if n not in held]
        if missing:
            raise ValueError(f"{arg} has no {kind} {missing[0]!r}, which {type(optimizer).__name__} keeps{hint}")
    slots = {n: jax.tree_util.tree_flatten(t, is_leaf=_slot_leaf)[0] for n, t in state.slots.items()}
    return [(n, p, state.non_slots[n] if p is None else slots[n][idx[p]]) for n, p in order]


# --- loading ---------------------------------------------------------------------------------------
def load_optimizer_state(
    path: str | os.PathLike, optimizer: Any, params: Any = None, *, node: str = "optimizer"
) -> tuple[Any, Any]:
    """Reads a Keras optimizer's state (and its trainable variables) from a TF checkpoint: ``(params, state)``.

    The optimizer's `keras_layout` says which of Keras 3's
    ``<node>/_variables/N`` is which slot or counter; each variable's Keras
    name (``adam/dense_kernel_momentum``) is checked against it. The state's
    ``iteration`` is Keras's int64 counter (saved back as int64) and its
    ``learning_rate`` Keras's stored one.

    A tf.keras 2 checkpoint (tf-keras ``optimizer_v2``: ``<node>/iter`` and
    slots under ``.OPTIMIZER_SLOT``) is read too: its slot names (``m``,
    ``v``, ``vhat``, ``rms``, ``mg``, ``accum_grad``, ...) become Keras 3's,
    ``iter`` becomes ``iteration``; its variables are matched to `params`
    by name when the names agree, else by order. Beside a tf.keras model
    (``model.save_weights(prefix)`` of a compiled model) the params default
    to the model's weights, in tf.keras's layer order.

    A Keras 3 ``.weights.h5`` or ``.keras`` of a compiled model holds the
    optimizer's variables as ``optimizer/vars/N``, in the same order but
    without names (shapes are checked); `params` then defaults to the
    model's weights (`load_weights`), whose trainable ones, in Keras's layer
    order, are the optimizer's variables. A ``.keras`` records that order
    (its config); for a ``.weights.h5`` of a Functional or Sequential model
    it is the one order of the layers (each class's layers in their file
    order) that gives the optimizer's shapes.

    Args:
        path: a TF checkpoint (prefix or directory), or a Keras 3
            ``.weights.h5`` or ``.keras`` of a compiled model.
        optimizer: the `varstate.optimizers.keras` optimizer made as Keras's
            was (same class, ``amsgrad``, ``momentum``, ``centered``, float or
            schedule learning rate).
        params: None to take the model's weights as `load_weights` returns
            them (a `KerasWeights`, which `save_weights` takes), its trainable
            ones in the optimizer's order: from a ``.weights.h5`` or
            ``.keras``, or a TF checkpoint holding the model, Keras 3's (the
            optimizer's ``_trainable_variables`` are its weights) or tf.keras
            2's (its weights holding slots are its trainable ones). Only a TF
            checkpoint of an optimizer without a Keras model beside it gives
            the trainable variables as a list of new Variables, in Keras's
            order. Or the
            model's trainable params (any pytree whose trainable leaves are in
            Keras's order of ``model.trainable_variables``), which come back
            with the checkpoint's values.
        node: the optimizer's path in the object graph
            (``tf.train.Checkpoint(optimizer=...)`` and ``model.save_weights``
            of a compiled model both use ``"optimizer"``).

    Returns:
        ``(params, state)``, the params with the checkpoint's values and the
        optimizer's `OptimizerState`.

    Raises:
        TypeError: `optimizer` is not a `varstate.optimizers.keras` optimizer.
        ValueError: no optimizer at `node`; a variable count, name, shape or
            dtype that does not fit `optimizer` or `params` (naming it); a
            ``.weights.h5`` whose layers more than one order (or none) fits.
        CheckpointFormatError: a name-based (TF1) checkpoint, or a corrupt file.
        FileNotFoundError: no checkpoint at `path`.

    >>> import os, tempfile, jax.numpy as jnp, varstate
    >>> from checkpoint import keras
    >>> from varstate.optimizers import keras as keras_opt
    >>> opt = keras_opt.Adam(0.01)
    >>> w = varstate.Variable(jnp.ones(2), name="dense/kernel")
    >>> state = opt.init([w])
    >>> (w,), state = opt.apply_gradients([jnp.ones(2)], [w], state)
    >>> path = keras.save_optimizer_state(os.path.join(tempfile.mkdtemp(), "ckpt"), opt, [w], state)
    >>> (w2,), state2 = keras.load_optimizer_state(path, opt)
    >>> w2.name, state2.non_slot("iteration").value.item(), state2.slots["velocity"][0].name
    ('dense/kernel', 1, 'dense/kernel/velocity')
    """
    check_optimizer(optimizer)
    where = os.fspath(path)
    if isinstance(where, str) and os.path.isfile(where) and (zipfile.is_zipfile(where) or _hdf5.is_hdf5(where)):
        return _load_h5(where, optimizer, _read.load_weights(where) if params is None else params)
    _read.missing_file(where, "load_optimizer_state")
    reader = _storage.open_reader(where)
    if reader.object_graph is None:
        raise CheckpointFormatError(f"{where}: a name-based checkpoint (TF1 Saver) holds no Keras optimizer")
    g = _read._Graph(reader, where)
    opt = g.find(node, lambda part, names: ValueError(
        f"{where}: the object graph has no {node!r} (no child {part!r}; there are {sorted(set(names))[:8]}); pass "
        "node= the optimizer's path"))
    kids = g.named(opt)
    if "_variables" in kids:
        return _load_keras3(g, kids, node, optimizer, params)
    if "iter" in kids:
        return _load_v2(g, opt, node, optimizer, params)
    raise ValueError(f"{where}: {node!r} is not a Keras optimizer (it has neither Keras 3's '_variables' nor "
                     f"tf.keras's 'iter'; its children are {sorted(kids)[:8]})")


def _params_from(g: _read._Graph, ids: list[int], paths: list[str], params: Any) -> Any:
    """The checkpoint's values of the trainable variables, as new Variables or put into `params`."""
    values = [g.read(i, p) for i, p in zip(ids, paths, strict=True)]
    if params is None:
        registry = varstate.Registry()
        return [varstate.Variable(v, name=name or p, registry=registry)
                for (v, name), p in zip(values, paths, strict=True)]
    leaves, treedef, idx = _trainable(params)
    if len(idx) != len(values):
        raise ValueError(f"{g.where}: the optimizer was built on {len(values)} trainable variables, but params has "
                         f"{len(idx)}; pass the model's trainable variables, in Keras's order")
    for k, (value, _), path in zip(idx, values, paths, strict=True):
        leaves[k] = _put(leaves[k], value, g.where, path)
    return treedef.unflatten(leaves)


def _model_of(g: _read._Graph, ids: list[int]) -> Any:
    """The weights of the Keras model in the checkpoint (`load_weights`'s dict), when the variables `ids` are its
    trainable ones: reordered so that those come in the order of `ids`. None without such a model (an optimizer
    saved alone: its variables then come back as a list)."""
    paths: dict[int, tuple[str, ...]] = {}
    try:
        weights = _read._read_tf_checkpoint(g.reader, g.where, None, varstate.Registry(), paths)
    except (ValueError, CheckpointFormatError):
        return None  # no Keras model in the checkpoint, or more than one
    if not ids or not all(i in paths for i in ids):
        return None
    weights = _order.by_rank(weights, {paths[i]: k for k, i in enumerate(ids)})
    leaves, _, idx = _trainable(weights)
    # The model's trainable weights must be exactly the optimizer's (by name: a Variable is named by its path).
    return weights if [leaves[k].name for k in idx] == ["/".join(paths[i]) for i in ids] else None


def _load_keras3(g: _read._Graph, kids: dict[str, int], node: str, optimizer: KerasOptimizer, params: Any):
    var_list = g.named(kids["_variables"])
    trainables = g.named(kids["_trainable_variables"]) if "_trainable_variables" in kids else {}
    t_ids = [trainables[str(i)] for i in range(len(trainables))]
    t_paths = [f"{node}/_trainable_variables/{i}" for i in range(len(t_ids))]
    model = _model_of(g, t_ids) if params is None else None
    if model is not None:
        params = model
    elif t_ids or params is None:
        params = _params_from(g, t_ids, t_paths, params)
    leaves, _, idx = _trainable(params)
    order = keras_order(optimizer, [leaves[i] for i in idx])
    if len(var_list) != len(order) or any(str(i) not in var_list for i in range(len(order))):
        raise _count_error(f"{g.where}: {node}/_variables", len(var_list), optimizer, len(idx), order)

    def values() -> Iterable[tuple[str, int | None, np.ndarray, str]]:
        for n, (name, p) in enumerate(order):
            path = f"{node}/_variables/{n}"
            value, full_name = g.read(var_list[str(n)], path)
            named = full_name and full_name != path  # an unnamed array's name is its path
            if named and not full_name.rsplit("/", 1)[-1].endswith(_KERAS_NAMES.get(name, name)):
                raise ValueError(
                    f"{g.where}: {path} is Keras's {full_name!r}, where {type(optimizer).__name__} expects "
                    + (f"{name!r}" if p is None else f"slot {name!r} of trainable variable {p}")
                    + f" ({_describe(order)}); make the optimizer as Keras's was made"
                )
            yield name, p, value, path

    return params, _state_from(optimizer.init(params), idx, g.where, values())


def _load_h5(where: str, optimizer: KerasOptimizer, params: Any):
    """Keras 3's ``optimizer/vars/N`` of a ``.weights.h5`` or ``.keras`` (values by position only)."""
    leaves, _, idx = _trainable(params)
    order = keras_order(optimizer, [leaves[i] for i in idx])
    group_path = f"{_read._OPTIMIZER}/{_read._VARS}"
    with _read._damaged(where), (
            _read._open_archive(where) if not _hdf5.is_hdf5(where) else _hdf5.open_file(where)) as f:
        group = f.get(group_path)
        if group is None:
            raise ValueError(f"{where}: no optimizer state (no '{group_path}' group): Keras saves it only "
                             "for a compiled model whose optimizer was built (trained, or optimizer.build)")
        keys = sorted(_hdf5.names(group, f"{where}: {group_path}"), key=lambda k: (len(k), k))
        if keys != [str(i) for i in range(len(order))]:
            raise _count_error(f"{where}: {group_path}", len(keys), optimizer, len(idx), order)
        budget = _read._SizeBudget(f)
        values = [_read._read_dataset(_hdf5.stored_dataset(group, str(n), f"{where}: {group_path}/{n}"),
                                      f"{where}: {group_path}/{n}", budget) for n in range(len(order))]
    # Each trainable variable's shape: its first group's last slot (shaped like it in every Keras optimizer,
    # Adafactor's velocity after its factored r and c).
    first_group = (*optimizer.keras_layout()[1], ())[0]
    first = {p: tuple(value.shape) for (name, p), value in zip(order, values, strict=True)
             if p is not None and name in first_group}
    params = _in_file_order(params, [first[p] for p in range(len(idx))] if len(first) == len(idx) else None, where)
    leaves, _, idx = _trainable(params)
    order = keras_order(optimizer, [leaves[i] for i in idx])  # the layers' order may choose other slots (Muon's)
    if len(order) != len(values):
        raise _count_error(f"{where}: {group_path}", len(values), optimizer, len(idx), order)
    return params, _state_from(optimizer.init(params), idx, where, (
        (name, p, value, f"{group_path}/{n} ({name})" if p is None else f"{group_path}/{n} ({name} of variable {p})")
        for n, ((name, p), value) in enumerate(zip(order, values, strict=True))))


def _in_file_order(params: Any, shapes: list[tuple[int, ...]] | None, where: str) -> Any:
    """Weights read from a ``.weights.h5`` (not a ``.keras``, whose config gives the order) in the one order of
    their layers that the optimizer's shapes allow; raises if none or several do (`_order.ambiguity_error`)."""
    source = getattr(params, "source", "")
    if (shapes is None or not isinstance(params, _read.KerasWeights)
            or (os.path.isfile(source) and zipfile.is_zipfile(source))):
        return params  # an optimizer without slots, params the caller ordered, or a .keras's config order
    ranks, count = _order.file_ranks(params, shapes)
    if count is None:
        return params  # not a Functional or Sequential model's file: its order is the file's
    if count != 1:
        raise _order.ambiguity_error(where, count)
    return _order.reorder(params, ranks)


def _v2_model(g: _read._Graph, ids: list[int]) -> tuple[Any, list[int]] | None:
    """The tf.keras 2 model in the checkpoint (`load_weights`'s dict, in tf.keras's layer order) and the node ids of
    its trainable weights in that order, when those are exactly the variables `ids` holding slots; else None (an
    optimizer saved without a Keras model: its variables then come back as a list)."""
    paths: dict[int, tuple[str, ...]] = {}
    try:
        weights = _read._read_tf_checkpoint(g.reader, g.where, None, varstate.Registry(), paths)
    except (ValueError, CheckpointFormatError):
        return None  # no Keras model in the checkpoint, or more than one
    node = {path: i for i, path in paths.items()}
    leaves, _, idx = _trainable(weights)
    # A Variable read by load_weights is named by its key path.
    order = [node.get(tuple(leaves[k].name.split("/")), -1) for k in idx]
    return (weights, order) if ids and sorted(order) == sorted(ids) else None


def _load_v2(g: _read._Graph, opt: int, node: str, optimizer: KerasOptimizer, params: Any):
    """tf.keras 2 (optimizer_v2): ``iter``, ``learning_rate`` children; slots linked to their variables' nodes."""
    cls = type(optimizer).__name__
    names = _V2_SLOTS.get(cls)
    if names is None:
        raise ValueError(f"{g.where}: tf.keras 2 has no {cls} whose slots map to Keras 3's; it has {sorted(_V2_SLOTS)}")
    refs = list(g.nodes[opt].slot_variables)
    primaries = list(dict.fromkeys(ref.original_variable_node_id for ref in refs))
    full = [g.read(i, f"node {i}")[1] or f"node {i}" for i in primaries]
    model = _v2_model(g, primaries) if params is None else None
    if model is not None:
        params, primaries = model
        full = [g.read(i, f"node {i}")[1] or f"node {i}" for i in primaries]
    elif params is not None:
        leaves, _, idx = _trainable(params)
        held: list[Any] = [getattr(leaves[k], "name", None) for k in idx]  # all str when they match `full`
        if sorted(held) == sorted(full):  # by Keras's names where they are the params' names
            primaries = [primaries[full.index(n)] for n in held]
            full = held
    if model is None:
        params = _params_from(g, primaries, full, params)
    state = optimizer.init(params)
    kids = g.named(opt)
    found = {(ref.original_variable_node_id, ref.slot_name): ref.slot_variable_node_id for ref in refs}

    def values() -> Iterable[tuple[str, int | None, np.ndarray, str]]:
        for name, child in (("iteration", "iter"), ("learning_rate", "learning_rate")):
            if name in state.non_slots and child in kids:
                yield name, None, g.read(kids[child], f"{node}/{child}")[0], f"{node}/{child}"
        for name in state.slots:
            v2 = names.get(name, name)
            for p, primary in enumerate(primaries):
                if (primary, v2) not in found:
                    raise ValueError(f"{g.where}: {full[p]!r} has no tf.keras slot {v2!r} (Keras 3's {name!r}); its "
                                     f"slots are {sorted(s for i, s in found if i == primary)}; make the optimizer "
                                     "as tf.keras's was made (amsgrad, momentum, centered)")
                path = _keys.slot_path(full[p], node, v2)
                yield name, p, g.read(found[(primary, v2)], path)[0], path

    return params, _state_from(state, _trainable(params)[2], g.where, values())


# --- saving --------------------------------------------------------------------------------------
def h5_values(optimizer: Any, params: Any, state: OptimizerState) -> tuple[str, list[np.ndarray]]:
    """Keras's optimizer name and the values of its ``optimizer/vars/N``, for a ``.weights.h5``."""
    check_optimizer(optimizer, state, "optimizer_state")
    leaves, _, idx = _trainable(params)
    values = [np.asarray(v.value).astype(_seam.saved_dtype(v)) if p is None
              else np.asarray(v.value if isinstance(v, varstate.Variable) else v)
              for _, p, v in _in_keras_order(optimizer, leaves, idx, state, "optimizer_state")]
    return snake_name(type(optimizer).__name__), values


def _save_v2(path: str, optimizer: KerasOptimizer, params: Any, state: OptimizerState, model: str) -> str:
    cls = type(optimizer).__name__
    if cls not in _V2_HYPER:
        raise ValueError(f"tf.keras 2 layout: {cls} has no tf.keras 2 counterpart written here; "
                         f"these do: {sorted(_V2_HYPER)}")
    if callable(optimizer.learning_rate):
        raise ValueError("tf.keras 2 layout: a learning-rate schedule is not a variable in tf.keras 2's checkpoint; "
                         "use a float learning rate")
    registry = varstate.Registry()
    non_slots = {"iter": _seam.record_saved_dtype(varstate.Variable(
        state.non_slots["iteration"].value, name=f"{cls}/iter", trainable=False, registry=registry), np.int64)}
    hypers = {**{hyper: getattr(optimizer, hyper) for hyper in _V2_HYPER[cls]}, "decay": 0.0,
              "learning_rate": state.non_slots["learning_rate"].value}
    for hyper, value in hypers.items():
        non_slots[hyper] = varstate.Variable(jnp.asarray(value, jnp.float32), name=f"{cls}/{hyper}",
                                             trainable=False, registry=registry)
    v2 = OptimizerState(slots=optimizer.renamed_slots(params, state, _V2_SLOTS[cls]).slots, non_slots=non_slots)
    return Checkpoint(**{model: params, "optimizer": v2}).write(path, format="tf")


def save_optimizer_state(
    path: str | os.PathLike,
    optimizer: Any,
    params: Any,
    state: Any,
    *,
    name: str | None = None,
    layout: str = "keras3",
    model: str = "model",
) -> str:
    """Writes `params` and a Keras optimizer's `state` as Keras 3 does (``tf.train.Checkpoint(optimizer=opt)``).

    The TF checkpoint at `path` holds ``optimizer/_iterations`` (int64),
    ``optimizer/_learning_rate``, ``optimizer/_variables/N`` in Keras's
    order and ``optimizer/_trainable_variables/i`` (the params, in their
    pytree order, which must be Keras's order of trainable variables), with
    Keras's variable names (``<name>/<param path with _>_<slot>``). Keras
    restores it, params and state, with
    ``tf.train.Checkpoint(optimizer=opt).restore(path)`` once ``opt`` is
    built on the model's trainable variables.

    ``layout="tf_keras2"`` writes tf.keras 2's (tf-keras ``optimizer_v2``)
    instead, as ``tf.train.Checkpoint(<model>=params, optimizer=opt)``
    saves it: ``optimizer/iter`` (int64), ``learning_rate``, ``decay`` and
    the hyperparameter variables, each slot under its variable's
    ``.OPTIMIZER_SLOT/optimizer/<tf.keras slot name>`` (``m``, ``v``,
    ``vhat``, ``rms``, ``mg``, ...), for SGD, Adam, Adamax, RMSprop, Adagrad
    and Adadelta.

    Args:
        path: the checkpoint prefix to write.
        optimizer: the `varstate.optimizers.keras` optimizer.
        params: its trainable params, in Keras's order of trainable variables.
        state: the optimizer's `OptimizerState` for `params`.
        name: the optimizer's Keras name in the variable names; None is
            Keras's default for the class (``adam``, ``rm_sprop``...).
        layout: ``"keras3"``, or ``"tf_keras2"`` for tf.keras 2's layout.
        model: (``tf_keras2``) the root name `params` are written under, as
            the pytree they are.

    Returns:
        `path`.

    Raises:
        TypeError: `optimizer` is not a `varstate.optimizers.keras` optimizer,
            or `state` not an OptimizerState.
        ValueError: an unknown `layout`; a state without ``iteration`` or
            without a slot of a trainable param; (``tf_keras2``) an optimizer
            with no tf.keras 2 counterpart, or a learning-rate schedule.

    >>> import os, tempfile, jax.numpy as jnp, varstate, checkpoint
    >>> from checkpoint import keras
    >>> from varstate.optimizers import keras as keras_opt
    >>> opt = keras_opt.SGD(0.1, momentum=0.9)
    >>> w = varstate.Variable(jnp.ones(2), name="kernel")
    >>> path = keras.save_optimizer_state(os.path.join(tempfile.mkdtemp(), "ckpt"), opt, [w], opt.init([w]))
    >>> sorted(checkpoint.read_checkpoint(path).keys())
    ['optimizer/_iterations/.ATTRIBUTES/VARIABLE_VALUE', 'optimizer/_learning_rate/.ATTRIBUTES/VARIABLE_VALUE', \
'optimizer/_trainable_variables/0/.ATTRIBUTES/VARIABLE_VALUE', 'optimizer/_variables/2/.ATTRIBUTES/VARIABLE_VALUE']
    """
    check_optimizer(optimizer, state, "state")
    if layout not in ("keras3", "tf_keras2"):
        raise ValueError(f"layout must be 'keras3' or 'tf_keras2', got {layout!r}")
    if "iteration" not in state.non_slots:
        raise ValueError(f"state has no non-slot 'iteration', which {type(optimizer).__name__} keeps{_MADE_BY}")
    if layout == "tf_keras2":
        return _save_v2(os.fspath(path), optimizer, params, state, model)
    leaves, _, idx = _trainable(params)
    prefix = snake_name(type(optimizer).__name__) if name is None else name
    registry = varstate.Registry()  # Keras's names, made fresh: a Variable's name is its checkpoint full_name

    def named(value: Any, var_name: str, saved: Any = None, into: varstate.Registry = registry) -> varstate.Variable:
        v = varstate.Variable(value.value if isinstance(value, varstate.Variable) else value, name=var_name,
                              trainable=False, registry=into)
        return v if saved is None else _seam.record_saved_dtype(v, saved)

    names = [getattr(leaves[i], "name", f"variable_{k}") for k, i in enumerate(idx)]
    trainables = [named(leaves[i], n) for i, n in zip(idx, names, strict=True)]
    entries = _in_keras_order(optimizer, leaves, idx, state, "state", _MADE_BY)
    variables = []
    for n, p, v in entries:
        if p is None:
            variables.append(named(v, f"{prefix}/{_KERAS_NAMES.get(n, n)}", _seam.saved_dtype(v)))
        elif v is None:
            raise ValueError(f"state has no slot {n!r} for trainable variable {p}; pass the state made for params")
        elif _KERAS_NAMES.get(n) == "":  # Adafactor's r and c, both named as their variable: a registry each
            variables.append(named(v, f"{prefix}/{names[p].rsplit('/', 1)[-1]}", into=varstate.Registry()))
        else:
            variables.append(named(v, f"{prefix}/{names[p].replace('/', '_')}_{n}"))
    rate = {"_learning_rate": variables[1]} if entries[1][0] == "learning_rate" else {}  # none for a schedule
    tree = {"_iterations": variables[0], **rate, "_trainable_variables": trainables, "_variables": variables}
    return Checkpoint(optimizer=tree).write(os.fspath(path), format="tf")
