"""Tool definitions: name, schema, the side-effect contract and resolved behaviour."""

from __future__ import annotations

import copy
import enum
import functools
import inspect
import itertools
import json
import os
import posixpath
import re
import types
import typing
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Generic, TypeVar, overload

import attrs
import cattrs
import jsonschema_rs

from .._errors import ToolBehaviorError, ToolDefinitionError, ToolInputError
from .._json import is_json, json_problem
from .._util import callable_name, safe_repr
from ._results import JsonObject, ToolResult, describe, json_copy
from ._schema import default_signature_field, inline_top_ref, input_converter, is_input_class, schema_for_class

if TYPE_CHECKING:
    from .._permissions._rules import PermissionResult
    from ._context import ToolContext

__all__ = [
    "BehaviorOverride",
    "InterruptBehavior",
    "SideEffect",
    "Tool",
    "ToolBehavior",
    "ToolKind",
    "define_tool",
]

_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")


def _check_name(name: object) -> str:
    """*name* if it is a tool name, else `ToolDefinitionError`. No ``:`` above all: a permission
    rule's tool name ends at the first one, so ``admin:wipe`` would be matched by ``admin``'s rules."""
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ToolDefinitionError(
            f"invalid tool name {safe_repr(name)}: must be 1-64 characters of letters, digits, '_' or '-'"
        )
    return name


def _valid_name(instance: object, attribute: attrs.Attribute[Any], value: object) -> None:
    _check_name(value)


In = TypeVar("In")
T = TypeVar("T")

SignatureContentFn = Callable[[JsonObject], "str | None"]
"""``signature_content(input) -> str | None``: the part after ``Name:`` in a call's permission signature."""

PermissionCheckFn = Callable[[JsonObject], "PermissionResult | Awaitable[PermissionResult | None] | None"]
"""``check_permissions(input)``, sync or async: `PermissionAllow` / `PermissionDeny` / `PermissionAsk` / ``None``."""


class SideEffect(enum.Enum):
    """What running a tool does to the world, from safest to least safe.

    Recovery relies on it: ``pure`` may simply run again, ``idempotent`` runs
    again with the same idempotency key, ``non_idempotent`` is never re-run
    automatically.
    """

    PURE = "pure"
    IDEMPOTENT = "idempotent"
    NON_IDEMPOTENT = "non_idempotent"

    @property
    def rank(self) -> int:
        return _SIDE_EFFECT_RANK[self]


class ToolKind(enum.Enum):
    """What a tool may touch, from safest to least safe; picks the scheduler bucket."""

    READONLY = "readonly"
    WRITE = "write"
    EXECUTE = "execute"

    @property
    def rank(self) -> int:
        return _KIND_RANK[self]


class InterruptBehavior(enum.Enum):
    """Whether steering (a new user message) interrupts a running call (``cancel``) or waits (``block``).

    A request abort reaches every call either way.
    """

    CANCEL = "cancel"
    BLOCK = "block"


_SIDE_EFFECT_RANK = {SideEffect.PURE: 0, SideEffect.IDEMPOTENT: 1, SideEffect.NON_IDEMPOTENT: 2}
_KIND_RANK = {ToolKind.READONLY: 0, ToolKind.WRITE: 1, ToolKind.EXECUTE: 2}


# The conventional signature fields that hold a file path (`SIGNATURE_FIELDS`).
_PATH_FIELDS = frozenset({"file_path", "path"})


def normal_path(path: str) -> str:
    """*path* as a path rule sees it: ``.`` and ``..`` segments and repeated separators resolved
    lexically (symlinks are not followed: the path policy judges where a path really leads). A
    leading ``//``, which POSIX lets a system read its own way, is one ``/`` here; a trailing
    ``/`` stays (``Read:/etc/ssh/*`` must still match ``/etc/ssh/``)."""
    normal = posixpath.normpath(path)
    if normal.startswith("//"):
        normal = normal[1:]
    return normal + "/" if path.endswith("/") and not normal.endswith("/") else normal


@attrs.frozen
class ToolBehavior:
    """The behaviour of one call, resolved from its input."""

    side_effect: SideEffect
    kind: ToolKind
    interrupt: InterruptBehavior
    concurrency_safe: bool


@attrs.frozen
class BehaviorOverride:
    """What a behaviour resolver returns: ``None`` keeps the static value.

    ``side_effect`` and ``kind`` may only narrow the static declaration (``pure``
    is narrower than ``idempotent``; ``readonly`` than ``write``); ``interrupt``
    and ``concurrency_safe`` may be set freely.
    """

    side_effect: SideEffect | None = None
    kind: ToolKind | None = None
    interrupt: InterruptBehavior | None = None
    concurrency_safe: bool | None = None


def _enum_value(enum_type: type[enum.Enum], value: object, *, where: str) -> Any:
    if isinstance(value, enum_type):
        return value
    try:
        return enum_type(value)
    except Exception:  # the enum's own ValueError formats the value with %r, which may raise anything
        allowed = ", ".join(repr(member.value) for member in enum_type)
        raise ToolDefinitionError(f"{where}: {safe_repr(value)} is not one of {allowed}") from None


# An input's issues: at most this many listed, each at most this long, then "... and <n> more" (the
# rule of a structured answer's, `_chat._listed`). A model's input of 1 MB failing on every item
# had 200,000 of them: a multi-megabyte invalid_input message.
LISTED_ISSUES = 20
ISSUE_CHARS = 300
# Up to this many characters of input (as JSON) every issue is found (then listed up to
# LISTED_ISSUES); beyond it, only the first (validate() stops there): jsonschema_rs builds every
# error eagerly, a Python object each, before the first can be read (seconds of the event loop,
# every session of the process, for such a megabyte).
_LISTED_INPUT = 4096


