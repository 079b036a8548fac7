"""The orbax storage backend: values through orbax/tensorstore, graph and layout beside them.

A checkpoint is an orbax composite directory:
  values/  an orbax PyTree: "p0", "p1", ... (batches: uint8, the values
           under `BATCH_LIMIT` bytes back to back, up to `BATCH_BYTES` a
           batch, so restoring one value reads one batch) and "a0", "a1", ...
           (each large value as its own array, sharded as it was)
  meta/    JSON: format version, the serialized TrackableObjectGraph, and per
           checkpoint key its dtype, shape, crc32c and where its bytes are
           (or a Python value itself: a batched value's entry names its batch
           as "pack" and the metadata lists the batches' sizes as "packs",
           the format's names since version 1); since version 2 also a crc32c of the
           rest of the JSON in canonical form (`seal`), so a flipped bit in a
           Python value or the graph is caught like one in an array.
orbax writes into a temporary directory and renames it when everything is
written, so a checkpoint either exists whole or not at all. Batching is what
makes 2,000 small variables cost one orbax array instead of 2,000.

Three modules: `_orbax_layout` (saving: the layout, checksums, the orbax
checkpointer), `_orbax_validate` (the metadata's checks) and this one, the
reader, which also keeps the names the rest of the package uses.
"""

from __future__ import annotations

import base64
import collections
import json
import math
import os
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath
from google.protobuf.message import DecodeError

from checkpoint import _dtypes, _keys
from checkpoint._errors import CheckpointFormatError, DataLossError
from checkpoint._storage._crc import crc32c
from checkpoint._storage._files import read_regular, within
from checkpoint._storage._host import aligned_empty, held_here, place, place_many, release_freed_memory
from checkpoint._storage._orbax_layout import (
    FORMAT,
    META_FILE,
    VERSION,
    canonical,
    checkpointer,
    complete,
    layout,
    on_every_host,
    save_args,
    seal,
    settle,
    staged_bytes,
)
from checkpoint._storage._orbax_native import KeyedReader
from checkpoint._storage._orbax_validate import (
    MAX_DEPTH,
    BadMetadataError,
    check_stored,
    first_line,
    future_result,
    open_array,
    short,
    too_deep,
    unreadable,
    validate,
)
from checkpoint.protos.trackable_object_graph_pb2 import TrackableObjectGraph

__all__ = ["FORMAT", "META_FILE", "VERSION", "OrbaxReader", "checkpointer", "complete", "crc32c", "is_temporary",
           "layout", "save_args", "seal", "settle", "staged_bytes"]

_META_LIMIT = 256 << 20  # bytes of meta/metadata; a million keys take about 200 MB
_OPEN_AHEAD = 256  # arrays opened ahead of the reads
_READ_AHEAD = 64 << 20  # bytes of values being read while the ones before are checked and placed
_TRIM_EVERY = 16 << 20  # bytes of values read between two returns of tensorstore's freed buffers to the system


