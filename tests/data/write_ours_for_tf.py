"""Step 1 of the TF checkpoint fixtures: checkpoints written by OUR code, for TensorFlow to check.

Run by hand from the repository root, then run step 2 (make_tf_checkpoint_fixtures.py, in the
TensorFlow venv), which restores these with TF and records what TF saw:

    .venv/bin/python tests/data/write_ours_for_tf.py
    /work/tfvenv/bin/python tests/data/make_tf_checkpoint_fixtures.py

Writes under tests/data/tf_checkpoints/:
  ours_bundle/      `write_bundle` with a hand-built TrackableObjectGraph: every dtype, a list, a dict
                    key that needs escaping, TF v1 Adam slots and non-slots, save_counter.
  ours_checkpoint/  `checkpoint.Checkpoint(model=..., optimizer=<varstate Adam state>, step=<global
                    step>).save(format="tf")`.
  ours_low_precision/  `checkpoint.Checkpoint(model=<float8_e4m3fn, float8_e5m2, int4 and uint4
                    Variables>).save(format="tf")`.
  ours_partitioned/  `checkpoint.Checkpoint(model={"emb": <PartitionedVariable, 3 shards>}).save(format="tf")`.
  ours_many/        `write_bundle` of 5,000 scalars under keys that share no prefix: an index of two blocks
                    (TF cuts a block at 256 KiB), so TF checks our index block's separator keys.
"""

import os
import shutil

import ml_dtypes
import numpy as np

from checkpoint._keys import OBJECT_GRAPH_KEY as GRAPH_KEY
from checkpoint._storage import write_bundle, write_checkpoint_state
from checkpoint.protos.trackable_object_graph_pb2 import TrackableObjectGraph

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tf_checkpoints")

DTYPES = {
    "float16": np.float16, "float32": np.float32, "float64": np.float64, "bfloat16": ml_dtypes.bfloat16,
    "int8": np.int8, "int16": np.int16, "int32": np.int32, "int64": np.int64,
    "uint8": np.uint8, "uint16": np.uint16, "uint32": np.uint32, "uint64": np.uint64,
    "bool": np.bool_, "complex64": np.complex64, "complex128": np.complex128,
}
STRINGS = np.array([b"", b"a", b"x" * 200, "h\u00e9llo".encode(), b"nul\x00byte"], dtype=object)


def _escape(name: str) -> str:
    return name.replace(".", "..").replace("/", ".S")


def ours_bundle_tensors() -> dict:
    """The values and the hand-built object graph of ours_bundle (TF's key and graph conventions)."""
    rng = np.random.default_rng(0)
    graph = TrackableObjectGraph()
    tensors: dict = {}

    def node(parent: int | None = None, local_name: str = "") -> int:
        graph.nodes.add()
        nid = len(graph.nodes) - 1
        if parent is not None:
            graph.nodes[parent].children.add(node_id=nid, local_name=local_name)
        return nid

    def variable(nid: int, key_path: str, full_name: str, value) -> None:
        key = f"{key_path}/.ATTRIBUTES/VARIABLE_VALUE"
        graph.nodes[nid].attributes.add(name="VARIABLE_VALUE", full_name=full_name, checkpoint_key=key)
        tensors[key] = value

    root = node()
    model = node(root, "model")
    optimizer = node(root, "optimizer")
    kernel, bias = node(model, "kernel"), node(model, "bias")
    variable(kernel, "model/kernel", "kernel", rng.normal(size=(3, 2)).astype(np.float32))
    variable(bias, "model/bias", "bias", np.array([0.5, -0.25], np.float32))
    dtypes = node(model, "dtypes")
    for name, dt in DTYPES.items():
        value = (rng.normal(size=(2, 3)) * 50).astype(dt) if np.dtype(dt).kind != "c" else (
            rng.normal(size=(2, 3)) + 1j * rng.normal(size=(2, 3))).astype(dt)
        if dt is np.bool_:
            value = rng.normal(size=(2, 3)) > 0
        variable(node(dtypes, name), f"model/dtypes/{name}", name, value)
    variable(node(dtypes, "string"), "model/dtypes/string", "string", STRINGS)
    variable(node(dtypes, "scalar"), "model/dtypes/scalar", "scalar", np.float64(2.5))
    layers = node(model, "layers")
    for i in range(2):
        variable(node(node(layers, str(i)), "w"), f"model/layers/{i}/w", f"w_{i}", np.full(4, i + 1, np.float32))
    table = node(model, "table")
    variable(node(table, "a.b/c"), f"model/table/{_escape('a.b/c')}", "t", np.arange(3, dtype=np.int32))
    for name, value in (("beta1_power", 0.9**2), ("beta2_power", 0.999**2)):
        variable(node(optimizer, name), f"optimizer/{name}", name, np.float32(value))
    for primary, path, shape in ((kernel, "model/kernel", (3, 2)), (bias, "model/bias", (2,))):
        for slot in ("m", "v"):
            nid = node()  # slot nodes are nobody's child
            graph.nodes[optimizer].slot_variables.add(
                original_variable_node_id=primary, slot_name=slot, slot_variable_node_id=nid
            )
            value = rng.uniform(0.1, 1.0, size=shape).astype(np.float32)
            variable(nid, f"{path}/.OPTIMIZER_SLOT/optimizer/{slot}", f"{path}/{slot}", value)
    variable(node(root, "save_counter"), "save_counter", "save_counter", np.int64(1))
    for n in graph.nodes:  # TF marks every node whose subtree holds values
        n.has_checkpoint_values.value = True
    tensors[GRAPH_KEY] = graph.SerializeToString()
    return tensors


