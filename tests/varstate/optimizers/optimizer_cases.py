"""The optimizers the suite's conformance checks run over, by name: one list for every test file.

Test files pick from `CASES` (``sys.path`` gets this folder, as the
multiprocess tests do for their model), so a new optimizer joins every
check that runs over all of them.
"""

import dataclasses

import jax.numpy as jnp
import optax

from varstate.mixed_precision import LossScaleOptimizer
from varstate.optimizers import (
    Adadelta,
    Adagrad,
    AdagradDA,
    Adam,
    Ftrl,
    GradientDescent,
    Momentum,
    ProximalAdagrad,
    ProximalGradientDescent,
    RMSProp,
    from_optax,
    keras,
    traced,
)


class _AdagradDAAtStepZero(AdagradDA):
    """AdagradDA for the step-less conformance checks: the global step is 0 unless given."""

    def hyperparameters(self, step=None):
        return super().hyperparameters(0 if step is None else step)


CASES = {
    "gd": lambda: GradientDescent(0.1),
    "momentum": lambda: Momentum(0.1, 0.9, use_nesterov=True),
    "adam": lambda: Adam(0.1),
    "lazy_adam": lambda: Adam(0.1, lazy=True),
    "adagrad": lambda: Adagrad(0.1),
    "rmsprop": lambda: RMSProp(0.1, momentum=0.5, centered=True),
    "optax_adam": lambda: from_optax(optax.adam(0.1)),
    "adadelta": lambda: Adadelta(1.0, rho=0.9, epsilon=1e-6),
    "adagrad_da": lambda: _AdagradDAAtStepZero(0.1, l1_regularization_strength=0.01, l2_regularization_strength=0.1),
    "ftrl": lambda: Ftrl(0.1, learning_rate_power=-0.6, l1_regularization_strength=0.01,
                         l2_shrinkage_regularization_strength=0.1),
    "proximal_adagrad": lambda: ProximalAdagrad(0.1, l1_regularization_strength=0.01, l2_regularization_strength=0.1),
    "proximal_gd": lambda: ProximalGradientDescent(0.1, l1_regularization_strength=0.01,
                                                   l2_regularization_strength=0.1),
    # Keras 3's optimizers (varstate.optimizers.keras), with Keras's numerics and state.
    "keras_sgd": lambda: keras.SGD(0.1, momentum=0.9, nesterov=True),
    "keras_adam": lambda: keras.Adam(0.1, amsgrad=True),
    "keras_adamw": lambda: keras.AdamW(0.1),
    "keras_rmsprop": lambda: keras.RMSprop(0.1, momentum=0.5, centered=True),
    "keras_adagrad": lambda: keras.Adagrad(0.1),
    "keras_adadelta": lambda: keras.Adadelta(1.0),
    "keras_adamax": lambda: keras.Adamax(0.1),
    "keras_nadam": lambda: keras.Nadam(0.1),
    "keras_lion": lambda: keras.Lion(0.1),
    "keras_lamb": lambda: keras.Lamb(0.1),
    "keras_muon": lambda: keras.Muon(0.1),
    "keras_adafactor": lambda: keras.Adafactor(0.1),
    "keras_ftrl": lambda: keras.Ftrl(0.1, l1_regularization_strength=0.01, l2_shrinkage_regularization_strength=0.1),
    "keras_schedule": lambda: keras.Adam(lambda it: 0.1 / (1.0 + it.astype(jnp.float32))),
    "loss_scale_adam": lambda: LossScaleOptimizer(Adam(0.1), initial_scale=8.0),
}


def pick(*names: str) -> dict:
    """The named cases, in the order given."""
    return {n: CASES[n] for n in names}


def all_traced(opt):
    """`opt` with every traceable hyperparameter that holds a float declared `traced` (a wrapper's inner optimizer's
    too), or None when it has none (an optax transformation's are optax's own)."""
    if isinstance(opt, LossScaleOptimizer):
        inner = all_traced(opt.inner_optimizer)
        return None if inner is None else dataclasses.replace(opt, inner_optimizer=inner)
    # A traced momentum keeps Keras's momentum slot, which Keras makes only for a non-zero one: a zero stays static.
    names = [n for n in opt._traceable() if isinstance(getattr(opt, n), float)
             and not (isinstance(opt, keras.KerasOptimizer) and n == "momentum" and opt.momentum == 0)]
    return dataclasses.replace(opt, **{n: traced(getattr(opt, n)) for n in names}) if names else None
