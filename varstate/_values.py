"""`values` and `with_values`: between a pytree of Variables and the same pytree of arrays."""

from __future__ import annotations

from typing import Any

import jax

from varstate._autocast import AutoCastVariable
from varstate._partition import PartitionedVariable
from varstate._variable import Variable, version


def _is_var(x: Any) -> bool:
    return isinstance(x, Variable)


def _is_unit(x: Any) -> bool:
    """A leaf of `values`: a Variable or one of the wrappers that hold Variables."""
    return isinstance(x, (Variable, AutoCastVariable, PartitionedVariable))


def _stored(x: Any) -> Any:
    """The value of a Variable, or the storage value of an AutoCastVariable (never cast)."""
    return x.__varstate_variable__().value if isinstance(x, AutoCastVariable) else x.value


def _value_of(x: Any) -> Any:
    if isinstance(x, PartitionedVariable):
        return [_stored(shard) for shard in x]
    return _stored(x) if _is_unit(x) else x


def values(tree: Any) -> Any:
    """`tree` with every Variable replaced by its value; everything else unchanged.

    What a loss function or `jax.grad` wants from a params pytree; with it,
    `jax.tree.map` over two models works on their values. The wrappers give
    arrays too: an `AutoCastVariable` its stored value (float32, not cast,
    even inside `autocast`), a `PartitionedVariable` the list of its shards'
    values (``jnp.concatenate(vals, axis)`` is the full array). The
    gradients of a function of these arrays are arrays, which
    `apply_gradients` does not pair with such wrappers: to train
    mixed-precision or partitioned params, differentiate with respect to the
    params themselves (``jax.grad(loss)(params)``; an AutoCastVariable's read
    inside `autocast` is then cast, and its gradient reaches the float32
    storage).

    Args:
        tree: any pytree (Variables among its leaves or not).

    Returns:
        The same structure with each Variable's value (a jax.Array) in its
        place, each AutoCastVariable's stored value, each PartitionedVariable's
        list of shard values.

    >>> import jax.numpy as jnp, varstate
    >>> params = {"w": varstate.Variable(jnp.ones(2)), "n": 3}
    >>> varstate.values(params)["w"].tolist(), varstate.values(params)["n"]
    ([1.0, 1.0], 3)
    >>> r = varstate.Registry()
    >>> mixed = {"w": varstate.AutoCastVariable(varstate.Variable(jnp.ones(2), name="w", registry=r)),
    ...          "emb": varstate.PartitionedVariable(jnp.ones((3, 2)), name="emb", num_shards=2, registry=r)}
    >>> with varstate.autocast(jnp.bfloat16):
    ...     vals = varstate.values(mixed)
    >>> vals["w"].dtype, [x.shape for x in vals["emb"]]
    (dtype('float32'), [(2, 2), (1, 2)])
    """
    return jax.tree.map(_value_of, tree, is_leaf=_is_unit)


def with_values(template: Any, arrays: Any) -> Any:
    """New versions of `template`'s Variables holding `arrays` (same structure); other leaves come from `arrays`.

    Each new version keeps its Variable's identity (resource id, name), as
    `Variable.assign` does, and is checked the same way (shape and dtype).
    `arrays` has the structure `values` gives: an array for an
    `AutoCastVariable` (its storage dtype; the result is an AutoCastVariable
    again), a list of shard values for a `PartitionedVariable` (the result is
    the PartitionedVariable's new version).

    Args:
        template: a pytree whose Variables give the identities.
        arrays: a pytree with `template`'s structure (what `values` returns);
            a leaf where `template` has a Variable is its new value.

    Returns:
        `template`'s structure with new Variable versions, and `arrays`' leaves
        where `template` has no Variable.

    Raises:
        ValueError: `arrays` does not have `template`'s structure (a
            PartitionedVariable's entry not a list of one value per shard),
            or a value's shape differs from its Variable's.
        TypeError: a value's dtype differs from its Variable's.

    >>> import jax.numpy as jnp, varstate
    >>> params = {"w": varstate.Variable(jnp.ones(2), name="w")}
    >>> new = varstate.with_values(params, {"w": jnp.zeros(2)})
    >>> new["w"].name, new["w"].resource_id == params["w"].resource_id, new["w"].value.tolist()
    ('w', True, [0.0, 0.0])
    """
    t_leaves, t_def = jax.tree.flatten(template, is_leaf=_is_unit)
    try:
        a_leaves = t_def.flatten_up_to(arrays)
    except (ValueError, TypeError) as e:
        raise ValueError(
            f"with_values: `arrays` does not have the template's structure {t_def}: {e} "
            "Pass arrays in the structure varstate.values(template) returns."
        ) from None
    return t_def.unflatten([_assigned(t, a) for t, a in zip(t_leaves, a_leaves, strict=True)])


