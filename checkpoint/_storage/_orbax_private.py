"""The one module of `checkpoint` that imports orbax internals (``orbax.checkpoint._src``).

- `jax_distributed_client()`: jax's coordination-service client, which jax
  keeps private and orbax (whose multi-host writer this package uses anyway)
  hands out; the barriers of a multi-process save wait on it.
"""

from __future__ import annotations

from typing import Any


def jax_distributed_client() -> Any:
    from orbax.checkpoint._src.multihost import multihost  # imported when first needed: a TF read imports no orbax

    return multihost.get_jax_distributed_client()
