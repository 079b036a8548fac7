"""flax nnx interop: an nnx Module's state as varstate Variables, and back.

`from_nnx` turns the state of an nnx Module (or an `nnx.State`) into a
nested dict of `varstate.Variable`s keyed by the nnx path, each named by
that path (``layers/0/kernel``) and trainable when its nnx type is a
`nnx.Param`. varstate's optimizers then step it with TF's numerics and
`checkpoint` saves it under TF's keys; `loss_fn` turns a function of the
Module into one of those params, for `jax.grad`; `to_nnx` writes the values
back into the Module (`nnx.update`). RNG state (`nnx.RngKey`,
`nnx.RngCount`) is left out: it is not a parameter for an optimizer to step.

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

from collections.abc import Callable as _Callable
from typing import Any as _Any

import jax as _jax

from varstate._autocast import AutoCastVariable as _AutoCastVariable
from varstate._registry import Registry as _Registry
from varstate._variable import Variable as _Variable

__all__ = ["from_nnx", "loss_fn", "to_nnx"]


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
            `from_nnx` returns, or a subset of them; an `AutoCastVariable`
            gives its stored (float32) value.

    Returns:
        None; `module` holds copies of the values (arrays, never the
        Variables or their wrappers), so a later donated step over `params`
        (`apply_gradients`) leaves the Module's arrays alive.

    Raises:
        TypeError: `module` is not an nnx Module, or `params` is not a dict.
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
    # A copy of each array: the Module must not share a buffer with params, which the next step donates.
    updates = _replaced(dict(_flat(module)), params, "to_nnx", copy=True)
    nnx.update(module, nnx.from_flat_state(updates))


def _replaced(current: dict, params: _Any, verb: str, *, copy: bool = False,
              read: bool = False) -> list[tuple[tuple, _Any]]:
    """(path, the Module's nnx Variable holding the new value) for each leaf of `params`, each checked.

    An AutoCastVariable gives its stored value, or with `read` its read (in the `autocast` dtype inside a scope).
    """
    if not isinstance(params, dict):
        nnx = _nnx()
        hint = (" (a Module): pass from_nnx(other) for another Module's values" if isinstance(params, nnx.Module)
                else ": pass nnx.to_pure_dict(state), or from_nnx(state)" if isinstance(params, nnx.State)
                else ": a restore returns a LoadStatus holding each root as an attribute, pass status.model (the "
                     "root's name)" if type(params).__name__ == "LoadStatus" else "")
        raise TypeError(f"{verb}: params must be nested dicts keyed by nnx path, as from_nnx returns; got "
                        f"{type(params).__name__}{hint}.")
    updates = []

    def walk(node: _Any, path: tuple) -> None:
        if isinstance(node, dict):
            for k, v in node.items():
                walk(v, (*path, k))
            return
        if isinstance(node, _AutoCastVariable):
            # Checked by its storage (the scope did any cast, not the caller); the Module gets the stored value to
            # keep, or for a loss the read, cast inside `autocast` as a Keras layer computes.
            stored = node.__varstate_variable__().value
            value = node.value if read else stored
        else:
            stored = value = node.value if isinstance(node, _Variable) else node
        target = current.get(path)
        if target is None:
            raise KeyError(f"{verb}: the Module has no variable at {'/'.join(map(str, path))!r}; its paths are "
                           f"{sorted('/'.join(map(str, p)) for p in current)[:10]}.")
        old = target.get_value()
        if tuple(old.shape) != tuple(stored.shape) or old.dtype != stored.dtype:
            fix = (f"cast it first (.astype(jnp.{old.dtype}))" if tuple(old.shape) == tuple(stored.shape) else
                   "params come from another architecture (from_nnx(module) gives this Module's)")
            raise ValueError(f"{verb}: {'/'.join(map(str, path))!r} is {stored.dtype}{list(stored.shape)}, the "
                             f"Module holds {old.dtype}{list(old.shape)}: {fix}.")
        updates.append((path, target.replace(value.copy() if copy and isinstance(value, _jax.Array) else value)))

    walk(params, ())
    return updates


def loss_fn(model: _Any, f: _Callable[..., _Any], *, discard_changes: bool = False) -> _Callable[..., _Any]:
    """`f` of an nnx Module as a function of its parameters: what `jax.grad` differentiates for a varstate optimizer.

    ``loss_fn(model, f)(params, *args, **kwargs)`` calls ``f(m, *args,
    **kwargs)`` on a copy ``m`` of `model` (``nnx.merge``) that holds the
    values of `params` (as `from_nnx` nests them, Variables or their
    `varstate.values`; a subset is fine: the rest comes from `model`), so
    ``jax.grad(loss_fn(model, f))(varstate.values(params))`` has the
    structure of ``params`` and goes straight to ``opt.apply_gradients``.
    `model` itself is never changed. An `AutoCastVariable` in `params`
    (`mixed_precision.autocast_variables`) gives the copy its read: inside
    `varstate.autocast` the Module computes in the compute dtype, and
    ``jax.grad`` of the wrappers themselves has their structure, float32
    gradients on the storage. Works under `jax.jit`; the rest of the
    Module's state (RNG keys) is read when the function is traced.

    The function is pure, so a change `f` makes to the copy's state (a
    draw from an RNG stream, BatchNorm statistics in training mode) would be
    lost, and a draw repeated on every call: that raises, naming the path
    and the fix (draw from a key passed in: ``m(x,
    rngs=nnx.Rngs(dropout=key))``; a Module in eval mode), unless
    ``discard_changes=True``.

    Args:
        model: the nnx Module whose structure and other state `f` sees.
        f: a function of the Module (and any further arguments), e.g. the loss.
        discard_changes: True lets `f` change the copy's state, the changes
            then dropped; False raises at the first.

    Returns:
        ``loss(params, *args, **kwargs)``, returning what `f` returns.

    Raises:
        TypeError: `model` is not an nnx Module; (when called) `params` is not a dict.
        KeyError: (when called) a path of `params` that the Module does not have.
        ValueError: (when called) a value whose shape or dtype differs from the Module's; `f`
            changed the copy's state (an RNG draw, BatchNorm statistics) without ``discard_changes=True``.

    >>> import jax, jax.numpy as jnp, varstate
    >>> from flax import nnx
    >>> from varstate.nnx import from_nnx, loss_fn
    >>> from varstate.optimizers import GradientDescent
    >>> model = nnx.Linear(2, 1, rngs=nnx.Rngs(0))
    >>> params = from_nnx(model, registry=varstate.Registry())
    >>> loss = loss_fn(model, lambda m, x: jnp.sum(m(x)))
    >>> grads = jax.grad(loss)(varstate.values(params), jnp.ones((1, 2)))
    >>> grads["kernel"].tolist(), grads["bias"].tolist()
    ([[1.0], [1.0]], [1.0])
    >>> opt = GradientDescent(0.5)
    >>> params, _ = opt.apply_gradients(grads, params, opt.init(params))
    >>> params["bias"].value.tolist()
    [-0.5]
    """
    nnx = _nnx()
    if not isinstance(model, nnx.Module):
        raise TypeError(f"loss_fn: expected an nnx.Module, got {type(model).__name__}; for a pytree of Variables, "
                        "differentiate a function of varstate.values(params) directly.")

    def loss(params: _Any, *args: _Any, **kwargs: _Any) -> _Any:
        graphdef, state = nnx.split(model)
        # Copies of every nnx Variable: f's changes stay on them (nnx refuses a change from inside a trace to a
        # Variable made outside it), and are found below.
        flat = {p: v.replace(v.get_value()) for p, v in nnx.to_flat_state(state)}
        rng_types = (nnx.RngKey, nnx.RngCount)  # left to nnx, as from_nnx leaves them
        flat.update(_replaced({p: v for p, v in flat.items() if not isinstance(v, rng_types)}, params, "loss_fn",
                              read=True))
        before = {p: v.get_value() for p, v in flat.items()}
        out = f(nnx.merge(graphdef, nnx.from_flat_state(list(flat.items()))), *args, **kwargs)
        changed = sorted((not isinstance(v, nnx.RngCount), i, p) for i, (p, v) in enumerate(flat.items())
                         if v.get_value() is not before[p])  # an RNG draw first: the likelier surprise
        if changed and not discard_changes:
            _refuse_change(changed[0][2], flat[changed[0][2]])
        return out

    return loss


def _refuse_change(path: tuple, var: _Any) -> None:
    nnx = _nnx()
    where = "/".join(map(str, path))
    if isinstance(var, nnx.RngCount):
        stream = getattr(var, "tag", None) or "default"  # the stream's name, which Rngs(...) takes as a keyword
        raise ValueError(
            f"loss_fn: f drew random numbers from the Module's RNG stream at {where!r}; loss_fn does not carry RNG "
            "state from call to call, so every call would draw the same numbers. Draw from a key passed in "
            f"instead, a new one each step: loss_fn(model, lambda m, x, key: ...m(x, rngs=nnx.Rngs({stream}=key)))"
            "(params, x, key) (nnx.Dropout and others take rngs= when called); or pass discard_changes=True."
        )
    raise ValueError(
        f"loss_fn: f changed {where!r} ({type(var).__name__}) on the copy of the Module it was given, and the "
        "change is not kept: loss_fn's function returns only what f returns. For a loss, put the Module in eval "
        "mode (model.eval(): BatchNorm then uses its running statistics); to keep the change, return it from f "
        "(jax.grad(..., has_aux=True)), write it into its Variable in params (`v.assign(new)` returns the "
        "new version) and pass discard_changes=True."
    )
