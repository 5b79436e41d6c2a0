"""JSON Schema (draft 2020-12) generated from typed attrs input classes."""

from __future__ import annotations

import enum
import types
import typing
from collections.abc import Mapping, Sequence
from typing import Any, Literal, Union

import attrs

from .._errors import ToolDefinitionError

__all__ = ["SIGNATURE_FIELDS", "default_signature_field", "schema_for_attrs_class"]

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


def schema_for_attrs_class(cls: type) -> dict[str, Any]:
    """The JSON Schema of an attrs class: fields become properties, fields without a default are required.

    A field's ``metadata={"description": ...}`` becomes its description; unknown
    properties are rejected (``additionalProperties: false``).
    """
    if not attrs.has(cls):
        raise ToolDefinitionError(f"input type {cls!r} is not an attrs class")
    schema = _object_schema(cls, seen=())
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    return schema


def _object_schema(cls: type, seen: tuple[type, ...]) -> dict[str, Any]:
    if cls in seen:
        raise ToolDefinitionError(f"input type {cls.__qualname__} is recursive; give input_schema directly")
    try:
        hints = typing.get_type_hints(cls)
    except Exception as exc:  # unresolvable forward references
        raise ToolDefinitionError(f"cannot resolve the annotations of {cls.__qualname__}: {exc}") from exc
    properties: dict[str, Any] = {}
    required: list[str] = []
    for field in attrs.fields(cls):
        if not field.init:  # not part of the input: cattrs would reject it as an extra key
            continue
        annotation = hints.get(field.name, field.type)
        if annotation is None:
            raise ToolDefinitionError(f"{cls.__qualname__}.{field.name} has no type annotation")
        prop = _type_schema(annotation, (*seen, cls), where=f"{cls.__qualname__}.{field.name}")
        description = field.metadata.get("description")
        if description:
            prop = {**prop, "description": str(description)}
        name = field.alias or field.name
        properties[name] = prop
        if field.default is attrs.NOTHING:
            required.append(name)
    schema: dict[str, Any] = {"type": "object", "properties": properties, "additionalProperties": False}
    if required:
        schema["required"] = required
    doc = cls.__doc__
    if doc and not doc.startswith(cls.__name__ + "("):  # skip attrs' generated signature docs
        schema["description"] = doc.strip()
    return schema


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
    if isinstance(annotation, type) and attrs.has(annotation):
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