def ours_many_tensors() -> dict:
    """Key `<40 hex digits>/v<i>` holds int32 i; the hex digits keep the keys from sharing prefixes."""
    rng = np.random.default_rng(2)
    return {f"{rng.integers(0, 1 << 62):016x}{rng.integers(0, 1 << 62):024x}/v{i}": np.int32(i) for i in range(5000)}


def ours_checkpoint(directory: str) -> str:
    import jax.numpy as jnp

    import checkpoint
    import varstate
    from varstate.optimizers import Adam

    reg = varstate.Registry()
    model = {
        "kernel": varstate.Variable(jnp.arange(6.0).reshape(3, 2), name="kernel", registry=reg),
        "bias": varstate.Variable(jnp.array([0.5, -0.5]), name="bias", registry=reg),
    }
    opt = Adam(0.1)
    state = opt.init(model)
    for step in range(2):
        grads = {"kernel": jnp.full((3, 2), 0.5 + step), "bias": jnp.array([1.0, -2.0])}
        model, state = opt.apply_gradients(grads, model, state)
    step = varstate.get_or_create_global_step(reg).assign(2)  # int32 in JAX, saved as TF's int64
    return checkpoint.Checkpoint(model=model, optimizer=state, step=step).save(
        os.path.join(directory, "ckpt"), format="tf"
    )


# The values of make_tf_checkpoint_fixtures.LOW_PRECISION.
LOW_PRECISION = {
    "float8_e4m3fn": [[1.0, -2.0, 3.0], [0.5, -1.0, 448.0]], "float8_e5m2": [[1.0, -2.0, 3.0], [0.5, -1.0, 57344.0]],
    "int4": [[1, -2, 3], [-8, 7, 0]], "uint4": [[1, 2, 3], [0, 15, 7]],
}


def ours_low_precision(directory: str) -> str:
    import jax.numpy as jnp

    import checkpoint
    import varstate

    reg = varstate.Registry()
    model = {name: varstate.Variable(jnp.asarray(np.array(v).astype(getattr(ml_dtypes, name))), name=name,
                                     registry=reg) for name, v in LOW_PRECISION.items()}
    return checkpoint.Checkpoint(model=model).save(os.path.join(directory, "ckpt"), format="tf")


def ours_partitioned(directory: str) -> str:
    import checkpoint
    import varstate

    table = np.arange(10, dtype=np.float32).reshape(5, 2) / 4  # make_tf_checkpoint_fixtures.SHARDED_TABLE
    emb = varstate.PartitionedVariable(table, name="emb", num_shards=3, registry=varstate.Registry())
    return checkpoint.Checkpoint(model={"emb": emb}).save(os.path.join(directory, "ckpt"), format="tf")


def main() -> None:
    for sub in ("ours_bundle", "ours_checkpoint", "ours_many", "ours_low_precision", "ours_partitioned"):
        shutil.rmtree(os.path.join(OUT, sub), ignore_errors=True)
    directory = os.path.join(OUT, "ours_bundle")
    write_bundle(os.path.join(directory, "ckpt-1"), ours_bundle_tensors())
    write_checkpoint_state(directory, os.path.join(directory, "ckpt-1"))
    print("wrote", directory)
    print("wrote", ours_checkpoint(os.path.join(OUT, "ours_checkpoint")))
    print("wrote", ours_low_precision(os.path.join(OUT, "ours_low_precision")))
    print("wrote", ours_partitioned(os.path.join(OUT, "ours_partitioned")))
    write_bundle(os.path.join(OUT, "ours_many", "many"), ours_many_tensors())
    print("wrote", os.path.join(OUT, "ours_many"))


if __name__ == "__main__":
    main()
