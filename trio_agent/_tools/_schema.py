"""JSON Schema (draft 2020-12) generated from typed input classes (attrs classes and dataclasses),
and the converter that structures input into them.

(Pydantic models bring their own ``model_json_schema()``; plain typed parameters
become an attrs class first, see `_definition.py`.)

A union becomes ``anyOf``; the converter then picks the member by the JSON type of the value
(`union_members`), so a union is accepted only where that type says which member it is: the
schema and the structuring follow one rule, checked when the tool is defined. A ``Literal`` is
structured as its declared value the input equals by JSON's rules, as its ``enum`` compares them
(``1.0`` is ``1``; a bool equals only a bool).
"""

from __future__ import annotations

import dataclasses
import enum
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal, Union

import attrs
import cattrs
from cattrs.disambiguators import create_default_dis_func
from cattrs.errors import CattrsError

from .._errors import ToolDefinitionError
from .._json import is_json
from .._util import safe_repr

__all__ = [
    "SIGNATURE_FIELDS",
    "default_signature_field",
    "inline_top_ref",
    "input_converter",
    "is_input_class",
    "schema_for_attrs_class",
    "schema_for_class",
    "union_members",
]

_SCALARS: dict[Any, dict[str, Any]] = {
    str: {"type": "string"},
    int: {"type": "integer"},
    float: {"type": "number"},
    bool: {"type": "boolean"},
    type(None): {"type": "null"},
}


SIGNATURE_FIELDS: tuple[str, ...] = ("command", "file_path", "path", "url")
"""Input fields that give a tool without ``signature_content=`` its permission signature, in this order."""


def default_signature_field(schema: Mapping[str, Any]) -> str | None:
    """The first of `SIGNATURE_FIELDS` that *schema* declares as a top-level ``"type": "string"`` property.

    Chosen from the schema, not from a call's input, so the model cannot pick
    which field a ``Name:content`` rule is matched against by adding keys, and a
    declared string field cannot arrive as a list that slips past the rule.
    """
    properties = schema.get("properties")
    if not isinstance(properties, Mapping):
        return None
    for name in SIGNATURE_FIELDS:
        prop = properties.get(name)
        if isinstance(prop, Mapping) and prop.get("type") == "string":
            return name
    return None


_DEFS_PREFIX = "#/$defs/"


def inline_top_ref(schema: dict[str, Any]) -> dict[str, Any]:
    """*schema* with a top-level ``$ref`` into its own ``$defs`` replaced by what it names.

    A recursive pydantic model's schema is ``{"$defs": {"Node": {...}}, "$ref": "#/$defs/Node"}``:
    no top-level ``type`` or ``properties``, which providers want for a tool's parameters, and
    from which the default signature field is found. The definition's keywords move to the top;
    ``$defs`` stays, for the references inside it (the recursion). Anything else is returned as
    it is: a reference elsewhere, or a top-level keyword that the definition also sets otherwise
    (merging them would change what the schema means).
    """
    ref = schema.get("$ref")
    defs = schema.get("$defs")
    if not isinstance(ref, str) or not ref.startswith(_DEFS_PREFIX) or not isinstance(defs, dict):
        return schema
    # One JSON Pointer segment, unescaped (RFC 6901: "~1" is "/", "~0" is "~").
    name = ref[len(_DEFS_PREFIX) :]
    if "/" in name:
        return schema
    target = defs.get(name.replace("~1", "/").replace("~0", "~"))
    if not isinstance(target, dict) or "$ref" in target:
        return schema
    inlined = dict(target)
    for key, value in schema.items():
        if key == "$ref":
            continue
        if key in inlined and inlined[key] != value:
            return schema
        inlined[key] = value
    return inlined


def is_input_class(cls: object) -> bool:
    """An attrs class or a dataclass (whose schema this module can write)."""
    return isinstance(cls, type) and (attrs.has(cls) or dataclasses.is_dataclass(cls))


def schema_for_class(cls: type) -> dict[str, Any]:
    """The JSON Schema of an attrs class or a dataclass: fields become properties, fields without a
    default are required.

    A field's ``metadata={"description": ...}`` becomes its description; unknown
    properties are rejected (``additionalProperties: false``).
    """
    if not is_input_class(cls):
        raise ToolDefinitionError(f"input type {safe_repr(cls)} is not an attrs class or a dataclass")
    schema = _object_schema(cls, seen=())
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    return schema


schema_for_attrs_class = schema_for_class  # the earlier name


def _object_schema(cls: type, seen: tuple[type, ...]) -> dict[str, Any]:
    if cls in seen:
        raise ToolDefinitionError(f"input type {cls.__qualname__} is recursive; give input_schema directly")
    try:
        hints = typing.get_type_hints(cls)
    except Exception as exc:  # unresolvable forward references
        raise ToolDefinitionError(f"cannot resolve the annotations of {cls.__qualname__}: {exc}") from exc
    properties: dict[str, Any] = {}
    required: list[str] = []
    for name, annotation, has_default, description in _fields(cls, hints):
        if annotation is None:
            raise ToolDefinitionError(f"{cls.__qualname__}.{name} has no type annotation")
        prop = _type_schema(annotation, (*seen, cls), where=f"{cls.__qualname__}.{name}")
        if description:
            prop = {**prop, "description": str(description)}
        properties[name] = prop
        if not has_default:
            required.append(name)
    schema: dict[str, Any] = {"type": "object", "properties": properties, "additionalProperties": False}
    if required:
        schema["required"] = required
    doc = cls.__doc__
    if doc and not doc.startswith(cls.__name__ + "("):  # skip attrs' generated signature docs
        schema["description"] = doc.strip()
    return schema


