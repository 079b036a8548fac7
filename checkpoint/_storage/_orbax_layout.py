"""The orbax format's save side: values into the orbax tree (batches and arrays) and the JSON metadata.

The format itself is described in `_orbax`'s docstring; this module decides
where each value's bytes go, checksums them, and seals the metadata.
"""

from __future__ import annotations

import base64
import concurrent.futures
import functools
import json
import math
import os
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from checkpoint import _dtypes, _keys
from checkpoint._errors import DataLossError
from checkpoint._storage import _distributed
from checkpoint._storage._crc import crc32c, crc32c_spans
from checkpoint._storage._files import ORBAX_METADATA, shared_pool
from checkpoint.protos.trackable_object_graph_pb2 import TrackableObjectGraph

FORMAT = "varstate-orbax"
VERSION = 2  # 2: the metadata carries a crc32c of itself (1 is read, without one)
META_FILE = ORBAX_METADATA
BATCH_LIMIT = 1 << 20  # values smaller than this are batched
BATCH_BYTES = 64 << 20  # a batch is closed once it holds this much
# tensorstore starts a new OCDBT data file once one holds this much. Unbounded (orbax's default), a save's values
# go to one file (all but the last written), synced as one: 2 GiB in 16 arrays saved 1.9x slower than the same
# values in the TF format (paired median of 8 rounds); in files of 256 MiB, 0.9x. 64 MiB and 128 MiB measured alike
# within the machine's noise; fewer, larger files keep a large checkpoint's file count low.
DATA_FILE_BYTES = 256 << 20
ALIGN = 64
# Large arrays of these types are written as the wider type (tensorstore has no uint4); the
# bytes, and so the checksum, are the same: ml_dtypes keeps one uint4 per byte.
STORED_AS = {"uint4": np.dtype(np.uint8)}


class _Batch(np.ndarray):
    """A batch `layout` made. Nothing else holds it, and it already is a copy taken at the save's call, so orbax's
    snapshot of a host array (a deep copy) can be the batch itself: the copy doubled the host memory and added a
    fifth to the time of a save of small values."""

    def __deepcopy__(self, memo: dict[int, Any] | None = None) -> _Batch:
        return self


@functools.cache  # np.dtype.name costs microseconds, times 2,000 values
def _dtype_name(dtype: np.dtype) -> str:
    return dtype.name


