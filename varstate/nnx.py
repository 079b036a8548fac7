"""flax nnx interop: an nnx Module's state as varstate Variables, and back.

`from_nnx` turns the state of an nnx Module (or an `nnx.State`) into a
nested dict of `varstate.Variable`s keyed by the nnx path, each named by
that path (``layers/0/kernel``) and trainable when its nnx type is a
`nnx.Param`. varstate's optimizers then step it with TF's numerics and
`checkpoint` saves it under TF's keys; `to_nnx` writes the values back into
the Module (`nnx.update`). RNG state (`nnx.RngKey`, `nnx.RngCount`) is left
out: it is not a parameter for an optimizer to step.

A Module (or an `nnx.State`) is also a checkpoint root as it is, RNG state
included: ``checkpoint.Checkpoint(model=module)`` saves every nnx Variable
under its attribute path (``model/layers/0/kernel``, no ``value`` level: the
keys TF gives a tf.Module of the same structure), each PRNG key as its key
data and implementation; restoring into a Module template returns a new
Module (`nnx.merge`), the template untouched.

>>> import jax.numpy as jnp, varstate
>>> from flax import nnx
>>> from varstate.nnx import from_nnx, to_nnx
>>> model = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
>>> params = from_nnx(model, registry=varstate.Registry())
>>> params["kernel"].name, params["kernel"].trainable, params["kernel"].shape
('kernel', True, (2, 3))
>>> to_nnx(model, {"kernel": params["kernel"].assign(jnp.ones((2, 3))), "bias": params["bias"]})
>>> float(model.kernel[...].sum())
6.0

>>> import os, tempfile, checkpoint
>>> path = checkpoint.Checkpoint(model=model).save(os.path.join(tempfile.mkdtemp(), "ckpt"))
>>> sorted(k for k in checkpoint.read_checkpoint(path).keys() if k.startswith("model/"))
['model/bias/.ATTRIBUTES/VARIABLE_VALUE', 'model/kernel/.ATTRIBUTES/VARIABLE_VALUE']
>>> restored = checkpoint.Checkpoint(model=nnx.Linear(2, 3, rngs=nnx.Rngs(1))).restore(path).model
>>> float(restored.kernel[...].sum())
6.0
"""

from __future__ import annotations

from typing import Any as _Any

from varstate._registry import Registry as _Registry
from varstate._variable import Variable as _Variable

__all__ = ["from_nnx", "to_nnx"]


def _nnx():
    from flax import nnx  # flax is a dependency; imported here so `import varstate` stays light

    return nnx


def _flat(module_or_state: _Any) -> list[tuple[tuple, _Any]]:
    nnx = _nnx()
    if isinstance(module_or_state, nnx.Module):
        state = nnx.state(module_or_state)
    elif isinstance(module_or_state, nnx.State):
        state = module_or_state
    else:
        raise TypeError(
            f"from_nnx: expected an nnx.Module or nnx.State, got {type(module_or_state).__name__}. "
            "For a plain pytree of arrays, build Variables with varstate.Variable."
        )
    rng_types = (nnx.RngKey, nnx.RngCount)
    return [(tuple(path), var) for path, var in nnx.to_flat_state(state) if not isinstance(var, rng_types)]


def from_nnx(module_or_state: _Any, *, registry: _Registry | None = None) -> dict[_Any, _Any]:
    """The nnx state as a nested dict of Variables keyed by nnx path; see the module docstring.

    Each Variable copies its value (as `varstate.Variable` does), so a donated
    optimizer step never deletes the Module's arrays.

    Args:
        module_or_state: an nnx Module, or an `nnx.State` (``nnx.state(module)``).
        registry: the `varstate.Registry` the Variables are named in; None is
            the default one (where a name already taken gets a ``_1`` suffix:
            pass a new registry to keep the paths exactly).

    Returns:
        ``{path part: ... {name: Variable}}`` as nested dicts, each Variable
        named by its path (``layers/0/kernel``), trainable when its nnx type
        is `nnx.Param`; RNG state left out.

    >>> import varstate
    >>> from flax import nnx
    >>> params = from_nnx(nnx.Linear(2, 3, rngs=nnx.Rngs(0)), registry=varstate.Registry())
    >>> sorted(params), params["bias"].name, params["bias"].shape
    (['bias', 'kernel'], 'bias', (3,))
    """
    from flax.traverse_util import unflatten_dict  # as `_nnx`: imported here

    nnx = _nnx()
    return unflatten_dict({
        path: _Variable(var.get_value(), name="/".join(str(p) for p in path), trainable=isinstance(var, nnx.Param),
                        registry=registry)
        for path, var in _flat(module_or_state)
    })


def to_nnx(module: _Any, params: _Any) -> None:
    """Writes the values of `params` (as made by `from_nnx`, or a subset of it) into `module` (`nnx.update`).

    Args:
        module: the nnx Module to update in place.
        params: nested dicts of Variables (or arrays) keyed by nnx path, as
            `from_nnx` returns, or a subset of them.

    Returns:
        None; `module` holds the new values.

    Raises:
        TypeError: `module` is not an nnx Module.
        KeyError: a path of `params` that the Module does not have (the first).
        ValueError: a path whose shape or dtype differs from the Module's.

    >>> import jax.numpy as jnp, varstate
    >>> from flax import nnx
    >>> model = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
    >>> to_nnx(model, {"bias": varstate.Variable(jnp.ones(3))})
    >>> model.bias[...].tolist()
    [1.0, 1.0, 1.0]
    """
    nnx = _nnx()
    if not isinstance(module, nnx.Module):
        raise TypeError(f"to_nnx: expected an nnx.Module, got {type(module).__name__}.")
    current = dict(_flat(module))
    updates = []

    def walk(node: _Any, path: tuple) -> None:
        if isinstance(node, dict):
            for k, v in node.items():
                walk(v, (*path, k))
            return
        value = node.value if isinstance(node, _Variable) else node
        target = current.get(path)
        if target is None:
            raise KeyError(f"to_nnx: the Module has no variable at {'/'.join(map(str, path))!r}; its paths are "
                           f"{sorted('/'.join(map(str, p)) for p in current)[:10]}.")
        old = target.get_value()
        if tuple(old.shape) != tuple(value.shape) or old.dtype != value.dtype:
            raise ValueError(f"to_nnx: {'/'.join(map(str, path))!r} is {value.dtype}{list(value.shape)}, the "
                             f"Module holds {old.dtype}{list(old.shape)}.")
        updates.append((path, target.replace(value)))

    walk(params, ())
    nnx.update(module, nnx.from_flat_state(updates))