def _fields(cls: type, hints: Mapping[str, Any]) -> list[tuple[str, Any, bool, object]]:
    """(input name, annotation, has a default, description) of each field that is part of the input."""
    if attrs.has(cls):
        return [
            (field.alias or field.name, hints.get(field.name, field.type), field.default is not attrs.NOTHING,
             field.metadata.get("description"))
            for field in attrs.fields(cls)
            if field.init  # not part of the input: cattrs would reject it as an extra key
        ]  # fmt: skip
    return [
        (field.name, hints.get(field.name, field.type),
         field.default is not dataclasses.MISSING or field.default_factory is not dataclasses.MISSING,
         field.metadata.get("description"))
        for field in dataclasses.fields(cls)
        if field.init
    ]  # fmt: skip


def _type_schema(annotation: Any, seen: tuple[type, ...], where: str) -> dict[str, Any]:
    if annotation in _SCALARS:
        return dict(_SCALARS[annotation])
    if annotation is Any:
        return {}
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin in (Union, types.UnionType):
        any_of = [_type_schema(arg, seen, where) for arg in args]
        union_members(annotation, where=where)  # one the converter can structure, or refused here
        return {"anyOf": any_of}
    if origin is Literal:
        return {"enum": _enum_values(annotation, args, where)}
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return {"enum": _enum_values(annotation, tuple(member.value for member in annotation), where)}
    if is_input_class(annotation):
        return _object_schema(annotation, seen)
    if origin in (list, tuple, set, frozenset, Sequence, typing.Sequence) or annotation in (list, tuple):
        if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
            return {"type": "array", "items": _type_schema(args[0], seen, where)}
        if origin is tuple and args:
            # Exactly len(args) items: without minItems a short array passed the schema and failed
            # only when structured (cattrs' "invalid value"), after the permission stages had run.
            return {
                "type": "array",
                "prefixItems": [_type_schema(arg, seen, where) for arg in args],
                "items": False,
                "minItems": len(args),
                "maxItems": len(args),
            }
        items = _type_schema(args[0], seen, where) if args else {}
        schema: dict[str, Any] = {"type": "array", "items": items}
        if origin in (set, frozenset):
            schema["uniqueItems"] = True
        return schema
    if origin in (dict, Mapping, typing.Mapping) or annotation is dict:
        if args and args[0] is not str:
            raise ToolDefinitionError(f"{where}: JSON object keys must be str, got {safe_repr(args[0])}")
        values = _type_schema(args[1], seen, where) if args else {}
        return {"type": "object", "additionalProperties": values}
    raise ToolDefinitionError(f"{where}: cannot express type {safe_repr(annotation)} in JSON Schema")


# -- structuring -------------------------------------------------------------------

# use_alias: private attrs fields (``_x``) are keyed by their alias (``x``), as in the generated schema.
input_converter = cattrs.Converter(forbid_extra_keys=True, use_alias=True)
"""Turns validated JSON input into an input class instance (`Tool.structure_input`)."""

_NONE = type(None)
# The JSON type of a decoded value (input is JSON: exactly these types).
_VALUE_KINDS: dict[type, str] = {
    _NONE: "null",
    bool: "boolean",
    int: "integer",
    float: "number",
    str: "string",
    list: "array",
    dict: "object",
}
_SCALAR_KINDS: dict[Any, str] = {_NONE: "null", bool: "boolean", int: "integer", float: "number", str: "string"}


def _enum_values(annotation: Any, values: tuple[Any, ...], where: str) -> list[Any]:
    """The values of a ``Literal`` or an ``Enum``, for a schema's ``enum``: JSON scalars (``None``,
    ``bool``, ``int``, finite ``float``, ``str``), exactly. Anything else (a tuple, a list, bytes,
    an enum member inside a ``Literal``) raises `ToolDefinitionError`: the schema would hold no
    JSON, and no input the model sends could ever be structured as that value."""
    for value in values:
        if type(value) not in _SCALAR_KINDS or not is_json(value):
            raise ToolDefinitionError(
                f"{where}: {safe_repr(annotation)} has the value {safe_repr(value)} ({type(value).__name__}); "
                "the values of a Literal or an Enum must be JSON scalars (None, bool, int, float, str)"
            )
    return list(values)


