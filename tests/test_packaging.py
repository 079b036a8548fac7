"""Packaging: the declared dependencies cover every import, LICENSE is the license pyproject names, the wheel is whole.

References: the installed distributions' own metadata (which distribution
provides which top-level module), the SHA-256 of the Apache License 2.0 text
as the ASF publishes it, and the wheel setuptools builds from this tree.
"""

import ast
import hashlib
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from importlib import metadata

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
PACKAGES = ("varstate", "checkpoint")
# sha256 of https://www.apache.org/licenses/LICENSE-2.0.txt (also Debian's /usr/share/common-licenses/Apache-2.0).
APACHE_2_SHA256 = "cfc7749b96f63bd31c3c42b5c471bf756814053e847c10f3eb003417bc523d30"


def _distribution_name(requirement):
    return re.split(r"[\s\[<>=!~;]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def _top_level_imports():
    """{top-level module: [(file:line, optional), ...]} for every absolute import in the packages.

    Function-local imports count too; an import is optional when a ``try`` around it catches ImportError (the code
    then tells the user what to install).
    """
    found = {}
    for package in PACKAGES:
        for file in sorted((ROOT / package).rglob("*.py")):
            tree = ast.parse(file.read_text(), str(file))
            optional = {id(n) for t in ast.walk(tree) if isinstance(t, ast.Try) and any(
                _catches_import_error(h.type) for h in t.handlers) for stmt in t.body for n in ast.walk(stmt)}
            for node in ast.walk(tree):
                names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                         [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module else [])
                for name in names:
                    found.setdefault(name.split(".")[0], []).append(
                        (f"{file.relative_to(ROOT)}:{node.lineno}", id(node) in optional))
    return found


def _catches_import_error(handler_type):
    names = [] if handler_type is None else handler_type.elts if isinstance(handler_type, ast.Tuple) else [handler_type]
    return any(isinstance(n, ast.Name) and n.id in ("ImportError", "ModuleNotFoundError") for n in names)


def test_every_imported_distribution_is_declared():
    declared = {_distribution_name(r) for r in PYPROJECT["project"]["dependencies"]}
    extras = {_distribution_name(r) for reqs in PYPROJECT["project"]["optional-dependencies"].values() for r in reqs}
    providers = metadata.packages_distributions()  # module -> the distributions installed that provide it
    undeclared = {}
    for module, where in _top_level_imports().items():
        if module in sys.stdlib_module_names or module in PACKAGES:
            continue
        dists = {d.lower().replace("_", "-") for d in providers.get(module, [])}
        assert dists, f"{module} (imported at {where[0][0]}) is provided by no installed distribution"
        required = [w for w, optional in where if not optional]
        if not dists & (declared if required else declared | extras):
            undeclared[module] = (sorted(dists), (required or [w for w, _ in where])[0],
                                  "a dependency" if required else "a dependency or an extra")
    assert not undeclared, f"imported but not declared in pyproject: {undeclared}"


def test_the_dependency_check_sees_imports_that_arrive_only_through_another_package():
    # rich and etils are installed as dependencies of flax and orbax; the check must still ask for them.
    imports = _top_level_imports()
    assert {"rich", "etils", "crc32c", "ml_dtypes", "numpy", "google", "orbax", "jax"} <= set(imports)
    assert "flax" in imports  # varstate/nnx.py imports it inside a function
    assert not any(optional for _, optional in imports["rich"])
    providers = metadata.packages_distributions()
    assert providers["rich"] == ["rich"] and "protobuf" in providers["google"]


def test_license_is_the_apache_2_text_pyproject_names():
    assert PYPROJECT["project"]["license"] == "Apache-2.0" and PYPROJECT["project"]["license-files"] == ["LICENSE"]
    text = (ROOT / "LICENSE").read_bytes()
    assert hashlib.sha256(text).hexdigest() == APACHE_2_SHA256
    assert text.splitlines()[1].strip() == b"Apache License" and b"END OF TERMS AND CONDITIONS" in text


def _build_wheel(tmp_path):
    """The wheel of a copy of the tree (a build in place would leave build/ and egg-info behind), built offline."""
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, src / name)
    for package in PACKAGES:
        shutil.copytree(ROOT / package, src / package, ignore=shutil.ignore_patterns("__pycache__"))
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
                           "-q", "-w", str(tmp_path / "dist"), str(src)], capture_output=True, text=True, timeout=300,
                          check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    (wheel,) = (tmp_path / "dist").glob("varstate-*.whl")
    return wheel


@pytest.mark.skipif(tuple(map(int, metadata.version("setuptools").split(".")[:2])) < (77, 0),
                    reason="needs setuptools>=77 in this environment (the test extra installs it)")
def test_the_wheel_holds_the_package_data_license_entry_point_and_dependencies(tmp_path):
    wheel = _build_wheel(tmp_path)
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        dist_info = next(n.split("/")[0] for n in names if n.split("/")[0].endswith(".dist-info"))
        meta = z.read(f"{dist_info}/METADATA").decode()
        entry_points = z.read(f"{dist_info}/entry_points.txt").decode()
        license_text = z.read(f"{dist_info}/licenses/LICENSE")
    # Every file of the packages in the tree is in the wheel: modules, py.typed, protos, stubs.
    want = {str(p.relative_to(ROOT)).replace(os.sep, "/") for package in PACKAGES
            for p in (ROOT / package).rglob("*") if p.is_file() and "__pycache__" not in p.parts
            and p.suffix in (".py", ".pyi", ".proto", ".typed")}
    assert {"varstate/py.typed", "checkpoint/py.typed", "checkpoint/protos/saved_object_graph.proto"} <= want
    assert want - names == set()
    assert not {n for n in names if n.split("/")[0] in ("tests", "examples", "benchmarks")}
    assert hashlib.sha256(license_text).hexdigest() == APACHE_2_SHA256
    assert "License-Expression: Apache-2.0" in meta.splitlines()
    requires = {_distribution_name(ln.split(":", 1)[1].strip()) for ln in meta.splitlines()
                if ln.startswith("Requires-Dist:") and "extra ==" not in ln}
    assert requires == {_distribution_name(r) for r in PYPROJECT["project"]["dependencies"]}
    assert re.search(r"^varstate-ckpt = checkpoint\.__main__:main$", entry_points, re.M)
