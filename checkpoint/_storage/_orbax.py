"""The orbax storage backend: values through orbax/tensorstore, graph and layout beside them.

A checkpoint is an orbax composite directory:
  values/  an orbax PyTree: "p0", "p1", ... (uint8; the values under
           `_PACK_LIMIT` bytes, back to back, up to `_PACK_BYTES` a pack, so
           restoring one value reads one pack) and "a0", "a1", ... (each large
           value as its own array, sharded as it was)
  meta/    JSON: format version, the serialized TrackableObjectGraph, and per
           checkpoint key its dtype, shape, crc32c and where its bytes are.
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
from checkpoint._errors import DataLossError
from checkpoint._storage._crc import crc32c
from checkpoint._storage._files import ORBAX_METADATA
from checkpoint.protos.trackable_object_graph_pb2 import TrackableObjectGraph

FORMAT = "varstate-orbax"
VERSION = 1
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

    def __init__(self) -> None:
        self.small: list[tuple[dict, Any]] = []
        self.large: dict[str, Any] = {}
        self.entries: dict[str, dict] = {}

    def add_array(self, key: str, value: Any, **extra: Any) -> dict:
        dtype = np.dtype(value.dtype)
        if dtype.name not in _dtypes.BY_NAME:
            raise TypeError(f"Cannot save {key!r}: dtype {dtype} is not supported by the orbax format.")
        entry = {"dtype": dtype.name, "shape": list(value.shape), **extra}
        nbytes = math.prod(value.shape) * dtype.itemsize
        if nbytes < _PACK_LIMIT:
            self.small.append((entry, value))
        else:
            name = f"a{len(self.large)}"
            if dtype.name in _STORED_AS:  # a type tensorstore lacks: its values, widened losslessly
                entry["stored_as"] = _STORED_AS[dtype.name].name
                value = value.astype(_STORED_AS[dtype.name])
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
        for entry in self.entries_with_arrays():
            entry["crc32c"] = crc32c(np.asarray(jax.device_get(self.large[entry["array"]])))
        return tree, {"packs": sizes}

    def entries_with_arrays(self):
        for entry in self.entries.values():
            for e in entry.get("slices", [entry]):
                if "array" in e:
                    yield e


def layout(values: dict[str, Any], object_graph: TrackableObjectGraph) -> tuple[dict, dict]:
    """{key: array | Python scalar | [(SaveSliceInfo, array), ...]} -> (orbax tree, JSON metadata)."""
    lay = _Layout()
    for key, value in values.items():
        if isinstance(value, (bool, int, float, str)) and not isinstance(value, np.generic):  # np.float64: array
            base = _dtypes.python_type(value)  # an IntEnum is an int
            lay.entries[key] = {"python": base.__name__, "value": base(value)}
        elif isinstance(value, list):
            info0 = value[0][0]
            lay.entries[key] = {
                "dtype": np.dtype(value[0][1].dtype).name,
                "shape": list(info0.full_shape),
                "slices": [lay.add_array(key, v, spec=info.spec) for info, v in value],
            }
        else:
            lay.entries[key] = lay.add_array(key, value)
    tree, extra = lay.finish()
    meta = {
        "format": FORMAT,
        "version": VERSION,
        "object_graph": base64.b64encode(object_graph.SerializeToString()).decode("ascii"),
        "entries": lay.entries,
        **extra,
    }
    return tree, meta


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


def _validate(key: str, e: Any, packs: list[int], sliced: bool = False) -> None:
    """Metadata is data: every name, shape and offset is checked before it is used."""
    if not isinstance(e, dict):
        raise TypeError(f"entry {key!r} is not an object")
    if "python" in e and not sliced:
        if type(e.get("value")) is not _dtypes.PYTHON_TYPES.get(e["python"]) and not (
                e["python"] == "float" and type(e.get("value")) is int):
            raise ValueError(f"entry {key!r}: value does not match its type {e['python']!r}")
        return
    _dtypes.by_name(e.get("dtype"), key)
    shape = e.get("shape")
    if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
        raise ValueError(f"entry {key!r}: bad shape {shape!r}")
    if "slices" in e and not sliced:
        if not isinstance(e["slices"], list) or not e["slices"]:
            raise ValueError(f"entry {key!r}: bad slices")
        boxes = []
        for part in e["slices"]:
            _validate(key, part, packs, sliced=True)
            spec = part["spec"] if isinstance(part.get("spec"), str) else ""
            full, offset, extent = _keys.parse_slice_spec(key, spec)
            if list(full) != shape or list(extent) != part["shape"] or any(
                    o < 0 or o + n > d for o, n, d in zip(offset, extent, shape, strict=True)):
                raise ValueError(f"entry {key!r}: slice {part['spec']!r} does not fit shape {shape}")
            boxes.append(list(zip(offset, extent, strict=True)))
        if not _keys.covers_exactly(shape, boxes):
            raise ValueError(f"entry {key!r}: its slices overlap or do not cover shape {shape}")
        return
    if type(e.get("crc32c")) is not int:
        raise ValueError(f"entry {key!r}: no crc32c")
    if "array" in e:
        if not isinstance(e["array"], str) or not _ARRAY_NAME.fullmatch(e["array"]):
            raise ValueError(f"entry {key!r}: bad array name {e['array']!r}")
        if "stored_as" in e and (_STORED_AS.get(e["dtype"]) is None or e["stored_as"] != _STORED_AS[e["dtype"]].name):
            raise ValueError(f"entry {key!r}: {e['dtype']} cannot be stored as {e['stored_as']!r}")
    else:
        pack, offset = e.get("pack"), e.get("offset")
        nbytes = math.prod(shape) * _dtypes.by_name(e["dtype"], key).itemsize
        if type(pack) is not int or not 0 <= pack < len(packs):
            raise ValueError(f"entry {key!r}: no pack {pack!r}")
        if type(offset) is not int or offset < 0 or offset + nbytes > packs[pack]:
            raise ValueError(f"entry {key!r}: bytes [{offset}, +{nbytes}) lie outside pack {pack}")


class OrbaxReader:
    """Reads one orbax-format checkpoint (the reader protocol of `read_checkpoint`).

    >>> import tempfile, os, jax.numpy as jnp, checkpoint
    >>> path = checkpoint.Checkpoint(w=jnp.arange(3.0)).write(os.path.join(tempfile.mkdtemp(), "ckpt"))
    >>> r = OrbaxReader(path)
    >>> r.keys(), r.get("w/.ATTRIBUTES/VARIABLE_VALUE").tolist()
    (['w/.ATTRIBUTES/VARIABLE_VALUE'], [0.0, 1.0, 2.0])
    """

    def __init__(self, path: str) -> None:
        self.path = os.path.abspath(path)
        meta_path = os.path.join(self.path, META_FILE)
        try:
            with open(meta_path, encoding="utf-8") as f:
                meta = json.load(f)
        except FileNotFoundError:
            raise ValueError(
                f"{path!r} is not a checkpoint: {META_FILE} is missing. Pass a path returned by "
                "Checkpoint.save/write or checkpoint.latest_checkpoint(directory)."
            ) from None
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise DataLossError(f"Checkpoint {path!r}: {META_FILE} is corrupted ({e}).") from None
        if not isinstance(meta, dict) or meta.get("format") != FORMAT:
            found = f"format {meta.get('format')!r}" if isinstance(meta, dict) else f"a {type(meta).__name__}"
            raise ValueError(f"{path!r} is not a varstate checkpoint ({found} in {META_FILE}).")
        version = meta.get("version")
        if not isinstance(version, int) or version > VERSION:
            raise ValueError(
                f"Checkpoint {path!r} has format version {version!r}, newer than this reader's "
                f"{VERSION}: upgrade varstate to read it."
            )
        try:
            self._entries: dict[str, dict] = meta["entries"]
            if not isinstance(self._entries, dict):
                raise TypeError(f"its entries are a {type(self._entries).__name__}, not an object")
            graph = TrackableObjectGraph.FromString(base64.b64decode(meta["object_graph"]))
            self.object_graph = graph if graph.nodes else None  # none: a converted name-based checkpoint
            self._packs = [int(n) for n in meta["packs"]]
            if any(n < 0 for n in self._packs):
                raise ValueError(f"negative pack size in {self._packs}")
            for key, entry in self._entries.items():
                _validate(key, entry, self._packs)
        except (KeyError, TypeError, ValueError, DecodeError) as e:
            raise DataLossError(f"Checkpoint {path!r}: {META_FILE} is corrupted ({type(e).__name__}: {e}).") from None
        self._cache: dict[str, np.ndarray] = {}

    def keys(self) -> list[str]:
        return sorted(self._entries)

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
            for part in e.get("slices", [e]):
                if "array" in part:
                    direct = sharding is not None and "slices" not in e
                    want[part["array"]] = (part, sharding if direct else None)
                elif "offset" in part:
                    want[f"p{part['pack']}"] = (part, None)
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
        missing = {n: w for n, w in want.items() if n not in self._cache or w[1] is not None}
        got: dict[str, Any] = {}
        if missing:
            item, restore_args = {}, {}
            for name, (part, sharding) in missing.items():
                if "offset" in part:
                    item[name] = np.empty(0, np.uint8)  # a placeholder: the stored size is checked on use
                    restore_args[name] = ocp.RestoreArgs(restore_type=np.ndarray)
                elif sharding is not None:
                    dtype, shape = _dtypes.by_name(part.get("stored_as", part["dtype"]), name), tuple(part["shape"])
                    item[name] = jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)
                    restore_args[name] = ocp.ArrayRestoreArgs(sharding=sharding, global_shape=shape, dtype=dtype)
                else:
                    item[name] = np.empty(0, np.uint8)
                    restore_args[name] = ocp.RestoreArgs(restore_type=np.ndarray)
            handler = ocp.PyTreeCheckpointHandler()
            try:
                got = handler.restore(
                    epath.Path(os.path.join(self.path, "values")),
                    args=ocp.args.PyTreeRestore(item=item, restore_args=restore_args, partial_restore=True),
                )
            except (ValueError, RuntimeError, OSError, KeyError) as e:  # how tensorstore reports damaged files
                raise DataLossError(f"Checkpoint {self.path!r}: cannot read stored values ({e}).") from e
            finally:
                handler.close()
            self._cache.update((n, v) for n, v in got.items() if isinstance(v, np.ndarray))
        return {n: got[n] if n in got else self._cache[n] for n in want}

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
            host = np.asarray(value)
        if crc32c(host) != e["crc32c"]:
            raise DataLossError(
                f"Checkpoint {self.path!r}: checksum mismatch for {key!r} (crc32c {crc32c(host):#010x}, "
                f"expected {e['crc32c']:#010x}); the checkpoint is corrupted. Restore an older checkpoint."
            )
        return value

    def _assemble(self, key: str, e: dict, loaded: dict) -> np.ndarray:
        full = np.zeros(tuple(e["shape"]), _dtypes.by_name(e["dtype"], key))
        for part in e["slices"]:
            _, offset, extent = _keys.parse_slice_spec(key, part["spec"])  # validated to fit in __init__
            index = _keys.slice_index(offset, extent)
            full[index] = np.asarray(self._value(key, part, loaded))
        return full


def is_temporary(path: str) -> bool:
    """True for the directory of an orbax save that has not committed (asked of orbax, which names them)."""
    from etils import epath

    return bool(ocp.step.is_tmp_checkpoint(epath.Path(path)))
