"""Writes tests/data/tf_variable_methods.npz: TF's results for the Variable methods of varstate/_scatter.py.

Run by hand with TensorFlow 2.21 installed (never imported by the package or the tests), from the
repository root:

    /tmp/tfvenv/bin/python tests/data/make_tf_variable_methods_fixtures.py

For each dtype (float32, float16, bfloat16, int32), each case below runs on a fresh eager
`tf.Variable` on the CPU, values drawn from a fixed seed:
- row scatters (`scatter_add`, `scatter_sub`, `scatter_update`, `scatter_max`, `scatter_min`,
  `scatter_mul`, `scatter_div`, given `tf.IndexedSlices`) on a (5, 3) variable, with 1-D and 2-D
  indices that repeat rows (TF's CPU kernel applies duplicates one after another, in index order);
- `scatter_nd_add`, `scatter_nd_sub`, `scatter_nd_update`, `scatter_nd_max`, `scatter_nd_min` on a
  (4, 3, 2) variable, with index depths 1, 2 and 3, batched indices, and repeats;
- `sparse_read` and `gather_nd` on the same variables;
- for the float dtypes, the max/min ops again on values holding NaNs and zeros of both signs (case
  "nan_zero"): TF keeps the variable's element unless an update is strictly greater (less), so a NaN
  in the variable stays, a NaN update is ignored, and of equal zeros the first one wins.
A dtype/op pair TF has no CPU kernel for is left out (and listed in the key "unsupported"). The key
"device" holds `tf.Variable(1.0).device` (an eager variable on the first CPU).

Keys: "<dtype>/<op>/<case>/<what>", what in init, indices, updates (not for reads), result. bfloat16
arrays are stored as their uint16 bits (npz has no bfloat16); the tests view them back.
"""

import os

os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")

import numpy as np
import tensorflow as tf

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tf_variable_methods.npz")
DTYPES = {"float32": tf.float32, "float16": tf.float16, "bfloat16": tf.bfloat16, "int32": tf.int32}
ROW_OPS = ["scatter_add", "scatter_sub", "scatter_update", "scatter_max", "scatter_min", "scatter_mul", "scatter_div"]
ND_OPS = ["scatter_nd_add", "scatter_nd_sub", "scatter_nd_update", "scatter_nd_max", "scatter_nd_min"]
ROW_SHAPE = (5, 3)
ND_SHAPE = (4, 3, 2)
ROW_INDICES = {"dup": [3, 0, 3, 1, 3], "rank2": [[4, 4], [2, 4]]}
ND_INDICES = {
    "depth1": [[2], [0], [2]],
    "depth2": [[1, 2], [0, 0], [1, 2], [3, 1], [1, 2]],
    "depth3": [[1, 2, 1], [1, 2, 1], [0, 0, 0], [1, 2, 1]],
    "batched": [[[1, 2], [0, 1]], [[1, 2], [3, 0]]],
}


def draw(rng, shape, dtype, op=""):
    if dtype == "int32":
        if op.endswith(("_mul", "_div")):  # nonzero divisors; small factors keep products in range
            return rng.choice(np.array([-3, -2, -1, 1, 2, 3], np.int32), size=shape)
        return rng.integers(-9, 10, size=shape).astype(np.int32)
    x = rng.standard_normal(shape) * 3
    if op.endswith("_div"):  # away from zero: a quotient of a tiny divisor overflows float16
        x = np.where(np.abs(x) < 0.5, np.sign(x) * 0.5 + x, x)
    return x.astype(np.float32)


NAN = float("nan")
# Row 1 is hit three times, row 0 once; columns: NaN in the variable, -0/+0 against +0/-0, NaN updates.
ROW_NAN_ZERO = ([1, 0, 1, 1], {0: [0.0, NAN, -0.0], 1: [NAN, -0.0, 0.0]},
                [[0.0, 0.0, -0.0], [NAN, -0.0, 0.0], [NAN, 0.0, -0.0], [1.0, NAN, NAN]])