def input_errors(validator: jsonschema_rs.Validator, value: object) -> tuple[str, ...]:
    """One line per way *value* fails *validator*'s schema (the tools' wording); empty when valid.

    JSON first, for every schema check that reads a Python value (a tool's input, a client
    tool's, an interrupt's payload): the validator reads a set or a tuple as an array and NaN or a
    huge integer as null, so it would pass them (an open schema) or blame the wrong thing, and
    what holds the value later (a journal, a paused run's JSON) fails on it outside the call.

    Bounded, whatever the (untrusted) input: a good one builds no error object (``is_valid``
    first); at most `LISTED_ISSUES` lines, each cut to `ISSUE_CHARS`, then ``"... and <n>
    more"``; an input over `_LISTED_INPUT` characters of JSON is reported by its first issue only.
    """
    if not is_json(value):
        problem = json_problem(value, "the input")
        if problem is not None:
            return listed_issues([f"at <root>: {problem}"], 0)
    try:
        if validator.is_valid(value):  # no error objects for a good input
            return ()
        if _json_length(value) <= _LISTED_INPUT:
            errors = validator.iter_errors(value)
            return listed_issues(
                [schema_issue(error) for error in itertools.islice(errors, LISTED_ISSUES)], sum(1 for _ in errors)
            )
        return listed_issues([first_schema_issue(validator, value)], 0, longer_than=_LISTED_INPUT)
    except ValueError:
        # The validator cannot read a lone surrogate (e.g. a key the model sent as "\ud800", a
        # UnicodeError) or a value JSON cannot hold (a key that is not a string): invalid input
        # the caller can fix, not a crash of whoever validates.
        problem = json_problem(value, "the input")
        return listed_issues([f"at <root>: {problem}"] if problem is not None else _surrogate_errors(value), 0)


def _json_length(value: object) -> int:
    """How many characters *value* is as JSON text (the model's arguments, about); a value that
    cannot be written counts as long (only its first issue is looked for)."""
    try:
        return len(json.dumps(value, ensure_ascii=False))
    except (TypeError, ValueError, RecursionError):
        return _LISTED_INPUT + 1


def schema_issue(error: jsonschema_rs.ValidationError) -> str:
    return f"at {'/'.join(str(part) for part in error.instance_path) or '<root>'}: {error.message}"


def first_schema_issue(validator: jsonschema_rs.Validator, value: object) -> str:
    try:
        validator.validate(value)
    except jsonschema_rs.ValidationError as error:
        return schema_issue(error)
    return "at <root>: the schema does not accept it"  # pragma: no cover - is_valid said no


def listed_issues(
    issues: Sequence[str], more: int, *, longer_than: int | None = None, of: str = "an input"
) -> tuple[str, ...]:
    """*issues* (at most `LISTED_ISSUES`), each cut to `ISSUE_CHARS`; a last line says how many
    *more* there were or, for *of* (a tool's input, a structured answer) *longer_than* the length
    up to which every issue is looked for (only its first was), that there may be more."""
    listed = [
        issue if len(issue) <= ISSUE_CHARS else f"{issue[:ISSUE_CHARS]}... ({len(issue)} characters)"
        for issue in issues[:LISTED_ISSUES]
    ]
    more += len(issues) - len(listed)
    if more:
        listed.append(f"... and {more} more")
    elif longer_than is not None:
        listed.append(f"... and maybe more: only the first is looked for in {of} over {longer_than} characters")
    return tuple(listed)


_SCALAR_TYPES = frozenset({"string", "integer", "number", "boolean", "null"})
_SCALARS = (str, int, float, bool, type(None))


def _only_scalars(schema: object) -> bool:
    """Whether every value *schema* accepts is a JSON scalar (no object, no array). Conservative:
    ``False`` for whatever it does not recognise (a ``$ref``, ``allOf``, no ``type``)."""
    if not isinstance(schema, dict):
        return False
    if "enum" in schema:
        values = schema["enum"]
        return isinstance(values, list) and all(isinstance(value, _SCALARS) for value in values)
    if "const" in schema:
        return isinstance(schema["const"], _SCALARS)
    kind = schema.get("type")
    if isinstance(kind, str):
        return kind in _SCALAR_TYPES
    if isinstance(kind, list):
        return all(item in _SCALAR_TYPES for item in kind)
    for key in ("anyOf", "oneOf"):
        if key in schema:
            options = schema[key]
            return isinstance(options, list) and all(_only_scalars(option) for option in options)
    return False


def _flat_input(schema: JsonObject) -> bool:
    """Whether an input *schema* admits only objects whose values are JSON scalars: then an input
    class made from such an input can share no container with it."""
    properties = schema.get("properties", {})
    return (
        schema.get("additionalProperties") is False
        and isinstance(properties, dict)
        and all(_only_scalars(property) for property in properties.values())
    )