def _assigned(t: Any, a: Any) -> Any:
    if isinstance(t, Variable):
        return t.assign(a)
    if isinstance(t, AutoCastVariable):
        # The inner assign, not the wrapper's (which casts any float dtype): the same checks as for a Variable.
        return AutoCastVariable(t.__varstate_variable__().assign(a))
    if isinstance(t, PartitionedVariable):
        if not isinstance(a, (list, tuple)) or len(a) != len(t):
            found = (f"a {type(a).__name__} of {len(a)}" if isinstance(a, (list, tuple)) else
                     f"a {type(a).__name__}" + (f" of shape {tuple(a.shape)}" if hasattr(a, "shape") else ""))
            raise ValueError(
                f"with_values: PartitionedVariable {t.name!r} takes a list of {len(t)} shard values (what "
                f"varstate.values gives), found {found}. Pass the shards' values in order, or the whole value "
                "to the PartitionedVariable's own assign(full_array), which slices it into the shards."
            )
        shards, shard_def = jax.tree.flatten(t, is_leaf=lambda x: isinstance(x, (Variable, AutoCastVariable)))
        return shard_def.unflatten([_assigned(s, x) for s, x in zip(shards, a, strict=True)])
    return a


def tree_map(f: Any, tree: Any, *rest: Any) -> Any:
    """`jax.tree.map` over trees of one structure whose Variables differ in identity (two models, say).

    `jax.tree.map(f, model_a, model_b)` raises, as a Variable's identity is part
    of its tree structure (and `jit` relies on that); this pairs Variables by
    position instead, and gives back the first tree's identities.

    Args:
        f: called with one leaf from each tree: for a Variable, its value (a
            PartitionedVariable's shards are paired one by one); any other
            leaf as `jax.tree.map` gives it.
        tree: a pytree; its Variables' identities (resource id, name) are kept.
        *rest: pytrees of `tree`'s structure, with Variables where `tree` has
            them (any identities).

    Returns:
        `tree`'s structure, each Variable a new version of itself holding
        `f`'s result (unchecked, as with `jax.tree.map`), `f`'s result in
        place of every other leaf.

    Raises:
        ValueError: a tree in `rest` differs from `tree` other than in its
            Variables' identities; the message names the first difference.

    >>> import jax.numpy as jnp, varstate
    >>> a = {"w": varstate.Variable(jnp.ones(2), name="w"), "n": 1}
    >>> b = {"w": varstate.Variable(jnp.full(2, 3.0), name="w"), "n": 2}
    >>> avg = varstate.tree_map(lambda x, y: (x + y) / 2, a, b)
    >>> avg["w"].name, avg["w"].value.tolist(), avg["n"]
    ('w', [2.0, 2.0], 1.5)
    """
    flat, t_def = jax.tree_util.tree_flatten_with_path(tree, is_leaf=_is_paired)
    columns = [[x for _, x in flat]]
    for i, other in enumerate(rest):
        o_flat, o_def = jax.tree_util.tree_flatten_with_path(other, is_leaf=_is_paired)
        difference = _first_difference(flat, o_flat, t_def, o_def, f"`rest[{i}]`")
        if difference:
            raise ValueError(
                f"varstate.tree_map: `rest[{i}]` does not have the first tree's structure: {difference}. "
                "Pass trees of one structure, with Variables in the same places (their identities may differ)."
            )
        columns.append([x for _, x in o_flat])

    def one(xs: tuple) -> Any:
        if _is_var(xs[0]):
            return version(f(*(x.value for x in xs)), xs[0].handle)
        if isinstance(xs[0], PartitionedVariable):  # its name is in its tree structure: paired shard by shard
            shards = [version(f(*(s.value for s in ss)), ss[0].handle) for ss in zip(*xs, strict=True)]
            return jax.tree.structure(xs[0], is_leaf=_is_var).unflatten(shards)
        return f(*xs)

    return t_def.unflatten([one(xs) for xs in zip(*columns, strict=True)])


def _is_paired(x: Any) -> bool:
    """A leaf `tree_map` pairs by position whatever its identity."""
    return isinstance(x, (Variable, PartitionedVariable))


def _kind(x: Any) -> str:
    return "Variable" if _is_var(x) else type(x).__name__


def _first_difference(flat: list, o_flat: list, t_def: Any, o_def: Any, other: str) -> str:
    keystr = jax.tree_util.keystr
    for (path, x), (o_path, o_x) in zip(flat, o_flat, strict=False):  # unequal lengths: below
        if path != o_path:
            return f"the first tree has a leaf at tree{keystr(path)} where {other} has one at tree{keystr(o_path)}"
        if (_is_paired(x) or _is_paired(o_x)) and _kind(x) != _kind(o_x):
            return f"at tree{keystr(path)} the first tree has a {_kind(x)}, {other} a {_kind(o_x)}"
        if isinstance(x, PartitionedVariable) and [s.shape for s in x] != [s.shape for s in o_x]:
            return (f"at tree{keystr(path)} the PartitionedVariables are split differently: shards of shapes "
                    f"{[tuple(s.shape) for s in x]} versus {[tuple(s.shape) for s in o_x]}")
    if len(flat) != len(o_flat):
        extra = keystr((flat if len(flat) > len(o_flat) else o_flat)[min(len(flat), len(o_flat))][0])
        return f"the first tree has {len(flat)} leaves, {other} {len(o_flat)} (the first extra at tree{extra})"
    if t_def != o_def:
        return f"the containers differ: {t_def} versus {o_def}"
    return ""
