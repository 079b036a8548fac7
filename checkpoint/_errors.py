"""The errors a damaged checkpoint raises: one family, so `except DataLossError` catches both storages."""


class DataLossError(OSError):
    """Stored data failed its checksum, is truncated or is inconsistent (TF's DataLossError).

    >>> import checkpoint
    >>> issubclass(checkpoint.DataLossError, OSError)
    True
    """


class CheckpointFormatError(DataLossError, ValueError):
    """A TF checkpoint file is corrupt, truncated, or uses a feature this reader does not support.

    The message names the file and, where known, the key. It is a
    `DataLossError`, and a ValueError as the TF file readers raise for bad
    input.

    >>> import checkpoint
    >>> issubclass(checkpoint.CheckpointFormatError, (checkpoint.DataLossError, ValueError))
    True
    """
