"""Tests for tool definitions: `define_tool`, `Tool`, behaviour resolution and tool results."""

from __future__ import annotations

import enum
import functools
import math
import pathlib
from typing import TYPE_CHECKING, Any, Literal, Optional

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trio_agent import (
    ConfigError,
    InterruptBehavior,
    SideEffect,
    Tool,
    ToolContext,
    ToolDefinitionError,
    ToolErrorType,
    ToolFailure,
    ToolInputError,
    ToolKind,
    ToolResult,
    TrioAgentError,
    define_tool,
)
from trio_agent.testing import call_tool
from trio_agent.tools import BehaviorOverride, ToolBehavior, ToolBehaviorError, ToolError, ToolPipeline

if TYPE_CHECKING:  # a name that only exists for type checkers, the usual pattern for the ctx annotation
    from trio_agent import ToolContext as TypeOnlyContext

OBJECT = {"type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]}


async def noop(input, ctx):
    """Does nothing."""
    return None


def make(**kwargs: Any) -> Tool[Any]:
    kwargs.setdefault("side_effect", "pure")
    if "input_type" not in kwargs:
        kwargs.setdefault("input_schema", OBJECT)
    return define_tool(noop, **kwargs)


# ---------------------------------------------------------------------------
# attrs input classes (module level so their annotations resolve)


class Color(enum.Enum):
    RED = "red"
    BLUE = "blue"


class Level(enum.Enum):
    LOW = 1
    HIGH = 2


@attrs.define
class Inner:
    n: int
    tags: list[str] = attrs.Factory(list)


@attrs.define
class Everything:
    s: str = attrs.field(metadata={"description": "a string field"})
    i: int
    f: float
    b: bool
    opt: Optional[int]  # noqa: UP045 - Optional spelling on purpose
    union_opt: str | None
    lst: list[int]
    mapping: dict[str, float]
    lit: Literal["a", "b"]
    color: Color
    level: Level
    inner: Inner
    default_int: int = 5
    default_none: Optional[str] = None  # noqa: UP045
    maybe_inner: Inner | None = None


@attrs.define
class SearchArgs:
    query: str
    limit: int = 10


@attrs.define
class Node:
    value: int
    children: list[Node] = attrs.Factory(list)


@attrs.define
class BadKeys:
    m: dict[int, str]


@attrs.define
class PrivateField:
    _secret: int


@attrs.define
class InitFalseWithDefault:
    x: int
    computed: int = attrs.field(init=False, default=3)


@attrs.define
class InitFalseNoDefault:
    x: int
    computed: int = attrs.field(init=False)


async def search(args: SearchArgs, ctx: ToolContext) -> str:
    """Search for things."""
    return args.query


async def search_type_only_ctx(args: SearchArgs, ctx: TypeOnlyContext) -> str:
    """Search, with ctx annotated by a TYPE_CHECKING-only name."""
    return args.query


async def untyped(args: dict, ctx: ToolContext) -> None:
    """First parameter is annotated, but not with an attrs class."""


async def no_doc(input, ctx):
    return None


# ---------------------------------------------------------------------------
# direct and decorator use


def test_define_tool_direct():
    tool = define_tool(noop, side_effect="pure", input_schema=OBJECT)
    assert isinstance(tool, Tool)
    assert tool.name == "noop"
    assert tool.description == "Does nothing."
    assert tool.input_schema == OBJECT
    assert tool.side_effect is SideEffect.PURE
    assert tool.run is noop
    assert tool.input_type is None
    assert tool.timeout is None


def test_define_tool_decorator():
    @define_tool(name="custom-name", side_effect=SideEffect.IDEMPOTENT, input_schema=OBJECT)
    async def fetch(input, ctx):
        """Fetch a page."""

    assert isinstance(fetch, Tool)
    assert fetch.name == "custom-name"
    assert fetch.description == "Fetch a page."
    assert fetch.side_effect is SideEffect.IDEMPOTENT


def test_explicit_description_overrides_docstring():
    tool = make(description="  Explicit.  ")
    assert tool.description == "Explicit."


def test_tool_is_frozen():
    tool = make()
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        tool.name = "other"  # type: ignore[misc]


# ---------------------------------------------------------------------------
# names


@pytest.mark.parametrize("name", ["a", "Z", "0", "_", "-", "tool_name-2", "A" * 64, "read_file", "x-1_Y"])
def test_valid_names_accepted(name):
    assert make(name=name).name == name


@pytest.mark.parametrize(
    "name", ["", "x" * 65, "has space", "dot.name", "ünï", "slash/name", "tab\tname", "colon:x", " lead"]
)
def test_invalid_names_rejected(name):
    with pytest.raises(ToolDefinitionError) as info:
        make(name=name)
    assert repr(name) in str(info.value)


@pytest.mark.parametrize("name", ["abc\n", "x" * 64 + "\n"])
def test_name_with_trailing_newline_rejected(name):
    with pytest.raises(ToolDefinitionError):
        make(name=name)


def test_non_string_name_rejected():
    with pytest.raises(ToolDefinitionError):
        make(name=123)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------
# side effect, kind, interrupt


def test_side_effect_is_required():
    with pytest.raises(ToolDefinitionError, match="side-effect") as info:
        define_tool(noop, input_schema=OBJECT)
    assert "'noop'" in str(info.value)


def test_side_effect_required_in_decorator_form():
    with pytest.raises(ToolDefinitionError, match="side-effect"):

        @define_tool(input_schema=OBJECT)
        async def tool(input, ctx):
            """Doc."""


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("pure", SideEffect.PURE),
        ("idempotent", SideEffect.IDEMPOTENT),
        ("non_idempotent", SideEffect.NON_IDEMPOTENT),
        (SideEffect.NON_IDEMPOTENT, SideEffect.NON_IDEMPOTENT),
    ],
)
def test_side_effect_strings_converted(value, expected):
    tool = make(side_effect=value)
    assert tool.side_effect is expected
    assert tool.behavior.side_effect is expected


