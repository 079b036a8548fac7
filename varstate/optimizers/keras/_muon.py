"""Keras 3's `Muon`: 2-D variables take a Newton-Schulz orthogonalized momentum step, the others AdamW's.

Keras gives every variable a ``momentum`` slot and only the AdamW ones a
``velocity``. The engine's steps take one slot set for all the params they
step, so `Muon.update` is two of them over one state: the AdamW part steps
the AdamW variables (slots ``momentum``, ``velocity``), then the matrix part
the others (slot ``momentum``; their ``velocity`` is None throughout), and
only the second counts the ``iteration``.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from varstate._variable import Variable
from varstate.optimizers._core._matching import flatten_grads, is_var
from varstate.optimizers._core._messages import check_arguments
from varstate.optimizers._core._rows import as_dtype
from varstate.optimizers._core._state import OptimizerState
from varstate.optimizers.keras._adam import Adam
from varstate.optimizers.keras._base import KerasOptimizer, const
from varstate.optimizers.keras._lamb import _PerVariable


def _transposed(x: Any) -> Any:
    return jnp.swapaxes(x, -1, -2)


@dataclasses.dataclass(frozen=True)
class _AdamWPart(Adam):
    """Muon's AdamW step: Adam's, at ``learning_rate * adam_lr_ratio``, decayed at the plain learning rate."""

    lr_ratio: float = 1.0
    counts: bool = False  # whether this step counts the iteration (the matrix part has no gradient)

    def _lr_and_decayed(self, h, non_slots, var):
        _, var = super()._lr_and_decayed(h, non_slots, var)  # decayed at the plain learning rate, as Keras
        lr_f32 = h["learning_rate"] if callable(self.learning_rate) else non_slots["learning_rate"]
        return as_dtype(jnp.asarray(lr_f32, jnp.float32) * as_dtype(self.lr_ratio, jnp.float32), var.dtype), var

    def _finish(self, h, non_slots):
        return super()._finish(h, non_slots) if self.counts else non_slots


@dataclasses.dataclass(frozen=True)
class _MatrixPart(KerasOptimizer):
    """Muon's own step: momentum, Nesterov's look-ahead, Newton-Schulz, Moonlight's RMS scale."""

    momentum: float = 0.95
    nesterov: bool = True
    ns_steps: int = 5
    abc: tuple[float, float, float] = (3.4445, -4.7750, 2.0315)
    rms_rate: float | None = 0.2

    def _slot_groups(self):
        return (("momentum",),)

    def _step(self, lr, var, slots, non_slots, summed):
        dtype = var.dtype
        grad = summed(lambda g: g)
        m = slots["momentum"] + (grad + slots["momentum"] * const(self.momentum - 1, dtype))
        g = grad + const(self.momentum, dtype) * m if self.nesterov else m
        update = self._newton_schulz(g)
        x = lr * update
        if self.rms_rate is not None:
            # Keras's sqrt of the larger dimension: an integer made float32, then rounded to the variable's dtype
            x = x * jnp.sqrt(jnp.float32(max(x.shape[0], x.shape[1]))).astype(dtype) * const(self.rms_rate, dtype)
        return var - x, {"momentum": m}

    def _newton_schulz(self, x):
        a, b, c = (const(v, x.dtype) for v in self.abc)
        tall = x.shape[-2] > x.shape[-1]
        if tall:
            x = _transposed(x)
        x = x / (jnp.sqrt(jnp.sum(jnp.square(x), axis=(-2, -1), keepdims=True)) + const(1e-7, x.dtype))
        for _ in range(self.ns_steps):
            xxt = x @ _transposed(x)
            # Python's precedence, as Keras writes it: b * A + ((c * A) @ A)
            x = a * x + (b * xxt + (c * xxt) @ xxt) @ x
        return _transposed(x) if tall else x


