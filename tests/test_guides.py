"""Every ```python block of README.md and of the pages under docs/ runs as written and prints what the page says.

A page marks each of its blocks by its fence:

- ```` ```python ````: run by this test. What it prints is compared with the `` prints `...` `` line right after
  it, or with a ```` ```text ```` block right after it.
- ```` ```{code-block} LANG ```` with ``:caption: not run by the tests: WHY``: code the suite cannot run (two hosts,
  TensorFlow's side, a GPU); the reason shows on the page as the block's caption. At most 10% of a page's code
  blocks may be of this kind.
- ```` ```text ````: not code: what a command prints, a listing. It must not look like code (a `$ ` prompt, `>>>`,
  an import): that is a block to run or to mark.

Directives other than code-block (toctree, include) are not blocks. README.md's blocks run, but its shell commands
(`make demo`, `pip install`) are not held to the marking rule: the README is the front page, not a guide.

The blocks run in one fresh interpreter (as a newcomer's: one CPU device, warnings as errors), each in its own
namespace, working directory (with links to the checkout's `examples/` and `tests/`, as in a clone's root) and
default variable registry, so one import of jax serves them all. A failing block's traceback names its page and line.
"""

import dataclasses
import json
import pathlib
import re
import subprocess
import sys

import pytest

# One worker for the whole module under `--dist loadgroup`: its module-scoped fixture then runs once.
pytestmark = pytest.mark.xdist_group("guides")

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
README = ROOT / "README.md"
NOT_RUN = re.compile(r"not run by the tests: \S.*")
MAX_NOT_RUN = 0.10
_FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})\s*(.*?)\s*$")
_PRINTS = re.compile(r"\A\n*prints `([^`]*)`")
_LOOKS_LIKE_CODE = re.compile(r"^(\$ |>>>|import |from \S+ import )")


@dataclasses.dataclass
class Block:
    page: str  # relative to the checkout
    line: int  # of the opening fence, 1-based
    kind: str  # "python", "code-block", "text", "directive", or the unknown info string
    code: str
    caption: str = ""
    expected: str | None = None
    end: int = 0  # the index of the line after its closing fence

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"


def _pages() -> list[pathlib.Path]:
    docs = sorted(p for p in DOCS.rglob("*.md") if not any(s.startswith("_") for s in p.relative_to(DOCS).parts))
    return [README, *docs]


def _parse(path: pathlib.Path) -> list[Block]:
    """The fenced blocks of one page, each with the output the page says it prints."""
    page = str(path.relative_to(ROOT))
    lines = path.read_text().split("\n")
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        fence, info = m.groups()
        end = next((j for j in range(i + 1, len(lines))
                    if re.fullmatch(rf" {{0,3}}{fence[0]}{{{len(fence)},}}\s*", lines[j])), len(lines))
        body = lines[i + 1:end]
        directive = re.match(r"\{([\w-]+)\}\s*(.*)", info)
        if directive and directive.group(1) in ("code-block", "code", "sourcecode"):
            options = {}
            while body and (opt := re.match(r":([\w-]+):\s*(.*)", body[0])):
                options[opt.group(1)] = opt.group(2)
                body = body[1:]
            block = Block(page, i + 1, "code-block", "\n".join(body), caption=options.get("caption", ""))
        else:
            kind = "directive" if directive else info.split()[0] if info else "(no language)"
            block = Block(page, i + 1, kind, "\n".join(body))
        previous = blocks[-1] if blocks else None
        if (block.kind == "text" and previous is not None and previous.kind in ("python", "code-block")
                and previous.expected is None and all(not s.strip() for s in lines[previous.end:i])):
            previous.expected = block.code  # the output of the block just above
            block.kind = "output"
        block.end = end + 1
        if block.kind == "python" and (p := _PRINTS.match("\n".join(lines[end + 1:end + 40]))):
            block.expected = p.group(1)
        blocks.append(block)
        i = end + 1
    return blocks


