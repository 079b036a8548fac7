"""Orbax-format checkpoints that are damaged, or written by someone else: DataLossError naming checkpoint and key.

Each case is checked against the values saved (the reference) and by its whole message: what is wrong, where,
what was expected and found, and what to do.
"""

import json
import os
import re
import shutil

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import checkpoint
import varstate
from checkpoint import CheckpointFormatError, DataLossError
from checkpoint._storage import _orbax

META = _orbax.META_FILE
W, S, P, N = ("w/.ATTRIBUTES/VARIABLE_VALUE", "s/.ATTRIBUTES/VARIABLE_VALUE", "p/.ATTRIBUTES/VARIABLE_VALUE",
              "epoch/.ATTRIBUTES/py_state")


def _tree():
    return {"w": np.arange(300_000, dtype=np.float32), "s": np.array([1.5, -2.0, 3.25], np.float32), "epoch": 12,
            "p": varstate.PartitionedVariable(jnp.arange(70.0).reshape(10, 7), name="p", num_shards=2)}


@pytest.fixture
def saved(tmp_path):
    return checkpoint.Checkpoint(**_tree()).write(str(tmp_path / "c"))


def _meta(path):
    with open(os.path.join(path, META)) as f:
        return json.load(f)


def _put_meta(path, meta, seal=True):
    with open(os.path.join(path, META), "w") as f:
        json.dump(_orbax.seal(meta) if seal else meta, f)


def _restore(path):
    return checkpoint.Checkpoint(**{k: (0 if k == "epoch" else np.zeros_like(np.asarray(v)) if k != "p" else
                                        varstate.PartitionedVariable(jnp.zeros((10, 7)), name="p", num_shards=2))
                                    for k, v in _tree().items()}).restore(path)


def _raises(cls, message, fn, *args):
    with pytest.raises(cls) as info:
        fn(*args)
    assert re.fullmatch(message, str(info.value)), str(info.value)
    assert len(str(info.value)) < 1000  # a sentence, not a page of tensorstore's output
    return info.value


def test_the_reference_restores(saved):
    status = _restore(saved).assert_consumed()
    assert status.epoch == 12 and status.s.tolist() == [1.5, -2.0, 3.25]
    assert np.array_equal(status.w, np.arange(300_000, dtype=np.float32))
    assert _meta(saved)["version"] == 2 == _orbax.VERSION


def test_one_flipped_bit_in_a_python_value_fails_the_metadata_checksum(saved):
    # '1' ^ 0x04 is '5': epoch 12 would restore as 52, and assert_consumed would pass.
    with open(os.path.join(saved, META), "rb") as f:
        raw = f.read()
    at = raw.index(b'"value": 12') + len(b'"value": ')
    with open(os.path.join(saved, META), "wb") as f:
        f.write(raw[:at] + bytes([raw[at] ^ 0x04]) + raw[at + 1:])
    assert _meta(saved)["entries"][N]["value"] == 52
    crc = _meta(saved)["crc32c"]
    _raises(DataLossError, rf"Checkpoint '{saved}': meta/metadata is corrupted \(meta/metadata fails its crc32c "
                           rf"\(0x[0-9a-f]{{8}}, stored {crc}\)\); a value stored in it, or the object graph, may be "
                           r"wrong\. Restore an older checkpoint\.", _restore, saved)


def test_one_flipped_bit_in_the_object_graph_fails_the_checksum(saved):
    meta = _meta(saved)
    graph = meta["object_graph"]
    meta["object_graph"] = graph[:10] + ("B" if graph[10] != "B" else "C") + graph[11:]
    _put_meta(saved, meta, seal=False)
    _raises(DataLossError, r".*meta/metadata is corrupted \(meta/metadata fails its crc32c .*", _restore, saved)


def test_a_damaged_entry_is_named_even_when_the_checksum_fails_too(saved):
    meta = _meta(saved)
    meta["entries"][S]["pack"] = 7
    _put_meta(saved, meta, seal=False)
    _raises(DataLossError, rf"Checkpoint '{saved}': meta/metadata is corrupted \(ValueError: entry '{S}': no pack 7\); "
                           r"meta/metadata fails its crc32c \(0x[0-9a-f]{8}, stored \d+\) as well\. Restore an older "
                           r"checkpoint\.", _restore, saved)


