"""Writes the TF Serving fixtures under tests/data/tf_serving/: our SavedModels, and what TensorFlow made of them.

Run by hand with TensorFlow 2.21 installed (never imported by the package or the tests), from the
repository root:

    /tmp/tfvenv/bin/python tests/data/make_tf_serving_fixtures.py [--ours-python .venv/bin/python]

Step 1 (our code writes, no TensorFlow): this file run with the project's Python and ``--write DIR``
exports the models of `models()` with `checkpoint.export_saved_model` to DIR/<model>/, and each
signature's inputs to DIR/inputs.npz (``<model>/<signature>/<input>``):
- mlp: Dense(3 -> 4, tanh) -> Dense(4 -> 2) as Variables, times a captured array; serving_default(x)
  with a dynamic batch returns {"scores"};
- ints: an int32 signature: serving_default(ids, offset) looks rows up in a float table and returns
  a tuple (output_0: the rows, output_1: sum(ids) + offset, int32);
- two: two named signatures over one set of Variables: serving_default(x) -> {"y"} and
  score(x, unused) -> {"total", "max"}, which reads one of the three Variables and not `unused`;
- mlp_cpu_cuda: mlp exported with platforms=("cpu", "cuda") (run on mlp's inputs).
Step 2 (TensorFlow reads ours): for each model, `tf.saved_model.load` runs every signature on those
inputs and lists its restored variables; ``saved_model_cli show --dir D --all`` and
``saved_model_cli run`` (the session loader TF Serving's C++ also uses) run on it; TF's own protos
parse saved_model.pb. Step 3: TF itself saves a tf.Module with one variable and one signature, the
structure ours copies.

Written: <model>/ (the SavedModels TF loaded); records.npz: ``<model>/<signature>/<output>`` (TF's
outputs, tf.saved_model.load), ``session/<model>/<signature>/<output>`` (saved_model_cli run's
--outdir files), ``variables/<model>/<variable name>`` (TF's restored values); inputs.npz;
show_<model>.txt and run_<model>.txt (saved_model_cli's stdout); tf_text_<model>.txt (saved_model.pb
parsed by TF's protos, text format, each XlaCallModule's `module` bytes replaced by their length);
reference.json (TF's own SavedModel: graph ops, the signature function's ops, saver_def, versions);
refused_cholesky.txt: TF's error running a model that calls a LAPACK custom call (jnp.linalg.cholesky
on CPU), exported with export_saved_model's refusal lifted, which is why it refuses one.
"""

import argparse
import json
import os
import shutil
import subprocess
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "tf_serving")
ROOT = os.path.dirname(os.path.dirname(HERE))
MULTI = "mlp_cpu_cuda"  # mlp exported with platforms=("cpu", "cuda")


def models():
    """{model: (root, {signature: (fn, example_args)}, {signature: {input: value}})}: the exported models."""
    import jax
    import jax.numpy as jnp

    import varstate

    rng = np.random.default_rng(7)
    f32 = lambda *shape: rng.standard_normal(shape).astype(np.float32)
    batch = lambda n: jax.ShapeDtypeStruct(jax.export.symbolic_shape(f"b, {n}"), jnp.float32)

    mlp = {"hidden": {"kernel": varstate.Variable(f32(3, 4), name="hidden/kernel"),
                      "bias": varstate.Variable(f32(4), name="hidden/bias")},
           "out": {"kernel": varstate.Variable(f32(4, 2), name="out/kernel"),
                   "bias": varstate.Variable(f32(2), name="out/bias")},
           "scale": jnp.asarray(f32(2)), "activation": "tanh"}

    def mlp_serve(p, x):
        h = jnp.tanh(x @ p["hidden"]["kernel"].value + p["hidden"]["bias"].value)
        return {"scores": (h @ p["out"]["kernel"].value + p["out"]["bias"].value) * p["scale"]}

    ints = {"table": varstate.Variable(f32(10, 3), name="table")}

    def lookup(p, ids, offset):
        return p["table"].value[ids], jnp.sum(ids) + offset

    two = {"w": varstate.Variable(f32(3, 3), name="w"), "b": varstate.Variable(f32(3), name="b"),
           "gain": varstate.Variable(np.float32(1.5), name="gain", trainable=False)}

    def forward(p, x):
        return {"y": x @ p["w"].value + p["b"].value}

    def score(p, x, unused):
        s = x * p["gain"].value
        return {"total": jnp.sum(s, axis=1), "max": jnp.max(s, axis=1)}

    b = jax.export.symbolic_shape("b")[0]  # score's two inputs share their batch dimension
    both = lambda n: jax.ShapeDtypeStruct((b, n), jnp.float32)
    ids = jax.ShapeDtypeStruct(jax.export.symbolic_shape("n"), jnp.int32)
    return {
        "mlp": (mlp, {"serving_default": (mlp_serve, (batch(3),))},
                {"serving_default": {"x": f32(5, 3)}}),
        "ints": (ints, {"serving_default": (lookup, (ids, jax.ShapeDtypeStruct((), jnp.int32)))},
                 {"serving_default": {"ids": np.array([3, 0, 9, 3], np.int32), "offset": np.array(-2, np.int32)}}),
        "two": (two, {"serving_default": (forward, (batch(3),)), "score": (score, (both(3), both(2)))},
                {"serving_default": {"x": f32(2, 3)}, "score": {"x": f32(4, 3), "unused": f32(4, 2)}}),
    }