ND_NAN_ZERO = ([[0, 0], [0, 0], [1, 1], [1, 1]], {(0, 0): [NAN, -0.0], (1, 1): [0.0, -0.0]},
               [[0.0, 0.0], [NAN, NAN], [-0.0, 0.0], [NAN, -1.0]])


def with_specials(x, rows):
    x = x.copy()
    for at, row in rows.items():
        x[at] = row
    return x


def stored(x, dtype):
    x = np.asarray(x)
    return x.view(np.uint16) if dtype == "bfloat16" else x


def main():
    rng = np.random.default_rng(24)
    out, unsupported = {}, []

    def record(dtype, op, case, init, indices, updates, result):
        key = f"{dtype}/{op}/{case}/"
        out[key + "init"] = stored(init, dtype)
        out[key + "indices"] = np.asarray(indices, np.int32)
        if updates is not None:
            out[key + "updates"] = stored(updates, dtype)
        out[key + "result"] = stored(result, dtype)

    for dname, dtype in DTYPES.items():
        special = {"nan_zero"} if dname != "int32" else set()
        for op in [*ROW_OPS, "sparse_read"]:
            cases = dict(ROW_INDICES, **dict.fromkeys(special if op[-3:] in ("max", "min") else (), ROW_NAN_ZERO[0]))
            for case, indices in cases.items():
                init = draw(rng, ROW_SHAPE, dname)
                init = tf.cast(with_specials(init, ROW_NAN_ZERO[1]) if case == "nan_zero" else init, dtype)
                v = tf.Variable(init)
                try:
                    if op == "sparse_read":
                        updates, result = None, v.sparse_read(indices)
                    else:
                        updates = draw(rng, np.shape(indices) + ROW_SHAPE[1:], dname, op)
                        updates = tf.cast(np.float32(ROW_NAN_ZERO[2]) if case == "nan_zero" else updates, dtype)
                        getattr(v, op)(tf.IndexedSlices(updates, tf.constant(indices)))
                        result = v.read_value()
                except (tf.errors.NotFoundError, tf.errors.InvalidArgumentError) as e:
                    unsupported.append(f"{dname}/{op}: {type(e).__name__}")
                    break
                record(dname, op, case, init.numpy(), indices, None if updates is None else updates.numpy(),
                       result.numpy())
        for op in [*ND_OPS, "gather_nd"]:
            cases = dict(ND_INDICES, **dict.fromkeys(special if op[-3:] in ("max", "min") else (), ND_NAN_ZERO[0]))
            for case, indices in cases.items():
                init = draw(rng, ND_SHAPE, dname)
                init = tf.cast(with_specials(init, ND_NAN_ZERO[1]) if case == "nan_zero" else init, dtype)
                v = tf.Variable(init)
                depth = np.shape(indices)[-1]
                try:
                    if op == "gather_nd":
                        updates, result = None, v.gather_nd(indices)
                    else:
                        updates = draw(rng, np.shape(indices)[:-1] + ND_SHAPE[depth:], dname, op)
                        updates = tf.cast(np.float32(ND_NAN_ZERO[2]) if case == "nan_zero" else updates, dtype)
                        getattr(v, op)(tf.constant(indices), updates)
                        result = v.read_value()
                except (tf.errors.NotFoundError, tf.errors.InvalidArgumentError) as e:
                    unsupported.append(f"{dname}/{op}: {type(e).__name__}")
                    break
                record(dname, op, case, init.numpy(), indices, None if updates is None else updates.numpy(),
                       result.numpy())
    out["unsupported"] = np.asarray(unsupported, dtype=str)
    out["device"] = np.asarray(tf.Variable(1.0).device)
    np.savez_compressed(OUT, **out)
    print(f"wrote {OUT}: {len(out)} arrays; unsupported: {unsupported or 'none'}")


if __name__ == "__main__":
    main()
