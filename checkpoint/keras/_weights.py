"""Keras weights and optimizer state: the public functions of `checkpoint.keras`."""

from __future__ import annotations

import os
import zipfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import varstate
from checkpoint import _dtypes, _storage
from checkpoint._errors import CheckpointFormatError
from checkpoint._storage._files import sync_file
from checkpoint.keras import _optimizer as _keras_optimizer
from checkpoint.keras._read import (
    _VARS,
    KerasWeights,
    LayerLayout,
    _h5py,
    _is_hdf5,
    _Keras3Reader,
    _legacy_root,
    _open_archive,
    _read_legacy,
    _read_tf_checkpoint,
)


# --- loading ----------------------------------------------------------------------------------
def load_weights(
    path: str | os.PathLike,
    *,
    weight_names: Mapping[str, Sequence[str]] | None = None,
    node: str | None = None,
    registry: varstate.Registry | None = None,
) -> KerasWeights:
    """Reads a Keras model's weights (any format in the module docstring) as `varstate.Variable`s.

    Returns a `KerasWeights`: layer name -> {weight name -> Variable,
    sublayer name -> {...}} in Keras's layer order, values bit-exact. A
    Variable is named by its Keras path relative to the model
    (``"lstm/lstm_cell/kernel"``) and made in `registry` (default: a new
    `varstate.Registry`, so that the names are exactly those paths).
    64-bit values are narrowed as JAX holds them (an int64 out of int32's
    range raises) unless JAX's 64-bit types are on.

    `weight_names` names the weights of layers a Keras 3 ``.weights.h5``
    stores by position only: ``{"my_layer": ["w", "b"]}``, keyed by layer
    name or by the layer's key path (``"block/my_layer"``). `node` is the
    model's object path in a TF checkpoint holding more than one candidate
    (default: the root, or its only child that is a Keras model, or
    ``"model"``).

    >>> import os, tempfile, numpy as np, varstate
    >>> from checkpoint import keras
    >>> w = keras.KerasWeights({"dense": {"kernel": varstate.Variable(np.ones((2, 3), np.float32)),
    ...                                   "bias": varstate.Variable(np.zeros(3, np.float32))}},
    ...     layout=(keras.LayerLayout((), "model", ""),
    ...             keras.LayerLayout(("dense",), "dense", "layers/dense", ("kernel", "bias"))))
    >>> path = keras.save_weights(os.path.join(tempfile.mkdtemp(), "m.weights.h5"), w)
    >>> back = keras.load_weights(path)
    >>> back["dense"]["kernel"].name, back["dense"]["kernel"].shape, list(back["dense"])
    ('dense/kernel', (2, 3), ['kernel', 'bias'])
    """
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"Keras weights path must be a string, got {type(path).__name__} {path!r}.")
    path = os.fspath(path)
    registry = varstate.Registry() if registry is None else registry
    names = {k: tuple(v) for k, v in (weight_names or {}).items()}
    if os.path.isfile(path) and zipfile.is_zipfile(path):
        with _open_archive(path) as f:
            return _Keras3Reader(f, path, names, registry).read()
    if os.path.isfile(path) and _is_hdf5(path):
        h5py = _h5py()
        with h5py.File(path, "r") as f:
            if _legacy_root(f) is not None:
                return _read_legacy(f, path, registry)
            return _Keras3Reader(f, path, names, registry).read()
    if os.path.isfile(path) and not path.endswith(".index"):
        raise CheckpointFormatError(
            f"{path}: not a Keras weights file: expected an HDF5 file (.weights.h5, .h5), a .keras archive, "
            "or a TF checkpoint prefix (the path before '.index')"
        )
    reader = _storage.open_reader(path)  # FileNotFoundError says what it expected
    return _read_tf_checkpoint(reader, path, node, registry)


