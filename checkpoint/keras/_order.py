"""Keras's order of a model's layers, which a Keras 3 ``.weights.h5`` does not record.

Keras writes a Functional or Sequential model's layers as ``layers/<class>``, ``layers/<class>_1``, ... (numbered
per class in ``model.layers`` order) and a layer's sublayers under their attribute names, visited sorted; the file
keeps no order across classes. Keras's order (``model.weights``, and ``model.trainable_variables``, on which the
optimizer is built) comes from, in turn: a ``.keras`` archive's ``config.json`` (its ``layers`` lists); else the
optimizer's ``optimizer/vars``, whose shapes follow the trainable variables: the per-class sequences are merged
to fit them, which is exact when only one merge fits; else only each class's own order is known.
"""

from __future__ import annotations

import functools
import itertools
import json
import re
import zipfile
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # _read builds on this module
    from checkpoint.keras import _read

Shape = tuple[int, ...]
_CONFIG = "config.json"
_MAX_CONFIG_BYTES = 64 << 20
# Steps of the merge (states explored times classes) before the order is called unknown: a real model takes about
# its layers times its classes; layers of many classes with equal shapes would take exponentially many.
_MAX_WORK = 2_000_000
_LAST = 1 << 30
_MAX_NESTING = 100  # models nested in a config; a real one nests a handful
_MAX_SLOTS = 8  # slots per variable in a Keras optimizer (Adam with amsgrad: 3)
# Built-in layers whose sublayers Keras tracks in an order other than their attributes' sorted names (Keras 3
# saves them under the public property's name; earlier versions under the private attribute's).
_SUBLAYER_RANK = {
    **{name: rank for rank, attr in enumerate(("query_dense", "key_dense", "gate_dense", "value_dense", "output_dense"))
       for name in (attr, f"_{attr}")},
    "forward_layer": 0, "backward_layer": 1,
}
_MODELS = frozenset({"Functional", "Sequential", "Model"})


def archive_config(path: str) -> Any:
    """The model config of a ``.keras`` archive, or None when it has none that parses."""
    with zipfile.ZipFile(path) as z:
        if _CONFIG not in z.namelist() or z.getinfo(_CONFIG).file_size > _MAX_CONFIG_BYTES:
            return None
        raw = z.read(_CONFIG)
    try:
        return json.loads(raw)
    except ValueError:  # UnicodeDecodeError is one
        return None


def config_ranks(config: Any) -> dict[tuple[str, ...], int]:
    """Each layer's key path -> its index in its model's ``layers`` list, from a Keras model config."""
    ranks: dict[tuple[str, ...], int] = {}
    todo: list[tuple[tuple[str, ...], Any]] = [((), config)]
    while todo:
        path, model = todo.pop()
        body = model.get("config") if isinstance(model, Mapping) else None
        layers = body.get("layers") if isinstance(body, Mapping) else None
        if not isinstance(layers, list) or len(path) > _MAX_NESTING:
            continue
        for i, layer in enumerate(layers):
            if not isinstance(layer, Mapping):
                continue
            body = layer.get("config")
            name = layer.get("name") or (body.get("name") if isinstance(body, Mapping) else None)
            if isinstance(name, str):
                ranks[(*path, name)] = i
                if layer.get("class_name") in _MODELS:
                    todo.append(((*path, name), layer))
    return ranks


def _leaf(weights: Mapping, path: tuple[str, ...]) -> Any:
    node: Any = weights
    for part in path:
        node = node[part]
    return node


def _blocks(weights: _read.KerasWeights, sub: Mapping[tuple[str, ...], int]) -> dict[str, list[Shape]]:
    """Each top-level layer's trainable shapes, its sublayers' in Keras's order after its own.

    Trainable as the optimizer's params are: all but the Variables made non-trainable (BatchNormalization's
    moving statistics).
    """
    out: dict[str, list[Shape]] = {}
    for lay in _ranked(weights.layout, sub):
        if path := lay.path:
            out.setdefault(path[0], []).extend(
                tuple(s) for w, s in zip(lay.weights, lay.shapes, strict=True)
                if getattr(_leaf(weights, (*path, w)), "trainable", True))
    return out


