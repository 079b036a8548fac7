"""`assign_weights` without a name_map when the full names differ: Keras's layers paired with the target's.

A target leaf's layer is its name up to the last ``/`` (``layers/0`` for
``layers/0/kernel``), a Keras weight's its path up to the weight. The layers
pair by name when both sides have the same layer names, else by position
(the target's order is JAX's: dict keys and Module attributes sorted, list
items in order). Within a pair the weights pair by name, Keras's spelling
or flax's (``gamma`` is nnx's ``scale``), and by position only when the
names differ: JAX sorts ``bias`` before ``kernel``, so position alone never
fits an ``nnx.Linear``.
"""

from __future__ import annotations

from typing import Any

# Keras's weight names -> flax nnx's for the same weight (BatchNormalization, LayerNormalization, Embedding).
_NNX_NAMES = {"gamma": "scale", "beta": "bias", "moving_mean": "mean", "moving_variance": "var",
              "embeddings": "embedding"}

# What a shape that does not fit adds, by how its weight was found: names alike on both sides, or by position.
SAME_NAMES = "; the names match, so the model is not the one that wrote the file: build it with the file's shapes"
BY_POSITION = "; the order of leaves differs from Keras's: pass a name_map"


def _layers(names: list[str]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for name in names:
        layer, _, weight = name.rpartition("/")
        out.setdefault(layer, []).append(weight)
    return out


def _by_name(ours: list[str], theirs: list[str]) -> dict[str, str] | None:
    """Our weight name -> theirs, when the two sets of names agree (directly or through nnx's spellings)."""
    for spelling in (lambda n: n, lambda n: _NNX_NAMES.get(n, n)):
        renamed = {spelling(n): n for n in theirs}
        if len(renamed) == len(theirs) and set(renamed) == set(ours):
            return {n: renamed[n] for n in ours}
    return None


def pair_by_layer(leaf_names: list[str], weights: list[tuple[str, Any]]) -> list[tuple[str, Any, str]] | None:
    """For each leaf: (the Keras weight's path, its value, the hint for a shape that does not fit); see above.

    `weights` are (path, value) in Keras's order. None when the layers do not
    line up (another count of layers, or of weights in a paired layer).
    """
    ours, theirs = _layers(leaf_names), _layers([p for p, _ in weights])
    if len(ours) != len(theirs):
        return None
    by_layer_name = set(ours) == set(theirs)
    pairs = {o: o for o in ours} if by_layer_name else dict(zip(ours, theirs, strict=True))
    value = dict(weights)
    chosen: dict[str, tuple[str, Any, str]] = {}
    for n, (layer, names) in enumerate(ours.items(), 1):
        other = pairs[layer]
        if len(names) != len(theirs[other]):
            return None
        matched = _by_name(names, theirs[other])
        if matched is None:
            matched, hint = dict(zip(names, theirs[other], strict=True)), BY_POSITION
        elif by_layer_name:
            hint = SAME_NAMES
        else:
            hint = (f"; layers pair by position where their names differ (target layer {layer!r}, number {n} in "
                    f"JAX's order, with Keras layer {other!r}): if the order differs, pass a name_map")
        for name, theirs_name in matched.items():
            path = f"{other}/{theirs_name}" if other else theirs_name
            chosen[f"{layer}/{name}" if layer else name] = (path, value[path], hint)
    return [chosen[name] for name in leaf_names]