def _is_surrogate_free(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _surrogate_errors(value: object) -> tuple[str, ...]:
    """One line per key or string holding a lone surrogate (never empty: the caller saw one fail)."""
    return surrogate_errors(value) or ("at <root>: the input is not valid Unicode (a lone surrogate)",)


def surrogate_errors(value: object) -> tuple[str, ...]:
    """One line per key or string of *value* (JSON) holding a lone surrogate; empty when none does.

    Such text is shown escaped (``'\\ud800'``), so the message itself encodes.
    """
    lines: list[str] = []

    def walk(item: object, path: tuple[str, ...]) -> None:
        where = "/".join(path) or "<root>"
        if isinstance(item, dict):
            for key, child in item.items():
                name = str(key)
                if not _is_surrogate_free(name):
                    lines.append(f"at {where}: key {name!r} is not valid Unicode (a lone surrogate)")
                    name = repr(name)
                walk(child, (*path, name))
        elif isinstance(item, (list, tuple)):
            for index, child in enumerate(item):
                walk(child, (*path, str(index)))
        elif isinstance(item, str) and not _is_surrogate_free(item):
            lines.append(f"at {where}: string {item!r} is not valid Unicode (a lone surrogate)")

    walk(value, ())
    return tuple(lines)


def _structure_problem(exc: Exception) -> str:
    """What the input class's structuring (cattrs, or a pydantic model's own validators: the tool's
    code) refused, for the model; never raises (`describe`)."""
    if isinstance(exc, cattrs.BaseValidationError):
        try:
            return "; ".join(cattrs.transform_error(exc))
        except Exception:  # it formats the leaves' messages: the tool's own exceptions
            pass
    return describe(exc, "text")


def _takes_fencing_token(fn: Callable[..., Any]) -> bool:
    try:
        parameters = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return "fencing_token" in parameters or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())


