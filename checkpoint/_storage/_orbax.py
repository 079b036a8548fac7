"""The orbax storage backend: values through orbax/tensorstore, graph and layout beside them.

A checkpoint is an orbax composite directory:
  values/  an orbax PyTree: "p0", "p1", ... (uint8; the values under
           `_PACK_LIMIT` bytes, back to back, up to `_PACK_BYTES` a pack, so
           restoring one value reads one pack) and "a0", "a1", ... (each large
           value as its own array, sharded as it was)
  meta/    JSON: format version, the serialized TrackableObjectGraph, and per
           checkpoint key its dtype, shape, crc32c and where its bytes are
           (or a Python value itself); since version 2 also a crc32c of the
           rest of the JSON in canonical form (`seal`), so a flipped bit in a
           Python value or the graph is caught like one in an array.
orbax writes into a temporary directory and renames it when everything is
written, so a checkpoint either exists whole or not at all. Packing is what
makes 2,000 small variables cost one orbax array instead of 2,000.
"""

from __future__ import annotations

import base64
import json
import math
import os
import re
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath
from google.protobuf.message import DecodeError

from checkpoint import _dtypes, _keys
from checkpoint._errors import CheckpointFormatError, DataLossError
from checkpoint._storage import _distributed
from checkpoint._storage._crc import crc32c
from checkpoint._storage._files import ORBAX_METADATA, read_regular, stored_bytes, within
from checkpoint.protos.trackable_object_graph_pb2 import TrackableObjectGraph

FORMAT = "varstate-orbax"
VERSION = 2  # 2: the metadata carries a crc32c of itself (1 is read, without one)
META_FILE = ORBAX_METADATA
_PACK_LIMIT = 1 << 20  # values smaller than this are packed
_PACK_BYTES = 64 << 20  # a pack is closed once it holds this much
_ALIGN = 64
# Large arrays of these types are written as the wider type (tensorstore has no uint4); the
# bytes, and so the checksum, are the same: ml_dtypes keeps one uint4 per byte.
_STORED_AS = {"uint4": np.dtype(np.uint8)}


# ---------------------------------------------------------------------------
# save
# ---------------------------------------------------------------------------
class _Layout:
    """Collects values into the orbax tree and the JSON entries."""

    def __init__(self, packed: bool = True) -> None:
        self.packed = packed
        self.small: list[tuple[dict, Any]] = []
        self.large: dict[str, Any] = {}
        self.entries: dict[str, dict] = {}

    def add_array(self, key: str, value: Any, name: str | None = None, **extra: Any) -> dict:
        dtype = np.dtype(value.dtype)
        if dtype.name not in _dtypes.BY_NAME:
            raise TypeError(f"Cannot save {key!r}: dtype {dtype} is not supported by the orbax format.")
        entry = {"dtype": dtype.name, "shape": list(value.shape), **extra}
        nbytes = math.prod(value.shape) * dtype.itemsize
        if self.packed and nbytes < _PACK_LIMIT and _on_every_host(value):
            self.small.append((entry, value))
        else:
            name = f"a{len(self.large)}" if self.packed else (name or key)
            if dtype.name in _STORED_AS:  # a type tensorstore lacks: its values, widened losslessly
                entry["stored_as"] = _STORED_AS[dtype.name].name
                value = value.astype(_STORED_AS[dtype.name])
            if isinstance(value, jax.Array) and value.is_fully_addressable and _distributed.process_count() > 1:
                value = np.asarray(value)  # this host's own array: written by the primary host, as orbax does
            self.large[name] = value
            entry["array"] = name
        return entry

    def finish(self) -> tuple[dict, dict]:
        tree: dict[str, Any] = {}
        hosts = jax.device_get([v for _, v in self.small])
        offset, parts, sizes = 0, [], []

        def close_pack():
            if not offset:  # only empty values: orbax refuses an empty array
                parts.append(np.zeros(_ALIGN, np.uint8))
            tree[f"p{len(sizes)}"] = np.concatenate(parts)
            sizes.append(offset or _ALIGN)

        for (entry, _), host in zip(self.small, hosts, strict=True):
            host = np.ascontiguousarray(host)
            raw = host.view(np.uint8).reshape(-1)
            if parts and offset + raw.size > _PACK_BYTES:
                close_pack()
                offset, parts = 0, []
            entry["crc32c"] = crc32c(host)
            entry["pack"], entry["offset"] = len(sizes), offset
            pad = -(offset + raw.size) % _ALIGN
            parts.append(raw)
            if pad:
                parts.append(np.zeros(pad, np.uint8))
            offset += raw.size + pad
        if parts:
            close_pack()
        for name, value in self.large.items():
            tree[name] = value
        by_shard = []
        for entry in self.entries_with_arrays():
            value = self.large[entry["array"]]
            if _on_every_host(value):
                entry["crc32c"] = crc32c(np.asarray(jax.device_get(value)))
            if _boxes(value) is not None:
                by_shard.append(entry)
        _shard_checksums(by_shard, self.large)
        return tree, {"packs": sizes}

    def entries_with_arrays(self):
        for entry in self.entries.values():
            for e in entry.get("slices", [entry]):
                if "array" in e:
                    yield e


