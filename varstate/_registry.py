"""Resource registries: process-unique ids, TF-style unique names, weak entries.

A registry never keeps a variable alive. It maps resource ids to the shared
`ResourceHandle` of a variable through weak references, so an entry disappears
as soon as no version of the variable (and no treedef holding its handle) is
left.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import weakref
from collections.abc import Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from varstate._variable import ResourceHandle, Variable

# One counter for the whole process, shared by every registry, so that ids
# never collide even between variables of different registries.
_id_lock = threading.Lock()
_id_counter = itertools.count(1)


def _next_resource_id() -> int:
    with _id_lock:
        return next(_id_counter)


_scope = threading.local()


def _scoped(*names: str) -> str:
    """This thread's name scopes, then `names`, joined by ``/`` (the current scope when no name is given)."""
    return "/".join((*getattr(_scope, "stack", ()), *names))


@contextlib.contextmanager
def name_scope(name: str) -> Iterator[str]:
    """Prefixes the names of variables created inside with ``name/``.

    Scopes nest, as TF's ``tf.name_scope`` does, and are per thread.

    Args:
        name: the scope's name: a non-empty string without a trailing ``/``.

    Yields:
        The full scope in effect inside the block (``"outer/name"``).

    Raises:
        ValueError: `name` is empty, not a string, or ends with ``/``.

    >>> import varstate
    >>> with varstate.name_scope("dense"):
    ...     k = varstate.Variable(1.0, name="kernel", registry=varstate.Registry())
    >>> k.name
    'dense/kernel'
    """
    if not isinstance(name, str) or not name or name.endswith("/"):
        raise ValueError(f"name_scope: expected a non-empty string without a trailing '/', got {name!r}.")
    with _scopes((*getattr(_scope, "stack", ()), name)):
        yield _scoped()


def outside_name_scopes() -> contextlib.AbstractContextManager[None]:
    """Names given inside ignore the enclosing `name_scope`s (for a name built from a scoped one)."""
    return _scopes(())


@contextlib.contextmanager
def _scopes(stack: tuple[str, ...]) -> Iterator[None]:
    """`stack` as this thread's name scopes within the block."""
    previous = getattr(_scope, "stack", ())
    _scope.stack = stack
    try:
        yield
    finally:
        _scope.stack = previous


class Registry:
    """Tracks live resources: lookup by id and TF-style unique names.

    A default registry exists per process (`Registry.default()`); pass an
    explicit one to `Variable(..., registry=r)` to keep name spaces apart.
    ``len(registry)`` counts live resources.

    >>> import varstate
    >>> r = varstate.Registry()
    >>> a = varstate.Variable(1.0, name="kernel", registry=r)
    >>> b = varstate.Variable(2.0, name="kernel", registry=r)
    >>> (a.name, b.name, len(r))
    ('kernel', 'kernel_1', 2)
    >>> r[b.resource_id].name
    'kernel_1'
    """

    _default: Registry | None = None

    def __init__(self) -> None:
        # RLock: get_or_create_global_step holds it while its new Variable registers here.
        self._lock = threading.RLock()
        # Weak values: an entry, and the name it holds, leave with the last version of their variable (weakref's
        # own callbacks remove them, and never an entry a later handle took over).
        self._entries: weakref.WeakValueDictionary[int, ResourceHandle] = weakref.WeakValueDictionary()
        self._names: weakref.WeakValueDictionary[str, ResourceHandle] = weakref.WeakValueDictionary()
        self._next_suffix: dict[str, int] = {}
        self._global_step: Variable | None = None  # see get_or_create_global_step

    @classmethod
    def default(cls) -> Registry:
        """The process-wide registry, used when a Variable is given none (made on first use)."""
        if cls._default is None:
            with _id_lock:
                if cls._default is None:
                    cls._default = cls()
        return cls._default

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, resource_id: object) -> bool:
        return self.get(resource_id) is not None  # type: ignore[arg-type]  # any key may be asked about: absent

    def __getitem__(self, resource_id: int):
        handle = self.get(resource_id)
        if handle is None:
            raise KeyError(
                f"Registry: no live resource with id {resource_id!r} "
                f"({len(self)} live resources); it was never created here or "
                "every version of its variable has been dropped."
            )
        return handle

    def get(self, resource_id: int, default=None):
        """The `ResourceHandle` of a live resource (``registry[resource_id]`` raises KeyError instead).

        Args:
            resource_id: a Variable's `Variable.resource_id`.
            default: what to return when no live resource has that id.

        Returns:
            The handle, or `default`.
        """
        return self._entries.get(resource_id, default)

    def names(self) -> list[str]:
        """Names of the live resources, sorted."""
        return sorted(self._names)

    def unique_name(self, name: str) -> str:
        """The name a Variable created now with `name` would get here (TF's ``unique_name``).

        `name` if unused here, else ``name_1``, ``name_2``... (TF's scheme). It
        reserves nothing (TF's ``unique_name(name, mark_as_used=False)``): only
        creating a Variable takes the name.

        Args:
            name: the name asked for (scopes included).

        Returns:
            `name`, or `name` with the first free ``_<i>`` suffix.

        >>> r = Registry()
        >>> r.unique_name("kernel"), r.unique_name("kernel")
        ('kernel', 'kernel')
        """
        with self._lock:
            if name not in self._names:
                return name
            i = self._next_suffix.get(name, 1)
            while f"{name}_{i}" in self._names:
                i += 1
            return f"{name}_{i}"

    def _register(self, handle, base_name: str) -> str:
        with self._lock:
            name = self.unique_name(base_name)
            if name != base_name:  # `base_name_<i>`: later ones start after it, as TF counts uses of a name
                self._next_suffix[base_name] = int(name[len(base_name) + 1 :]) + 1
            self._entries[handle.resource_id] = handle
            self._names[name] = handle
            return name

    def __repr__(self) -> str:
        return f"Registry({len(self)} live resources)"
