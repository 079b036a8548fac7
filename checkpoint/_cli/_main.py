"""`python -m checkpoint` / `varstate-ckpt`: inspect, convert, diff, verify and strip checkpoints and exports.

Reads every format `read_checkpoint` reads (orbax, TF object-based, TF
name-based, checkpoints orbax itself wrote) and, for `inspect`, the
directories `checkpoint.export` writes and TF SavedModels (whose variables
`convert` and `diff` read too).
Output uses rich (tables, trees, a progress bar) when stdout is a terminal,
plain text otherwise, and JSON with ``--json``. Names read from a file are
printed with their control characters escaped, so a crafted key cannot
drive the terminal. Bad input ends with one line on stderr and exit status
2; `diff` exits 0 when the checkpoints match and 1 when not, `verify` 0
when intact and 1 on damage (`_verify`), `strip-optimizer` 1 when there is
no optimizer state (`_strip`). Only orbax checkpoints, exports and
`strip-optimizer` import jax.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Iterator
from typing import Any

import numpy as np

import checkpoint
from checkpoint import _keys, _storage
from checkpoint._cli import _out as out
from checkpoint._cli import _safetensors as safetensors
from checkpoint._cli._inspect import inspect
from checkpoint._cli._strip import strip_optimizer
from checkpoint._cli._verify import verify
from checkpoint._storage._safetensors import is_safetensors


# --- convert -------------------------------------------------------------------
def _read_all(reader, keys: list[str], what: str) -> Iterator[tuple[str, np.ndarray]]:
    """Yields (key, value), with a progress bar over the bytes when stdout is a terminal."""
    if not out.is_terminal():
        yield from ((key, reader.get(key)) for key in keys)
        return
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn

    sizes = {k: out.nbytes(reader, k) for k in keys}
    columns = (TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TimeRemainingColumn())
    with Progress(*columns, console=out.console(), transient=True) as progress:
        task = progress.add_task(what, total=sum(sizes.values()))
        for key in keys:
            yield key, reader.get(key)
            progress.advance(task, sizes[key])


def _write_orbax(path: str, tensors: dict[str, np.ndarray], graph: Any) -> None:
    from checkpoint.protos.trackable_object_graph_pb2 import TrackableObjectGraph

    values: dict[str, Any] = dict(tensors)
    for key, value in tensors.items():
        if out.is_str(value.dtype):
            # A scalar string (a Python str saved as TF's py_state) is kept as a Python str value.
            try:
                values[key] = bytes(value.item()).decode() if value.shape == () else None
            except UnicodeDecodeError:
                values[key] = None
            if values[key] is None:
                raise out.UsageError(f"{key!r} is a string tensor, which the orbax format cannot hold; convert --to tf")
    # A name-based checkpoint keeps its names as keys, with an empty object graph.
    out.write_orbax(os.path.abspath(path), values, graph if graph is not None else TrackableObjectGraph())


def _open(path: str) -> Any:
    """A reader for any checkpoint `_storage.open_reader` opens, or a safetensors file or index."""
    return safetensors.CheckpointView(path) if is_safetensors(path) else _storage.open_reader(path)


def _convert(args) -> int:
    if args.to == "safetensors":
        safetensors.check_destination(args.dst)
    elif os.path.exists(args.dst) or os.path.exists(args.dst + ".index"):
        raise out.UsageError(f"destination {args.dst!r} already exists; remove it or choose another path")
    if args.max_shard_size is not None and args.to != "safetensors":
        raise out.UsageError("--max-shard-size is for --to safetensors only")
    reader = _open(args.src)
    keys = out.key_list(reader)
    tensors = dict(_read_all(reader, keys, "reading"))
    graph = out.object_graph(reader)
    if args.to == "safetensors":
        return _verify_safetensors(*safetensors.write(args.dst, tensors, graph, args.max_shard_size), tensors)
    if args.to == "tf":
        _storage.write_bundle(args.dst, {**tensors, _keys.OBJECT_GRAPH_KEY: graph.SerializeToString()}
                              if graph else tensors)
    else:
        _write_orbax(args.dst, tensors, graph)
    back = _storage.open_reader(args.dst)
    out.check_copy(args.dst, back, keys, graph, "the source's",
                   ((key, tensors[key], value) for key, value in _read_all(back, keys, "verifying")))
    total = sum(out.nbytes(back, k) for k in keys)
    out.say(f"wrote {args.dst} ({args.to}): {len(keys)} values, {out.human(total)}; verified by reading it back")
    return 0


def _verify_safetensors(dst: str, names: dict[str, str], tensors: dict[str, np.ndarray]) -> int:
    back = safetensors.st.SafetensorsReader(dst)
    if set(back.keys()) != set(names):
        raise out.UsageError(f"verification failed: {dst!r} holds tensors {sorted(back.keys())}, expected "
                             f"{sorted(names)}")
    for name, value in _read_all(back, list(names), "verifying"):
        if not out.same(value, tensors[names[name]]):
            raise out.UsageError(f"verification failed: {name!r} in {dst!r} differs from the source's "
                                 f"{names[name]!r}")
    total = sum(out.nbytes(back, n) for n in names)
    out.say(f"wrote {dst} (safetensors): {len(names)} values, {out.human(total)}; verified by reading it back")
    return 0


# --- diff ----------------------------------------------------------------------
def _max_abs_diff(a: np.ndarray, b: np.ndarray) -> float:
    if out.is_str(a.dtype):
        return 0.0 if out.same(a, b) else float("inf")
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
    inexact = np.complex128 if a.dtype.kind == "c" else np.float64
    a, b = a.astype(inexact), b.astype(inexact)
    nan_a, nan_b = np.isnan(a), np.isnan(b)
    if np.any(nan_a != nan_b):
        return float("nan")
    apart = (a != b) & ~nan_a  # equal infinities are equal (their difference would be NaN); so is NaN and NaN
    return float(np.abs(a[apart] - b[apart]).max()) if apart.any() else 0.0


def _diff(args) -> int:
    ra, rb = _open(args.a), _open(args.b)
    ka, kb = set(out.key_list(ra)), set(out.key_list(rb))
    report: dict[str, Any] = {"a": args.a, "b": args.b, "atol": args.atol}
    spec = lambda r, k: {"key": k, "dtype": out.dtype_name(r.dtype(k)), "shape": list(r.shape(k))}
    report["only_in_a"] = [spec(ra, k) for k in sorted(ka - kb)]
    report["only_in_b"] = [spec(rb, k) for k in sorted(kb - ka)]
    ga, gb = out.object_graph(ra), out.object_graph(rb)
    report["object_graph"] = ("only in A" if gb is None else "only in B") if (ga is None) != (gb is None) else (
        "differs" if ga != gb else "same" if ga is not None else "none")
    report["dtype_or_shape_differs"], report["values"] = [], []
    for key in sorted(ka & kb):
        a, b = spec(ra, key), spec(rb, key)
        if a != b:  # dtype or shape
            report["dtype_or_shape_differs"].append({"key": key, "a": a, "b": b})
            continue
        va, vb = np.asarray(ra.get(key)), np.asarray(rb.get(key))
        d = _max_abs_diff(va, vb)
        # At atol 0, bit for bit: -0.0 and 0.0, or two NaN payloads, are equal numbers but not the same bits.
        match = d <= args.atol if args.atol else d == 0 and (out.is_str(va.dtype) or va.tobytes() == vb.tobytes())
        report["values"].append({"key": key, "max_abs_diff": d, "match": bool(match)})  # NaN: never a match
    differ = bool(report["only_in_a"] or report["only_in_b"] or report["dtype_or_shape_differs"]
                  or report["object_graph"] in ("only in A", "only in B", "differs")
                  or not all(v["match"] for v in report["values"]))
    report["shared_keys"], report["match"] = len(ka & kb), not differ
    if args.only_diff:
        report["values"] = [v for v in report["values"] if not v["match"]]
    if args.json:
        for v in report["values"]:
            v["max_abs_diff"] = out.number(v["max_abs_diff"])
        out.print_json(report)
        return 1 if differ else 0
    lines = [f"only in A: {x['key']}  {x['dtype']} {tuple(x['shape'])}" for x in report["only_in_a"]]
    lines += [f"only in B: {x['key']}  {x['dtype']} {tuple(x['shape'])}" for x in report["only_in_b"]]
    if report["object_graph"] in ("only in A", "only in B", "differs"):
        lines.append(f"object graph: {report['object_graph']}")
    lines += [f"differs: {x['key']}: A {x['a']['dtype']} {tuple(x['a']['shape'])}, B {x['b']['dtype']} "
              f"{tuple(x['b']['shape'])}" for x in report["dtype_or_shape_differs"]]
    rows = [(v["key"], f"{v['max_abs_diff']:.6g}", "match" if v["match"] else "DIFFERS") for v in report["values"]]
    verdict = f"{'differ' if differ else 'match'} ({len(ka & kb)} shared keys, atol={args.atol:g})"
    if out.is_terminal():
        from rich.table import Table
        from rich.text import Text

        console = out.console()
        for line in lines:
            console.print(out.safe(line), markup=False)
        t = Table(title="shared keys" + (" that differ" if args.only_diff else ""), caption=verdict)
        for col in ("key", "max |A - B|", ""):
            t.add_column(col)
        for row in rows:
            t.add_row(Text(out.safe(row[0])), *row[1:])
        console.print(t)
    else:
        for line in lines:
            out.say(line)
        width = max((len(out.safe(r[0])) for r in rows), default=3)
        for key, diff, word in rows:
            out.say(f"{out.safe(key):<{width}}  max|A-B|={diff:<10} {word}")
        out.say(verdict)
    return 1 if differ else 0


# --- entry point ----------------------------------------------------------------
def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=out.PROG, description="Inspect, convert, compare, verify and strip TF and "
                                                        "orbax checkpoints, and inspect exports.")
    p.add_argument("--version", action="version", version=f"{out.PROG} {checkpoint.__version__}")
    sub = p.add_subparsers(dest="command", required=True)
    i = sub.add_parser("inspect", help="the object graph (or name list) with shapes, dtypes and sizes; for an "
                                       "export, also each signature's inputs, outputs and platforms")
    i.add_argument("path", help="a checkpoint directory, prefix, or `checkpoint` state file, an export directory, "
                                "or a TF SavedModel directory")
    i.add_argument("--key", help="print one value's summary (min/max/mean, first values)")
    i.set_defaults(run=lambda args: (safetensors.inspect if is_safetensors(args.path) else inspect)(args))
    c = sub.add_parser("convert", help="write a checkpoint in another format and verify it")
    c.add_argument("src", help="a checkpoint, an export or TF SavedModel directory (its variables), or a "
                               "safetensors file or index")
    c.add_argument("dst", help="a TF prefix for --to tf, a directory for --to orbax, a .safetensors file for "
                               "--to safetensors")
    c.add_argument("--to", required=True, choices=("orbax", "tf", "safetensors"))
    c.add_argument("--max-shard-size", help="with --to safetensors: shards of at most this size (e.g. 5GB) and "
                                            "a .safetensors.index.json")
    c.set_defaults(run=_convert)
    d = sub.add_parser("diff", help="keys, shapes, dtypes and values of two checkpoints (exit 0: match, 1: differ)")
    d.add_argument("a", help="a checkpoint, or an export or TF SavedModel directory (its variables)")
    d.add_argument("b")
    d.add_argument("--atol", type=float, default=0.0, help="largest absolute difference still a match (default 0)")
    d.add_argument("--only-diff", action="store_true", help="list only the shared keys whose values differ")
    d.set_defaults(run=_diff)
    v = sub.add_parser("verify", help="every checksum of the metadata and of every value, each value read once "
                                      "(exit 0: intact, 1: damaged); formats without checksums: structure and reads")
    v.add_argument("path", help="a checkpoint, an export or TF SavedModel directory, a Keras .weights.h5/.h5/.keras "
                                "file, or a .safetensors file or index")
    v.set_defaults(run=verify)
    s = sub.add_parser("strip-optimizer", help="a copy without the optimizer state (slot variables, the optimizer "
                                               "objects and their other values), in the same format, verified")
    s.add_argument("src", help="a TF object-based or orbax-format checkpoint of this library")
    s.add_argument("dst", help="the new checkpoint: a TF prefix or an orbax directory, as SRC is; must not exist")
    s.set_defaults(run=strip_optimizer)
    for command in (i, d, v):
        command.add_argument("--json", action="store_true", help="print JSON instead of text")
    return p


def main(argv: list[str] | None = None) -> int:
    """Runs the command line; returns the exit status (0 ok / match, 1 differ, 2 error).

    >>> import checkpoint._cli._main as cli
    >>> cli.main(["inspect", "/nonexistent/ckpt"])  # the error goes to stderr, one line
    2
    """
    try:
        args = _parser().parse_args(argv)
    except SystemExit as e:  # argparse has printed usage and the error, or --help / --version
        return int(e.code or 0)
    try:
        return args.run(args)
    except BrokenPipeError:  # stdout closed early (`| head`): stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except KeyboardInterrupt:
        print(f"{out.PROG}: interrupted", file=sys.stderr)
        return 130
    except RecursionError:  # a library walking a file's nesting recursively (the CLI's own walks do not)
        where = next(getattr(args, name) for name in ("path", "src", "a") if hasattr(args, name))
        print(f"{out.PROG}: error: {out.safe(where)}: its object graph nests too deeply for this command",
              file=sys.stderr)
        return 2
    except (out.UsageError, OSError, ValueError, TypeError, KeyError, NotImplementedError, RuntimeError) as e:
        message = e.args[0] if isinstance(e, KeyError) and e.args else e
        text = " ".join(str(message).split())
        print(f"{out.PROG}: error: {out.safe(text)}", file=sys.stderr)
        return 2
