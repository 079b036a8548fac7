"""The base of Keras 3's optimizers: an ``iteration`` counter, a ``learning_rate`` variable, weight decay.

Keras keeps its step count in an int64 variable ``iteration`` (held here as
JAX's widest integer and saved as int64, as the global step is) and a float
learning rate in a float32 variable ``learning_rate``; both are non-slot
variables of the state, so a restored Keras checkpoint brings its learning
rate with it, as Keras's own restore does. A callable learning rate (a
schedule) is called with ``iteration`` and then there is no
``learning_rate`` variable, as in Keras.

Numerics follow Keras's TF backend op by op: a Python-float constant such as
``1 - beta_1`` is computed in double precision and rounded once to the
variable's dtype (Keras passes the Python float to the op), while a value
Keras first casts to a tensor (``ops.cast(beta_1, dtype)``) takes part in
float32 arithmetic. Sparse gradients keep Keras's rules for its TF backend:
an element-wise op of an `IndexedSlices` with a scalar stays sparse (on the
raw rows, duplicates included), an op with a dense tensor first sums the
rows into a dense tensor, and an update of a variable by sparse rows is a
scatter in which duplicates accumulate one after another.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from varstate._global_step import int64_counter
from varstate._jax_compat import Tracer
from varstate._variable import Variable
from varstate.optimizers._core._base import Hyper, Optimizer
from varstate.optimizers._core._matching import is_var
from varstate.optimizers._core._messages import check_arguments
from varstate.optimizers._core._rows import Array, as_dtype
from varstate.optimizers._core._slots import check_non_slots, filled_slot, non_slot_home
from varstate.optimizers._core._state import OptimizerState
from varstate.optimizers._core._traced import Live, Traced, varies


def const(x: float, dtype: Any) -> Array:
    """A Python float as Keras hands it to an op: rounded once from double to `dtype`.

    A traced one (`Live`) was rounded to float32 when set (its ``1 - x`` too,
    from double): for a float32 variable the same bits; for a narrower one,
    rounded twice (float32 first).
    """
    if isinstance(x, Live | jax.Array):  # traced (`Live`, or ``1 - live``): float32 already
        return jnp.asarray(x).astype(dtype)
    return jnp.asarray(np.asarray(x, np.float64).astype(np.dtype(dtype)))


def densify(values: Array, indices: Array, shape: tuple[int, ...]) -> Array:
    """The dense tensor of sparse rows: duplicates summed in order (TF's unsorted segment sum)."""
    return jnp.zeros(shape, values.dtype).at[indices].add(values, mode="drop", wrap_negative_indices=False)


def scatter_sub(x: Array, indices: Array, rows: Array) -> Array:
    """`x` with `rows` subtracted at `indices` (``x - r`` and ``x + (-r)`` round alike)."""
    return x.at[indices].add(-rows, mode="drop", wrap_negative_indices=False)


@dataclasses.dataclass(frozen=True)
class KerasOptimizer(Optimizer):
    """Base of the Keras 3 optimizers: non-slots ``iteration`` (int64), ``learning_rate`` (float32, unless a schedule).

    Subclass contract: ``_slot_groups`` (Keras's slot lists, each created
    interleaved over the variables), ``_extra_non_slots`` (float32 non-slots
    Keras creates after the slots), and ``_step_dense(lr, grad, var, slots,
    non_slots)`` / ``_step_sparse(lr, values, indices, var, slots,
    non_slots)`` on raw rows (duplicates included), where ``lr`` is the
    learning rate in the variable's dtype and ``non_slots["iteration"]``
    counts the steps before this one. An optimizer whose sparse step is its
    dense one on the summed rows defines ``_step(lr, var, slots, non_slots,
    summed)`` instead, where ``summed(f)`` is ``f`` of the gradient (for
    sparse rows: ``f`` of each row, the results summed into a dense tensor).

    Args:
        learning_rate: a float, or a schedule ``f(iteration)`` called with the
            ``iteration`` counter (unless ``step=`` is given; Keras then keeps no
            ``learning_rate`` variable).
        weight_decay: Keras's decoupled weight decay, ``var -= var *
            weight_decay * learning_rate`` before each update; None turns it off.

    Raises:
        TypeError: an option that is not a float (the learning rate: nor a
            callable), or an unknown keyword (the message names the closest).

    >>> import jax.numpy as jnp, varstate
    >>> from varstate.optimizers import keras
    >>> state = keras.Adam(0.1).init([varstate.Variable(jnp.ones(2), name="k")])
    >>> issubclass(keras.Adam, keras.KerasOptimizer), state.get_slot_names(), sorted(state.non_slots)
    (True, ['momentum', 'velocity'], ['iteration', 'learning_rate'])
    """

    learning_rate: Hyper = 0.001
    weight_decay: float | None = None

    _dedup: ClassVar[bool] = False
    _hyper_names: ClassVar[tuple[str, ...]] = ("learning_rate",)
    _floats: ClassVar[tuple[str, ...]] = ()  # hyperparameters Keras holds as Python floats
    _injectable: ClassVar[tuple[str, ...]] = ("weight_decay",)  # a traced array: used as a float32 value

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in (*self._floats, "weight_decay"):
            x = getattr(self, name)
            if varies(x) or (name == "weight_decay" and (x is None or isinstance(x, Tracer))):
                continue  # a Tracer (optax.inject_hyperparams): used as a float32 value
            if isinstance(x, bool) or not isinstance(x, (int, float, np.floating, np.integer)):
                raise TypeError(f"{type(self).__name__}: {name} must be a float, got {type(x).__name__} {x!r:.40}.")
            object.__setattr__(self, name, float(x))

    @classmethod
    def _traceable(cls) -> tuple[str, ...]:
        # A slot's initial value is read once, by init: nothing to trace.
        return (*cls._hyper_names, "weight_decay", *(n for n in cls._floats if not n.startswith("initial_")))

    def _held_elsewhere(self) -> tuple[str, ...]:
        return ("learning_rate",)  # the ``learning_rate`` non-slot, as in Keras

    def _compile_key(self) -> KerasOptimizer:
        # The step reads a float learning rate from its non-slot: one compiled step serves every value.
        if callable(self.learning_rate) or isinstance(self.learning_rate, Traced | Tracer):
            return self
        key = self.__dict__.get("_key")
        if key is None:
            key = object.__new__(type(self))
            key.__dict__.update(self.__dict__, learning_rate=Traced(self.learning_rate))
            self.__dict__["_key"] = key
        return key

    # --- Keras's layout -------------------------------------------------
    def _slot_groups(self) -> tuple[tuple[str, ...], ...]:
        return ()

    def _extra_non_slots(self) -> dict[str, float]:
        return {}

    def keras_layout(self) -> tuple[tuple[str, ...], tuple[tuple[str, ...], ...], tuple[str, ...]]:
        """Keras's order of its optimizer variables: (leading non-slots, slot groups, trailing non-slots).

        Keras numbers them ``iteration``, ``learning_rate`` (absent for a
        schedule), then each slot group for every variable in turn (the names
        of a group interleaved per variable), then trailing non-slots.

        Returns:
            ``(leading non-slot names, slot groups (tuples of slot names),
            trailing non-slot names)``.

        >>> from varstate.optimizers import keras
        >>> keras.Adam(amsgrad=True).keras_layout()
        (('iteration', 'learning_rate'), (('momentum', 'velocity'), ('velocity_hat',)), ())
        """
        lead = ("iteration",) if callable(self.learning_rate) else ("iteration", "learning_rate")
        return lead, self._slot_groups(), tuple(self._extra_non_slots())

    def keras_slots(self, param: Any) -> tuple[str, ...]:
        """The slots Keras keeps for `param`: all of `keras_layout`'s (`Muon`: ``velocity`` only where AdamW steps).

        Keras's variable list holds, per slot group, these of the group's
        slots for each trainable variable in turn.

        Args:
            param: a trainable Variable or array.

        Returns:
            The slot names, in `keras_layout`'s order.

        >>> import jax.numpy as jnp
        >>> from varstate.optimizers import keras
        >>> keras.Adam(amsgrad=True).keras_slots(jnp.zeros(2))
        ('momentum', 'velocity', 'velocity_hat')
        """
        return tuple(name for group in self._slot_groups() for name in group)

    def _slot_inits(self) -> dict[str, float]:
        return {name: 0.0 for group in self._slot_groups() for name in group}

    def _non_slot_inits(self) -> dict[str, float]:
        lr = {} if callable(self.learning_rate) else {"learning_rate": self.learning_rate}
        return {**lr, **self._extra_non_slots()}

    # --- state ----------------------------------------------------------
    def init(self, params: Any, state: OptimizerState | None = None, *, stepped: Any = None,
             fused: bool | None = None, reinitialize_slots: bool = False) -> OptimizerState:
        """Slots and non-slots as `Optimizer.init`, plus Keras's int64 ``iteration`` counter (starting at 0).

        Args:
            params: as `Optimizer.init`'s.
            state: as `Optimizer.init`'s; its ``iteration`` is kept.
            stepped: as `Optimizer.init`'s.
            fused: as `Optimizer.init`'s.
            reinitialize_slots: as `Optimizer.init`'s.

        Returns:
            The `OptimizerState`.

        Raises:
            ValueError: ``fused=True`` (or a fused `state`) for an optimizer
                whose step reduces over each whole variable (`Lamb`, `Muon`,
                `Adafactor`), or as `Optimizer.init`.

        >>> import jax.numpy as jnp, varstate
        >>> from varstate.optimizers import keras
        >>> w = varstate.Variable(jnp.zeros(2), name="w")
        >>> state = keras.SGD(0.1, momentum=0.9).init([w])
        >>> sorted(state.non_slots), state.non_slot("iteration").value.item(), state.get_slot(w, "momentum").name
        (['iteration', 'learning_rate'], 0, 'w/momentum')
        """
        if not self._elementwise and (fused or (fused is None and state is not None and state.fused)):
            name = type(self).__name__
            raise ValueError(f"{name}.init: fused=True (or a fused state) packs many params into one buffer, but "
                             f"{name}'s step reduces over each whole variable (Keras's per-variable norms and "
                             "matrix shapes); pass fused=False, or a state made without fused=True")
        state = super().init(params, state, stepped=stepped, fused=fused, reinitialize_slots=reinitialize_slots)
        if "iteration" in state.non_slots:
            return state
        registry, placement = non_slot_home(params)
        counter = int64_counter("iteration", registry, device=placement)
        return state.replace(non_slots={"iteration": counter, **state.non_slots})

    def update(
        self, grads: Any, params: Any, state: OptimizerState, step: Any = None, **extra_args: Any
    ) -> tuple[Any, OptimizerState]:
        """One step as `Optimizer.update`; a learning-rate schedule is called with ``iteration`` unless `step` is given.

        Args:
            grads: as `Optimizer.update`'s.
            params: as `Optimizer.update`'s.
            state: as `Optimizer.update`'s; it must hold ``iteration`` (`init`).
            step: the value a learning-rate schedule is called with; None is
                the state's ``iteration``.
            **extra_args: none is taken (TypeError naming the first).

        Returns:
            ``(params, state)``, ``iteration`` incremented.

        >>> import jax.numpy as jnp
        >>> from varstate.optimizers import keras
        >>> opt = keras.SGD(lambda it: 0.5 / (1.0 + it))
        >>> p = [jnp.ones(1)]
        >>> state = opt.init(p)
        >>> p, state = opt.update([jnp.ones(1)], p, state)
        >>> p, state = opt.update([jnp.ones(1)], p, state)
        >>> p[0].tolist(), state.non_slot("iteration").value.item()
        ([0.25], 2)
        """
        check_arguments(self, "update", params, grads, state)  # before reading `state`'s iteration
        check_non_slots(state, ("iteration",))
        if step is None:
            step = state.non_slots["iteration"].value
        return super().update(grads, params, state, step, **extra_args)

    def renamed_slots(self, params: Any, state: OptimizerState, names: dict[str, str]) -> OptimizerState:
        """`state` with its slots re-linked to `params` under other names (``{"momentum": "m"}``), values kept.

        For another layout's names, such as tf.keras 2's (``m``, ``v``), which
        a checkpoint records as slot names. Non-slots are kept as they are.

        Args:
            params: the params the state's slots belong to (found by resource
                id, whatever their structure).
            state: the state to rename.
            names: ``{current slot name: new name}``; unnamed slots keep theirs.

        Returns:
            A new `OptimizerState` whose slot Variables are named
            ``<primary>/<new name>``.

        Raises:
            ValueError: a slot belongs to no Variable of `params`.

        >>> import jax.numpy as jnp, varstate
        >>> from varstate.optimizers import keras
        >>> w = varstate.Variable(jnp.ones(2), name="kernel")
        >>> opt = keras.Adam()
        >>> renamed = opt.renamed_slots([w], opt.init([w]), {"momentum": "m", "velocity": "v"})
        >>> renamed.get_slot_names(), renamed.get_slot(w, "m").name
        (['m', 'v'], 'kernel/m')
        """
        # A slot finds its primary by resource id: params may come in another structure than at init.
        # Keyed by int | None: a variable that is no slot has slot_of None, found nowhere.
        by_rid: dict[int | None, Variable] = {
            p.resource_id: p for p in jax.tree.leaves(params, is_leaf=is_var) if isinstance(p, Variable)}

        def renamed(name: str, s: Any) -> Any:
            if not isinstance(s, Variable):
                return s
            primary = by_rid.get(s.handle.slot_of)
            if primary is None:
                raise ValueError(f"renamed_slots: slot {s.name!r} belongs to no Variable of params; pass the "
                                 "params the state was made for")
            return filled_slot(primary, name, 0.0)._with_value(s.value)

        slots = {}
        for name, tree in state.slots.items():
            leaves, treedef = jax.tree.flatten(tree, is_leaf=lambda x: is_var(x) or x is None)
            slots[names.get(name, name)] = treedef.unflatten([renamed(names.get(name, name), s) for s in leaves])
        return OptimizerState(slots=slots, non_slots=dict(state.non_slots))

    # --- the step -------------------------------------------------------
    def _lr_and_decayed(self, h: dict, non_slots: dict, var: Array) -> tuple[Array, Array]:
        """The learning rate in the variable's dtype, and the variable after the decoupled weight decay."""
        # Keras's schedules return float32 tensors; the variable is float32; both are then cast.
        lr = as_dtype(h["learning_rate"] if callable(self.learning_rate) else non_slots["learning_rate"], var.dtype)
        if self.weight_decay is not None:
            var = var - var * as_dtype(self.weight_decay, var.dtype) * lr
        return lr, var

    def _dense(self, h, grad, var, slots, non_slots):
        lr, var = self._lr_and_decayed(h, non_slots, var)
        return self._step_dense(lr, grad.astype(var.dtype), var, slots, non_slots)

    def _sparse(self, h, values, indices, var, slots, non_slots):
        lr, var = self._lr_and_decayed(h, non_slots, var)
        return self._step_sparse(lr, values.astype(var.dtype), indices, var, slots, non_slots)

    def _step_dense(self, lr, grad, var, slots, non_slots):
        return self._step(lr, var, slots, non_slots, lambda f: f(grad))

    def _step_sparse(self, lr, values, indices, var, slots, non_slots):
        # Keras's rule: an elementwise op of sparse rows stays on the rows, which a dense op then sums.
        return self._step(lr, var, slots, non_slots, lambda f: densify(f(values), indices, var.shape))

    def _step(self, lr, var, slots, non_slots, summed):
        raise NotImplementedError

    def _finish(self, h, non_slots):
        return {**non_slots, "iteration": non_slots["iteration"] + 1}


def local_step(non_slots: dict, dtype: Any, ahead: int = 1) -> Array:
    """Keras's ``cast(iterations + ahead, dtype)``."""
    return (non_slots["iteration"] + ahead).astype(dtype)
