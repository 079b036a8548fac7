"""Keras optimizer state in TF checkpoints: Keras 3's ``optimizer/_variables/N`` and tf.keras 2's slots.

Keras 3 (TF backend) tracks an optimizer's variables in one list,
``_variables``: ``iteration``, ``learning_rate`` (absent for a schedule),
then each slot list in turn, a list interleaving its slots per trainable
variable, then variables made after the slots (Nadam's ``u_product``). The
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
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import varstate
from checkpoint import _keys, _storage
from checkpoint._errors import CheckpointFormatError
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

# Non-slots Keras creates without a name of their own.
_KERAS_NAMES = {"u_product": "variable"}


def snake_name(cls_name: str) -> str:
    """Keras's default optimizer name for a class (``AdamW`` -> ``adam_w``, ``RMSprop`` -> ``rm_sprop``)."""
    name = re.sub(r"(.)([A-Z][a-z]+)", r"\1_\2", cls_name)
    return re.sub(r"([a-z])([A-Z])", r"\1_\2", name).lower()


def keras_order(optimizer: KerasOptimizer, n_params: int) -> list[tuple[str, int | None]]:
    """Keras's ``_variables``, in order: (non-slot name, None) or (slot name, index of its trainable variable)."""
    lead, groups, trail = optimizer.keras_layout()
    order: list[tuple[str, int | None]] = [(name, None) for name in lead]
    for group in groups:
        for i in range(n_params):
            order.extend((name, i) for name in group)
    return order + [(name, None) for name in trail]


def check_optimizer(optimizer: Any) -> None:
    if not isinstance(optimizer, KerasOptimizer):
        raise TypeError(
            f"optimizer must be one of varstate.optimizers.keras's optimizers (Keras's layout and names), got "
            f"{type(optimizer).__name__}; for TF v1 optimizers use checkpoint.Checkpoint"
        )


def _trainable(params: Any) -> tuple[list, Any, list[int]]:
    """(leaves, treedef, the trainable leaves' positions in Keras's order).

    Keras's order is the pytree's, except for weights read from a Keras 3
    file (`KerasWeights` with a layout), whose plain-dict layers JAX flattens
    sorted: their order is the layout's.
    """
    with_paths, treedef = jax.tree_util.tree_flatten_with_path(
        params, is_leaf=lambda x: isinstance(x, varstate.Variable))
    leaves = [x for _, x in with_paths]
    order = list(range(len(leaves)))
    layout = getattr(params, "layout", ())
    if layout:
        at = {tuple(str(getattr(k, "key", k)) for k in path): i for i, (path, _) in enumerate(with_paths)}
        keras = [at[full] for lay in layout for full in ((*lay.path, n) for n in lay.weights) if full in at]
        order = keras + [i for i in order if i not in set(keras)]
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
        out = _seam.with_value(old, new)
        _seam.record_saved_dtype(out, value.dtype if np.dtype(value.dtype) != dtype else recorded)
        return out
    return new


def _slot_leaf(x: Any) -> bool:
    return x is None or isinstance(x, varstate.Variable)


class _Nodes:
    """The object graph of a TF checkpoint, walked by local names."""

    def __init__(self, reader: Any, where: str) -> None:
        graph = reader.object_graph
        if graph is None:
            raise CheckpointFormatError(f"{where}: a name-based checkpoint (TF1 Saver) holds no Keras optimizer")
        self.nodes, self.where, self.reader = graph.nodes, where, reader

    def children(self, i: int) -> dict[str, int]:
        out = {}
        for ref in self.nodes[i].children:
            if not 0 <= ref.node_id < len(self.nodes):
                raise CheckpointFormatError(f"{self.where}: node {i}'s child {ref.local_name!r} refers to node "
                                            f"{ref.node_id}, but the object graph has {len(self.nodes)} nodes")
            out[ref.local_name] = ref.node_id
        return out

    def find(self, path: str) -> int:
        i = 0
        for part in [p for p in path.split("/") if p]:
            kids = self.children(i)
            if part not in kids:
                raise ValueError(f"{self.where}: the object graph has no {path!r} (no child {part!r}; there are "
                                 f"{sorted(kids)[:8]}); pass node= the optimizer's path")
            i = kids[part]
        return i

    def value(self, i: int, path: str) -> tuple[np.ndarray, str]:
        attr = next((a for a in self.nodes[i].attributes if a.name == _keys.VARIABLE_VALUE), None)
        if attr is None:
            raise CheckpointFormatError(f"{self.where}: {path} is not a variable (it has no VARIABLE_VALUE)")
        return self.reader.get(attr.checkpoint_key), attr.full_name