def cholesky():
    """A model export_saved_model refuses: jnp.linalg.cholesky on CPU calls LAPACK through a jaxlib custom call."""
    import jax
    import jax.numpy as jnp

    import varstate

    root = {"w": varstate.Variable(jnp.eye(3) * 2.0 + 0.1, name="w")}
    fn = lambda p, x: {"c": jnp.linalg.cholesky(p["w"].value) @ x}
    return root, {"serving_default": (fn, (jax.ShapeDtypeStruct((3, 2), jnp.float32),))}


def write_ours(out):
    """Step 1, with the project's Python: export every model and save the inputs."""
    import checkpoint
    from checkpoint._export import _tf_saved_model

    # The refused model, written with its custom call allowed, to record what TF says when it runs it.
    allowed = _tf_saved_model.TF_CUSTOM_CALLS
    _tf_saved_model.TF_CUSTOM_CALLS = allowed | {"lapack_spotrf_ffi"}
    checkpoint.export_saved_model(os.path.join(out, "refused_cholesky"), *cholesky())
    _tf_saved_model.TF_CUSTOM_CALLS = allowed
    inputs = {}
    for name, (root, signatures, feeds) in models().items():
        checkpoint.export_saved_model(os.path.join(out, name), root, signatures)
        for sig, feed in feeds.items():
            inputs.update({f"{name}/{sig}/{k}": v for k, v in feed.items()})
        if name == "mlp":  # one module for both platforms: TF on a CPU runs the CPU one
            checkpoint.export_saved_model(os.path.join(out, MULTI), root, signatures, platforms=("cpu", "cuda"))
    np.savez(os.path.join(out, "inputs.npz"), **inputs)


def _cli(*args):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    cli = os.path.join(os.path.dirname(sys.executable), "saved_model_cli")
    return subprocess.run([cli, *args], check=True, capture_output=True, text=True, env=env).stdout


def _text(path, tf):
    """saved_model.pb parsed by TF's protos, as text, each XlaCallModule's module replaced by its length."""
    from google.protobuf import text_format
    from tensorflow.core.protobuf import saved_model_pb2

    sm = saved_model_pb2.SavedModel()
    with open(os.path.join(path, "saved_model.pb"), "rb") as f:
        sm.ParseFromString(f.read())
    for fn in sm.meta_graphs[0].graph_def.library.function:
        for node in fn.node_def:
            if node.op == "XlaCallModule":
                node.attr["module"].s = b"%d bytes" % len(node.attr["module"].s)
    return text_format.MessageToString(sm)


def read_with_tf(out):
    """Step 2: TF loads each model, runs its signatures (eagerly and through saved_model_cli)."""
    import tensorflow as tf

    inputs = dict(np.load(os.path.join(out, "inputs.npz")))
    records = {}
    for name in ("mlp", "ints", "two", MULTI):
        path = os.path.join(out, name)
        source = "mlp" if name == MULTI else name  # whose inputs it runs on
        loaded = tf.saved_model.load(path)
        restored = [t for t in tf.train.TrackableView(loaded).descendants() if isinstance(t, tf.Variable)]
        assert restored, f"{name}: TF restored no variables"
        for v in restored:
            records[f"variables/{name}/{v.name.removesuffix(':0')}"] = v.numpy()
        run_text = []
        for sig, fn in loaded.signatures.items():
            feed = {k.split("/")[2]: v for k, v in inputs.items() if k.startswith(f"{source}/{sig}/")}
            for k, v in fn(**{k: tf.constant(v) for k, v in feed.items()}).items():
                records[f"{name}/{sig}/{k}"] = v.numpy()
            tmp = os.path.join(out, "_inputs")
            os.makedirs(tmp, exist_ok=True)
            for k, v in feed.items():
                np.save(os.path.join(tmp, f"{k}.npy"), v)
            outdir = os.path.join(out, "_outdir")
            shutil.rmtree(outdir, ignore_errors=True)
            # mlp's input as a literal (--input_exprs), the others from .npy files (--inputs, exact dtypes).
            feed_args = (["--input_exprs", "x=" + repr(feed["x"].tolist())] if source == "mlp" else
                         ["--inputs", ";".join(f"{k}={os.path.join(tmp, k + '.npy')}" for k in feed)])
            run_text.append(_cli("run", "--dir", path, "--tag_set", "serve", "--signature_def", sig,
                                 *feed_args, "--outdir", outdir))
            for f in sorted(os.listdir(outdir)):
                records[f"session/{name}/{sig}/{f.removesuffix('.npy')}"] = np.load(os.path.join(outdir, f))
            shutil.rmtree(outdir)
            shutil.rmtree(tmp)
        with open(os.path.join(out, f"show_{name}.txt"), "w") as f:
            f.write(_cli("show", "--dir", path, "--all"))
        with open(os.path.join(out, f"run_{name}.txt"), "w") as f:
            f.write("".join(run_text).replace(out, "tests/data/tf_serving"))
        with open(os.path.join(out, f"tf_text_{name}.txt"), "w") as f:
            f.write(_text(path, tf))
    np.savez(os.path.join(out, "records.npz"), **records)
    path = os.path.join(out, "refused_cholesky")
    try:
        tf.saved_model.load(path).signatures["serving_default"](x=tf.ones((3, 2)))
        raise AssertionError("TF ran a LAPACK custom call: export_saved_model need not refuse it")
    except tf.errors.OpError as e:
        with open(os.path.join(out, "refused_cholesky.txt"), "w") as f:
            f.write(e.message.strip().splitlines()[-2].strip() + "\n")  # "No FFI handler registered for ..."
    shutil.rmtree(path)