def _on_every_host(value: Any) -> bool:
    """Every process can read all of `value` (so it can be packed and checksummed whole)."""
    return not isinstance(value, jax.Array) or value.is_fully_addressable or value.is_fully_replicated


def _boxes(value: Any) -> list[tuple[tuple[int, int], ...]] | None:
    """The distinct shards of a sharded array ((offset, extent) per dimension), in order.

    None where a whole-array checksum does: a value not split, or held whole
    by every process.
    """
    if not isinstance(value, jax.Array) or value.is_fully_replicated:
        return None
    shape = value.shape
    boxes = {_box_of(index, shape) for index in value.sharding.devices_indices_map(shape).values()}
    return sorted(boxes) if len(boxes) > 1 or not value.is_fully_addressable else None


def _box_of(index: tuple[slice, ...], shape: tuple[int, ...]) -> tuple[tuple[int, int], ...]:
    return tuple((s.indices(d)[0], len(range(*s.indices(d)))) for s, d in zip(index, shape, strict=True))


def _shard_checksums(entries: list[dict], large: dict[str, Any]) -> None:
    """Sets ``entry["shards"]``: a crc32c per distinct shard of each sharded array.

    Each process checksums the shards it holds (replica 0 of each), and the
    small {array: {shard: crc}} maps are exchanged, so the metadata every
    process builds (and the primary writes) is the same, and no array is
    gathered to one host. A restore checks each shard it reads whole.
    """
    if not entries:
        return
    mine: dict[str, dict[str, int]] = {}
    for entry in entries:
        value = large[entry["array"]]
        got = mine.setdefault(entry["array"], {})
        for shard in value.addressable_shards:
            if shard.replica_id == 0:
                got[json.dumps(_box_of(shard.index, value.shape))] = crc32c(np.asarray(shard.data))
    merged: dict[str, dict[str, int]] = {}
    for blob in _distributed.allgather_bytes(json.dumps(mine, sort_keys=True).encode()):
        for name, crcs in json.loads(blob).items():
            merged.setdefault(name, {}).update(crcs)
    for entry in entries:
        value, crcs = large[entry["array"]], merged.get(entry["array"], {})
        shards = []
        for box in _boxes(value):
            text = json.dumps(box)
            if text not in crcs:
                raise DataLossError(f"Saving {entry['array']!r}: no process checksummed its shard {box}; "
                                    "a process holds no replica 0 of it (jax reported an inconsistent sharding).")
            shards.append({"box": [list(b) for b in box], "crc32c": crcs[text]})
        entry["shards"] = shards


def layout(values: dict[str, Any], object_graph: TrackableObjectGraph, packed: bool = True) -> tuple[dict, dict]:
    """{key: array | Python scalar | [(SaveSliceInfo, array), ...]} -> (orbax tree, JSON metadata).

    ``packed=False``: every value is its own orbax array named by its
    checkpoint key (slice i of a sliced value: ``<key>@slice_<i>``; a Python
    value too, as a numpy scalar), so that plain orbax restores the values
    item into {checkpoint key: array}.
    """
    lay = _Layout(packed)
    for key, value in values.items():
        if isinstance(value, (bool, int, float, str)) and not isinstance(value, np.generic):  # np.float64: array
            base = _dtypes.python_type(value)  # an IntEnum is an int
            lay.entries[key] = {"python": base.__name__, "value": base(value)}
        elif isinstance(value, list):
            info0 = value[0][0]
            lay.entries[key] = {
                "dtype": np.dtype(value[0][1].dtype).name,
                "shape": list(info0.full_shape),
                "slices": [lay.add_array(key, v, name=f"{key}@slice_{i}", spec=info.spec)
                           for i, (info, v) in enumerate(value)],
            }
        else:
            lay.entries[key] = lay.add_array(key, value)
    tree, extra = lay.finish()
    if not packed:  # for plain orbax readers; this reader takes them from the metadata
        tree.update((key, np.asarray(e["value"].encode() if e["python"] == "str" else e["value"]))
                    for key, e in lay.entries.items() if "python" in e and e["python"] != "str")
    meta = {
        "format": FORMAT,
        "version": VERSION,
        "object_graph": base64.b64encode(object_graph.SerializeToString()).decode("ascii"),
        "entries": lay.entries,
        **extra,
    }
    return tree, seal(meta)


def seal(meta: dict) -> dict:
    """`meta` with its crc32c set: one flipped bit in a stored Python value or the object graph is then
    caught when the checkpoint is read, where it would otherwise restore a wrong value silently."""
    meta["crc32c"] = crc32c(_canonical(meta))
    return meta