def load_optimizer_state(
    path: str | os.PathLike, optimizer: Any, params: Any = None, *, node: str = "optimizer", h5_params: Any = None
) -> tuple[Any, OptimizerState]:
    """(params, state) of a Keras optimizer from a TF checkpoint; see `checkpoint.keras.load_optimizer_state`."""
    check_optimizer(optimizer)
    where = os.fspath(path)
    if h5_params is not None:  # a Keras 3 .weights.h5 / .keras: the weights came from load_weights
        return _load_h5(where, optimizer, params if params is not None else h5_params)
    reader = _storage.open_reader(where)
    g = _Nodes(reader, where)
    opt = g.find(node)
    kids = g.children(opt)
    if "_variables" in kids:
        return _load_keras3(g, opt, node, optimizer, params)
    if "iter" in kids:
        return _load_v2(g, opt, node, optimizer, params)
    raise ValueError(f"{where}: {node!r} is not a Keras optimizer (it has neither Keras 3's '_variables' nor "
                     f"tf.keras's 'iter'; its children are {sorted(kids)[:8]})")


def _params_from(g: _Nodes, ids: list[int], paths: list[str], params: Any) -> Any:
    """The checkpoint's values of the trainable variables, as new Variables or put into `params`."""
    values = [g.value(i, p) for i, p in zip(ids, paths, strict=True)]
    if params is None:
        registry = varstate.Registry()
        return [varstate.Variable(v, name=name or p, registry=registry)
                for (v, name), p in zip(values, paths, strict=True)]
    leaves, treedef, idx = _trainable(params)
    if len(idx) != len(values):
        raise ValueError(f"{g.where}: the optimizer was built on {len(values)} trainable variables, but params has "
                         f"{len(idx)}; pass the model's trainable variables, in Keras's order")
    for k, (value, _) in zip(idx, values, strict=True):
        leaves[k] = _put(leaves[k], value, g.where, paths[idx.index(k)])
    return treedef.unflatten(leaves)


def _load_keras3(g: _Nodes, opt: int, node: str, optimizer: KerasOptimizer, params: Any):
    kids = g.children(opt)
    var_list = g.children(kids["_variables"])
    trainables = g.children(kids["_trainable_variables"]) if "_trainable_variables" in kids else {}
    t_ids = [trainables[str(i)] for i in range(len(trainables))]
    t_paths = [f"{node}/_trainable_variables/{i}" for i in range(len(t_ids))]
    params = _params_from(g, t_ids, t_paths, params) if (t_ids or params is None) else params
    _leaves, _treedef, idx = _trainable(params)
    order = keras_order(optimizer, len(idx))
    if len(var_list) != len(order) or any(str(i) not in var_list for i in range(len(order))):
        raise ValueError(
            f"{g.where}: {node}/_variables holds {len(var_list)} variables, but {type(optimizer).__name__} with these "
            f"settings on {len(idx)} trainable variables has {len(order)} ({_describe(order)}); make the optimizer "
            "as Keras's was made (amsgrad, momentum, centered, a schedule or a float learning rate)"
        )
    state = optimizer.init(params)
    non_slots = dict(state.non_slots)
    slots = {n: jax.tree_util.tree_flatten(t, is_leaf=lambda x: isinstance(x, varstate.Variable) or x is None)[0]
             for n, t in state.slots.items()}
    for n, (name, p) in enumerate(order):
        path = f"{node}/_variables/{n}"
        value, full_name = g.value(var_list[str(n)], path)
        named = full_name and full_name != path  # an unnamed array's name is its path
        if named and not full_name.rsplit("/", 1)[-1].endswith(_KERAS_NAMES.get(name, name)):
            raise ValueError(
                f"{g.where}: {path} is Keras's {full_name!r}, where {type(optimizer).__name__} expects "
                + (f"{name!r}" if p is None else f"slot {name!r} of trainable variable {p}")
                + f" ({_describe(order)}); make the optimizer as Keras's was made"
            )
        if p is None:
            non_slots[name] = _put(non_slots[name], value, g.where, path)
        else:
            slots[name][idx[p]] = _put(slots[name][idx[p]], value, g.where, path)
    return params, OptimizerState(
        slots={n: jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(
            state.slots[n], is_leaf=lambda x: isinstance(x, varstate.Variable) or x is None), v)
            for n, v in slots.items()},
        non_slots=non_slots,
    )


