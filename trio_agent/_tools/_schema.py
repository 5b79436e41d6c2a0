"""JSON Schema (draft 2020-12) generated from typed input classes: attrs classes and dataclasses.

(Pydantic models bring their own ``model_json_schema()``; plain typed parameters
become an attrs class first, see `_definition.py`.)"""

from __future__ import annotations

import dataclasses
import enum
import types
import typing
from collections.abc import Mapping, Sequence
from typing import Any, Literal, Union

import attrs

from .._errors import ToolDefinitionError

__all__ = [
    "SIGNATURE_FIELDS",
    "default_signature_field",
    "is_input_class",
    "schema_for_attrs_class",
    "schema_for_class",
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
        raise ToolDefinitionError(f"input type {cls!r} is not an attrs class or a dataclass")
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
        return {"anyOf": [_type_schema(arg, seen, where) for arg in args]}
    if origin is Literal:
        return {"enum": list(args)}
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return {"enum": [member.value for member in annotation]}
    if is_input_class(annotation):
        return _object_schema(annotation, seen)
    if origin in (list, tuple, set, frozenset, Sequence, typing.Sequence) or annotation in (list, tuple):
        if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
            return {"type": "array", "items": _type_schema(args[0], seen, where)}
        if origin is tuple and args:
            return {
                "type": "array",
                "prefixItems": [_type_schema(arg, seen, where) for arg in args],
                "items": False,
            }
        items = _type_schema(args[0], seen, where) if args else {}
        schema: dict[str, Any] = {"type": "array", "items": items}
        if origin in (set, frozenset):
            schema["uniqueItems"] = True
        return schema
    if origin in (dict, Mapping, typing.Mapping) or annotation is dict:
        if args and args[0] is not str:
            raise ToolDefinitionError(f"{where}: JSON object keys must be str, got {args[0]!r}")
        values = _type_schema(args[1], seen, where) if args else {}
        return {"type": "object", "additionalProperties": values}
    raise ToolDefinitionError(f"{where}: cannot express type {annotation!r} in JSON Schema")
