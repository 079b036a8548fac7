"""The object graph: pytrees <-> TF's TrackableObjectGraph, format-agnostic.

`_walk` names an object's dependencies as TF does; `_build` turns roots into
the graph proto and the values to store under its keys (`_cache` keeps the
graphs of structures saved before); `_match` matches a
stored graph against templates and loads their values through a storage
reader. Nothing here reads or writes files.
"""

from checkpoint._graph._build import Saveable, build, node_names, values
from checkpoint._graph._cache import graph_of
from checkpoint._graph._match import RestoreState, restore_roots
from checkpoint._graph._walk import Kind, as_variable, children, kind, rewrap, slot_variables

__all__ = ["Kind", "RestoreState", "Saveable", "as_variable", "build", "children", "graph_of", "kind", "node_names",
           "restore_roots", "rewrap", "slot_variables", "values"]
