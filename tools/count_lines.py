"""Counts the library's code lines: lines of varstate/ and checkpoint/ that hold code.

Left out: blank lines, comments, docstrings (a string that is a module's, class's or function's first
statement) and the generated protobuf modules. The layout issue's budget is stated in this count.

    python tools/count_lines.py            # total
    python tools/count_lines.py --per-file
"""

from __future__ import annotations

import ast
import io
import pathlib
import sys
import tokenize

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = ("varstate", "checkpoint")


def code_lines(source: str) -> int:
    """The number of lines of ``source`` that carry a token other than a comment or a docstring."""
    docstring_lines: set[int] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(
                    first.value.value, str):
                docstring_lines.update(range(first.lineno, (first.end_lineno or first.lineno) + 1))
    lines: set[int] = set()
    skip = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type in skip:
            continue
        lines.update(n for n in range(tok.start[0], tok.end[0] + 1) if n not in docstring_lines)
    return len(lines)


def main(argv: list[str]) -> int:
    counts = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            if path.name.endswith("_pb2.py"):
                continue
            counts[str(path.relative_to(ROOT))] = code_lines(path.read_text())
    if "--per-file" in argv:
        for name, n in sorted(counts.items(), key=lambda kv: -kv[1]):
            print(f"{n:6d}  {name}")
    print(f"{sum(counts.values())} code lines in {len(counts)} modules")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
