"""What the `varstate-ckpt` commands share: opening a path, describing its values, printing safely.

Names read from a file are printed with their control characters escaped
(`safe`), so a crafted key cannot drive the terminal; rich is used only
when stdout is a terminal (`is_terminal`, which the tests replace).
"""

from __future__ import annotations

import json
import math
import os
import sys
import unicodedata
from typing import Any

import numpy as np

from checkpoint import _keys, _storage

GRAPH_KEY = _keys.OBJECT_GRAPH_KEY
PROG = "varstate-ckpt"


class UsageError(Exception):
    """Bad input found by the CLI itself (exit status 2)."""


def is_terminal() -> bool:
    return sys.stdout.isatty()


def console():
    from rich.console import Console

    return Console(file=sys.stdout)


# Control characters (C0, DEL, C1), format characters (bidi overrides, zero-width), line and paragraph
# separators, and lone surrogates: none is meant for a terminal, and ESC or a bidi override can rewrite it.
_UNPRINTABLE = frozenset(("Cc", "Cf", "Cs", "Zl", "Zp"))


def safe(text: str) -> str:
    """`text` with every character a terminal would act on written as a Python escape (``\\x1b``)."""
    if text.isprintable():  # the common case: nothing to do
        return text
    out = []
    for ch in text:
        if unicodedata.category(ch) in _UNPRINTABLE:
            n = ord(ch)
            out.append(f"\\x{n:02x}" if n < 0x100 else f"\\u{n:04x}" if n < 0x10000 else f"\\U{n:08x}")
        else:
            out.append(ch)
    return "".join(out)


def say(line: str = "") -> None:
    print(safe(line))


def print_json(data: Any) -> None:
    # ensure_ascii: every non-ASCII character, control characters of any kind included, as a \\uXXXX escape.
    print(json.dumps(data, ensure_ascii=True, allow_nan=False))


def number(x: Any) -> Any:
    """A value for JSON: NaN and the infinities as the strings "nan", "inf", "-inf" (JSON has none)."""
    if isinstance(x, float) and not math.isfinite(x):
        return "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")
    return x


# --- values -------------------------------------------------------------------
def human(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def is_str(dtype: np.dtype) -> bool:
    return np.dtype(dtype).kind in "OSU"


def nbytes(reader, key: str) -> int:
    dtype = np.dtype(reader.dtype(key))
    if is_str(dtype):  # strings: their bytes are only known once read
        return sum(len(x) for x in np.asarray(reader.get(key)).ravel())
    return int(np.prod(reader.shape(key), dtype=np.int64)) * dtype.itemsize


def describe_value(reader, key: str) -> tuple[str, str, int]:
    dtype = np.dtype(reader.dtype(key))
    return "string" if is_str(dtype) else dtype.name, str(tuple(reader.shape(key))), nbytes(reader, key)


def key_list(reader) -> list[str]:
    return sorted(k for k in reader.keys() if k != GRAPH_KEY)


def object_graph(reader) -> Any:
    """The object graph, or None for a name-based checkpoint (stored in orbax as an empty graph)."""
    graph = reader.object_graph
    return graph if graph is not None and len(graph.nodes) else None


def format_name(reader) -> str:
    own = getattr(reader, "format_name", None)  # a checkpoint orbax wrote: its object graph is synthesized
    if own is not None:
        return own
    kind = "orbax" if os.path.isdir(getattr(reader, "path", "")) else "TF"
    return f"{kind} {'object' if object_graph(reader) is not None else 'name'}-based checkpoint"


def is_export(path: str) -> bool:
    return os.path.isdir(path) and os.path.lexists(os.path.join(path, "export.pb"))


def is_saved_model(path: str) -> bool:
    from checkpoint._tf import _saved_model  # protos only: no jax

    return os.path.isdir(path) and _saved_model.is_saved_model(path)


def open_reader(path: str):
    """A reader for a checkpoint, or for the variables of an export or a TF SavedModel."""
    if is_saved_model(path):
        from checkpoint._tf._saved_model import VARIABLES_PREFIX

        prefix = os.path.join(path, VARIABLES_PREFIX)
        if not os.path.isfile(prefix + ".index"):
            raise UsageError(f"{path}: the SavedModel has no variables ({VARIABLES_PREFIX}.index is missing)")
        return _storage.open_reader(prefix)
    return _storage.open_reader(os.path.join(path, "variables", "variables") if is_export(path) else path)
