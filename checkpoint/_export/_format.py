"""The export format's constants and the registry of revived types (TF's `revived_types`), shared by save and load.

Layout of an export directory (TF's SavedModel layout, our own top-level file):

    export.pb                   ExportDef: format version, SavedObjectGraph, asset file names, function digests,
                                then its own sha256 (see `seal`)
    variables/variables.*       TensorBundle with TF's object-graph keys (variables, captured constants)
    functions/<name>            one `jax.export` serialization per signature
    assets/<file>               copies of the exported `Asset` files
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import re
from collections.abc import Callable
from typing import Any

from checkpoint.protos.versions_pb2 import VersionDef

# This exporter's format version; a reader accepts min_consumer <= VERSION. Version 2 added export.pb's
# sha256; a version-1 file (which has none) still loads, so exports still say min_consumer 1.
VERSION = 2
# jax.export serializes to a flatbuffer, which cannot exceed 2 GiB; protobuf messages have the same limit.
# Anything larger is not one of ours, and reading it whole could exhaust memory first.
MAX_FILE_BYTES = 2**31 - 1
# export.pb ends with field 15 of ExportDef, length 32: the sha256 of every byte before it. ExportDef does not
# declare field 15, so any protobuf reader (a version-1 loader too) skips it as an unknown field.
_DIGEST_TAG = bytes([15 << 3 | 2, 32])
SIGNATURES = "signatures"
WRAPPERS: dict[type, str] = {
    dict: "trackable_dict_wrapper", list: "trackable_list_wrapper", tuple: "trackable_tuple_wrapper"}
GENERIC = "_generic_user_object"
SIGNATURE_MAP = "signature_map"
FUNCTION_NAME = re.compile(r"[A-Za-z0-9_]+")


def seal(data: bytes) -> bytes:
    """`data` (a serialized ExportDef) followed by its sha256, as export.pb holds it."""
    return data + _DIGEST_TAG + hashlib.sha256(data).digest()


def seal_problem(data: bytes) -> str | None:
    """What is wrong with the sha256 that ends `data` (export.pb's bytes), or None if it matches."""
    if len(data) < 34 or data[-34:-32] != _DIGEST_TAG:
        return "does not end with its sha256"
    if hashlib.sha256(data[:-34]).digest() != data[-32:]:
        return "does not match the sha256 at its end"
    return None


class Asset:
    """A file that goes with an export: copied into ``<export>/assets/``; loaded, `asset_path` points at the copy.

    Args:
        path: the file (it must exist when `export` runs).

    >>> import pathlib, tempfile, checkpoint
    >>> tmp = pathlib.Path(tempfile.mkdtemp())
    >>> _ = (tmp / "vocab.txt").write_text("a b")
    >>> _ = checkpoint.export(tmp / "out", {"vocab": checkpoint.Asset(tmp / "vocab.txt")})
    >>> pathlib.Path(checkpoint.load(tmp / "out").vocab.asset_path).read_text().split()
    ['a', 'b']
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self.asset_path = os.fspath(path)

    def __repr__(self) -> str:
        return f"Asset({self.asset_path!r})"


@dataclasses.dataclass(frozen=True)
class Registration:
    cls: type
    version: int
    min_producer_version: int
    min_consumer_version: int
    bad_consumers: tuple[int, ...]
    from_children: Callable[[dict[str, Any]], Any]

    def accepts(self, v: VersionDef) -> bool:  # TF's rule for a revived type
        return self.version >= v.min_consumer and v.producer >= self.min_producer_version and (
            self.version not in v.bad_consumers)


REVIVED: dict[str, list[Registration]] = {}  # identifier -> registrations, highest version first
IDENTIFIER_OF: dict[type, str] = {}


def register_revived_type(identifier: str, cls: type, *, version: int = 1, min_producer_version: int = 1,
                          min_consumer_version: int = 1, bad_consumers: tuple[int, ...] = (),
                          from_children: Callable[[dict[str, Any]], Any] | None = None) -> None:
    """Registers pytree type `cls` under `identifier` so `load` rebuilds it (TF's revived types).

    `load` uses the highest registration whose version is ``>=`` the file's
    min consumer version, not among its bad consumers, and whose
    `min_producer_version` the file's version reaches; with none it loads a
    generic object (`RevivedObject`) and logs why. Registering a version again
    replaces it.

    Args:
        identifier: the name the export records for `cls` (new, non-empty;
            one per type).
        cls: the pytree type (a registered dataclass, a NamedTuple...).
        version: this registration's version; `export` writes the highest.
        min_producer_version: the oldest export version this code loads.
        min_consumer_version: written by `export`: the oldest version that
            may load what this version exports.
        bad_consumers: written by `export`: versions that must not load it.
        from_children: builds the object from ``{child name: loaded child}``;
            None is ``cls(**children)``, which suits dataclasses and NamedTuples.

    Raises:
        ValueError: an empty or reserved `identifier`, or `cls` already
            registered under another identifier.

    >>> import dataclasses, os, tempfile, jax, jax.numpy as jnp, varstate, checkpoint
    >>> @jax.tree_util.register_dataclass
    ... @dataclasses.dataclass
    ... class Dense:
    ...     kernel: varstate.Variable
    >>> checkpoint.register_revived_type("example.Dense", Dense, version=2, min_consumer_version=1)
    >>> root = {"dense": Dense(varstate.Variable(jnp.ones(2)))}
    >>> path = checkpoint.export(os.path.join(tempfile.mkdtemp(), "m"), root)
    >>> type(checkpoint.load(path).dense).__name__
    'Dense'
    """
    if not isinstance(identifier, str) or not identifier or identifier in (*WRAPPERS.values(), GENERIC,
                                                                           SIGNATURE_MAP):
        raise ValueError(f"register_revived_type: identifier must be a new non-empty string, got {identifier!r}.")
    if IDENTIFIER_OF.get(cls, identifier) != identifier:
        raise ValueError(f"register_revived_type: {cls.__qualname__} is already registered as "
                         f"{IDENTIFIER_OF[cls]!r}; one type has one identifier.")
    reg = Registration(cls, version, min_producer_version, min_consumer_version, tuple(bad_consumers),
                        from_children or (lambda children: cls(**children)))
    regs = [r for r in REVIVED.get(identifier, []) if r.version != version] + [reg]
    REVIVED[identifier] = sorted(regs, key=lambda r: -r.version)
    IDENTIFIER_OF[cls] = identifier