def checkpointer(async_save: bool = False) -> ocp.AbstractCheckpointer:
    """An orbax checkpointer for this layout: OCDBT, no compression (float weights barely
    compress; zstd made saves 3x slower than the disk)."""
    handler = ocp.CompositeCheckpointHandler(
        values=ocp.PyTreeCheckpointHandler(use_compression=False, use_ocdbt=True),
        meta=ocp.JsonCheckpointHandler(),
    )
    return ocp.AsyncCheckpointer(handler) if async_save else ocp.Checkpointer(handler)


def save_args(tree: dict, meta: dict) -> ocp.args.Composite:
    # orbax refuses an empty tree: a checkpoint of Python values only has no values item.
    values = {"values": ocp.args.PyTreeSave(tree)} if tree else {}
    return ocp.args.Composite(**values, meta=ocp.args.JsonSave(meta))


# ---------------------------------------------------------------------------
# restore
# ---------------------------------------------------------------------------
_ARRAY_NAME = re.compile(r"a[0-9]+")
_PACK_NAME = re.compile(r"p[0-9]+")
_SLICE_SUFFIX = re.compile(r"@slice_[0-9]+")  # an unpacked checkpoint's slice i of a sliced value
_META_LIMIT = 256 << 20  # bytes of meta/metadata; a million keys take about 200 MB
_MAX_DEPTH = 16  # JSON nesting; the format needs 6 (meta, entries, entry, slices, slice, shape)
_MAX_RANK = 64  # numpy's limit
_MAX_ELEMENTS = 1 << 59  # a shape's elements (zero dimensions counted as one), as the TF reader allows
# Bytes the values may claim beyond the files under values/: orbax inlines a value of up to 1 KiB in its
# compressed b-tree nodes, and only the last pack can be that small; every other value is stored raw.
_SLACK = 1 << 16
_PROBE_BATCH = 256  # arrays whose stored shape and dtype are read at once


class _BadMetadataError(Exception):
    """Metadata that failed a check: the detail, with the key it concerns, for the DataLossError."""

    def __init__(self, detail: str, kind: str = "ValueError") -> None:
        detail = detail if len(detail) <= 2000 else detail[:2000] + "..."  # keys from a file can be megabytes
        super().__init__(f"{kind}: {detail}")


def _short(value: Any, limit: int = 120) -> str:
    """repr of a value read from a file, cut short: a hostile file's strings can be megabytes."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def _first_line(error: BaseException, limit: int = 300) -> str:
    # tensorstore's messages run to a page (the whole spec); the first line says what failed.
    text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return text if len(text) <= limit else text[:limit] + "..."


def _canonical(meta: dict) -> bytes:
    """The bytes the metadata's crc32c covers: every field but the checksum, as canonical JSON."""
    body = {k: v for k, v in meta.items() if k != "crc32c"}
    return json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode("ascii")


def _too_deep(value: Any) -> bool:
    level = [value]
    for _ in range(_MAX_DEPTH):  # level by level, not recursion: the depth is what is being checked
        inner = []
        for node in level:
            children = node.values() if type(node) is dict else node
            inner.extend(c for c in children if type(c) is dict or type(c) is list)
        if not inner:
            return False
        level = inner
    return True


def _check_shape(key: str, shape: Any) -> tuple[int, ...]:
    if type(shape) is not list or len(shape) > _MAX_RANK or not all(type(d) is int and d >= 0 for d in shape) \
            or math.prod(d or 1 for d in shape) > _MAX_ELEMENTS:
        raise _BadMetadataError(f"entry {key!r}: bad shape {_short(shape)}")
    return tuple(shape)


def _dtype_name(key: str, e: dict) -> str:
    name = e.get("dtype")
    if type(name) is not str or name not in _dtypes.BY_NAME:
        raise _BadMetadataError(f"Checkpoint value {key!r} has unsupported dtype {_short(name)}.")
    return name


