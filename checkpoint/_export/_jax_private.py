"""The module of `checkpoint._export` that reads JAX internals: the two that export needs (a restore's placing
call is `checkpoint/_storage/_jax_private.py`'s).

- `stable_custom_call_targets()`: the custom calls jax.export guarantees
  stable, the only ones a loaded function may make;
- `file_names_without_directories()`: lowering that keeps the exporting
  machine's directories out of the source locations an export records.

Each is looked up when first used, so a JAX release without it fails with a
`JaxInternalsError` naming it instead of loading or writing an export
unchecked. (varstate's internals are `varstate/_jax_compat.py`'s; checkpoint
may not import varstate's private modules, and these are not varstate's
concern.)
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Iterator
from typing import Any

import jax


class JaxInternalsError(RuntimeError):
    """The installed JAX lacks an internal that export relies on."""


def _internal(module: str, name: str, why: str) -> Any:
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        raise JaxInternalsError(
            f"checkpoint's export needs jax internal {module}.{name}, which JAX {jax.__version__} does not have; "
            f"{why} Install a JAX release that has it (varstate requires jax>=0.10), or report this to varstate."
        ) from None


def stable_custom_call_targets() -> frozenset[str]:
    """The custom-call targets jax.export guarantees stable: the only ones a loaded function may call."""
    return frozenset(_internal("jax._src.export._export", "_CUSTOM_CALL_TARGETS_GUARANTEED_STABLE",
                               "it is the list of custom calls a loaded function may make."))


@contextlib.contextmanager
def file_names_without_directories() -> Iterator[None]:
    """Lowering inside this context records source locations as ``file.py:line``, without the directories.

    The setting is thread-local and part of JAX's trace context, so the
    lowering is not taken from a cache filled outside the context.
    """
    regex = _internal("jax._src.config", "hlo_source_file_canonicalization_regex",
                      "it keeps the exporting machine's directories out of the exported functions.")
    with regex(r"^.*[/\\]"):  # JAX removes what matches: everything up to the last separator
        yield
