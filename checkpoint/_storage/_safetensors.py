"""The safetensors format (Hugging Face's), read and written: one file, or shards named by an index.

A file is an 8-byte little-endian header length, a JSON header (each tensor's
dtype, shape and byte range; ``__metadata__``, a map of strings) and the
tensors' bytes. A sharded set is ``<stem>-00001-of-0000N.safetensors`` files
and ``<stem>.safetensors.index.json`` (``weight_map``: tensor name -> file,
``metadata.total_size``). Names are opaque strings here; object-graph paths
are the caller's business. Every number of a header is checked before use
(its size bounded, byte ranges inside the file and disjoint, byte counts
matching dtype and shape) and an index names files in its own directory only.
Values are read with pread into fresh 64-byte-aligned buffers (no mmap: a
file truncated later cannot take an array down with it), and for a sharding,
each shard reads the bytes it holds and no others.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import os
import re
from collections.abc import Iterator
from typing import Any

import numpy as np

from checkpoint import _dtypes
from checkpoint._errors import CheckpointFormatError, DataLossError
from checkpoint._storage._files import open_regular, pread, pread_into, read_regular, replacing
from checkpoint._storage._host import aligned_empty, one_by_one, place_many, read_grouped, read_runs

HEADER_LIMIT = 100 << 20  # the bound the safetensors package puts on a header
INDEX_LIMIT = 64 << 20
_MAX_RANK = 64
SUFFIX = ".safetensors"
INDEX_SUFFIX = ".safetensors.index.json"

_PLAIN = {name: np.dtype(t) for name, t in {
    "F64": np.float64, "F32": np.float32, "F16": np.float16,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8,
    "U64": np.uint64, "U32": np.uint32, "U16": np.uint16, "U8": np.uint8, "BOOL": np.bool_, "C64": np.complex64,
}.items()}


def _ml(ml: Any) -> dict[str, np.dtype]:  # ml_dtypes' entries, added when first needed (see _dtypes.LazyTable)
    return {"BF16": np.dtype(ml.bfloat16), "F8_E4M3": np.dtype(ml.float8_e4m3fn), "F8_E5M2": np.dtype(ml.float8_e5m2)}


DTYPES: dict[str, np.dtype] = _dtypes.LazyTable(_PLAIN, _ml)
NAMES: dict[np.dtype, str] = _dtypes.LazyTable({d: n for n, d in _PLAIN.items()},
                                               lambda ml: {d: n for n, d in _ml(ml).items()})

# __metadata__ entries (strings, as the format requires) for what a tensor cannot hold, written by
# checkpoint.safetensors.save and the CLI's convert.
NAMES_ARE_PATHS = "varstate.names"  # PATHS: the names are object-graph paths (split into a nested dict on load)
PATHS = "object-graph paths"
PYTHON = "varstate.python"  # JSON {path: bool | int | float | str}: Python values of the tree
PRNG_IMPL = "varstate.prng_impl"  # JSON {path: implementation}: a PRNG key is stored as its key data
PRNG_ATTRIBUTE = "PRNG_KEY_IMPL"  # the checkpoint attribute holding it (_graph._build.PRNG_KEY_IMPL, no jax here)
_ESCAPE = re.compile(r"\.(.)")


def unescape(part: str) -> str:
    """`_keys.escape` undone: ``..`` -> ``.``, ``.S`` -> ``/`` (anything else is kept as it is)."""
    return _ESCAPE.sub(lambda m: {".": ".", "S": "/"}.get(m.group(1), m.group(0)), part)


@dataclasses.dataclass(frozen=True)
class Entry:
    """One stored tensor: where its bytes are (an absolute offset in `file`) and what they are."""

    name: str
    file: str
    dtype: np.dtype
    shape: tuple[int, ...]
    offset: int
    nbytes: int


def dtype_name(dtype: Any, where: str) -> str:
    """The safetensors name of `dtype`; ValueError naming `where` for a dtype the format has no name for."""
    name = NAMES.get(np.dtype(dtype))
    if name is None:
        raise ValueError(f"{where}: dtype {np.dtype(dtype)} has no safetensors equivalent (it stores "
                         f"{', '.join(str(d) for d in NAMES)}); cast the value before saving it.")
    return name


def _short(x: Any) -> str:
    text = repr(x)
    return text if len(text) <= 80 else text[:80] + "..."


def _pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        twice = next(k for k, _ in pairs if k in seen or seen.add(k))  # type: ignore[func-returns-value]
        raise ValueError(f"the name {twice!r} appears twice")
    return out


def _int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _json_error(e: BaseException) -> str:
    return "nested too deeply" if isinstance(e, RecursionError) else str(e)


def read_header(path: str) -> tuple[dict[str, Entry], dict[str, str]]:
    """({name: Entry}, metadata) of the safetensors file `path`; CheckpointFormatError naming it and the tensor."""
    fd, size = open_regular(path, "a safetensors file")
    try:
        if size < 8:
            raise CheckpointFormatError(f"{path}: {size} bytes, too short for a safetensors file (an 8-byte header "
                                        "length comes first); the file is truncated or not safetensors")
        n = int.from_bytes(pread(fd, 8, 0, path), "little")
        if n > HEADER_LIMIT or n > size - 8:
            raise CheckpointFormatError(
                f"{path}: the header length says {n} bytes, but the file has {size - 8} after it and this reader "
                f"accepts at most {HEADER_LIMIT}; the file is truncated or not safetensors")
        raw = pread(fd, n, 8, path)
    finally:
        os.close(fd)
    try:
        header = json.loads(raw.decode("utf-8"), object_pairs_hook=_pairs)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:  # RecursionError: arrays nested thousands deep
        raise CheckpointFormatError(f"{path}: the header is not valid JSON ({_json_error(e)}); the file is damaged "
                                    "or not safetensors") from None
    if not isinstance(header, dict):
        raise CheckpointFormatError(f"{path}: the header is {type(header).__name__}, expected a JSON object")
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise CheckpointFormatError(f"{path}: __metadata__ must map strings to strings, found {_short(metadata)}")
    data_start = 8 + n
    entries = {name: _entry(path, name, info, data_start, size - data_start) for name, info in header.items()}
    spans = sorted((e.offset, e.offset + e.nbytes, e.name) for e in entries.values() if e.nbytes)
    for (_, end, a), (start, _, b) in itertools.pairwise(spans):
        if start < end:
            raise CheckpointFormatError(f"{path}: tensors {a!r} and {b!r} overlap (bytes {start - data_start} to "
                                        f"{end - data_start}); the header is damaged")
    return entries, metadata


def _entry(path: str, name: str, info: Any, data_start: int, data_size: int) -> Entry:
    where = f"{path}: tensor {name!r}"
    if not isinstance(info, dict) or set(info) != {"dtype", "shape", "data_offsets"}:
        raise CheckpointFormatError(f"{where}: expected an object with dtype, shape and data_offsets, found "
                                    f"{_short(info)}")
    dtype = DTYPES.get(info["dtype"]) if isinstance(info["dtype"], str) else None
    if dtype is None:
        raise CheckpointFormatError(f"{where}: dtype {_short(info['dtype'])} is not one this reader knows "
                                    f"({', '.join(DTYPES)})")
    shape, offsets = info["shape"], info["data_offsets"]
    if not isinstance(shape, list) or len(shape) > _MAX_RANK or not all(_int(d) and d >= 0 for d in shape):
        raise CheckpointFormatError(f"{where}: shape {_short(shape)} is not a list of at most {_MAX_RANK} "
                                    "non-negative integers")
    if (not isinstance(offsets, list) or len(offsets) != 2 or not all(map(_int, offsets))
            or not 0 <= offsets[0] <= offsets[1] <= data_size):
        raise CheckpointFormatError(f"{where}: data_offsets {_short(offsets)} are not [begin, end] within the "
                                    f"{data_size} data bytes of the file; it is truncated or damaged")
    nbytes = math.prod(shape) * dtype.itemsize
    if offsets[1] - offsets[0] != nbytes:
        raise CheckpointFormatError(f"{where}: shape {tuple(shape)} of {info['dtype']} is {nbytes} bytes, but its "
                                    f"data_offsets {offsets} hold {offsets[1] - offsets[0]}; the header is damaged")
    return Entry(name, path, dtype, tuple(shape), data_start + offsets[0], nbytes)


def read_index(path: str) -> tuple[dict[str, str], dict[str, Any]]:
    """({tensor name: shard file path}, metadata) of an index; its files must lie in its own directory."""
    try:
        index = json.loads(read_regular(path, INDEX_LIMIT, "a safetensors index").decode("utf-8"),
                           object_pairs_hook=_pairs)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        if isinstance(e, CheckpointFormatError):
            raise
        raise CheckpointFormatError(f"{path}: not valid JSON ({_json_error(e)}); the index is damaged") from None
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise CheckpointFormatError(f"{path}: expected a JSON object with a weight_map of tensor names to file "
                                    f"names, found {_short(index)}")
    directory = os.path.dirname(os.path.abspath(path))
    root = os.path.realpath(directory)
    files: dict[str, str] = {}
    for name, file in weight_map.items():
        if file not in files:
            full = os.path.join(directory, file)
            real = os.path.realpath(full)
            if os.path.isabs(file) or os.path.commonpath([root, real]) != root or real == root:
                raise CheckpointFormatError(
                    f"{path}: tensor {name!r} is in {file!r}, which is outside the index's directory {directory}; "
                    "an index may only name files beside it")
            files[file] = full
        weight_map[name] = files[file]
    metadata = index.get("metadata") or {}
    return weight_map, metadata if isinstance(metadata, dict) else {}


def resolve(path: str) -> str:
    """A safetensors file or index for `path`: itself, or the one model file or index in a directory."""
    if not os.path.isdir(path):
        if not os.path.lexists(path):
            raise FileNotFoundError(f"No safetensors file or index at {path}")
        return path
    found = sorted(f for f in os.listdir(path) if f.endswith(INDEX_SUFFIX))
    found = found or sorted(f for f in os.listdir(path) if f.endswith(SUFFIX))
    if len(found) != 1:
        raise FileNotFoundError(
            f"{path}: expected one *{INDEX_SUFFIX} index or one *{SUFFIX} file in the directory, found "
            f"{found or 'none'}; pass the file or the index itself")
    return os.path.join(path, found[0])


def is_safetensors(path: str) -> bool:
    """True for a path naming safetensors: a file or index by its name, or a directory of one model."""
    if os.path.isdir(path):  # as `resolve` reads one (a TF checkpoint directory has its 'checkpoint' file)
        names = os.listdir(path)
        files = [f for f in names if f.endswith(SUFFIX)]
        return (any(f.endswith(INDEX_SUFFIX) for f in names) or f"model{SUFFIX}" in names
                or (len(files) == 1 and "checkpoint" not in names)
                or (not names and path.rstrip(os.sep).endswith(SUFFIX)))  # empty: the safetensors message says so
    return path.endswith((SUFFIX, INDEX_SUFFIX))


class SafetensorsReader:
    """A safetensors file or sharded set as a `Reader` (no object graph: names are its keys)."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = resolve(os.fspath(path))
        self.entries: dict[str, Entry] = {}
        self.metadata: dict[str, str] = {}
        if self.path.endswith(".json"):
            weight_map, self.index_metadata = read_index(self.path)
            headers: dict[str, dict[str, Entry]] = {}
            for name, file in weight_map.items():
                if file not in headers:
                    if not os.path.lexists(file):
                        held = sum(f == file for f in weight_map.values())
                        raise DataLossError(
                            f"{self.path}: the index puts {held} tensor{'s' * (held != 1)} ({name!r} first) in "
                            f"{os.path.basename(file)}, which is missing from {os.path.dirname(file)}; copy that "
                            "shard beside the index (the checkpoint is incomplete)")
                    headers[file], meta = read_header(file)
                    self.metadata.update(meta)
                if name not in headers[file]:
                    raise CheckpointFormatError(f"{self.path}: the index puts tensor {name!r} in {file}, which does "
                                                "not hold it; the shards and the index do not belong together")
                self.entries[name] = headers[file][name]
            self.files = list(headers)
        else:
            self.entries, self.metadata = read_header(self.path)
            self.files, self.index_metadata = [self.path], {}
        self.format_name = "safetensors" + (f" ({len(self.files)} shards)" if self.path.endswith(".json") else "")
        self.object_graph = None

    def keys(self) -> list[str]:
        return list(self.entries)

    def stored_together(self, keys: list[str]) -> list[list[str]]:
        return one_by_one(keys)

    def release(self) -> None:
        """Keeps no host copies: nothing to forget."""

    def __contains__(self, key: str) -> bool:
        return key in self.entries

    def _entry(self, key: str) -> Entry:
        entry = self.entries.get(key)
        if entry is None:
            raise KeyError(f"{self.path}: no tensor {key!r}; it holds {len(self.entries)} tensors")
        return entry

    def shape(self, key: str) -> tuple[int, ...]:
        return self._entry(key).shape

    def dtype(self, key: str) -> np.dtype:
        return self._entry(key).dtype

    def get_slices(self, key: str) -> list[tuple[slice, ...]]:
        return []

    def get(self, key: str) -> np.ndarray:
        """The whole tensor, in a fresh aligned buffer."""
        entry = self._entry(key)
        return self.read_box(entry, tuple((0, d) for d in entry.shape))

    def read_box(self, entry: Entry, box: tuple[tuple[int, int], ...]) -> np.ndarray:
        """The block `box` ((offset, extent) per dimension) of a tensor, reading only the byte runs it covers."""
        out = aligned_empty(tuple(n for _, n in box), entry.dtype)
        if not out.size:
            return out
        shape, item = entry.shape, entry.dtype.itemsize
        # The last dimension cut by the box (the first if none is): the rest of each row from it on is one
        # contiguous run of bytes.
        cut = max((a for a, (o, n) in enumerate(box) if (o, n) != (0, shape[a])), default=0)
        runs = itertools.product(*(range(o, o + n) for o, n in box[:cut]))
        run = math.prod(n for _, n in box[cut:])
        strides = [math.prod(shape[a + 1:]) for a in range(len(shape))]
        flat = out.reshape(-1).view(np.uint8)
        fd, _ = open_regular(entry.file, "a safetensors file")
        try:
            for i, outer in enumerate(runs):
                first = sum(x * s for x, s in zip(outer, strides, strict=False))
                first += box[cut][0] * strides[cut] if box else 0
                pread_into(fd, flat[i * run * item:(i + 1) * run * item], entry.offset + first * item,
                           f"{entry.file}: tensor {entry.name!r}")
        finally:
            os.close(fd)
        return out

    def get_into(self, key: str, sharding: Any) -> Any:
        """A jax.Array on `sharding`; each distinct shard is read once, only its bytes."""
        import jax

        entry = self._entry(key)
        blocks: dict[tuple[tuple[int, int], ...], np.ndarray] = {}
        arrays = []
        for device, index in sharding.addressable_devices_indices_map(entry.shape).items():
            box = tuple((s.indices(d)[0], len(range(*s.indices(d)))) for s, d in zip(index, entry.shape, strict=True))
            if box not in blocks:
                blocks[box] = self.read_box(entry, box)
            arrays.append(jax.device_put(blocks[box], device))
        return jax.make_array_from_single_device_arrays(entry.shape, sharding, arrays)

    def get_many(self, requests: dict[str, Any]) -> dict[str, Any]:
        """{key: sharding or None} -> {key: jax.Array on it, or np.ndarray}.

        Tensors wanted whole (on the host, on one device or replicated) are
        read in file order a group of about 1 MB at a time, tensors stored
        back to back with one read (`read_runs`: each in its own aligned
        buffer), and placed a group at a time by one `device_put`; a sharded
        tensor reads only its shards' bytes (`get_into`).
        """
        whole = [k for k, s in requests.items() if s is None or (s.is_fully_addressable and s.is_fully_replicated)]
        out: dict[str, Any] = {}
        for group, hosts in self._read_whole(whole) if whole else ():
            out.update(zip(group, hosts, strict=True))
            placed = [k for k in group if requests[k] is not None]  # placed now: the host holds a group at a time
            out.update(zip(placed, place_many([out[k] for k in placed], [requests[k] for k in placed]), strict=True))
        return {k: out[k] if k in out else self.get_into(k, s) for k, s in requests.items()}

    def _read_whole(self, keys: list[str]) -> Iterator[tuple[list[str], list[np.ndarray]]]:
        """(keys, their whole tensors on the host) a group at a time, in file order (`read_grouped`)."""
        entries = {k: self._entry(k) for k in keys}
        fds: dict[str, int] = {}
        try:
            for e in entries.values():
                if e.file not in fds:
                    fds[e.file] = open_regular(e.file, "a safetensors file")[0]

            def read(group: list[str]) -> list[np.ndarray]:
                flats = read_runs([(fds[entries[k].file], entries[k].offset, entries[k].nbytes,
                                    f"{entries[k].file}: tensor {entries[k].name!r}") for k in group])
                return [f.view(entries[k].dtype).reshape(entries[k].shape) for k, f in zip(group, flats, strict=True)]

            ordered = sorted(keys, key=lambda k: (entries[k].file, entries[k].offset))
            yield from read_grouped(ordered, lambda k: entries[k].nbytes, read)
        finally:
            for fd in fds.values():
                os.close(fd)


