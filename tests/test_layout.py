"""The layers keep their direction: parsed from the sources, so a new import that breaks them fails here.

- no import cycle between modules (function-level imports count: they only defer a cycle);
- `checkpoint._storage` imports neither `checkpoint._graph` nor `varstate`;
- `varstate` never imports `checkpoint`;
- `checkpoint` reaches varstate only through its public modules and `varstate._seam`;
- an underscore name is not imported across package boundaries;
- `jax._src` is imported by `varstate/_jax_compat.py` alone.
"""

import ast
import pathlib

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
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            return True
    return False


def _imports(module: str) -> list[tuple[str, str | None, int]]:
    """(target module, imported attribute or None, line) for every import in `module`, at any depth."""
    tree = ast.parse(MODULES[module].read_text())
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    base = module if MODULES[module].name == "__init__.py" else module.rpartition(".")[0]
    out = []
    for node in ast.walk(tree):
        if _type_checking_only(node, parents):
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


EDGES = {m: _imports(m) for m in MODULES}


def test_the_sources_are_found():
    assert "checkpoint._storage._bundle" in MODULES and "varstate._seam" in MODULES
    # The parser resolves `from pkg import module` to the module, and names to their module.
    assert ("checkpoint._graph._walk", None) in {(t, n) for t, n, _ in EDGES["checkpoint._graph._match"]}
    assert ("checkpoint._keys", None) in {(t, n) for t, n, _ in EDGES["checkpoint._checkpoint"]}
    assert ("varstate._seam", None) in {(t, n) for t, n, _ in EDGES["checkpoint._graph._build"]}


def test_no_import_cycles():
    graph = {m: sorted({t for t, _, _ in EDGES[m] if t in MODULES and t != m}) for m in MODULES}
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
    for target, name, line in EDGES[module]:
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
        if target.startswith("jax._src") and module != "varstate._jax_compat":
            errors.append(f"{where}: private JAX goes through varstate/_jax_compat.py")
    assert not errors, "\n".join(errors)
