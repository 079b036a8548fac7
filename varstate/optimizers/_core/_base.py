"""`Optimizer`: the base of TF-style optimizers as immutable configs with pure updates.

How a step runs (TF's `Optimizer.apply_gradients`, functionally): each param
leaf is paired with its gradient leaf; None gradients and non-trainable
Variables are skipped (`_matching`); a dense gradient goes to `_dense`, an
`IndexedSlices` to `_sparse` (after summing duplicate indices, as TF's
`_deduplicate_indexed_slices`, unless the subclass sets `_dedup = False`);
then `_finish` updates the non-slot variables once (Adam's beta powers).
`apply_gradients` runs that step jitted, with donation (`_step`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, ClassVar, Self

import jax
import jax.numpy as jnp
import numpy as np

from varstate._indexed_slices import IndexedSlices
from varstate._jax_compat import Tracer, in_transformation
from varstate._pack import Packed
from varstate._variable import Variable, owning_variable
from varstate.optimizers._core import _packed, _step, _traced
from varstate.optimizers._core._matching import (
    array_of,
    cast_like,
    flatten_grads,
    gradients_by_owner,
    is_var,
    owner_positions,
    with_value,
)
from varstate.optimizers._core._messages import check_arguments, checked_new, guarded_update, injected
from varstate.optimizers._core._rows import _dedupe
from varstate.optimizers._core._slots import (
    Existing,
    StateMismatchError,
    check_non_slots,
    check_slots,
    filled_slot,
    non_slot_home,
    param_want,
)
from varstate.optimizers._core._state import OptimizerState

Hyper = float | Callable[[Any], Any]  # a hyperparameter: a float or a callable of the step


@dataclasses.dataclass(frozen=True)
class Optimizer:
    """Base of all optimizers: an immutable, hashable config; state lives in `OptimizerState`.

    Public API:

    - ``init(params, state=None) -> OptimizerState``: creates slot Variables
      (named ``<primary>/<slot>``, linked to the primary by resource id, with
      its dtype and sharding) and non-slot Variables; given a `state`, keeps
      what it holds for these params and creates the rest. Call it outside jit.
    - ``update(grads, params, state, step=None, **extra_args) -> (params, state)``:
      the pure, un-jitted step; use it inside your own ``jax.jit`` (a wrapper
      such as a loss-scale optimizer calls this). The TF optimizers take no
      extra arguments (TypeError naming the first).
    - ``apply_gradients(grads, params, state, step=None, *, global_step=None,
      **extra_args)``: ``update`` under ``jax.jit`` with ``params`` and
      ``state`` donated; each config compiles once per structure (identities
      aside: a freshly built model of the same shapes reuses the step). With
      ``global_step`` it returns ``(params, state, global_step)``, the counter
      incremented in the same step.

    ``params`` is a pytree whose leaves are Variables or plain arrays. A plain
    array param is updated too; its slots are plain arrays (there is no
    resource to link a slot Variable to). ``grads`` has params' structure; a leaf is an array, a Variable,
    an `IndexedSlices` or None (skipped, as are non-trainable Variables).
    Hyperparameters are floats or callables ``f(step)``; a callable needs
    ``step=`` (e.g. the global step's value). A float declared
    `varstate.optimizers.traced` lives in the state instead
    (``state.hyperparameters``): it is no part of the config's equality, so
    one compiled step serves every value. Arithmetic runs in the
    variable's dtype with hyperparameters rounded to float32 first, as TF's
    kernels do. `IndexedSlices` indices are range-checked while concrete
    (``apply_gradients``, or ``update`` outside jit); inside a caller's jit
    out-of-range rows are dropped, as `Variable.scatter_add` does.

    Subclass contract (all on array values, inside the traced step):

    - ``_slot_inits() -> {slot name: fill value}`` and
      ``_non_slot_inits() -> {name: float32 initial value}``;
    - ``_dense(h, grad, var, slots, non_slots) -> (var, slots)`` and
      ``_sparse(h, values, indices, var, slots, non_slots) -> (var, slots)``
      where ``h`` maps hyperparameter names to resolved values, ``slots`` maps
      slot names to arrays; sparse indices are unique, padded with an
      out-of-range row (see `gather_rows` / `set_rows`), unless
      ``_dedup = False`` (then raw indices, duplicates included);
    - ``_finish(h, non_slots) -> non_slots`` runs once per step.

    A wrapper overrides ``init``/``update`` and delegates to an inner optimizer;
    its ``update`` raises the `StateMismatchError` of ``check_slots`` /
    ``check_non_slots`` (``_slots.py``) for state it lacks, and its ``init``
    takes ``state`` to create it, so ``apply_gradients`` can.

    >>> import jax.numpy as jnp, varstate
    >>> from varstate.optimizers import GradientDescent
    >>> w = varstate.Variable(jnp.array([1.0, 2.0]), name="w")
    >>> opt = GradientDescent(0.5)
    >>> state = opt.init({"w": w})
    >>> params, state = opt.apply_gradients({"w": jnp.array([1.0, 1.0])}, {"w": w}, state)
    >>> params["w"].value.tolist(), params["w"].resource_id == w.resource_id
    ([0.5, 1.5], True)
    """

    _dedup: ClassVar[bool] = True
    _hyper_names: ClassVar[tuple[str, ...]] = ()
    _step_floats: ClassVar[tuple[str, ...]] = ()  # float options the step reads besides _hyper_names (traceable)
    # Options besides _hyper_names that may be traced arrays (optax.inject_hyperparams builds the optimizer in its
    # jitted init/update with such values); any other option is a constant of the compiled step.
    _injectable: ClassVar[tuple[str, ...]] = ()
    _elementwise: ClassVar[bool] = True  # each element's update reads only that element: packed params may be stepped

    def __new__(cls, *args: Any, **kwargs: Any) -> Self:
        # A misspelled keyword (beta_1, lr) raises a TypeError naming the closest fields, not dataclass's bare one.
        # A method, not an assigned function: type checkers then check a call against the class's own __init__.
        return checked_new(cls, *args, **kwargs)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "update" in cls.__dict__:  # an override gets `guarded_update`'s message too (Optimizer's own below)
            cls.update = guarded_update(cls.__dict__["update"])  # type: ignore[method-assign]

    def __post_init__(self) -> None:
        traceable = self._traceable()
        for f in dataclasses.fields(self):
            if isinstance(getattr(self, f.name), Tracer) and f.name not in (*self._hyper_names, *self._injectable):
                raise TypeError(injected(type(self).__name__, f.name, self._hyper_names))
            if isinstance(getattr(self, f.name), _traced.Traced) and f.name not in traceable:
                raise TypeError(
                    f"{type(self).__name__}: {f.name} cannot be traced: only a float the step reads can "
                    f"({', '.join(traceable) or 'this optimizer has none'}); pass {f.name} as a plain value."
                )
        for name in self._hyper_names:
            x = getattr(self, name)
            # A tracer: optax.inject_hyperparams builds the optimizer inside its jitted init/update. Such an
            # optimizer steps through `update` and `to_optax`; it cannot be a static jit argument (apply_gradients).
            if callable(x) or isinstance(x, Tracer | _traced.Traced):
                continue
            # Arrays are unhashable; a config must be a static jit argument.
            try:
                x = float(np.asarray(x))
            except (TypeError, ValueError):
                raise TypeError(
                    f"{type(self).__name__}: {name} must be a float or a callable of the step, "
                    f"got {type(x).__name__} {x!r:.40}."
                ) from None
            object.__setattr__(self, name, x)

    @classmethod
    def _traceable(cls) -> tuple[str, ...]:
        """The fields that may be `traced`: the float hyperparameters the step reads."""
        return (*cls._hyper_names, *cls._step_floats)

    def _held_elsewhere(self) -> tuple[str, ...]:
        """Traced fields whose value the state holds otherwise than as a traced entry (Keras's learning rate)."""
        return ()

    def _compile_key(self) -> Optimizer:
        """The config that keys the compiled step: `self`, or one equal in effect that leaves out values the state
        holds (Keras's float learning rate)."""
        return self

    # --- subclass hooks -------------------------------------------------
    def _slot_inits(self) -> dict[str, float]:
        return {}

    def _slot_layout(self, name: str, p: Any) -> tuple:
        """(shape, dtype, the param axis each slot dimension follows or None) of the slot `name` of param `p`.

        The param's own shape and dtype (None: split as the param is), as TF's
        slots are; an optimizer with slots shaped otherwise (Adafactor's row and
        column means) overrides it, for slot creation and every shape check.
        """
        return (*param_want(p), None)

    def _non_slot_inits(self) -> dict[str, float]:
        return {}

    def _dense(self, h, grad, var, slots, non_slots):
        raise NotImplementedError

    def _sparse(self, h, values, indices, var, slots, non_slots):
        raise NotImplementedError

    def _finish(self, h, non_slots):
        return non_slots

    # --- public API -----------------------------------------------------
    def init(self, params: Any, state: OptimizerState | None = None, *, stepped: Any = None,
             fused: bool | None = None, reinitialize_slots: bool = False) -> OptimizerState:
        """Slots for every trainable param and the non-slot variables (call outside jit).

        With `state`, keeps the state's slots for these params (found by the
        primary's identity; a plain-array param's by position) and its
        non-slots, and creates the missing ones with their initial values, as
        TF's optimizers create a slot only where none exists. `apply_gradients`
        does this itself when params arrive without state (a grown model); a
        caller of `update` under its own jit calls it first. A state that holds
        slots of other Variables (not among `params`) while a param has none is
        refused: it was built or loaded for other Variables (a model rebuilt
        after a restore), and fresh slots would silently drop it; pass
        ``reinitialize_slots=True`` to make them anyway.

        A param marked not stepped gets no slots (None in ``state.slots``)
        until a step gives it a gradient; then `apply_gradients` creates them
        with their initial values, as TF does. So a TF checkpoint in which
        some variables never got a gradient restores into
        ``opt.init(params, stepped=...)`` with every slot matched.

        A fused state packs the slots of small params (up to 4,096 elements,
        trainable, on one device or replicated) into one buffer per dtype and
        sharding, and each step updates a buffer with one computation: for
        many small tensors that is several times faster
        (``benchmarks/optimizers.py``), with the unfused step's numbers
        (within one ulp of each array's largest element per step: XLA may
        vectorise the two loops differently). Everything else still sees
        per-variable slots (``state.slots``, `get_slot`, checkpoint keys,
        restore).

        Args:
            params: a pytree whose leaves are Variables or plain arrays.
            state: an existing state whose slots (found by the primary's
                identity; a plain-array param's by position) and non-slots
                are kept; None creates everything.
            stepped: which params have been stepped, as TF creates a slot only
                for a variable that gets a gradient: a pytree of bools with the
                structure of params (or a prefix of it: one bool for a
                subtree), or a callable of a param's path (its keys joined by
                ``/``, e.g. ``"dense/kernel"``) returning a bool. None: every
                trainable param.
            fused: True packs slots as described above; None keeps the given
                state's layout, else unfused.
            reinitialize_slots: True makes fresh slots (initial values) for
                params without slots in `state` even where `state` holds slots
                of other Variables (those are then left out); False refuses.

        Returns:
            The `OptimizerState`, with slots named ``<primary name>/<slot>``, linked
            to their primary, with its dtype and sharding.

        Raises:
            ValueError: a kept slot's shape or dtype does not fit its param
                (naming both), a param is uninitialized, a plain-array
                param stands where the state holds a Variable's slots, or a
                param has no slot while `state` holds slots of other Variables
                (naming both, unless ``reinitialize_slots=True``).
            TypeError: a `stepped` leaf is not a bool.

        >>> import jax.numpy as jnp, varstate
        >>> from varstate.optimizers import Momentum
        >>> w = varstate.Variable(jnp.zeros(2), name="dense/kernel")
        >>> state = Momentum(0.1, momentum=0.9).init([w])
        >>> state.slots["momentum"][0].name
        'dense/kernel/momentum'
        >>> b = varstate.Variable(jnp.zeros(3), name="dense/bias")
        >>> grown = Momentum(0.1, momentum=0.9).init([w, b], state)
        >>> grown.get_slot(w, "momentum") is state.get_slot(w, "momentum"), grown.get_slot(b, "momentum").name
        (True, 'dense/bias/momentum')
        >>> fresh = Momentum(0.1, momentum=0.9).init({"w": w, "b": b}, stepped={"w": True, "b": False})
        >>> fresh.get_slot(b, "momentum") is None, fresh.slots["momentum"]["b"]
        (True, None)
        """
        check_arguments(self, "init", params, state=state)
        if isinstance(params, Packed):
            return self._init_packed(params, state, stepped, reinitialize_slots)
        flat, p_def = jax.tree_util.tree_flatten_with_path(params, is_leaf=lambda x: is_var(x) or isinstance(x, Packed))
        if any(isinstance(x, Packed) for _, x in flat):
            raise TypeError(
                f"{type(self).__name__}.init: params hold a Packed (varstate.pack) inside other containers; a Packed "
                "must be the whole params (its buffers are stepped as they are laid out): pack the whole tree, or "
                "step the packed part and the rest with two states."
            )
        leaves, paths = [x for _, x in flat], [p for p, _ in flat]
        owners = owner_positions(leaves)
        existing = Existing(state, p_def, paths)
        wanted = _stepped_mask(stepped, params, paths, owners)
        slots = {}
        for slot_name, fill in self._slot_inits().items():
            made: list[Any] = []
            for i, p in enumerate(leaves):
                if isinstance(p, Variable) and not p.trainable:
                    made.append(None)
                elif owners[i] != i:  # a shared variable (tied weights): one slot, at every place
                    made.append(made[owners[i]])
                else:
                    layout = self._slot_layout(slot_name, p)
                    kept = existing.get(slot_name, i, p, layout[:2])
                    if kept is None and wanted[i]:
                        if not reinitialize_slots:
                            existing.refuse_foreign(slot_name, i, p, leaves)
                        kept = filled_slot(p, slot_name, fill, f"{type(self).__name__}.init", layout)
                    made.append(kept)  # None: not stepped yet, so no slot (TF makes none either)
            slots[slot_name] = p_def.unflatten(made)
        if state is not None:
            for name in existing.names:  # another optimizer's slots: carried as they are
                slots.setdefault(name, state.slots[name])
        non_slots = dict(existing.non_slots)
        registry, placement = non_slot_home(leaves)
        for name, initial in self._non_slot_inits().items():
            if name not in non_slots:
                value = jnp.asarray(float(initial), jnp.float32, device=placement)  # float(): a `Traced` too
                non_slots[name] = owning_variable(value, name=name, trainable=False, registry=registry)
        held = {} if state is None else dict(state._traced)
        for name in _traced.traced_names(self):  # a value the state already holds is kept, as a slot is
            if name not in held:
                held[name] = jax.device_put(_traced.entry(getattr(self, name).value, name), placement)
        if fused is None:
            fused = state is not None and state.fused
        names = list(self._slot_inits())
        if not fused or not names:
            return OptimizerState(slots, non_slots, None, held)
        stored, packed = _packed.pack(slots, names, leaves, p_def, owners)
        return OptimizerState(stored, non_slots, packed, held)

    def hyperparameters(self, step: Any = None) -> dict[str, Any]:
        """Hyperparameter values at `step` (callables are called with it).

        A traced hyperparameter's entry is its `traced` marker: its value is
        the state's (``state.hyperparameters``).

        Args:
            step: the step a callable hyperparameter is called with; None when
                none is callable.

        Returns:
            ``{hyperparameter name: value}``.

        Raises:
            TypeError: a hyperparameter is callable and `step` is None.

        >>> from varstate.optimizers import GradientDescent
        >>> GradientDescent(lambda step: 0.1 / (1 + step)).hyperparameters(step=1)["learning_rate"]
        0.05
        """
        out = {}
        for name in self._hyper_names:
            x = getattr(self, name)
            if callable(x):
                if step is None:
                    raise TypeError(
                        f"{type(self).__name__}.{name} is a callable of the step, but no step was given: "
                        "pass step= to apply_gradients/update (e.g. step=global_step.value)."
                    )
                x = x(step)
            out[name] = x
        return out

    def update(
        self, grads: Any, params: Any, state: OptimizerState, step: Any = None, **extra_args: Any
    ) -> tuple[Any, OptimizerState]:
        """One pure step (no jit, no donation): returns new params and state.

        Use it inside your own ``jax.jit``; slots must exist already (`init`).

        Args:
            grads: the gradients, with params' structure; a leaf is an array,
                a Variable, an `IndexedSlices` or None (that param is skipped).
            params: a pytree whose leaves are Variables or plain arrays.
            state: the `OptimizerState` made by `init` for these params.
            step: the step for hyperparameters that are callables of it (a
                Variable is read); None if none is.
            **extra_args: for optimizers whose step needs more inputs (an
                optax transformation's ``value=``).

        Returns:
            ``(params, state)``, new versions with the given identities.

        Raises:
            TypeError: extra arguments to an optimizer that takes none (the
                built-in TF optimizers), naming the first; a callable
                hyperparameter without `step`.
            ValueError: `state` lacks slots or non-slots for these params
                (`init` them first; `apply_gradients` does).

        >>> import jax, jax.numpy as jnp
        >>> from varstate.optimizers import GradientDescent
        >>> opt = GradientDescent(0.1)
        >>> p = {"w": jnp.ones(2)}
        >>> new_p, _ = jax.jit(opt.update)({"w": jnp.ones(2)}, p, opt.init(p))
        >>> new_p["w"].tolist()
        [0.8999999761581421, 0.8999999761581421]
        """
        check_arguments(self, "update", params, grads, state)
        if extra_args:
            self._refuse_extra_args(extra_args)
        if isinstance(params, Packed):
            if not _packed.packed_like(state, params):
                raise StateMismatchError(
                    f"{type(self).__name__}.update: params are packed (varstate.pack) but the state's slots are not "
                    "packed as they are: make it with opt.init(packed) (apply_gradients converts it; inside your own "
                    "jit, call `state = opt.init(packed, state)` first, outside jit)."
                )
            return _packed.packed_update(self.update, grads, params, state, step, extra_args)
        p_leaves, g_leaves, p_def, paths = flatten_grads(grads, params)
        owners = owner_positions(p_leaves)
        slot_names = list(self._slot_inits())
        work = gradients_by_owner(p_leaves, g_leaves, paths, owners)

        def want(i, n, slot):  # every trainable param has its slots (init's rule), except one never stepped
            p = p_leaves[i]
            # Without a gradient now, a param without slots (init's stepped=False) keeps none.
            if (isinstance(p, Variable) and not p.trainable) or (i not in work and slot is None):
                return None
            return self._slot_layout(n, p)[:2]

        slot_leaves = check_slots(state, slot_names, p_leaves, p_def, paths, owners, want)
        check_non_slots(state, self._non_slot_inits())
        opt = self._bound(state)
        non_slots = {k: v._value for k, v in state.non_slots.items()}
        if isinstance(step, Variable):
            step = step.read_value()
        h = opt.hyperparameters(step)
        new_p = list(p_leaves)
        new_slots = {n: list(slot_leaves[n]) for n in slot_names}
        for i, g in work.items():
            p = p_leaves[i]
            var = array_of(p)
            slots = {n: array_of(slot_leaves[n][i]) for n in slot_names}
            if isinstance(g, IndexedSlices):
                values, indices = g.values, g.indices
                if self._dedup:
                    values, indices = _dedupe(values, indices, var.shape[0])
                var, slots = opt._sparse(h, values, indices, var, slots, non_slots)
            else:
                var, slots = opt._dense(h, g, var, slots, non_slots)
            new_p[i] = with_value(p, cast_like(var, array_of(p)))
            for n in slot_names:
                new_slots[n][i] = with_value(slot_leaves[n][i], cast_like(slots[n], array_of(p)))
        for j, i in enumerate(owners):
            if i != j and i in work:
                new_p[j] = new_p[i]
                for n in slot_names:
                    new_slots[n][j] = new_slots[n][i]
        non_slots = opt._finish(h, non_slots)
        # Slots of another optimizer's (kept by init(params, state)) pass through untouched; a fused state packs
        # the new slots into its buffers (`OptimizerState.replace`).
        return p_def.unflatten(new_p), state.replace(
            slots={**state.slots, **{n: p_def.unflatten(new_slots[n]) for n in slot_names}},
            non_slots={k: v._with_value(non_slots[k]) for k, v in state.non_slots.items()},
        )

    def apply_gradients(
        self, grads: Any, params: Any, state: OptimizerState, step: Any = None, *, global_step: Any = None,
        reinitialize_slots: bool = False, **extra_args: Any,
    ) -> tuple:
        """`update` under jit with `params` and `state` donated (their old buffers are deleted).

        Returns ``(params, state)``; with ``global_step=`` (the global step
        Variable, `varstate.get_or_create_global_step()`) it also increments
        that counter by one in the same jitted step and returns
        ``(params, state, global_step)``, as TF v1's
        ``apply_gradients(global_step=...)`` does (the given version is donated
        too). Unless ``step=`` is given, hyperparameters that are callables of
        the step then see the global step's value before the increment.
        `extra_args` (e.g. ``value=loss``) reach `update` as traced arguments.

        The jit runs over the arrays only; its key is the structure without
        identity, so a freshly built model with the same structure and shapes
        reuses the compiled step, and the outputs get the caller's identities.

        Every new param, and its slots, keeps the param's sharding whatever
        the gradient's (TF updates a variable on its device; the donated
        buffers are then reused). Params without state (a grown model, a
        param never stepped, a state made by another optimizer) get their
        slots and non-slots created with initial values first, outside jit
        (`init(params, state)`), as TF's optimizers create missing slots; but
        a state holding slots of other Variables (a model rebuilt after a
        restore) raises, unless ``reinitialize_slots=True``. Reading a version
        given to a step raises `varstate.DonatedVariableError`: use the
        returned ones.

        Args:
            grads: the gradients, as for `update`.
            params: the params pytree; donated.
            state: the `OptimizerState`; donated. One lacking slots for some
                params is completed with `init` first.
            step: the step for callable hyperparameters (default: the global
                step's value when `global_step` is given).
            global_step: the global step Variable to increment, or None.
            reinitialize_slots: as `init`'s: True gives params without slots
                fresh ones even where `state` holds other Variables' slots.
            **extra_args: passed to `update` as traced arguments.

        Returns:
            ``(params, state)``, or ``(params, state, global_step)`` with
            `global_step`.

        Raises:
            TypeError: as `update`.
            ValueError: a param that was a Variable when `state` was made is
                a plain array now (its slots would be lost); keep the
                Variable (`v.assign(...)`, `varstate.with_values`). A param
                has no slot while `state` holds slots of other Variables
                (naming both; see `init`).

        >>> import jax.numpy as jnp, varstate
        >>> from varstate.optimizers import Adam
        >>> w = varstate.Variable(jnp.zeros(3), name="w")
        >>> opt = Adam(0.1)
        >>> state = opt.init([w])
        >>> (w,), state = opt.apply_gradients([jnp.ones(3)], [w], state)
        >>> [round(x, 4) for x in w.value.tolist()], round(state.non_slot("beta1_power").value.item(), 4)
        ([-0.1, -0.1, -0.1], 0.81)
        >>> gs = varstate.get_or_create_global_step(varstate.Registry())
        >>> (w,), state, gs = opt.apply_gradients([jnp.ones(3)], [w], state, global_step=gs)
        >>> int(gs.value)
        1
        """
        check_arguments(self, "apply_gradients", params, grads, state)
        if isinstance(params, Packed):
            _packed.check_packed_grads(grads, params)  # before the trace: nothing donated
        if extra_args and type(self).update is Optimizer.update:
            self._refuse_extra_args(extra_args)  # before the trace: nothing donated, no JAX frames in the message
        try:
            return _step.apply_jitted(self, grads, params, state, step, global_step, extra_args)
        except StateMismatchError:
            if in_transformation():
                raise  # under a caller's trace no Variable can be made; the message says what to do
        # Params without state: created outside jit, as TF's optimizers create missing slots; then the step.
        state = self.init(params, state, reinitialize_slots=reinitialize_slots)
        return _step.apply_jitted(self, grads, params, state, step, global_step, extra_args)

    def _init_packed(self, params: Packed, state: OptimizerState | None, stepped: Any,
                     reinitialize_slots: bool) -> OptimizerState:
        """`init` for packed params: the slots of the packed ones in buffers laid out as the param buffers."""
        if stepped is not None:
            raise TypeError(f"{type(self).__name__}.init: packed params (varstate.pack) are all stepped together "
                            "(one computation per buffer): stepped= does not apply; pass it for unpacked params.")
        made = self.init(params.unpack(), state, fused=False, reinitialize_slots=reinitialize_slots)
        names = [n for n in self._slot_inits() if n in made._stored]
        stored, packed = _packed.pack_as(made._stored, names, params)
        return OptimizerState(stored, made.non_slots, packed, made._traced)

    def _bound(self, state: OptimizerState) -> Self:
        """This optimizer as its step runs it: traced fields read from `state` (`_traced.bind`); else itself."""
        names = _traced.traced_names(self)
        if not names:
            return self
        missing = [n for n in names if n not in state._traced]
        if missing:
            raise StateMismatchError(
                f"{type(self).__name__}.update: the state holds no value of the traced hyperparameter {missing[0]!r} "
                f"(it holds {sorted(state._traced)}): it was made for an optimizer without it. apply_gradients adds "
                "it; inside your own jit, call `state = opt.init(params, state)` (or opt.with_hyperparameters(state, "
                f"{missing[0]}=...)) first."
            )
        return _traced.bind(self, state._traced)

    def with_hyperparameters(self, state: OptimizerState, **values: Any) -> OptimizerState:
        """`state` with new values of this optimizer's traced hyperparameters (adding any the state lacks).

        As `OptimizerState.with_hyperparameters`, checked against this
        optimizer: a name must be one of its traced hyperparameters (or
        Keras's ``learning_rate``).

        Args:
            state: the state to change (it is unchanged).
            **values: ``name=value``; a float, an array (a stacked state's:
                one value per run) or a traced value.

        Returns:
            The new `OptimizerState`.

        Raises:
            TypeError: a name that is not a traced hyperparameter of this
                optimizer (the message says how to declare it), or a value
                that is not a real number.
            ValueError: a number the constructor refuses (Ftrl's
                ``learning_rate`` must be positive), or a value shaped
                unlike the one it replaces.

        >>> import jax.numpy as jnp
        >>> from varstate.optimizers import Adam, traced
        >>> opt = Adam(traced(0.1), beta1=traced(0.9))
        >>> state = opt.with_hyperparameters(opt.init([jnp.zeros(2)]), beta1=0.5)
        >>> float(state.hyperparameters["beta1"])
        0.5
        """
        cls = type(self).__name__
        traced = _traced.traced_names(self)
        for name in values:
            if name in traced or name in self._held_elsewhere():
                continue
            if name in self._traceable():
                raise TypeError(
                    f"{cls}.with_hyperparameters: {name} is static in this {cls} (a float compiled into the step); "
                    f"declare it traced to change it without a new compile: {cls}({name}="
                    f"varstate.optimizers.traced({getattr(self, name)!r}))."
                )
            raise TypeError(
                f"{cls}.with_hyperparameters: {cls} has no hyperparameter {name!r}; those that can be traced are "
                f"{list(self._traceable())}."
            )
        numbers = {n: _traced.traced(float(v)) for n, v in values.items()
                   if n in traced and isinstance(v, int | float | np.floating | np.integer) and not isinstance(v, bool)}
        if numbers:  # the constructor's range checks (Ftrl's learning_rate > 0...), on a copy holding the new values
            dataclasses.replace(self, **numbers)
        added = {n: _traced.entry(values[n], f"{cls}.with_hyperparameters({n}=...)")
                 for n in traced if n in values and n not in state._traced}
        if added:
            state = OptimizerState(state._stored, state.non_slots, state.packed, {**state._traced, **added})
        return state.with_hyperparameters(**{k: v for k, v in values.items() if k not in added})

    def _refuse_extra_args(self, extra_args: dict) -> None:
        """TypeError naming the first extra argument: the TF optimizers' update takes none."""
        name = type(self).__name__
        raise TypeError(
            f"{name}.update() got an unexpected keyword argument {next(iter(extra_args))!r}: {name} takes grads, "
            "params, state and step only (extra keyword arguments of apply_gradients/update are for optimizers "
            "whose update accepts them, e.g. from_optax)."
        )

    def to_optax(self) -> Any:
        """This optimizer as an optax ``GradientTransformationExtraArgs`` with TF's numerics.

        Its state is a pytree of arrays (no Variables); its ``update`` takes
        ``step=`` where a hyperparameter is a callable of the step.

        Returns:
            The optax transformation.

        >>> import jax.numpy as jnp, optax
        >>> from varstate.optimizers import GradientDescent
        >>> tx = GradientDescent(0.5).to_optax()
        >>> params = {"w": jnp.array([1.0, 2.0])}
        >>> updates, _ = tx.update({"w": jnp.array([1.0, 1.0])}, tx.init(params), params)
        >>> optax.apply_updates(params, updates)["w"].tolist()
        [0.5, 1.5]
        """
        from varstate.optimizers._to_optax import to_optax

        return to_optax(self)


# optax's two-argument habit, update(grads, state), gets a message naming the class and the fix.
Optimizer.update = guarded_update(Optimizer.update)  # type: ignore[method-assign]


def _path_name(path: tuple) -> str:
    """A param's key path as ``stepped=``'s callable sees it: its keys joined by ``/`` (``dense/kernel``)."""
    return jax.tree_util.keystr(path, simple=True, separator="/")


def _stepped_mask(stepped: Any, params: Any, paths: list, owners: list[int]) -> list[bool]:
    """`init`'s ``stepped=`` as one bool per param leaf (True: make its slots)."""
    if stepped is None:
        return [True] * len(paths)
    if callable(stepped):
        flags = [stepped(_path_name(path)) for path in paths]
        where = [f"stepped({_path_name(path)!r})" for path in paths]
    else:
        is_flag = lambda x: isinstance(x, (bool, np.bool_))
        m_leaves, m_def = jax.tree_util.tree_flatten(stepped, is_leaf=is_flag)
        try:
            subtrees = m_def.flatten_up_to(params)
        except (ValueError, TypeError):
            raise ValueError(
                f"Optimizer.init: stepped= must be a pytree of bools with the structure of params (or a prefix "
                f"of it), or a callable of a param's path; got {type(stepped).__name__} with structure {m_def}, "
                f"params have {jax.tree_util.tree_structure(params, is_leaf=is_var)}."
            ) from None
        flags = [m for m, sub in zip(m_leaves, subtrees, strict=True) for _ in jax.tree.leaves(sub, is_leaf=is_var)]
        where = [f"stepped{jax.tree_util.keystr(path)}" for path in paths]
    for f, w in zip(flags, where, strict=True):
        if not isinstance(f, (bool, np.bool_)):
            raise TypeError(f"Optimizer.init: {w} must be a bool (True: the param has been stepped), "
                            f"got {type(f).__name__} {f!r:.40}.")
    flags = [bool(f) for f in flags]
    for j, i in enumerate(owners):  # tied weights share one slot: it exists if any place was stepped
        flags[i] = flags[i] or flags[j]
    return flags
