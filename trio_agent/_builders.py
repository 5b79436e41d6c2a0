"""Cheaper construction of the frozen attrs values that every tool call and journal event builds.

attrs' frozen ``__init__`` stores each field through ``object.__setattr__`` (the class's own
``__setattr__`` refuses): a C call of about 900 instructions per field, a fifth of the pipeline's
own cost per call over its dozen values. The functions here make, for one such class, a
constructor that fills an instance of a *builder* instead: a subclass that adds nothing but the
plain ``__setattr__``, so each store is a specialised slot store (a few dozen instructions). The
instance then gets the frozen class itself as its ``__class__`` (allowed: the layouts are the
same). What comes out is an ordinary instance of the frozen class, frozen, compared, hashed,
repr'd, pickled and evolved as attrs defines.

A constructor is generated from the class's fields, as attrs generates ``__init__``, so it never
falls out of step with them, and takes every field, positionally:

* `constructor` applies no defaults, validators, converters or ``__attrs_post_init__``: a class
  that has any of them is refused, except for what is named *trusted* (fields whose callers pass
  what the validator accepts and what the converter would have made, or ``__attrs_post_init__``
  when the caller made its checks);
* `checked_constructor` runs the checks it is given, inline, and hands anything they do not
  plainly accept to the class itself, which accepts it or raises what it always raised.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Any, TypeVar

import attrs

__all__ = ["checked_constructor", "constructor"]

T = TypeVar("T")

CheckSource = Callable[[object, str, dict[str, object]], "str | None"]
"""``check(validator, name, names)``: a Python expression that is true when *validator* would
accept the value of the argument *name* (``None``: no such expression); it may add what the
expression reads to *names*."""


def constructor(cls: type[T], *, trusted: Collection[str] = ()) -> Callable[..., T]:
    """A positional constructor of the frozen, slotted attrs class *cls* that stores what it is given."""
    fields = _fields(cls)
    for field in fields:
        if (field.validator is not None or field.converter is not None) and field.name not in trusted:
            raise TypeError(f"{cls.__qualname__}.{field.name} validates or converts: build it with the class")
    if hasattr(cls, "__attrs_post_init__") and "__attrs_post_init__" not in trusted:
        raise TypeError(f"{cls.__qualname__} checks itself after its fields: build it with the class")
    lines = [f"def build({', '.join(field.alias for field in fields)}):", *_stores(cls, fields, "    ")]
    return _compile(cls, lines, {}, "constructor")


def checked_constructor(cls: type[T], check: CheckSource, *, trusted: Collection[str] = ()) -> Callable[..., T]:
    """A positional constructor of *cls* that gives what ``cls(...)`` gives, for any values: those
    that *check*'s expressions accept are stored, anything else (and every field with a converter
    or a validator *check* does not know) goes to ``cls(...)`` itself. Fields named *trusted* are
    not tested: their callers pass what the validator accepts (without a converter)."""
    fields = _fields(cls)
    names: dict[str, object] = {}
    tests = []
    for field in fields:
        if field.name in trusted and field.converter is None:
            continue
        test = None if field.converter is not None else check(field.validator, field.alias, names)
        tests.append("False" if test is None else test)
    arguments = ", ".join(field.alias for field in fields)
    lines = [f"def build({arguments}):", f"    if {' and '.join(tests) or 'True'}:", *_stores(cls, fields, "        ")]
    lines.append(f"    return _Frozen({', '.join(f'{field.alias}={field.alias}' for field in fields)})")
    return _compile(cls, lines, names, "checked_constructor")


def _fields(cls: type[Any]) -> tuple[Any, ...]:
    return tuple(attrs.fields(cls))


def _plain(cls: type[Any]) -> bool:
    """Whether *cls* stores its fields itself (not frozen): then it is its own builder."""
    return cls.__setattr__ is object.__setattr__ and cls.__delattr__ is object.__delattr__  # type: ignore[comparison-overlap]


def _stores(cls: type[Any], fields: tuple[Any, ...], indent: str) -> list[str]:
    # Aliases never start with an underscore, so the function's own names cannot clash with them.
    lines = [f"{indent}_made = _new(_Builder)"]
    lines += [f"{indent}_made.{field.name} = {field.alias}" for field in fields]
    if not _plain(cls):
        lines.append(f"{indent}_made.__class__ = _Frozen")
    lines.append(f"{indent}return _made")
    return lines


def _compile(cls: type[T], lines: list[str], names: dict[str, object], kind: str) -> Callable[..., T]:
    builder = (
        cls
        if _plain(cls)
        else type(
            f"{cls.__name__}Builder",
            (cls,),
            {
                "__slots__": (),
                # Both: CPython fills the setattr slot from the pair, and only the plain pair gives the
                # generic setter that the interpreter specialises stores for.
                "__setattr__": object.__setattr__,
                "__delattr__": object.__delattr__,
                "__module__": cls.__module__,
                "__qualname__": f"{cls.__qualname__}.Builder",
            },
        )
    )
    namespace: dict[str, Any] = {**names, "_new": object.__new__, "_Builder": builder, "_Frozen": cls}
    exec(compile("\n".join(lines), f"<trio_agent {kind} of {cls.__qualname__}>", "exec"), namespace)
    build: Callable[..., T] = namespace["build"]
    build.__qualname__ = f"{kind}({cls.__qualname__})"
    return build
