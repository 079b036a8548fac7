"""Step 2 of the TF checkpoint fixtures (TensorFlow + numpy only; run by hand in the TF venv).

    .venv/bin/python tests/data/write_ours_for_tf.py                   # step 1: our checkpoints
    /work/tfvenv/bin/python tests/data/make_tf_checkpoint_fixtures.py  # step 2: this script

Writes under tests/data/tf_checkpoints/:
  tf_object/   tf.train.Checkpoint(model, optimizer=tf.compat.v1.train.AdamOptimizer).save(): every dtype,
               nested modules, a list, a dict with a key that needs escaping, a variable reachable twice,
               v1 Adam slots and non-slots, after two training steps.
  tf_name/     tf.compat.v1.train.Saver in a graph: partitioned variables (axis 0 and axis 1), Adam
               slots (partitioned too), global_step.
  tf_sharded/  a checkpoint split over 3 data shards (MaxShardSizePolicy).
  tf_low_precision/  tf.train.Checkpoint of float8_e4m3fn, float8_e5m2, int4 and uint4 variables.
  tf_sharded_variable/  tf.train.Checkpoint of a TF2 ShardedVariable (parts of 3 and 2 rows of a 5x2 table);
               and TF's restore of ours_partitioned (a PartitionedVariable of 3 shards) into ShardedVariables
               of other splits.
  ours_*_tf_resaved/  TF's re-save of ours_bundle and ours_checkpoint (step 1), after restoring them.
  expected.json: what TF reads from every checkpoint: per key dtype, shape and raw little-endian bytes
               (hex; strings as a list of hex), the object graph in text format, the saved slices of
               partitioned variables, and the values TF restored from ours into its own variables (under
               the object path of their checkpoint key, before "/.ATTRIBUTES").
The script also asserts that TF restores our checkpoints with assert_existing_objects_matched()
and, once the optimizer has made its slots, assert_consumed().
"""

import itertools
import json
import os
import shutil

import numpy as np
import tensorflow as tf
from google.protobuf import text_format
from tensorflow.core.protobuf import trackable_object_graph_pb2

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tf_checkpoints")
DTYPES = ["float16", "float32", "float64", "bfloat16", "int8", "int16", "int32", "int64", "uint8", "uint16",
          "uint32", "uint64", "bool", "complex64", "complex128"]
STRINGS = [b"", b"a", b"x" * 200, "h\u00e9llo".encode(), b"nul\x00byte"]
# The low-precision types TF keeps in variables; the same values in write_ours_for_tf.py.
LOW_PRECISION = {
    "float8_e4m3fn": [[1.0, -2.0, 3.0], [0.5, -1.0, 448.0]], "float8_e5m2": [[1.0, -2.0, 3.0], [0.5, -1.0, 57344.0]],
    "int4": [[1, -2, 3], [-8, 7, 0]], "uint4": [[1, 2, 3], [0, 15, 7]],
}


def record(prefix: str) -> dict:
    """Everything tf.train.load_checkpoint sees in the checkpoint at `prefix`."""
    reader = tf.train.load_checkpoint(prefix)
    dtypes = reader.get_variable_to_dtype_map()
    out = {"tensors": {}, "object_graph": None}
    for key, shape in sorted(reader.get_variable_to_shape_map().items()):
        value = reader.get_tensor(key)
        if key == "_CHECKPOINTABLE_OBJECT_GRAPH":
            graph = trackable_object_graph_pb2.TrackableObjectGraph.FromString(value)
            out["object_graph"] = text_format.MessageToString(graph)
            continue
        value = np.asarray(value)
        entry = {"dtype": dtypes[key].name, "shape": list(shape)}
        if dtypes[key] == tf.string:
            entry["strings"] = [s.hex() for s in value.reshape(-1).tolist()]
        else:
            entry["hex"] = np.ascontiguousarray(value).astype(value.dtype.newbyteorder("<")).tobytes().hex()
        out["tensors"][key] = entry
    return out


def fresh(name: str) -> str:
    path = os.path.join(OUT, name)
    shutil.rmtree(path, ignore_errors=True)
    os.makedirs(path)
    return path


