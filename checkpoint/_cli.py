"""`python -m checkpoint` / `varstate-ckpt`: inspect, convert and diff checkpoints.

Reads every format `read_checkpoint` reads (orbax, TF object-based, TF
name-based). Output uses rich (tables, trees, a progress bar) when stdout is
a terminal and plain text otherwise. Bad input ends with one line on stderr
and exit status 2; `diff` exits 0 when the checkpoints match and 1 when not.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Iterator
from typing import Any

import numpy as np

from checkpoint import _dtypes, _keys, _storage

_GRAPH_KEY = _keys.OBJECT_GRAPH_KEY
_VALUE_SUFFIX = _keys.value_suffix()
_PROG = "varstate-ckpt"


class _UsageError(Exception):
    """Bad input found by the CLI itself (exit status 2)."""


def _is_terminal() -> bool:
    return sys.stdout.isatty()


def _console():
    from rich.console import Console

    return Console(file=sys.stdout)


# --- values -------------------------------------------------------------------
def _human(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def _is_str(dtype: np.dtype) -> bool:
    return np.dtype(dtype).kind in "OSU"


def _nbytes(reader, key: str) -> int:
    dtype = np.dtype(reader.dtype(key))
    if _is_str(dtype):  # strings: their bytes are only known once read
        return sum(len(x) for x in np.asarray(reader.get(key)).ravel())
    return int(np.prod(reader.shape(key), dtype=np.int64)) * dtype.itemsize


def _describe(reader, key: str) -> tuple[str, str, int]:
    dtype = np.dtype(reader.dtype(key))
    return "string" if _is_str(dtype) else dtype.name, str(tuple(reader.shape(key))), _nbytes(reader, key)


def _key_list(reader) -> list[str]:
    return sorted(k for k in reader.keys() if k != _GRAPH_KEY)


def _graph(reader) -> Any:
    """The object graph, or None for a name-based checkpoint (stored in orbax as an empty graph)."""
    graph = reader.object_graph
    return graph if graph is not None and len(graph.nodes) else None


def _format_name(reader) -> str:
    kind = "orbax" if os.path.isdir(getattr(reader, "path", "")) else "TF"
    return f"{kind} {'object' if _graph(reader) is not None else 'name'}-based checkpoint"


# --- inspect -------------------------------------------------------------------
def _graph_rows(graph, reader) -> tuple[list[tuple[int, str]], set[str]]:
    """(depth, label) lines of the object graph, and the keys it reaches.

    Objects are referred to by their escaped path, the prefix of their keys.
    """
    nodes = graph.nodes
    # A node's path is the first one found breadth-first, as TF names its keys.
    paths = {0: ""}
    queue = [0]
    for node_id in queue:
        for child in nodes[node_id].children:
            if child.node_id not in paths and 0 <= child.node_id < len(nodes):
                paths[child.node_id] = f"{paths[node_id]}/{_keys.escape(child.local_name)}".lstrip("/")
                queue.append(child.node_id)
    rows: list[tuple[int, str]] = []
    seen: set[str] = set()

    def info(node_id: int) -> str:
        parts = []
        for attr in nodes[node_id].attributes:
            key = attr.checkpoint_key
            seen.add(key)
            if key in reader_keys:
                dtype, shape, size = _describe(reader, key)
                extra = "" if attr.name == "VARIABLE_VALUE" else f" [{attr.name}]"
                parts.append(f"{dtype} {shape} {_human(size)}{extra}")
            else:
                parts.append(f"missing value {key!r}")
        return ("  " + "; ".join(parts)) if parts else ""

    def walk(node_id: int, depth: int) -> None:
        node = nodes[node_id]
        for child in node.children:
            path = f"{paths[node_id]}/{_keys.escape(child.local_name)}".lstrip("/")
            if paths.get(child.node_id) != path:
                rows.append((depth, f"{child.local_name} -> same object as {paths.get(child.node_id, '?')}"))
                continue
            rows.append((depth, f"{child.local_name}{info(child.node_id)}"))
            walk(child.node_id, depth + 1)
        for slot in node.slot_variables:
            if 0 <= slot.slot_variable_node_id < len(nodes):
                owner = paths.get(slot.original_variable_node_id, "?")
                rows.append((depth, f"slot {slot.slot_name!r} of {owner}{info(slot.slot_variable_node_id)}"))

    reader_keys = set(reader.keys())
    walk(0, 0)
    return rows, seen


def _inspect(args) -> int:
    reader = _storage.open_reader(args.path)
    if args.key is not None:
        return _inspect_key(reader, args.key)
    keys = _key_list(reader)
    total = 0
    for key in keys:
        total += _nbytes(reader, key)
    title = f"{getattr(reader, 'prefix', None) or getattr(reader, 'path', args.path)}: {_format_name(reader)}"
    footer = f"{len(keys)} values, {_human(total)}" + (f" ({total} bytes)" if total >= 1024 else "")
    tty = _is_terminal()
    if _graph(reader) is not None:
        rows, seen = _graph_rows(_graph(reader), reader)
        rows += [(0, f"{k} (outside the object graph)  " + " ".join(map(str, _describe(reader, k)[:2])))
                 for k in keys if k not in seen]
        if tty:
            from rich.text import Text
            from rich.tree import Tree

            # Text, not markup: names may hold brackets.
            root = Tree(Text(title))
            stack = [root]
            for depth, label in rows:
                del stack[depth + 1:]
                stack.append(stack[depth].add(Text(label)))
            console = _console()
            console.print(root)
            console.print(footer, markup=False)
        else:
            print(title)
            for depth, label in rows:
                print("  " * (depth + 1) + label)
            print(footer)
        return 0
    slices = getattr(reader, "get_slices", lambda key: [])
    table = [(k, *_describe(reader, k), f"{len(slices(k))} slices" if slices(k) else "") for k in keys]
    if tty:
        from rich.table import Table
        from rich.text import Text

        t = Table(title=Text(title), caption=footer)
        for col in ("name", "dtype", "shape", "bytes", "saved as"):
            t.add_column(col, justify="right" if col == "bytes" else "left")
        for name, dtype, shape, size, note in table:
            t.add_row(Text(name), dtype, shape, _human(size), note)
        _console().print(t)
    else:
        print(title)
        width = max((len(r[0]) for r in table), default=4)
        for name, dtype, shape, size, note in table:
            print(f"  {name:<{width}}  {dtype:<8} {shape:<14} {_human(size):>9}  {note}".rstrip())
        print(footer)
    return 0


def _inspect_key(reader, key: str) -> int:
    keys = set(reader.keys())
    if key not in keys and key + _VALUE_SUFFIX in keys:
        key += _VALUE_SUFFIX
    if key not in keys:
        near = sorted(k for k in keys if key.split("/")[-1] in k)[:5]
        hint = f"; similar keys: {near}" if near else "; list them with `inspect PATH`"
        raise _UsageError(f"no key {key!r} in the checkpoint{hint}")
    value = np.asarray(reader.get(key))
    dtype, shape, size = _describe(reader, key)
    lines = [f"key: {key}", f"dtype: {dtype}", f"shape: {shape}", f"bytes: {size}"]
    flat = value.ravel()
    if _dtypes.is_real(value.dtype) and flat.size:
        x = flat if value.dtype.kind in "iu" else flat.astype(np.float64)
        lines += [f"min: {x.min()}", f"max: {x.max()}", f"mean: {x.astype(np.float64).mean()}"]
    elif value.dtype.kind == "c" and flat.size:
        lines += [f"max abs: {np.abs(flat).max()}", f"mean: {flat.mean()}"]
    first = [x if len(x) <= 40 else x[:40] + b"..." for x in flat[:10]] if _is_str(value.dtype) else flat[:10].tolist()
    lines.append(f"first values: {first}{' ...' if flat.size > 10 else ''}")
    print("\n".join(lines))
    return 0


# --- convert -------------------------------------------------------------------
def _read_all(reader, keys: list[str], what: str) -> Iterator[tuple[str, np.ndarray]]:
    """Yields (key, value), with a progress bar over the bytes when stdout is a terminal."""
    if not _is_terminal():
        for key in keys:
            yield key, reader.get(key)
        return
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn

    sizes = {k: _nbytes(reader, k) for k in keys}
    columns = (TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TimeRemainingColumn())
    with Progress(*columns, console=_console(), transient=True) as progress:
        task = progress.add_task(what, total=sum(sizes.values()))
        for key in keys:
            yield key, reader.get(key)
            progress.advance(task, sizes[key])


def _same(a: np.ndarray, b: np.ndarray) -> bool:
    a, b = np.asarray(a), np.asarray(b)
    if a.shape != b.shape:
        return False
    if _is_str(a.dtype) and _is_str(b.dtype):
        return all(bytes(x) == bytes(y) for x, y in zip(a.ravel(), b.ravel(), strict=True))
    if a.dtype != b.dtype:
        return False
    # Bitwise: NaNs and signed zeros must survive a conversion unchanged.
    return a.tobytes() == b.tobytes()


def _write_orbax(path: str, tensors: dict[str, np.ndarray], graph: Any) -> None:
    from checkpoint._storage import _orbax
    from checkpoint.protos.trackable_object_graph_pb2 import TrackableObjectGraph

    values: dict[str, Any] = dict(tensors)
    for key, value in tensors.items():
        if _is_str(value.dtype):
            # A scalar string (a Python str saved as TF's py_state) is kept as a Python str value.
            try:
                values[key] = bytes(value.item()).decode() if value.shape == () else None
            except UnicodeDecodeError:
                values[key] = None
            if values[key] is None:
                raise _UsageError(f"{key!r} is a string tensor, which the orbax format cannot hold; convert --to tf")
    # A name-based checkpoint keeps its names as keys, with an empty object graph.
    tree, meta = _orbax.layout(values, graph if graph is not None else TrackableObjectGraph())
    checkpointer = _orbax.checkpointer()
    try:
        checkpointer.save(os.path.abspath(path), args=_orbax.save_args(tree, meta))
    finally:
        checkpointer.close()


def _convert(args) -> int:
    if os.path.exists(args.dst) or os.path.exists(args.dst + ".index"):
        raise _UsageError(f"destination {args.dst!r} already exists; remove it or choose another path")
    reader = _storage.open_reader(args.src)
    keys = _key_list(reader)
    tensors = dict(_read_all(reader, keys, "reading"))
    graph = _graph(reader)
    if args.to == "tf":
        _storage.write_bundle(args.dst, {**tensors, _GRAPH_KEY: graph.SerializeToString()} if graph else tensors)
    else:
        _write_orbax(args.dst, tensors, graph)
    back = _storage.open_reader(args.dst)
    if set(_key_list(back)) != set(keys):
        raise _UsageError(f"verification failed: {args.dst!r} holds keys {_key_list(back)}, expected {keys}")
    if _graph(back) != graph:
        raise _UsageError(f"verification failed: the object graph of {args.dst!r} differs from the source's")
    for key, value in _read_all(back, keys, "verifying"):
        if not _same(value, tensors[key]):
            raise _UsageError(f"verification failed: {key!r} in {args.dst!r} differs from the source")
    total = sum(_nbytes(back, k) for k in keys)
    print(f"wrote {args.dst} ({args.to}): {len(keys)} values, {_human(total)}; verified by reading it back")
    return 0


# --- diff ----------------------------------------------------------------------
def _max_abs_diff(a: np.ndarray, b: np.ndarray) -> float:
    if _is_str(a.dtype):
        return 0.0 if _same(a, b) else float("inf")
    if a.size == 0:
        return 0.0
    if a.dtype.kind == "b":
        return float(np.any(a != b))
    if a.dtype.kind in "iu":
        # Exact in uint64 (modular subtraction of the larger minus the smaller): float64
        # would call 2**60 and 2**60 + 1 equal.
        wide = np.int64 if a.dtype.kind == "i" else np.uint64
        ua, ub = a.astype(wide).view(np.uint64), b.astype(wide).view(np.uint64)
        d = np.where(a.astype(wide) >= b.astype(wide), ua - ub, ub - ua)
        return float(int(d.max()))
    wide = np.complex128 if a.dtype.kind == "c" else np.float64
    a, b = a.astype(wide), b.astype(wide)
    d = np.abs(a - b)
    nan_a, nan_b = np.isnan(a), np.isnan(b)
    if np.any(nan_a != nan_b):
        return float("nan")
    d = d[~nan_a]  # NaN in both at the same place counts as equal
    return float(d.max()) if d.size else 0.0


def _diff(args) -> int:
    ra, rb = _storage.open_reader(args.a), _storage.open_reader(args.b)
    ka, kb = set(_key_list(ra)), set(_key_list(rb))
    lines: list[str] = []
    rows: list[tuple[str, str, str]] = []
    for key in sorted(ka - kb):
        lines.append(f"only in A: {key}  {' '.join(map(str, _describe(ra, key)[:2]))}")
    for key in sorted(kb - ka):
        lines.append(f"only in B: {key}  {' '.join(map(str, _describe(rb, key)[:2]))}")
    differ = bool(lines)
    ga, gb = _graph(ra), _graph(rb)
    if (ga is None) != (gb is None):
        lines.append(f"object graph: only in {'A' if gb is None else 'B'}")
        differ = True
    elif ga is not None and ga != gb:
        lines.append("object graph: differs")
        differ = True
    for key in sorted(ka & kb):
        (da, sa, _), (db, sb, _) = _describe(ra, key), _describe(rb, key)
        if (da, sa) != (db, sb):
            lines.append(f"differs: {key}: A {da} {sa}, B {db} {sb}")
            differ = True
            continue
        d = _max_abs_diff(np.asarray(ra.get(key)), np.asarray(rb.get(key)))
        if not d <= args.atol:  # NaN and inf count as different
            differ = True
        rows.append((key, f"{d:.6g}", "match" if d <= args.atol else "DIFFERS"))
    verdict = f"{'differ' if differ else 'match'} ({len(ka & kb)} shared keys, atol={args.atol:g})"
    if _is_terminal():
        from rich.table import Table
        from rich.text import Text

        console = _console()
        for line in lines:
            console.print(line, markup=False)
        t = Table(title="shared keys", caption=verdict)
        for col in ("key", "max |A - B|", ""):
            t.add_column(col)
        for row in rows:
            t.add_row(Text(row[0]), *row[1:])
        console.print(t)
    else:
        for line in lines:
            print(line)
        width = max((len(r[0]) for r in rows), default=3)
        for key, d, word in rows:
            print(f"{key:<{width}}  max|A-B|={d:<10} {word}")
        print(verdict)
    return 1 if differ else 0


# --- entry point ----------------------------------------------------------------
def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=_PROG, description="Inspect, convert and compare TF and orbax checkpoints.")
    sub = p.add_subparsers(dest="command", required=True)
    i = sub.add_parser("inspect", help="the object graph (or name list) with shapes, dtypes and sizes")
    i.add_argument("path", help="a checkpoint directory, prefix, or `checkpoint` state file")
    i.add_argument("--key", help="print one value's summary (min/max/mean, first values)")
    i.set_defaults(run=_inspect)
    c = sub.add_parser("convert", help="write a checkpoint in another format and verify it")
    c.add_argument("src")
    c.add_argument("dst", help="a TF prefix for --to tf, a directory for --to orbax")
    c.add_argument("--to", required=True, choices=("orbax", "tf"))
    c.set_defaults(run=_convert)
    d = sub.add_parser("diff", help="keys, shapes, dtypes and values of two checkpoints (exit 0: match, 1: differ)")
    d.add_argument("a")
    d.add_argument("b")
    d.add_argument("--atol", type=float, default=0.0, help="largest absolute difference still a match (default 0)")
    d.set_defaults(run=_diff)
    return p


def main(argv: list[str] | None = None) -> int:
    """Runs the command line; returns the exit status (0 ok / match, 1 differ, 2 error).

    >>> import checkpoint._cli as cli
    >>> cli.main(["inspect", "/nonexistent/ckpt"])  # the error goes to stderr, one line
    2
    """
    try:
        args = _parser().parse_args(argv)
    except SystemExit as e:  # argparse has printed usage and the error
        return int(e.code or 0)
    try:
        return args.run(args)
    except BrokenPipeError:  # stdout closed early (`| head`): stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except KeyboardInterrupt:
        print(f"{_PROG}: interrupted", file=sys.stderr)
        return 130
    except (_UsageError, OSError, ValueError, TypeError, KeyError, NotImplementedError) as e:
        message = e.args[0] if isinstance(e, KeyError) and e.args else e
        text = " ".join(str(message).split())
        print(f"{_PROG}: error: {text}", file=sys.stderr)
        return 2
