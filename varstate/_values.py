"""`values` and `with_values`: between a pytree of Variables and the same pytree of arrays."""

from __future__ import annotations

from typing import Any

import jax

from varstate._variable import Variable


def _is_var(x: Any) -> bool:
    return isinstance(x, Variable)


def values(tree: Any) -> Any:
    """`tree` with every Variable replaced by its value; everything else unchanged.

    What a loss function or `jax.grad` wants from a params pytree; with it,
    `jax.tree.map` over two models works on their values.

    Args:
        tree: any pytree (Variables among its leaves or not).

    Returns:
        The same structure with each Variable's value (a jax.Array) in its place.

    >>> import jax.numpy as jnp, varstate
    >>> params = {"w": varstate.Variable(jnp.ones(2)), "n": 3}
    >>> varstate.values(params)["w"].tolist(), varstate.values(params)["n"]
    ([1.0, 1.0], 3)
    """
    return jax.tree.map(lambda x: x.value if isinstance(x, Variable) else x, tree, is_leaf=_is_var)


def with_values(template: Any, arrays: Any) -> Any:
    """New versions of `template`'s Variables holding `arrays` (same structure); other leaves come from `arrays`.

    Each new version keeps its Variable's identity (resource id, name), as
    `Variable.assign` does, and is checked the same way (shape and dtype).

    Args:
        template: a pytree whose Variables give the identities.
        arrays: a pytree with `template`'s structure (what `values` returns);
            a leaf where `template` has a Variable is its new value.

    Returns:
        `template`'s structure with new Variable versions, and `arrays`' leaves
        where `template` has no Variable.

    Raises:
        ValueError: `arrays` does not have `template`'s structure, or a value's
            shape differs from its Variable's.
        TypeError: a value's dtype differs from its Variable's.

    >>> import jax.numpy as jnp, varstate
    >>> params = {"w": varstate.Variable(jnp.ones(2), name="w")}
    >>> new = varstate.with_values(params, {"w": jnp.zeros(2)})
    >>> new["w"].name, new["w"].resource_id == params["w"].resource_id, new["w"].value.tolist()
    ('w', True, [0.0, 0.0])
    """
    t_leaves, t_def = jax.tree.flatten(template, is_leaf=_is_var)
    try:
        a_leaves = t_def.flatten_up_to(arrays)
    except (ValueError, TypeError) as e:
        raise ValueError(
            f"with_values: `arrays` does not have the template's structure {t_def}: {e} "
            "Pass arrays in the structure varstate.values(template) returns."
        ) from None
    return t_def.unflatten([t.assign(a) if isinstance(t, Variable) else a for t, a in zip(t_leaves, a_leaves,
                                                                                          strict=True)])