_SIZE = r"\s*(\d+(?:\.\d+)?)\s*(?:([KMGT]?)(i?)B)?\s*"


def parse_size(size: int | str, where: str) -> int:
    """Bytes of a shard size given as an int or as Hugging Face writes it (``"5GB"``, ``"500MiB"``)."""
    if _int(size) and size > 0:  # type: ignore[operator]
        return int(size)
    # A count of bytes ("1000", as a command line gives it) or Hugging Face's form ("5GB", "500MiB").
    m = re.fullmatch(_SIZE, size, re.IGNORECASE) if isinstance(size, str) else None
    unit = (m.group(2) or "").upper() if m else ""
    scale = (1024 if m and m.group(3) else 1000) ** "_KMGT".index(unit or "_")
    if m is None or int(float(m.group(1)) * scale) < 1:
        raise ValueError(f"{where}: max_shard_size {size!r} is not a positive number of bytes or a size such as "
                         "'5GB' or '500MiB'")
    return int(float(m.group(1)) * scale)


def write(path: str, tensors: dict[str, Any], metadata: dict[str, str], max_shard_size: int | None = None) -> str:
    """Writes `tensors` ({name: array}) to `path`, or as shards and an index beside it; returns the path to load.

    Tensors go into shards in the order given, a new shard when the next one
    would pass `max_shard_size` (a tensor larger than that gets a shard of its
    own); a single shard is written as the one file `path`. Every file is
    written under a temporary name, fsynced, and renamed into place, the
    index last.
    """
    specs = {name: (np.dtype(value.dtype), tuple(int(d) for d in value.shape)) for name, value in tensors.items()}
    for name, (dtype, _) in specs.items():  # every dtype checked before a byte is written
        dtype_name(dtype, f"{path}: tensor {name!r}")
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    groups: list[list[str]] = [[]]
    size = 0
    for name, (dtype, shape) in specs.items():
        nbytes = math.prod(shape) * dtype.itemsize
        if max_shard_size is not None and groups[-1] and size + nbytes > max_shard_size:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += nbytes
    if len(groups) == 1:
        with replacing(path) as (temp,):
            _write_file(temp, groups[0], tensors, specs, metadata)
        return path
    if not path.endswith(SUFFIX):
        raise ValueError(f"{path}: a sharded save needs a path ending in {SUFFIX} (the shards and the index are "
                         "named from it, e.g. model.safetensors)")
    stem = path[: -len(SUFFIX)]
    shards = [f"{stem}-{i + 1:05d}-of-{len(groups):05d}{SUFFIX}" for i in range(len(groups))]
    index_path = stem + INDEX_SUFFIX
    total = sum(math.prod(shape) * dtype.itemsize for dtype, shape in specs.values())
    weight_map = {name: os.path.basename(shard) for shard, group in zip(shards, groups, strict=True) for name in group}
    with replacing(*shards, index_path) as temps:
        for temp, group in zip(temps, groups, strict=False):  # the last temporary is the index
            _write_file(temp, group, tensors, specs, metadata)
        with open(temps[-1], "w", encoding="utf-8") as f:
            json.dump({"metadata": {"total_size": total, **metadata}, "weight_map": weight_map}, f, indent=2)
    return index_path


def _write_file(temp: str, names: list[str], tensors: dict[str, Any], specs: dict, metadata: dict[str, str]) -> None:
    order = sorted(names, key=lambda n: -specs[n][0].itemsize)  # wider items first: each starts aligned to its size
    header: dict[str, Any] = {"__metadata__": metadata} if metadata else {}
    at = 0
    for name in order:
        dtype, shape = specs[name]
        nbytes = math.prod(shape) * dtype.itemsize
        header[name] = {"dtype": NAMES[dtype], "shape": list(shape), "data_offsets": [at, at + nbytes]}
        at += nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned, as the safetensors package writes it
    with open(temp, "wb") as f:
        f.write(len(text).to_bytes(8, "little") + text)
        for name in order:
            host = np.ascontiguousarray(np.asarray(tensors[name])).astype(specs[name][0].newbyteorder("<"), copy=False)
            if host.size:
                f.write(host.reshape(-1).view(np.uint8).data)