@attrs.frozen(eq=False)
class Tool(Generic[In]):
    """A tool the model can call. Build one with `define_tool`.

    ``run(input, ctx)`` receives the validated input (an instance of ``input_type``
    when the tool was defined from a typed attrs class, else the JSON object), streams
    items with ``await ctx.emit(item)`` and returns a `ToolResult` (any other return
    value becomes a success with that value as output). A result that is not JSON fails
    its call (``invalid_result``).
    """

    # Checked however the tool is built (`Tool(...)`, `attrs.evolve`), not only by `define_tool`.
    name: str = attrs.field(validator=_valid_name)
    description: str
    input_schema: JsonObject
    side_effect: SideEffect
    kind: ToolKind
    interrupt: InterruptBehavior
    concurrency_safe: bool
    run: Callable[[In, ToolContext], Awaitable[Any]] = attrs.field(repr=False)
    input_type: type[In] | None = attrs.field(default=None, repr=False)
    resolver: Callable[[JsonObject], BehaviorOverride | None] | None = attrs.field(default=None, repr=False)
    affected_paths: Callable[[JsonObject], Sequence[str]] | None = attrs.field(default=None, repr=False)
    reconcile: Callable[[JsonObject, str], Awaitable[ToolResult | None]] | None = attrs.field(default=None, repr=False)
    timeout: float | None = None
    signature_content: SignatureContentFn | None = attrs.field(default=None, repr=False)
    check_permissions: PermissionCheckFn | None = attrs.field(default=None, repr=False)
    _validator: jsonschema_rs.Validator = attrs.field(init=False, repr=False)
    _static: ToolBehavior = attrs.field(init=False, repr=False)
    _signature_field: str | None = attrs.field(init=False, repr=False)
    # How `structure_input` turns JSON into an ``input_type`` instance: found on first use (not when a
    # module defines its tools), then every call skips the converter's dispatch.
    _structure: Callable[[JsonObject, Any], Any] | None = attrs.field(default=None, init=False, repr=False)
    # Whether `structure_input` needs a copy of the input (`input_copy`): an input class keeps what its
    # fields hold (a dict or list under ``Any``), which is the journal's record of the call's final input.
    _shares_input: bool = attrs.field(default=False, init=False, repr=False)
    # Whether a call waits for and holds a scheduler slot of its kind: not a built-in control tool's
    # (`unscheduled`).
    _takes_slot: bool = attrs.field(default=True, init=False, repr=False)

    def __attrs_post_init__(self) -> None:
        try:
            # offline: a tool definition never fetches remote $refs over the network.
            validator = jsonschema_rs.Draft202012Validator(self.input_schema, offline=True)
        except (jsonschema_rs.ValidationError, jsonschema_rs.ReferencingError, ValueError) as exc:
            first = str(exc).splitlines()[0]
            raise ToolDefinitionError(f"tool {self.name!r}: input_schema is not valid JSON Schema: {first}") from None
        object.__setattr__(self, "_validator", validator)
        static = ToolBehavior(self.side_effect, self.kind, self.interrupt, self.concurrency_safe)
        object.__setattr__(self, "_static", static)
        field = None if self.signature_content is not None else default_signature_field(self.input_schema)
        object.__setattr__(self, "_signature_field", field)
        shares = self.input_type is not None and not _flat_input(self.input_schema)
        object.__setattr__(self, "_shares_input", shares)

    @property
    def behavior(self) -> ToolBehavior:
        """The static (most conservative) behaviour."""
        return self._static

    @property
    def signature_field(self) -> str | None:
        """The input field whose value is the signature content when no ``signature_content`` is given.

        The first of ``command``, ``file_path``, ``path``, ``url`` that the input
        schema declares as a top-level ``"type": "string"`` property; ``None``
        when it declares none (or ``signature_content`` is given).
        """
        return self._signature_field

    @property
    def has_signature_content(self) -> bool:
        """Whether calls of this tool can have signature content (so ``Name:content`` rules can match them)."""
        return self.signature_content is not None or self._signature_field is not None

    def signature_content_for(self, value: JsonObject) -> str | None:
        """The content of a call's permission signature ``Name:content`` (``None``: just ``Name``).

        ``signature_content(value)`` when given, else the value of `signature_field`
        with surrounding whitespace stripped (so ``"  rm -rf x"`` still matches
        ``Bash:rm *``); a path field (``file_path``, ``path``) is also normalised
        lexically (`normal_path`), so ``/home/u//.ssh/k`` or ``/home/x/../u/.ssh/k``
        is matched as ``/home/u/.ssh/k``. Raises `TypeError` if ``signature_content``
        returns something other than a string or ``None``, and what it raises.
        """
        fn = self.signature_content
        if fn is not None:
            content: object = fn(value)
        elif self._signature_field is not None:
            field = self._signature_field
            raw = value.get(field) if isinstance(value, dict) else None
            content = raw.strip() if isinstance(raw, str) else None
            if content and field in _PATH_FIELDS:
                content = normal_path(content)
        else:
            return None
        if content is None:
            return None
        if not isinstance(content, str):
            raise TypeError(f"signature content must be a string or None, got {safe_repr(content)}")
        return content or None

    def _valid(self, value: object, json_checked: bool = False) -> bool:
        """Whether *value* is JSON (unless the caller has checked that: *json_checked*) and satisfies
        the schema. JSON first: the validator reads a set or a tuple as an array and NaN or a huge
        integer as null, so it would pass them (an open schema) or blame the wrong thing."""
        if not json_checked and not is_json(value) and json_problem(value, "the input") is not None:
            return False
        try:
            return self._validator.is_valid(value)
        except ValueError:  # a lone surrogate, a key that is not a string ...: invalid input
            return False

    def input_errors(self, value: object) -> tuple[str, ...]:
        """One readable line per schema violation of *value*; empty when valid.

        A value that is no JSON (a set, a tuple, bytes, NaN, a key that is not a string ...) is
        reported as that, before any schema check; a key or string holding a lone surrogate (not
        valid Unicode) is reported as a violation too, wherever the validator would otherwise
        fail on it.
        """
        return self._input_errors(value)

    def _input_errors(self, value: object, json_checked: bool = False) -> tuple[str, ...]:
        if self._valid(value, json_checked):
            return ()
        return input_errors(self._validator, value)  # says first if it is no JSON

    def validate_input(self, value: object) -> None:
        """Raise `ToolInputError` naming every violation unless *value* satisfies the schema."""
        errors = self.input_errors(value)
        if errors:
            raise ToolInputError(
                f"invalid input for tool {self.name!r}: " + "; ".join(errors), tool_name=self.name, errors=errors
            )

    def structure_input(self, value: JsonObject) -> In:
        """Turn validated JSON input into what ``run`` receives."""
        input_type = self.input_type
        if input_type is None:
            return typing.cast(In, value)
        structure = self._structure
        if structure is None:
            if _is_pydantic_model(input_type):
                structure = _structure_pydantic
            else:
                structure = input_converter.get_structure_hook(input_type)
            object.__setattr__(self, "_structure", structure)
        try:
            structured: In = structure(value, input_type)  # not `typing.cast`: a call per tool call
        except Exception as exc:
            detail = _structure_problem(exc)
            raise ToolInputError(
                f"invalid input for tool {self.name!r}: {detail}", tool_name=self.name, errors=(detail,)
            ) from None
        return structured

    def resolve_behavior(self, value: JsonObject) -> ToolBehavior:
        """Resolve this call's behaviour from *value*.

        Input that fails the schema gets the static behaviour (the resolver only
        sees valid input). Raises `ToolBehaviorError` if the resolver raises,
        returns something other than a `BehaviorOverride` or ``None``, or widens
        the side effect or kind past the static declaration.
        """
        return self._resolve_behavior(value)

    def _resolve_behavior(self, value: JsonObject, json_checked: bool = False) -> ToolBehavior:
        resolver = self.resolver
        if resolver is None or not self._valid(value, json_checked):
            return self._static
        try:
            override = resolver(json_copy(value))  # a copy: the callable cannot change the call's input
        except Exception as exc:
            raise ToolBehaviorError(f"tool {self.name!r}: behaviour resolver raised {describe(exc, 'repr')}") from exc
        if override is None:
            return self._static
        if not isinstance(override, BehaviorOverride):
            raise ToolBehaviorError(
                f"tool {self.name!r}: behaviour resolver must return BehaviorOverride or None, "
                f"got {safe_repr(override)}"
            )
        static = self._static
        side_effect = self._resolved("side_effect", static.side_effect, override.side_effect, SideEffect, narrow=True)
        kind = self._resolved("kind", static.kind, override.kind, ToolKind, narrow=True)
        interrupt = self._resolved("interrupt", static.interrupt, override.interrupt, InterruptBehavior)
        concurrency_safe = self._resolved("concurrency_safe", static.concurrency_safe, override.concurrency_safe, bool)
        return ToolBehavior(side_effect, kind, interrupt, concurrency_safe)

    def _resolved(self, field: str, static: T, resolved: object, expected: type[T], *, narrow: bool = False) -> T:
        """The resolver's value for *field*, checked against its type and, for ranked enums, the static one."""
        if resolved is None:
            return static
        if not isinstance(resolved, expected):
            raise ToolBehaviorError(
                f"tool {self.name!r}: resolved {field} {safe_repr(resolved)} is not a {expected.__name__}"
            )
        if narrow and resolved.rank > static.rank:  # type: ignore[attr-defined]
            raise ToolBehaviorError(
                f"tool {self.name!r}: resolver widened {field} from {static.value!r} "  # type: ignore[attr-defined]
                f"to {resolved.value!r}; it may only narrow the static declaration"  # type: ignore[attr-defined]
            )
        return resolved

    async def run_reconcile(
        self, value: JsonObject, idempotency_key: str, *, fencing_token: int | None
    ) -> ToolResult | None:
        """Ask the tool's ``reconcile`` whether a started call's effect happened.

        ``fencing_token`` is the new owner's lease token: a reconciler that can should
        raise its downstream's floor to it, so a paused old owner's late write is refused.
        Reconcilers written as ``reconcile(input, idempotency_key)`` keep working.
        """
        reconcile = self.reconcile
        assert reconcile is not None
        if _takes_fencing_token(reconcile):
            return await reconcile(value, idempotency_key, fencing_token=fencing_token)  # type: ignore[call-arg]
        return await reconcile(value, idempotency_key)

    def paths_for(self, value: JsonObject) -> tuple[str, ...]:
        """The paths this call touches (for file locks and the path policy).

        Each item must be a `str` or an `os.PathLike` of one; anything else raises `TypeError`
        naming it (``str()`` of a list or an object would lock and check a path no one uses).
        """
        if self.affected_paths is None:
            return ()
        paths = self.affected_paths(json_copy(value))  # a copy: the callable cannot change the call's input
        if isinstance(paths, str):
            return (paths,)
        items: Iterable[object] = (paths,) if isinstance(paths, os.PathLike) else paths
        found: list[str] = []
        for path in items:
            if type(path) is not str:
                path = _path_item(self.name, path)
            found.append(path)
        return tuple(found)