@pytest.mark.parametrize("value", ["PURE", "non-idempotent", "readonly", "", 0, None, ["pure"], ToolKind.READONLY])
def test_bad_side_effect_rejected_naming_allowed(value):
    with pytest.raises(ToolDefinitionError) as info:
        make(side_effect=value)
    message = str(info.value)
    for allowed in ("'pure'", "'idempotent'", "'non_idempotent'"):
        assert allowed in message
    assert "side_effect" in message


@pytest.mark.parametrize(
    ("value", "expected"),
    [("readonly", ToolKind.READONLY), ("write", ToolKind.WRITE), ("execute", ToolKind.EXECUTE)],
)
def test_kind_strings_converted(value, expected):
    assert make(kind=value).kind is expected


@pytest.mark.parametrize("value", ["read", "READONLY", 1, None, SideEffect.PURE])
def test_bad_kind_rejected_naming_allowed(value):
    with pytest.raises(ToolDefinitionError) as info:
        make(kind=value)
    message = str(info.value)
    for allowed in ("'readonly'", "'write'", "'execute'"):
        assert allowed in message


@pytest.mark.parametrize(
    ("value", "expected"), [("cancel", InterruptBehavior.CANCEL), ("block", InterruptBehavior.BLOCK)]
)
def test_interrupt_strings_converted(value, expected):
    assert make(interrupt=value).interrupt is expected


@pytest.mark.parametrize("value", ["stop", "CANCEL", True, None])
def test_bad_interrupt_rejected_naming_allowed(value):
    with pytest.raises(ToolDefinitionError) as info:
        make(interrupt=value)
    message = str(info.value)
    assert "'cancel'" in message
    assert "'block'" in message


def test_defaults():
    tool = make()
    assert tool.kind is ToolKind.EXECUTE
    assert tool.interrupt is InterruptBehavior.BLOCK
    assert tool.concurrency_safe is False
    assert tool.behavior == ToolBehavior(SideEffect.PURE, ToolKind.EXECUTE, InterruptBehavior.BLOCK, False)


@pytest.mark.parametrize(("kind", "safe"), [("readonly", True), ("write", False), ("execute", False)])
def test_concurrency_safe_defaults_to_readonly(kind, safe):
    tool = make(kind=kind)
    assert tool.concurrency_safe is safe
    assert tool.behavior.concurrency_safe is safe


def test_concurrency_safe_explicit_overrides_default():
    assert make(kind="readonly", concurrency_safe=False).concurrency_safe is False
    assert make(kind="execute", concurrency_safe=True).concurrency_safe is True


def test_rank_order():
    assert [s.rank for s in (SideEffect.PURE, SideEffect.IDEMPOTENT, SideEffect.NON_IDEMPOTENT)] == [0, 1, 2]
    assert [k.rank for k in (ToolKind.READONLY, ToolKind.WRITE, ToolKind.EXECUTE)] == [0, 1, 2]


# ---------------------------------------------------------------------------
# run, description, schema presence


def test_sync_run_rejected():
    def run(input, ctx):
        """Sync."""

    with pytest.raises(ToolDefinitionError, match="async"):
        define_tool(run, side_effect="pure", input_schema=OBJECT)


def test_async_generator_run_rejected():
    async def run(input, ctx):
        """Generator."""
        yield 1

    with pytest.raises(ToolDefinitionError, match="async"):
        define_tool(run, side_effect="pure", input_schema=OBJECT)


def test_non_callable_run_rejected():
    with pytest.raises(ToolDefinitionError):
        define_tool(42, side_effect="pure", input_schema=OBJECT)  # type: ignore[call-overload]


def test_async_callable_object_accepted():
    class Runner:
        async def __call__(self, input, ctx):
            return None

    tool = define_tool(Runner(), name="runner", description="Runs.", side_effect="pure", input_schema=OBJECT)
    assert tool.name == "runner"


def test_missing_description_rejected():
    with pytest.raises(ToolDefinitionError, match="description") as info:
        define_tool(no_doc, side_effect="pure", input_schema=OBJECT)
    assert "'no_doc'" in str(info.value)


@pytest.mark.parametrize("description", ["", "   ", "\n\t"])
def test_blank_description_rejected(description):
    with pytest.raises(ToolDefinitionError, match="description"):
        define_tool(no_doc, side_effect="pure", input_schema=OBJECT, description=description)


@pytest.mark.parametrize("description", [123, b"bytes describe it", ["a"], {"a": 1}], ids=repr)
def test_a_description_that_is_not_a_string_is_a_tool_definition_error(description):
    # An int, list or dict raised a raw AttributeError ('int' object has no attribute 'strip');
    # bytes were accepted, and the model was offered "b'bytes describe it'".
    with pytest.raises(ToolDefinitionError, match=r"tool 'no_doc': description must be a string, got "):
        define_tool(no_doc, side_effect="pure", input_schema=OBJECT, description=description)


def test_no_schema_and_no_annotation_rejected():
    with pytest.raises(ToolDefinitionError, match="input schema"):
        define_tool(noop, side_effect="pure")


def test_non_attrs_annotation_is_not_a_schema():
    with pytest.raises(ToolDefinitionError, match="input schema"):
        define_tool(untyped, side_effect="pure")


def test_both_schema_and_type_rejected():
    with pytest.raises(ToolDefinitionError, match="not both"):
        define_tool(noop, side_effect="pure", input_schema=OBJECT, input_type=SearchArgs)


# ---------------------------------------------------------------------------
# direct input schemas


def test_valid_direct_schema_validates_input():
    schema = {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "type": "object",
        "properties": {"q": {"type": "string", "minLength": 1}, "n": {"type": "integer", "minimum": 0}},
        "required": ["q"],
        "additionalProperties": False,
    }
    tool = make(input_schema=schema)
    assert tool.input_errors({"q": "x", "n": 3}) == ()
    tool.validate_input({"q": "x"})
    errors = tool.input_errors({"q": "", "n": -1, "zzz": 1})
    assert len(errors) == 3
    assert any(line.startswith("at q:") for line in errors)
    assert any(line.startswith("at n:") for line in errors)
    assert any("zzz" in line for line in errors)
    # Direct schemas give the JSON object itself to run.
    value = {"q": "x"}
    assert tool.structure_input(value) is value


