"""Messages for misspelled optimizer arguments: the closest valid names, and Keras's spellings mapped to ours.

An optimizer is a dataclass; its generated ``__init__`` raises a bare
``TypeError: __init__() got an unexpected keyword argument 'beta_1'``.
`checked_new`, called by ``Optimizer.__new__``, runs first with the same
arguments and raises instead a TypeError naming the class, the closest
fields (`difflib`) and all of them.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
from collections.abc import Callable
from typing import Any

from varstate._pack import Packed
from varstate.optimizers._core._matching import entered
from varstate.optimizers._core._state import OptimizerState

# Keras (and tf.keras) keywords whose TF v1 counterpart is spelled too differently for difflib to find.
_ALIASES = {
    "lr": "learning_rate",
    "nesterov": "use_nesterov",
    "rho": "decay",
    "initial_accumulator": "initial_accumulator_value",
}

def _init_fields(cls: type) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(cls) if f.init) if dataclasses.is_dataclass(cls) else ()


def unexpected_keyword(cls: type, keyword: str) -> TypeError:
    """The TypeError for ``cls(keyword=...)`` when `cls` has no such field: the closest field names, then all.

    >>> from varstate.optimizers import Adam
    >>> print(unexpected_keyword(Adam, "beta_1"))  # doctest: +ELLIPSIS
    Adam() got an unexpected keyword argument 'beta_1': did you mean beta1? Adam's arguments are learning_rate, ...
    """
    fields = _init_fields(cls)
    close = [_ALIASES[keyword]] if _ALIASES.get(keyword) in fields else []
    if not close:  # the best-scoring names (ties kept): beta_1 is beta1, not beta2
        scores = {n: difflib.SequenceMatcher(None, keyword, n).ratio() for n in fields}
        best = max(scores.values(), default=0.0)
        close = [n for n, score in scores.items() if score == best and score >= 0.6]
    hint = f": did you mean {' or '.join(close)}?" if close else "."
    known = f" {cls.__name__}'s arguments are {', '.join(fields)}." if fields else ""
    return TypeError(f"{cls.__name__}() got an unexpected keyword argument {keyword!r}{hint}{known}")


def checked_new(cls: type, *args: Any, **kwargs: Any) -> Any:
    """``__new__`` for optimizer dataclasses: a keyword that is no field raises `unexpected_keyword`'s TypeError.

    >>> import dataclasses
    >>> from varstate.optimizers import GradientDescent
    >>> @dataclasses.dataclass(frozen=True)
    ... class Hooked(GradientDescent):
    ...     __new__ = checked_new
    >>> Hooked(lr=0.1)
    Traceback (most recent call last):
    TypeError: Hooked() got an unexpected keyword argument 'lr': did you mean learning_rate? ...
    """
    fields = _init_fields(cls) if kwargs else ()
    for keyword in kwargs:
        if fields and keyword not in fields:
            raise unexpected_keyword(cls, keyword)
    return object.__new__(cls)


@functools.cache  # by type: every step asks, for the same few types
def _nnx_kind(kind: type) -> str | None:
    """``"an nnx.State"``, ``"an nnx Module (MLP)"``...: what flax nnx type `kind` is, else None (flax unimported)."""
    for cls in kind.__mro__:
        if cls.__module__.startswith("flax.nnx"):
            own = kind.__name__
            return f"an nnx {cls.__name__} ({own})" if own != cls.__name__ else f"an nnx.{own}"
    return None


def guarded_update(update: Callable[..., Any]) -> Callable[..., Any]:
    """`update` refusing optax's two-argument habit, ``opt.update(grads, state)``, with `missing_state`'s message.

    Python's own message for it names the class that defines ``update``
    (``Optimizer.update()``), not the optimizer's, and gives no fix. The
    check counts the arguments only: O(1) per call.
    """
    @functools.wraps(update)
    def checked(self: Any, *args: Any, **kwargs: Any) -> Any:
        if len(args) < 3 and "state" not in kwargs:
            raise missing_state(self, args)
        with entered(f"{type(self).__name__}.update"):
            return update(self, *args, **kwargs)

    return checked


def missing_state(opt: Any, args: tuple) -> TypeError:
    """The TypeError for ``opt.update`` called without its state (optax's ``update(grads, state)`` habit).

    >>> from varstate.optimizers import Adam
    >>> print(missing_state(Adam(0.1), ({}, Adam(0.1).init({}))))  # doctest: +ELLIPSIS
    Adam.update(grads, state): missing the state. The arguments are update(grads, params, state), ...
    """
    name, _, optax_form = _owner(opt)
    if len(args) == 2 and isinstance(args[1], OptimizerState):
        got = f"{name}.update(grads, state): missing the state"
    else:
        got = f"{name}.update() missing its argument 'state' ({len(args)} positional given)"
    if optax_form == "tx":
        whose, tx = "the hosted tx's", "with tx itself"
    else:
        whose, tx = "opt.to_optax()'s", "with tx = opt.to_optax()"
    return TypeError(
        f"{got}. The arguments are update(grads, params, state), params between grads and state; optax's "
        f"update(grads, state, params) order is {whose}. Call opt.update(grads, params, state), or step {tx}: "
        "tx.update(grads, tx_state, params) with tx_state = tx.init(params)."
    )


def _owner(opt: Any) -> tuple[str, str, str]:
    """(the optimizer's name in messages, how it was made, its optax form)."""
    if type(opt).__name__.startswith("_"):  # from_optax's class: the optax transformation is the nnx fix
        return "from_optax(tx)", "from_optax(tx)", "tx"
    name = type(opt).__name__
    return name, f"{name}(...)", f"{name}(...).to_optax()"


def check_arguments(opt: Any, verb: str, params: Any, grads: Any = None, state: Any = None) -> None:
    """TypeError for arguments of another API: an nnx object, optax's argument order, a state of another kind.

    An nnx object reaches an optimizer when it is handed to ``nnx.Optimizer``
    (which calls ``tx.init(nnx.state(model))``) or given a Module or
    ``nnx.grad``'s State directly; either way the steps would pair leaves
    that are not the params. optax's ``update(grads, state, params)`` puts
    the state second, where ours is ``(grads, params, state)``.

    >>> from varstate.optimizers import Adam
    >>> check_arguments(Adam(0.1), "init", {"w": 1.0})  # plain pytrees pass
    """
    name, given, optax_form = _owner(opt)
    if isinstance(params, Packed) and not getattr(opt, "_elementwise", True):
        raise TypeError(
            f"{name}.{verb}: params are packed (varstate.pack), but {name}'s step is not elementwise (it reduces "
            "over each whole variable, or is an optax transformation): one computation over a buffer of many "
            f"params would mix them. Step the unpacked params (packed.unpack()) with {name}, or use an elementwise "
            "optimizer (Adam, SGD, ...)."
        )
    if isinstance(params, OptimizerState):
        raise TypeError(
            f"{name}.{verb}: params is an OptimizerState: the arguments are (grads, params, state), where optax's "
            f"update takes (grads, state, params). Call opt.{verb}(grads, params, state)."
        )
    if state is not None and not isinstance(state, OptimizerState):
        kind = type(state).__name__
        if kind == "TFOptimizerState":
            raise TypeError(
                f"{name}.{verb}: state is the optax state of {given}.to_optax() (a TFOptimizerState), where {verb} "
                f"takes the OptimizerState that {name}.init(params) makes. Keep to one form: tx.update(grads, "
                "opt_state, params) with the optax state, or state = opt.init(params)."
            )
        raise TypeError(
            f"{name}.{verb}: state is {'an' if kind[:1] in 'AEIOUaeiou' else 'a'} {kind}, not the OptimizerState "
            f"that {name}.init(params) makes. Call state = opt.init(params) once, then pass the state each step "
            "returns."
        )
    for role, tree in (("params", params), ("grads", grads)):
        nnx_kind = _nnx_kind(type(tree))  # type: ignore[arg-type]  # a type is hashable
        if nnx_kind is None:
            continue
        if role == "params":
            fix = (
                f"If it came from nnx.Optimizer(model, {given}), give nnx.Optimizer the optax form instead: "
                f"nnx.Optimizer(model, {optax_form}, wrt=nnx.Param). To step the model's parameters with "
                "varstate, make them Variables: `params = varstate.nnx.from_nnx(model)`, then "
                "`varstate.nnx.to_nnx(model, params)` writes them back"
            )
        else:
            fix = (
                "Take the gradient with respect to the params' values, which has params' structure: "
                "`grads = jax.grad(varstate.nnx.loss_fn(model, f))(varstate.values(params))` with "
                "`params = varstate.nnx.from_nnx(model)`"
            )
        raise TypeError(
            f"{name}.{verb}: {role} is {nnx_kind}; varstate's optimizers take pytrees of varstate Variables or arrays, "
            f"not nnx objects. {fix}."
        )


def injected(cls: str, name: str, injectable: tuple[str, ...]) -> str:
    """The message for an option given a traced array (optax.inject_hyperparams injects its values so)."""
    return (
        f"{cls}: {name} cannot be injected by optax.inject_hyperparams (it came as a traced array): the step "
        "takes it as a constant (to pick a code path, or for arithmetic done once on the host, as Keras does). "
        "optax can inject "
        f"{', '.join(injectable)}; to sweep {name}, declare it {cls}({name}=varstate.optimizers.traced(...)) and "
        "step with apply_gradients or update (see the sweeps guide)."
    )