def tf_reference(out):
    """Step 3: the structure TF 2.21 writes for a tf.Module with one variable and one signature."""
    import tempfile

    import tensorflow as tf
    from tensorflow.core.protobuf import saved_model_pb2

    class Module(tf.Module):
        def __init__(self):
            self.v = tf.Variable([1.0, 2.0, 3.0], name="v")

        @tf.function(input_signature=[tf.TensorSpec([None, 3], tf.float32, name="x")])
        def f(self, x):
            return {"y": x * self.v}

    m = Module()
    path = os.path.join(tempfile.mkdtemp(), "ref")
    tf.saved_model.save(m, path, signatures={"serving_default": m.f})
    sm = saved_model_pb2.SavedModel()
    with open(os.path.join(path, "saved_model.pb"), "rb") as f:
        sm.ParseFromString(f.read())
    meta = sm.meta_graphs[0]
    lib = {f.signature.name: f for f in meta.graph_def.library.function}
    call = next(n for n in meta.graph_def.node if n.name == meta.signature_def["serving_default"].outputs["y"].name
                .split(":")[0])

    def ops(fn_name):  # the ops a function runs, following the calls it makes
        fn = lib[fn_name]
        found = set()
        for n in fn.node_def:
            found.add(n.op)
            if n.op in ("StatefulPartitionedCall", "PartitionedCall"):
                found |= set(ops(n.attr["f"].func.name))
        return sorted(found)

    restore = next(n for n in meta.graph_def.node if n.name == meta.saver_def.restore_op_name)
    objects = meta.object_graph_def
    sig_map = next(c.node_id for c in objects.nodes[0].children if c.local_name == "signatures")
    reference = {
        "tags": list(meta.meta_info_def.tags),
        "graph_ops": sorted({n.op for n in meta.graph_def.node}),
        "placeholder": meta.signature_def["serving_default"].inputs["x"].name,
        "method_name": meta.signature_def["serving_default"].method_name,
        "signature_call_op": call.op,
        "signature_ops": ops(call.attr["f"].func.name),
        "restore_ops": ops(restore.attr["f"].func.name),
        "saver_def": {"filename_tensor_name": meta.saver_def.filename_tensor_name,
                      "version": int(meta.saver_def.version), "restore_op": restore.op},
        "versions": {"producer": meta.graph_def.versions.producer,
                     "min_consumer": meta.graph_def.versions.min_consumer},
        "signature_node_kinds": [objects.nodes[c.node_id].WhichOneof("kind")
                                 for c in objects.nodes[sig_map].children],
        "signature_map_identifier": objects.nodes[sig_map].user_object.identifier,
    }
    with open(os.path.join(out, "reference.json"), "w") as f:
        json.dump(reference, f, indent=1, sort_keys=True)
        f.write("\n")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", help="(step 1, the project's Python) export the models to this directory")
    parser.add_argument("--ours-python", default=os.path.join(ROOT, ".venv", "bin", "python"))
    args = parser.parse_args()
    if args.write:
        write_ours(args.write)
        return
    shutil.rmtree(OUT, ignore_errors=True)
    os.makedirs(OUT)
    subprocess.run([args.ours_python, os.path.abspath(__file__), "--write", OUT], check=True, cwd=ROOT)
    read_with_tf(OUT)
    tf_reference(OUT)


if __name__ == "__main__":
    main()