def test_the_callers_schema_is_copied_at_definition():
    schema = {"type": "object", "properties": {"x": {"type": "string"}}, "required": ["x"]}
    tool = make(input_schema=schema)
    schema["properties"]["x"]["type"] = "integer"  # a base schema reused for a second tool
    assert tool.input_schema["properties"]["x"] == {"type": "string"}
    assert tool.input_errors({"x": "a"}) == ()


@pytest.mark.parametrize(
    "schema",
    [
        {"type": "bogus"},
        {"type": "object", "properties": {"a": {"type": "bogus"}}},
        {"type": "object", "properties": {"a": {"minimum": "x"}}},
        {"type": "object", "required": "q"},
        {"type": "object", "properties": {"a": {"pattern": "("}}},
        {"type": "object", "properties": []},
        {"type": "object", "$ref": "#/$defs/missing"},
    ],
)
def test_invalid_schema_rejected(schema):
    with pytest.raises(ToolDefinitionError) as info:
        make(input_schema=schema)
    assert "'noop'" in str(info.value)


@pytest.mark.parametrize(
    "schema",
    [{"type": "array"}, {"type": "string"}, {"type": "integer"}, {"properties": {"q": {}}}],
)
def test_top_level_non_object_schema_rejected(schema):
    with pytest.raises(ToolDefinitionError, match="object"):
        make(input_schema=schema)


@pytest.mark.parametrize("schema", [[], "object", 42])
def test_non_dict_schema_rejected(schema):
    with pytest.raises(ToolDefinitionError):
        make(input_schema=schema)


# ---------------------------------------------------------------------------
# schemas generated from attrs classes


def everything_tool() -> Tool[Any]:
    return define_tool(noop, side_effect="pure", input_type=Everything)


VALID_EVERYTHING = {
    "s": "text",
    "i": 3,
    "f": 1.5,
    "b": True,
    "opt": None,
    "union_opt": "u",
    "lst": [1, 2, 3],
    "mapping": {"a": 1.0, "b": 2},
    "lit": "b",
    "color": "blue",
    "level": 2,
    "inner": {"n": 1, "tags": ["x"]},
}


def test_generated_schema_shape():
    schema = everything_tool().input_schema
    props = schema["properties"]
    assert schema["type"] == "object"
    assert schema["additionalProperties"] is False
    assert props["s"] == {"type": "string", "description": "a string field"}
    assert props["i"] == {"type": "integer"}
    assert props["f"] == {"type": "number"}
    assert props["b"] == {"type": "boolean"}
    assert props["opt"] == {"anyOf": [{"type": "integer"}, {"type": "null"}]}
    assert props["union_opt"] == {"anyOf": [{"type": "string"}, {"type": "null"}]}
    assert props["lst"] == {"type": "array", "items": {"type": "integer"}}
    assert props["mapping"] == {"type": "object", "additionalProperties": {"type": "number"}}
    assert props["lit"] == {"enum": ["a", "b"]}
    assert props["color"] == {"enum": ["red", "blue"]}
    assert props["level"] == {"enum": [1, 2]}
    inner = props["inner"]
    assert inner["type"] == "object"
    assert inner["additionalProperties"] is False
    assert inner["properties"] == {"n": {"type": "integer"}, "tags": {"type": "array", "items": {"type": "string"}}}
    assert inner["required"] == ["n"]
    assert set(schema["required"]) == {
        "s",
        "i",
        "f",
        "b",
        "opt",
        "union_opt",
        "lst",
        "mapping",
        "lit",
        "color",
        "level",
        "inner",
    }
    for optional in ("default_int", "default_none", "maybe_inner"):
        assert optional in props
        assert optional not in schema["required"]


def test_input_type_from_annotation():
    tool = define_tool(search, side_effect="pure", kind="readonly")
    assert tool.input_type is SearchArgs
    assert tool.input_schema["properties"] == {"query": {"type": "string"}, "limit": {"type": "integer"}}
    assert tool.input_schema["required"] == ["query"]
    args = tool.structure_input({"query": "hello"})
    assert isinstance(args, SearchArgs)
    assert args == SearchArgs("hello", 10)


def test_unresolvable_first_parameter_annotation_rejected_naming_it():
    @attrs.define
    class LocalArgs:  # local: its string annotation cannot be resolved from module globals
        q: str

    async def run(args: LocalArgs, ctx):
        """Doc."""

    with pytest.raises(ToolDefinitionError, match="LocalArgs"):
        define_tool(run, side_effect="pure")
    # Passing the class explicitly works.
    assert define_tool(run, side_effect="pure", input_type=LocalArgs).input_type is LocalArgs


def test_input_type_inferred_when_only_ctx_annotation_is_unresolvable():
    tool = define_tool(search_type_only_ctx, side_effect="pure")
    assert tool.input_type is SearchArgs


def test_input_type_explicit():
    tool = define_tool(noop, side_effect="pure", input_type=SearchArgs)
    assert tool.input_type is SearchArgs
    assert tool.structure_input({"query": "q", "limit": 2}) == SearchArgs("q", 2)


def test_valid_input_accepted_and_structured():
    tool = everything_tool()
    assert tool.input_errors(VALID_EVERYTHING) == ()
    tool.validate_input(VALID_EVERYTHING)
    value = tool.structure_input(VALID_EVERYTHING)
    assert isinstance(value, Everything)
    assert isinstance(value.inner, Inner)
    assert value.inner == Inner(1, ["x"])
    assert value.color is Color.BLUE
    assert value.level is Level.HIGH
    assert value.mapping == {"a": 1.0, "b": 2.0}
    assert value.default_int == 5
    assert value.maybe_inner is None


