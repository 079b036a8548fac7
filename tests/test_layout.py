"""The layout keeps its rules: parsed from the sources, so a new module or import that breaks one fails here.

- no import cycle between modules (function-level imports count: they only defer a cycle);
- `checkpoint._storage` imports neither `checkpoint._graph` nor `varstate`;
- `varstate` never imports `checkpoint`;
- `checkpoint` reaches varstate only through its public modules and `varstate._seam`;
- an underscore name is not imported across package boundaries;
- private JAX (`jax._src`) is reached by `varstate/_jax_compat.py`, `checkpoint/_export/_jax_private.py` and
  `checkpoint/_storage/_jax_private.py` alone (jaxlib's by `checkpoint/_export/_module_child.py`, the child that
  reads export modules), and orbax's (`orbax.checkpoint._src`) by `checkpoint/_storage/_orbax_private.py` alone:
  by an import, or by a string naming it passed to a call (`importlib.import_module("jax._src...")`,
  `__import__`); the tests read private JAX through tests/conftest.py's `jax_private` fixture alone;
- each concept has its folder, holding its modules (`CONCEPT_FOLDERS`);
- `checkpoint/` holds only the verbs at its top level and `varstate/optimizers/` only the TF v1 optimizers and
  their helpers (`FLAT_MODULES`): a new flat module is added there deliberately, or goes into a folder;
- every public module (`PUBLIC_MODULES`) has `__all__`, and its other top-level names are underscored or
  submodules, so `dir()` of it shows its API and no `np` or `os`;
- the suite itself runs without xdist (`-p no:xdist`, for a debugger), as pyproject.toml says: tests/conftest.py's
  xdist hooks are optional there.
"""

import ast
import functools
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = ("varstate", "checkpoint")


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            if path.name.endswith("_pb2.py"):
                continue
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


MODULES = _modules()


def _package(module: str) -> str:
    """The package a module belongs to (a package's __init__ belongs to the package itself)."""
    return module if (ROOT / module.replace(".", "/") / "__init__.py").exists() else module.rpartition(".")[0]


def _type_checking_only(node: ast.AST, parents: dict) -> bool:
    while node in parents:
        node = parents[node]
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id.lstrip("_") == "TYPE_CHECKING":
            return True
    return False


