"""checkpoint: TF object-graph checkpoints for varstate pytrees."""

from checkpoint._by_name import NameBasedLoadStatus, restore_by_name
from checkpoint._checkpoint import Checkpoint, LoadStatus
from checkpoint._errors import CheckpointFormatError, DataLossError
from checkpoint._manager import CheckpointManager, latest_checkpoint
from checkpoint._reader import read_checkpoint

__all__: list[str] = [
    "Checkpoint",
    "CheckpointFormatError",
    "CheckpointManager",
    "DataLossError",
    "LoadStatus",
    "NameBasedLoadStatus",
    "latest_checkpoint",
    "read_checkpoint",
    "restore_by_name",
]
