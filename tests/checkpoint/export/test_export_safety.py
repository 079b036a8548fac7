"""checkpoint.load on exports made to harm: what it refuses before anything runs, and the message it refuses with.

References: jax.export's own view of each function (its `mlir_module()` text,
its `disabled_safety_checks`), the bytes on disk, and the checks' messages.
"""

import dataclasses
import importlib
import os
import pathlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import checkpoint
import varstate
from checkpoint._export import _format, _jax_private, _load
from checkpoint.protos import saved_object_graph_pb2 as pb
from checkpoint.protos.versions_pb2 import VersionDef

BATCH = jax.ShapeDtypeStruct(jax.export.symbolic_shape("n, 3"), jnp.float32)
MADE_UP = "varstate_test_no_such_kernel"


def _serve(root, x):
    return x @ root["w"].value + root["b"].value


@pytest.fixture
def exported(tmp_path):
    root = {"w": varstate.Variable(jnp.arange(6.0).reshape(3, 2), name="w"), "b": varstate.Variable(jnp.ones(2))}
    return checkpoint.export(tmp_path / "m", root, {"serve": (_serve, (BATCH,))})


def _function_file(path):
    (name,) = os.listdir(os.path.join(path, "functions"))
    return name, os.path.join(path, "functions", name)


def _definition(path):
    return pb.ExportDef.FromString(pathlib.Path(path, "export.pb").read_bytes())


def _edit(path, change):
    """Rewrites export.pb through `change(definition)` and seals it again: an attacker can do all that."""
    definition = _definition(path)
    definition.DiscardUnknownFields()
    change(definition)
    pathlib.Path(path, "export.pb").write_bytes(_format.seal(definition.SerializeToString()))


def _replace_function(path, exported):
    """Puts `exported` in place of the export's function, with its sha256 in export.pb (a crafted export)."""
    import hashlib

    name, file = _function_file(path)
    data = exported.serialize()
    pathlib.Path(file).write_bytes(data)
    _edit(path, lambda d: d.function_sha256.__setitem__(name, hashlib.sha256(data).digest()))


def _original(path):
    return jax.export.deserialize(bytearray(pathlib.Path(_function_file(path)[1]).read_bytes()))


def _targets_in_text(exported):
    """The reference: custom-call targets as jax prints the module (pretty form `stablehlo.custom_call @target(`)."""
    return sorted(re.findall(r"stablehlo\.custom_call @([\w.$]+)\(", exported.mlir_module()))


# --- custom calls ----------------------------------------------------------------------
def _crafted(path, target=MADE_UP):
    """A function with the export's calling convention that calls XLA custom call `target`.

    jax.export refuses to serialize it unless the safety check for that target is disabled, which the crafted file
    then records; the loader must not take the file's word for it.
    """
    original = _original(path)
    captured = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in original.in_avals[:-1]]

    def fn(captured, x):
        return jax.ffi.ffi_call(target, jax.ShapeDtypeStruct((x.shape[0], 2), x.dtype))(x) + captured[0][0]

    with pytest.raises(ValueError, match="custom calls whose targets have no compatibility guarantees"):
        jax.export.export(jax.jit(fn))(captured, BATCH)
    disabled = [jax.export.DisabledSafetyCheck.custom_call(target)]
    crafted = jax.export.export(jax.jit(fn), disabled_checks=disabled)(captured, BATCH)
    assert crafted.in_tree == original.in_tree
    assert set(_targets_in_text(crafted)) - _jax_private.stable_custom_call_targets() == {target}
    return crafted


def test_a_custom_call_outside_jaxs_allow_list_is_refused_at_load(exported):
    crafted = _crafted(exported)
    _replace_function(exported, crafted)
    back = jax.export.deserialize(bytearray(pathlib.Path(_function_file(exported)[1]).read_bytes()))
    assert back.disabled_safety_checks == crafted.disabled_safety_checks != ()  # the file vouches for itself
    want = (rf"{re.escape(_function_file(exported)[1])}: signature 'serve' calls XLA custom call target\(s\) "
            rf"\['{MADE_UP}'\], which jax\.export does not accept without a disabled safety check \(JAX "
            rf"{re.escape(jax.__version__)} accepts \d+ stable targets\); load refuses it before anything runs, as "
            r"calling an unknown target can crash the process\. Export the function again without custom calls")
    with pytest.raises(checkpoint.CheckpointFormatError, match=want):
        checkpoint.load(exported)


