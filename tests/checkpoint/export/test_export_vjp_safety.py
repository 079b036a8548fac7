"""checkpoint.load checks every function an export file carries: the function and its VJPs, before anything runs."""

import hashlib
import os
import pathlib
import re

import jax
import jax.numpy as jnp
import pytest

import checkpoint
import varstate
from checkpoint._export import _format, _jax_private, _load
from checkpoint.protos import saved_object_graph_pb2 as pb

CALLBACK = "xla_ffi_python_cpu_callback"  # what jax.pure_callback lowers to on CPU


def _never(x):
    raise AssertionError("the crafted callback ran")


def _serve(root, x):
    return x * root["w"].value


@pytest.fixture
def exported(tmp_path):
    return checkpoint.export(tmp_path / "m", {"w": varstate.Variable(jnp.ones(3), name="w")},
                             {"serve": (_serve, (jnp.zeros(3),))})


def _install(path, data):
    """`data` in place of the export's function file, with its sha256 in export.pb sealed again (a crafted export)."""
    (name,) = os.listdir(os.path.join(path, "functions"))
    pathlib.Path(path, "functions", name).write_bytes(data)
    definition = pb.ExportDef.FromString(pathlib.Path(path, "export.pb").read_bytes())
    definition.DiscardUnknownFields()
    definition.function_sha256[name] = hashlib.sha256(data).digest()
    pathlib.Path(path, "export.pb").write_bytes(_format.seal(definition.SerializeToString()))
    return os.path.join(path, "functions", name)


def _with_vjp(backward):
    """The export's calling convention, `x * w`, whose VJP's cotangent for x is `backward(g)`."""
    @jax.custom_vjp
    def serve(captured, x):
        return x * captured[0]

    serve.defvjp(lambda captured, x: (serve(captured, x), captured),
                 lambda captured, g: ([jnp.zeros_like(captured[0])], backward(g)))
    return serve


def test_pure_callback_lowers_to_the_target_the_crafted_file_calls():
    lowered = jax.jit(lambda x: jax.pure_callback(_never, jax.ShapeDtypeStruct((3,), jnp.float32), x)).lower(
        jnp.zeros(3, jnp.float32))
    assert f"custom_call @{CALLBACK}(" in lowered.as_text()
    assert CALLBACK not in _jax_private.stable_custom_call_targets()


def test_a_vjp_calling_a_host_callback_is_refused_before_anything_runs(exported):
    # The callback's own lowering carries a pointer into the exporting process, which jax.export refuses to
    # serialize; a crafted file calls the same target through ffi_call, main function benign.
    crafted = _with_vjp(lambda g: jax.ffi.ffi_call(CALLBACK, jax.ShapeDtypeStruct(g.shape, g.dtype))(g))
    disabled = [jax.export.DisabledSafetyCheck.custom_call(CALLBACK)]
    function = jax.export.export(jax.jit(crafted), disabled_checks=disabled)([jnp.ones(3)], jnp.zeros(3))
    assert CALLBACK not in function.mlir_module() and CALLBACK in function.vjp().mlir_module()
    file = _install(exported, function.serialize(vjp_order=1))
    want = (rf"{re.escape(file)}: signature 'serve' \(its VJP of order 1\) calls XLA custom call target\(s\) "
            rf"\['{CALLBACK}'\], which jax\.export does not accept without a disabled safety check .*; load refuses it "
            r"before anything runs, as calling an unknown target can crash the process\.")
    with pytest.raises(checkpoint.CheckpointFormatError, match=want):
        checkpoint.load(exported)


def test_vjps_within_the_bound_load_and_differentiate(exported):
    function = jax.export.export(jax.jit(_with_vjp(lambda g: 2 * g)))([jnp.ones(3)], jnp.zeros(3))
    _install(exported, function.serialize(vjp_order=1))
    signature = checkpoint.load(exported).signatures["serve"]
    assert jax.grad(lambda x: signature(x).sum())(jnp.ones(3)).tolist() == [2.0, 2.0, 2.0]


def test_a_vjp_chain_past_the_bound_is_refused(exported, monkeypatch):
    monkeypatch.setattr(_load, "MAX_VJP_ORDER", 1)
    function = jax.export.export(jax.jit(lambda captured, x: x * captured[0]))([jnp.ones(3)], jnp.zeros(3))
    file = _install(exported, function.serialize(vjp_order=2))
    with pytest.raises(checkpoint.CheckpointFormatError, match=re.escape(
            f"{file}: signature 'serve' carries VJPs past order 1, the most load accepts; export the function again "
            "serialized with vjp_order at most 1.")):
        checkpoint.load(exported)