def test_version_1_checkpoints_without_a_checksum_still_read_and_are_checked_as_strictly(saved):
    # Written before the checksum: accepted, as safe as before (every entry is checked), but a flipped bit in a
    # Python value of one is not caught. A version 2 file without its checksum is damage.
    meta = _meta(saved)
    del meta["crc32c"]
    _put_meta(saved, dict(meta, version=1), seal=False)
    assert _restore(saved).assert_consumed().epoch == 12
    _put_meta(saved, meta, seal=False)
    _raises(DataLossError, rf"Checkpoint '{saved}': meta/metadata is corrupted \(meta/metadata has no crc32c, which "
                           r"every version 2 checkpoint holds\); a value stored in it, or the object graph, may be "
                           r"wrong\. Restore an older checkpoint\.", _restore, saved)
    meta["entries"][S]["dtype"] = "object"
    _put_meta(saved, dict(meta, version=1), seal=False)
    _raises(DataLossError, rf"Checkpoint '{saved}': meta/metadata is corrupted \(ValueError: Checkpoint value '{S}' "
                           r"has unsupported dtype 'object'\.\)\. Restore an older checkpoint\.", _restore, saved)
    _put_meta(saved, dict(meta, version=0), seal=False)
    _raises(DataLossError, rf"Checkpoint '{saved}': meta/metadata is corrupted \(format version 0 does not exist\)\.",
            _restore, saved)


def test_newer_versions_are_refused_and_a_bad_checksum_says_it_may_be_either(saved):
    meta = _meta(saved)
    _put_meta(saved, dict(meta, version=3))
    error = _raises(ValueError, rf"Checkpoint '{saved}' has format version 3, newer than this reader's 2: upgrade "
                                r"varstate to read it\.", _restore, saved)
    assert not isinstance(error, DataLossError)
    _put_meta(saved, dict(meta, version=3), seal=False)  # a flipped bit in "2" also reads as 3
    error = _raises(CheckpointFormatError, rf"Checkpoint '{saved}' has format version 3, newer than this reader's 2, "
                                           r"or its meta/metadata is corrupted \(it fails its crc32c\): upgrade "
                                           r"varstate to read it, or restore an older checkpoint\.", _restore, saved)
    assert isinstance(error, DataLossError) and isinstance(error, ValueError)
    _put_meta(saved, dict(meta, version="2"))
    _raises(DataLossError, rf"Checkpoint '{saved}': meta/metadata is corrupted \(its format version '2' is not an "
                           r"integer\)\.", _restore, saved)


