"""The API reference lists every public name with a usable docstring, checked without building the site.

`docs/conf.py`'s `public_api_modules` must be exactly the public modules: every module under varstate/ and
checkpoint/ without an underscore in its path, except `checkpoint.protos` (TF's generated protobuf bindings, whose
reference is TF's .proto files; the package's README says how they are made). `checkpoint.__main__` is private by
its name (the command line has its guide). Each public module has `docs/api/<module>.rst` using the `public-api`
directive (which lists its `__all__`), and each name of `__all__` has a docstring with an example and, where it
takes parameters, an `Args:` section naming each one (a class: its constructor's).
"""

import enum
import importlib.util
import inspect
import pathlib
import pkgutil
import re
import sys
import types

import pytest

import checkpoint
import varstate

DOCS = pathlib.Path(__file__).resolve().parent.parent / "docs"
NOT_IN_REFERENCE = {"checkpoint.protos"}  # and its submodules; see the module docstring


def _load(name, path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


REFERENCED = _load("_docs_conf", DOCS / "conf.py").public_api_modules  # conf.py imports no Sphinx


def _doc_comment(module, name):
    """Whether a constant re-exported by `module` has a `#:` comment at its assignment (what docs/_ext/public_api.py
    shows for it), read from the sources here: the suite does not install Sphinx."""
    obj = getattr(module, name)
    assigned = re.compile(rf"^{re.escape(name)}\s*(?::[^=]*)?=", re.M)
    for modname, sub in sorted(sys.modules.items()):
        inside = modname == module.__name__ or modname.startswith(module.__name__ + ".")
        if inside and getattr(sub, name, None) is obj:
            source = inspect.getsource(sub)
            match = assigned.search(source)
            if match and source[:match.start()].rstrip("\n").rsplit("\n", 1)[-1].lstrip().startswith("#:"):
                return True
    return False


def _public_modules():
    for pkg in (varstate, checkpoint):
        names = [pkg.__name__] + [i.name for i in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + ".")]
        for name in names:
            if any(part.startswith("_") for part in name.split(".")):
                continue
            if not any(name == m or name.startswith(m + ".") for m in NOT_IN_REFERENCE):
                yield name


def test_the_reference_lists_exactly_the_public_modules():
    assert sorted(REFERENCED) == sorted(_public_modules()), (
        "docs/conf.py's public_api_modules must list every public module (and only those); "
        "add a new one there and give it a page docs/api/<module>.rst"
    )


@pytest.mark.parametrize("module", REFERENCED)
def test_each_public_module_has_its_page(module):
    page = DOCS / "api" / f"{module}.rst"
    assert page.is_file(), f"{page} is missing: write it with `.. public-api:: {module}` under a title"
    assert re.search(rf"^\.\. public-api:: {re.escape(module)}\s*$", page.read_text(), re.M), (
        f"{page} does not use `.. public-api:: {module}`, which lists the module's __all__"
    )
    index = (DOCS / "api" / "index.md").read_text()
    assert re.search(rf"^{re.escape(module)}$", index, re.M), f"docs/api/index.md's toctree does not list {module}"


def _parameters(obj):
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        return []
    if inspect.isclass(obj) and issubclass(obj, (BaseException, enum.Enum)):
        return []  # an exception's message, an enum's lookup by value: the docstring says what they are
    kinds = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    return [n for n, p in sig.parameters.items() if p.kind not in kinds and not n.startswith("_")]


def _documented_args(doc):
    """Parameter names an `Args:` (or a NamedTuple's/dataclass's `Attributes:`) section documents."""
    found = set()
    for section in re.finditer(r"^(\s*)(?:Args|Attributes):\n((?:\1[ \t]+\S.*\n|\s*\n)+)", doc + "\n", re.M):
        found |= set(re.findall(r"^\s+\**(\w+)(?: \([^)]*\))?:", section.group(2), re.M))
    return found


@pytest.mark.parametrize("module", REFERENCED)
def test_every_public_name_has_a_reference_docstring(module):
    mod = importlib.import_module(module)
    names = list(mod.__all__)
    problems = []
    for name in names:
        obj = getattr(mod, name)
        if isinstance(obj, types.ModuleType):
            continue
        if not callable(obj):  # a constant: documented by a `#:` comment where it is assigned
            if not _doc_comment(mod, name):
                problems.append(f"{name}: no `#:` comment at its assignment")
            continue
        doc = inspect.getdoc(obj) or ""
        if ">>>" not in doc:
            problems.append(f"{name}: no example")
        undocumented = [p for p in _parameters(obj) if p not in _documented_args(doc)]
        if undocumented:
            problems.append(f"{name}: Args does not document {undocumented}")
    assert not problems, f"{module}: " + "; ".join(problems)
