"""A tool's input from its signature, a dataclass or a pydantic model, beside attrs classes and JSON Schema."""

from __future__ import annotations

import dataclasses
import enum
import functools
import typing
from typing import Any, Literal

import pytest

from trio_agent import ToolContext, ToolDefinitionError, ToolInputError, define_tool, open_session
from trio_agent._tools._context import ToolCall
from trio_agent._tools._pipeline import ToolPipeline
from trio_agent.testing import Reply, TestModel


@define_tool(side_effect="pure", kind="readonly")
async def weather(city: str, units: str = "celsius", ctx: ToolContext | None = None) -> str:
    """Today's weather in a city."""
    assert ctx is not None
    return f"sunny in {city} ({units})"


def test_plain_typed_parameters_make_the_schema() -> None:
    schema = weather.input_schema
    assert schema["properties"] == {"city": {"type": "string"}, "units": {"type": "string"}}
    assert schema["required"] == ["city"]
    assert schema["additionalProperties"] is False
    assert weather.description == "Today's weather in a city."


async def test_a_signature_tool_runs_with_its_arguments_and_the_context() -> None:
    pipeline = ToolPipeline([weather])
    ok = await pipeline.execute(ToolCall("c1", "weather", {"city": "Paris"}))
    assert ok.result.output == "sunny in Paris (celsius)"
    bad = await pipeline.execute(ToolCall("c2", "weather", {"city": 3}))
    assert bad.result.error is not None and "city" in bad.result.error.message


@dataclasses.dataclass
class Forecast:
    city: str
    days: int = 1


async def test_a_dataclass_input() -> None:
    @define_tool(side_effect="pure", kind="readonly")
    async def forecast(query: Forecast, ctx: Any) -> str:
        """Forecast."""
        return f"{query.city} for {query.days} days"

    assert forecast.input_schema["required"] == ["city"]
    record = await ToolPipeline([forecast]).execute(ToolCall("c1", "forecast", {"city": "Oslo", "days": 3}))
    assert record.result.output == "Oslo for 3 days"


async def test_a_pydantic_model_input() -> None:
    pydantic = pytest.importorskip("pydantic")

    class Order(pydantic.BaseModel):  # type: ignore[misc,name-defined]
        item: str
        quantity: int = 1

    @define_tool(side_effect="idempotent", kind="readonly", input_type=Order)
    async def order(value: Any, ctx: Any) -> str:
        """Orders."""
        return f"{value.quantity} x {value.item}"

    assert order.input_schema["properties"]["item"]["type"] == "string"
    pipeline = ToolPipeline([order])
    record = await pipeline.execute(ToolCall("c1", "order", {"item": "tea", "quantity": 2}))
    assert record.result.output == "2 x tea"
    bad = await pipeline.execute(ToolCall("c2", "order", {"item": "tea", "quantity": "many"}))
    assert not bad.result.ok


async def test_the_context_parameter_is_passed_under_its_own_name() -> None:
    @define_tool(side_effect="pure", kind="readonly")
    async def where(city: str, context: ToolContext) -> str:
        """Where a call runs."""
        return f"{city} in call {context.tool_call_id}"

    assert set(where.input_schema["properties"]) == {"city"}
    record = await ToolPipeline([where]).execute(ToolCall("c1", "where", {"city": "Paris"}))
    assert record.result.output == "Paris in call c1"


def test_two_context_parameters_are_refused() -> None:
    with pytest.raises(ToolDefinitionError, match="'ctx' and 'context' both take the context"):

        @define_tool(side_effect="pure", kind="readonly")
        async def twice(city: str, ctx: ToolContext, context: ToolContext) -> str:
            """Two contexts."""
            return city