class _Layout:
    """Collects values into the orbax tree and the JSON entries."""

    def __init__(self, batched: bool, batch_bytes: int) -> None:
        self.batched = batched
        self.batch_bytes = batch_bytes
        self.small: list[tuple[dict, Any]] = []  # (entry, value) of each value to batch
        self.large: list[tuple[dict, Any]] = []  # (entry, value) of each value stored as its own array
        self.entries: dict[str, dict] = {}
        # Asked once: with one process every value is on every host, and asking an array costs microseconds.
        self.one_process = _distributed.process_count() == 1

    def add_array(self, key: str, value: Any, name: str | None = None, **extra: Any) -> dict:
        dtype = np.dtype(value.dtype)
        dtype_name = _dtype_name(dtype)
        if dtype_name not in _dtypes.BY_NAME:
            raise TypeError(f"Cannot save {key!r}: dtype {dtype} is not supported by the orbax format.")
        entry = {"dtype": dtype_name, "shape": list(value.shape), **extra}
        nbytes = math.prod(value.shape) * dtype.itemsize
        if self.batched and nbytes < BATCH_LIMIT and (self.one_process or on_every_host(value)):
            self.small.append((entry, value))
        else:
            name = f"a{len(self.large)}" if self.batched else (name or key)
            if dtype_name in STORED_AS:  # a type tensorstore lacks: its values, widened losslessly
                entry["stored_as"] = STORED_AS[dtype_name].name
                value = value.astype(STORED_AS[dtype_name])
            if not self.one_process and isinstance(value, jax.Array) and value.is_fully_addressable:
                value = np.asarray(value)  # this host's own array: written by the primary host, as orbax does
            entry["array"] = name
            self.large.append((entry, value))
        return entry

    def finish(self, later: list | None) -> tuple[dict, dict]:
        tree: dict[str, Any] = {}
        sizes = self._batches(tree)
        tree.update((entry["array"], value) for entry, value in self.large)
        # crc32c releases the GIL (_crc.py): a large array's checksum runs beside the others' and beside orbax's write.
        # jaxlib builds an array's list of shards when first asked (without a lock in older sources): a checksum
        # thread asking while `_shard_checksums` asks here most likely found it half built (an IndexError inside
        # jax's copy_to_host_async, once in a suite run). Built here, before any thread starts.
        for _, value in self.large:
            if isinstance(value, jax.Array) and len(value.sharding.device_set) > 1:
                value.addressable_shards  # noqa: B018 (asked for its side effect)
        pool = shared_pool("checkpoint-crc", os.cpu_count() or 1)
        whole = [(entry, pool.submit(_checksum, value)) for entry, value in self.large
                 if self.one_process or on_every_host(value)]
        if later is not None:
            later.extend(whole)
        else:
            for entry, crc in whole:
                entry["crc32c"] = crc.result()
        sharded = [(entry, value, boxes) for entry, value in self.large if (boxes := _boxes(value)) is not None]
        _shard_checksums(sharded)
        return tree, {"packs": sizes}

    def _batches(self, tree: dict[str, Any]) -> list[int]:
        """Copies the small values into batches (`tree`'s "p0", "p1", ...), sets their entries; the batch sizes.

        Each value's place is worked out first, so each batch is one
        allocation that the values are copied into, and their checksums are
        taken over the batch's bytes in one call: with 2,000 values a list of
        parts to concatenate, and an array object per padding, cost more
        than the copies.
        """
        if not self.small:
            return []
        # Transfers to the host start together; each np.asarray below then waits for its own. Not
        # for arrays on CPU devices, already in host memory: the call alone costs microseconds each.
        on_cpu = functools.cache(lambda sharding: all(d.platform == "cpu" for d in sharding.device_set))
        for _, value in self.small:
            if isinstance(value, jax.Array) and not on_cpu(value.sharding):
                value.copy_to_host_async()
        hosts = [np.asarray(value) for _, value in self.small]
        spans: list[list[tuple[int, int]]] = [[]]  # (offset, bytes) of each value, per batch
        sizes: list[int] = []
        offset = 0
        for host in hosts:
            if spans[-1] and offset + host.nbytes > self.batch_bytes:
                sizes.append(offset or ALIGN)
                spans.append([])
                offset = 0
            spans[-1].append((offset, host.nbytes))
            offset += host.nbytes + (-(offset + host.nbytes) % ALIGN)
        sizes.append(offset or ALIGN)  # a batch of empty values only: orbax refuses an empty array
        batches = [_fresh(size) for size in sizes]
        views = [b.data for b in batches]
        places = [(batch, start, nbytes) for batch, its in enumerate(spans) for start, nbytes in its]
        for host, (batch, start, nbytes) in zip(hosts, places, strict=True):
            if nbytes:
                views[batch][start:start + nbytes] = np.ascontiguousarray(host).reshape(-1).view(np.uint8).data
        # Every byte between and after the values is set: a batch is not zeroed first (its pages are written
        # once, not twice), and what it held before must not reach the file.
        for view, its, size in zip(views, spans, sizes, strict=True):
            for (start, nbytes), nxt in zip(its, [start for start, _ in its[1:]] + [size], strict=True):
                view[start + nbytes:nxt] = _ZEROS[:nxt - start - nbytes]
        crcs = [crc for batch, its in zip(batches, spans, strict=True) for crc in crc32c_spans(batch, its)]
        for (entry, _), (batch, start, _), crc in zip(self.small, places, crcs, strict=True):
            entry["crc32c"] = crc
            entry["pack"], entry["offset"] = batch, start
        tree.update((f"p{i}", batch.view(_Batch)) for i, batch in enumerate(batches))
        return sizes


_ZEROS = bytes(ALIGN)  # the most padding after a value (an empty batch's whole)


def _fresh(size: int) -> np.ndarray:
    """An uninitialized batch (`_batches` sets every byte)."""
    return np.empty(size, np.uint8)


def _checksum(value: Any) -> int:
    return crc32c(np.asarray(jax.device_get(value)))


def settle(later: list | None) -> None:
    """Waits for the checksums still running: once a save has failed, the caller may donate the arrays they read."""
    if later:
        concurrent.futures.wait([crc for _, crc in later])


def complete(meta: dict, later: list, directory: str) -> None:
    """Sets the checksums `layout(..., later=)` left to finish in `meta`, seals it, and writes it over the
    metadata file orbax wrote under `directory` (a checkpoint not yet published, whose values it holds)."""
    for entry, crc in later:
        entry["crc32c"] = crc.result()
    with open(os.path.join(directory, META_FILE), "w", encoding="utf-8") as f:
        f.write(json.dumps(seal(meta)))  # as orbax's JsonCheckpointHandler writes it


def on_every_host(value: Any) -> bool:
    """Every process can read all of `value` (so it can be batched and checksummed whole)."""
    return not isinstance(value, jax.Array) or value.is_fully_addressable or value.is_fully_replicated



def _boxes(value: Any) -> list[tuple[tuple[int, int], ...]] | None:
    """The distinct shards of a sharded array ((offset, extent) per dimension), in order.

    None where a whole-array checksum does: a value not split, or held whole
    by every process.
    """
    if not isinstance(value, jax.Array) or value.is_fully_replicated:
        return None
    shape = value.shape
    boxes = {_keys.box_of(index, shape) for index in value.sharding.devices_indices_map(shape).values()}
    return sorted(boxes) if len(boxes) > 1 or not value.is_fully_addressable else None


