"""safetensors (Hugging Face's format) both ways: `save` a pytree, `load` into a template or as a dict.

One file, or the sharded layout of the Hugging Face hub
(``model-00001-of-0000N.safetensors`` and ``model.safetensors.index.json``).
Values are named by object-graph path (``model/dense/kernel``, as
`Checkpoint` keys them) or by a ``name_map``; bfloat16, float8 (``F8_E4M3``,
``F8_E5M2``), integers, bool and complex64 are stored as such. Loading reads
each value with pread into its own aligned buffer, straight onto the
template's (or the given) sharding, reading only the bytes its shards hold.
The ``safetensors`` package reads what `save` writes, and `load` reads what
it writes.

>>> import os, tempfile, numpy as np, checkpoint.safetensors as st
>>> path = st.save(os.path.join(tempfile.mkdtemp(), "m.safetensors"), {"a": np.arange(3, dtype=np.int8)})
>>> st.load(path)
{'a': array([0, 1, 2], dtype=int8)}
"""

from checkpoint.safetensors._tree import load, save

__all__ = ["load", "save"]