@pytest.mark.parametrize("edit, detail", [
    # a file from someone else: its checksum is right, the checks must hold without it
    (lambda m: m["entries"][W].update(shape=[2 ** 40]),
     rf"cannot read stored values: value '{W}' is stored as \(300000,\) float32, its metadata says \(1099511627776,\) "
     r"float32\. The checkpoint is corrupted\."),
    (lambda m: m["entries"][W].update(shape=[2 ** 60]),
     rf"meta/metadata is corrupted \(ValueError: entry '{W}': bad shape \[1152921504606846976\]\)\. Restore an "
     r"older checkpoint\."),
    (lambda m: m["entries"][W].update(shape=[1] * 65),
     rf"meta/metadata is corrupted \(ValueError: entry '{W}': bad shape \[1, 1, .*\.\.\. \(195 characters\)\)\. .*"),
    (lambda m: m["entries"][P].update(shape=[2 ** 40, 7], slices=[dict(m["entries"][P]["slices"][0],
                                                                        shape=[2 ** 40, 7], spec="1099511627776 7 "
                                                                        "0,1099511627776:0,7")]),
     rf"meta/metadata is corrupted \(ValueError: entry '{P}': bytes \[0, \+30786325577728\) lie outside pack 0\)\. "
     r"Restore an older checkpoint\."),
    (lambda m: m.update(packs=[1 << 50]),
     r"cannot read stored values: value '.*' lies in pack 0, which holds \d+ bytes; the metadata says "
     r"1125899906842624\. The checkpoint is corrupted\."),
    (lambda m: m["entries"][W].update(dtype="float64"),
     rf"cannot read stored values: value '{W}' is stored as \(300000,\) float32, its metadata says \(300000,\) "
     r"float64\. The checkpoint is corrupted\."),
    (lambda m: m["entries"][S].update(array="a0"),
     rf"meta/metadata is corrupted \(ValueError: entry '{W}': array 'a0' holds another value too\)\. Restore an "
     r"older checkpoint\."),
    (lambda m: m["entries"][N].update(value="\udc80", python="str"),
     rf"meta/metadata is corrupted \(ValueError: entry '{N}': value is not UTF-8 text \(it holds a lone "
     r"surrogate\)\)\. .*"),
    (lambda m: m["entries"][N].update(python=["int"]),
     rf"meta/metadata is corrupted \(ValueError: entry '{N}': unknown Python type \['int'\]\)\. .*"),
    (lambda m: m["entries"][P]["slices"][1].update(dtype="float64"),
     rf"meta/metadata is corrupted \(ValueError: entry '{P}': a slice of float32 holds float64\)\. .*"),
    (lambda m: m["entries"][P]["slices"][1].update(spec="x" * 500),
     rf"meta/metadata is corrupted \(ValueError: Invalid slice spec 'x{{100}}'\.\.\. \(500 characters\) for '{P}': "
     r"expected e\.g\. '10 4 0,4:0,4'\.\)\. .*"),
    (lambda m: m["entries"][S].update(crc32c=2 ** 32), rf"meta/metadata is corrupted \(ValueError: entry '{S}': no "
                                                       r"crc32c\)\. .*"),
    (lambda m: m.update(object_graph="!!"), r"meta/metadata is corrupted \(Error: its object graph cannot be read "
                                            r"\(Only base64 data is allowed\)\)\. .*"),
    (lambda m: m.update(object_graph=7), r"meta/metadata is corrupted \(TypeError: its object graph is a int, not a "
                                         r"string\)\. .*"),
    (lambda m: m.update(packs=[True]), r"meta/metadata is corrupted \(ValueError: bad pack sizes \[True\]\)\. .*"),
    (lambda m: m.update(format="other"), r"meta/metadata is corrupted \(ValueError: format 'other', not "
                                         r"'varstate-orbax'\)\. .*"),
    (lambda m: m["entries"].update(x={"python": "int", "value": [[[[[[[[[[[[[[[[[[1]]]]]]]]]]]]]]]]]]}),
     r"meta/metadata is corrupted \(its JSON is nested deeper than 16 levels; this format uses 6\)\."),
])
def test_lying_metadata_with_a_good_checksum_is_refused_before_anything_is_allocated(saved, edit, detail):
    meta = _meta(saved)
    edit(meta)
    _put_meta(saved, meta)
    _raises(DataLossError, rf"Checkpoint '{saved}': {detail}", _restore, saved)


def test_json_too_deep_for_the_parser_and_numbers_too_long_are_data_loss_errors(saved):
    for text, detail in (("[" * 100_000 + "]" * 100_000, r"its JSON is nested too deeply"),
                         ('{"a": ' + "1" * 5000 + "}", r"Exceeds the limit \(4300 digits\) for integer string "
                                                        r"conversion: value has 5000 digits; .*"),
                         ("\xff{", r"'utf-8' codec can't decode byte 0xff in position 0: invalid start byte")):
        with open(os.path.join(saved, META), "wb") as f:
            f.write(text.encode("latin-1"))
        _raises(DataLossError, rf"Checkpoint '{saved}': meta/metadata is corrupted \({detail}\)\.", _restore, saved)


def _value_files(path):
    out = []
    for root, _, names in os.walk(os.path.join(path, "values")):
        out += [os.path.join(root, n) for n in names]
    return out


def _bytes(name):
    with open(name, "rb") as f:
        return f.read()


def _holding(path, data: bytes):
    return [f for f in _value_files(path) if data in _bytes(f)]