def test_custom_calls_on_jaxs_allow_list_load_and_run(tmp_path):
    # lapack's LU (jnp.linalg.solve on CPU), inside a lax.cond branch: the scan reaches nested regions.
    root = {"a": varstate.Variable(jnp.array([[3.0, 1.0], [1.0, 2.0]]))}

    def solve(r, b, flag):
        return jax.lax.cond(flag, lambda: jnp.linalg.solve(r["a"].value, b), lambda: b)

    path = checkpoint.export(tmp_path / "m", root, {"solve": (solve, (jnp.ones(2), jnp.bool_(True)))})
    original = _original(path)
    assert sorted(_load.custom_call_targets(original, "here")) == _targets_in_text(original) != []
    assert set(_targets_in_text(original)) <= _jax_private.stable_custom_call_targets()
    b = jnp.array([9.0, 8.0])
    got = checkpoint.load(path, trust_custom_calls=True).signatures["solve"](b, jnp.bool_(True))
    np.testing.assert_allclose(got, np.linalg.solve(np.asarray(root["a"].value), b), rtol=1e-6)


def test_an_unreadable_module_is_a_format_error(exported):
    _replace_function(exported, dataclasses.replace(_original(exported), mlir_module_serialized=b"not stablehlo"))
    with pytest.raises(checkpoint.CheckpointFormatError, match=r"functions/\w+: its StableHLO module cannot be read"):
        checkpoint.load(exported)


def test_a_jax_without_the_allow_list_is_named(exported, monkeypatch):
    real = importlib.import_module

    def without_private(name, *args):
        if name.startswith("jax._src"):
            raise ImportError(name)
        return real(name, *args)

    monkeypatch.setattr(importlib, "import_module", without_private)
    want = (r"checkpoint's export needs jax internal jax\._src\.export\._export\._CUSTOM_CALL_TARGETS_GUARANTEED_STABLE"
            rf", which JAX {re.escape(jax.__version__)} does not have; it is the list of custom calls a loaded "
            r"function may make\. Install a JAX release that has it")
    with pytest.raises(_jax_private.JaxInternalsError, match=want):
        checkpoint.load(exported)
    with pytest.raises(_jax_private.JaxInternalsError, match=r"jax\._src\.config\.hlo_source_file_canonicalization_"
                                                             r"regex, .*keeps the exporting machine's directories out"):
        root = {"w": varstate.Variable(jnp.ones((3, 2))), "b": varstate.Variable(jnp.ones(2))}
        checkpoint.export(exported + "2", root, {"f": (_serve, (BATCH,))})
    assert not os.path.exists(exported + "2")


# --- export.pb's sha256 -------------------------------------------------------------------
def test_export_pb_ends_with_its_sha256(exported):
    import hashlib

    data = pathlib.Path(exported, "export.pb").read_bytes()
    assert data[-34:-32] == bytes([0x7A, 32]) and data[-32:] == hashlib.sha256(data[:-34]).digest()
    definition = pb.ExportDef.FromString(data)  # any protobuf reader skips the trailer
    assert definition.version.producer == 2 and definition.version.min_consumer == 1
    assert definition.object_graph == pb.ExportDef.FromString(data[:-34]).object_graph


