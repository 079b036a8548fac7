"""checkpoint: TF object-graph checkpoints for varstate pytrees.

The public names are defined in the private modules named below and imported
on first use, so that ``varstate-ckpt`` on a TF checkpoint imports neither
jax nor orbax.

>>> import checkpoint
>>> checkpoint.Checkpoint.__module__
'checkpoint._checkpoint'
"""

from __future__ import annotations

import importlib as _importlib
from importlib import metadata as _metadata
from typing import TYPE_CHECKING as _TYPE_CHECKING
from typing import Any as _Any

from checkpoint._errors import CheckpointFormatError, DataLossError

if _TYPE_CHECKING:
    from checkpoint._checkpoint import Checkpoint, read_checkpoint, restore_arrays
    from checkpoint._export import Asset, export, load, register_revived_type
    from checkpoint._export._tf_saved_model import export_saved_model
    from checkpoint._manager import CheckpointManager, StepAlreadyExistsError, latest_checkpoint
    from checkpoint._status import LoadStatus
    from checkpoint._storage._distributed import ProcessGroupError
    from checkpoint._tf._name_based import NameBasedLoadStatus, restore_by_name, write_name_based
    from checkpoint._tf._saved_model import read_saved_model

_HOME = {name: module for module, names in {  # the module defining each public name, as imported above
    "_checkpoint": ("Checkpoint", "read_checkpoint", "restore_arrays"),
    "_export": ("Asset", "export", "load", "register_revived_type"),
    "_export._tf_saved_model": ("export_saved_model",),
    "_manager": ("CheckpointManager", "StepAlreadyExistsError", "latest_checkpoint"),
    "_status": ("LoadStatus",),
    "_storage._distributed": ("ProcessGroupError",),
    "_tf._name_based": ("NameBasedLoadStatus", "restore_by_name", "write_name_based"),
    "_tf._saved_model": ("read_saved_model",),
}.items() for name in names}

__all__ = [
    "Asset",
    "Checkpoint",
    "CheckpointFormatError",
    "CheckpointManager",
    "DataLossError",
    "LoadStatus",
    "NameBasedLoadStatus",
    "ProcessGroupError",
    "StepAlreadyExistsError",
    "export",
    "export_saved_model",
    "latest_checkpoint",
    "load",
    "read_checkpoint",
    "read_saved_model",
    "register_revived_type",
    "restore_arrays",
    "restore_by_name",
    "write_name_based",
]

try:  # the version lives in pyproject.toml only; installed, it is the distribution's (`varstate`, both packages)
    __version__ = _metadata.version("varstate")
except _metadata.PackageNotFoundError:
    __version__ = "unknown (varstate is not installed; running from a source tree)"


def __getattr__(name: str) -> _Any:
    if name in ("keras", "safetensors"):  # the public submodules, also imported on first use
        return _importlib.import_module(f"checkpoint.{name}")
    home = _HOME.get(name)
    if home is None:
        raise AttributeError(f"module 'checkpoint' has no attribute {name!r}")
    value = getattr(_importlib.import_module(f"checkpoint.{home}"), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