def test_nested_optional_attrs_structured():
    tool = everything_tool()
    data = {**VALID_EVERYTHING, "maybe_inner": {"n": 9}}
    assert tool.input_errors(data) == ()
    assert tool.structure_input(data).maybe_inner == Inner(9, [])


@pytest.mark.parametrize(
    ("change", "path"),
    [
        ({"i": "three"}, "at i:"),
        ({"b": 1}, "at b:"),
        ({"i": True}, "at i:"),
        ({"lst": [1, "x"]}, "at lst/1:"),
        ({"mapping": {"k": "v"}}, "at mapping/k:"),
        ({"lit": "c"}, "at lit:"),
        ({"color": "RED"}, "at color:"),
        ({"inner": {"n": "z"}}, "at inner/n:"),
        ({"inner": {"n": 1, "tags": [1]}}, "at inner/tags/0:"),
        ({"inner": {"n": 1, "extra": 1}}, "at inner:"),
        ({"extra": 1}, "at <root>:"),
    ],
)
def test_invalid_input_rejected_with_json_paths(change, path):
    tool = everything_tool()
    data = {**VALID_EVERYTHING, **change}
    errors = tool.input_errors(data)
    assert errors
    assert any(line.startswith(path) for line in errors), errors
    with pytest.raises(ToolInputError) as info:
        tool.validate_input(data)
    assert info.value.errors == errors
    assert info.value.tool_name == "noop"
    assert isinstance(info.value, ValueError)
    assert isinstance(info.value, TrioAgentError)
    for line in errors:
        assert line in str(info.value)


def test_missing_required_field_reported():
    tool = everything_tool()
    data = dict(VALID_EVERYTHING)
    del data["s"]
    errors = tool.input_errors(data)
    assert len(errors) == 1
    assert "at <root>" in errors[0]
    assert '"s"' in errors[0]


def test_multiple_errors_all_listed():
    tool = everything_tool()
    data = {**VALID_EVERYTHING, "i": "x", "inner": {"n": "y"}, "extra": 0}
    del data["s"]
    errors = tool.input_errors(data)
    assert len(errors) == 4
    with pytest.raises(ToolInputError) as info:
        tool.validate_input(data)
    assert len(info.value.errors) == 4


@pytest.mark.parametrize("value", [None, [], "text", 1])
def test_non_object_input_rejected(value):
    tool = everything_tool()
    assert tool.input_errors(value)
    with pytest.raises(ToolInputError):
        tool.validate_input(value)


def test_structure_input_rejects_bad_input_with_tool_input_error():
    tool = define_tool(noop, side_effect="pure", input_type=SearchArgs)
    with pytest.raises(ToolInputError) as info:
        tool.structure_input({"query": "q", "surplus": 1})
    assert info.value.tool_name == "noop"


def test_recursive_input_type_rejected():
    with pytest.raises(ToolDefinitionError, match="recursive"):
        define_tool(noop, side_effect="pure", input_type=Node)


def test_non_str_dict_keys_rejected():
    with pytest.raises(ToolDefinitionError, match="keys must be str"):
        define_tool(noop, side_effect="pure", input_type=BadKeys)


def test_non_attrs_input_type_rejected():
    with pytest.raises(ToolDefinitionError, match="attrs"):
        define_tool(noop, side_effect="pure", input_type=dict)


def test_private_attrs_field_schema_and_structure_agree():
    tool = define_tool(noop, side_effect="pure", input_type=PrivateField)
    assert tool.input_schema["required"] == ["secret"]
    data = {"secret": 7}
    assert tool.input_errors(data) == ()
    assert tool.structure_input(data) == PrivateField(7)


@pytest.mark.parametrize("cls", [InitFalseWithDefault, InitFalseNoDefault])
def test_init_false_fields_not_part_of_input(cls):
    tool = define_tool(noop, side_effect="pure", input_type=cls)
    # Every input the schema accepts must structure; the plain input must be accepted.
    assert tool.input_errors({"x": 1}) == ()
    assert tool.structure_input({"x": 1}).x == 1
    with_computed = {"x": 1, "computed": 9}
    if not tool.input_errors(with_computed):
        assert tool.structure_input(with_computed).x == 1


json_everything = st.fixed_dictionaries(
    {
        "s": st.text(max_size=5),
        "i": st.integers(-(10**6), 10**6),
        "f": st.floats(allow_nan=False, allow_infinity=False, width=32),
        "b": st.booleans(),
        "opt": st.none() | st.integers(-5, 5),
        "union_opt": st.none() | st.text(max_size=3),
        "lst": st.lists(st.integers(-5, 5), max_size=4),
        "mapping": st.dictionaries(st.text(max_size=3), st.floats(allow_nan=False, allow_infinity=False), max_size=3),
        "lit": st.sampled_from(["a", "b"]),
        "color": st.sampled_from(["red", "blue"]),
        "level": st.sampled_from([1, 2]),
        "inner": st.fixed_dictionaries({"n": st.integers(-5, 5)}, optional={"tags": st.lists(st.text(max_size=2))}),
    },
    optional={
        "default_int": st.integers(-5, 5),
        "default_none": st.none() | st.text(max_size=3),
        "maybe_inner": st.none() | st.fixed_dictionaries({"n": st.integers(-5, 5)}),
    },
)


@settings(max_examples=100, deadline=None)
@given(json_everything)
def test_schema_accepted_input_always_structures(data):
    tool = _everything_tool_cached()
    assert tool.input_errors(data) == ()
    value = tool.structure_input(data)
    assert isinstance(value, Everything)
    assert value.i == data["i"]
    assert value.color.value == data["color"]
    assert value.inner.n == data["inner"]["n"]
    assert value.default_int == data.get("default_int", 5)


@functools.cache
def _everything_tool_cached() -> Tool[Any]:
    return everything_tool()


# ---------------------------------------------------------------------------
# unions: the JSON type of a value says which member it is


@attrs.define
class ByName:
    name: str


@attrs.define
class ById:
    id: int


@attrs.define
class AlsoByName:
    name: str


