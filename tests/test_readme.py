"""Every ```python block in README.md runs as written, and prints what the README says."""

import os
import pathlib
import re
import subprocess
import sys

import pytest

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"
_BLOCK = re.compile(r"```python\n(.*?)```(?:\n+prints `([^`]*)`)?", re.S)


def _blocks():
    return [(i, m.group(1), m.group(2)) for i, m in enumerate(_BLOCK.finditer(README.read_text()))]


@pytest.mark.parametrize("index, code, expected", _blocks(), ids=lambda x: str(x) if isinstance(x, int) else "")
def test_readme_example_runs(index, code, expected, tmp_path):
    env = {**os.environ, "PYTHONWARNINGS": "error", "JAX_PLATFORMS": "cpu"}
    env.pop("XLA_FLAGS", None)  # the README's examples run as a newcomer runs them
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, f"README block {index} failed:\n{code}\n{out.stderr[-3000:]}"
    if expected is not None:
        assert out.stdout.strip() == expected, f"README block {index} printed {out.stdout!r}"


def test_readme_has_examples():
    assert len(_blocks()) >= 1
