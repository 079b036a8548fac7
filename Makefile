# Two commands do everything on a fresh machine with python3 and make:
#   make demo   - set up .venv and run the main example
#   make test   - set up .venv and run the whole test suite
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
DOCS_STAMP := $(VENV)/.installed-docs

.PHONY: demo test lint bench docs clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# setuptools' boxed notice about editable installs reads like an error to a newcomer; it is only information.
	PYTHONWARNINGS='ignore:Editable installation' $(BIN)/python -m pip install -q -e '.[test]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/python examples/demo.py

# Bytecode caches on even where the machine turns them off (PYTHONDONTWRITEBYTECODE): without them every worker
# rewrites the test modules' asserts and every subprocess compiles the package again (225 s -> 198-214 s warm).
test: $(STAMP)
	$(BIN)/python -m ruff check .
	$(BIN)/python -m mypy
	PYTHONDONTWRITEBYTECODE= $(BIN)/python -m pytest -n auto --dist loadfile tests

# The docs extra on top of the test set-up; the build is offline (intersphinx reads docs/_inventories/).
$(DOCS_STAMP): $(STAMP)
	PYTHONWARNINGS='ignore:Editable installation' $(BIN)/python -m pip install -q -e '.[docs]'
	touch $(DOCS_STAMP)

docs: $(DOCS_STAMP)
	mkdir -p docs/_build
	$(BIN)/python -m sphinx -E -b html -W -n --keep-going -w docs/_build/warnings.txt docs docs/_build/html

bench: $(STAMP)
	for b in benchmarks/[!_]*.py; do $(BIN)/python -m benchmarks.$$(basename $$b .py) || exit 1; done

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .mypy_cache docs/_build
