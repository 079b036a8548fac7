"""The errors a damaged checkpoint raises: one family, so `except DataLossError` catches both storages."""


class DataLossError(OSError):
    """Stored data failed its checksum, is truncated or is inconsistent (TF's DataLossError).

    >>> import checkpoint
    >>> issubclass(checkpoint.DataLossError, OSError)
    True
    """


class CheckpointFormatError(DataLossError, ValueError):
    """A checkpoint file is corrupt, truncated, not a plain file, or uses a feature this reader does not support.

    Raised for TF files, and for files of either format that are not regular
    files (a FIFO, a device), that link out of the checkpoint's directory, or
    that exceed a reader's size bound. The message names the file and, where
    known, the key. It is a `DataLossError`, and a ValueError as the TF file
    readers raise for bad input.

    >>> import checkpoint
    >>> issubclass(checkpoint.CheckpointFormatError, (checkpoint.DataLossError, ValueError))
    True
    """
