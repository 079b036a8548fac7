"""Export and load: a pytree with its jitted functions as a directory that runs without the code that made it.

`_format` holds the layout's constants and the revived-type registry;
`_save` writes an export (SavedObjectGraph, TensorBundle, `jax.export`
functions, assets); `_coder` encodes signature structures; `_load` reads it
back, checking every file before anything runs.
"""

from checkpoint._export._format import Asset, register_revived_type
from checkpoint._export._load import RevivedObject, Signature, load
from checkpoint._export._save import export

__all__ = ["Asset", "RevivedObject", "Signature", "export", "load", "register_revived_type"]
