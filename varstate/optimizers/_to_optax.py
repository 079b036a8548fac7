"""`to_optax`: any varstate optimizer as an optax ``GradientTransformation`` with TF's numerics inside."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, NamedTuple

import jax
import jax.core
import jax.numpy as jnp
import numpy as np

from varstate._jax_compat import Tracer
from varstate._registry import Registry
from varstate._variable import Variable, owning_variable
from varstate.optimizers._core import _traced
from varstate.optimizers._core._matching import array_of, is_var, with_value
from varstate.optimizers._core._slots import replicated_home
from varstate.optimizers._core._state import OptimizerState

if TYPE_CHECKING:
    # Not imported at run time: Optimizer.to_optax imports this module (an import cycle otherwise). Optimizers
    # whose initial state is not made of constants (from_optax, LossScaleOptimizer) say so by `_initial_arrays`.
    from varstate.optimizers._core._base import Optimizer


def _a(kind: str) -> str:
    return f"{'an' if kind[:1] in 'AEIOUaeiou' else 'a'} {kind}"


class TFOptimizerState(NamedTuple):
    """The optax state of `to_optax`: arrays only (TF's variables without their identities).

    count:     int32, the steps taken (the ``step`` a callable hyperparameter sees).
    slots:     {slot name: tree with the params' structure}, e.g. Adam's ``m`` and ``v``.
    non_slots: {name: array}, e.g. Adam's ``beta1_power``.
    """

    count: Any
    slots: dict[str, Any]
    non_slots: dict[str, Any]


def _initial(opt: Optimizer, leaves: list) -> tuple[dict[str, list], dict[str, Any]]:
    """`opt`'s initial slots (lists, one entry per leaf) and non-slots (arrays), traceable.

    `Optimizer.init` makes Variables, which cannot be made under a trace
    (``jax.jit(tx.init)``, ``jax.eval_shape(tx.init, ...)``, as orbax restores
    do, or ``optax.inject_hyperparams``, which builds the optimizer with traced
    hyperparameters). Hosted optax state is computed by the transformation
    itself; every other optimizer's initial state depends on the params'
    shapes and dtypes only (TF fills slots with constants), so it is made
    outside the trace from zeros of those shapes (and checked against ones: a
    slot that copies the params is an error there), by a copy of `opt` whose
    traced hyperparameters are stand-in floats; an initial value that is one
    of them (Keras's ``learning_rate`` variable) is then the traced value.
    """
    hook = getattr(opt, "_initial_arrays", None)
    if hook is not None:
        return hook(leaves, _initial)
    traced = {f.name: f for f in dataclasses.fields(opt) if isinstance(getattr(opt, f.name), Tracer)}
    if not traced and not any(isinstance(x, Tracer) for x in leaves):
        return _arrays(opt.init(leaves))
    # The stand-in: the field's default where it is a float (passes the constructor's checks), else 0.5.
    twin = dataclasses.replace(opt, **{
        name: f.default if isinstance(f.default, float) else 0.5 for name, f in traced.items()})
    with jax.core.eval_context():
        made = [_arrays(twin.init([jnp.full(x.shape, fill, x.dtype) for x in leaves])) for fill in (0, 1)]
    if not all(jax.tree.leaves(jax.tree.map(lambda a, b: np.array_equal(np.asarray(a), np.asarray(b)), *made))):
        raise ValueError(
            f"to_optax({type(opt).__name__}).init under jax.jit or jax.eval_shape: this optimizer's initial state "
            "depends on the params' values (a slot copies them), which a trace does not have. Call tx.init(params) "
            "outside jit."
        )
    slots, non_slots = made[0]
    for name, fill in opt._slot_inits().items():
        if isinstance(fill, Tracer):
            slots[name] = [None if s is None else jnp.full(s.shape, fill, s.dtype) for s in slots[name]]
    for name, value in opt._non_slot_inits().items():
        if isinstance(value, Tracer):
            non_slots[name] = jnp.asarray(value, non_slots[name].dtype)
    return slots, non_slots


def _home(leaves: list) -> Any:
    """Where an eager init puts the step count and the non-slots: replicated over the first param's placement
    when that is committed (so a jitted step's inputs are all committed from its first call, and its second call
    finds them as the first left them); None when it is not (jit's outputs then stay uncommitted too)."""
    first = next((x for x in leaves if isinstance(x, jax.Array) and not isinstance(x, Tracer)), None)
    return None if first is None else replicated_home(first)


def _placed(x: Any, home: Any) -> Any:
    if home is None or isinstance(x, Tracer) or getattr(x, "committed", True):
        return x
    return jax.device_put(x, home)


def _takes_extra_args(opt: Optimizer) -> bool:
    """Whether `opt.update` takes keyword arguments beyond ``step`` (a hosted optax transformation does, TF's
    optimizers refuse them): optax's rule is that a transformation ignores the extra arguments it has no use for."""
    inner = getattr(opt, "inner_optimizer", None)  # LossScaleOptimizer passes them on
    # from_optax's optimizer holds its transformation as `tx` (not isinstance: _optax imports the base, which
    # imports this module).
    return _takes_extra_args(inner) if inner is not None else hasattr(opt, "tx")


def _arrays(state: OptimizerState) -> tuple[dict[str, list], dict[str, Any]]:
    return ({name: [array_of(s) for s in tree] for name, tree in state.slots.items()},
            {name: v.value for name, v in state.non_slots.items()})


def to_optax(opt: Optimizer) -> Any:
    """`opt` as an optax ``GradientTransformationExtraArgs``: ``init(params)``, ``update(grads, state, params)``.

    The step is `opt.update` (TF's numerics, slot for slot); the state is a
    `TFOptimizerState` of arrays, so it checkpoints as any optax state (orbax,
    or `checkpoint.Checkpoint` as a pytree). It works wherever optax does:
    `optax.chain`, `flax.nnx.Optimizer` (``wrt=nnx.Param``), a train step
    under ``jax.jit``, ``optax.MultiSteps``. Of the keyword arguments of
    ``update`` beyond ``params``, ``step=`` is the step a callable
    hyperparameter sees (default: the state's ``count``); the others
    (``value=`` ...) reach ``opt.update`` where it takes them (a transformation
    hosted by `from_optax`) and are ignored elsewhere, as optax's rule for
    extra arguments is. ``init`` may run under ``jax.jit`` or
    ``jax.eval_shape``; run eagerly, it makes the count and non-slots where
    the params are (uncommitted for uncommitted params), so a jitted step
    compiles once. optax's own generic optimizer tests (its ``AliasTest``)
    pass; ``tests/varstate/optimizers/test_optax_alias.py`` runs them and
    names the cases that do not apply.

    What differs from ``opt.apply_gradients``:

    - optax returns updates, ``new - old``, which the caller adds back
      (``optax.apply_updates``): one subtraction and one addition more. When
      each new value is within a factor of two of the old one (same sign, as
      for any step that changes a weight by less than half of it) the
      subtraction is exact (Sterbenz's lemma) and ``old + (new - old)`` is
      ``new``: under ``jax.jit`` (as ``apply_gradients`` runs) the params
      are bitwise those of ``apply_gradients``. A step that crosses zero or
      more than halves or doubles a value can differ by the rounding of
      ``new - old`` (half an ulp of ``|new - old|``) plus the addition's.
      Run eagerly, op by op, the step itself rounds where the jitted one
      fuses (an ulp or so), as any JAX code does.
    - the params are plain arrays (a varstate Variable is read; its update is
      a Variable of the same resource, as ``jax.grad`` returns): no slot
      Variables, no identity links and no donation.
    - a None gradient leaves its param and slots unchanged (update zero), as TF does.
    - ``params`` is required: TF's optimizers compute each new value from the old one.

    >>> import jax.numpy as jnp, optax
    >>> from varstate.optimizers import Adam
    >>> from varstate.optimizers._to_optax import to_optax
    >>> tx = to_optax(Adam(0.1))
    >>> params = {"w": jnp.array([1.0, 2.0])}
    >>> state = tx.init(params)
    >>> sorted(state.slots), sorted(state.non_slots)
    (['m', 'v'], ['beta1_power', 'beta2_power'])
    >>> updates, state = tx.update({"w": jnp.array([0.5, -1.0])}, state, params)
    >>> [round(x, 4) for x in optax.apply_updates(params, updates)["w"].tolist()]
    [0.9, 2.1]
    """
    import optax  # optional dependency: needed only here

    if not hasattr(opt, "apply_gradients"):  # what optax transformations lack (not isinstance: see the imports)
        hint = (" It is an optax transformation already." if hasattr(opt, "init") and hasattr(opt, "update")
                else "")
        raise TypeError(
            f"to_optax: expected a varstate.optimizers.Optimizer (e.g. Adam(1e-3)), got {type(opt).__name__}.{hint}"
        )
    if _traced.traced_names(opt):
        raise TypeError(
            f"to_optax({type(opt).__name__}): {list(_traced.traced_names(opt))} are traced, which lives in an "
            "OptimizerState (apply_gradients/update); optax's way is optax.inject_hyperparams, e.g. "
            "optax.inject_hyperparams(lambda learning_rate: Adam(learning_rate).to_optax())(learning_rate=0.01)."
        )
    takes_extra_args = _takes_extra_args(opt)
    registry = Registry()  # the non-slot stand-ins' names stay out of the caller's registries
    held: dict[tuple, Variable] = {}

    def stand_in(name: str, value: Any) -> Variable:
        # opt.update takes non-slots as Variables; one per (name, type), made outside any trace, then re-valued.
        key = (name, tuple(value.shape), jnp.dtype(value.dtype))
        if key not in held:
            with jax.core.eval_context():
                held[key] = owning_variable(jnp.zeros(key[1], key[2]), name=name, trainable=False, registry=registry)
        return held[key]._with_value(value)

    def init(params: Any) -> TFOptimizerState:
        leaves, treedef = jax.tree.flatten(params, is_leaf=is_var)
        arrays = [array_of(x) for x in leaves]
        slots, non_slots = _initial(opt, arrays)
        home = _home(arrays)
        return TFOptimizerState(
            count=_placed(jnp.zeros((), jnp.int32), home),
            slots={name: treedef.unflatten(made) for name, made in slots.items()},
            non_slots={name: _placed(value, home) for name, value in non_slots.items()},
        )

    def update(updates: Any, state: TFOptimizerState, params: Any = None, **extra_args: Any) -> tuple[Any, Any]:
        if not isinstance(state, TFOptimizerState):
            made_by = (f" (an OptimizerState is {type(opt).__name__}.init's, for apply_gradients and update)"
                       if isinstance(state, OptimizerState) else "")
            raise TypeError(
                f"to_optax({type(opt).__name__}).update: state is {_a(type(state).__name__)}{made_by}; the optax form "
                "takes the state its own init makes: opt_state = tx.init(params), then the one each update returns."
            )
        if params is None:
            raise ValueError(
                f"to_optax({type(opt).__name__}).update needs params (optax's third argument): TF's optimizers "
                "compute each new value from the old one. Call tx.update(grads, state, params)."
            )
        p_vars, treedef = jax.tree.flatten(params, is_leaf=is_var)
        old = [array_of(x) for x in p_vars]
        grads = treedef.flatten_up_to(updates)
        given = OptimizerState(
            slots={name: treedef.flatten_up_to(tree) for name, tree in state.slots.items()},
            non_slots={name: stand_in(name, value) for name, value in state.non_slots.items()},
        )
        step = extra_args.pop("step", state.count)
        new, new_state = opt.update(grads, old, given, step, **(extra_args if takes_extra_args else {}))
        deltas = [with_value(p, n - o) for p, n, o in zip(p_vars, new, old, strict=True)]
        out = TFOptimizerState(
            count=state.count + 1,
            slots={name: treedef.unflatten([array_of(s) for s in made]) for name, made in new_state.slots.items()},
            non_slots={name: v._value for name, v in new_state.non_slots.items()},
        )
        return treedef.unflatten(deltas), out

    return optax.GradientTransformationExtraArgs(init, update)