def _path_item(tool: str, item: object) -> str:
    """*item* of tool *tool*'s affected paths as a `str`, or `TypeError` naming it."""
    if isinstance(item, str):
        return str.__str__(item)  # a subclass's own formatting is the tool's code
    if isinstance(item, os.PathLike):
        path = os.fspath(item)
        if isinstance(path, str):
            return path
    raise TypeError(
        f"affected_paths of tool {tool!r} gave {safe_repr(item)}; each path must be a str or an os.PathLike of one"
    )


class _Missing(enum.Enum):
    MISSING = enum.auto()


_MISSING = _Missing.MISSING

RunFn = Callable[[Any, "ToolContext"], Awaitable[Any]]


@overload
def define_tool(
    run: RunFn,
    /,
    *,
    name: str | None = None,
    description: str | None = None,
    side_effect: SideEffect | str | _Missing = _MISSING,
    kind: ToolKind | str = ToolKind.EXECUTE,
    input_schema: JsonObject | None = None,
    input_type: type | None = None,
    interrupt: InterruptBehavior | str = InterruptBehavior.BLOCK,
    concurrency_safe: bool | None = None,
    resolve_behavior: Callable[[JsonObject], BehaviorOverride | None] | None = None,
    affected_paths: Callable[[JsonObject], Sequence[str]] | None = None,
    reconcile: Callable[[JsonObject, str], Awaitable[ToolResult | None]] | None = None,
    timeout: float | None = None,
    signature_content: SignatureContentFn | None = None,
    check_permissions: PermissionCheckFn | None = None,
) -> Tool[Any]: ...


@overload
def define_tool(
    run: None = None,
    /,
    *,
    name: str | None = None,
    description: str | None = None,
    side_effect: SideEffect | str | _Missing = _MISSING,
    kind: ToolKind | str = ToolKind.EXECUTE,
    input_schema: JsonObject | None = None,
    input_type: type | None = None,
    interrupt: InterruptBehavior | str = InterruptBehavior.BLOCK,
    concurrency_safe: bool | None = None,
    resolve_behavior: Callable[[JsonObject], BehaviorOverride | None] | None = None,
    affected_paths: Callable[[JsonObject], Sequence[str]] | None = None,
    reconcile: Callable[[JsonObject, str], Awaitable[ToolResult | None]] | None = None,
    timeout: float | None = None,
    signature_content: SignatureContentFn | None = None,
    check_permissions: PermissionCheckFn | None = None,
) -> Callable[[RunFn], Tool[Any]]: ...


def define_tool(
    run: RunFn | None = None,
    /,
    *,
    name: str | None = None,
    description: str | None = None,
    side_effect: SideEffect | str | _Missing = _MISSING,
    kind: ToolKind | str = ToolKind.EXECUTE,
    input_schema: JsonObject | None = None,
    input_type: type | None = None,
    interrupt: InterruptBehavior | str = InterruptBehavior.BLOCK,
    concurrency_safe: bool | None = None,
    resolve_behavior: Callable[[JsonObject], BehaviorOverride | None] | None = None,
    affected_paths: Callable[[JsonObject], Sequence[str]] | None = None,
    reconcile: Callable[[JsonObject, str], Awaitable[ToolResult | None]] | None = None,
    timeout: float | None = None,
    signature_content: SignatureContentFn | None = None,
    check_permissions: PermissionCheckFn | None = None,
) -> Tool[Any] | Callable[[RunFn], Tool[Any]]:
    """Define a tool; use directly or as a decorator on ``async def run(input, ctx)``.

    ``side_effect`` is required: it is the contract recovery relies on. The input
    schema is given directly (JSON Schema 2020-12, top-level ``"type": "object"``)
    or generated from a typed attrs class, passed as ``input_type`` or found as the
    annotation of ``run``'s first parameter; such input is structured with cattrs
    before ``run`` sees it. ``kind`` defaults to the most conservative ``execute``.

    Permissions (see docs/permissions.md):

    * ``signature_content(input) -> str | None`` gives the ``content`` of the call's
      signature ``Name:content``, which ``Name:content`` / ``Name:prefix*`` rules
      match. Without it the content is the value of the first of ``command``,
      ``file_path``, ``path``, ``url`` the schema declares as a ``"type": "string"``
      property (stripped), or none.
    * ``check_permissions(input)``, sync or async, is the tool's own check: return
      ``PermissionDeny(message)`` (final: nobody is asked), ``PermissionAsk(message)``
      (always ask, in every mode), ``PermissionAllow(updated_input=...)`` (no objection,
      optionally normalised input) or ``None`` (no objection).
    """

    def build(fn: RunFn) -> Tool[Any]:
        return _build_tool(
            fn,
            name=name,
            description=description,
            side_effect=side_effect,
            kind=kind,
            input_schema=input_schema,
            input_type=input_type,
            interrupt=interrupt,
            concurrency_safe=concurrency_safe,
            resolve_behavior=resolve_behavior,
            affected_paths=affected_paths,
            reconcile=reconcile,
            timeout=timeout,
            signature_content=signature_content,
            check_permissions=check_permissions,
        )

    if run is None:
        return build
    return build(run)


