"""Every ```python block in README.md runs as written, and prints what the README says.

The blocks run in one fresh interpreter (as a newcomer's: no fake devices,
warnings as errors), each in its own namespace, working directory and
default variable registry, so one import of jax serves them all.
"""

import json
import pathlib
import re
import subprocess
import sys

import pytest

# One worker for the whole module under `--dist loadgroup`: its module-scoped fixture then runs once.
pytestmark = pytest.mark.xdist_group("readme")

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"
_BLOCK = re.compile(r"```python\n(.*?)```(?:\n+prints `([^`]*)`)?", re.S)

_RUNNER = r"""
import contextlib, io, json, os, sys, tempfile, traceback
blocks = json.loads(sys.stdin.read())
results = []
for code in blocks:
    import varstate
    varstate.Registry._default = varstate.Registry()  # names as in a fresh process
    out = io.StringIO()
    os.chdir(tempfile.mkdtemp())
    try:
        with contextlib.redirect_stdout(out):
            exec(compile(code, "<README block>", "exec"), {"__name__": "__main__"})
        results.append({"ok": True, "stdout": out.getvalue()})
    except BaseException:
        results.append({"ok": False, "stdout": out.getvalue(), "error": traceback.format_exc()[-3000:]})
print(json.dumps(results))
"""


def _blocks():
    return [(m.group(1), m.group(2)) for m in _BLOCK.finditer(README.read_text())]


@pytest.fixture(scope="module")
def results(tmp_path_factory, newcomer_env):  # the README's examples run as a newcomer runs them
    out = subprocess.run([sys.executable, "-c", _RUNNER], input=json.dumps([c for c, _ in _blocks()]),
                         cwd=tmp_path_factory.mktemp("readme"), env=newcomer_env, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("index", range(len(_blocks())))
def test_readme_example_runs(index, results):
    code, expected = _blocks()[index]
    got = results[index]
    assert got["ok"], f"README block {index} failed:\n{code}\n{got.get('error')}"
    if expected is not None:
        assert got["stdout"].strip() == expected, f"README block {index} printed {got['stdout']!r}"


def test_readme_has_examples():
    assert len(_blocks()) >= 1
