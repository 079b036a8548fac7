"""Damaged Keras files raise the library's errors naming the file (issue 26 item 5): a truncated HDF5 file, a zip
whose CRC fails, an encrypted or unknown-compression entry, and single-byte flips anywhere.
"""

import pathlib
import random
import shutil
import struct
import time
import zipfile

import pytest

from checkpoint import CheckpointFormatError, DataLossError, keras

_DATA = pathlib.Path(__file__).parents[2] / "data" / "keras_weights"
_ARCHIVE = _DATA / "keras3" / "mlp.keras"
_WEIGHTS = "model.weights.h5"


def _copy(src, tmp_path):
    dst = tmp_path / src.name
    shutil.copyfile(src, dst)
    return dst


def _patch_zip_headers(path, patch):
    """Calls patch(data, offset_of_flags, offset_of_method) for the weights entry's local and central headers."""
    data = bytearray(path.read_bytes())
    with zipfile.ZipFile(path) as z:
        local = z.getinfo(_WEIGHTS).header_offset
    central = data.index(b"PK\x01\x02")  # the first central entry; walk to the weights entry
    while True:
        name_len, extra_len, comment_len = struct.unpack_from("<HHH", data, central + 28)
        if data[central + 46:central + 46 + name_len] == _WEIGHTS.encode():
            break
        central += 46 + name_len + extra_len + comment_len
    patch(data, local + 6, local + 8)
    patch(data, central + 8, central + 10)
    path.write_bytes(bytes(data))


def test_a_truncated_weights_file_is_a_format_error(tmp_path):
    path = _copy(_DATA / "keras3" / "mlp.weights.h5", tmp_path)
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(CheckpointFormatError, match=r"mlp\.weights\.h5: a damaged or unsupported file"):
        keras.load_weights(str(path))


def test_a_flipped_byte_in_the_archive_fails_its_crc(tmp_path):
    path = _copy(_ARCHIVE, tmp_path)
    with zipfile.ZipFile(path) as z:
        info = z.getinfo(_WEIGHTS)
    assert info.compress_type == zipfile.ZIP_STORED
    data = bytearray(path.read_bytes())
    start = info.header_offset + 30 + len(info.filename) + len(info.extra)
    data[start + info.compress_size // 2] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(DataLossError, match=r"mlp.keras: a damaged zip archive \(Bad CRC-32") as e:
        keras.load_weights(str(path))
    assert not isinstance(e.value, CheckpointFormatError)


def test_an_encrypted_entry_is_a_format_error(tmp_path):
    path = _copy(_ARCHIVE, tmp_path)

    def encrypt(data, flags, _method):
        data[flags] |= 0x01

    _patch_zip_headers(path, encrypt)
    with pytest.raises(CheckpointFormatError, match=r"mlp.keras: a damaged or unsupported file \(RuntimeError: .*"
                                                    "encrypted"):
        keras.load_weights(str(path))


def test_an_unknown_compression_method_is_a_format_error(tmp_path):
    path = _copy(_ARCHIVE, tmp_path)

    def unknown(data, _flags, method):
        struct.pack_into("<H", data, method, 77)

    _patch_zip_headers(path, unknown)
    with pytest.raises(CheckpointFormatError, match=r"mlp.keras: a damaged or unsupported file "
                                                    r"\(NotImplementedError: .*compression"):
        keras.load_weights(str(path))


def test_a_damaged_layer_is_named_and_a_failed_metadata_checksum_is_data_loss(tmp_path):
    path = _copy(_DATA / "ours" / "mlp.weights.h5", tmp_path)
    data = bytearray(path.read_bytes())
    data[1755] ^= 1 << 3  # inside layers/dense_1's object header
    path.write_bytes(bytes(data))
    with pytest.raises(DataLossError, match=r"mlp\.weights\.h5: layers/dense_1: a damaged or unsupported file "
                                            r"\(KeyError: .*checksum"):
        keras.load_weights(str(path))


@pytest.mark.parametrize("fixture", ["keras3/mlp.weights.h5", "ours/mlp.weights.h5", "keras3/mlp.keras"])
def test_single_byte_flips_load_or_raise_the_librarys_errors(tmp_path, fixture):
    original = (_DATA / fixture).read_bytes()
    path = tmp_path / pathlib.Path(fixture).name
    rng = random.Random(26_5)
    started = time.monotonic()
    for _ in range(100):
        offset = rng.randrange(len(original))
        data = bytearray(original)
        data[offset] ^= 1 << rng.randrange(8)
        path.write_bytes(bytes(data))
        try:
            keras.load_weights(str(path))
        except (CheckpointFormatError, DataLossError) as e:
            assert type(e) in (CheckpointFormatError, DataLossError), (offset, e)
            assert str(path) in str(e), (offset, e)
    assert time.monotonic() - started < 20