def _imports(module: str) -> list[tuple[str, str | None, int]]:
    """(target module, imported attribute or None, line) for every import in `module`, at any depth."""
    tree = ast.parse(MODULES[module].read_text())
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    base = module if MODULES[module].name == "__init__.py" else module.rpartition(".")[0]
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.Import, ast.ImportFrom)) or _type_checking_only(node, parents):
            continue
        if isinstance(node, ast.Import):
            out.extend((alias.name, None, node.lineno) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            source = node.module or ""
            if node.level:
                anchor = base.split(".")[: len(base.split(".")) - node.level + 1]
                source = ".".join([*anchor, source] if source else anchor)
            for alias in node.names:
                sub = f"{source}.{alias.name}"
                out.append((sub, None, node.lineno) if sub in MODULES else (source, alias.name, node.lineno))
    return out


# Parsed when a test first asks (a module's import costs every xdist worker that collects it).
edges = functools.cache(_imports)


def test_the_sources_are_found():
    assert "checkpoint._storage._bundle" in MODULES and "varstate._seam" in MODULES
    # The parser resolves `from pkg import module` to the module, and names to their module.
    assert ("checkpoint._graph._walk", None) in {(t, n) for t, n, _ in edges("checkpoint._graph._match")}
    assert ("checkpoint._keys", None) in {(t, n) for t, n, _ in edges("checkpoint._checkpoint")}
    assert ("varstate._seam", None) in {(t, n) for t, n, _ in edges("checkpoint._graph._build")}


def test_no_import_cycles():
    graph = {m: sorted({t for t, _, _ in edges(m) if t in MODULES and t != m}) for m in MODULES}
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for t in graph[m]:
            if state.get(t) == 1:
                cycle = [*stack[stack.index(t):], t]
                pytest.fail(f"import cycle: {' -> '.join(cycle)}")
            if t not in state:
                visit(t)
        stack.pop()
        state[m] = 2

    for m in graph:
        if m not in state:
            visit(m)


@pytest.mark.parametrize("module", sorted(MODULES))
def test_import_directions(module):
    errors = []
    for target, name, line in edges(module):
        where = f"{MODULES[module].relative_to(ROOT)}:{line} imports {target}{'.' + name if name else ''}"
        top = target.split(".")[0]
        if module.startswith("varstate") and top == "checkpoint":
            errors.append(f"{where}: varstate must not import checkpoint")
        if module.startswith("checkpoint._storage") and (top == "varstate" or target.startswith("checkpoint._graph")):
            errors.append(f"{where}: storage must not import the object graph or varstate")
        if module.startswith("checkpoint") and top == "varstate":
            private = [p for p in target.split(".") if p.startswith("_")]
            if private and target != "varstate._seam":
                errors.append(f"{where}: checkpoint reaches varstate through its public names or varstate._seam")
        if name is not None and name.startswith("_") and top in PACKAGES and _package(target) != _package(module):
            errors.append(f"{where}: the underscore name {name!r} crosses a package boundary")
        errors.extend(_private_access(module, target, where))
    assert not errors, "\n".join(errors)


# Private modules of other libraries -> the one module of ours allowed to reach each.
PRIVATE_HOMES = {
    "jax._src": ("varstate._jax_compat", "checkpoint._export._jax_private", "checkpoint._storage._jax_private"),
    "orbax.checkpoint._src": ("checkpoint._storage._orbax_private",),
    # Reading an export's StableHLO module as jax does, in a child process that does not import jax.
    "jaxlib._jax": ("checkpoint._export._module_child",),
    "jaxlib.mlir._mlir_libs": ("checkpoint._export._module_child",),
}


def _private_access(module: str, name: str, where: str) -> list[str]:
    out = []
    for private, homes in PRIVATE_HOMES.items():
        if (name == private or name.startswith(private + ".")) and module not in homes:
            home = " or ".join(f"{h.replace('.', '/')}.py" for h in homes if h.split(".")[0] == module.split(".")[0])
            out.append(f"{where}: {private} is private; reach it through {home or ' or '.join(homes)} (add a "
                       "function there and call it)")
    return out


@pytest.mark.parametrize("module", sorted(MODULES))
def test_private_modules_named_in_calls(module):
    """`importlib.import_module("jax._src.x")`, `__import__(...)` or any call given such a name counts as an import."""
    tree = ast.parse(MODULES[module].read_text())
    errors = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            for arg in [*node.args, *(k.value for k in node.keywords)]:
                if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                    where = f"{MODULES[module].relative_to(ROOT)}:{arg.lineno} names {arg.value!r} in a call"
                    errors.extend(_private_access(module, arg.value, where))
    assert not errors, "\n".join(errors)


def _private_reads(path: pathlib.Path) -> list[tuple[str, int]]:
    """(private module, line) for each import of one, and each `import_module`/`__import__` call naming one."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level:
            names = [node.module or ""]
        elif isinstance(node, ast.Call) and (getattr(node.func, "attr", None) == "import_module"
                                             or getattr(node.func, "id", None) == "__import__"):
            names = [a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
        out += [(n, node.lineno) for n in names if any(n == p or n.startswith(p + ".") for p in PRIVATE_HOMES)]
    return out


def test_tests_read_private_jax_through_conftest():
    errors = [f"{path.relative_to(ROOT)}:{line} reads {name}: use the `jax_private` fixture of tests/conftest.py "
              "(add the expression there)"
              for path in sorted((ROOT / "tests").rglob("*.py")) if path != ROOT / "tests" / "conftest.py"
              for name, line in _private_reads(path)]
    assert not errors, "\n".join(errors)


# Each concept's folder and the modules it must hold (it may hold more).
CONCEPT_FOLDERS = {
    "checkpoint/keras": {"__init__", "_weights", "_read", "_optimizer", "_order", "_hdf5"},
    "checkpoint/safetensors": {"__init__", "_tree"},  # the file format itself is checkpoint/_storage/_safetensors
    "checkpoint/_tf": {"_name_based", "_saved_model"},
    "checkpoint/_cli": {"_main", "_inspect", "_out"},
    "checkpoint/_storage": {"__init__", "_publish", "_journal", "_bundle", "_orbax", "_orbax_private"},
    "checkpoint/_graph": {"__init__", "_walk", "_build", "_match"},
    "checkpoint/_export": {"__init__", "_save", "_load", "_jax_private", "_tf_saved_model"},
    "varstate/optimizers/_core": {"_base", "_step", "_matching", "_slots", "_state", "_rows", "_messages", "_packed"},
    "varstate/optimizers/keras": {"__init__", "_base", "_adam", "_ftrl", "_sgd", "_lamb", "_muon"},
}

# The modules a folder may hold at its top level (sub-packages aside): anything else belongs in a concept folder.
FLAT_MODULES = {
    "checkpoint": {"__init__", "__main__", "_checkpoint", "_manager", "_status", "_errors", "_keys", "_dtypes"},
    "varstate/optimizers": {
        "__init__", "_adadelta", "_adagrad", "_adagrad_da", "_adam", "_ftrl", "_gradient_descent", "_momentum",
        "_proximal_adagrad", "_proximal_gradient_descent", "_rmsprop",  # the TF v1 optimizers
        "_proximal_math", "_loss_scale", "_optax", "_to_optax",
    },
}


@pytest.mark.parametrize("folder", sorted(CONCEPT_FOLDERS))
def test_concept_folders_hold_their_modules(folder):
    here = ROOT / folder
    assert (here / "__init__.py").is_file(), f"{folder}/__init__.py is missing: {folder}/ must be a package"
    missing = sorted(m for m in CONCEPT_FOLDERS[folder] if not (here / f"{m}.py").is_file())
    assert not missing, (f"{folder}/ lacks {', '.join(f'{m}.py' for m in missing)}: move the module back into its "
                         "concept's folder, or update CONCEPT_FOLDERS in tests/test_layout.py if the concept changed")


@pytest.mark.parametrize("folder", sorted(FLAT_MODULES))
def test_only_the_listed_modules_are_flat(folder):
    extra = sorted(p.name for p in (ROOT / folder).glob("*.py") if p.stem not in FLAT_MODULES[folder])
    assert not extra, (f"{folder}/ holds {', '.join(extra)} at its top level, where only "
                       f"{sorted(FLAT_MODULES[folder])} belong: move it into its concept's folder, or add it to "
                       "FLAT_MODULES in tests/test_layout.py deliberately")


PUBLIC_MODULES = ["varstate", "varstate.optimizers", "varstate.optimizers.keras", "varstate.mixed_precision",
                  "varstate.nnx", "checkpoint", "checkpoint.keras", "checkpoint.safetensors"]


def _top_level_names(tree: ast.Module) -> list[tuple[str, int]]:
    """(name, line) of every name a module binds at its top level (`from __future__` is a compiler directive)."""
    out = []
    for node in tree.body:
        if isinstance(node, ast.Import):
            out += [((a.asname or a.name).split(".")[0], node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module != "__future__":
            out += [(a.asname or a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            out.append((node.name, node.lineno))
        elif isinstance(node, ast.Assign | ast.AnnAssign | ast.AugAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            out += [(n.id, node.lineno) for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)]
    return out


def _all_of(tree: ast.Module) -> list[str] | None:
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            return [e.value for e in node.value.elts]
    return None


@pytest.mark.parametrize("module", PUBLIC_MODULES)
def test_public_modules_show_their_api_only(module):
    path = MODULES[module]
    where = path.relative_to(ROOT)
    tree = ast.parse(path.read_text())
    public = _all_of(tree)
    assert public is not None, f"{where}: a public module without __all__; list its public names in __all__"
    package = path.parent if path.name == "__init__.py" else None
    errors = []
    for name, line in _top_level_names(tree):
        if name.startswith("_") or name in public:
            continue
        if package is not None and (f"{module}.{name}" in MODULES):
            continue  # a submodule
        errors.append(f"{where}:{line}: top-level name {name!r} is neither in __all__ nor underscored; import it "
                      f"as `_{name}` (e.g. `import numpy as _np`), move the code using it to a private module, or "
                      "add it to __all__ if it is public")
    assert not errors, "\n".join(errors)


def test_the_suite_collects_without_xdist():
    done = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:xdist", "-p", "no:cacheprovider", "--collect-only",
                           "tests/test_layout.py::test_the_sources_are_found"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "tests/test_layout.py::test_the_sources_are_found" in done.stdout