@dataclasses.dataclass(frozen=True)
class Muon(_PerVariable):
    """``keras.optimizers.Muon``: slot ``momentum`` for every variable, ``velocity`` for those AdamW steps.

    Keras's rules for which update a variable takes, followed exactly: a
    variable that is not 2-D, one whose name contains ``"embedding"`` (any
    case; with ``exclude_embeddings``), and one whose name matches a regular
    expression of ``exclude_layers`` (``re.search``) take AdamW's step
    (`Adam`'s, at ``learning_rate * adam_lr_ratio``, decayed by
    ``adam_weight_decay``); every other variable takes Muon's: ``m += g +
    m * (momentum - 1)``, ``u = NS(g + momentum * m)`` (``NS(m)`` without
    ``nesterov``; ``ns_steps`` quintic Newton-Schulz iterations with
    ``muon_a``, ``muon_b``, ``muon_c`` on the Frobenius-normalized matrix,
    transposed while it is taller than wide), ``var -= lr * u *
    sqrt(max(rows, cols)) * rms_rate`` (no scale when ``rms_rate`` is None),
    decayed by ``weight_decay``. The Variable's name stands for Keras's
    ``variable.path`` (a plain-array param has none: only its shape counts).
    A sparse gradient's rows are summed into a dense gradient.

    Numerics: run op by op, the AdamW variables and every ``momentum`` and
    ``velocity`` equal Keras's bit for bit; the Muon-stepped variables'
    Newton-Schulz matmuls and norm sum in another order than Eigen's, so
    each of their elements is within 2 ulp of the variable's largest element
    (measured: 1)
    (tests/varstate/optimizers/keras/test_keras_matrix_optimizers.py).
    Under ``jit``, fused multiply-adds move elements by up to 4 ulp of the
    largest. The step reduces over whole variables: ``init(...,
    fused=True)`` is refused (ValueError). Keras's checkpoints number a
    ``velocity`` for the AdamW variables only (`keras_slots`), as
    ``checkpoint.keras`` reads and writes them.

    Args:
        learning_rate: a float, or a schedule ``f(iteration)`` called with the
            ``iteration`` counter (unless ``step=`` is given; Keras then keeps no
            ``learning_rate`` variable).
        adam_beta_1: the decay of ``momentum`` in the AdamW step.
        adam_beta_2: the decay of ``velocity`` in the AdamW step.
        adam_weight_decay: the AdamW variables' decoupled weight decay; None
            turns it off.
        epsilon: added to ``sqrt(v)`` in the AdamW step.
        weight_decay: the Muon variables' decoupled weight decay, ``var -= var
            * weight_decay * learning_rate``; None turns it off.
        exclude_layers: regular expressions; a variable whose name matches one
            takes the AdamW step.
        exclude_embeddings: variables named ``*embedding*`` take the AdamW step.
        muon_a: the Newton-Schulz iteration's ``a``.
        muon_b: its ``b``.
        muon_c: its ``c``.
        adam_lr_ratio: the AdamW step's learning rate over ``learning_rate``.
        momentum: the Muon step's momentum.
        ns_steps: the number of Newton-Schulz iterations.
        nesterov: use the Nesterov look-ahead ``g + momentum * m``.
        rms_rate: Moonlight's scale of the Muon step (None: unscaled).

    Raises:
        TypeError: an option that is not a float (the learning rate: nor a
            callable), or an unknown keyword (the message names the closest).

    >>> import jax.numpy as jnp, varstate
    >>> from varstate.optimizers import keras
    >>> kernel = varstate.Variable(jnp.eye(2), name="dense/kernel")
    >>> bias = varstate.Variable(jnp.zeros(2), name="dense/bias")
    >>> opt = keras.Muon(0.1, weight_decay=None)
    >>> state = opt.init([kernel, bias])
    >>> state.get_slot(kernel, "velocity") is None, state.get_slot(bias, "velocity").name
    (True, 'dense/bias/velocity')
    >>> (kernel, bias), state = opt.update([jnp.eye(2), jnp.ones(2)], [kernel, bias], state)
    >>> [round(x, 4) for x in kernel.value[0].tolist()], state.non_slot("iteration").value.item()
    ([0.9687, 0.0], 1)
    """

    adam_beta_1: float = 0.9
    adam_beta_2: float = 0.999
    adam_weight_decay: float | None = 0.004
    epsilon: float = 1e-7
    weight_decay: float | None = 0.004
    exclude_layers: tuple[str, ...] = ()
    exclude_embeddings: bool = True
    muon_a: float = 3.4445
    muon_b: float = -4.7750
    muon_c: float = 2.0315
    adam_lr_ratio: float = 1.0
    momentum: float = 0.95
    ns_steps: int = 5
    nesterov: bool = True
    rms_rate: float | None = 0.2

    _floats: ClassVar[tuple[str, ...]] = (
        "adam_beta_1", "adam_beta_2", "epsilon", "muon_a", "muon_b", "muon_c", "adam_lr_ratio", "momentum")

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("adam_weight_decay", "rms_rate"):
            x = getattr(self, name)
            if x is not None and (isinstance(x, bool) or not isinstance(x, (int, float, np.floating, np.integer))):
                raise TypeError(f"Muon: {name} must be a float or None, got {type(x).__name__} {x!r:.40}.")
            object.__setattr__(self, name, None if x is None else float(x))
        if isinstance(self.ns_steps, bool) or not isinstance(self.ns_steps, (int, np.integer)) or self.ns_steps < 0:
            raise TypeError(f"Muon: ns_steps must be a non-negative int (Newton-Schulz iterations), got "
                            f"{self.ns_steps!r:.40}.")
        layers = self.exclude_layers or ()
        if isinstance(layers, str) or not all(isinstance(k, str) for k in layers):
            raise TypeError(f"Muon: exclude_layers must be a list of regular expressions (str), got {layers!r:.60}.")
        object.__setattr__(self, "exclude_layers", tuple(layers))

    def _slot_groups(self):
        return (("momentum", "velocity"),)

    def keras_slots(self, param: Any) -> tuple[str, ...]:
        """``("momentum", "velocity")`` for a variable AdamW steps (`uses_adamw`), else ``("momentum",)``.

        Args:
            param: a trainable Variable or array.

        Returns:
            The slot names Keras keeps for `param`, in its order.

        >>> import jax.numpy as jnp
        >>> from varstate.optimizers import keras
        >>> keras.Muon().keras_slots(jnp.zeros((2, 2))), keras.Muon().keras_slots(jnp.zeros(2))
        (('momentum',), ('momentum', 'velocity'))
        """
        return ("momentum", "velocity") if self.uses_adamw(param) else ("momentum",)

    def uses_adamw(self, param: Any) -> bool:
        """Whether Keras steps `param` with AdamW (True) or with Muon's orthogonalized step (False).

        Args:
            param: a Variable (its name stands for Keras's ``variable.path``)
                or an array.

        Returns:
            True for a variable that is not 2-D, is named ``*embedding*``
            (with ``exclude_embeddings``) or matches ``exclude_layers``.

        >>> import jax.numpy as jnp, varstate
        >>> from varstate.optimizers import keras
        >>> opt = keras.Muon(exclude_layers=["^out/"])
        >>> [opt.uses_adamw(varstate.Variable(jnp.zeros(s), name=n))
        ...  for n, s in [("dense/kernel", (2, 2)), ("dense/bias", (2,)), ("out/kernel", (2, 2)),
        ...               ("Embedding/embeddings", (4, 2))]]
        [False, True, True, True]
        """
        if len(jnp.shape(param.value if isinstance(param, Variable) else param)) != 2:
            return True
        path = param.name if isinstance(param, Variable) else ""
        if self.exclude_embeddings and "embedding" in path.lower():
            return True
        return any(re.search(k, path) for k in self.exclude_layers)

    def _parts(self, counts: bool) -> tuple[_AdamWPart, _MatrixPart]:
        lr = self.learning_rate
        adamw = _AdamWPart(lr, self.adam_weight_decay, beta_1=self.adam_beta_1, beta_2=self.adam_beta_2,
                           epsilon=self.epsilon, lr_ratio=self.adam_lr_ratio, counts=counts)
        matrix = _MatrixPart(lr, self.weight_decay, momentum=self.momentum, nesterov=self.nesterov,
                             ns_steps=self.ns_steps, abc=(self.muon_a, self.muon_b, self.muon_c),
                             rms_rate=self.rms_rate)
        return adamw, matrix

    def init(self, params: Any, state: OptimizerState | None = None, *, stepped: Any = None,
             fused: bool | None = None, reinitialize_slots: bool = False) -> OptimizerState:
        """Slots and non-slots as `KerasOptimizer.init`, without ``velocity`` for the Muon-stepped variables.

        Args:
            params: as `Optimizer.init`'s.
            state: as `Optimizer.init`'s; its ``iteration`` is kept.
            stepped: as `Optimizer.init`'s.
            fused: must not be True (Muon's step reduces over whole variables).
            reinitialize_slots: as `Optimizer.init`'s.

        Returns:
            The `OptimizerState`: ``velocity`` is None for each param that
            `uses_adamw` says Muon steps.

        Raises:
            ValueError: ``fused=True``, or as `Optimizer.init`.

        >>> import jax.numpy as jnp, varstate
        >>> from varstate.optimizers import keras
        >>> state = keras.Muon().init({"k": jnp.ones((2, 3)), "b": jnp.ones(3)})
        >>> state.slots["velocity"]["k"] is None, state.slots["velocity"]["b"].shape
        (True, (3,))
        """
        state = super().init(params, state, stepped=stepped, fused=fused, reinitialize_slots=reinitialize_slots)
        leaves, p_def = jax.tree.flatten(params, is_leaf=is_var)
        velocity = p_def.flatten_up_to(state.slots["velocity"])
        velocity = [v if self.uses_adamw(p) else None for p, v in zip(leaves, velocity, strict=True)]
        return state.replace(slots={**state.slots, "velocity": p_def.unflatten(velocity)})

    def update(
        self, grads: Any, params: Any, state: OptimizerState, step: Any = None, **extra_args: Any
    ) -> tuple[Any, OptimizerState]:
        """One step as `KerasOptimizer.update`: AdamW's for the AdamW variables, Muon's for the others.

        Args:
            grads: as `Optimizer.update`'s.
            params: as `Optimizer.update`'s.
            state: as `Optimizer.update`'s (`init`).
            step: as `KerasOptimizer.update`'s.
            **extra_args: none is taken (TypeError naming the first).

        Returns:
            ``(params, state)``, ``iteration`` incremented once.

        >>> import jax.numpy as jnp
        >>> from varstate.optimizers import keras
        >>> opt = keras.Muon(0.1, weight_decay=None, rms_rate=None)
        >>> p = [jnp.zeros((2, 2))]
        >>> p, state = opt.update([jnp.eye(2)], p, opt.init(p))
        >>> [round(x, 3) for x in p[0].ravel().tolist()]
        [-0.111, 0.0, 0.0, -0.111]
        """
        check_arguments(self, "update", params, grads, state)  # errors name Muon, not its parts
        leaves, g_leaves, p_def, _ = flatten_grads(grads, params)  # the engine's errors for mismatched structures
        mask = [self.uses_adamw(p) for p in leaves]
        has = {keep: any(g is not None and m is keep for g, m in zip(g_leaves, mask, strict=True))
               for keep in (True, False)}
        adamw, matrix = self._bound(state)._parts(counts=not has[False])  # traced values from the state

        def only(keep: bool) -> Any:
            return p_def.unflatten([g if m is keep else None for g, m in zip(g_leaves, mask, strict=True)])

        if has[True]:
            params, state = adamw.update(only(True), params, state, step, **extra_args)
        if has[False] or not has[True]:  # with no gradient at all, the engine's own error
            params, state = matrix.update(only(False), params, state, step, **extra_args)
        return params, state