@attrs.define
class Unions:
    int_or_str: int | str = 0
    float_or_bool: float | bool = 0.0
    list_or_str: list[int] | str = ""
    dict_or_list: dict[str, int] | list[int] = attrs.Factory(list)
    int_or_float: int | float = 0
    literal_or_int: Literal["auto"] | int = "auto"
    color_or_int: Color | int = 0
    class_or_str: ByName | str = ""
    classes: ByName | ById | None = None
    nested: list[int | str] = attrs.Factory(list)
    anything: Optional[Any] = None  # noqa: UP045 (typing spells it so)


def unions_tool() -> Tool[Any]:
    return define_tool(noop, name="unions", description="d", side_effect="pure", input_type=Unions)


@pytest.mark.parametrize(
    ("field", "value", "expected"),
    [
        ("int_or_str", "x", "x"),
        ("int_or_str", 3, 3),
        ("int_or_str", "3", "3"),  # never int("3"): the JSON type says str
        ("int_or_str", 2.0, 2),  # JSON Schema's "integer" takes 2.0
        ("float_or_bool", True, True),
        ("float_or_bool", 3, 3.0),  # "number" takes integers
        ("list_or_str", [1, 2], [1, 2]),
        ("list_or_str", "s", "s"),
        ("dict_or_list", {"a": 1}, {"a": 1}),
        ("dict_or_list", [1], [1]),
        ("int_or_float", 2, 2),
        ("int_or_float", 2.5, 2.5),
        ("literal_or_int", "auto", "auto"),
        ("literal_or_int", 7, 7),
        ("color_or_int", "red", Color.RED),
        ("color_or_int", 4, 4),
        ("class_or_str", {"name": "n"}, ByName("n")),
        ("class_or_str", "s", "s"),
        ("classes", {"id": 1}, ById(1)),
        ("classes", {"name": "n"}, ByName("n")),
        ("classes", None, None),
        ("nested", [1, "a"], [1, "a"]),
        ("anything", {"any": [1]}, {"any": [1]}),
        ("anything", None, None),
    ],
)
def test_a_union_field_structures_the_member_its_json_type_names(field: str, value: Any, expected: Any) -> None:
    tool = unions_tool()
    assert tool.input_errors({field: value}) == ()
    structured = getattr(tool.structure_input({field: value}), field)
    assert structured == expected
    assert type(structured) is type(expected)


async def test_a_tool_with_union_parameters_runs() -> None:
    @define_tool(side_effect="pure", kind="readonly")
    async def pick(value: int | str, items: dict[str, int] | list[int], ctx: ToolContext) -> str:
        """Pick."""
        return f"{value!r} {items!r}"

    pipeline = ToolPipeline([pick])
    assert (await call_tool(pipeline, "pick", {"value": "x", "items": [1]})).result.output == "'x' [1]"
    assert (await call_tool(pipeline, "pick", {"value": 3, "items": {"a": 1}})).result.output == "3 {'a': 1}"


@attrs.define
class TwoLists:
    value: list[int] | list[str]


@attrs.define
class DictOrClass:
    value: dict[str, int] | ByName


@attrs.define
class EnumOrStr:
    value: Color | str


@attrs.define
class LookAlikes:
    value: ByName | AlsoByName


@pytest.mark.parametrize(
    ("cls", "message"),
    [
        (TwoLists, r"TwoLists.value: in list\[int\] \| list\[str\], a JSON array could be list"),
        (DictOrClass, "a JSON object could be"),
        (EnumOrStr, "a JSON string could be"),
        (LookAlikes, "LookAlikes.value: the input classes of .* cannot be told apart"),
    ],
)
def test_a_union_whose_members_a_json_value_cannot_tell_apart_is_refused_at_definition(cls, message) -> None:
    with pytest.raises(ToolDefinitionError, match=message):
        define_tool(noop, name="t", description="d", side_effect="pure", input_type=cls)


# ---------------------------------------------------------------------------
# behaviour resolution


def resolver_tool(resolver, **kwargs: Any) -> Tool[Any]:
    kwargs.setdefault("side_effect", "non_idempotent")
    kwargs.setdefault("kind", "execute")
    return define_tool(noop, input_schema=OBJECT, resolve_behavior=resolver, **kwargs)


def test_resolver_may_narrow_and_set_interrupt():
    seen: list[Any] = []

    def resolver(value):
        seen.append(value)
        return BehaviorOverride(
            side_effect=SideEffect.PURE,
            kind=ToolKind.READONLY,
            interrupt=InterruptBehavior.CANCEL,
            concurrency_safe=True,
        )

    tool = resolver_tool(resolver)
    behavior = tool.resolve_behavior({"q": "ls"})
    assert behavior == ToolBehavior(SideEffect.PURE, ToolKind.READONLY, InterruptBehavior.CANCEL, True)
    assert seen == [{"q": "ls"}]
    # The static behaviour is unchanged.
    assert tool.behavior == ToolBehavior(SideEffect.NON_IDEMPOTENT, ToolKind.EXECUTE, InterruptBehavior.BLOCK, False)


def test_resolver_interrupt_set_freely_both_ways():
    tool = resolver_tool(lambda v: BehaviorOverride(interrupt=InterruptBehavior.BLOCK), interrupt="cancel")
    assert tool.resolve_behavior({"q": "x"}).interrupt is InterruptBehavior.BLOCK
    tool = resolver_tool(lambda v: BehaviorOverride(interrupt=InterruptBehavior.CANCEL), interrupt="block")
    assert tool.resolve_behavior({"q": "x"}).interrupt is InterruptBehavior.CANCEL


def test_resolver_concurrency_safe_set_freely():
    tool = resolver_tool(lambda v: BehaviorOverride(concurrency_safe=False), kind="readonly")
    assert tool.resolve_behavior({"q": "x"}).concurrency_safe is False


def test_resolver_returning_none_or_empty_override_keeps_static():
    for resolver in (lambda v: None, lambda v: BehaviorOverride()):
        tool = resolver_tool(resolver)
        assert tool.resolve_behavior({"q": "x"}) == tool.behavior


