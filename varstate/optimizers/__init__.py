"""Optimizers with TF's slot and non-slot variables, as jitted pure updates (dense and sparse).

>>> import jax.numpy as jnp, varstate
>>> opt = varstate.optimizers.GradientDescent(0.5)
>>> params = {"w": varstate.Variable(jnp.ones(2), name="w")}
>>> params, state = opt.apply_gradients({"w": jnp.ones(2)}, params, opt.init(params))
>>> params["w"].value.tolist()
[0.5, 0.5]
"""

from varstate.optimizers._adadelta import Adadelta
from varstate.optimizers._adagrad import Adagrad
from varstate.optimizers._adagrad_da import AdagradDA
from varstate.optimizers._adam import Adam
from varstate.optimizers._core._base import Optimizer
from varstate.optimizers._core._state import OptimizerState
from varstate.optimizers._core._traced import traced
from varstate.optimizers._ftrl import Ftrl
from varstate.optimizers._gradient_descent import GradientDescent
from varstate.optimizers._loss_scale import LossScaleOptimizer
from varstate.optimizers._momentum import Momentum
from varstate.optimizers._optax import from_optax
from varstate.optimizers._proximal_adagrad import ProximalAdagrad
from varstate.optimizers._proximal_gradient_descent import ProximalGradientDescent
from varstate.optimizers._rmsprop import RMSProp

__all__ = [
    "Adadelta",
    "Adagrad",
    "AdagradDA",
    "Adam",
    "Ftrl",
    "GradientDescent",
    "LossScaleOptimizer",
    "Momentum",
    "Optimizer",
    "OptimizerState",
    "ProximalAdagrad",
    "ProximalGradientDescent",
    "RMSProp",
    "from_optax",
    "traced",
]
