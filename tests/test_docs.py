"""Every docstring example in varstate and checkpoint runs as written."""

import doctest
import importlib
import pkgutil

import pytest

import checkpoint
import varstate


def _modules():
    for pkg in (varstate, checkpoint):
        yield pkg.__name__
        for info in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + "."):
            if not info.name.endswith("_pb2"):
                yield info.name


@pytest.mark.parametrize("module", sorted(set(_modules())))
def test_docstring_examples(module, monkeypatch):
    # Examples run as in a fresh process: names like 'w' must not depend on other tests.
    monkeypatch.setattr(varstate.Registry, "_default", varstate.Registry())
    mod = importlib.import_module(module)
    result = doctest.testmod(mod, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE, verbose=False)
    assert result.failed == 0, f"{result.failed} docstring example(s) failed in {module}"


def test_every_public_name_has_a_docstring_example():
    missing = []
    for pkg in (varstate, varstate.optimizers, checkpoint):
        for name in pkg.__all__:
            obj = getattr(pkg, name)
            if isinstance(obj, type(pkg)):
                continue
            doc = getattr(obj, "__doc__", None) or ""
            if ">>>" not in doc:
                missing.append(f"{pkg.__name__}.{name}")
    assert not missing, f"public names without a runnable example: {missing}"
