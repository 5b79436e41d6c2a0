"""Helpers for the public face: the ``__module__`` fix-up trio uses, and lazy names.

Every public module (``trio_agent`` and its public submodules) re-exports objects
defined in private modules and ends with ``fixup_module_metadata(__name__, globals())``,
so that ``repr(trio_agent.Session)`` reads ``<class 'trio_agent.Session'>`` rather than
the private path it was defined in. Only objects whose ``__module__`` is still private are
rewritten, so the first public module to claim an object becomes its home: the top level
first (it is always imported before a submodule), then the submodule.
"""

from __future__ import annotations

import importlib
import inspect
import sys
import types
import typing
from collections.abc import Mapping
from typing import Any

__all__ = ["PRIVATE_PREFIX", "fixup_module_metadata", "import_lazy", "original_module"]

PRIVATE_PREFIX = "trio_agent._"
"""Objects whose ``__module__`` starts with this are defined in a private module."""

_ORIGINAL_MODULES: dict[int, str] = {}


def original_module(obj: object) -> str | None:
    """The private module *obj* was defined in, if `fixup_module_metadata` rewrote it."""
    return _ORIGINAL_MODULES.get(id(obj))


def _resolve_annotations(cls: type) -> None:
    # typing.get_type_hints (and so cattrs, through attrs.resolve_types) evaluates a class's
    # string annotations in sys.modules[cls.__module__]: evaluate them while that is still
    # the defining module, and keep the results, so that they resolve after the rewrite.
    own = inspect.get_annotations(cls)
    if not any(isinstance(v, str) for v in own.values()):
        return
    try:
        hints = typing.get_type_hints(cls, include_extras=True)
    except Exception:  # a name only known to type checkers: leave the text
        return
    cls.__annotations__ = {key: hints.get(key, value) for key, value in own.items()}


def fixup_module_metadata(module_name: str, namespace: Mapping[str, object]) -> None:
    """Make the public objects of *namespace* say they live in *module_name* (trio's fix-up).

    Only the names in ``namespace["__all__"]`` are considered when it is set (a module's
    helper imports are not its exports). Classes and functions whose ``__module__`` is
    private are rewritten, and so are the methods and nested classes defined with a class.
    Names (``__name__``, ``__qualname__``) are left alone: every export is spelled as its
    object is named. Constants (instances) are not touched.
    """
    seen_ids: set[int] = set()

    def fix_one(obj: object, home: str) -> None:
        if id(obj) in seen_ids or not isinstance(obj, (type, types.FunctionType)):
            return
        seen_ids.add(id(obj))
        mod = getattr(obj, "__module__", None)
        if not isinstance(mod, str) or not mod.startswith(PRIVATE_PREFIX):
            return
        if isinstance(obj, type):
            _resolve_annotations(obj)
        _ORIGINAL_MODULES.setdefault(id(obj), mod)
        obj.__module__ = home
        if isinstance(obj, type):
            for attr_value in list(vars(obj).values()):
                if getattr(attr_value, "__module__", None) == mod:
                    fix_one(attr_value, home)

    # The top level's names live at the top level, whichever public module loads them first
    # (the top level loads its names lazily, so a submodule may well be first); a homonym
    # (another object under a top-level name, e.g. `trio_agent.agui.ToolMessage`) does not.
    top = sys.modules.get("trio_agent")
    top_names = frozenset(getattr(top, "__all__", ())) if module_name != "trio_agent" else frozenset()
    top_sources: Mapping[str, str] = getattr(top, "_LAZY", {})

    def home_of(objname: str, obj: object) -> str:
        if objname not in top_names:
            return module_name
        source = top_sources.get(objname)
        same = source is None or source == getattr(obj, "__module__", None)
        return "trio_agent" if same else module_name

    exported = namespace.get("__all__")
    names = exported if isinstance(exported, (list, tuple)) else list(namespace)
    for objname in names:
        if not objname.startswith("_") and objname in namespace:  # ignore private attributes
            fix_one(namespace[objname], home_of(objname, namespace[objname]))


def import_lazy(module_name: str, lazy: Mapping[str, str], name: str, namespace: dict[str, Any]) -> Any:
    """Import ``name`` from the private module ``lazy[name]`` on first use, for a module ``__getattr__``.

    The object is fixed up to belong to *module_name* and cached in *namespace*, so the
    module ``__getattr__`` runs once per name. So is every other lazy name whose module is
    loaded by now: objects a program meets without naming them (the events a session
    yields, the errors it raises) must say where they live too, and pickle the same way
    before and after someone reads their name.
    """
    importlib.import_module(lazy[name])
    loaded = {
        other: getattr(sys.modules[source], other)
        for other, source in lazy.items()
        if other not in namespace and source in sys.modules
    }
    fixup_module_metadata(module_name, loaded)
    namespace.update(loaded)
    return namespace[name]
