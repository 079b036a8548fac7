"""What the `varstate-ckpt` commands share: describing a checkpoint's values, printing safely.

Names read from a file are printed with their control characters escaped
(`safe`), so a crafted key cannot drive the terminal; rich is used only
when stdout is a terminal (`is_terminal`, which the tests replace).
"""

from __future__ import annotations

import json
import math
import sys
import unicodedata
from collections.abc import Iterator
from typing import Any

import numpy as np

from checkpoint import _keys

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
    return "".join(_escape(ch) if unicodedata.category(ch) in _UNPRINTABLE else ch for ch in text)


def _escape(ch: str) -> str:
    n = ord(ch)
    return f"\\x{n:02x}" if n < 0x100 else f"\\u{n:04x}" if n < 0x10000 else f"\\U{n:08x}"


def say(line: str = "") -> None:
    print(safe(line))


def print_json(data: Any) -> None:
    # ensure_ascii: every non-ASCII character, control characters of any kind included, as a \\uXXXX escape.
    print(json.dumps(data, ensure_ascii=True, allow_nan=False))


def number(x: Any) -> Any:
    """A value for JSON: NaN and the infinities as the strings "nan", "inf", "-inf" (JSON has none)."""
    return str(x) if isinstance(x, float) and not math.isfinite(x) else x  # str(): "nan", "inf", "-inf"


# --- values -------------------------------------------------------------------
def human(n: float) -> str:
    for unit in ("B", "KiB", "MiB"):
        if n < 1024:
            return f"{n} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def is_str(dtype: np.dtype) -> bool:
    return np.dtype(dtype).kind in "OSU"


def dtype_name(dtype: np.dtype) -> str:
    return "string" if is_str(dtype) else np.dtype(dtype).name


def value_bytes(value: Any) -> int:
    """The bytes of a value: a string tensor's are the lengths of its strings."""
    value = np.asarray(value)
    return sum(len(x) for x in value.ravel()) if is_str(value.dtype) else int(value.nbytes)


def nbytes(reader, key: str) -> int:
    dtype = np.dtype(reader.dtype(key))
    if is_str(dtype):  # strings: their bytes are only known once read
        return value_bytes(reader.get(key))
    return int(np.prod(reader.shape(key), dtype=np.int64)) * dtype.itemsize


def same(a: Any, b: Any) -> bool:
    """Whether two values are identical: shape, dtype (any string kind matches another) and every bit."""
    a, b = np.asarray(a), np.asarray(b)
    if a.shape != b.shape:
        return False
    if is_str(a.dtype) and is_str(b.dtype):
        return all(bytes(x) == bytes(y) for x, y in zip(a.ravel(), b.ravel(), strict=True))
    # Bitwise: NaNs and signed zeros must come through a copy unchanged.
    return a.dtype == b.dtype and a.tobytes() == b.tobytes()


def describe_value(reader, key: str) -> tuple[str, str, int]:
    return dtype_name(reader.dtype(key)), str(tuple(reader.shape(key))), nbytes(reader, key)


def key_list(reader) -> list[str]:
    return sorted(k for k in reader.keys() if k != _keys.OBJECT_GRAPH_KEY)


def check_copy(dst: str, back, keys: list[str], graph: Any, graph_source: str,
               pairs: Iterator[tuple[str, Any, Any]]) -> None:
    """Raises UsageError unless `back`, read from `dst`, holds `keys` (sorted) and `graph`, and each pair
    (key, value written, value read back) is the `same`; `graph_source` names where `graph` came from."""
    if key_list(back) != keys:
        raise UsageError(f"verification failed: {dst!r} holds keys {key_list(back)}, expected {keys}")
    if object_graph(back) != graph:
        raise UsageError(f"verification failed: the object graph of {dst!r} differs from {graph_source}")
    for key, a, b in pairs:
        if not same(a, b):
            raise UsageError(f"verification failed: {key!r} in {dst!r} differs from the source")


def write_orbax(path: str, values: dict[str, Any], graph: Any) -> None:
    """Writes `values` (by checkpoint key) and the object graph `graph` at `path`, in this library's orbax format."""
    from checkpoint._storage import _orbax

    tree, meta = _orbax.layout(values, graph)
    checkpointer = _orbax.checkpointer()
    try:
        checkpointer.save(path, args=_orbax.save_args(tree, meta))
    finally:
        checkpointer.close()


def object_graph(reader) -> Any:
    """The object graph, or None for a name-based checkpoint (stored in orbax as an empty graph)."""
    graph = reader.object_graph
    return graph if graph is not None and len(graph.nodes) else None
