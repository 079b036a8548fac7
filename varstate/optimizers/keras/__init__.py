"""Keras 3's optimizers on varstate: Keras's update rules, constant rounding and state layout.

Each optimizer computes what ``keras.optimizers.<Name>`` computes with the
TensorFlow backend, op by op in Keras's order and with Keras's constants
(``1 - beta_1`` rounded once from a Python float, ``epsilon=1e-7``, the
bias correction from the ``iteration`` counter), on dense gradients and on
`varstate.IndexedSlices` with Keras's sparse rules. Run op by op (``update``
outside ``jit``) the results equal Keras's bit for bit; under ``jit``, XLA
may fuse a multiply and an add, which moves elements by a few ulp. `Lamb`'s
norms, `Muon`'s matrix products and `Adafactor`'s means sum in another order
than Eigen's: they agree within the bound each one's docstring states.

The state is an `OptimizerState` whose slots carry Keras's names
(``momentum``, ``velocity``, ...) and whose non-slots are Keras's
``iteration`` (int64, held as JAX's widest integer), ``learning_rate``
(float32; absent when the learning rate is a callable of the iteration, a
schedule) and, for `Nadam`, ``u_product``. `keras_layout` gives Keras's
numbering of these variables, which ``checkpoint.keras.load_optimizer_state``
and ``save_optimizer_state`` use to read and write Keras checkpoints.

Not modelled: gradient clipping (``clipnorm``, ``clipvalue``,
``global_clipnorm``), ``use_ema``, ``loss_scale_factor``, gradient
accumulation and ``exclude_from_weight_decay``.

>>> import jax.numpy as jnp, varstate
>>> from varstate.optimizers import keras
>>> w = varstate.Variable(jnp.ones(3), name="dense/kernel")
>>> opt = keras.Adam(learning_rate=0.01)
>>> state = opt.init([w])
>>> (w,), state = opt.apply_gradients([jnp.ones(3)], [w], state)
>>> state.non_slot("iteration").value.item(), state.get_slot(w, "velocity").name
(1, 'dense/kernel/velocity')
"""

from varstate.optimizers.keras._adafactor import Adafactor
from varstate.optimizers.keras._adam import Adam, Adamax, AdamW, Nadam
from varstate.optimizers.keras._base import KerasOptimizer
from varstate.optimizers.keras._ftrl import Ftrl
from varstate.optimizers.keras._lamb import Lamb
from varstate.optimizers.keras._muon import Muon
from varstate.optimizers.keras._sgd import SGD, Adadelta, Adagrad, Lion, RMSprop

__all__ = [
    "SGD", "Adadelta", "Adafactor", "Adagrad", "Adam", "AdamW", "Adamax", "Ftrl", "KerasOptimizer", "Lamb", "Lion",
    "Muon", "Nadam", "RMSprop",
]