def dtype_module(rng) -> tf.Module:
    m = tf.Module()
    for name in DTYPES:
        if name == "bool":
            value = rng.normal(size=(2, 3)) > 0
        elif name.startswith("complex"):
            value = rng.normal(size=(2, 3)) + 1j * rng.normal(size=(2, 3))
        else:
            value = rng.normal(size=(2, 3)) * 50
        setattr(m, name, tf.Variable(tf.cast(tf.constant(value), name), name=name))
    m.string = tf.Variable(tf.constant(STRINGS), name="string")
    m.scalar = tf.Variable(tf.constant(2.5, tf.float64), name="scalar")
    return m


def tf_object(expected: dict) -> None:
    rng = np.random.default_rng(1)
    model = tf.Module()
    model.dense = tf.Module()
    model.dense.kernel = tf.Variable(rng.normal(size=(3, 2)).astype(np.float32), name="kernel")
    model.dense.bias = tf.Variable(np.zeros(2, np.float32), name="bias")
    model.tied = model.dense.kernel  # reachable twice: stored once, under its first path breadth-first
    model.blocks = [tf.Module(), tf.Module()]
    for i, block in enumerate(model.blocks):
        block.w = tf.Variable(np.full(4, float(i + 1), np.float32), name=f"w_{i}")
    model.table = {"a.b/c": tf.Variable(np.arange(3, dtype=np.int32), name="t"), "plain": tf.Variable(7.0)}
    model.dtypes = dtype_module(rng)
    opt = tf.compat.v1.train.AdamOptimizer(0.1)
    trained = [model.dense.kernel, model.dense.bias, *(b.w for b in model.blocks)]
    for step in range(2):
        opt.apply_gradients([(tf.ones_like(v) * (step + 1) * (i + 1), v) for i, v in enumerate(trained)])
    path = tf.train.Checkpoint(model=model, optimizer=opt).save(os.path.join(fresh("tf_object"), "ckpt"))
    expected["tf_object"] = record(path)


def tf_name(expected: dict) -> None:
    directory = fresh("tf_name")
    slices = {}
    with tf.Graph().as_default():
        init = tf.compat.v1.random_normal_initializer(seed=3)
        with tf.compat.v1.variable_scope("dense"):
            kernel = tf.compat.v1.get_variable("kernel", (3, 2), initializer=init)
            bias = tf.compat.v1.get_variable("bias", (2,), initializer=tf.compat.v1.zeros_initializer())
        emb = tf.compat.v1.get_variable(
            "emb", (10, 4), initializer=init, partitioner=tf.compat.v1.fixed_size_partitioner(3)
        )
        proj = tf.compat.v1.get_variable(
            "proj", (4, 5), initializer=init, partitioner=tf.compat.v1.fixed_size_partitioner(2, axis=1)
        )
        step = tf.compat.v1.train.get_or_create_global_step()
        rows = tf.nn.embedding_lookup(emb, tf.constant([1, 7, 9]))
        loss = tf.reduce_sum(tf.matmul(rows[:, :3], kernel) + bias) ** 2 + tf.reduce_sum(tf.concat(list(proj), 1) ** 2)
        train = tf.compat.v1.train.AdamOptimizer(0.1).minimize(loss, global_step=step)
        saver = tf.compat.v1.train.Saver()
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            sess.run(train)
            sess.run(train)
            path = saver.save(sess, os.path.join(directory, "model.ckpt"), global_step=step, write_meta_graph=False)
        for v in tf.compat.v1.global_variables():
            info = v._get_save_slice_info()
            if info is not None:
                slices.setdefault(info.full_name, []).append(info.spec)
    expected["tf_name"] = record(path)
    expected["tf_name"]["slices"] = {k: sorted(v) for k, v in sorted(slices.items())}


def tf_sharded(expected: dict) -> None:
    vs = {f"v{i}": tf.Variable(np.arange(64, dtype=np.float32) * (i + 1)) for i in range(3)}
    options = tf.train.CheckpointOptions(
        experimental_sharding_callback=tf.train.experimental.MaxShardSizePolicy(max_shard_size=300)
    )
    path = tf.train.Checkpoint(**vs).write(os.path.join(fresh("tf_sharded"), "ckpt"), options=options)
    assert len([f for f in os.listdir(os.path.dirname(path)) if ".data-" in f]) == 3
    expected["tf_sharded"] = record(path)