# --- saving --------------------------------------------------------------------------------------
def save_weights(
    path: str | os.PathLike,
    weights: Mapping[str, Any],
    *,
    like: str | os.PathLike | None = None,
    optimizer: Any = None,
    optimizer_state: Any = None,
) -> str:
    """Writes `weights` as a Keras 3 ``.weights.h5`` that Keras's ``model.load_weights`` reads; returns the path.

    `weights` is layer name -> {weight name -> Variable, array or scalar}
    (what `load_weights` returns, changed or not). Keras finds weights by
    their file layout (group names derived from layer classes, weights by
    position), which a plain dict does not carry: it comes from `like`, a
    ``.weights.h5`` or ``.keras`` file Keras wrote for the same architecture,
    or else from `weights.layout` when `weights` is a `KerasWeights` read from
    a Keras 3 file. Every weight of the layout must be present with the
    layout's shape, and every weight given must be used; the first exception
    is named. Optimizer state is written when `optimizer` (a
    `varstate.optimizers.keras` optimizer) and its `optimizer_state` (made
    on `weights`, e.g. by `load_optimizer_state`) are given, as Keras's
    ``optimizer/vars/N``; Keras's ``model.load_weights`` loads it into a
    compiled model whose optimizer is built. Otherwise Keras keeps the
    model's own optimizer state (with a warning if it has one).

    The file is written next to `path` and renamed into place.

    >>> import os, tempfile, numpy as np
    >>> from checkpoint import keras
    >>> layout = (keras.LayerLayout((), "model", ""),
    ...           keras.LayerLayout(("out",), "out", "layers/dense", ("kernel", "bias")))
    >>> weights = {"out": {"kernel": np.ones((2, 2), np.float32), "bias": np.arange(2, dtype=np.float32)}}
    >>> path = keras.save_weights(os.path.join(tempfile.mkdtemp(), "x.weights.h5"),
    ...                           keras.KerasWeights(weights, layout=layout))
    >>> keras.load_weights(path)["out"]["bias"].value.tolist()
    [0.0, 1.0]
    """
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"Keras weights path must be a string, got {type(path).__name__} {path!r}.")
    path = os.fspath(path)
    if not path.endswith(".weights.h5"):
        raise ValueError(
            f"{path}: Keras's model.load_weights reads this format only from a file named '*.weights.h5'; "
            "name it so"
        )
    if not isinstance(weights, Mapping):
        raise TypeError(f"weights must be a dict of layers (as load_weights returns), got {type(weights).__name__}.")
    if like is not None:
        layout = load_weights(like).layout if not isinstance(like, KerasWeights) else like.layout
        source = os.fspath(like) if not isinstance(like, KerasWeights) else like.source
    else:
        layout = getattr(weights, "layout", ())
        source = getattr(weights, "source", "")
    if not layout or any(lay.group is None for lay in layout):
        raise ValueError(
            "save_weights needs Keras's file layout for these weights (which HDF5 group holds each layer): "
            + (f"they were read from {source}, which is not a Keras 3 weights file; " if source else
               "they are a plain dict; ")
            + "pass like=<a .weights.h5 or .keras file Keras wrote for the same model>"
        )
    planned = _plan(weights, layout, source)
    opt_values = None
    if (optimizer is None) != (optimizer_state is None):
        raise ValueError("save_weights writes optimizer state from both optimizer= and optimizer_state=; pass both")
    if optimizer is not None:
        opt_values = _keras_optimizer.h5_values(optimizer, weights, optimizer_state)
    h5py = _h5py()
    directory = os.path.dirname(os.path.abspath(path))
    tmp = os.path.join(directory, f".{os.path.basename(path)}.tmp-{os.getpid()}")
    try:
        # Compact groups (HDF5 >= 1.8 format): files a third the size of h5py's default, read by any h5py.
        with h5py.File(tmp, "w", libver=("v108", "latest")) as f:
            for lay, values in planned:
                group = f.create_group(f"{lay.group}/{_VARS}" if lay.group else _VARS)
                group.attrs["name"] = lay.name
                for i, value in enumerate(values):
                    ds = group.create_dataset(str(i), data=value, track_times=False)
                    if value.dtype.name == "bfloat16":  # stored as 2 opaque bytes; Keras reads it back by this mark
                        ds.attrs["dtype"] = "bfloat16"
            if opt_values is not None:
                group = f.create_group(f"optimizer/{_VARS}")
                group.attrs["name"] = opt_values[0]
                for i, value in enumerate(opt_values[1]):
                    group.create_dataset(str(i), data=value, track_times=False)
        with open(tmp, "rb+") as f:
            sync_file(f)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return path