def test_no_resolver_gives_static():
    tool = make(side_effect="idempotent", kind="write")
    assert tool.resolve_behavior({"q": "x"}) == tool.behavior


def test_resolver_widening_side_effect_rejected():
    tool = resolver_tool(lambda v: BehaviorOverride(side_effect=SideEffect.IDEMPOTENT), side_effect="pure")
    with pytest.raises(ToolBehaviorError) as info:
        tool.resolve_behavior({"q": "x"})
    assert "'pure'" in str(info.value)
    assert "'idempotent'" in str(info.value)
    assert isinstance(info.value, ToolDefinitionError)


def test_resolver_widening_kind_rejected():
    tool = resolver_tool(lambda v: BehaviorOverride(kind=ToolKind.WRITE), side_effect="pure", kind="readonly")
    with pytest.raises(ToolBehaviorError) as info:
        tool.resolve_behavior({"q": "x"})
    assert "'readonly'" in str(info.value)
    assert "'write'" in str(info.value)


@pytest.mark.parametrize(
    "garbage",
    [
        {"side_effect": "pure"},
        "pure",
        SideEffect.PURE,
        42,
        ToolBehavior(SideEffect.PURE, ToolKind.READONLY, InterruptBehavior.BLOCK, True),
        BehaviorOverride(side_effect="pure"),  # type: ignore[arg-type]
        BehaviorOverride(kind="readonly"),  # type: ignore[arg-type]
        BehaviorOverride(interrupt="cancel"),  # type: ignore[arg-type]
        BehaviorOverride(side_effect=ToolKind.READONLY),  # type: ignore[arg-type]
    ],
)
def test_resolver_garbage_rejected(garbage):
    tool = resolver_tool(lambda v: garbage)
    with pytest.raises(ToolBehaviorError):
        tool.resolve_behavior({"q": "x"})


@pytest.mark.parametrize("exc_type", [KeyError, RuntimeError, ZeroDivisionError, ToolDefinitionError])
def test_resolver_raising_becomes_behavior_error(exc_type):
    def resolver(value):
        raise exc_type("boom")

    tool = resolver_tool(resolver)
    with pytest.raises(ToolBehaviorError, match="boom") as info:
        tool.resolve_behavior({"q": "x"})
    assert type(info.value.__cause__) is exc_type


@pytest.mark.parametrize("bad_input", [{}, {"q": 1}, None, "q", []])
def test_invalid_input_gets_static_behavior_without_calling_resolver(bad_input):
    calls: list[Any] = []

    def resolver(value):
        calls.append(value)
        return BehaviorOverride(side_effect=SideEffect.PURE)

    tool = resolver_tool(resolver)
    assert tool.resolve_behavior(bad_input) == tool.behavior
    assert calls == []
    tool.resolve_behavior({"q": "ok"})
    assert calls == [{"q": "ok"}]


def test_non_callable_resolver_rejected():
    with pytest.raises(ToolDefinitionError, match="resolve_behavior"):
        make(resolve_behavior="nope")


def _static_tool(side_effect: SideEffect, kind: ToolKind, holder: dict[str, Any]) -> Tool[Any]:
    return define_tool(
        noop,
        side_effect=side_effect,
        kind=kind,
        input_schema=OBJECT,
        resolve_behavior=lambda value: holder["override"],
    )


_HOLDER: dict[str, Any] = {}
_STATIC_TOOLS = {(s, k): _static_tool(s, k, _HOLDER) for s in SideEffect for k in ToolKind}


@settings(max_examples=200, deadline=None)
@given(
    static_side_effect=st.sampled_from(SideEffect),
    static_kind=st.sampled_from(ToolKind),
    resolved_side_effect=st.none() | st.sampled_from(SideEffect),
    resolved_kind=st.none() | st.sampled_from(ToolKind),
    interrupt=st.none() | st.sampled_from(InterruptBehavior),
)
def test_resolution_succeeds_iff_narrowing(
    static_side_effect, static_kind, resolved_side_effect, resolved_kind, interrupt
):
    tool = _STATIC_TOOLS[(static_side_effect, static_kind)]
    _HOLDER["override"] = BehaviorOverride(side_effect=resolved_side_effect, kind=resolved_kind, interrupt=interrupt)
    effective_side_effect = resolved_side_effect or static_side_effect
    effective_kind = resolved_kind or static_kind
    allowed = effective_side_effect.rank <= static_side_effect.rank and effective_kind.rank <= static_kind.rank
    if allowed:
        behavior = tool.resolve_behavior({"q": "x"})
        assert behavior.side_effect is effective_side_effect
        assert behavior.kind is effective_kind
        assert behavior.interrupt is (interrupt or InterruptBehavior.BLOCK)
        assert behavior.concurrency_safe is tool.concurrency_safe
    else:
        with pytest.raises(ToolBehaviorError):
            tool.resolve_behavior({"q": "x"})


# ---------------------------------------------------------------------------
# reconcile and affected paths


async def _reconcile(value, key):
    return None


@pytest.mark.parametrize("side_effect", ["pure", "idempotent"])
def test_reconcile_only_for_non_idempotent(side_effect):
    with pytest.raises(ToolDefinitionError, match="reconcile"):
        make(side_effect=side_effect, reconcile=_reconcile)


def test_reconcile_accepted_for_non_idempotent():
    tool = make(side_effect="non_idempotent", reconcile=_reconcile)
    assert tool.reconcile is _reconcile


def test_non_callable_reconcile_rejected():
    with pytest.raises(ToolDefinitionError, match="reconcile"):
        make(side_effect="non_idempotent", reconcile="nope")


def test_paths_for_single_string_is_one_path():
    tool = make(affected_paths=lambda value: value["q"])
    assert tool.paths_for({"q": "src/main.py"}) == ("src/main.py",)


