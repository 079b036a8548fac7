"""Fuzzing the orbax-format reader: damaged or lying files give DataLossError (or the saved values), nothing else.

Short by default; for a long run by hand:

    ORBAX_FUZZ_EXAMPLES=2000 .venv/bin/python -m pytest tests/checkpoint/storage/test_orbax_fuzz.py -q
"""

import copy
import json
import os
import tempfile

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import checkpoint
import varstate
from checkpoint import DataLossError
from checkpoint._storage import _orbax

FUZZ = settings(
    max_examples=int(os.environ.get("ORBAX_FUZZ_EXAMPLES", "25")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    derandomize="ORBAX_FUZZ_EXAMPLES" not in os.environ,  # CI runs the same examples every time
)
META = _orbax.META_FILE
_TREE = {
    "w": np.arange(300_000, dtype=np.float32),  # its own array
    "s": np.array([1.5, -2.0, 3.25], np.float32),  # packed
    "b": np.array([True, False]),
    "h": np.array([1.0, 2.0], ml_dtypes.bfloat16),
    "epoch": 12,
    "name": "run-7",
    "rate": 0.5,
    "p": varstate.PartitionedVariable(jnp.arange(70.0).reshape(10, 7), name="p", num_shards=2),  # sliced
}


def _files(path: str) -> dict[str, bytes]:
    out = {}
    for root, _, names in os.walk(path):
        for name in names:
            full = os.path.join(root, name)
            with open(full, "rb") as f:
                out[os.path.relpath(full, path)] = f.read()
    return out


def _write(directory: str, files: dict[str, bytes]) -> str:
    path = os.path.join(directory, "c")
    for rel, data in files.items():
        os.makedirs(os.path.dirname(os.path.join(path, rel)), exist_ok=True)
        with open(os.path.join(path, rel), "wb") as f:
            f.write(data)
    return path


def _read_everything(path: str) -> dict | None:
    """Every value (the large one straight onto a device), the graph; None on DataLossError. Nothing else escapes."""
    try:
        reader = checkpoint.read_checkpoint(path)
        device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        requests = {k: (device if k.startswith("w/") else None) for k in reader.keys()}
        got = reader.get_many(requests)
        out = {}
        for k, v in got.items():  # a value put on a device is held as JAX holds its dtype (64-bit types off)
            dtype = np.dtype(reader.dtype(k))
            out[k] = (np.asarray(v), reader.shape(k), jax.dtypes.canonicalize_dtype(dtype) if requests[k] else dtype)
        graph = reader.object_graph  # None for an empty graph: a name-based checkpoint converted
        out["graph"] = None if graph is None else graph.SerializeToString()
        return out
    except DataLossError:
        return None


with tempfile.TemporaryDirectory() as _d:
    _FILES = _files(checkpoint.Checkpoint(**_TREE).write(os.path.join(_d, "c")))
    _ORIGINAL = _read_everything(_write(tempfile.mkdtemp(dir=_d), _FILES))
_VALUE_FILES = sorted(name for name in _FILES if name.startswith("values" + os.sep))


def _same(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    for key, value in got.items():
        if key == "graph":
            assert value == want[key]
            continue
        array, shape, dtype = value
        assert array.dtype == want[key][0].dtype and array.shape == want[key][0].shape, key
        assert array.tobytes() == want[key][0].tobytes(), key
        assert (shape, dtype) == want[key][1:], key


mutation = st.tuples(
    st.sampled_from(["flip", "truncate", "overwrite", "insert", "delete"]),
    st.floats(0, 1, exclude_max=True),  # where, as a fraction of the file
    st.binary(min_size=1, max_size=16),
)


def _mutate(blob: bytes, kind: str, where: float, payload: bytes) -> bytes:
    pos = int(where * len(blob))
    if kind == "flip" and blob:
        return blob[:pos] + bytes([blob[pos] ^ (1 << (payload[0] % 8))]) + blob[pos + 1:]
    if kind in ("truncate", "flip"):
        return blob[:pos]
    if kind == "overwrite":
        return blob[:pos] + payload + blob[pos + len(payload):]
    if kind == "delete":
        return blob[:pos] + blob[pos + len(payload):]
    return blob[:pos] + payload + blob[pos:]


def test_the_fuzzed_checkpoint_reads_cleanly():
    assert _ORIGINAL is not None
    assert _ORIGINAL["epoch/.ATTRIBUTES/py_state"][0].tolist() == 12
    assert _ORIGINAL["p/.ATTRIBUTES/VARIABLE_VALUE"][0].shape == (10, 7)
    assert META in _FILES and len(_VALUE_FILES) >= 4


@FUZZ
@given(mutation)
def test_damaged_metadata_is_a_data_loss_error(m):
    # One damage: every byte of the metadata is under its crc32c, so nothing read from it can be wrong.
    files = dict(_FILES)
    files[META] = _mutate(files[META], *m)
    with tempfile.TemporaryDirectory() as d:
        got = _read_everything(_write(d, files))
    if files[META] != _FILES[META] and got is not None:  # only a change JSON does not see (e.g. whitespace)
        _same(got, _ORIGINAL)


@FUZZ
@given(st.sampled_from(_VALUE_FILES), st.lists(mutation, min_size=1, max_size=3), st.booleans())
def test_damaged_or_deleted_value_files_are_data_loss_errors(name, mutations, delete):
    files = dict(_FILES)
    if delete:
        del files[name]
    else:
        for m in mutations:
            files[name] = _mutate(files[name], *m)
    with tempfile.TemporaryDirectory() as d:
        got = _read_everything(_write(d, files))
    if got is not None:  # what reads at all reads right: the checksums caught the rest
        _same(got, _ORIGINAL)


_META_JSON = json.loads(_FILES[META])
_LIES = [None, True, -1, 0, 1, 7, 2 ** 31, 2 ** 40, 2 ** 62, 2 ** 64, 1.5, float("nan"), "", "a0", "a1", "p0",
         "float32", "uint4", "object", "10 7 0,5:0,7", "10 7 0,10:0,7", "1 0,1", [], [0], [2 ** 40], [10, 7],
         [-1], [1] * 65, {}, {"python": "int", "value": 3}, [[[[[[[[[[[[[[[[[[0]]]]]]]]]]]]]]]]]]]


def _paths(node, prefix=()):
    yield prefix
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _paths(v, (*prefix, k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _paths(v, (*prefix, i))


_PATHS = [p for p in _paths(_META_JSON) if p and p[0] != "crc32c"]


@FUZZ
@given(st.lists(st.tuples(st.sampled_from(_PATHS), st.sampled_from(["replace", "delete"]), st.sampled_from(_LIES)),
                min_size=1, max_size=3))
def test_lying_metadata_with_a_good_checksum_gives_data_loss_errors_never_crashes_or_huge_allocations(edits):
    # A file from someone else: its checksum is right, its contents are not. The checks, not the crc, must hold.
    meta = copy.deepcopy(_META_JSON)
    for path, how, lie in edits:
        parent = meta
        try:
            for step in path[:-1]:
                parent = parent[step]
            if how == "delete" and isinstance(parent, dict):
                del parent[path[-1]]
            else:
                parent[path[-1]] = copy.deepcopy(lie)
        except (KeyError, IndexError, TypeError):
            continue  # an earlier edit removed or replaced the path
    files = dict(_FILES)
    files[META] = json.dumps(_orbax.seal(meta)).encode()
    with tempfile.TemporaryDirectory() as d:
        try:
            got = _read_everything(_write(d, files))
        except ValueError as e:  # a sealed file that claims a newer version is one: not damage, a refusal
            assert isinstance(meta.get("version"), int) and meta["version"] > _orbax.VERSION, e
            assert "newer than this reader's 2: upgrade varstate to read it" in str(e)
            return
    stored = sum(len(v) for k, v in files.items() if k.startswith("values"))
    for key, value in (got or {}).items():
        if key != "graph":
            array, shape, dtype = value
            assert array.shape == shape, key
            assert array.dtype == dtype or (array.dtype.kind, dtype.kind) == ("S", "U"), key  # a str: UTF-8 bytes
            assert array.nbytes <= stored or array.dtype == object, key