def _shard_checksums(arrays: list[tuple[dict, Any, list]]) -> None:
    """Sets ``entry["shards"]``: a crc32c per distinct shard (`_boxes`) of each sharded array.

    Each process checksums the shards it holds (replica 0 of each), and the
    small {array: {shard: crc}} maps are exchanged, so the metadata every
    process builds (and the primary writes) is the same, and no array is
    gathered to one host. A restore checks each shard it reads whole.
    """
    if not arrays:
        return
    mine: dict[str, dict[str, int]] = {}
    for entry, value, _ in arrays:
        got = mine.setdefault(entry["array"], {})
        for shard in value.addressable_shards:
            if shard.replica_id == 0:
                got[json.dumps(_keys.box_of(shard.index, value.shape))] = crc32c(np.asarray(shard.data))
    merged: dict[str, dict[str, int]] = {}
    for blob in _distributed.allgather_bytes(json.dumps(mine, sort_keys=True).encode()):
        for name, crcs in json.loads(blob).items():
            merged.setdefault(name, {}).update(crcs)
    for entry, _, boxes in arrays:
        crcs = merged.get(entry["array"], {})
        shards = []
        for box in boxes:
            text = json.dumps(box)
            if text not in crcs:
                raise DataLossError(f"Saving {entry['array']!r}: no process checksummed its shard {box}; "
                                    "a process holds no replica 0 of it (jax reported an inconsistent sharding).")
            shards.append({"box": [list(b) for b in box], "crc32c": crcs[text]})
        entry["shards"] = shards


def layout(values: dict[str, Any], object_graph: TrackableObjectGraph, batched: bool = True,
           batch_bytes: int | None = None, *, later: list | None = None) -> tuple[dict, dict]:
    """{key: array | Python scalar | [(SaveSliceInfo, array), ...]} -> (orbax tree, JSON metadata).

    With a list as `later`, the checksums of arrays stored on their own are
    taken in threads while orbax writes them (a fifth of a 2 GiB save's time,
    were they taken first): the metadata holds them once `complete` has run,
    which needs the arrays alive and unchanged until then (a synchronous save).

    ``batched=False``: every value is its own orbax array named by its
    checkpoint key (slice i of a sliced value: ``<key>@slice_<i>``; a Python
    value too, as a numpy scalar), so that plain orbax restores the values
    item into {checkpoint key: array}.
    """
    lay = _Layout(batched, BATCH_BYTES if batch_bytes is None else batch_bytes)  # read now: tests make it small
    for key, value in values.items():
        if isinstance(value, (bool, int, float, str)) and not isinstance(value, np.generic):  # np.float64: array
            base = _dtypes.python_type(value)  # an IntEnum is an int
            lay.entries[key] = {"python": base.__name__, "value": base(value)}
        elif isinstance(value, list):
            lay.entries[key] = {
                "dtype": np.dtype(value[0][1].dtype).name,
                "shape": list(value[0][0].full_shape),
                "slices": [lay.add_array(key, v, name=f"{key}@slice_{i}", spec=info.spec)
                           for i, (info, v) in enumerate(value)],
            }
        else:
            lay.entries[key] = lay.add_array(key, value)
    tree, extra = lay.finish(later)
    if not batched:  # for plain orbax readers; this reader takes them from the metadata
        tree.update((key, np.asarray(e["value"])) for key, e in lay.entries.items()
                    if "python" in e and e["python"] != "str")
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
    meta["crc32c"] = crc32c(canonical(meta))
    return meta


def canonical(meta: dict) -> bytes:
    """The bytes the metadata's crc32c covers: every field but the checksum, as canonical JSON."""
    body = {k: v for k, v in meta.items() if k != "crc32c"}
    return json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode("ascii")


def staged_bytes(tree: dict) -> int:
    """Bytes of host copies an asynchronous orbax save of `tree` holds while it writes.

    orbax's asynchronous save copies every array this process writes before
    it returns, except the batches, which `layout` made as copies already.
    """
    total = 0
    for value in tree.values():
        if isinstance(value, jax.Array) and not value.is_fully_addressable:
            total += sum(s.data.nbytes for s in value.addressable_shards if s.replica_id == 0)
        else:
            total += int(np.asarray(value).nbytes if not hasattr(value, "nbytes") else value.nbytes)
    return total


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
    values = {"values": ocp.args.PyTreeSave(tree, ocdbt_target_data_file_size=DATA_FILE_BYTES)} if tree else {}
    return ocp.args.Composite(**values, meta=ocp.args.JsonSave(meta))