def test_paths_for_sequence_and_iterables():
    tool = make(affected_paths=lambda value: [value["q"], pathlib.PurePosixPath("b/c")])
    assert tool.paths_for({"q": "a"}) == ("a", "b/c")
    tool = make(affected_paths=lambda value: (p for p in ("x", "y")))
    assert tool.paths_for({"q": "a"}) == ("x", "y")
    tool = make(affected_paths=lambda value: [])
    assert tool.paths_for({"q": "a"}) == ()


def test_paths_for_without_affected_paths_is_empty():
    assert make().paths_for({"q": "a"}) == ()


def test_non_callable_affected_paths_rejected():
    with pytest.raises(ToolDefinitionError, match="affected_paths"):
        make(affected_paths=["a"])


# ---------------------------------------------------------------------------
# timeout


@pytest.mark.parametrize("timeout", [0, -1, 0.0, -0.5, math.nan, math.inf, "10", True, False, 1e12, [1]])
def test_bad_timeout_rejected(timeout):
    with pytest.raises(ConfigError) as info:
        make(timeout=timeout)
    assert isinstance(info.value, ValueError)
    assert isinstance(info.value, TrioAgentError)
    assert "timeout" in str(info.value)


@pytest.mark.parametrize(("timeout", "expected"), [(10, 10.0), (0.25, 0.25), (2**31 / 1000, 2**31 / 1000)])
def test_good_timeout_accepted(timeout, expected):
    tool = make(timeout=timeout)
    assert tool.timeout == expected
    assert isinstance(tool.timeout, float)


# ---------------------------------------------------------------------------
# results


def test_tool_result_success():
    result = ToolResult.success("out", display="shown", data={"k": 1}, metadata={"m": 2})
    assert result.ok is True
    assert result.error is None
    assert result.output == "out"
    assert result.display == "shown"
    assert result.data == {"k": 1}
    assert result.metadata == {"m": 2}
    assert ToolResult.success("x").metadata == {}


def test_tool_result_failure_defaults():
    result = ToolResult.failure(ToolErrorType.TIMEOUT, "took too long", code="deadline", details={"s": 5})
    assert result.ok is False
    assert result.output == "Error: took too long"
    assert result.error == ToolError(ToolErrorType.TIMEOUT, "took too long", "deadline", {"s": 5})
    assert result.error.type is ToolErrorType.TIMEOUT
    assert result.error.code == "deadline"


def test_tool_result_failure_explicit_output_kept():
    assert ToolResult.failure(ToolErrorType.EXECUTION, "m", output="custom").output == "custom"
    assert ToolResult.failure(ToolErrorType.EXECUTION, "m", output="").output == ""


def test_tool_error_type_validated():
    with pytest.raises(TypeError):
        ToolError("execution", "m")  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        ToolResult.failure("validation", "m")  # type: ignore[arg-type]


def test_tool_failure_to_result():
    failure = ToolFailure("denied", type=ToolErrorType.PERMISSION_DENIED, code="policy")
    result = failure.to_result()
    assert result.ok is False
    assert result.error is not None
    assert result.error.type is ToolErrorType.PERMISSION_DENIED
    assert result.error.code == "policy"
    assert result.error.message == "denied"
    assert result.output == "Error: denied"


def test_tool_failure_defaults_to_execution():
    failure = ToolFailure("broke")
    assert failure.type is ToolErrorType.EXECUTION
    assert failure.code is None
    result = failure.to_result()
    assert result.error == ToolError(ToolErrorType.EXECUTION, "broke")
    assert str(failure) == "broke"


def test_tool_failure_type_given_by_value():
    failure = ToolFailure("slow", type="timeout")
    assert failure.type is ToolErrorType.TIMEOUT
    assert failure.to_result().error == ToolError(ToolErrorType.TIMEOUT, "slow")


@pytest.mark.parametrize("bad", ["bogus", 3, None, ["timeout"]])
def test_tool_failure_refuses_a_type_that_is_not_one_naming_it(bad):
    with pytest.raises(ValueError, match=r"ToolFailure type .* is not a ToolErrorType") as caught:
        ToolFailure("x", type=bad)
    assert repr(bad) in str(caught.value)


# ---------------------------------------------------------------------------
# permissions: signature_content and check_permissions (settlement issue item 12)


def _content(input: dict[str, Any]) -> str | None:
    return input.get("q")


def _check(input: dict[str, Any]) -> None:
    return None


def test_signature_content_and_check_permissions_are_stored_on_the_tool():
    tool = make(signature_content=_content, check_permissions=_check)
    assert (tool.signature_content, tool.check_permissions) == (_content, _check)
    assert tool.has_signature_content and tool.signature_field is None
    assert tool.signature_content_for({"q": "x"}) == "x"
    assert tool.signature_content_for({}) is None
    # Decorator form takes them too.

    @define_tool(side_effect="pure", input_schema=OBJECT, signature_content=_content, check_permissions=_check)
    async def decorated(input, ctx):
        """Decorated."""

    assert (decorated.signature_content, decorated.check_permissions) == (_content, _check)
    plain = make()
    assert (plain.signature_content, plain.check_permissions, plain.has_signature_content) == (None, None, False)


@pytest.mark.parametrize("field", ["signature_content", "check_permissions"])
def test_non_callable_permission_parts_rejected(field):
    with pytest.raises(ToolDefinitionError, match=f"{field} must be callable"):
        make(**{field: "input['q']"})


def test_signature_content_must_return_a_string_or_none():
    tool = make(signature_content=lambda input: 42)
    with pytest.raises(TypeError, match="must be a string or None"):
        tool.signature_content_for({"q": "x"})
    assert make(signature_content=lambda input: "").signature_content_for({"q": "x"}) is None


@attrs.define
class ShellInput:
    command: str
    cwd: Optional[str] = None  # noqa: UP045 - Optional on purpose: not a plain string, never the content


@attrs.define
class MaybePath:
    path: Optional[str] = None  # noqa: UP045


def test_signature_field_from_attrs_input_types():
    shell = make(input_type=ShellInput)
    assert shell.signature_field == "command"
    assert shell.signature_content_for({"command": " git status "}) == "git status"
    # An optional field is not a plain string property: no default content.
    assert make(input_type=MaybePath).signature_field is None
    # Given signature_content wins: the field is not used.
    assert make(input_type=ShellInput, signature_content=lambda input: "x").signature_field is None