def _member_kinds(member: Any, where: str) -> tuple[str, ...]:
    """The JSON types of the values a union member takes."""
    if member in _SCALAR_KINDS:
        return (_SCALAR_KINDS[member],)
    origin = typing.get_origin(member)
    values: tuple[Any, ...] | None = None
    if origin is Literal:
        values = typing.get_args(member)
    elif isinstance(member, type) and issubclass(member, enum.Enum):
        values = tuple(item.value for item in member)
    if values is not None:
        return tuple(dict.fromkeys(_SCALAR_KINDS[type(value)] for value in _enum_values(member, values, where)))
    if is_input_class(member) or origin in (dict, Mapping, typing.Mapping) or member is dict:
        return ("object",)
    if origin in (list, tuple, set, frozenset, Sequence, typing.Sequence) or member in (list, tuple):
        return ("array",)
    raise ToolDefinitionError(f"{where}: cannot express type {safe_repr(member)} in JSON Schema")


def union_members(union: Any, *, where: str) -> tuple[dict[str, Any], bool]:
    """For each JSON type, the member of *union* that a value of that type is structured as, and
    whether ``Any`` is a member (it takes the values no other member takes, unchanged).

    Raises `ToolDefinitionError` when a JSON type does not say which member a value is: two members
    take it (``list[int] | list[str]``, ``dict[str, int] | Point``, ``Color | str``), except input
    classes that cattrs tells apart by their fields (``A | B``; they share the ``object`` entry as
    ``Union[A, B]``).
    """
    by_kind: dict[str, list[Any]] = {}
    takes_any = False
    for member in typing.get_args(union):
        if member is Any:
            takes_any = True
            continue
        for kind in _member_kinds(member, where):
            by_kind.setdefault(kind, []).append(member)
    members: dict[str, Any] = {}
    for kind, found in by_kind.items():
        if len(found) == 1:
            members[kind] = found[0]
        elif kind == "object" and all(is_input_class(member) for member in found):
            try:
                create_default_dis_func(input_converter, *found)
            except Exception as exc:
                raise ToolDefinitionError(
                    f"{where}: the input classes of {safe_repr(union)} cannot be told apart: {exc}"
                ) from None
            members[kind] = Union[tuple(found)]  # noqa: UP007 (built from a tuple)
        else:
            names = " and ".join(safe_repr(member) for member in found)
            raise ToolDefinitionError(
                f"{where}: in {safe_repr(union)}, a JSON {kind} could be {names}; the input cannot say which "
                "(give input_schema=, or members that differ in JSON type)"
            )
    return members, takes_any


def _needs_union_hook(annotation: Any) -> bool:
    """A union other than input classes and ``None`` (cattrs tells those apart by their fields itself)."""
    if typing.get_origin(annotation) not in (Union, types.UnionType):
        return False
    return not all(member is _NONE or is_input_class(member) for member in typing.get_args(annotation))


def _union_hook(union: Any) -> Callable[[Any, Any], Any]:
    members, takes_any = union_members(union, where=safe_repr(union))
    hooks = {
        kind: (member, None if member is _NONE else input_converter.get_structure_hook(member))
        for kind, member in members.items()
    }
    # JSON Schema's "number" takes integers and its "integer" takes 2.0: so does the structuring.
    if "number" in hooks:
        hooks.setdefault("integer", hooks["number"])

    def structure_union(value: Any, _: Any) -> Any:
        kind = _VALUE_KINDS.get(type(value))
        entry = hooks.get(kind) if kind is not None else None
        if entry is None and kind == "number" and value.is_integer():
            entry = hooks.get("integer")
        if entry is None:
            if takes_any:
                return value
            raise ValueError(f"{safe_repr(value)} is not a {safe_repr(union)}")
        member, hook = entry
        return None if hook is None else hook(value, member)

    return structure_union


input_converter.register_structure_hook_factory(_needs_union_hook, _union_hook)


# A declared Literal value's JSON kind: a bool is only a boolean, an int or a float a number.
_LITERAL_KINDS: dict[type, str] = {_NONE: "null", bool: "boolean", int: "number", float: "number", str: "string"}
_MISSING = object()


def _is_literal(annotation: Any) -> bool:
    return typing.get_origin(annotation) is Literal


def _literal_hook(literal: Any) -> Callable[[Any, Any], Any]:
    """The declared value of *literal* that the JSON value equals, as the schema's ``enum`` compares
    them: a boolean only a ``bool`` value, a number (``1`` or ``1.0``) an ``int`` or ``float`` value
    of the same number, a string a ``str``. cattrs' own hook returns the value it was given once
    Python's ``==`` finds it among the values, so ``1.0`` stayed a float (and ``True`` passed for
    ``1``), a value that is not one of the Literal's."""
    declared: dict[tuple[str, Any], Any] = {}
    for value in typing.get_args(literal):
        kind = _LITERAL_KINDS.get(type(value))
        if kind is not None:  # a definition refuses any other (`_enum_values`)
            declared.setdefault((kind, value), value)

    def structure_literal(value: Any, _: Any) -> Any:
        kind = _LITERAL_KINDS.get(type(value))
        if kind is not None:
            found = declared.get((kind, value), _MISSING)
            if found is not _MISSING:
                return found
        # As cattrs' own hook refuses one (its message names the values).
        raise CattrsError(f"{safe_repr(value)} not in literal {safe_repr(literal)}")

    return structure_literal


input_converter.register_structure_hook_factory(_is_literal, _literal_hook)