def _all_blocks() -> list[Block]:
    return [b for path in _pages() for b in _parse(path)]


def _runnable() -> list[Block]:
    return [b for b in _all_blocks() if b.kind == "python"]


_RUNNER = r"""
import contextlib, io, json, os, sys, tempfile, traceback
root, blocks = json.loads(sys.stdin.read())
results = []
for block in blocks:
    import varstate
    varstate.Registry._default = varstate.Registry()  # names as in a fresh process
    out = io.StringIO()
    os.chdir(tempfile.mkdtemp())
    for name in ("examples", "tests"):  # a page runs from a clone's root
        os.symlink(os.path.join(root, name), name)
    try:
        # Blank lines in front, so that a traceback's line numbers are the page's.
        code = compile("\n" * block["line"] + block["code"], block["page"], "exec")
        with contextlib.redirect_stdout(out):
            exec(code, {"__name__": "__main__"})
        results.append({"ok": True, "stdout": out.getvalue()})
    except BaseException:
        results.append({"ok": False, "stdout": out.getvalue(), "error": traceback.format_exc()[-3000:]})
print(json.dumps(results))
"""


@pytest.fixture(scope="module")
def results(tmp_path_factory, newcomer_env):  # the pages' examples run as a newcomer runs them
    blocks = [{"page": b.page, "line": b.line, "code": b.code} for b in _runnable()]
    out = subprocess.run([sys.executable, "-c", _RUNNER], input=json.dumps([str(ROOT), blocks]),
                         cwd=tmp_path_factory.mktemp("guides"), env=newcomer_env, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return {b.id: r for b, r in zip(_runnable(), json.loads(out.stdout.strip().splitlines()[-1]), strict=True)}


@pytest.mark.parametrize("block", _runnable(), ids=lambda b: b.id)
def test_example_runs_and_prints_what_the_page_says(block, results):
    got = results[block.id]
    assert got["ok"], f"the block at {block.id} failed:\n{got.get('error')}"
    if block.expected is not None:
        assert got["stdout"].strip() == block.expected.strip(), (
            f"the block at {block.id} printed\n{got['stdout']}\nbut the page says\n{block.expected}")


@pytest.mark.parametrize("page", [p for p in _pages() if p != README], ids=lambda p: str(p.relative_to(ROOT)))
def test_page_runs_or_marks_each_block(page):
    blocks = _parse(page)
    wrong = sorted(
        [(b.line, f"a ```{b.kind} block; use ```python (run by the tests), ```text (output, not code), or "
                  "```{code-block} with `:caption: not run by the tests: <why>`")
         for b in blocks if b.kind not in ("python", "code-block", "text", "output", "directive")]
        + [(b.line, f"a {{code-block}} without `:caption: not run by the tests: <why>` (found {b.caption!r})")
           for b in blocks if b.kind == "code-block" and not NOT_RUN.fullmatch(b.caption)]
        + [(b.line, f"a ```text block that looks like code ({b.code.strip().splitlines()[0]!r}): run it as "
                    "```python or mark it as a {code-block}")
           for b in blocks if b.kind == "text" and _LOOKS_LIKE_CODE.match(b.code.strip())])
    if wrong:
        pytest.fail(f"{page.relative_to(ROOT)}:\n" + "\n".join(f"line {line}: {why}" for line, why in wrong),
                    pytrace=False)
    code = [b for b in blocks if b.kind in ("python", "code-block")]
    not_run = [b for b in code if b.kind == "code-block"]
    if len(not_run) > MAX_NOT_RUN * len(code):
        pytest.fail(f"{page.relative_to(ROOT)}: {len(not_run)} of its {len(code)} code blocks are not run by the "
                    f"tests (lines {[b.line for b in not_run]}); at most {MAX_NOT_RUN:.0%} may be: run them from "
                    "Python (a command through subprocess) or move them into prose", pytrace=False)


def test_the_pages_have_examples():
    pages = {b.page for b in _runnable()}
    assert "README.md" in pages and "docs/guides/quickstart.md" in pages
