"""Every docstring example in varstate and checkpoint runs as written; every public module, and every public name
in a public module's ``__all__``, has one (private modules, whose names start with an underscore, need none)."""

import doctest
import importlib
import pkgutil
import types

import pytest

import checkpoint
import varstate


def _modules():
    for pkg in (varstate, checkpoint):
        yield pkg.__name__
        for info in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + "."):
            if not info.name.endswith("_pb2"):
                yield info.name


def _public(module: str) -> bool:
    return not any(part.startswith("_") for part in module.split("."))


PUBLIC = sorted(m for m in set(_modules()) if _public(m))


def test_the_public_modules_are_found():
    assert {"varstate", "varstate.optimizers", "varstate.optimizers.keras", "checkpoint", "checkpoint.keras"} <= set(
        PUBLIC
    ), PUBLIC


@pytest.mark.parametrize("module", sorted(set(_modules())))
def test_docstring_examples(module, monkeypatch):
    # Examples run as in a fresh process: names like 'w' must not depend on other tests.
    monkeypatch.setattr(varstate.Registry, "_default", varstate.Registry())
    mod = importlib.import_module(module)
    result = doctest.testmod(mod, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE, verbose=False)
    assert result.failed == 0, f"{result.failed} docstring example(s) failed in {module}"
    if _public(module):  # its own docstring: the first thing `help(module)` shows
        assert ">>>" in (mod.__doc__ or ""), f"the public module {module} has no example in its docstring"


@pytest.mark.parametrize("module", PUBLIC)
def test_every_public_name_has_a_docstring_example(module):
    mod = importlib.import_module(module)
    missing = []
    for name in getattr(mod, "__all__", ()):
        obj = getattr(mod, name)
        # a module is checked as a module; a constant (a dict, a str) has its type's docstring, not one of its own
        if isinstance(obj, types.ModuleType) or not callable(obj):
            continue
        if ">>>" not in (obj.__doc__ or ""):
            missing.append(f"{module}.{name}")
    assert not missing, f"public names without a runnable example in their docstring: {missing}"