def _validate(key: str, e: Any, packs: list[int]) -> list | None:
    """Metadata is data: every name, shape and offset is checked before it is used.

    Returns a sliced entry's slices as (offset, extent) per dimension, else None.
    """
    if type(e) is not dict:
        raise _BadMetadataError(f"entry {key!r} is not an object", "TypeError")
    if "python" in e:
        want = _dtypes.PYTHON_TYPES.get(e["python"]) if type(e["python"]) is str else None
        if want is None:
            raise _BadMetadataError(f"entry {key!r}: unknown Python type {_short(e['python'])}")
        if type(e.get("value")) is not want and not (want is float and type(e.get("value")) is int):
            raise _BadMetadataError(f"entry {key!r}: value does not match its type {e['python']!r}")
        if want is str:
            try:
                e["value"].encode("utf-8")  # restore hands it on as UTF-8 bytes
            except UnicodeEncodeError:
                raise _BadMetadataError(f"entry {key!r}: value is not UTF-8 text (it holds a lone surrogate)") \
                    from None
        return None
    dtype = _dtype_name(key, e)
    shape = _check_shape(key, e.get("shape"))
    if "slices" not in e:
        _validate_stored(key, e, packs, dtype, shape)
        return None
    slices = e["slices"]
    if type(slices) is not list or not slices:
        raise _BadMetadataError(f"entry {key!r}: bad slices")
    boxes = []
    for part in slices:  # linear: a hostile file may hold tens of thousands
        if type(part) is not dict:
            raise _BadMetadataError(f"entry {key!r}: a slice is not an object", "TypeError")
        if _dtype_name(key, part) != dtype:
            raise _BadMetadataError(f"entry {key!r}: a slice of {dtype} holds {part['dtype']}")
        part_shape = _check_shape(key, part.get("shape"))
        spec = part.get("spec")
        try:
            full, offset, extent = _keys.parse_slice_spec(key, spec if type(spec) is str else "")
        except ValueError as err:
            raise _BadMetadataError(str(err)) from None
        if full != shape or extent != part_shape or any(
                o < 0 or o + n > d for o, n, d in zip(offset, extent, shape, strict=True)):
            raise _BadMetadataError(f"entry {key!r}: slice {_short(spec)} does not fit shape {list(shape)}")
        _validate_stored(key, part, packs, dtype, part_shape)
        boxes.append(list(zip(offset, extent, strict=True)))
    try:
        tiled = _keys.covers_exactly(shape, boxes)
    except ValueError as err:  # more fragmented than this reader checks
        raise _BadMetadataError(f"entry {key!r}: {err}") from None
    if not tiled:
        raise _BadMetadataError(f"entry {key!r}: its slices overlap or do not cover shape {list(shape)}")
    return boxes


def _validate_stored(key: str, e: dict, packs: list[int], dtype: str, shape: tuple[int, ...]) -> None:
    """Where a value's bytes are: its own array, or a range of a pack; and their crc32c."""
    crc = e.get("crc32c")
    if "array" in e and "shards" in e:
        _validate_shards(key, e["shards"], shape)
    elif type(crc) is not int or not 0 <= crc < 1 << 32:
        raise _BadMetadataError(f"entry {key!r}: no crc32c")
    if crc is not None and (type(crc) is not int or not 0 <= crc < 1 << 32):
        raise _BadMetadataError(f"entry {key!r}: bad crc32c {_short(crc)}")
    if "array" in e:
        name = e["array"]
        if type(name) is not str or not (_ARRAY_NAME.fullmatch(name) or name == key or (
                name.startswith(key) and _SLICE_SUFFIX.fullmatch(name[len(key):]))):
            raise _BadMetadataError(f"entry {key!r}: bad array name {_short(e['array'])}")
        if "stored_as" in e and (dtype not in _STORED_AS or e["stored_as"] != _STORED_AS[dtype].name):
            raise _BadMetadataError(f"entry {key!r}: {dtype} cannot be stored as {_short(e['stored_as'])}")
        return
    pack, offset = e.get("pack"), e.get("offset")
    nbytes = math.prod(shape) * _dtypes.BY_NAME[dtype].itemsize
    if type(pack) is not int or not 0 <= pack < len(packs):
        raise _BadMetadataError(f"entry {key!r}: no pack {_short(pack)}")
    if type(offset) is not int or offset < 0 or offset + nbytes > packs[pack]:
        raise _BadMetadataError(f"entry {key!r}: bytes [{_short(offset)}, +{nbytes}) lie outside pack {pack}")


def _validate_shards(key: str, shards: Any, shape: tuple[int, ...]) -> None:
    """A sharded array's per-shard checksums: boxes that tile its shape, each with a crc32c."""
    if type(shards) is not list or not shards:
        raise _BadMetadataError(f"entry {key!r}: bad shards {_short(shards)}")
    boxes = []
    for part in shards:
        box = part.get("box") if type(part) is dict else None
        crc = part.get("crc32c") if type(part) is dict else None
        if type(crc) is not int or not 0 <= crc < 1 << 32 or type(box) is not list or len(box) != len(shape) or \
                not all(type(b) is list and len(b) == 2 and all(type(n) is int for n in b) for b in box):
            raise _BadMetadataError(f"entry {key!r}: bad shard {_short(part)}")
        boxes.append([tuple(b) for b in box])
    try:
        tiled = _keys.covers_exactly(shape, boxes)
    except ValueError as err:
        raise _BadMetadataError(f"entry {key!r}: {err}") from None
    if not tiled:
        raise _BadMetadataError(f"entry {key!r}: its shards overlap or do not cover shape {list(shape)}")


