"""Cheaper construction of the frozen attrs values that every tool call builds.

attrs' frozen ``__init__`` stores each field through ``object.__setattr__`` (the class's own
``__setattr__`` refuses): a C call of about 900 instructions per field, a fifth of the pipeline's
own cost per call over its dozen values. `constructor` makes, for one such class, a function that
fills an instance of a *builder* instead: a subclass that adds nothing but the plain
``__setattr__``, so each store is a specialised slot store (a few dozen instructions). The
instance then gets the frozen class itself as its ``__class__`` (allowed: the layouts are the
same). What comes out is an ordinary instance of the frozen class, frozen, compared, hashed,
repr'd, pickled and evolved as attrs defines.

The function is generated from the class's fields, as attrs generates ``__init__``, so it never
falls out of step with them. It takes every field, positionally, and applies no defaults,
validators or converters: a class whose fields validate or convert is refused, except for the
fields named *trusted* (whose callers pass what the converter would have made).
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Any, TypeVar

import attrs

__all__ = ["constructor"]

T = TypeVar("T")


def constructor(cls: type[T], *, trusted: Collection[str] = ()) -> Callable[..., T]:
    """A positional constructor of the frozen, slotted attrs class *cls* (see the module docstring)."""
    fields = attrs.fields(cls)  # type: ignore[arg-type]  # an attrs class, checked by attrs itself
    for field in fields:
        if (field.validator is not None or field.converter is not None) and field.name not in trusted:
            raise TypeError(f"{cls.__qualname__}.{field.name} validates or converts: build it with the class")
    builder = type(
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
    # Aliases never start with an underscore, so the function's own names cannot clash with them.
    lines = [f"def build({', '.join(field.alias for field in fields)}):", "    _made = _new(_Builder)"]
    lines += [f"    _made.{field.name} = {field.alias}" for field in fields]
    lines += ["    _made.__class__ = _Frozen", "    return _made"]
    namespace: dict[str, Any] = {"_new": object.__new__, "_Builder": builder, "_Frozen": cls}
    exec(compile("\n".join(lines), f"<trio_agent constructor of {cls.__qualname__}>", "exec"), namespace)
    build: Callable[..., T] = namespace["build"]
    build.__qualname__ = f"constructor({cls.__qualname__})"
    return build