def restore_ours_bundle(expected: dict) -> None:
    """Our write_bundle checkpoint, restored by tf.train.Checkpoint into the matching TF objects."""
    directory = os.path.join(OUT, "ours_bundle")
    expected["ours_bundle"] = record(os.path.join(directory, "ckpt-1"))
    model = tf.Module()
    model.kernel = tf.Variable(tf.zeros((3, 2)))
    model.bias = tf.Variable(tf.zeros(2))
    model.dtypes = tf.Module()
    for name in DTYPES:
        setattr(model.dtypes, name, tf.Variable(tf.zeros((2, 3), name)))
    model.dtypes.string = tf.Variable(tf.constant([b""] * len(STRINGS)))
    model.dtypes.scalar = tf.Variable(tf.constant(0.0, tf.float64))
    model.layers = [tf.Module(), tf.Module()]
    for layer in model.layers:
        layer.w = tf.Variable(tf.zeros(4))
    model.table = {"a.b/c": tf.Variable(tf.zeros(3, tf.int32))}
    opt = tf.compat.v1.train.AdamOptimizer(0.1)
    ckpt = tf.train.Checkpoint(model=model, optimizer=opt)
    status = ckpt.restore(tf.train.latest_checkpoint(directory))  # also reads our `checkpoint` state file
    status.assert_existing_objects_matched()
    opt._create_slots([model.kernel, model.bias])  # what apply_gradients does first; restores deferred slots
    status.assert_consumed()
    slot = "{}/.OPTIMIZER_SLOT/optimizer/{}".format
    restored = {
        "model/kernel": model.kernel, "model/bias": model.bias,
        slot("model/kernel", "m"): opt.get_slot(model.kernel, "m"),
        slot("model/kernel", "v"): opt.get_slot(model.kernel, "v"),
        slot("model/bias", "m"): opt.get_slot(model.bias, "m"), slot("model/bias", "v"): opt.get_slot(model.bias, "v"),
        "optimizer/beta1_power": opt._get_beta_accumulators()[0],
        "optimizer/beta2_power": opt._get_beta_accumulators()[1],
        "model/table/a..b.Sc": model.table["a.b/c"], "model/layers/1/w": model.layers[1].w,
        "model/dtypes/bfloat16": model.dtypes.bfloat16, "model/dtypes/string": model.dtypes.string,
        "save_counter": ckpt.save_counter,
    }
    expected["ours_bundle"]["restored_by_tf"] = {
        k: [v.dtype.name, [s.hex() for s in v.numpy().tolist()] if v.dtype == tf.string
            else np.asarray(v.numpy()).tobytes().hex()]
        for k, v in restored.items()
    }
    path = ckpt.write(os.path.join(fresh("ours_bundle_tf_resaved"), "ckpt"))
    expected["ours_bundle_tf_resaved"] = record(path)


def restore_ours_checkpoint(expected: dict) -> None:
    """checkpoint.Checkpoint(...).save(format="tf") with varstate's Adam state, restored by TF."""
    directory = os.path.join(OUT, "ours_checkpoint")
    expected["ours_checkpoint"] = record(os.path.join(directory, "ckpt-1"))
    model = tf.Module()
    model.kernel = tf.Variable(tf.zeros((3, 2)))
    model.bias = tf.Variable(tf.zeros(2))
    opt = tf.compat.v1.train.AdamOptimizer(0.1)
    step = tf.compat.v1.train.get_or_create_global_step()  # int64: TF refuses to restore an int32 into it
    ckpt = tf.train.Checkpoint(model=model, optimizer=opt, step=step)
    status = ckpt.restore(tf.train.latest_checkpoint(directory))
    status.assert_existing_objects_matched()
    opt._create_slots([model.kernel, model.bias])
    status.assert_consumed()
    restored = {
        "model/kernel": model.kernel, "model/bias": model.bias,
        "model/kernel/.OPTIMIZER_SLOT/optimizer/m": opt.get_slot(model.kernel, "m"),
        "model/bias/.OPTIMIZER_SLOT/optimizer/v": opt.get_slot(model.bias, "v"),
        "optimizer/beta1_power": opt._get_beta_accumulators()[0], "save_counter": ckpt.save_counter,
        "step": step,
    }
    expected["ours_checkpoint"]["restored_by_tf"] = {
        k: [v.dtype.name, np.asarray(v.numpy()).tobytes().hex()] for k, v in restored.items()
    }
    path = ckpt.write(os.path.join(fresh("ours_checkpoint_tf_resaved"), "ckpt"))
    expected["ours_checkpoint_tf_resaved"] = record(path)


