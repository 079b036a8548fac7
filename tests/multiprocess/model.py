"""The model both the 2-process children and the single-process reference build: same data, same steps.

Sharded over a mesh of all devices (2 processes x 4, or one process's 8):
a kernel split by columns, one split by rows, a replicated bias, and a
PartitionedVariable whose two shards are each split by rows.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import varstate
from varstate.optimizers import Adam

STEPS = 3


def mesh(devices=None) -> Mesh:
    return Mesh(np.array(devices if devices is not None else jax.devices()), ("x",))


def put(value: np.ndarray, sharding) -> jax.Array:
    """A global array from a value every process knows whole (test data only)."""
    return jax.make_array_from_callback(value.shape, sharding, lambda index: value[index])


def shardings(m: Mesh) -> dict:
    return {"cols": NamedSharding(m, P(None, "x")), "rows": NamedSharding(m, P("x", None)),
            "rep": NamedSharding(m, P()), "vec": NamedSharding(m, P("x"))}


def make(m: Mesh, registry, seed: int = 0, zeros: bool = False) -> dict:
    rng = np.random.default_rng(seed)
    s = shardings(m)

    def init(shape):
        value = rng.standard_normal(shape).astype(np.float32)
        return np.zeros_like(value) if zeros else value

    kernel0, bias0, kernel1 = init((16, 64)), init((64,)), init((64, 8))
    emb = init((16, 16))
    model = {
        "dense0": {"kernel": varstate.Variable(put(kernel0, s["cols"]), name="dense0/kernel", registry=registry),
                   "bias": varstate.Variable(put(bias0, s["rep"]), name="dense0/bias", registry=registry)},
        "dense1": {"kernel": varstate.Variable(put(kernel1, s["rows"]), name="dense1/kernel", registry=registry)},
        "emb": varstate.PartitionedVariable(put(emb, s["rows"]), name="emb", num_shards=2, registry=registry,
                                            sharding=s["rows"]),
    }
    return model


def data(m: Mesh, step: int) -> tuple[jax.Array, jax.Array]:
    rng = np.random.default_rng(1000 + step)
    x = rng.standard_normal((32, 16)).astype(np.float32)
    y = rng.standard_normal((32, 8)).astype(np.float32)
    s = shardings(m)
    return put(x, s["rows"]), put(y, s["rows"])


def forward(model: dict, x: jax.Array) -> jax.Array:
    x = x @ model["emb"].as_array()
    h = jax.nn.relu(x @ model["dense0"]["kernel"].value + model["dense0"]["bias"].value)
    return h @ model["dense1"]["kernel"].value


@jax.jit
def loss_and_grads(model: dict, x: jax.Array, y: jax.Array):
    return jax.value_and_grad(lambda mm: jnp.mean((forward(mm, x) - y) ** 2))(model)


def train(m: Mesh, registry, steps: int = STEPS):
    model = make(m, registry)
    opt = Adam(1e-2)
    state = opt.init(model)
    losses = []
    for step in range(steps):
        x, y = data(m, step)
        loss, grads = loss_and_grads(model, x, y)
        model, state = opt.apply_gradients(grads, model, state)
        losses.append(float(loss))
    return model, opt, state, losses


def lazy_embedding_step(m: Mesh):
    """One lazy-Adam step of a row-sharded 64x16 table from IndexedSlices touching rows 1 and 40 (twice).

    Returns the new table and slots, and the collectives of the compiled
    step: only the touched rows may move (an all-reduce of 3 rows per array),
    never the table (no all-gather).
    """
    import re

    rows = NamedSharding(m, P("x", None))
    rep = NamedSharding(m, P())
    table = np.arange(64 * 16, dtype=np.float32).reshape(64, 16) / 100
    params = {"emb": varstate.Variable(put(table, rows), name="emb", registry=varstate.Registry())}
    opt = Adam(0.1, lazy=True)
    state = opt.init(params)
    grads = {"emb": varstate.IndexedSlices(put(np.linspace(-1, 1, 48, dtype=np.float32).reshape(3, 16), rep),
                                           put(np.array([1, 40, 40], np.int32), rep), (64, 16))}
    step = jax.jit(lambda p, s, g: opt.apply_gradients(g, p, s))
    hlo = step.lower(params, state, grads).compile().as_text()
    collectives = sorted({match.group(1) + " " + match.group(2) for match in re.finditer(
        r"= \(?([a-z0-9]+\[[0-9,]*\])[^=]*? (all-gather|all-to-all|all-reduce|collective-permute|reduce-scatter)\(",
        hlo)})
    new, new_state = step(params, state, grads)
    return new["emb"], new_state, collectives
