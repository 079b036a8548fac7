"""2 processes write a small TF-format checkpoint (argv: its prefix) of values the readers can check by formula.

Run by tests/data/write_multiprocess_for_tf.py; TensorFlow reads the result
in tests/data/make_tf_multiprocess_readback.py.
"""

import group
import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import checkpoint
import varstate

mesh = Mesh(np.array(jax.devices()), ("x",))
registry = varstate.Registry()


def put(value, spec):
    return jax.make_array_from_callback(value.shape, NamedSharding(mesh, spec), lambda index: value[index])


model = {
    "rows": varstate.Variable(put(np.arange(16 * 3, dtype=np.float32).reshape(16, 3), P("x", None)), name="rows",
                              registry=registry),
    "cols": varstate.Variable(put(np.arange(2 * 8, dtype=np.int32).reshape(2, 8) - 5, P(None, "x")), name="cols",
                              registry=registry),
    "rep": varstate.Variable(put(np.linspace(0, 1, 5).astype(np.float64), P()), name="rep", registry=registry),
    "emb": varstate.PartitionedVariable(put(np.arange(16 * 2, dtype=np.float32).reshape(16, 2) / 4, P("x", None)),
                                        name="emb", num_shards=2, registry=registry,
                                        sharding=NamedSharding(mesh, P("x", None))),
}
path = checkpoint.Checkpoint(model=model).write(group.args()[0], format="tf")
group.report("path", path)