def low_precision_module() -> tf.Module:
    from tensorflow.python.framework import dtypes  # the float8/int4 dtypes are not in tf's namespace

    m = tf.Module()
    for name, value in LOW_PRECISION.items():
        setattr(m, name, tf.Variable(np.array(value).astype(getattr(dtypes, name).as_numpy_dtype), name=name))
    return m


def tf_low_precision(expected: dict) -> None:
    path = tf.train.Checkpoint(model=low_precision_module()).write(os.path.join(fresh("tf_low_precision"), "ckpt"))
    expected["tf_low_precision"] = record(path)


def restore_ours_low_precision(expected: dict) -> None:
    """Our Checkpoint.save(format="tf") of the same four variables, restored by tf.train.Checkpoint."""
    model = low_precision_module()
    for v in model.trainable_variables:
        v.assign(np.zeros(v.shape, v.dtype.as_numpy_dtype))  # TF has no float8 ZerosLike kernel
    ckpt = tf.train.Checkpoint(model=model)
    path = tf.train.latest_checkpoint(os.path.join(OUT, "ours_low_precision"))
    ckpt.restore(path).assert_consumed()
    expected["ours_low_precision"] = record(path)
    expected["ours_low_precision"]["restored_by_tf"] = {
        f"model/{name}": [getattr(model, name).dtype.name, getattr(model, name).numpy().tobytes().hex()]
        for name in LOW_PRECISION
    }


SHARDED_TABLE = np.arange(10, dtype=np.float32).reshape(5, 2) / 4  # the same in write_ours_for_tf.py


def sharded_variable(splits: list[int], value: np.ndarray) -> tuple[tf.Module, list[tf.Variable]]:
    from tensorflow.python.distribute.sharded_variable import ShardedVariable  # what TF2 partitioners make

    bounds = np.cumsum([0, *splits])
    parts = [tf.Variable(value[a:b], name=f"emb/part_{i}") for i, (a, b) in enumerate(itertools.pairwise(bounds))]
    m = tf.Module()
    m.emb = ShardedVariable(parts, name="emb") if len(parts) > 1 else parts[0]
    return m, parts


def tf_sharded_variable(expected: dict) -> None:
    model, _ = sharded_variable([3, 2], SHARDED_TABLE)
    path = tf.train.Checkpoint(model=model).save(os.path.join(fresh("tf_sharded_variable"), "ckpt"))
    expected["tf_sharded_variable"] = record(path)


def restore_ours_partitioned(expected: dict) -> None:
    """ours_partitioned (3 shards), restored by TF into ShardedVariables of 2 and 3 parts and a plain variable."""
    path = tf.train.latest_checkpoint(os.path.join(OUT, "ours_partitioned"))
    restored = {}
    for splits in ([3, 2], [2, 2, 1], [5]):
        model, parts = sharded_variable(splits, np.zeros_like(SHARDED_TABLE))
        tf.train.Checkpoint(model=model).restore(path).assert_consumed()
        restored[",".join(map(str, splits))] = np.concatenate([p.numpy() for p in parts]).tobytes().hex()
    expected["ours_partitioned"] = record(path)
    expected["ours_partitioned"]["restored_by_tf"] = restored


def read_ours_many(expected: dict) -> None:
    """5,000 keys over two index blocks, written by write_bundle: TF finds every one."""
    reader = tf.train.load_checkpoint(os.path.join(OUT, "ours_many", "many"))
    shapes = reader.get_variable_to_shape_map()
    assert len(shapes) == 5000
    for key in shapes:
        assert reader.get_tensor(key) == int(key.rsplit("/v", 1)[1]), key
    expected["ours_many"] = {"keys_read_by_tf": len(shapes), "every_value_matched_its_key": True}


def main() -> None:
    expected = {"tensorflow_version": tf.__version__}
    tf_object(expected)
    tf_name(expected)
    tf_sharded(expected)
    restore_ours_bundle(expected)
    restore_ours_checkpoint(expected)
    read_ours_many(expected)
    tf_low_precision(expected)
    restore_ours_low_precision(expected)
    tf_sharded_variable(expected)
    restore_ours_partitioned(expected)
    with open(os.path.join(OUT, "expected.json"), "w") as f:
        json.dump(expected, f, indent=1, sort_keys=True)
    total = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(OUT) for f in fs)
    print(f"wrote {OUT} ({total} bytes)")


if __name__ == "__main__":
    main()