def _build_tool(
    run: RunFn,
    *,
    name: str | None,
    description: str | None,
    side_effect: SideEffect | str | _Missing,
    kind: ToolKind | str,
    input_schema: JsonObject | None,
    input_type: type | None,
    interrupt: InterruptBehavior | str,
    concurrency_safe: bool | None,
    resolve_behavior: Callable[[JsonObject], BehaviorOverride | None] | None,
    affected_paths: Callable[[JsonObject], Sequence[str]] | None,
    reconcile: Callable[[JsonObject, str], Awaitable[ToolResult | None]] | None,
    timeout: float | None,
    signature_content: SignatureContentFn | None = None,
    check_permissions: PermissionCheckFn | None = None,
) -> Tool[Any]:
    if not callable(run):
        raise ToolDefinitionError(f"tool run must be an async function, got {safe_repr(run)}")
    function = _unwrap_partial(run)  # a partial is named and described by the function it wraps
    tool_name = _check_name(name if name is not None else getattr(function, "__name__", None))
    if not inspect.iscoroutinefunction(run) and not inspect.iscoroutinefunction(type(run).__call__):
        raise ToolDefinitionError(f"tool {tool_name!r}: run must be an `async def run(input, ctx)` function")
    if side_effect is _MISSING:
        raise ToolDefinitionError(
            f"tool {tool_name!r} has no side-effect contract: declare side_effect='pure', "
            "'idempotent' or 'non_idempotent' (recovery depends on it)"
        )
    effect = _enum_value(SideEffect, side_effect, where=f"tool {tool_name!r}: side_effect")
    tool_kind = _enum_value(ToolKind, kind, where=f"tool {tool_name!r}: kind")
    interrupt_behavior = _enum_value(InterruptBehavior, interrupt, where=f"tool {tool_name!r}: interrupt")
    text = description
    if text is None:
        # A callable object is described by its class's docstring, else its `__call__`'s.
        text = inspect.getdoc(function) or inspect.getdoc(_annotated_function(run))
    elif not isinstance(text, str):  # bytes would pass .strip() and reach the model as "b'...'"
        raise ToolDefinitionError(
            f"tool {tool_name!r}: description must be a string, got {type(text).__name__} {safe_repr(text, 80)}"
        )
    if not text or not text.strip():
        raise ToolDefinitionError(f"tool {tool_name!r} has no description (pass description= or a docstring)")

    from_parameters = False
    if input_type is None and input_schema is None:
        input_type = _annotated_input_type(run)
        if input_type is None:
            # `async def weather(city: str, units: str = "c", ctx=None)`: the parameters are the input.
            input_type, run = _signature_input(run, tool_name)
            from_parameters = True
    if not from_parameters:
        # `async def run(input, ctx)`: the whole input is the first parameter.
        run = _input_and_context(run, tool_name)
    if input_type is not None:
        if input_schema is not None:
            raise ToolDefinitionError(f"tool {tool_name!r}: give input_schema or input_type, not both")
        try:
            schema = _input_class_schema(input_type)
        except ToolDefinitionError as exc:
            raise ToolDefinitionError(f"tool {tool_name!r}: {exc}") from None
    else:
        assert input_schema is not None
        if not isinstance(input_schema, dict):
            raise ToolDefinitionError(
                f"tool {tool_name!r}: input_schema must be a dict, got {type(input_schema).__name__}"
            )
        # Our own copy: the caller's dict (a base schema reused for the next tool, say) may change
        # later, and what the model is offered must stay what the validator was compiled from.
        schema = copy.deepcopy(input_schema)
    if schema.get("type") != "object":
        raise ToolDefinitionError(
            f'tool {tool_name!r}: input_schema must describe an object ("type": "object"), '
            f"got {safe_repr(schema.get('type'))}"
        )
    if reconcile is not None and effect is not SideEffect.NON_IDEMPOTENT:
        raise ToolDefinitionError(
            f"tool {tool_name!r}: reconcile is only for non_idempotent tools (this one is {effect.value!r})"
        )
    for label, fn in (
        ("resolve_behavior", resolve_behavior),
        ("affected_paths", affected_paths),
        ("reconcile", reconcile),
        ("signature_content", signature_content),
        ("check_permissions", check_permissions),
    ):
        if fn is not None and not callable(fn):
            raise ToolDefinitionError(f"tool {tool_name!r}: {label} must be callable, got {safe_repr(fn)}")
    if timeout is not None:
        from .._config import validate_timeout

        timeout = validate_timeout(timeout, name=f"tool {tool_name!r} timeout")
    safe = tool_kind is ToolKind.READONLY if concurrency_safe is None else bool(concurrency_safe)
    return Tool(
        name=tool_name,
        description=text.strip(),
        input_schema=schema,
        side_effect=effect,
        kind=tool_kind,
        interrupt=interrupt_behavior,
        concurrency_safe=safe,
        run=run,
        input_type=input_type,
        resolver=resolve_behavior,
        affected_paths=affected_paths,
        reconcile=reconcile,
        timeout=timeout,
        signature_content=signature_content,
        check_permissions=check_permissions,
    )