def _plan(weights: Mapping, layout: Sequence[LayerLayout], source: str) -> list[tuple[LayerLayout, list[np.ndarray]]]:
    """Every value to write, checked against the layout before anything is written."""
    used: set[tuple[str, ...]] = set()
    planned = []
    for lay in layout:
        node: Any = weights
        for depth, part in enumerate(lay.path):
            if not isinstance(node, Mapping) or part not in node:
                if not lay.weights:
                    node = None  # a layer without weights (InputLayer, pooling) need not be given
                    break
                raise ValueError(
                    f"weights has no layer {'/'.join(lay.path[: depth + 1])!r}, which the Keras layout"
                    f"{' of ' + source if source else ''} needs (weights {list(lay.weights)})"
                )
            node = node[part]
        values = []
        for i, name in enumerate(lay.weights):
            full = (*lay.path, name)
            if not isinstance(node, Mapping) or name not in node:
                raise ValueError(
                    f"weights has no {'/'.join(full)!r}, which the Keras layout{' of ' + source if source else ''} "
                    f"needs (layer {lay.name!r} stores {list(lay.weights)})"
                )
            value = _as_numpy(node[name])
            if lay.shapes and value.shape != lay.shapes[i]:
                raise ValueError(
                    f"{'/'.join(full)!r} has shape {value.shape}, but the Keras layout"
                    f"{' of ' + source if source else ''} has {lay.shapes[i]}"
                )
            if lay.dtypes and value.dtype.name != lay.dtypes[i]:
                want = np.dtype(_dtypes.BY_NAME.get(lay.dtypes[i], lay.dtypes[i]))
                if _dtypes.held_as(want) != value.dtype:  # only a value JAX narrowed goes back to its stored type
                    raise ValueError(
                        f"{'/'.join(full)!r} is {value.dtype}, but the Keras layout"
                        f"{' of ' + source if source else ''} stores {want}"
                    )
                value = value.astype(want)
            values.append(value)
            used.add(full)
        planned.append((lay, values))
    for full, _ in _leaves(weights, ()):
        if full not in used:
            raise ValueError(
                f"weights has {'/'.join(full)!r}, which the Keras layout{' of ' + source if source else ''} does "
                "not hold; remove it or pass like= a file of the model it belongs to"
            )
    return planned


def _as_numpy(value: Any) -> np.ndarray:
    if isinstance(value, varstate.Variable):
        value = value.value
    if isinstance(value, jax.ShapeDtypeStruct):
        raise ValueError("an uninitialized Variable has no value to save")
    return np.asarray(value)


def _leaves(tree: Mapping, path: tuple[str, ...]) -> Iterator[tuple[tuple[str, ...], Any]]:
    """(key path, value) of every weight, in the dicts' order."""
    for key, value in tree.items():
        if isinstance(value, Mapping):
            yield from _leaves(value, (*path, str(key)))
        else:
            yield (*path, str(key)), value


def _ordered(weights: Mapping) -> list[tuple[tuple[str, ...], Any]]:
    """Weights in Keras's order: the layout's when there is one (jax.tree.map re-sorts plain dicts), else dict order."""
    layout = getattr(weights, "layout", ())
    leaves = dict(_leaves(weights, ()))
    out, seen = [], set()
    for lay in layout:
        for name in lay.weights:
            full = (*lay.path, name)
            if full in leaves and full not in seen:
                out.append((full, leaves[full]))
                seen.add(full)
    out.extend((p, v) for p, v in leaves.items() if p not in seen)
    return out


# --- assigning into a model --------------------------------------------------------------------
def _path_name(path: tuple) -> str:
    parts = []
    for k in path:
        if isinstance(k, jax.tree_util.DictKey):
            parts.append(str(k.key))
        elif isinstance(k, jax.tree_util.SequenceKey):
            parts.append(str(k.idx))
        elif isinstance(k, jax.tree_util.GetAttrKey):
            parts.append(k.name)
        elif isinstance(k, jax.tree_util.FlattenedIndexKey):
            parts.append(str(k.key))
        else:
            parts.append(str(k))
    if parts and parts[-1] == "value" and isinstance(path[-1], jax.tree_util.GetAttrKey):
        parts.pop()  # a varstate or flax nnx Variable's value: the weight is the Variable
    return "/".join(parts)