def optimizer_shapes(opt_shapes: Sequence[Shape], n: int) -> list[Shape] | None:
    """The n trainable variables' shapes from a Keras 3 optimizer's variables, or None if they do not show them.

    Keras 3 lays them out as scalars (``iteration``, ``learning_rate``), then each slot group for every variable
    in turn (a group's slots side by side per variable: Adam's momentum and velocity, then amsgrad's
    velocity_hat), then scalars made after the slots. Every split into groups that fits is tried; the shapes are
    known only if all that fit give the same.
    """
    shapes = [tuple(s) for s in opt_shapes]
    lead = next((i for i, s in enumerate(shapes[:2]) if s), min(len(shapes), 2))
    end = len(shapes)
    while end > lead and not shapes[end - 1]:
        end -= 1
    body = shapes[lead:end]
    if not n or not body or len(body) % n or len(body) // n > _MAX_SLOTS:
        return None
    per = len(body) // n
    found = set()
    for cuts in range(1 << (per - 1)):  # each way to split a variable's `per` slots into groups, in order
        bounds = [0, *(bit + 1 for bit in range(per - 1) if cuts >> bit & 1), per]
        start, target = 0, None
        for width in (b - a for a, b in itertools.pairwise(bounds)):
            group = [body[start + i * width] for i in range(n)]
            if target not in (None, group) or any(body[start + i * width + j] != group[i]
                                                   for i in range(n) for j in range(width)):
                break
            target, start = group, start + n * width
        else:
            found.add(tuple(target or ()))
    return list(found.pop()) if len(found) == 1 else None


def _classes(groups: Sequence[str] | Mapping[str, Any]) -> dict[str, list[str]]:
    """Group names by class, each class's in Keras's order: Keras names them <class>, <class>_1, <class>_2, ...
    in ``model.layers`` order."""
    chains: dict[str, list[tuple[int, str]]] = {}
    for name in groups:
        m = re.fullmatch(r"(.*?)(?:_(\d+))?", name)
        assert m is not None  # the pattern matches any string
        chains.setdefault(m[1], []).append((int(m[2] or 0), name))
    return {c: [n for _, n in sorted(chain)] for c, chain in chains.items()}


def merge(blocks: Mapping[str, list[Shape]], target: Sequence[Shape]) -> tuple[list[str] | None, int]:
    """Top-level layers in the one order (per-class sequences kept) whose trainable shapes are `target`.

    Returns (an order or None, how many orders fit: 0, 1 or 2 for "more than one"); (None, -1) when too many
    states were explored to tell.
    """
    seqs = list(_classes(blocks).values())
    # Layers without trainable weights take no place in `target`: they follow their class's previous layer.
    heavy = [[n for n in seq if blocks[n]] for seq in seqs]
    offsets = [[0, *itertools.accumulate(len(blocks[n]) for n in seq)] for seq in heavy]
    target = [tuple(s) for s in target]

    def moves(state: tuple[int, ...]) -> list[tuple[int, tuple[int, ...]]]:
        t = sum(off[p] for off, p in zip(offsets, state, strict=True))
        out = []
        for c, p in enumerate(state):
            if p < len(heavy[c]):
                block = blocks[heavy[c][p]]
                if target[t:t + len(block)] == block:
                    out.append((c, (*state[:c], p + 1, *state[c + 1:])))
        return out

    done = tuple(len(seq) for seq in heavy)
    memo: dict[tuple[int, ...], int] = {}
    start = tuple(0 for _ in heavy)
    stack = [start]
    work = 0
    while stack:
        state = stack[-1]
        if state in memo:
            stack.pop()
            continue
        nexts = moves(state)
        work += len(heavy) * (1 + len(nexts))
        if work > _MAX_WORK:
            return None, -1
        pending = [s for _, s in nexts if s not in memo]
        if pending:
            stack.extend(pending)
            continue
        memo[state] = int(sum(off[-1] for off in offsets) == len(target)) if state == done else min(
            2, sum(memo[s] for _, s in nexts))
        stack.pop()
    count = memo[start]
    if not count:
        return None, 0
    order: list[str] = []
    state = start
    placed = [0] * len(seqs)  # how far each class's layers, weightless ones included, are placed

    def place_until(c: int, name: str | None) -> None:
        while placed[c] < len(seqs[c]) and seqs[c][placed[c]] != name:
            order.append(seqs[c][placed[c]])
            placed[c] += 1

    while state != done:
        c, state = next((c, s) for c, s in moves(state) if memo[s])
        place_until(c, heavy[c][state[c] - 1])
        order.append(seqs[c][placed[c]])
        placed[c] += 1
    for c in range(len(seqs)):
        place_until(c, None)
    return order, count