def unscheduled(tool: Tool[In]) -> Tool[In]:
    """*tool*, whose calls take no scheduler slot (internal: for the built-in ``task`` and
    ``task_output`` only, not a knob for applications).

    Those tools start, wait for or look at other agents' work and hold no resource a slot stands
    for. Drawing from the bucket of their kind, they could be kept waiting for ever by the very work
    they control: background subagents whose long calls hold every slot of it. Returns *tool*.
    """
    object.__setattr__(tool, "_takes_slot", False)
    return tool


def _structure_pydantic(value: JsonObject, cls: Any) -> Any:
    return cls.model_validate(value)


def _is_pydantic_model(cls: object) -> bool:
    return isinstance(cls, type) and hasattr(cls, "model_json_schema") and hasattr(cls, "model_validate")


def _input_class_schema(cls: type) -> dict[str, Any]:
    if _is_pydantic_model(cls):
        # A recursive model's schema is a top-level $ref into $defs: inlined, so the top level says
        # what the input is (its properties, for the model and the default signature field).
        schema: dict[str, Any] = inline_top_ref(cls.model_json_schema())  # type: ignore[attr-defined]
        schema.setdefault("type", "object")
        return schema
    return schema_for_class(cls)


_CONTEXT_PARAMETER = "ctx"


def _signature_input(run: RunFn, tool_name: str) -> tuple[type, RunFn]:
    """An input class made from ``run``'s typed parameters (all but ``ctx``), and a ``run(input, ctx)``
    that calls it with them as keyword arguments."""
    try:
        hints = typing.get_type_hints(_annotated_function(run))
    except Exception as exc:
        raise ToolDefinitionError(
            f"tool {tool_name!r}: cannot resolve the annotations of its parameters ({describe(exc, 'repr')})"
        ) from None
    fields: dict[str, Any] = {}
    context: str | None = None  # the name of the parameter that takes the context, if any
    # What a partial binds is the application's choice, not the model's: never an input field
    # (a model sending it is refused by the schema, as any unknown key).
    bound = frozenset(run.keywords) if isinstance(run, functools.partial) else frozenset()
    for parameter in inspect.signature(run).parameters.values():
        if parameter.name in bound:
            continue
        annotation = hints.get(parameter.name)
        if parameter.name == _CONTEXT_PARAMETER or _is_context_annotation(annotation):
            if context is not None:
                raise ToolDefinitionError(
                    f"tool {tool_name!r}: parameters {context!r} and {parameter.name!r} both take the context; keep one"
                )
            context = parameter.name
            continue
        if parameter.kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD):
            raise ToolDefinitionError(f"tool {tool_name!r}: *{parameter.name} cannot be a tool input; name each one")
        if parameter.kind is inspect.Parameter.POSITIONAL_ONLY:
            raise ToolDefinitionError(f"tool {tool_name!r}: parameter {parameter.name!r} must not be positional-only")
        if annotation is None:
            raise ToolDefinitionError(
                f"tool {tool_name!r} has no input schema: annotate parameter {parameter.name!r} with its type "
                "(e.g. `city: str`), or pass input_schema= (JSON Schema) or input_type= (an attrs class, a "
                "dataclass or a pydantic model)"
            )
        default = attrs.NOTHING if parameter.default is inspect.Parameter.empty else parameter.default
        fields[parameter.name] = attrs.field(type=annotation, default=default)
    if len(fields) == 1:
        (only,) = fields.values()
        if only.type is dict or typing.get_origin(only.type) in (dict, Mapping, typing.Mapping):
            # `run(input: dict, ctx)` means the raw JSON input, whose shape only a schema can say.
            raise ToolDefinitionError(
                f"tool {tool_name!r} has no input schema: its input is a plain dict, so pass input_schema= "
                "(JSON Schema), or give typed parameters (`city: str`) or an input class"
            )
    input_class = attrs.make_class(f"{tool_name}_input", fields, kw_only=True, frozen=True)
    input_class.__doc__ = None
    names = tuple(fields)

    async def run_with_parameters(value: Any, ctx: ToolContext) -> Any:
        arguments = {name: getattr(value, name) for name in names}
        if context is not None:
            arguments[context] = ctx  # under its own name: `context: ToolContext` is one too
        call: Callable[..., Awaitable[Any]] = run
        return await call(**arguments)

    run_with_parameters.__name__ = getattr(run, "__name__", tool_name)
    run_with_parameters.__doc__ = run.__doc__
    run_with_parameters.__wrapped__ = run  # type: ignore[attr-defined]
    return input_class, run_with_parameters


def _is_context_annotation(annotation: Any) -> bool:
    """Whether *annotation* says the parameter takes the context: ``ToolContext``, or ``ToolContext |
    None`` (``Optional[ToolContext]``, for a ``run`` also called outside a pipeline). The one rule for
    a signature's parameters and for ``run(input, ctx)``'s."""
    from ._context import ToolContext

    if annotation is ToolContext:
        return True
    if typing.get_origin(annotation) not in (typing.Union, types.UnionType):
        return False
    members = typing.get_args(annotation)
    return ToolContext in members and all(member is ToolContext or member is type(None) for member in members)