def _load_h5(where: str, optimizer: KerasOptimizer, params: Any):
    """Keras 3's ``optimizer/vars/N`` of a ``.weights.h5`` or ``.keras`` (values by position only)."""
    from checkpoint.keras._read import _OPTIMIZER, _VARS, _h5py, _is_hdf5, _open_archive, _read_dataset

    _leaves, _treedef, idx = _trainable(params)
    order = keras_order(optimizer, len(idx))
    opener = _open_archive(where) if not _is_hdf5(where) else _h5py().File(where, "r")
    with opener as f:
        group = f.get(f"{_OPTIMIZER}/{_VARS}")
        if group is None:
            raise ValueError(f"{where}: no optimizer state (no '{_OPTIMIZER}/{_VARS}' group): Keras saves it only "
                             "for a compiled model whose optimizer was built (trained, or optimizer.build)")
        keys = sorted(group.keys(), key=lambda k: (len(k), k))
        if keys != [str(i) for i in range(len(order))]:
            raise ValueError(
                f"{where}: {_OPTIMIZER}/{_VARS} holds {len(keys)} variables, but {type(optimizer).__name__} with "
                f"these settings on {len(idx)} trainable variables has {len(order)} ({_describe(order)}); make the "
                "optimizer as Keras's was made (amsgrad, momentum, centered, a schedule or a float learning rate)"
            )
        values = [_read_dataset(group[str(n)], f"{where}: {_OPTIMIZER}/{_VARS}/{n}") for n in range(len(order))]
    state = optimizer.init(params)
    non_slots = dict(state.non_slots)
    slots = {n: jax.tree_util.tree_flatten(t, is_leaf=_slot_leaf) for n, t in state.slots.items()}
    for n, ((name, p), value) in enumerate(zip(order, values, strict=True)):
        path = f"{_OPTIMIZER}/{_VARS}/{n}"
        if p is None:
            non_slots[name] = _put(non_slots[name], value, where, f"{path} ({name})")
        else:
            slots[name][0][idx[p]] = _put(slots[name][0][idx[p]], value, where, f"{path} ({name} of variable {p})")
    return params, OptimizerState(slots={n: d.unflatten(f) for n, (f, d) in slots.items()}, non_slots=non_slots)


def h5_values(optimizer: Any, params: Any, state: OptimizerState) -> tuple[str, list[np.ndarray]]:
    """Keras's optimizer name and the values of its ``optimizer/vars/N``, for a ``.weights.h5``."""
    check_optimizer(optimizer)
    if not isinstance(state, OptimizerState):
        raise TypeError(f"optimizer_state must be the OptimizerState of the optimizer, got {type(state).__name__}")
    _leaves, _, idx = _trainable(params)
    out = []
    for name, p in keras_order(optimizer, len(idx)):
        if p is None:
            if name not in state.non_slots:
                raise ValueError(f"optimizer_state has no non-slot {name!r}, which {type(optimizer).__name__} keeps")
            v = state.non_slots[name]
            out.append(np.asarray(v.value).astype(_seam.saved_dtype(v)))
        else:
            if name not in state.slots:
                raise ValueError(f"optimizer_state has no slot {name!r}, which {type(optimizer).__name__} keeps")
            slot = jax.tree_util.tree_flatten(state.slots[name], is_leaf=_slot_leaf)[0][idx[p]]
            out.append(np.asarray(slot.value if isinstance(slot, varstate.Variable) else slot))
    return snake_name(type(optimizer).__name__), out