def _key(path: tuple[str, ...], ranks: Mapping[tuple[str, ...], int], walk: Mapping[tuple[str, ...], int]):
    return tuple((ranks.get(path[: k + 1], _LAST), walk.get(path[: k + 1], 0)) for k in range(len(path)))


def _ranked(layout: Sequence[_read.LayerLayout], ranks: Mapping[tuple[str, ...], int]) -> list[_read.LayerLayout]:
    """`layout` sorted by the ranks of each level of a layer's path; unranked levels keep their order, after."""
    paths = [lay.path for lay in layout]  # read once: a reader's work stays linear in its layers
    walk = {path: i for i, path in enumerate(paths)}
    return [layout[i] for i in sorted(range(len(paths)), key=lambda i: _key(paths[i], ranks, walk))]


def sublayer_ranks(layout: Sequence[_read.LayerLayout]) -> dict[tuple[str, ...], int]:
    """Ranks of the sublayers of built-in layers (MultiHeadAttention's projections, Bidirectional's two RNNs)."""
    return {lay.path: _SUBLAYER_RANK[lay.group.rsplit("/", 1)[-1]] for lay in layout
            if lay.group and lay.group.rsplit("/", 1)[-1] in _SUBLAYER_RANK and len(lay.path) > 1}


def file_ranks(weights: _read.KerasWeights, target: Sequence[Shape] | None,
               n_of: Any = None) -> tuple[dict[tuple[str, ...], int], int | None]:
    """Ranks of the top-level layers of a ``.weights.h5`` found from the optimizer's shapes, and how many orders fit.

    The top-level layers take the one order that fits; without one (no shapes, none or several fit), each class's
    layers are put in their numbered order in the places its layers were read in.

    `target` is the trainable variables' shapes in Keras's order; `n_of` instead derives them from the
    optimizer's variables' shapes (`optimizer_shapes`). Only the layers of a Functional or Sequential model (all
    under ``layers/``) are ordered; the count is None when there is nothing to go by (another model, no shapes).
    """
    sub = sublayer_ranks(weights.layout)
    top = [(path, lay.group or "") for lay in weights.layout if len(path := lay.path) == 1]
    if not top or any(not g.startswith("layers/") or g.count("/") != 1 for _, g in top):
        return sub, None
    by_group = {g.split("/", 1)[1]: path[0] for path, g in top}
    # Each class's layers in their numbered order, in the places the class's layers were read in: all that is
    # known of the order without the optimizer's shapes.
    classes = _classes(by_group)
    chains = {c: iter(chain) for c, chain in classes.items()}
    class_of = {g: c for c, chain in classes.items() for g in chain}
    placed = [by_group[next(chains[class_of[g]])] for g in by_group]
    known: dict[tuple[str, ...], int] = {} if placed == list(by_group.values()) else {
        (name,): i for i, name in enumerate(placed)}
    fallback = {**sub, **known}
    if target is None and n_of is None:
        return fallback, None
    blocks = _blocks(weights, sub)
    if target is None:
        target = optimizer_shapes(n_of, sum(len(b) for b in blocks.values()))
        if target is None:
            return fallback, None
    order, count = merge({g: blocks.get(name, []) for g, name in by_group.items()}, target)
    if order is None or count != 1:
        return fallback, count
    return {**sub, **{(by_group[g],): i for i, g in enumerate(order)}}, count