def assign_weights(
    target: Any,
    weights: Mapping[str, Any],
    name_map: Mapping[str, str] | Callable[[str], str | None] | None = None,
    *,
    strict: bool = True,
) -> Any:
    """`target` (any pytree: dicts of arrays or Variables, a flax nnx Module) with Keras `weights` put in; a new tree.

    Each leaf of `target` is named by its path, parts joined with ``/``
    (``"dense/kernel"``; ``"layers/0/kernel"`` for list items; a Variable's
    own ``value`` part left out). How leaves find their weights:

    - ``name_map`` given: a dict or function from leaf name to the Keras
      weight's path (``"dense/kernel"``); a leaf it maps to None (or leaves
      out) is an error unless ``strict=False``, which leaves it unchanged and
      lets weights go unused;
    - no ``name_map``, leaf names equal to the weights' paths: by name;
    - otherwise by structure: the n-th leaf (JAX's order: dict keys sorted,
      Module attributes sorted) takes the n-th weight in Keras's order.

    Every shape must match; a value takes the leaf's dtype when both are
    floats (or both integers), and goes to the leaf's sharding. Errors name
    the first leaf that has no weight, or whose shape or dtype does not fit.

    >>> import numpy as np
    >>> from checkpoint.keras import assign_weights
    >>> keras_w = {"dense": {"kernel": np.ones((4, 3)), "bias": np.zeros(3)}}
    >>> params = {"layers": [{"w": np.zeros((4, 3)), "b": np.ones(3)}]}
    >>> new = assign_weights(params, keras_w, {"layers/0/w": "dense/kernel", "layers/0/b": "dense/bias"})
    >>> float(new["layers"][0]["w"].sum()), float(new["layers"][0]["b"].sum())
    (12.0, 0.0)
    """
    if not isinstance(weights, Mapping):
        raise TypeError(f"weights must be a dict of layers (as load_weights returns), got {type(weights).__name__}.")
    flat, treedef = jax.tree_util.tree_flatten_with_path(target)
    if not flat:
        raise ValueError(f"target has no leaves to assign (got {type(target).__name__})")
    leaf_names = [_path_name(p) for p, _ in flat]
    ordered = _ordered(weights)
    by_path = {"/".join(p): v for p, v in ordered}
    if name_map is not None:
        lookup = name_map.get if isinstance(name_map, Mapping) else name_map
        pairs = []
        for name, (_, leaf) in zip(leaf_names, flat, strict=True):
            source = lookup(name)
            if source is None:
                if strict:
                    raise ValueError(
                        f"target leaf {name!r} is not in name_map; map it to a Keras weight (one of "
                        f"{_some(by_path)}), or pass strict=False to leave it unchanged"
                    )
                pairs.append((name, leaf, None, None))
                continue
            if source not in by_path:
                raise ValueError(
                    f"name_map maps target leaf {name!r} to {source!r}, which is not a Keras weight (they are "
                    f"{_some(by_path)})"
                )
            pairs.append((name, leaf, source, by_path[source]))
        if strict:
            unused = [p for p in by_path if p not in {s for _, _, s, _ in pairs}]
            if unused:
                raise ValueError(
                    f"Keras weight {unused[0]!r} is not assigned to any target leaf ({len(unused)} unused); map it "
                    "in name_map, or pass strict=False"
                )
    elif set(leaf_names) == set(by_path) and len(leaf_names) == len(by_path):
        pairs = [(name, leaf, name, by_path[name]) for name, (_, leaf) in zip(leaf_names, flat, strict=True)]
    else:
        if len(flat) != len(ordered):
            raise ValueError(
                f"target has {len(flat)} leaves but there are {len(ordered)} Keras weights, and the names differ "
                f"(target: {_some(leaf_names)}; Keras: {_some(by_path)}): pass a name_map"
            )
        pairs = [
            (name, leaf, "/".join(p), v)
            for name, (_, leaf), (p, v) in zip(leaf_names, flat, ordered, strict=True)
        ]
    new_leaves = [leaf if source is None else _fit(name, leaf, source, value) for name, leaf, source, value in pairs]
    return jax.tree_util.tree_unflatten(treedef, new_leaves)


def _some(names) -> str:
    names = list(names)
    return str(names[:6])[:-1] + (", ...]" if len(names) > 6 else "]")


def _family(dtype: np.dtype) -> str:
    """Float, int, bool or complex: a value may change precision within its family, never family."""
    if dtype.kind == "V":  # ml_dtypes (bfloat16, float8, int4) are numpy kind "V"
        return "int" if dtype.name.startswith(("int", "uint")) else "float"
    return {"i": "int", "u": "int", "f": "float", "b": "bool", "c": "complex"}.get(dtype.kind, dtype.kind)


