"""The `public-api` directive: one reference page per public module, listed from its `__all__`.

``.. public-api:: varstate.optimizers`` documents the module's docstring, a summary table, then every name of
``__all__`` in its order (classes with their documented members, functions, data), so a name added to ``__all__``
appears without editing the page. A submodule named in ``__all__`` is listed in the table and linked to its own
page, not documented twice.
"""

import dataclasses
import importlib
import inspect
import sys
import types
import typing

from docutils import nodes
from docutils.statemachine import StringList
from sphinx.ext.intersphinx import missing_reference
from sphinx.pycode import ModuleAnalyzer
from sphinx.util.docutils import SphinxDirective
from sphinx.util.inspect import signature as _signature
from sphinx.util.inspect import stringify_signature


def public_names(modname):
    """The module's `__all__`; a public module without one is an error (every public module must have it)."""
    module = importlib.import_module(modname)
    names = getattr(module, "__all__", None)
    if names is None:
        raise ValueError(f"public-api: module {modname} has no __all__; add one listing its public names, "
                         "in the order the reference should show them")
    return module, list(names)


def home(obj, modules):
    """The public module that documents `obj` for cross-references: the deepest one its defining module is in."""
    defined_in = getattr(obj, "__module__", None) or ""
    inside = [m for m in modules if defined_in == m or defined_in.startswith(m + ".")]
    return max(inside, key=len) if inside else None


def data_doc(module, name):
    """A constant's documentation: the `#:` comment (or string) at its assignment in the submodule that makes it.

    A public module re-exports constants by import, which carries no documentation, and a constant's own
    `__doc__` is its type's (a dict's); so the comment is looked up where the name is assigned. None if none.
    """
    obj = getattr(module, name)
    for modname, sub in sorted(sys.modules.items()):
        if modname.startswith(module.__name__ + ".") and getattr(sub, name, None) is obj:
            doc = ModuleAnalyzer.for_module(modname).find_attr_docs().get(("", name))
            if doc:
                return [line for line in doc if line is not None]
    return None


def _entry(modname, name, obj, indexed):
    qualified = f"{modname}.{name}"
    if isinstance(obj, types.ModuleType):
        return []
    no_index = [] if indexed else ["   :no-index:"]
    if inspect.isclass(obj):
        return [f".. autoclass:: {qualified}", "   :members:", *no_index, ""]
    if callable(obj):
        return [f".. autofunction:: {qualified}", *no_index, ""]
    return [f".. autodata:: {qualified}", "   :no-value:", *no_index, ""]


def _public_objects(app):
    """id(object) -> its public name, for each object of every module in `public_api_modules`."""
    modules = app.config.public_api_modules
    found = {}
    for modname in modules:
        module, names = public_names(modname)
        for name in names:
            obj = getattr(module, name)
            where = home(obj, modules) or modname
            if where == modname or id(obj) not in found:
                found[id(obj)] = f"{modname}.{name}"
    return found


def _resolve_private(app, env, node, contnode):
    """A reference to a private path (`varstate._variable.Variable`) or to a re-export goes to the public entry;
    one to another project's private path (`jaxlib._jax.Sharding`) goes where `public_api_type_aliases` says."""
    if node.get("refdomain") != "py":
        return None
    target = original = node["reftarget"]
    alias = app.config.public_api_type_aliases.get(target)
    if alias is not None:  # another project's name (its inventory), else one of ours (below)
        node = node.deepcopy()
        node["reftarget"] = target = alias
        found = missing_reference(app, env, node, contnode)
        if found is not None:
            return found
    obj = _import(target)
    public = None if obj is None else app.env.public_api_objects.get(id(obj))
    if public is None or public == original:
        return None
    domain = env.get_domain("py")
    return domain.resolve_xref(env, node["refdoc"], app.builder, "obj", public, node, contnode)


def _import(dotted):
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        try:
            for attr in parts[cut:]:
                obj = getattr(obj, attr)
        except AttributeError:
            return None
        return obj
    return None


class PublicAPI(SphinxDirective):
    required_arguments = 1
    has_content = False

    def run(self):
        modname = self.arguments[0]
        try:
            module, names = public_names(modname)
        except (ImportError, ValueError) as e:
            raise self.error(str(e)) from e
        self.env.note_dependency(inspect.getsourcefile(module))
        lines = [f".. automodule:: {modname}", "   :no-members:", "", f".. currentmodule:: {modname}", "",
                 ".. autosummary::", ""]
        lines += [f"   {name}" for name in names]
        lines.append("")
        modules = self.config.public_api_modules
        for name in names:
            obj = getattr(module, name)
            lines += _entry(modname, name, obj, indexed=home(obj, modules) in (modname, None))
        node = nodes.section()
        node.document = self.state.document
        self.state.nested_parse(StringList(lines, source=f"<public-api {modname}>"), self.content_offset, node)
        return node.children


def _data_docstring(app, what, name, obj, options, lines):
    """A public constant's entry and summary show `data_doc`, not its type's docstring."""
    modname, _, attr = name.rpartition(".")
    if what == "data" and modname in app.config.public_api_modules:
        lines[:] = data_doc(importlib.import_module(modname), attr) or lines


def _skip_field_aliases(app, what, name, obj, skip, options):
    """A NamedTuple's fields are documented in its Args, not again as "Alias for field number N"."""
    if (getattr(obj, "__doc__", None) or "").startswith("Alias for field number"):
        return True
    return None


def _init_signature(app, what, name, obj, options, signature, return_annotation):
    """An optimizer checks its keywords in `__new__(*args, **kwargs)`: show its dataclass `__init__`'s parameters."""
    if what == "class" and dataclasses.is_dataclass(obj) and (signature or "").startswith("(*args"):
        sig = _signature(obj.__init__, bound_method=True)
        hints = typing.get_type_hints(obj)  # the fields' annotations, resolved in the class's own module
        params = [p.replace(annotation=hints.get(p.name, p.annotation)) for p in sig.parameters.values()]
        return stringify_signature(sig.replace(parameters=params), show_return_annotation=False), return_annotation
    return None


def _public_bases(app, name, obj, options, bases):
    """A private mixin (`_ArrayOps`) is how a class is built, not what it is: the reference shows public bases."""
    bases[:] = [b for b in bases if not getattr(b, "__name__", "").startswith("_")]


def _collect(app):
    app.env.public_api_objects = _public_objects(app)


def setup(app):
    app.add_config_value("public_api_modules", [], "env")
    app.add_config_value("public_api_type_aliases", {}, "env")
    app.add_directive("public-api", PublicAPI)
    app.connect("builder-inited", _collect)
    app.connect("missing-reference", _resolve_private)
    app.connect("autodoc-process-bases", _public_bases)
    app.connect("autodoc-process-docstring", _data_docstring)
    app.connect("autodoc-skip-member", _skip_field_aliases)
    app.connect("autodoc-process-signature", _init_signature)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