def test_a_truncated_or_deleted_value_file_names_the_checkpoint_and_the_values(saved):
    (big,) = _holding(saved, np.arange(1000, 2000, dtype=np.float32).tobytes())
    original = _bytes(big)
    for damage in (original[: len(original) // 2], None):
        if damage is None:
            os.remove(big)
        else:
            with open(big, "wb") as f:
                f.write(damage)
        _raises(DataLossError, rf"Checkpoint '{saved}': cannot read stored values \('{W}', '.*'\): they "
                               rf"take \d+ bytes, but the files under {saved}/values hold \d+: a value file is "
                               r"truncated or missing\. The value files are damaged; restore an older checkpoint\.",
                _restore, saved)


def test_a_value_file_cut_by_a_few_bytes_and_damaged_orbax_files_are_data_loss_errors(tmp_path):
    # Too little missing for the size check: tensorstore's read fails, naming the value it was reading.
    path = checkpoint.Checkpoint(**_tree()).write(str(tmp_path / "c"))
    w = np.arange(300_000, dtype=np.float32).tobytes()
    (big,) = _holding(path, w)
    with open(big, "r+b") as f:
        start = f.read().index(w)  # where tensorstore put it: after the other values it wrote first, if any
        f.truncate(start + len(w) - 8)
    _raises(DataLossError, rf"Checkpoint '{path}': cannot read stored values \('{W}'\): OUT_OF_RANGE: Error reading "
                           rf"\"a0/0\" in OCDBT database at local file \"{path}/values/\": Requested byte range "
                           rf"\[{start}, {start + len(w)}\) is not valid for value of size {start + len(w) - 8}\. The "
                           r"value files are damaged; restore an older checkpoint\.", _restore, path)
    path = checkpoint.Checkpoint(**_tree()).write(str(tmp_path / "m"))
    with open(os.path.join(path, "values", "manifest.ocdbt"), "r+b") as f:
        f.truncate(20)
    _raises(DataLossError, rf"Checkpoint '{path}': cannot read stored values \('.*'\): DATA_LOSS: Error opening "
                           r"\"zarr\" driver: .*\. The value files are damaged; restore an older checkpoint\.",
            _restore, path)


def test_values_from_another_checkpoint_fail_their_checksum(tmp_path):
    good = checkpoint.Checkpoint(**_tree()).write(str(tmp_path / "good"))
    other = checkpoint.Checkpoint(**dict(_tree(), s=np.array([9.0, 9.0, 9.0], np.float32))).write(str(tmp_path / "o"))
    shutil.rmtree(os.path.join(good, "values"))
    shutil.copytree(os.path.join(other, "values"), os.path.join(good, "values"))
    _raises(DataLossError, rf"Checkpoint '{good}': checksum mismatch for '{S}' \(crc32c 0x[0-9a-f]{{8}}, expected "
                           r"0x[0-9a-f]{8}\); the checkpoint is corrupted\. Restore an older checkpoint\.",
            _restore, good)


def test_a_large_values_checksum_taken_beside_orbaxs_write_is_in_the_sealed_metadata(saved):
    # A synchronous save checksums an array stored on its own while orbax writes it, then rewrites the metadata.
    meta = _meta(saved)
    assert meta["entries"][W]["crc32c"] == _orbax.crc32c(np.arange(300_000, dtype=np.float32))
    assert meta["crc32c"] == _orbax.crc32c(_orbax.canonical(meta))
    data = np.arange(300_000, dtype=np.float32).tobytes()
    for root, _, names in os.walk(os.path.join(saved, "values")):
        for name in names:
            with open(os.path.join(root, name), "r+b") as f:
                content = f.read()
                if data in content:
                    f.seek(content.index(data) + 4 * 1234)
                    f.write(np.float32(-1.0).tobytes())
    _raises(DataLossError, rf"Checkpoint '{saved}': checksum mismatch for '{W}' \(crc32c 0x[0-9a-f]{{8}}, expected "
                           rf"{meta['entries'][W]['crc32c']:#010x}\); the checkpoint is corrupted\. Restore an older "
                           r"checkpoint\.", _restore, saved)


def test_a_failed_save_returns_only_once_no_checksum_reads_the_arrays(tmp_path, monkeypatch):
    # The caller may donate the arrays as soon as the error reaches it: the checksums taken beside the write must
    # be over by then.
    import time

    import orbax.checkpoint as ocp

    from checkpoint._storage import _orbax_layout

    done = []

    def slow_checksum(value):
        time.sleep(0.2)
        done.append(value.shape)
        return 0

    def failing_save(self, *args, **kwargs):
        raise OSError("disk full (test)")

    monkeypatch.setattr(_orbax_layout, "_checksum", slow_checksum)
    monkeypatch.setattr(ocp.Checkpointer, "save", failing_save)
    with pytest.raises(OSError, match=r"disk full \(test\)"):
        checkpoint.Checkpoint(**_tree()).write(str(tmp_path / "c"))
    assert done == [(300_000,)]  # w, the one array stored on its own, was checksummed before write returned
    assert not os.path.exists(tmp_path / "c")


def test_the_metadata_must_be_a_regular_file_of_bounded_size_inside_the_checkpoint(saved, tmp_path, monkeypatch):
    meta_file = os.path.join(saved, META)
    os.rename(meta_file, tmp_path / "elsewhere")
    os.symlink(tmp_path / "elsewhere", meta_file)  # outside the checkpoint
    _raises(CheckpointFormatError, rf"{meta_file}: a symlink to {tmp_path}/elsewhere, outside the checkpoint's "
                                   rf"directory {saved}; a checkpoint may only use files in its own directory\. Copy "
                                   r"the file into it instead of linking\.", _restore, saved)
    os.remove(meta_file)
    os.symlink("../../elsewhere", meta_file)  # relative, and still outside
    _raises(CheckpointFormatError, rf"{meta_file}: a symlink to {tmp_path}/elsewhere, outside .*", _restore, saved)
    os.remove(meta_file)
    os.rename(tmp_path / "elsewhere", os.path.join(saved, "real_meta"))
    os.symlink("../real_meta", meta_file)  # a link within the checkpoint is followed
    assert _restore(saved).epoch == 12
    os.remove(meta_file)
    os.mkfifo(meta_file)  # would block a plain open() forever
    _raises(CheckpointFormatError, rf"{meta_file}: the checkpoint's metadata is not a regular file \(it is a FIFO\); a "
                                   r"checkpoint's files must be plain files", _restore, saved)
    os.remove(meta_file)
    shutil.copy(os.path.join(saved, "real_meta"), meta_file)
    monkeypatch.setattr(_orbax, "_META_LIMIT", 100)
    size = os.path.getsize(meta_file)
    _raises(CheckpointFormatError, rf"{meta_file}: the checkpoint's metadata is {size} bytes, more than the 100 this "
                                   r"reader accepts; it is not one this library wrote", _restore, saved)


def test_value_files_must_be_regular_files_inside_the_checkpoint(saved, tmp_path):
    manifest = os.path.join(saved, "values", "manifest.ocdbt")
    shutil.move(manifest, tmp_path / "manifest")
    os.symlink(tmp_path / "manifest", manifest)
    _raises(CheckpointFormatError, rf"{manifest}: a symlink to {tmp_path}/manifest, outside the checkpoint's "
                                   rf"directory {saved}; .*", _restore, saved)
    os.remove(manifest)
    os.symlink("/dev/zero", manifest)
    _raises(CheckpointFormatError, rf"{manifest}: a symlink to /dev/zero, outside .*", _restore, saved)
    os.remove(manifest)
    os.mkfifo(manifest)
    _raises(CheckpointFormatError, rf"{manifest}: is a FIFO, not a regular file; a checkpoint's files must be plain "
                                   r"files", _restore, saved)
    os.remove(manifest)
    os.symlink("/nowhere", os.path.join(saved, "values", "d", "x"))
    _raises(CheckpointFormatError, rf"{saved}/values/d/x: a symlink to /nowhere, outside .*", _restore, saved)
    os.remove(os.path.join(saved, "values", "d", "x"))
    shutil.rmtree(os.path.join(saved, "values"))
    _raises(DataLossError, rf"Checkpoint '{saved}': cannot read stored values \('.*'\): the values directory is "
                           r"missing\. The value files are damaged; restore an older checkpoint\.", _restore, saved)


@pytest.mark.parametrize("size", [3, 300_000], ids=["packed", "own-array"])
def test_every_dtype_passes_the_stored_shape_and_dtype_checks(tmp_path, size):
    values = {name.replace("_", ""): np.arange(size).astype(dtype) for name, dtype in [
        ("f32", np.float32), ("f64", np.float64), ("i8", np.int8), ("u64", np.uint64), ("c64", np.complex64),
        ("bf16", ml_dtypes.bfloat16), ("f8", ml_dtypes.float8_e4m3fn), ("i4", ml_dtypes.int4),
        ("u4", ml_dtypes.uint4), ("bool", np.bool_)]}
    path = checkpoint.Checkpoint(**values).write(str(tmp_path / "c"))
    reader = checkpoint.read_checkpoint(path)
    for name, want in values.items():
        got = reader.get(f"{name}/.ATTRIBUTES/VARIABLE_VALUE")
        assert got.dtype == want.dtype and got.tobytes() == want.tobytes(), name
