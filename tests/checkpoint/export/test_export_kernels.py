"""checkpoint.load refuses kernel custom calls unless the caller trusts the file; jax's non-kernel targets load.

A kernel on jax.export's stable list (lapack's getrf here) writes into buffers of the shapes the file declares:
a file that declares them wrongly corrupts memory when run. References: the targets jax prints in each module
(`mlir_module()`), numpy's linear algebra, and jax's own shape refinement.
"""

import dataclasses
import hashlib
import os
import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.linalg

import checkpoint
import varstate
from checkpoint._export import _format, _jax_private, _load
from checkpoint.protos import saved_object_graph_pb2 as pb

GETRF = "lapack_sgetrf_ffi"  # LU on CPU, float32


def _targets_in_text(module_text):
    return sorted(set(re.findall(r"stablehlo\.custom_call @([\w.$]+)\(", module_text)))


def _function(path):
    (name,) = os.listdir(os.path.join(path, "functions"))
    return name, os.path.join(path, "functions", name)


def _install(path, data):
    """`data` in place of the export's function file, its sha256 in export.pb sealed again (a crafted export)."""
    name, file = _function(path)
    pathlib.Path(file).write_bytes(data)
    definition = pb.ExportDef.FromString(pathlib.Path(path, "export.pb").read_bytes())
    definition.DiscardUnknownFields()
    definition.function_sha256[name] = hashlib.sha256(data).digest()
    pathlib.Path(path, "export.pb").write_bytes(_format.seal(definition.SerializeToString()))
    return file


def _refusal(file, label, targets, order=0):
    what = f" \\(its VJP of order {order}\\)" if order else ""
    return (rf"{re.escape(file)}: signature '{label}'{what} calls kernel custom call target\(s\) "
            rf"{re.escape(str(targets))}; load refuses them before anything runs unless the caller trusts the file: "
            r"a kernel writes into buffers of the shapes the file declares, unchecked, so a file that lies about "
            r"them can corrupt memory or crash the process\. If you trust the file's author, load it with "
            r"checkpoint\.load\(path, trust_custom_calls=True\)\.")


def test_the_non_kernel_targets_are_jaxs_own_and_pallas_and_tf_count_as_kernels():
    stable = _jax_private.stable_custom_call_targets()
    assert _load.NON_KERNEL_TARGETS <= stable
    assert {"tpu_custom_call", "mosaic_gpu_v2", "tf.call_tf_function", GETRF, "cusolver_getrf_ffi"} <= (
        stable - _load.NON_KERNEL_TARGETS)


@pytest.fixture
def linalg(tmp_path):
    a = np.array([[4.0, 3.0, 1.0], [6.0, 3.0, 2.0], [1.0, 5.0, 7.0]], np.float32)
    root = {"a": varstate.Variable(jnp.asarray(a), name="a")}
    signatures = {"solve": (lambda r, b: jnp.linalg.solve(r["a"].value, b), (jnp.zeros(3),)),
                  "lu": (lambda r: jax.scipy.linalg.lu(r["a"].value), ())}
    return checkpoint.export(tmp_path / "m", root, signatures), a