def in_keras_order(weights: _read.KerasWeights, config: Any, opt_shapes: Sequence[Shape] | None) -> _read.KerasWeights:
    """`weights` read from a Keras 3 file in Keras's order: from the ``.keras`` `config`, else the optimizer's shapes.

    With neither (or when the shapes fit no order or several), each class's layers keep Keras's order among
    themselves, in the places the class's layers were read in (`file_ranks`).
    """
    ranks = config_ranks(config) if config is not None else {}
    if ranks:
        return reorder(weights, {**sublayer_ranks(weights.layout), **ranks})
    return reorder(weights, file_ranks(weights, None, opt_shapes)[0])


def reorder(weights: _read.KerasWeights, ranks: Mapping[tuple[str, ...], int]) -> _read.KerasWeights:
    """`weights` with its layers (dict and layout) in the order `ranks` gives; unranked ones keep theirs, after."""
    if not ranks:
        return weights
    layout = _ranked(weights.layout, ranks)
    return weights if layout == list(weights.layout) else _rebuilt(weights, layout)


def _rebuilt(weights: _read.KerasWeights, layout: Sequence[_read.LayerLayout]) -> _read.KerasWeights:
    """`weights`' values in a dict made in the order of `layout` (the same layers, reordered)."""
    tree: dict = {}
    for lay in layout:
        if not lay.weights:
            continue  # a layer's dict is made by its first weight (as load_weights makes it)
        node, source = tree, weights
        for part in lay.path:
            node, source = node.setdefault(part, {}), source[part]
        for name in lay.weights:
            node[name] = source[name]
    _add_missing(tree, weights)  # weights a caller added outside the layout stay, after
    return type(weights)(tree, layout=tuple(layout), source=weights.source)


def _add_missing(tree: dict, source: Mapping) -> None:
    for key, value in source.items():
        if isinstance(value, Mapping) and isinstance(tree.get(key, {}), dict):
            _add_missing(tree.setdefault(key, {}), value)
        elif key not in tree:
            tree[key] = value


def by_rank(weights: _read.KerasWeights, rank: Mapping[tuple[str, ...], int]) -> _read.KerasWeights:
    """Weights read from a TF checkpoint (no file layout) with the weights of `rank` first and in its order.

    Layers go by their first ranked weight, a layer's weights by rank; the unranked (non-trainable) keep their
    places after them.
    """
    def weight_rank(lay: _read.LayerLayout, name: str) -> int:
        return rank.get((*lay.path, name), _LAST)

    # Both sorts are stable: the unranked keep their order. A TF checkpoint's layout records no shapes or dtypes
    # that would have to follow the weights.
    layout = [lay._replace(weights=tuple(sorted(lay.weights, key=functools.partial(weight_rank, lay))))
              for lay in weights.layout]
    layout.sort(key=lambda lay: weight_rank(lay, lay.weights[0]) if lay.weights else _LAST)
    return _rebuilt(weights, layout)


def ambiguity_error(where: str, count: int) -> ValueError:
    if count == 0:
        why = ("no order of the model's layers gives the shapes of the optimizer's variables (a frozen layer, "
               "trainable=False, or a layer whose weights this reader takes for trainable)")
    elif count < 0:
        why = "the order of the model's layers could not be worked out from the optimizer's variables"
    else:
        why = ("more than one order of the model's layers gives the shapes of the optimizer's variables (layers of "
               "different classes with equal shapes)")
    return ValueError(
        f"{where}: a .weights.h5 does not record the order of a model's layers, and {why}; load the .keras "
        "archive (model.save), whose config records it, or pass params= a list of the "
        "weights in Keras's order of model.trainable_variables"
    )

