"""Writing Keras weights (`save_weights`) and putting them into a model's pytree (`assign_weights`)."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import varstate
from checkpoint import _dtypes
from checkpoint._storage._files import replacing
from checkpoint.keras._hdf5 import h5py_module
from checkpoint.keras._optimizer import h5_values
from checkpoint.keras._pairing import BY_POSITION, SAME_NAMES, pair_by_layer
from checkpoint.keras._read import _VARS, KerasWeights, LayerLayout, load_weights


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

    Keras finds weights by their file layout (group names derived from
    layer classes, weights by position), which a plain dict does not carry:
    it comes from `like`, or else from ``weights.layout``. Every weight of
    the layout must be present with the layout's shape, and every weight
    given must be used. Optimizer state is written as Keras's
    ``optimizer/vars/N``, which Keras's ``model.load_weights`` loads into a
    compiled model whose optimizer is built; without it Keras keeps the
    model's own optimizer state (with a warning if it has one). The file is
    written next to `path` and renamed into place.

    Args:
        path: the file to write; its name must end in ``.weights.h5`` (Keras
            reads this format only from such a name).
        weights: layer name -> {weight name -> Variable, array or scalar}
            (what `load_weights` or `load_optimizer_state` returns, changed
            or not); a `KerasWeights` read from a Keras 3 file carries its
            layout.
        like: a ``.weights.h5`` or ``.keras`` file Keras wrote for the same
            architecture, giving the layout; None uses ``weights.layout``.
        optimizer: a `varstate.optimizers.keras` optimizer whose state to
            write too; None writes none.
        optimizer_state: its `OptimizerState`, made on `weights` (as
            `load_optimizer_state` returns them together); given with
            `optimizer` or not at all.

    Returns:
        `path`.

    Raises:
        TypeError: `path` is not a string or path, or `weights` not a dict.
        ValueError: a name not ending in ``.weights.h5``; no layout (a plain
            dict without `like`); a weight missing, unused or of another
            shape than the layout's (naming the first); only one of
            `optimizer` and `optimizer_state`.

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
    known = weights if like is None else like if isinstance(like, KerasWeights) else load_weights(like)
    layout, source = getattr(known, "layout", ()), getattr(known, "source", "")
    if not layout or any(lay.group is None for lay in layout):
        raise ValueError(
            "save_weights needs Keras's file layout for these weights (which HDF5 group holds each layer): "
            + (f"they were read from {source}, which is not a Keras 3 weights file; " if source else
               "they are a plain dict; ")
            + "pass like=<a .weights.h5 or .keras file Keras wrote for the same model>"
        )
    planned = _plan(weights, layout, source)
    if (optimizer is None) != (optimizer_state is None):
        raise ValueError("save_weights writes optimizer state from both optimizer= and optimizer_state=; pass both")
    opt_values = None if optimizer is None else h5_values(optimizer, weights, optimizer_state)
    # Compact groups (HDF5 >= 1.8 format): files a third the size of h5py's default, read by any h5py.
    with replacing(path) as (tmp,), h5py_module().File(tmp, "w", libver=("v108", "latest")) as f:
        for lay, values in planned:
            group = f.create_group(f"{lay.group}/{_VARS}" if lay.group else _VARS)
            group.attrs["name"] = lay.name
            for i, value in enumerate(values):
                _dataset(group, str(i), value)
        if opt_values is not None:
            group = f.create_group(f"optimizer/{_VARS}")
            group.attrs["name"] = opt_values[0]
            for i, value in enumerate(opt_values[1]):
                _dataset(group, str(i), value)
    return path


def _dataset(group: Any, name: str, value: np.ndarray) -> None:
    ds = group.create_dataset(name, data=value, track_times=False)
    if value.dtype.name == "bfloat16":  # stored as 2 opaque bytes; Keras reads any value back as bf16 by this mark
        ds.attrs["dtype"] = "bfloat16"


def _plan(weights: Mapping, layout: Sequence[LayerLayout], source: str) -> list[tuple[LayerLayout, list[np.ndarray]]]:
    """Every value to write, checked against the layout before anything is written."""
    of = f" of {source}" if source else ""  # which layout, in the errors
    used: set[tuple[str, ...]] = set()
    planned = []
    for lay in layout:
        node: Any = weights
        for depth, part in enumerate(lay.path):
            if not isinstance(node, Mapping) or part not in node:
                if not lay.weights:
                    break  # a layer without weights (InputLayer, pooling) need not be given
                raise ValueError(f"weights has no layer {'/'.join(lay.path[: depth + 1])!r}, which the Keras "
                                 f"layout{of} needs (weights {list(lay.weights)})")
            node = node[part]
        values = []
        for i, name in enumerate(lay.weights):
            full = (*lay.path, name)
            if not isinstance(node, Mapping) or name not in node:
                raise ValueError(f"weights has no {'/'.join(full)!r}, which the Keras layout{of} needs (layer "
                                 f"{lay.name!r} stores {list(lay.weights)})")
            value = _as_numpy(node[name])
            if lay.shapes and value.shape != lay.shapes[i]:
                want_shape = lay.shapes[i]
                # A (out, in) kernel from another framework is the common case of a reversed 2-d shape.
                transposed = len(want_shape) == 2 and value.shape == want_shape[::-1]
                flipped = (f"it looks transposed: pass its transpose (.T) in Keras's {want_shape} layout, or "
                           if transposed else "pass a value of that shape, or ")
                raise ValueError(f"{'/'.join(full)!r} has shape {value.shape}, but the Keras layout{of} has "
                                 f"{want_shape}, so Keras's model.load_weights would refuse the file; {flipped}"
                                 "pass like= a file Keras wrote for the model these weights belong to")
            if lay.dtypes and value.dtype.name != lay.dtypes[i]:
                want = np.dtype(_dtypes.BY_NAME.get(lay.dtypes[i], lay.dtypes[i]))
                if _dtypes.held_as(want) != value.dtype:  # only a value JAX narrowed goes back to its stored type
                    raise ValueError(f"{'/'.join(full)!r} is {value.dtype}, but the Keras layout{of} stores {want}; "
                                     f"cast it (value.astype({want.name!r})), or pass like= a file Keras wrote for "
                                     f"the model with {value.dtype} weights")
                value = value.astype(want)
            values.append(value)
            used.add(full)
        planned.append((lay, values))
    for full, _ in _leaves(weights, ()):
        if full not in used:
            raise ValueError(f"weights has {'/'.join(full)!r}, which the Keras layout{of} does not hold; remove it "
                             "or pass like= a file of the model it belongs to")
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
    leaves = dict(_leaves(weights, ()))
    by_layout = [full for lay in getattr(weights, "layout", ()) for full in ((*lay.path, n) for n in lay.weights)]
    return [(p, leaves[p]) for p in dict.fromkeys([*(p for p in by_layout if p in leaves), *leaves])]


# --- assigning into a model --------------------------------------------------------------------
def _path_name(path: tuple) -> str:
    if path and isinstance(path[-1], jax.tree_util.GetAttrKey) and path[-1].name == "value":
        path = path[:-1]  # a varstate or flax nnx Variable's value: the weight is the Variable
    return jax.tree_util.keystr(path, simple=True, separator="/")


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
    - otherwise layer by layer (a leaf's layer is its name up to the last
      ``/``): the layers pair by name when both sides have the same layer
      names, else by position (JAX's order: dict keys sorted, Module
      attributes sorted, list items in order); within a pair, weights pair
      by name, Keras's or flax nnx's (``gamma`` is ``scale``, ``beta`` is
      ``bias``, ``moving_mean`` is ``mean``, ``moving_variance`` is ``var``,
      ``embeddings`` is ``embedding``), and by position only where the names
      differ. So an ``nnx.List`` of ``nnx.Linear`` takes a Keras MLP's
      weights although JAX sorts ``bias`` before ``kernel``;
    - when the layers do not line up (other counts), leaf by leaf: the n-th
      leaf takes the n-th weight in Keras's order.

    A shape that does not fit says how its weight was found; only a pairing
    by position suggests a ``name_map``.

    Every shape must match; a value takes the leaf's dtype when both are
    floats (or both integers), and goes to the leaf's sharding.

    Args:
        target: the pytree to fill (dicts, lists, Variables, arrays, an nnx
            Module); it is not changed.
        weights: Keras weights, as `load_weights` returns them (or nested
            dicts of arrays).
        name_map: a dict or function from leaf name to the Keras weight's
            path; None matches by name, else layer by layer (above).
        strict: every leaf must get a weight and every weight must be used;
            False leaves unmapped leaves unchanged and lets weights go unused
            (with `name_map` only).

    Returns:
        A new tree like `target` (a Variable leaf becomes a new version with its
        identity) holding the weights.

    Raises:
        ValueError: a leaf with no weight, a weight left unused, a count
            mismatch (by structure), a shape that does not fit, or a dtype
            of another family (a float into an integer leaf); the message
            names the first.
        TypeError: `weights` is not a dict.

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
    # Each leaf's Keras weight: (its path, its value, what a shape that does not fit says, by how the weight was
    # found), or None to leave the leaf unchanged.
    chosen: list[tuple[str, Any, str] | None]
    if name_map is not None:
        lookup = name_map.get if isinstance(name_map, Mapping) else name_map
        chosen = []
        for name in leaf_names:
            source = lookup(name)
            if source is None and strict:
                raise ValueError(
                    f"target leaf {name!r} is not in name_map; map it to a Keras weight (one of "
                    f"{_some(by_path)}), or pass strict=False to leave it unchanged"
                )
            if source is not None and source not in by_path:
                raise ValueError(
                    f"name_map maps target leaf {name!r} to {source!r}, which is not a Keras weight (they are "
                    f"{_some(by_path)})"
                )
            chosen.append(None if source is None else (source, by_path[source], ""))
        assigned = {c[0] for c in chosen if c is not None}
        unused = [p for p in by_path if p not in assigned]
        if strict and unused:
            raise ValueError(
                f"Keras weight {unused[0]!r} is not assigned to any target leaf ({len(unused)} unused); map it "
                "in name_map, or pass strict=False"
            )
    elif set(leaf_names) == set(by_path) and len(leaf_names) == len(by_path):
        chosen = [(name, by_path[name], SAME_NAMES) for name in leaf_names]
    elif len(flat) != len(ordered):
        raise ValueError(
            f"target has {len(flat)} leaves but there are {len(ordered)} Keras weights, and the names differ "
            f"(target: {_some(leaf_names)}; Keras: {_some(by_path)}): pass a name_map"
        )
    else:  # by layer (`pair_by_layer`), or leaf by leaf when the layers do not line up
        chosen = list(pair_by_layer(leaf_names, list(by_path.items()))
                      or [(p, v, BY_POSITION) for p, v in by_path.items()])
    new_leaves = [leaf if c is None else _fit(name, leaf, *c)
                  for name, (_, leaf), c in zip(leaf_names, flat, chosen, strict=True)]
    return jax.tree_util.tree_unflatten(treedef, new_leaves)


def _some(names) -> str:
    names = list(names)
    return str(names[:6])[:-1] + (", ...]" if len(names) > 6 else "]")


def _family(dtype: np.dtype) -> str:
    """Float, int, bool or complex: a value may change precision within its family, never family."""
    if dtype.kind == "V":  # ml_dtypes (bfloat16, float8, int4) are numpy kind "V"
        return "int" if dtype.name.startswith(("int", "uint")) else "float"
    return {"i": "int", "u": "int", "f": "float", "b": "bool", "c": "complex"}.get(dtype.kind, dtype.kind)


def _fit(name: str, leaf: Any, source: str, value: Any, hint: str) -> Any:
    value = _as_numpy(value)
    shape = tuple(np.shape(leaf))
    if value.shape != shape:
        # A weight chosen through name_map comes with no hint: the map itself is what to check.
        hint = hint or "; check name_map, which maps this leaf to that weight"
        raise ValueError(f"target leaf {name!r} has shape {shape}, but Keras weight {source!r} has {value.shape}{hint}")
    want = np.dtype(leaf.dtype) if hasattr(leaf, "dtype") else value.dtype
    if want != value.dtype and _family(want) != _family(value.dtype):
        family = _family(value.dtype)
        # Paired by position, the weight may be another leaf's; by name_map, the map may be wrong.
        pairing = ("" if hint == SAME_NAMES else "; or fix name_map, if that is not this leaf's weight" if not hint
                   else "; or, if the leaves pair with Keras's weights in another order, pass a name_map")
        raise ValueError(f"target leaf {name!r} is {want}, but Keras weight {source!r} is {value.dtype}: a weight "
                         f"loads into a leaf of any {family} precision, never into one of kind {_family(want)}. Make "
                         f"the leaf {family} (e.g. {value.dtype.name}) as in the model that wrote the file"
                         f"{pairing}")
    out = jnp.asarray(value.astype(want, copy=False))
    sharding = getattr(leaf, "sharding", None)
    return jax.device_put(out, sharding) if sharding is not None else out