def test_a_real_linalg_export_is_refused_by_default_and_runs_when_trusted(linalg):
    path, a = linalg
    directory = os.path.join(path, "functions")
    targets = {os.path.join(directory, name): _targets_in_text(
        jax.export.deserialize(bytearray(pathlib.Path(directory, name).read_bytes())).mlir_module())
        for name in os.listdir(directory)}
    assert sorted(targets.values()) == [["lapack_sgetrf_ffi"], ["lapack_sgetrf_ffi", "lapack_strsm_ffi"]]
    with pytest.raises(checkpoint.CheckpointFormatError) as refused:
        checkpoint.load(path)
    file, label = re.match(r"(\S+): signature '(\w+)'", str(refused.value)).groups()  # the first one loaded
    assert label in ("solve", "lu") and re.fullmatch(_refusal(file, label, targets[file]), str(refused.value))

    loaded = checkpoint.load(path, trust_custom_calls=True)
    b = jnp.array([1.0, 2.0, 3.0])
    np.testing.assert_allclose(loaded.signatures["solve"](b), np.linalg.solve(a, b), rtol=1e-5)
    for got, want in zip(loaded.signatures["lu"](), scipy.linalg.lu(a), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_trust_custom_calls_must_be_a_bool(linalg):
    with pytest.raises(TypeError, match=r"load: trust_custom_calls must be a bool, got 'no'\."):
        checkpoint.load(linalg[0], trust_custom_calls="no")


@pytest.fixture
def exported(tmp_path):
    root = {"w": varstate.Variable(jnp.ones((64, 64)), name="w")}
    return checkpoint.export(tmp_path / "m", root, {"serve": (lambda r, x: x @ r["w"].value, (jnp.zeros((64, 64)),))})


def test_a_kernel_lying_about_its_result_shape_is_refused_before_anything_runs(exported):
    # getrf on a 64x64 operand, its factorization declared 1x1: run, the kernel writes 64*64 floats into one.
    # jax.export takes it (the target is on its stable list), so only the loader stands between it and a call.
    def lying(captured, x):
        shapes = (jax.ShapeDtypeStruct((1, 1), x.dtype), jax.ShapeDtypeStruct((64,), jnp.int32),
                  jax.ShapeDtypeStruct((), jnp.int32))
        return jax.ffi.ffi_call(GETRF, shapes)(x + captured[0])[0]

    function = jax.export.export(jax.jit(lying))([jnp.ones((64, 64))], jnp.zeros((64, 64)))
    assert function.disabled_safety_checks == ()
    assert f"custom_call @{GETRF}(%" in function.mlir_module() and "-> (tensor<1x1xf32>" in function.mlir_module()
    file = _install(exported, function.serialize())
    with pytest.raises(checkpoint.CheckpointFormatError, match=_refusal(file, "serve", [GETRF])):
        checkpoint.load(exported)
    # Trusted, it loads (and is not called here: the trust is the caller's to give).
    assert list(checkpoint.load(exported, trust_custom_calls=True).signatures) == ["serve"]


def test_a_kernel_in_a_vjp_is_refused_naming_the_order(tmp_path):
    @jax.custom_vjp
    def serve(captured, x):
        return x * captured[0]

    serve.defvjp(lambda captured, x: (serve(captured, x), captured),
                 lambda captured, g: ([jnp.zeros_like(captured[0])], jnp.linalg.solve(jnp.eye(3) * 2, g)))
    path = checkpoint.export(tmp_path / "m", {"w": varstate.Variable(jnp.ones(3), name="w")},
                             {"serve": (lambda r, x: x * r["w"].value, (jnp.zeros(3),))})
    function = jax.export.export(jax.jit(serve))([jnp.ones(3)], jnp.zeros(3))
    assert GETRF not in function.mlir_module() and GETRF in function.vjp().mlir_module()
    file = _install(path, function.serialize(vjp_order=1))
    with pytest.raises(checkpoint.CheckpointFormatError,
                       match=_refusal(file, "serve", ["lapack_sgetrf_ffi", "lapack_strsm_ffi"], order=1)):
        checkpoint.load(path)
    signature = checkpoint.load(path, trust_custom_calls=True).signatures["serve"]
    np.testing.assert_allclose(jax.grad(lambda x: signature(x).sum())(jnp.ones(3)), [0.5, 0.5, 0.5])


def test_a_symbolic_batch_needs_no_trust(tmp_path):
    # The dynamic batch of the export guide: shape_assertion; a cumulative sum over it: dynamic_reduce_window.
    batch = jax.ShapeDtypeStruct(jax.export.symbolic_shape("n, 3"), jnp.float32)
    root = {"w": varstate.Variable(jnp.arange(6.0).reshape(3, 2), name="w")}
    path = checkpoint.export(tmp_path / "m", root, {"serve": (lambda r, x: jnp.cumsum(x @ r["w"].value, 0), (batch,))})
    text = jax.export.deserialize(bytearray(pathlib.Path(_function(path)[1]).read_bytes())).mlir_module()
    assert _targets_in_text(text) == ["shape_assertion", "stablehlo.dynamic_reduce_window"]
    x = np.arange(12.0, dtype=np.float32).reshape(4, 3)
    got = checkpoint.load(path).signatures["serve"](jnp.asarray(x))
    np.testing.assert_allclose(got, np.cumsum(x @ np.arange(6.0).reshape(3, 2), 0), rtol=1e-6)


def test_a_dynamic_reduce_window_lying_about_its_type_fails_shape_refinement(tmp_path):
    # Why stablehlo.dynamic_* need no trust: jax refines them into StableHLO ops whose types are verified.
    from jax.extend import mlir as jax_mlir
    from jax.extend.mlir.dialects import stablehlo

    batch = jax.ShapeDtypeStruct(jax.export.symbolic_shape("n, 8"), jnp.float32)
    honest = jax.export.export(jax.jit(lambda x: jnp.cumsum(x, axis=0)))(batch)
    text = honest.mlir_module()
    call = re.search(r"(%\d+) = (stablehlo\.custom_call @stablehlo\.dynamic_reduce_window\(.*) -> tensor<\?x8xf32>",
                     text)
    lie = (f"%lie = {call.group(2)} -> tensor<2x8xf32>\n"
           f"    {call.group(1)} = stablehlo.convert %lie : (tensor<2x8xf32>) -> tensor<?x8xf32>")
    version = stablehlo.get_version_from_compatibility_requirement(
        stablehlo.StablehloCompatibilityRequirement.WEEK_4)
    data = jax_mlir.serialize_portable_artifact(text.replace(call.group(0), lie), version)
    lying = dataclasses.replace(honest, mlir_module_serialized=data)
    assert "-> tensor<2x8xf32>" in lying.mlir_module()
    path = checkpoint.export(tmp_path / "m", {"w": varstate.Variable(jnp.ones(8), name="w")},
                             {"serve": (lambda r, x: jnp.cumsum(x, 0) * r["w"].value, (batch,))})
    wrapped = jax.export.export(jax.jit(lambda captured, x: lying.call(x) * captured[0]))([jnp.ones(8)], batch)
    _install(path, wrapped.serialize())
    signature = checkpoint.load(path).signatures["serve"]
    with pytest.raises(ValueError, match="Error refining shapes"):
        signature(jnp.ones((1000, 8)))