class OrbaxReader(KeyedReader):
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
            raise DataLossError(f"Checkpoint {path!r}: {META_FILE} is corrupted ({first_line(e)}).") from None
        if too_deep(meta):
            raise DataLossError(
                f"Checkpoint {path!r}: {META_FILE} is corrupted (its JSON is nested deeper than {MAX_DEPTH} levels; "
                "this format uses 6)."
            )
        sealed = isinstance(meta, dict) and "crc32c" in meta
        if not sealed and (not isinstance(meta, dict) or meta.get("format") != FORMAT):
            found = f"format {short(meta.get('format'))}" if isinstance(meta, dict) else f"a {type(meta).__name__}"
            raise ValueError(f"{path!r} is not a varstate checkpoint ({found} in {META_FILE}).")
        actual_crc = crc32c(canonical(meta)) if sealed else None
        broken = sealed and meta["crc32c"] != actual_crc
        version = meta.get("version")
        if type(version) is not int:
            raise DataLossError(f"Checkpoint {path!r}: {META_FILE} is corrupted (its format version "
                                f"{short(version)} is not an integer).")
        if version > VERSION:
            if broken:  # a newer writer may seal differently: either may be the case
                raise CheckpointFormatError(
                    f"Checkpoint {path!r} has format version {short(version)}, newer than this reader's {VERSION}, "
                    f"or its {META_FILE} is corrupted (it fails its crc32c): upgrade varstate to read it, or "
                    "restore an older checkpoint."
                )
            raise ValueError(
                f"Checkpoint {path!r} has format version {short(version)}, newer than this reader's "
                f"{VERSION}: upgrade varstate to read it."
            )
        if broken:
            # Say what is wrong where the checks find it; the checksum alone says only that something is.
            mismatch = (f"{META_FILE} fails its crc32c ({actual_crc:#010x}, stored {short(meta['crc32c'])})")
        elif not sealed and version >= 2:
            mismatch = f"{META_FILE} has no crc32c, which every version {version} checkpoint holds"
        elif version < 1:
            raise DataLossError(f"Checkpoint {path!r}: {META_FILE} is corrupted (format version {version} does "
                                "not exist).")
        else:
            mismatch = None  # intact, or version 1: written before the checksum, checked as strictly otherwise
        try:
            self._open(meta)
        except BadMetadataError as e:
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
            raise BadMetadataError(f"format {short(meta.get('format'))}, not {FORMAT!r}")
        entries = meta.get("entries")
        if not isinstance(entries, dict):
            raise BadMetadataError(f"its entries are a {type(entries).__name__}, not an object", "TypeError")
        graph_text = meta.get("object_graph")
        if not isinstance(graph_text, str):
            raise BadMetadataError(f"its object graph is a {type(graph_text).__name__}, not a string", "TypeError")
        try:
            graph = TrackableObjectGraph.FromString(base64.b64decode(graph_text, validate=True))
        except (ValueError, DecodeError) as e:  # binascii.Error is a ValueError
            raise BadMetadataError(f"its object graph cannot be read ({first_line(e)})", type(e).__name__) from None
        self.object_graph = graph if graph.nodes else None  # none: a converted name-based checkpoint
        batches = meta.get("packs")
        if not isinstance(batches, list) or not all(type(n) is int and n >= 0 for n in batches):
            raise BadMetadataError(f"bad pack sizes {short(batches)}")
        self._batches: list[int] = batches
        self._entries = entries  # key -> its entry
        self._slices: dict[str, list] = {}
        # What orbax must hold: array name -> (a key it holds, shape, stored dtype name).
        # Only batches some value lies in: nothing reads the others, so a list of a million is no work.
        stored: dict[str, tuple[str, tuple[int, ...], str]] = {}
        for key, entry in entries.items():
            boxes = validate(key, entry, batches)
            if boxes is not None:
                self._slices[key] = boxes
            for part in entry.get("slices", [entry]) if "python" not in entry else ():
                if "array" in part:
                    if part["array"] in stored:
                        raise BadMetadataError(f"entry {key!r}: array {part['array']!r} holds another value too")
                    stored[part["array"]] = (key, tuple(part["shape"]), part.get("stored_as", part["dtype"]))
                else:
                    stored.setdefault(f"p{part['pack']}", (key, (batches[part["pack"]],), "uint8"))
        self._driver = check_stored(self.path, stored)

    def shape(self, key: str) -> tuple[int, ...]:
        e = self._lookup(key)
        return () if "python" in e else tuple(e["shape"])

    def dtype(self, key: str) -> np.dtype:
        e = self._lookup(key)
        if "python" in e:
            return np.asarray(e["value"]).dtype
        return _dtypes.by_name(e["dtype"], key)

    @property
    def format_name(self) -> str:
        return f"orbax {'object' if self.object_graph is not None else 'name'}-based checkpoint"

    def python_value(self, key: str) -> bool | int | float | str | None:
        """The Python value stored under `key` as itself (`get` gives it as an array), or None for an array."""
        e = self._lookup(key)
        return e["value"] if "python" in e else None

    def stored_together(self, keys: list[str]) -> list[list[str]]:
        """`keys` a batch to a group (one read loads, checks and keeps a batch whole), after those stored alone."""
        batch_of = {}
        for key in keys:
            e = self._lookup(key)
            if isinstance(e, dict) and "pack" in e:
                batch_of[key] = e["pack"]
        groups: dict[Any, list[str]] = {}
        for key in sorted(keys, key=lambda k: (batch_of.get(k, -1), k)):
            groups.setdefault(batch_of.get(key, key), []).append(key)
        return list(groups.values())

    def get_slices(self, key: str) -> list[tuple[slice, ...]]:
        self._lookup(key)
        return [_keys.slice_index(*zip(*box, strict=True)) for box in self._slices.get(key, ())]

    def get_many(self, requests: dict[str, Any]) -> dict[str, Any]:
        """{key: target sharding or None} -> {key: jax.Array on that sharding, or np.ndarray}.

        Large values with a target sharding this process holds whole are
        read one after another (a few ahead), each checked and put on its
        devices as it arrives, so its bytes are checksummed while still in
        the cache and the host copy is freed at once; the rest are read
        together (a sharding across processes through orbax, which reads
        each process's own shards).
        """
        want: dict[str, Any] = {}
        for key, sharding in requests.items():
            e = self._lookup(key)
            for part in e.get("slices", [e]) if "python" not in e else ():
                if "array" in part:
                    direct = sharding is not None and "slices" not in e
                    want[part["array"]] = (key, part, sharding if direct else None)
                else:
                    want.setdefault(f"p{part['pack']}", (key, part, None))
        streamed = {n: w for n, w in want.items() if w[2] is not None and held_here(w[2])}
        loaded = self._load({n: w for n, w in want.items() if n not in streamed})
        out = {}
        for name, host in self._read(streamed):  # checked on the host, before any device holds it
            key, part, sharding = streamed[name]
            self._check_read(name, key, part, host)
            out[key] = place(self._value(key, part, {name: host}), sharding)  # no copy where it can
        for key in requests:
            e = self._entries[key]
            if key in out:
                continue
            if "python" in e:
                out[key] = np.asarray(e["value"].encode() if e["python"] == "str" else e["value"])
            elif "slices" in e:
                out[key] = self._assemble(key, e, loaded)
            else:
                out[key] = self._value(key, e, loaded)
        puts = [k for k, s in requests.items() if s is not None and isinstance(out[k], np.ndarray)]
        out.update(zip(puts, place_many([out[k] for k in puts], [requests[k] for k in puts]), strict=True))
        return {key: out[key] for key in requests}

    def _load(self, want: dict[str, tuple]) -> dict[str, Any]:
        # Host copies are cached for later (deferred) restores; arrays placed on devices are
        # handed out once, since their owner may donate them.
        missing = {n: w for n, w in want.items() if n not in self._cache or w[2] is not None}
        spread = {n: w for n, w in missing.items() if w[2] is not None}
        got: dict[str, Any] = self._load_orbax(spread) if spread else {}
        got.update(self._read({n: w for n, w in missing.items() if n not in spread}))
        for name, (key, part, _) in missing.items():
            self._check_read(name, key, part, got.get(name))
        self._cache.update((n, v) for n, v in got.items() if n not in spread)
        return {n: got[n] if n in got else self._cache[n] for n in want}

    def _load_orbax(self, missing: dict[str, tuple]) -> dict[str, Any]:
        """Arrays onto shardings that span processes, through orbax: each process reads its own shards."""
        item, restore_args = {}, {}
        for name, (_, part, sharding) in missing.items():
            # shapes and dtypes were checked against orbax's when the reader opened
            dtype, shape = _dtypes.by_name(part.get("stored_as", part["dtype"]), name), tuple(part["shape"])
            item[name] = jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)
            restore_args[name] = ocp.ArrayRestoreArgs(sharding=sharding, global_shape=shape, dtype=dtype)
        handler = ocp.PyTreeCheckpointHandler()
        try:
            return handler.restore(
                epath.Path(os.path.join(self.path, "values")),
                args=ocp.args.PyTreeRestore(item=item, restore_args=restore_args, partial_restore=True),
            )
        except Exception as e:  # tensorstore reports damaged files as exceptions of many types, even bare ones
            named = {n: w for n, w in missing.items() if f'"{n}/' in str(e)}  # its message names arrays
            raise unreadable(self.path, named or missing, first_line(e)) from e
        finally:
            handler.close()

    def _read(self, want: dict[str, tuple]):
        """Yields (name, numpy array) for the stored arrays `want` names, in order, with tensorstore.

        Reads run in tensorstore's threads, up to `_READ_AHEAD` bytes beyond
        the array being handed out, so the caller's work on one array (its
        checksum, its copy to a device) overlaps the reading of the next.
        The arrays' stored shapes, dtypes and chunks were checked when the
        reader opened; `want` maps each to (the key of the value it holds, ...), for errors.
        """
        import tensorstore as ts  # orbax's own storage library

        context = ts.Context()
        values = os.path.join(self.path, "values")

        def start_open(name: str) -> tuple[str, Any]:
            return name, open_array(values, self._driver, name, context)

        # Opened a few hundred ahead of the reads (their metadata is read concurrently), never all of a million at once.
        names = list(want)
        opening = collections.deque(start_open(name) for name in names[:_OPEN_AHEAD])
        later = collections.deque(names[_OPEN_AHEAD:])
        reading: collections.deque = collections.deque()
        ahead = freed = 0
        while opening or reading:
            # two values at least: a large one is one read in one of tensorstore's threads
            while opening and (len(reading) < 2 or ahead < _READ_AHEAD):
                name, future = opening.popleft()
                if later:
                    opening.append(start_open(later.popleft()))
                store = future_result(self.path, future, {name: want[name]})
                nbytes = math.prod(store.shape) * store.dtype.numpy_dtype.itemsize
                # Straight into the buffer the value is placed from: tensorstore's own result would be
                # copied again by device_put (it is not 64-byte aligned).
                buf = aligned_empty(tuple(store.shape), store.dtype.numpy_dtype)
                reading.append((name, buf, ts.array(buf, copy=False, write=True).write(store), nbytes))
                ahead += nbytes
            name, buf, future, nbytes = reading.popleft()
            ahead -= nbytes
            future_result(self.path, future, {name: want[name]})
            freed += nbytes
            if freed >= _TRIM_EVERY:
                release_freed_memory()  # tensorstore's read buffers for the values up to this one
                freed = 0
            yield name, buf

    def _check_read(self, name: str, key: str, part: dict, value: Any) -> None:
        """Raises unless `value`, read for stored array `name`, has the shape and dtype it is stored with.

        The values files' own metadata decides what tensorstore and orbax read.
        """
        if "array" in part:
            shape, dtype = tuple(part["shape"]), _dtypes.BY_NAME[part.get("stored_as", part["dtype"])]
        else:
            shape, dtype = (self._batches[part["pack"]],), np.dtype(np.uint8)
        if not isinstance(value, (np.ndarray, jax.Array)) or tuple(value.shape) != shape or \
                np.dtype(value.dtype) != dtype:
            found = f"{type(value).__name__} {getattr(value, 'shape', '')} {getattr(value, 'dtype', '')}"
            raise unreadable(self.path, {name: (key,)}, f"read {found.strip()} for {shape} {dtype}")

    def _value(self, key: str, e: dict, loaded: dict) -> Any:
        dtype, shape = _dtypes.by_name(e["dtype"], key), tuple(e["shape"])
        # What was read has the shape and dtype it is stored with (`_check_read`), and each batch the size
        # the metadata gives, which its values' offsets were checked against (`validate`).
        if "offset" in e:
            nbytes = math.prod(shape) * dtype.itemsize
            batch, start = loaded[f"p{e['pack']}"], e["offset"]
            value = host = batch[start:start + nbytes].view(dtype).reshape(shape)
        else:
            value = loaded[e["array"]]
            if "stored_as" in e:
                value = value.astype(dtype)
            if not on_every_host(value) or ("crc32c" not in e and "shards" in e):
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
        if not isinstance(value, jax.Array) or value.is_fully_addressable:
            local = [((slice(None),) * value.ndim, np.asarray(value))]
        else:
            local = [(s.index, s.data) for s in value.addressable_shards if s.replica_id == 0]
        for part in e.get("shards", []):
            box = [tuple(b) for b in part["box"]]
            for index, data in local:
                have = _keys.box_of(index, value.shape)
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
        for index, part in zip(self.get_slices(key), parts, strict=True):
            full[index] = part
        return full


def is_temporary(path: str) -> bool:
    """True for the directory of an orbax save that has not committed (asked of orbax, which names them)."""
    return bool(ocp.step.is_tmp_checkpoint(epath.Path(path)))