def _describe(order: list[tuple[str, int | None]]) -> str:
    names = [name if p is None else f"{name}[{p}]" for name, p in order]
    return ", ".join(names[:10]) + (", ..." if len(names) > 10 else "")


def _load_v2(g: _Nodes, opt: int, node: str, optimizer: KerasOptimizer, params: Any):
    """tf.keras 2 (optimizer_v2): ``iter``, ``learning_rate`` children; slots linked to their variables' nodes."""
    cls = type(optimizer).__name__
    names = _V2_SLOTS.get(cls)
    if names is None:
        raise ValueError(f"{g.where}: tf.keras 2 has no {cls} whose slots map to Keras 3's; it has {sorted(_V2_SLOTS)}")
    refs = list(g.nodes[opt].slot_variables)
    primaries: list[int] = []
    for ref in refs:
        if ref.original_variable_node_id not in primaries:
            primaries.append(ref.original_variable_node_id)
    full = [g.value(i, f"node {i}")[1] or f"node {i}" for i in primaries]
    if params is not None:
        leaves, _, idx = _trainable(params)
        held = [getattr(leaves[k], "name", None) for k in idx]
        if sorted(held) == sorted(full):  # by Keras's names where they are the params' names
            primaries = [primaries[full.index(n)] for n in held]
            full = held
    params = _params_from(g, primaries, full, params)
    leaves, _, idx = _trainable(params)
    state = optimizer.init(params)
    non_slots = dict(state.non_slots)
    kids = g.children(opt)
    for name, child in (("iteration", "iter"), ("learning_rate", "learning_rate")):
        if name in non_slots and child in kids:
            non_slots[name] = _put(non_slots[name], g.value(kids[child], f"{node}/{child}")[0], g.where,
                                   f"{node}/{child}")
    found = {(ref.original_variable_node_id, ref.slot_name): ref.slot_variable_node_id for ref in refs}
    slots = {}
    for name, tree in state.slots.items():
        flat, treedef = jax.tree_util.tree_flatten(tree, is_leaf=_slot_leaf)
        v2 = names.get(name, name)
        for p, primary in enumerate(primaries):
            if (primary, v2) not in found:
                raise ValueError(f"{g.where}: {full[p]!r} has no tf.keras slot {v2!r} (Keras 3's {name!r}); its "
                                 f"slots are {sorted(s for i, s in found if i == primary)}; make the optimizer as "
                                 "tf.keras's was made (amsgrad, momentum, centered)")
            path = f"{full[p]}/.OPTIMIZER_SLOT/{node}/{v2}"
            flat[idx[p]] = _put(flat[idx[p]], g.value(found[(primary, v2)], path)[0], g.where, path)
        slots[name] = treedef.unflatten(flat)
    return params, OptimizerState(slots=slots, non_slots=non_slots)


# tf.keras 2's hyperparameter variables (children of the optimizer), from the Keras 3 optimizer's settings.
_V2_HYPER = {
    "SGD": ("momentum",),
    "Adam": ("beta_1", "beta_2"),
    "Adamax": ("beta_1", "beta_2"),
    "RMSprop": ("rho", "momentum"),
    "Adagrad": (),
    "Adadelta": ("rho",),
}


def _save_v2(path: str, optimizer: KerasOptimizer, params: Any, state: OptimizerState, model: str) -> str:
    from checkpoint._checkpoint import Checkpoint

    cls = type(optimizer).__name__
    if cls not in _V2_HYPER:
        raise ValueError(f"tf.keras 2 layout: {cls} has no tf.keras 2 counterpart written here; "
                         f"these do: {sorted(_V2_HYPER)}")
    if callable(optimizer.learning_rate):
        raise ValueError("tf.keras 2 layout: a learning-rate schedule is not a variable in tf.keras 2's checkpoint; "
                         "use a float learning rate")
    renamed = optimizer.renamed_slots(params, state, _V2_SLOTS[cls])
    registry = varstate.Registry()
    it = state.non_slots["iteration"]
    counter = varstate.Variable(it.value, name=f"{cls}/iter", trainable=False, registry=registry)
    _seam.record_saved_dtype(counter, np.int64)
    non_slots = {"iter": counter}
    for hyper in (*_V2_HYPER[cls], "decay", "learning_rate"):
        value = state.non_slots["learning_rate"].value if hyper == "learning_rate" else (
            np.float32(0.0) if hyper == "decay" else np.float32(getattr(optimizer, hyper)))
        non_slots[hyper] = varstate.Variable(jnp.asarray(value, jnp.float32), name=f"{cls}/{hyper}",
                                             trainable=False, registry=registry)
    v2 = OptimizerState(slots=renamed.slots, non_slots=non_slots)
    return Checkpoint(**{model: params, "optimizer": v2}).write(path, format="tf")


