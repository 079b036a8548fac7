"""Keras weights and optimizer state without Keras or TensorFlow.

Weights: `load_weights`, `save_weights`, `assign_weights`. Optimizer state:
`load_optimizer_state`, `save_optimizer_state` (Keras 3's and tf.keras 2's
layouts in TF checkpoints, Keras 3's ``optimizer/vars`` in ``.weights.h5``
and ``.keras``), for the optimizers of `varstate.optimizers.keras`.

Read (format found from the file itself, not its name):

- Keras 3 ``.weights.h5`` (``model.save_weights``) and the weights inside a
  ``.keras`` archive (``model.save``);
- Keras 2's legacy HDF5 (tf.keras / tf-keras ``save_weights("w.h5")``,
  ``model.save("m.h5")``);
- TF checkpoints of Keras models: tf-keras ``model.save_weights(prefix)``
  and ``tf.train.Checkpoint(model=model).save`` of a tf-keras or a Keras 3
  model (the checkpoint prefix, or its directory).

Written: Keras 3 ``.weights.h5``, which Keras's ``model.load_weights`` reads.

Weights come back as a `KerasWeights`: a dict, layer name -> {weight name ->
`varstate.Variable`, sublayer name -> {...}}, in Keras's layer order (a
``.keras`` records it; a ``.weights.h5`` only through its optimizer's
shapes, see `load_optimizer_state`); a
Variable's name is its Keras path relative to the model (``"dense/kernel"``,
``"lstm/lstm_cell/kernel"``; Keras 3 prefixes the variables of a Sequential
model with the model's name, which is left out). Optimizer state is not
returned (`load_optimizer_state` reads it).

Where names come from: TF checkpoints and legacy HDF5 record every
variable's Keras path. A Keras 3 ``.weights.h5`` records each layer's name
and its weights' values by position only ("0", "1", ...); weight names are
those Keras's built-in layers create in that order (Dense: kernel, bias;
BatchNormalization: gamma, beta, moving_mean, moving_variance; LSTM/GRU
cells: kernel, recurrent_kernel, bias; see `BUILTIN_WEIGHT_NAMES`).
Other layers keep positional names unless `load_weights(weight_names=...)`
names them. HDF5 needs h5py (and pyfive, which reads the files' string
attributes), imported only when an HDF5 file is read or written.

>>> import numpy as np, varstate
>>> from checkpoint import keras
>>> w = keras.KerasWeights({"dense": {"kernel": varstate.Variable(np.ones((2, 3), np.float32), name="dense/kernel"),
...                                   "bias": varstate.Variable(np.zeros(3, np.float32), name="dense/bias")}})
>>> target = {"dense": {"kernel": np.zeros((2, 3), np.float32), "bias": np.ones(3, np.float32)}}
>>> new = keras.assign_weights(target, w)
>>> new["dense"]["kernel"].sum(), new["dense"]["bias"].sum()
(Array(6., dtype=float32), Array(0., dtype=float32))
"""

from checkpoint.keras._optimizer import load_optimizer_state, save_optimizer_state
from checkpoint.keras._read import BUILTIN_WEIGHT_NAMES, KerasWeights, LayerLayout, load_weights
from checkpoint.keras._weights import assign_weights, save_weights

__all__ = [
    "BUILTIN_WEIGHT_NAMES",
    "KerasWeights",
    "LayerLayout",
    "assign_weights",
    "load_optimizer_state",
    "load_weights",
    "save_optimizer_state",
    "save_weights",
]