def test_a_changed_export_pb_is_refused(exported):
    file = pathlib.Path(exported, "export.pb")
    good = file.read_bytes()
    assert b"sErve" not in good and b"serve" in good
    file.write_bytes(good.replace(b"serve", b"sErve"))  # still a valid ExportDef, one name changed
    assert pb.ExportDef.FromString(file.read_bytes()).object_graph.nodes
    changed = rf"{re.escape(str(file))}: does not match the sha256 at its end, as an export of format version 2 must"
    with pytest.raises(checkpoint.CheckpointFormatError, match=changed + r" \(it was modified, truncated or is "
                                                                         r"corrupt\); export the model again\."):
        checkpoint.load(exported)
    file.write_bytes(good[:-34])  # without its trailer
    with pytest.raises(checkpoint.CheckpointFormatError, match=r"export\.pb: does not end with its sha256, as an "
                                                               r"export of format version 2 must"):
        checkpoint.load(exported)


def test_a_version_1_export_without_a_sha256_still_loads(exported):
    definition = _definition(exported)
    definition.DiscardUnknownFields()
    definition.version.CopyFrom(VersionDef(producer=1, min_consumer=1))
    pathlib.Path(exported, "export.pb").write_bytes(definition.SerializeToString())
    x = jnp.ones((2, 3))
    np.testing.assert_array_equal(checkpoint.load(exported).signatures["serve"](x), x @ jnp.arange(6.0).reshape(3, 2)
                                  + 1)


# --- files that are not what they seem --------------------------------------------------
def _asset_export(tmp_path):
    (tmp_path / "vocab.txt").write_text("a b c")
    return checkpoint.export(tmp_path / "m", {"vocab": checkpoint.Asset(tmp_path / "vocab.txt")})


def test_a_linked_assets_directory_is_refused(tmp_path):
    path = _asset_export(tmp_path)
    os.rename(os.path.join(path, "assets"), tmp_path / "elsewhere")
    os.symlink("/etc", os.path.join(path, "assets"))  # with the asset named "passwd": /etc/passwd
    _edit(path, lambda d: setattr(d.asset_file_def[0], "filename", "passwd"))
    want = (r"node 1 \(\(root\)\.vocab\): the assets directory is a symbolic link \(.*/m/assets\), which load "
            r"refuses: it could point anywhere\. Copy the file itself into the export\.")
    with pytest.raises(checkpoint.CheckpointFormatError, match=want):
        checkpoint.load(path)
    os.remove(os.path.join(path, "assets"))
    with pytest.raises(checkpoint.CheckpointFormatError, match=r"the assets directory is missing from the export"):
        checkpoint.load(path)


def test_an_asset_that_is_a_link_or_not_a_file_is_refused(tmp_path):
    path = _asset_export(tmp_path)
    asset = os.path.join(path, "assets", "vocab.txt")
    assert pathlib.Path(checkpoint.load(path).vocab.asset_path).read_text() == "a b c"
    os.remove(asset)
    os.symlink("/etc/passwd", asset)
    with pytest.raises(checkpoint.CheckpointFormatError, match=r"asset 'vocab\.txt' is a symbolic link"):
        checkpoint.load(path)
    os.remove(asset)
    os.mkfifo(asset)
    with pytest.raises(checkpoint.CheckpointFormatError, match=r"asset 'vocab\.txt' \(.*\) is a named pipe, "
                                                               r"expected a regular file"):
        checkpoint.load(path)
    os.remove(asset)
    with pytest.raises(checkpoint.CheckpointFormatError, match=r"asset 'vocab\.txt' is missing from the export"):
        checkpoint.load(path)


def test_a_function_file_must_be_a_bounded_regular_file(exported):
    _, file = _function_file(exported)
    what = re.escape(f"{file}: the export's function file of signature 'serve'")
    os.remove(file)
    os.symlink("/dev/zero", file)  # read whole, this was a MemoryError
    with pytest.raises(checkpoint.CheckpointFormatError, match=what + " is a symbolic link, which load refuses"):
        checkpoint.load(exported)
    os.remove(file)
    os.mkfifo(file)  # opened without O_NONBLOCK, this would wait for a writer forever
    with pytest.raises(checkpoint.CheckpointFormatError, match=what + r" is not a regular file \(found a named pipe\)"):
        checkpoint.load(exported)
    os.remove(file)
    with open(file, "wb") as f:
        f.truncate(_format.MAX_FILE_BYTES + 1)  # sparse: no disk used
    with pytest.raises(checkpoint.CheckpointFormatError, match=what + f" is {2**31} bytes, over the {2**31 - 1}-byte "
                                                                      "limit of the format"):
        checkpoint.load(exported)
    os.remove(file)
    with pytest.raises(checkpoint.CheckpointFormatError, match=what + r" is missing \(the export is incomplete\)"):
        checkpoint.load(exported)