def save_optimizer_state(
    path: str | os.PathLike, optimizer: Any, params: Any, state: OptimizerState, *, name: str | None = None,
    layout: str = "keras3", model: str = "model",
) -> str:
    """Writes Keras 3's layout, or tf.keras 2's; see `checkpoint.keras.save_optimizer_state`."""
    from checkpoint._checkpoint import Checkpoint

    check_optimizer(optimizer)
    if not isinstance(state, OptimizerState):
        raise TypeError(f"state must be the OptimizerState of the optimizer, got {type(state).__name__}")
    if layout not in ("keras3", "tf_keras2"):
        raise ValueError(f"layout must be 'keras3' or 'tf_keras2', got {layout!r}")
    if "iteration" not in state.non_slots:
        raise ValueError(f"state has no non-slot 'iteration', which {type(optimizer).__name__} keeps; pass the "
                         "state this optimizer made (opt.init / apply_gradients)")
    if layout == "tf_keras2":
        return _save_v2(os.fspath(path), optimizer, params, state, model)
    leaves, _, idx = _trainable(params)
    order = keras_order(optimizer, len(idx))
    prefix = snake_name(type(optimizer).__name__) if name is None else name
    registry = varstate.Registry()  # Keras's names, made fresh: a Variable's name is its checkpoint full_name

    def named(value: Any, var_name: str, saved: Any = None) -> varstate.Variable:
        v = varstate.Variable(value.value if isinstance(value, varstate.Variable) else value, name=var_name,
                              trainable=False, registry=registry)
        if saved is not None:
            _seam.record_saved_dtype(v, saved)
        return v

    trainables = [named(leaves[i], getattr(leaves[i], "name", f"variable_{k}")) for k, i in enumerate(idx)]
    keras_names = [getattr(leaves[i], "name", f"variable_{k}").replace("/", "_") for k, i in enumerate(idx)]
    missing = [n for n, p in order if p is None and n not in state.non_slots]
    if missing:
        raise ValueError(f"state has no non-slot {missing[0]!r}, which {type(optimizer).__name__} keeps; pass the "
                         "state this optimizer made (opt.init / apply_gradients)")
    slot_leaves = {}
    for n in {n for n, p in order if p is not None}:
        if n not in state.slots:
            raise ValueError(f"state has no slot {n!r}, which {type(optimizer).__name__} keeps; pass the state this "
                             "optimizer made (opt.init / apply_gradients)")
        slot_leaves[n] = jax.tree_util.tree_flatten(
            state.slots[n], is_leaf=lambda x: isinstance(x, varstate.Variable) or x is None)[0]
    variables = []
    for n, p in order:
        if p is None:
            v = state.non_slots[n]
            variables.append(named(v, f"{prefix}/{_KERAS_NAMES.get(n, n)}", _seam.saved_dtype(v)))
        else:
            slot = slot_leaves[n][idx[p]]
            if slot is None:
                raise ValueError(f"state has no slot {n!r} for trainable variable {p}; pass the state made for params")
            variables.append(named(slot, f"{prefix}/{keras_names[p]}_{n}"))
    tree: dict[str, Any] = {"_iterations": variables[0]}
    if order[1][0] == "learning_rate":
        tree["_learning_rate"] = variables[1]
    tree["_trainable_variables"] = trainables
    tree["_variables"] = variables
    return Checkpoint(optimizer=tree).write(os.fspath(path), format="tf")