def _is_context(parameter: inspect.Parameter, annotation: Any, position: int) -> bool:
    """Whether *parameter*, after the input, takes the context: it is named ``ctx`` or annotated
    ``ToolContext``, or it is the second positional one (``run(input, ctx)``) and says nothing else
    (no annotation, one that cannot be resolved, ``Any``, ``object``)."""
    if parameter.name == _CONTEXT_PARAMETER or _is_context_annotation(annotation):
        return True
    positional = parameter.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return positional and position == 1 and (annotation is None or annotation is Any or annotation is object)


def _input_and_context(run: RunFn, tool_name: str) -> RunFn:
    """``run`` checked to take the input first and, at most, the context: what is called as
    ``run(input, ctx)``, adapted when it takes no context or takes it by keyword.

    Other parameters are never given: one with a default keeps it (``kind: str = kind``, a loop's
    value bound); one without raises `ToolDefinitionError` (``async def search(q: Query, limit:
    int, ctx)``: ``limit`` would be missing from every call, and is no part of the schema).
    """
    try:
        parameters = list(inspect.signature(run).parameters.values())
    except (TypeError, ValueError):  # no signature to read (a builtin): called as it is
        return run
    if any(parameter.kind is inspect.Parameter.VAR_POSITIONAL for parameter in parameters[:2]):
        return run  # `run(*args)`, `run(input, *args)`: takes both
    if not parameters or parameters[0].kind not in (
        inspect.Parameter.POSITIONAL_ONLY,
        inspect.Parameter.POSITIONAL_OR_KEYWORD,
    ):
        raise ToolDefinitionError(
            f"tool {tool_name!r}: run must take the input as its first positional parameter: "
            "`async def run(input, ctx)`"
        )
    try:
        hints = typing.get_type_hints(_annotated_function(run))
    except Exception:  # a name only a type checker knows: judged by the names and positions alone
        hints = {}
    context: inspect.Parameter | None = None
    for position, parameter in enumerate(parameters[1:], start=1):
        if parameter.kind is inspect.Parameter.VAR_KEYWORD:
            continue
        annotation = hints.get(parameter.name)
        if context is None and _is_context(parameter, annotation, position):
            context = parameter
            continue
        if parameter.default is not inspect.Parameter.empty:
            continue  # never given: it keeps its default
        raise ToolDefinitionError(
            f"tool {tool_name!r}: run takes parameter {parameter.name!r} (without a default), but it is called "
            f"as run(input, ctx): the input is its first parameter, so make {parameter.name!r} a field of the "
            "input (or give every input as a typed parameter, `async def run(city: str, ctx)`)"
        )
    if context is None:
        # `async def search(q: Query)`: no context wanted.
        async def run_with_input(value: Any, ctx: ToolContext) -> Any:
            return await run(value)  # type: ignore[call-arg]

        return _adapted(run_with_input, run, tool_name)
    if context is parameters[1] and context.kind is not inspect.Parameter.KEYWORD_ONLY:
        return run  # `run(input, ctx)` itself
    if context.kind is inspect.Parameter.POSITIONAL_ONLY:
        raise ToolDefinitionError(
            f"tool {tool_name!r}: the context parameter {context.name!r} must come right after the input"
        )
    name = context.name

    async def run_with_context_keyword(value: Any, ctx: ToolContext) -> Any:
        call: Callable[..., Awaitable[Any]] = run
        return await call(value, **{name: ctx})

    return _adapted(run_with_context_keyword, run, tool_name)


def _adapted(adapter: RunFn, run: RunFn, tool_name: str) -> RunFn:
    adapter.__name__ = getattr(run, "__name__", tool_name)
    adapter.__doc__ = run.__doc__
    adapter.__wrapped__ = run  # type: ignore[attr-defined]
    return adapter


def _unwrap_partial(run: Any) -> Any:
    while isinstance(run, functools.partial):
        run = run.func
    return run


def _annotated_function(run: Any) -> Any:
    """Where the annotations (and the globals they are resolved in) of ``run``'s parameters are: the
    function itself, a partial's function, or a callable object's ``__call__`` (not the instance,
    whose class attributes' annotations are no parameters)."""
    function = _unwrap_partial(run)
    if inspect.isfunction(function) or inspect.ismethod(function):
        return function
    call = type(function).__call__
    return call if inspect.isfunction(call) else function


def _annotated_input_type(run: RunFn) -> type | None:
    """The input class (attrs class, dataclass or pydantic model) annotated on ``run``'s first
    parameter, if any (other annotations are ignored)."""
    parameters = list(inspect.signature(run).parameters.values())
    if not parameters:
        return None
    annotation = parameters[0].annotation
    if isinstance(annotation, str):
        namespace = dict(getattr(_annotated_function(run), "__globals__", {}))
        try:
            annotation = eval(annotation, namespace)  # resolve just this one string annotation
        except Exception as exc:
            raise ToolDefinitionError(
                f"cannot resolve the annotation {parameters[0].annotation!r} of "
                f"{callable_name(run)}'s first parameter ({describe(exc, 'repr')}); define the input class "
                "at module level or pass input_type="
            ) from None
    if is_input_class(annotation) or _is_pydantic_model(annotation):
        return annotation  # type: ignore[no-any-return]
    return None