def test_a_linked_functions_directory_reaches_no_device(exported):
    # The link is in a directory above the file: O_NOFOLLOW does not see it, the file's own type does.
    name, _ = _function_file(exported)
    functions = os.path.join(exported, "functions")
    os.rename(functions, functions + ".old")
    os.symlink("/dev", functions)

    def rename(d):
        d.object_graph.concrete_functions["zero"].CopyFrom(d.object_graph.concrete_functions[name])
        d.function_sha256["zero"] = b""
        _bare(d).concrete_function_name = "zero"

    _edit(exported, rename)
    with pytest.raises(checkpoint.CheckpointFormatError, match=r"/functions/zero: the export's function file of "
                                                               r"signature 'serve' is not a regular file \(found a "
                                                               r"character device\)"):
        checkpoint.load(exported)


def _bare(definition):
    return next(n.bare_concrete_function for n in definition.object_graph.nodes
                if n.WhichOneof("kind") == "bare_concrete_function")


def test_export_pb_must_be_a_regular_file(exported):
    file = os.path.join(exported, "export.pb")
    os.remove(file)
    os.symlink("/dev/zero", file)
    with pytest.raises(checkpoint.CheckpointFormatError, match=r"export\.pb: the export's export\.pb is a symbolic "
                                                               r"link"):
        checkpoint.load(exported)
    os.remove(file)
    os.mkfifo(file)
    with pytest.raises(checkpoint.CheckpointFormatError, match=r"is not a regular file \(found a named pipe\)"):
        checkpoint.load(exported)


# --- what the files say about the machine that wrote them ------------------------------------
def test_function_files_carry_no_paths_of_the_exporting_machine(exported):
    here = os.path.dirname(os.path.abspath(__file__))
    repo = os.path.dirname(os.path.dirname(os.path.abspath(checkpoint.__file__)))
    for file in pathlib.Path(exported).rglob("*"):
        if file.is_file():
            data = file.read_bytes()
            for secret in (here, repo, os.path.abspath(__file__)):
                assert secret.encode() not in data, (file, secret)
    # Locations stay, as file name and line: jax's own printing of the module is the reference.
    text = _original(exported).mlir_module()
    assert re.search(r'loc\("test_export_safety\.py":\d+:\d+', text), text
    assert f'"{os.path.abspath(__file__)}"' not in text


def test_names_from_the_file_stay_inside_the_export(exported, tmp_path, capsys):
    import checkpoint._cli._main as cli

    name, _ = _function_file(exported)

    def escape(d):
        d.object_graph.concrete_functions["../../escape"].CopyFrom(d.object_graph.concrete_functions[name])
        _bare(d).concrete_function_name = "../../escape"

    _edit(exported, escape)
    with pytest.raises(checkpoint.CheckpointFormatError, match=r"names concrete function '\.\./\.\./escape', which "
                                                               r"the export does not have"):
        checkpoint.load(exported)
    assert cli.main(["inspect", exported]) == 2  # the CLI reads functions through the same check
    err = capsys.readouterr().err
    assert re.fullmatch(r"varstate-ckpt: error: .*export\.pb: signature 'serve' names function '\.\./\.\./escape', "
                        r"which is not a function file name \(\[A-Za-z0-9_\]\+\); refusing it\.\n", err), err
    (tmp_path / "a").mkdir()
    asset = _asset_export(tmp_path / "a")
    _edit(asset, lambda d: setattr(d.asset_file_def[0], "filename", "vocab.txt\0.png"))
    with pytest.raises(checkpoint.CheckpointFormatError, match=r"asset file name 'vocab\.txt\\x00\.png' leads outside"):
        checkpoint.load(asset)
