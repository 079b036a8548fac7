"""Sphinx configuration: `make docs` builds docs/_build/html offline (intersphinx reads docs/_inventories/)."""

import pathlib
import sys

DOCS = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(DOCS / "_ext"))
sys.path.insert(0, str(DOCS.parent))  # the checkout's packages, also when the docs extra is not installed editable

project = "varstate"
author = "the varstate authors"
copyright = "the varstate authors; Apache-2.0"

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.napoleon",
    "sphinx.ext.intersphinx",
    "sphinx.ext.viewcode",
    "sphinx_copybutton",
    "public_api",
]

source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
exclude_patterns = ["_build", "_inventories", "README.md"]
root_doc = "index"

# MyST: `#`-anchors for headings down to ### so that guides link to each other's sections.
myst_heading_anchors = 3
myst_enable_extensions = ["colon_fence", "deflist"]

# Reference: Google-style docstrings, type hints in the signature (where a reader looks for them).
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False
autodoc_typehints = "signature"
autodoc_member_order = "bysource"
autodoc_preserve_defaults = True
autodoc_default_options = {"show-inheritance": True}
autosummary_generate = False
python_use_unqualified_type_names = True
# Docstrings write `name` for code (Markdown style), so single backquotes render as code, not as italics.
default_role = "literal"

# Offline: each inventory is a committed file; the URL is only where the links point (see _inventories/README.md).
_INV = DOCS / "_inventories"
intersphinx_mapping = {
    "python": ("https://docs.python.org/3/", str(_INV / "python.inv")),
    "numpy": ("https://numpy.org/doc/stable/", str(_INV / "numpy.inv")),
    "jax": ("https://docs.jax.dev/en/latest/", str(_INV / "jax.inv")),
    "flax": ("https://flax.readthedocs.io/en/latest/", str(_INV / "flax.inv")),
    "optax": ("https://optax.readthedocs.io/en/latest/", str(_INV / "optax.inv")),
    "orbax": ("https://orbax.readthedocs.io/en/latest/", str(_INV / "orbax.inv")),
}
intersphinx_timeout = 1

html_theme = "furo"
html_title = "varstate"
html_static_path = ["_static"]
html_css_files = ["custom.css"]
html_show_sourcelink = False
# Unlabelled blocks are terminal output or commands, not Python (labelled blocks and doctests keep their lexer).
highlight_language = "text"
pygments_style = "friendly"
pygments_dark_style = "monokai"

# Copy only the code from `$ cmd` / `>>> ` lines, never the output.
copybutton_prompt_text = r"\$ |>>> |\.\.\. "
copybutton_prompt_is_regexp = True

# The public modules, each with its page under api/ (public_api.py lists each one's __all__ there).
public_api_modules = [
    "varstate",
    "varstate.optimizers",
    "varstate.optimizers.keras",
    "varstate.mixed_precision",
    "varstate.nnx",
    "checkpoint",
    "checkpoint.keras",
    "checkpoint.safetensors",
]

# Where a type hint names another project's private class (what `jax.Array` is at run time), the public name to
# look up in that project's inventory.
public_api_type_aliases = {
    "jax.jaxlib._jax.Array": "jax.Array",
    "jaxlib._jax.Array": "jax.Array",
    "jaxlib._jax.Sharding": "jax.sharding.Sharding",
    # Our own private base of Variable and AutoCastVariable (their operators and array protocols): a value hint
    # naming it (`Variable.assign`'s) accepts either, and Variable's entry is where a reader learns what that is.
    "varstate._array_ops._ArrayOps": "varstate.Variable",
}

# Type hints naming a private class that no user handles, so the reference has no entry to link to.
nitpick_ignore = [
    # `LoadStatus(state, ...)`: the restore machinery's shared account; `Checkpoint.restore` builds every
    # LoadStatus, users never do.
    ("py:class", "checkpoint._graph._match.RestoreState"),
    # `traced(value)`'s marker: passed straight to an optimizer's constructor; `traced`'s entry says what it does.
    ("py:class", "varstate.optimizers._core._traced.Traced"),
    # `Packed`'s layout: made by `varstate.pack` and shared by every version; `Packed`'s entry says what it holds.
    ("py:class", "varstate._pack.PackLayout"),
]