def _fit(name: str, leaf: Any, source: str, value: Any) -> Any:
    value = _as_numpy(value)
    shape = tuple(np.shape(leaf))
    if value.shape != shape:
        raise ValueError(
            f"target leaf {name!r} has shape {shape}, but Keras weight {source!r} has {value.shape}"
            + ("; the order of leaves differs from Keras's: pass a name_map" if not isinstance(leaf, str) else "")
        )
    want = np.dtype(leaf.dtype) if hasattr(leaf, "dtype") else value.dtype
    if want != value.dtype and _family(want) != _family(value.dtype):
        raise ValueError(f"target leaf {name!r} is {want}, but Keras weight {source!r} is {value.dtype}")
    out = jnp.asarray(value.astype(want, copy=False))
    sharding = getattr(leaf, "sharding", None)
    return jax.device_put(out, sharding) if sharding is not None else out


# --- optimizer state ---------------------------------------------------------------------------
def load_optimizer_state(
    path: str | os.PathLike, optimizer: Any, params: Any = None, *, node: str = "optimizer"
) -> tuple[Any, Any]:
    """Reads a Keras optimizer's state (and its trainable variables) from a TF checkpoint: ``(params, state)``.

    `optimizer` is the `varstate.optimizers.keras` optimizer made as Keras's
    was (same class, ``amsgrad``, ``momentum``, ``centered``, float or
    schedule learning rate): its `keras_layout` says which of Keras 3's
    ``<node>/_variables/N`` is which slot or counter; each variable's Keras
    name (``adam/dense_kernel_momentum``) is checked against it. The state's
    ``iteration`` is Keras's int64 counter (saved back as int64) and its
    ``learning_rate`` Keras's stored one.

    A tf.keras 2 checkpoint (tf-keras ``optimizer_v2``: ``<node>/iter`` and
    slots under ``.OPTIMIZER_SLOT``) is read too: its slot names (``m``,
    ``v``, ``vhat``, ``rms``, ``mg``, ``accum_grad``, ...) become Keras 3's,
    ``iter`` becomes ``iteration``; its variables are matched to `params`
    by name when the names agree, else by order.

    A Keras 3 ``.weights.h5`` or ``.keras`` of a compiled model holds the
    optimizer's variables as ``optimizer/vars/N``, in the same order but
    without names (shapes are checked); `params` then defaults to the
    model's weights (`load_weights`), whose trainable ones, in Keras's layer
    order, are the optimizer's variables.

    `params`: None to take the trainable variables the optimizer recorded
    (``<node>/_trainable_variables/i``) as new Variables, in Keras's order;
    or the model's trainable params (any pytree whose trainable leaves are
    in Keras's order of ``model.trainable_variables``), which come back with
    the checkpoint's values. `node` is the optimizer's path in the object
    graph (``tf.train.Checkpoint(optimizer=...)`` and ``model.save_weights``
    of a compiled model both use ``"optimizer"``).

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
    where = os.fspath(path) if isinstance(path, (str, os.PathLike)) else path
    if isinstance(where, str) and os.path.isfile(where) and (zipfile.is_zipfile(where) or _is_hdf5(where)):
        _keras_optimizer.check_optimizer(optimizer)
        return _keras_optimizer.load_optimizer_state(
            where, optimizer, params, h5_params=load_weights(where) if params is None else params)
    return _keras_optimizer.load_optimizer_state(path, optimizer, params, node=node)


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
    Keras's variable names (``<name>/<param path with _>_<slot>``; `name`
    defaults to Keras's default optimizer name, ``adam``, ``rm_sprop``...).
    Keras restores it, params and state, with
    ``tf.train.Checkpoint(optimizer=opt).restore(path)`` once ``opt`` is
    built on the model's trainable variables. Returns `path`.

    ``layout="tf_keras2"`` writes tf.keras 2's (tf-keras ``optimizer_v2``)
    instead, as ``tf.train.Checkpoint(<model>=params, optimizer=opt)``
    saves it: ``optimizer/iter`` (int64), ``learning_rate``, ``decay`` and
    the hyperparameter variables, each slot under its variable's
    ``.OPTIMIZER_SLOT/optimizer/<tf.keras slot name>`` (``m``, ``v``,
    ``vhat``, ``rms``, ``mg``, ...); `params` are written at `model` as
    the pytree they are (SGD, Adam, Adamax, RMSprop, Adagrad, Adadelta).

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
    return _keras_optimizer.save_optimizer_state(path, optimizer, params, state, name=name, layout=layout,
                                                 model=model)
