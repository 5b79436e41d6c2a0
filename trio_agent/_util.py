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
from typing import Any, Generic, Literal, TypeVar

__all__ = [
    "PRIVATE_PREFIX",
    "callable_name",
    "describe",
    "fixup_module_metadata",
    "import_lazy",
    "instance_of",
    "original_module",
    "safe_repr",
]

T = TypeVar("T")

PRIVATE_PREFIX = "trio_agent._"
"""Objects whose ``__module__`` starts with this are defined in a private module."""

_ORIGINAL_MODULES: dict[int, str] = {}

# A class's own name, read past any ``__name__`` a metaclass defines (which could raise).
_CLASS_NAME = type.__dict__["__name__"]


def safe_repr(value: object, limit: int = 200) -> str:
    """*value*'s repr for a message about it, cut short past *limit* characters; never raises.

    The value is usually what a user's callable returned, emitted or was configured with where
    something else was expected, and its ``__repr__`` is that user's code too: when it (or an
    item's, inside a container) raises, the message names the value's type instead, so the
    error that says what was wrong is the one raised. Only for error paths: it formats in full.
    """
    try:
        text = repr(value)
    except Exception as exc:  # a raising __repr__, an int past the digit limit, a deep recursion ...
        kind: str = _CLASS_NAME.__get__(type(value))
        return f"<{kind} object, unprintable: its repr raised {_CLASS_NAME.__get__(type(exc))}>"
    text = str.__str__(text)  # a str subclass's own slicing and len() are the caller's code too
    return text if len(text) <= limit else f"{text[: limit - 40]}... ({len(text)} characters)"


def describe(exc: BaseException, form: Literal["typed", "repr", "text"] = "typed") -> str:
    """How an exception that user code raised (a tool, a middleware, a hook, a provider) is told
    in a message, a result or the journal: ``"Type: message"`` (*form* ``"typed"``), its ``repr``
    (``"repr"``) or its message alone (``"text"``: what ``str()`` gives, when that works).

    Never raises: the exception is the caller's code, and its ``__str__`` or ``__repr__`` may
    raise or return no string; then the other spelling is used, or else its type's name alone.
    Telling a failure must not become a failure of whoever reports it (a request's end left
    unrecorded, the library's own error raised in place of the user's).
    """
    name: str = _CLASS_NAME.__get__(type(exc))
    for spell in (repr, str) if form == "repr" else (str, repr):
        try:
            text = spell(exc)
        except Exception:
            continue
        if not isinstance(text, str):
            continue
        text = str.__str__(text)  # a str subclass's own formatting is the caller's code too
        return f"{name}: {text}" if spell is str and form != "text" else text
    return f"{name} (unprintable: its __str__ and __repr__ failed)"


def callable_name(fn: object) -> str:
    """A user's callable named for a message: its ``__qualname__`` when that is a string, else
    `safe_repr` (an instance with ``__call__``, a partial). Never raises."""
    try:
        name = getattr(fn, "__qualname__", None)
    except Exception:  # a property of the caller's that raises
        name = None
    return str.__str__(name) if isinstance(name, str) else safe_repr(fn)


class instance_of(Generic[T]):  # named as the attrs validator it stands in for
    """``attrs.validators.instance_of``, telling a wrong value through `safe_repr`: attrs formats it
    with ``!r``, so a value whose repr raises would raise that instead of the `TypeError`. The same
    message; the message is the exception's only argument (attrs adds the attribute, the type and
    the value, and then ``str()`` of the exception formats them all with ``repr`` again)."""

    __slots__ = ("kind",)

    def __init__(self, kind: type[T] | tuple[type[T], ...]) -> None:
        self.kind = kind

    def __call__(self, instance: Any, attribute: Any, value: T) -> None:
        if not isinstance(value, self.kind):
            message = (
                f"'{attribute.name}' must be {safe_repr(self.kind)} "
                f"(got {safe_repr(value)} that is a {safe_repr(type(value))})."
            )
            raise TypeError(message)

    def __repr__(self) -> str:
        return f"<instance_of validator for type {safe_repr(self.kind)}>"


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