@pytest.mark.parametrize(
    ("value", "fragment"),
    [
        ({"q": "x", "\ud800": 1}, "at <root>: key '\\ud800' is not valid Unicode"),
        ({"q": "\udfff"}, "at q: string '\\udfff' is not valid Unicode"),
    ],
)
def test_lone_surrogates_are_input_errors_not_crashes(value, fragment):
    tool = make(input_schema={"type": "object", "properties": {"q": {"type": "string", "pattern": "^x"}}})
    errors = tool.input_errors(value)
    assert any(fragment in line for line in errors), errors
    "; ".join(errors).encode("utf-8")
    with pytest.raises(ToolInputError, match="lone surrogate"):
        tool.validate_input(value)
    # The behaviour resolver only ever sees valid input: a surrogate key gets the static behaviour.
    resolving = make(input_schema=OBJECT, resolve_behavior=lambda input: BehaviorOverride(concurrency_safe=False))
    assert resolving.resolve_behavior({"q": "x", "\ud800": 1}) == resolving.behavior


def test_a_key_that_is_not_a_string_is_an_input_error_not_a_crash():
    # The validator raised ValueError("Dict key must be str") out of input_errors and validate_input.
    tool = make(input_schema={"type": "object", "properties": {"q": {"type": "string"}}})
    assert tool.input_errors({1: "x"}) == ("at <root>: the input has a non-string key 1",)
    with pytest.raises(ToolInputError, match="non-string key"):
        tool.validate_input({"q": "x", 1: "y"})


@pytest.mark.parametrize(
    ("value", "problem"),
    [
        ({"q": {1, 2}}, "the input.q is not JSON: set"),
        ({"q": (1, 2)}, "the input.q is not JSON: tuple"),
        ({"q": math.nan}, "the input.q is not a finite number: nan"),
        ({"q": [math.inf]}, "the input.q[0] is not a finite number: inf"),
    ],
)
@pytest.mark.parametrize("schema", [{"type": "object"}, {"type": "object", "properties": {"q": {"type": "string"}}}])
def test_input_that_is_not_json_is_reported_as_such_before_the_schema(
    value: dict[str, Any], problem: str, schema: dict[str, Any]
) -> None:
    # The validator reads a set or a tuple as an array and NaN as null: an open schema let them
    # through, a typed one blamed the wrong thing ('null is not of type "string"').
    tool = make(input_schema=schema)
    assert tool.input_errors(value) == (f"at <root>: {problem}",)
    with pytest.raises(ToolInputError, match="not"):
        tool.validate_input(value)
    # The behaviour resolver only ever sees JSON input.
    seen: list[Any] = []
    resolving = make(input_schema=schema, resolve_behavior=lambda input: seen.append(input))
    assert resolving.resolve_behavior(value) == resolving.behavior
    assert seen == []


_JSONISH = st.recursive(
    st.none()
    | st.booleans()
    | st.text(max_size=3)
    | st.floats()
    | st.integers()
    | st.sampled_from([(1 << 2048) - 1, 1 << 2048, -(1 << 2048) + 1, -(1 << 2048), 10**700]),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=2), children, max_size=3),
    max_leaves=12,
)


@given(_JSONISH)
@settings(max_examples=300, deadline=None)
def test_the_fast_json_check_and_the_explaining_one_agree(value: Any) -> None:
    # is_json (the fast path of every result, input and event check) and explain_json (which
    # names the problem) are one rule: ints past MAX_JSON_INT_BITS and non-finite floats fail both.
    from trio_agent._json import MAX_JSON_INT_BITS, is_json, json_problem

    problem = json_problem(value, "value")
    assert is_json(value) == (problem is None), problem
    if problem is not None and "integer" in problem:
        assert f"at most {MAX_JSON_INT_BITS}" in problem


_ANYISH = st.recursive(
    _JSONISH | st.sampled_from([b"x", math.nan, -math.inf, 1j]),
    lambda children: (
        st.lists(children, max_size=3)
        | st.tuples(children)
        | st.dictionaries(st.text(max_size=2) | st.integers(0, 3) | st.none(), children, max_size=3)
    ),
    max_leaves=12,
)


def _containers(value: Any) -> list[Any]:
    if isinstance(value, dict):
        return [value, *(item for inner in value.values() for item in _containers(inner))]
    if isinstance(value, list):
        return [value, *(item for inner in value for item in _containers(inner))]
    return []


@given(_ANYISH)
@settings(max_examples=400, deadline=None)
def test_copy_if_json_judges_as_is_json_and_copies_every_container(value: Any) -> None:
    # One walk for what `is_json` and `json_copy` did in two (the pipeline's frozen input, the
    # journal's scheduled and started inputs): it must accept exactly what is_json accepts, and
    # its copy must share no container with the original, or a later in-place change would reach it.
    from trio_agent._json import NOT_JSON, copy_if_json, is_json

    copy = copy_if_json(value)
    if not is_json(value):
        assert copy is NOT_JSON
        return
    assert copy == value or value != value  # (a float NaN is never JSON, so equality holds)
    originals = {id(container) for container in _containers(value)}
    assert not originals & {id(container) for container in _containers(copy)}


def test_copy_if_json_refuses_nesting_past_the_limit() -> None:
    from trio_agent._json import MAX_JSON_DEPTH, NOT_JSON, copy_if_json, is_json

    deep: Any = 1
    for _ in range(MAX_JSON_DEPTH):
        deep = [deep]
    assert is_json(deep) and copy_if_json(deep) == deep
    assert not is_json([deep]) and copy_if_json([deep]) is NOT_JSON
    # An empty container is never walked by is_json, so it may sit one level deeper; the copy agrees.
    for empty in ([], {}):
        edge: Any = empty
        for _ in range(MAX_JSON_DEPTH):
            edge = [edge]
        assert is_json(edge) and copy_if_json(edge) == edge