class WeatherService:
    """Weather for a city, from an object."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix

    async def __call__(self, city: str, ctx: ToolContext | None = None) -> str:
        return f"{self.prefix} {city}"


class Shadowed:
    """Class attributes that are no parameters."""

    city: int = 0

    async def __call__(self, city, ctx=None):  # type: ignore[no-untyped-def]
        return city


class DescribedByCall:
    async def __call__(self, city: str) -> str:
        """Described by its __call__."""
        return city


async def test_a_callable_object_is_typed_by_its_call_method() -> None:
    tool = define_tool(WeatherService("sunny in"), name="weather", side_effect="pure", kind="readonly")
    assert tool.description == "Weather for a city, from an object."
    assert tool.input_schema["properties"] == {"city": {"type": "string"}}
    record = await ToolPipeline([tool]).execute(ToolCall("c1", "weather", {"city": "Oslo"}))
    assert record.result.output == "sunny in Oslo"
    described = define_tool(DescribedByCall(), name="described", side_effect="pure")
    assert described.description == "Described by its __call__."


def test_a_callable_objects_class_annotations_are_not_its_parameters() -> None:
    with pytest.raises(ToolDefinitionError, match="annotate parameter 'city'"):
        define_tool(Shadowed(), name="shadowed", side_effect="pure")


async def _forecast(city: str, days: int = 1, ctx: ToolContext | None = None) -> str:
    """Forecast for a city."""
    return f"{city} for {days} days"


async def _raw(input: dict[str, Any], ctx: Any) -> str:
    """Echoes its input."""
    return str(input)


async def test_a_partial_is_named_described_and_typed_by_its_function() -> None:
    tool = define_tool(functools.partial(_forecast, days=3), side_effect="pure", kind="readonly")
    assert tool.name == "_forecast"
    assert tool.description == "Forecast for a city."
    assert tool.input_schema["required"] == ["city"]
    record = await ToolPipeline([tool]).execute(ToolCall("c1", "_forecast", {"city": "Oslo"}))
    assert record.result.output == "Oslo for 3 days"
    raw = define_tool(functools.partial(_raw), name="raw", side_effect="pure", input_schema={"type": "object"})
    assert raw.description == "Echoes its input."  # not functools.partial's own docstring


async def test_what_a_partial_binds_is_no_input_the_model_can_override() -> None:
    # days=3 was offered to the model as an optional field with default 3, and {"days": 30} ran.
    tool = define_tool(functools.partial(_forecast, days=3), side_effect="pure", kind="readonly")
    assert set(tool.input_schema["properties"]) == {"city"}
    pipeline = ToolPipeline([tool])
    record = await pipeline.execute(ToolCall("c1", "_forecast", {"city": "Oslo", "days": 30}))
    assert record.result.error is not None and record.result.error.code == "invalid_input"
    assert (await pipeline.execute(ToolCall("c2", "_forecast", {"city": "Oslo"}))).result.output == "Oslo for 3 days"


async def test_an_input_class_tool_may_take_no_context_or_take_it_by_keyword() -> None:
    @define_tool(side_effect="pure", kind="readonly")
    async def plain(query: Forecast) -> str:
        """Without a context."""
        return f"{query.city} for {query.days} days"

    @define_tool(side_effect="pure", kind="readonly")
    async def keyword(query: Forecast, *, context: ToolContext) -> str:
        """With the context by keyword."""
        return f"{query.city} in call {context.tool_call_id}"

    pipeline = ToolPipeline([plain, keyword])
    assert (await pipeline.execute(ToolCall("c1", "plain", {"city": "Oslo"}))).result.output == "Oslo for 1 days"
    assert (await pipeline.execute(ToolCall("c2", "keyword", {"city": "Rome"}))).result.output == "Rome in call c2"


@pytest.mark.parametrize("where", ["before the context", "after the context", "instead of the context"])
def test_a_parameter_beside_an_input_class_without_a_default_is_refused_naming_it(where: str) -> None:
    async def before(query: Forecast, limit: int, ctx: ToolContext) -> str:
        return ""

    async def after(query: Forecast, ctx: ToolContext, limit: int) -> str:
        return ""

    async def instead(query: Forecast, limit: int) -> str:
        return ""

    run = {"before the context": before, "after the context": after, "instead of the context": instead}[where]
    with pytest.raises(ToolDefinitionError, match=r"run takes parameter 'limit' \(without a default\), but it is"):
        define_tool(run, name="search", description="Search.", side_effect="pure")


async def test_parameters_with_defaults_beside_the_input_keep_them() -> None:
    tools = []
    for kind in ("a", "b"):

        async def bound(input: dict[str, Any], ctx: ToolContext, kind: str = kind) -> str:
            return f"{kind} in call {ctx.tool_call_id}"

        tools.append(
            define_tool(
                bound, name=f"bound_{kind}", description="d", side_effect="pure", input_schema={"type": "object"}
            )
        )

    async def limited(query: Forecast, limit: int = 5, ctx: ToolContext | None = None) -> str:
        assert ctx is not None  # given by keyword: `limit` keeps its default
        return f"{query.city} x{limit} in call {ctx.tool_call_id}"

    tools.append(define_tool(limited, description="d", side_effect="pure"))
    pipeline = ToolPipeline(tools)
    assert (await pipeline.execute(ToolCall("c1", "bound_a", {}))).result.output == "a in call c1"
    assert (await pipeline.execute(ToolCall("c2", "bound_b", {}))).result.output == "b in call c2"
    record = await pipeline.execute(ToolCall("c3", "limited", {"city": "Oslo"}))
    assert record.result.output == "Oslo x5 in call c3"


def test_a_schema_tool_must_take_its_input_positionally() -> None:
    async def keyword_only(*, input: dict[str, Any], ctx: Any) -> str:
        return ""

    with pytest.raises(ToolDefinitionError, match="run must take the input as its first positional parameter"):
        define_tool(keyword_only, description="d", side_effect="pure", input_schema={"type": "object"})


async def test_schema_tools_keep_their_context_by_position_whatever_its_name() -> None:
    async def named(input: dict[str, Any], context) -> str:  # type: ignore[no-untyped-def]
        return context.tool_call_id  # type: ignore[no-any-return]

    async def spread(*args: Any) -> str:
        return str(args[1].tool_call_id)

    tools = [
        define_tool(run, description="d", side_effect="pure", input_schema={"type": "object"})
        for run in (named, spread)
    ]
    assert tools[0].run is named and tools[1].run is spread  # called as they are
    pipeline = ToolPipeline(tools)
    assert (await pipeline.execute(ToolCall("c1", "named", {}))).result.output == "c1"
    assert (await pipeline.execute(ToolCall("c2", "spread", {}))).result.output == "c2"


def test_an_unannotated_parameter_is_a_clear_error() -> None:
    with pytest.raises(ToolDefinitionError, match="annotate parameter 'city'"):

        @define_tool(side_effect="pure", kind="readonly")
        async def untyped(city, ctx) -> str:  # type: ignore[no-untyped-def]
            """No types."""
            return ""


def test_var_arguments_are_refused() -> None:
    with pytest.raises(ToolDefinitionError, match=r"\*args"):

        @define_tool(side_effect="pure", kind="readonly")
        async def spread(*args: str) -> str:
            """Spread."""
            return ""


async def test_a_first_tool_written_with_plain_typed_parameters_works_in_a_session() -> None:
    model = TestModel({"weather?": [Reply(tool_calls=[("weather", {"city": "Rome"})]), Reply(text="nice")]})
    async with open_session(provider=model, tools=[weather]) as session:
        assert await session.send("weather?") == "nice"
    answer = next(m for m in model.requests[1].messages if type(m).__name__ == "ToolResultMessage")
    assert answer.content == "sunny in Rome (celsius)"


async def test_a_recursive_pydantic_model_input_has_its_properties_at_the_top() -> None:
    # Its schema was {"$defs": {"Folder": {...}}, "$ref": "#/$defs/Folder", "type": "object"}: no
    # top-level properties for the model to read, and no default signature field ("path" was not
    # found, so a `Tree:/etc/*` rule could never match a call).
    pydantic = pytest.importorskip("pydantic")

    class Folder(pydantic.BaseModel):  # type: ignore[misc,name-defined]
        path: str
        children: list[Folder] = []  # noqa: RUF012 (pydantic copies a default)

    def count(folder: Any) -> int:
        return 1 + sum(count(child) for child in folder.children)

    @define_tool(side_effect="pure", kind="readonly", input_type=Folder)
    async def tree(root: Any, ctx: Any) -> int:
        """Count the folders of a tree."""
        return count(root)

    schema = tree.input_schema
    assert "$ref" not in schema
    assert set(schema["properties"]) == {"path", "children"} and schema["required"] == ["path"]
    assert schema["properties"]["children"]["items"] == {"$ref": "#/$defs/Folder"}  # the recursion
    assert tree.signature_field == "path"
    assert tree.signature_content_for({"path": "/etc//ssh"}) == "/etc/ssh"
    pipeline = ToolPipeline([tree])
    ok = await pipeline.execute(ToolCall("c1", "tree", {"path": "/", "children": [{"path": "/a"}, {"path": "/b"}]}))
    assert ok.result.output == 3
    bad = await pipeline.execute(ToolCall("c2", "tree", {"path": "/", "children": [{"path": 3}]}))
    assert bad.result.error is not None and "at children/0/path" in bad.result.error.message


def test_inline_top_ref_leaves_what_it_cannot_inline_as_it_is() -> None:
    from trio_agent._tools._schema import inline_top_ref

    node = {"type": "object", "properties": {"next": {"$ref": "#/$defs/N"}}}
    assert inline_top_ref({"$defs": {"N": node}, "$ref": "#/$defs/N"}) == {**node, "$defs": {"N": node}}
    assert inline_top_ref({"$defs": {"a/b": node}, "$ref": "#/$defs/a~1b"})["properties"] == node["properties"]
    for kept in (
        {"$ref": "https://example.com/schema"},  # not into its own $defs
        {"$defs": {"N": node}, "$ref": "#/$defs/M"},  # names nothing
        {"$defs": {"N": node}, "$ref": "#/$defs/N", "type": "array"},  # a sibling the definition contradicts
        {"type": "object", "properties": {}},  # no $ref
    ):
        assert inline_top_ref(kept) is kept


async def test_a_fixed_length_tuple_parameter_wants_exactly_its_items() -> None:
    # The schema had prefixItems and items: false but no minItems: [1] passed the schema check and
    # failed only when structured ("invalid value @ $.pair"), after the permission stages.
    @define_tool(side_effect="pure", kind="readonly")
    async def label(pair: tuple[int, str]) -> str:
        """Label a number."""
        return f"{pair[0]}={pair[1]}"

    assert label.input_schema["properties"]["pair"] == {
        "type": "array",
        "prefixItems": [{"type": "integer"}, {"type": "string"}],
        "items": False,
        "minItems": 2,
        "maxItems": 2,
    }
    pipeline = ToolPipeline([label])
    ok = await pipeline.execute(ToolCall("c1", "label", {"pair": [1, "one"]}))
    assert ok.result.output == "1=one"
    for short in ([1], []):
        record = await pipeline.execute(ToolCall(f"c-{len(short)}", "label", {"pair": short}))
        assert record.result.error is not None and "has less than 2 items" in record.result.error.message


class Corner(enum.Enum):
    TOP_LEFT = (0, 0)
    BOTTOM_RIGHT = (1, 1)


class Mode(enum.Enum):
    FAST = "fast"


@pytest.mark.parametrize(
    ("annotation", "value"),
    [
        (Corner, "(0, 0) (tuple)"),
        (Literal[(0, 0),], "(0, 0) (tuple)"),  # one value, a tuple
        (Literal[b"raw"], "b'raw' (bytes)"),
        (Literal[Mode.FAST], "<Mode.FAST: 'fast'> (Mode)"),  # a member, not its value
        (Literal[float("nan")], "nan (float)"),
        (Corner | None, "(0, 0) (tuple)"),  # in a union too
    ],
)
def test_a_literal_or_enum_with_values_that_are_no_json_scalars_is_refused_at_definition(
    annotation: Any, value: str
) -> None:
    # Corner's schema was {"enum": [(0, 0), (1, 1)]}: no JSON, and no input could ever match it
    # (the model's [0, 0] failed as "invalid value for type, expected Corner").
    async def place(where: Any) -> str:
        return "placed"

    place.__annotations__ = {"where": annotation, "return": str}
    with pytest.raises(ToolDefinitionError, match="must be JSON scalars") as info:
        define_tool(place, side_effect="pure", description="Place it.")
    assert f"has the value {value}" in str(info.value)


@pytest.mark.parametrize(
    ("annotation", "given", "expected"),
    [
        (Literal[1, "a"], 1.0, 1),
        (Literal[1, "a"], 1, 1),
        (Literal[1, "a"], "a", "a"),
        (Literal[2.0, "a"], 2, 2.0),
        (Literal[2.5], 2.5, 2.5),
        (Literal[True, 1], True, True),
        (Literal[True, 1], 1, 1),
        (Literal[True, 1], 1.0, 1),
        (Literal[False, 0], 0.0, 0),
        (Literal[None, "a"], None, None),
        (Literal[1, "a"] | None, 1.0, 1),  # in a union too
        (Literal[1, True] | None, True, True),
    ],
)
async def test_a_literal_field_holds_the_declared_value_the_input_equals(
    annotation: Any, given: Any, expected: Any
) -> None:
    # The model's 1.0 for a Literal[1, "a"] field passed the schema (enum compares numbers by value)
    # and stayed the float 1.0: cattrs' Literal hook returns what it was given, so the input held a
    # value that is none of the Literal's (an int field or an Enum of 1 gets 1 and the member).
    seen: list[Any] = []

    async def pick(value: Any) -> str:
        seen.append(value)
        return "picked"

    pick.__annotations__ = {"value": annotation, "return": str}
    tool = define_tool(pick, side_effect="pure", description="Pick one.")
    record = await ToolPipeline([tool]).execute(ToolCall("c1", "pick", {"value": given}))
    assert record.result.ok
    assert seen == [expected]
    assert type(seen[0]) is type(expected)


@pytest.mark.parametrize(
    ("annotation", "given"),
    [
        (Literal[1], True),  # True == 1 in Python, not in JSON
        (Literal[True], 1),
        (Literal[True], 1.0),
        (Literal[0], False),
        (Literal["1"], 1),
        (Literal[1], "1"),
        (Literal[1], 1.5),
        (Literal[1, "a"] | None, True),
    ],
)
def test_a_literal_field_refuses_a_value_of_another_json_kind_when_structured(annotation: Any, given: Any) -> None:
    # The schema check refuses these first in the pipeline; structure_input, asked directly, took
    # True for Literal[1] (Python's True == 1) and kept it as True.
    async def pick(value: Any) -> str:
        return "picked"

    pick.__annotations__ = {"value": annotation, "return": str}
    tool = define_tool(pick, side_effect="pure", description="Pick one.")
    assert tool.input_errors({"value": given})  # the schema refuses it too
    with pytest.raises(ToolInputError, match=r"@ \$\.value"):
        tool.structure_input({"value": given})


@pytest.mark.parametrize("optional", ["union", "Optional"])
async def test_an_optional_context_parameter_under_another_name_takes_the_context(optional: str) -> None:
    # `context: ToolContext | None = None` was taken as an input field: define_tool failed trying
    # to write ToolContext's schema ("cannot express type AbortHandle"), unless it was named ctx.
    async def where(city: str, context: ToolContext | None = None) -> str:
        """Where a call runs."""
        assert context is not None
        return f"{city} in call {context.tool_call_id}"

    if optional == "Optional":
        where.__annotations__["context"] = typing.Optional[ToolContext]  # noqa: UP045 - that spelling on purpose
    tool = define_tool(where, side_effect="pure", kind="readonly")
    assert set(tool.input_schema["properties"]) == {"city"}
    record = await ToolPipeline([tool]).execute(ToolCall("c1", "where", {"city": "Paris"}))
    assert record.result.output == "Paris in call c1"
    # One rule for a signature's parameters and for run(input, ctx): a list of contexts is no context.
    with pytest.raises(ToolDefinitionError, match="'contexts'"):

        @define_tool(side_effect="pure", kind="readonly", input_schema={"type": "object"})
        async def many(input: dict[str, Any], contexts: list[ToolContext]) -> str:
            """Not a context."""
            return "x"
