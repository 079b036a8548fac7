"""checkpoint: TF object-graph checkpoints for varstate pytrees."""

from checkpoint._by_name import NameBasedLoadStatus, restore_by_name
from checkpoint._checkpoint import Checkpoint
from checkpoint._errors import CheckpointFormatError, DataLossError
from checkpoint._export import Asset, export, register_revived_type
from checkpoint._load import load
from checkpoint._manager import CheckpointManager, latest_checkpoint
from checkpoint._reader import read_checkpoint
from checkpoint._status import LoadStatus

__all__: list[str] = [
    "Asset",
    "Checkpoint",
    "CheckpointFormatError",
    "CheckpointManager",
    "DataLossError",
    "LoadStatus",
    "NameBasedLoadStatus",
    "export",
    "latest_checkpoint",
    "load",
    "read_checkpoint",
    "register_revived_type",
    "restore_by_name",
]