class OrbaxReader:
    """Reads one orbax-format checkpoint (the reader protocol of `read_checkpoint`).

    Everything in the metadata is checked when the reader opens: its crc32c,
    every entry, and the shape and dtype orbax stored for every array against
    the shape and dtype the metadata claims, whose bytes must be on disk.
    Damage raises DataLossError naming the checkpoint and, where one is to
    blame, the key.

    >>> import tempfile, os, jax.numpy as jnp, checkpoint
    >>> path = checkpoint.Checkpoint(w=jnp.arange(3.0)).write(os.path.join(tempfile.mkdtemp(), "ckpt"))
    >>> r = OrbaxReader(path)
    >>> r.keys(), r.get("w/.ATTRIBUTES/VARIABLE_VALUE").tolist()
    (['w/.ATTRIBUTES/VARIABLE_VALUE'], [0.0, 1.0, 2.0])
    """

    def __init__(self, path: str) -> None:
        self.path = os.path.abspath(path)
        meta_path = os.path.join(self.path, META_FILE)
        within(self.path, os.path.join(self.path, os.path.dirname(META_FILE)))
        within(self.path, meta_path)
        try:
            raw = read_regular(meta_path, _META_LIMIT, "the checkpoint's metadata")
        except FileNotFoundError:
            raise ValueError(
                f"{path!r} is not a checkpoint: {META_FILE} is missing. Pass a path returned by "
                "Checkpoint.save/write or checkpoint.latest_checkpoint(directory)."
            ) from None
        try:
            meta = json.loads(raw.decode("utf-8"))
        except RecursionError:
            raise DataLossError(f"Checkpoint {path!r}: {META_FILE} is corrupted (its JSON is nested too deeply).") \
                from None
        except ValueError as e:  # not JSON, not UTF-8, or an integer of thousands of digits
            raise DataLossError(f"Checkpoint {path!r}: {META_FILE} is corrupted ({_first_line(e)}).") from None
        if _too_deep(meta):
            raise DataLossError(
                f"Checkpoint {path!r}: {META_FILE} is corrupted (its JSON is nested deeper than {_MAX_DEPTH} levels; "
                "this format uses 6)."
            )
        sealed = isinstance(meta, dict) and "crc32c" in meta
        if not sealed and (not isinstance(meta, dict) or meta.get("format") != FORMAT):
            found = f"format {_short(meta.get('format'))}" if isinstance(meta, dict) else f"a {type(meta).__name__}"
            raise ValueError(f"{path!r} is not a varstate checkpoint ({found} in {META_FILE}).")
        stored_crc = meta.get("crc32c")
        actual_crc = crc32c(_canonical(meta)) if sealed else None
        intact = sealed and stored_crc == actual_crc
        version = meta.get("version")
        if type(version) is not int:
            raise DataLossError(f"Checkpoint {path!r}: {META_FILE} is corrupted (its format version "
                                f"{_short(version)} is not an integer).")
        if version > VERSION:
            if sealed and not intact:  # a newer writer may seal differently: either may be the case
                raise CheckpointFormatError(
                    f"Checkpoint {path!r} has format version {_short(version)}, newer than this reader's {VERSION}, "
                    f"or its {META_FILE} is corrupted (it fails its crc32c): upgrade varstate to read it, or "
                    "restore an older checkpoint."
                )
            raise ValueError(
                f"Checkpoint {path!r} has format version {_short(version)}, newer than this reader's "
                f"{VERSION}: upgrade varstate to read it."
            )
        if sealed and not intact:
            # Say what is wrong where the checks find it; the checksum alone says only that something is.
            mismatch = (f"{META_FILE} fails its crc32c ({actual_crc:#010x}, stored {_short(stored_crc)})")
        elif not sealed and version >= 2:
            mismatch = f"{META_FILE} has no crc32c, which every version {version} checkpoint holds"
        elif version < 1:
            raise DataLossError(f"Checkpoint {path!r}: {META_FILE} is corrupted (format version {version} does "
                                "not exist).")
        else:
            mismatch = None  # intact, or version 1: written before the checksum, checked as strictly otherwise
        try:
            self._open(meta)
        except _BadMetadataError as e:
            also = f"; {mismatch} as well" if mismatch else ""
            raise DataLossError(f"Checkpoint {path!r}: {META_FILE} is corrupted ({e}){also}. Restore an older "
                                "checkpoint.") from None
        except DataLossError as e:
            if mismatch:
                raise DataLossError(f"{e} Its {mismatch} as well.") from None
            raise
        if mismatch:
            raise DataLossError(f"Checkpoint {path!r}: {META_FILE} is corrupted ({mismatch}); a value stored in it, "
                                "or the object graph, may be wrong. Restore an older checkpoint.")
        self._cache: dict[str, np.ndarray] = {}

    def _open(self, meta: dict) -> None:
        if meta.get("format") != FORMAT:
            raise _BadMetadataError(f"format {_short(meta.get('format'))}, not {FORMAT!r}")
        entries = meta.get("entries")
        if not isinstance(entries, dict):
            raise _BadMetadataError(f"its entries are a {type(entries).__name__}, not an object", "TypeError")
        graph_text = meta.get("object_graph")
        if not isinstance(graph_text, str):
            raise _BadMetadataError(f"its object graph is a {type(graph_text).__name__}, not a string", "TypeError")
        try:
            graph = TrackableObjectGraph.FromString(base64.b64decode(graph_text, validate=True))
        except (ValueError, DecodeError) as e:  # binascii.Error is a ValueError
            raise _BadMetadataError(f"its object graph cannot be read ({_first_line(e)})", type(e).__name__) from None
        self.object_graph = graph if graph.nodes else None  # none: a converted name-based checkpoint
        packs = meta.get("packs")
        if not isinstance(packs, list) or not all(type(n) is int and n >= 0 for n in packs):
            raise _BadMetadataError(f"bad pack sizes {_short(packs)}")
        self._packs: list[int] = packs
        self._entries: dict[str, dict] = entries
        self._slices: dict[str, list] = {}
        # What orbax must hold: array name -> (a key it holds, shape, stored dtype name).
        # Only packs some value lies in: nothing reads the others, so a list of a million is no work.
        stored: dict[str, tuple[str, tuple[int, ...], str]] = {}
        for key, entry in entries.items():
            boxes = _validate(key, entry, packs)
            if boxes is not None:
                self._slices[key] = boxes
            for part in entry.get("slices", [entry]) if "python" not in entry else ():
                if "array" in part:
                    if part["array"] in stored:
                        raise _BadMetadataError(f"entry {key!r}: array {part['array']!r} holds another value too")
                    stored[part["array"]] = (key, tuple(part["shape"]), part.get("stored_as", part["dtype"]))
                else:
                    stored.setdefault(f"p{part['pack']}", (key, (packs[part["pack"]],), "uint8"))
        self._check_stored(stored)

    def _check_stored(self, stored: dict[str, tuple[str, tuple[int, ...], str]]) -> None:
        """The shape and dtype orbax holds for each array are the claimed ones, and their bytes are on disk.

        Before anything is allocated: tensorstore allocates what its own
        metadata (in the values files) says, so a lie there, or here, would
        otherwise become a huge allocation.
        """
        values = os.path.join(self.path, "values")
        on_disk = stored_bytes(values, self.path)
        if not stored:
            return
        if not os.path.isdir(values):
            raise self._unreadable(stored, "the values directory is missing")
        import tensorstore as ts  # orbax's own storage library

        driver = "zarr3" if self._uses_zarr3(values) else "zarr"
        context = ts.Context()
        base = {"driver": "file", "path": values + os.sep}
        names = list(stored)
        for start in range(0, len(names), _PROBE_BATCH):
            self._probe(stored, names[start:start + _PROBE_BATCH], driver, base, context)
        sizes = {name: math.prod(shape) * _dtypes.BY_NAME[dtype].itemsize for name, (_, shape, dtype) in stored.items()}
        if sum(sizes.values()) > on_disk + _SLACK:
            largest = {n: stored[n] for n in sorted(sizes, key=sizes.get, reverse=True)}  # the likeliest cut short
            raise self._unreadable(largest, f"they take {sum(sizes.values())} bytes, but the files under {values} "
                                            f"hold {on_disk}: a value file is truncated or missing")

    def _probe(self, stored: dict, names: list[str], driver: str, base: dict, context: Any) -> None:
        import tensorstore as ts

        # Opened together (tensorstore reads their metadata concurrently), a batch at a time: a file naming a
        # million arrays that are not there fails at the first batch.
        opening = {
            name: ts.open({"driver": driver, "kvstore": {"driver": "ocdbt", "base": base, "path": name}},
                          open=True, read=True, context=context)
            for name in names
        }
        for name, future in opening.items():
            key, shape, dtype = stored[name]
            try:
                array = future.result()
            except Exception as e:  # tensorstore's errors are of many types; all mean the files are damaged
                raise self._unreadable({name: stored[name]}, _first_line(e)) from None
            if _PACK_NAME.fullmatch(name) and tuple(array.shape) != shape:
                raise DataLossError(
                    f"Checkpoint {self.path!r}: cannot read stored values: value {key!r} lies in pack {name[1:]}, "
                    f"which holds {math.prod(array.shape)} bytes; the metadata says {shape[0]}. The checkpoint is "
                    "corrupted."
                )
            if tuple(array.shape) != shape or array.dtype.name != dtype:
                raise DataLossError(
                    f"Checkpoint {self.path!r}: cannot read stored values: value {key!r} is stored as "
                    f"{tuple(array.shape)} {array.dtype.name}, its metadata says {shape} {dtype}. The checkpoint "
                    "is corrupted."
                )
            chunk = tuple(array.chunk_layout.read_chunk.shape or ())
            if len(chunk) != len(shape) or any(c > max(d, 1) for c, d in zip(chunk, shape, strict=True)):
                # tensorstore reads whole chunks: one larger than the array would be an allocation of any size
                raise self._unreadable({name: stored[name]}, f"it is stored in chunks of {chunk}, larger than the "
                                                             f"array's shape {shape}")

    def _uses_zarr3(self, values: str) -> bool:
        try:
            about = json.loads(read_regular(os.path.join(values, "_METADATA"), _META_LIMIT, "orbax's metadata"))
        except FileNotFoundError:
            return False  # orbax's default; it fails on the read if the files say otherwise
        except (ValueError, RecursionError) as e:
            raise DataLossError(f"Checkpoint {self.path!r}: cannot read stored values: values/_METADATA is "
                                f"corrupted ({_first_line(e)}).") from None
        return isinstance(about, dict) and about.get("use_zarr3") is True

    def _unreadable(self, names: dict, why: str) -> DataLossError:
        keys = list(dict.fromkeys(key for key, *_ in names.values()))
        which = ", ".join(repr(k) for k in keys[:3]) + (f" and {len(keys) - 3} more" if len(keys) > 3 else "")
        return DataLossError(
            f"Checkpoint {self.path!r}: cannot read stored values ({which}): {why}. The value files are damaged; "
            "restore an older checkpoint."
        )

    def keys(self) -> list[str]:
        return sorted(self._entries)

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    def _entry(self, key: str) -> dict:
        try:
            return self._entries[key]
        except KeyError:
            raise KeyError(f"Key {key!r} not found in checkpoint {self.path!r}.") from None

    def shape(self, key: str) -> tuple[int, ...]:
        e = self._entry(key)
        return () if "python" in e else tuple(e["shape"])

    def dtype(self, key: str) -> np.dtype:
        e = self._entry(key)
        if "python" in e:
            return np.asarray(e["value"]).dtype
        return _dtypes.by_name(e["dtype"], key)

    def get(self, key: str) -> np.ndarray:
        return self.get_many({key: None})[key]

    def get_into(self, key: str, sharding: Any) -> jax.Array:
        return self.get_many({key: sharding})[key]

    def get_many(self, requests: dict[str, Any]) -> dict[str, Any]:
        """{key: target sharding or None} -> {key: jax.Array on that sharding, or np.ndarray}.

        One orbax restore for all of them; large values with a target
        sharding go straight to their devices.
        """
        want: dict[str, Any] = {}
        for key, sharding in requests.items():
            e = self._entry(key)
            for part in e.get("slices", [e]) if "python" not in e else ():
                if "array" in part:
                    direct = sharding is not None and "slices" not in e
                    want[part["array"]] = (key, part, sharding if direct else None)
                else:
                    want.setdefault(f"p{part['pack']}", (key, part, None))
        loaded = self._load(want)
        out = {}
        for key in requests:
            e = self._entries[key]
            if "python" in e:
                out[key] = np.asarray(e["value"].encode() if e["python"] == "str" else e["value"])
            elif "slices" in e:
                out[key] = self._assemble(key, e, loaded)
            else:
                out[key] = self._value(key, e, loaded)
        puts = [k for k, s in requests.items() if s is not None and isinstance(out[k], np.ndarray)]
        if puts:
            placed = jax.device_put([out[k] for k in puts], [requests[k] for k in puts])
            out.update(zip(puts, placed, strict=True))
        return out

    def _load(self, want: dict[str, tuple]) -> dict[str, Any]:
        # Host copies are cached for later (deferred) restores; arrays placed on devices are
        # handed out once, since their owner may donate them.
        missing = {n: w for n, w in want.items() if n not in self._cache or w[2] is not None}
        got: dict[str, Any] = {}
        if missing:
            item, restore_args = {}, {}
            for name, (_, part, sharding) in missing.items():
                if sharding is not None:  # shapes and dtypes were checked against orbax's when the reader opened
                    dtype, shape = _dtypes.by_name(part.get("stored_as", part["dtype"]), name), tuple(part["shape"])
                    item[name] = jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)
                    restore_args[name] = ocp.ArrayRestoreArgs(sharding=sharding, global_shape=shape, dtype=dtype)
                else:
                    item[name] = np.empty(0, np.uint8)  # a placeholder: the stored array is read as it is
                    restore_args[name] = ocp.RestoreArgs(restore_type=np.ndarray)
            handler = ocp.PyTreeCheckpointHandler()
            try:
                got = handler.restore(
                    epath.Path(os.path.join(self.path, "values")),
                    args=ocp.args.PyTreeRestore(item=item, restore_args=restore_args, partial_restore=True),
                )
            except Exception as e:  # tensorstore reports damaged files as exceptions of many types, even bare ones
                named = {n: (w[0],) for n, w in missing.items() if f'"{n}/' in str(e)}  # its message names arrays
                raise self._unreadable(named or {n: (w[0],) for n, w in missing.items()}, _first_line(e)) from e
            finally:
                handler.close()
            for name, (key, part, _) in missing.items():
                value = got.get(name)
                shape, dtype = self._stored_as(name, part)
                if not isinstance(value, (np.ndarray, jax.Array)) or tuple(value.shape) != shape or \
                        np.dtype(value.dtype) != dtype:  # orbax's own metadata decides what it hands back
                    found = f"{type(value).__name__} {getattr(value, 'shape', '')} {getattr(value, 'dtype', '')}"
                    raise self._unreadable({name: (key,)}, f"orbax returned {found.strip()} for {shape} {dtype}")
            self._cache.update((n, v) for n, v in got.items() if isinstance(v, np.ndarray))
        return {n: got[n] if n in got else self._cache[n] for n in want}

    def _stored_as(self, name: str, part: dict) -> tuple[tuple[int, ...], np.dtype]:
        if _PACK_NAME.fullmatch(name):
            return (self._packs[int(name[1:])],), np.dtype(np.uint8)
        return tuple(part["shape"]), _dtypes.BY_NAME[part.get("stored_as", part["dtype"])]

    def _value(self, key: str, e: dict, loaded: dict) -> Any:
        dtype, shape = _dtypes.by_name(e["dtype"], key), tuple(e["shape"])
        if "offset" in e:
            nbytes = math.prod(shape) * dtype.itemsize
            packed, start = loaded[f"p{e['pack']}"], e["offset"]  # offsets were checked against the pack sizes
            if packed.size != self._packs[e["pack"]]:
                raise DataLossError(
                    f"Checkpoint {self.path!r}: value {key!r} lies in pack {e['pack']}, which holds {packed.size} "
                    f"bytes; the metadata says {self._packs[e['pack']]}. The checkpoint is corrupted."
                )
            value = packed[start:start + nbytes].view(dtype).reshape(shape)
            host = value
        else:
            value = loaded[e["array"]]
            if "stored_as" in e and np.dtype(value.dtype) == np.dtype(e["stored_as"]):
                value = value.astype(dtype)
            if tuple(value.shape) != shape or np.dtype(value.dtype) != dtype:
                raise DataLossError(
                    f"Checkpoint {self.path!r}: value {key!r} has shape {tuple(value.shape)} {value.dtype}, "
                    f"its metadata says {shape} {dtype}."
                )
            if not _on_every_host(value) or ("crc32c" not in e and "shards" in e):
                self._check_shards(key, e, value)
                return value
            host = np.asarray(value)
        if crc32c(host) != e["crc32c"]:
            raise DataLossError(
                f"Checkpoint {self.path!r}: checksum mismatch for {key!r} (crc32c {crc32c(host):#010x}, "
                f"expected {e['crc32c']:#010x}); the checkpoint is corrupted. Restore an older checkpoint."
            )
        return value

    def _check_shards(self, key: str, e: dict, value: Any) -> None:
        """Checks the saved shards this process holds whole (each process checks its own: no gather).

        A value restored onto a layout whose shards are smaller than the
        saved ones is checked where a process holds a saved shard whole; a
        value saved by one process and restored across several, with no
        per-shard checksums, is not checked here (its bytes are read as
        stored; tensorstore's own chunk reads still fail on truncation).
        """
        shards = e.get("shards", [])
        if isinstance(value, np.ndarray) or (isinstance(value, jax.Array) and value.is_fully_addressable):
            local = [((slice(None),) * value.ndim, np.asarray(value))]
        else:
            local = [(s.index, s.data) for s in value.addressable_shards if s.replica_id == 0]
        shape = tuple(value.shape)
        for part in shards:
            box = [tuple(b) for b in part["box"]]
            for index, data in local:
                have = _box_of(index, shape)
                if all(ho <= o and o + n <= ho + hn for (o, n), (ho, hn) in zip(box, have, strict=True)):
                    inner = tuple(slice(o - ho, o - ho + n) for (o, n), (ho, _) in zip(box, have, strict=True))
                    got = crc32c(np.ascontiguousarray(np.asarray(data[inner] if inner else data)))
                    if got != part["crc32c"]:
                        raise DataLossError(
                            f"Checkpoint {self.path!r}: checksum mismatch for {key!r} in its shard at "
                            f"{[o for o, _ in box]} of shape {[n for _, n in box]} (crc32c {got:#010x}, expected "
                            f"{part['crc32c']:#010x}); the checkpoint is corrupted. Restore an older checkpoint."
                        )
                    break

    def _assemble(self, key: str, e: dict, loaded: dict) -> np.ndarray:
        # Each slice is read and checked first: the full array is allocated only once the stored
        # bytes are in hand (its slices tile it, so they account for every element).
        parts = [np.asarray(self._value(key, part, loaded)) for part in e["slices"]]
        full = np.empty(tuple(e["shape"]), _dtypes.by_name(e["dtype"], key))
        for box, part in zip(self._slices[key], parts, strict=True):
            full[_keys.slice_index(*zip(*box, strict=True))] = part
        return full


def is_temporary(path: str) -> bool:
    """True for the directory of an orbax save that has not committed (asked of orbax, which names them)."""
    from etils import epath

    return bool(ocp.step.is_tmp_checkpoint(epath.Path(path)))
