"""Plugins: definition-time validation, names, resolution order (middleware onion, hooks), the tool registry
with sources and trust levels, duplicates, and plugin hooks and tools running through a real pipeline."""

from __future__ import annotations

import string
from collections.abc import Awaitable, Callable
from typing import Any

import attrs
import pytest
from hypothesis import given
from hypothesis import strategies as st

from trio_agent import ConfigError, ModelMiddleware, Tool, ToolResult, define_tool
from trio_agent._session._hooks import HookEvent, HookInput, HookOutput, HookRegistry, HookRunner, pre_tool_stage
from trio_agent._session._plugins import (
    PLUGIN_NAME_PATTERN,
    MiddlewareConfig,
    MiddlewareConfigError,
    Plugin,
    RegisteredTool,
    TrustLevel,
    define_plugin,
    resolve_plugins,
)
from trio_agent.middleware import MiddlewareShapeError
from trio_agent.models import ModelRequest, ModelResponse, ModelService, UserMessage
from trio_agent.plugins import UnknownToolError
from trio_agent.testing import Reply, TestModel, call_tool
from trio_agent.tools import InMemoryToolJournal, ToolMiddlewareRequest, ToolPipeline, ToolStages

# -- helpers -------------------------------------------------------------------


def make_tool(name: str, log: list[str] | None = None) -> Tool[Any]:
    async def run(inp: dict[str, Any], ctx: Any) -> ToolResult:
        if log is not None:
            log.append(f"tool:{name}")
        return ToolResult.success(f"{name}:{inp.get('q', '')}")

    return define_tool(
        run,
        name=name,
        description=name,
        side_effect="pure",
        input_schema={"type": "object", "properties": {"q": {"type": "string"}}},
    )


def tool_layer(tag: str, log: list[str]) -> Callable[[ToolMiddlewareRequest, Any], Awaitable[ToolResult]]:
    async def layer(request: ToolMiddlewareRequest, call_next: Any) -> ToolResult:
        log.append(f"{tag}:before")
        result: ToolResult = await call_next()
        log.append(f"{tag}:after")
        return result

    layer.__qualname__ = tag
    return layer


class ModelLayer(ModelMiddleware):
    def __init__(self, tag: str, log: list[str]) -> None:
        self.tag = tag
        self.log = log

    async def wrap_chat(
        self, request: ModelRequest, call_next: Callable[[ModelRequest | None], Awaitable[ModelResponse]]
    ) -> ModelResponse:
        self.log.append(f"{self.tag}:before")
        response: ModelResponse = await call_next(None)
        self.log.append(f"{self.tag}:after")
        return response


def hook(tag: str, log: list[str], output: HookOutput | None = None) -> Any:
    async def callback(inp: HookInput) -> HookOutput | None:
        log.append(tag)
        return output

    callback.__qualname__ = tag
    return callback


# -- names ------------------------------------------------------------------------


def is_valid_name(name: str) -> bool:
    """An oracle written without the regex."""
    allowed = set(string.ascii_lowercase + string.digits + "._-")
    edges = set(string.ascii_lowercase + string.digits)
    return 1 <= len(name) <= 64 and set(name) <= allowed and name[0] in edges and name[-1] in edges


@pytest.mark.parametrize("name", ["a", "9", "a.b_c-d", "x" * 64, "0-0", "my.plugin2"])
def test_valid_names(name: str) -> None:
    assert define_plugin(name=name).name == name


@pytest.mark.parametrize(
    "name", ["", "A", "Audit", "-a", "a-", ".a", "a_", "a" * 65, "a\n", "a b", "é", "a/b", None, 3, b"abc"]
)
def test_invalid_names_raise_config_error(name: Any) -> None:
    with pytest.raises(ConfigError, match="must be 1-64 lowercase letters, numbers, dots, underscores, or hyphens"):
        define_plugin(name=name)


@given(name=st.text(alphabet=string.ascii_letters + string.digits + "._-/ \n\té", max_size=70))
def test_random_names_are_accepted_exactly_when_the_rule_allows(name: str) -> None:
    if is_valid_name(name):
        assert define_plugin(name=name).source_id == f"plugin:{name}"
    else:
        with pytest.raises(ConfigError):
            define_plugin(name=name)


@given(name=st.from_regex(PLUGIN_NAME_PATTERN, fullmatch=True))
def test_every_name_matching_the_pattern_is_valid(name: str) -> None:
    assert is_valid_name(name)
    assert define_plugin(name=name).name == name


# -- middleware config ------------------------------------------------------------


def test_middleware_config_freezes_lists_as_tuples() -> None:
    log: list[str] = []
    layer, model = tool_layer("t", log), ModelLayer("m", log)
    config = MiddlewareConfig(model=[model], tool=[layer])
    assert config.model == (model,)
    assert config.tool == (layer,)
    assert MiddlewareConfig() == MiddlewareConfig(model=(), tool=())


def _sync_layer(request: Any, call_next: Any) -> Any:
    return None


async def _one_arg(request: Any) -> Any:
    return None


class NoWrappers(ModelMiddleware):
    pass


class SyncChat(ModelMiddleware):
    def wrap_chat(self, request: Any, call_next: Any) -> Any:
        return None


class CoroutineStream(ModelMiddleware):
    async def wrap_stream(self, request: Any, call_next: Any) -> Any:  # type: ignore[override]
        return None


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"tool": "abc"}, "must be a sequence"),
        ({"tool": _sync_layer}, "must be a sequence"),
        ({"tool": [42]}, "not callable"),
        ({"tool": [_sync_layer]}, "async def"),
        ({"tool": [_one_arg]}, "positional arguments"),
        ({"model": [NoWrappers()]}, "defines none of"),
        ({"model": [SyncChat()]}, "wrap_chat must be an async def"),
        ({"model": [CoroutineStream()]}, "must return an async iterator"),
        ({"model": {"a": 1}}, "must be a sequence"),
    ],
)
def test_middleware_config_rejects_bad_layers_at_registration(kwargs: dict[str, Any], fragment: str) -> None:
    with pytest.raises(MiddlewareConfigError) as info:
        MiddlewareConfig(**kwargs)
    assert fragment in str(info.value)
    assert isinstance(info.value, ConfigError)
    assert isinstance(info.value, MiddlewareShapeError)


# -- define_plugin validation --------------------------------------------------------


def test_define_plugin_validates_every_part() -> None:
    with pytest.raises(ConfigError, match="must be a MiddlewareConfig"):
        define_plugin(name="p", middleware={"tool": []})  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"did you mean HookEvent\.STOP"):
        define_plugin(name="p", hooks={"Stop": [hook("h", [])]})  # type: ignore[dict-item]
    with pytest.raises(ConfigError, match=r"plugin:p hooks\[STOP\]\[0\]"):
        define_plugin(name="p", hooks={HookEvent.STOP: [lambda inp: None]})  # type: ignore[list-item,return-value]
    with pytest.raises(ConfigError, match="expected a Tool"):
        define_plugin(name="p", tools=[object()])  # type: ignore[list-item]
    with pytest.raises(ConfigError, match="must be a sequence of Tool"):
        define_plugin(name="p", tools=make_tool("t"))  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="defines tool 't' twice"):
        define_plugin(name="p", tools=[make_tool("t"), make_tool("t")])


def test_define_plugin_records_its_parts_with_its_source() -> None:
    log: list[str] = []
    cb = hook("h", log)
    tool = make_tool("review")
    plugin = define_plugin(name="review", hooks={HookEvent.USER_PROMPT_SUBMIT: [cb]}, tools=[tool])
    assert isinstance(plugin, Plugin)
    assert plugin.middleware == MiddlewareConfig()
    assert plugin.tools == (tool,)
    (entry,) = plugin.hooks.for_event(HookEvent.USER_PROMPT_SUBMIT)
    assert (entry.callback, entry.source) == (cb, "plugin:review")


# -- resolution: order -----------------------------------------------------------------


async def test_tool_middleware_onion_is_session_then_plugins_in_order() -> None:
    log: list[str] = []
    session = MiddlewareConfig(tool=[tool_layer("s1", log), tool_layer("s2", log)])
    p1 = define_plugin(name="p1", middleware=MiddlewareConfig(tool=[tool_layer("p1a", log), tool_layer("p1b", log)]))
    p2 = define_plugin(name="p2", middleware=MiddlewareConfig(tool=[tool_layer("p2", log)]))
    resolved = resolve_plugins(session, [p1, p2], [make_tool("t", log)], [])
    assert [layer.__qualname__ for layer in resolved.tool_middleware] == ["s1", "s2", "p1a", "p1b", "p2"]

    pipeline = ToolPipeline([entry.tool for entry in resolved.tools], middleware=resolved.tool_middleware)
    record = await call_tool(pipeline, "t", {"q": "x"})
    assert record.result.output == "t:x"
    order = ["s1", "s2", "p1a", "p1b", "p2"]
    assert log == [f"{t}:before" for t in order] + ["tool:t"] + [f"{t}:after" for t in reversed(order)]


async def test_model_middleware_onion_is_session_then_plugins_in_order() -> None:
    log: list[str] = []
    session = MiddlewareConfig(model=[ModelLayer("s", log)])
    p1 = define_plugin(name="p1", middleware=MiddlewareConfig(model=[ModelLayer("p1a", log), ModelLayer("p1b", log)]))
    p2 = define_plugin(name="p2", middleware=MiddlewareConfig(model=[ModelLayer("p2", log)]))
    resolved = resolve_plugins(session, [p1, p2], [], [])
    service = ModelService(TestModel(default=Reply("hi")), resolved.model_middleware)
    response = await service.chat([UserMessage("hello")])
    assert response.message.parts[0].text == "hi"  # type: ignore[union-attr]
    order = ["s", "p1a", "p1b", "p2"]
    assert log == [f"{t}:before" for t in order] + [f"{t}:after" for t in reversed(order)]


def test_no_session_middleware_means_plugins_only() -> None:
    log: list[str] = []
    layer = tool_layer("p", log)
    resolved = resolve_plugins(None, [define_plugin(name="p", middleware=MiddlewareConfig(tool=[layer]))])
    assert resolved.tool_middleware == (layer,)
    assert resolved.model_middleware == ()
    assert resolved.tools == ()


async def test_session_hooks_run_before_plugin_hooks_in_plugin_order() -> None:
    log: list[str] = []
    p1 = define_plugin(name="one", hooks={HookEvent.SESSION_START: [hook("one:a", log), hook("one:b", log)]})
    p2 = define_plugin(name="two", hooks={HookEvent.SESSION_START: [hook("two", log)], HookEvent.STOP: []})
    resolved = resolve_plugins(None, [p1, p2], session_hooks={HookEvent.SESSION_START: [hook("session", log)]})
    sources = [entry.source for entry in resolved.hooks.for_event(HookEvent.SESSION_START)]
    assert sources == ["session", "plugin:one", "plugin:one", "plugin:two"]
    decision = await HookRunner(resolved.hooks).dispatch(
        HookEvent.SESSION_START, HookInput(event=HookEvent.SESSION_START, session_id="s")
    )
    assert log == ["session", "one:a", "one:b", "two"]
    assert decision.ran == ("session", "one:a", "one:b", "two")


def test_session_hooks_may_be_a_registry() -> None:
    registry = HookRegistry({HookEvent.STOP: [hook("s", [])]})
    resolved = resolve_plugins(None, [], session_hooks=registry)
    assert [entry.name for entry in resolved.hooks.for_event(HookEvent.STOP)] == ["s"]
    with pytest.raises(ConfigError):
        resolve_plugins(None, [], session_hooks={"stop": []})  # type: ignore[dict-item]


# -- resolution: tools --------------------------------------------------------------------


def test_tools_get_sources_and_trust_levels_in_registration_order() -> None:
    builtin, mine, theirs = make_tool("Read"), make_tool("mine"), make_tool("review")
    resolved = resolve_plugins(None, [define_plugin(name="rev", tools=[theirs])], [builtin], [mine])
    assert resolved.tools == (
        RegisteredTool(builtin, "builtin", TrustLevel.TRUSTED),
        RegisteredTool(mine, "session", TrustLevel.TRUSTED),
        RegisteredTool(theirs, "plugin:rev", TrustLevel.WORKSPACE),
    )
    assert resolved.tool("review").source_id == "plugin:rev"
    assert resolved.tool("review").trust_level.value == "workspace"
    with pytest.raises(UnknownToolError, match="no tool named 'missing' is registered") as caught:
        resolved.tool("missing")
    assert isinstance(caught.value, ConfigError) and isinstance(caught.value, KeyError)  # typed, and still a lookup


@pytest.mark.parametrize(
    ("builtins", "session", "plugin_tools", "sources"),
    [
        (["x"], ["x"], [], "by builtin and session"),
        (["x"], [], ["x"], "by builtin and plugin:a"),
        ([], ["x"], ["x"], "by session and plugin:a"),
        ([], ["x", "x"], [], "registered twice"),
    ],
)
def test_a_duplicate_tool_name_rejects_the_session_naming_both_sources(
    builtins: list[str], session: list[str], plugin_tools: list[str], sources: str
) -> None:
    plugin = define_plugin(name="a", tools=[make_tool(n) for n in plugin_tools])
    with pytest.raises(ConfigError) as info:
        resolve_plugins(None, [plugin], [make_tool(n) for n in builtins], [make_tool(n) for n in session])
    assert "duplicate tool name 'x'" in str(info.value)
    assert sources in str(info.value)
    assert "nothing is silently replaced" in str(info.value)


def test_a_duplicate_tool_across_two_plugins_names_both() -> None:
    a = define_plugin(name="a", tools=[make_tool("x")])
    b = define_plugin(name="b", tools=[make_tool("x")])
    with pytest.raises(ConfigError, match="by plugin:a and plugin:b"):
        resolve_plugins(None, [a, b])


def test_duplicate_plugins_and_non_plugins_are_rejected() -> None:
    with pytest.raises(ConfigError, match="'audit' is registered more than once"):
        resolve_plugins(None, [define_plugin(name="audit"), define_plugin(name="audit")])
    with pytest.raises(ConfigError, match="define_plugin"):
        resolve_plugins(None, [{"name": "x"}])  # type: ignore[list-item]
    with pytest.raises(ConfigError):
        resolve_plugins({"tool": []}, [])  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="session tools"):
        resolve_plugins(None, [], [], [object()])  # type: ignore[list-item]
    with pytest.raises(ConfigError, match="plugins must be a sequence"):
        resolve_plugins(None, define_plugin(name="p"))  # type: ignore[arg-type]


def test_plugin_tools_pass_the_same_filters_as_every_tool() -> None:
    plugin = define_plugin(name="rev", tools=[make_tool("review"), make_tool("lint")])
    resolved = resolve_plugins(None, [plugin], [make_tool("Read")], [make_tool("mine")])

    def names(**kwargs: Any) -> list[str]:
        return [entry.name for entry in resolved.select(**kwargs)]

    assert names() == ["Read", "mine", "review", "lint"]
    assert names(allowed=["Read", "review"]) == ["Read", "review"]
    assert names(allowed=[]) == []
    assert names(disallowed=["lint"]) == ["Read", "mine", "review"]
    assert names(allowed=["review", "lint"], disallowed=["review"]) == ["lint"]
    with pytest.raises(ConfigError):
        resolved.select(allowed="review")
    assert names(allowed=iter(["Read", "lint"]), disallowed=(n for n in ["lint"])) == ["Read"]  # read once
    for bad in ({"allowed": 5}, {"disallowed": 5}, {"allowed": [None]}, {"disallowed": {"lint": 1}}):
        with pytest.raises(ConfigError, match="must be a list of tool names"):
            resolved.select(**bad)


def test_plugins_md_documents_select_as_it_is() -> None:
    import inspect
    import re
    from pathlib import Path

    from trio_agent._session._plugins import ResolvedPlugins

    text = (Path(__file__).resolve().parent.parent / "docs" / "plugins.md").read_text()
    documented = re.findall(r"select\(((?:[^()]|\(\))*)\)", text)  # `()` may stand inside: `disallowed=()`
    assert documented  # the page shows the call
    parameters = set(inspect.signature(ResolvedPlugins.select).parameters) - {"self"}
    for arguments in documented:
        # Every keyword the page names (`allowed=None`, `*, disallowed=()`) is one select takes.
        named = set(re.findall(r"(\w+)\s*=", arguments))
        assert named <= parameters, f"docs/plugins.md: select({arguments}) names {named - parameters}"


def test_plugins_md_names_the_modules_that_export_each_name() -> None:
    """Each "`a`, `b` and `c` ... from `module`" list of the page's export sentence is true of that
    module's ``__all__`` (it once placed TrustLevel in trio_agent and called the public
    resolve_plugins/ResolvedPlugins/RegisteredTool internal)."""
    import importlib
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parent.parent / "docs" / "plugins.md").read_text()
    start = text.index("`define_plugin`, `Plugin` and `MiddlewareConfig` are exported")
    sentence = text[start : text.index(". ", start)]
    names = r"(?:`\w+`(?:,\s*|\s+and\s+))*`\w+`"
    claims = re.findall(rf"({names})\s+(?:are exported\s+)?from\s+`(trio_agent[\w.]*)`", sentence)
    assert {module for _, module in claims} == {"trio_agent", "trio_agent.plugins"}
    for listed, module in claims:
        exported = importlib.import_module(module).__all__
        for name in re.findall(r"`(\w+)`", listed):
            assert name in exported, f"docs/plugins.md says {name} is exported from {module}"
    assert "internal (`trio_agent._session._plugins`)" not in text


# -- end to end: plugin hooks and tools in one pipeline ------------------------------------------


async def test_plugin_hook_and_tool_run_in_the_pipeline_after_session_hooks() -> None:
    log: list[str] = []

    async def session_hook(inp: HookInput) -> HookOutput:
        log.append(f"session:{inp.tool_input}")
        return HookOutput.modify({"q": "from-session"})

    async def plugin_hook(inp: HookInput) -> HookOutput:
        # The original input, not the session hook's modification.
        log.append(f"plugin:{inp.tool_input}")
        return HookOutput.modify({"q": "from-plugin"})

    plugin = define_plugin(
        name="rev",
        hooks={HookEvent.PRE_TOOL_USE: [plugin_hook]},
        tools=[make_tool("review", log)],
        middleware=MiddlewareConfig(tool=[tool_layer("rev-mw", log)]),
    )
    resolved = resolve_plugins(
        MiddlewareConfig(tool=[tool_layer("session-mw", log)]),
        [plugin],
        session_hooks={HookEvent.PRE_TOOL_USE: [session_hook]},
    )
    journal = InMemoryToolJournal()
    pipeline = ToolPipeline(
        [entry.tool for entry in resolved.tools],
        middleware=resolved.tool_middleware,
        stages=ToolStages(pre_tool=[pre_tool_stage(HookRunner(resolved.hooks))]),
        journal=journal,
    )
    record = await call_tool(pipeline, "review", {"q": "orig"}, call_id="c1")
    assert log == [
        "session-mw:before",
        "rev-mw:before",
        "session:{'q': 'orig'}",
        "plugin:{'q': 'orig'}",
        "tool:review",
        "rev-mw:after",
        "session-mw:after",
    ]
    assert record.result.output == "review:from-plugin"  # later modifications win the shallow merge
    assert journal.kinds("c1") == ["scheduled", "started", "settled"]


async def test_a_raising_plugin_hook_denies_a_plugin_tool_without_wedging() -> None:
    log: list[str] = []

    async def broken(inp: HookInput) -> None:
        raise RuntimeError("plugin bug")

    plugin = define_plugin(name="rev", hooks={HookEvent.PRE_TOOL_USE: [broken]}, tools=[make_tool("review", log)])
    resolved = resolve_plugins(None, [plugin])
    pipeline = ToolPipeline(
        [entry.tool for entry in resolved.tools],
        stages=ToolStages(pre_tool=[pre_tool_stage(HookRunner(resolved.hooks))]),
    )
    first = await call_tool(pipeline, "review", {"q": "a"})
    second = await call_tool(pipeline, "review", {"q": "b"})
    for record in (first, second):
        assert record.result.error is not None
        assert record.result.error.code == "hook_error"
        assert "(plugin:rev) failed" in record.result.output
    assert log == []


# -- order is layer order: only sequences; a Plugin built directly is checked too ----------------------


def _unordered(items: list[Any]) -> list[Any]:
    """The unordered (or one-pass) collections a list was given as."""
    return [set(items), frozenset(items), (item for item in items), dict.fromkeys(items).keys()]


def test_middleware_must_be_a_sequence_not_an_unordered_collection() -> None:
    # MiddlewareConfig(tool={...}) was taken, in the set's order (the error text said "sequence").
    log: list[str] = []
    layers = [tool_layer(f"t{index}", log) for index in range(4)]
    models = [ModelLayer(f"m{index}", log) for index in range(4)]
    for value in _unordered(layers):
        with pytest.raises(MiddlewareConfigError, match="tool middleware must be a sequence"):
            MiddlewareConfig(tool=value)
    for value in _unordered(models):
        with pytest.raises(MiddlewareConfigError, match="model middleware must be a sequence"):
            MiddlewareConfig(model=value)
    assert MiddlewareConfig(tool=tuple(layers)).tool == tuple(layers)


def test_plugins_and_tools_must_be_sequences_not_unordered_collections() -> None:
    plugins = [define_plugin(name=name) for name in ("a", "b", "c")]
    for value in _unordered(plugins):
        with pytest.raises(ConfigError, match="plugins must be a sequence of Plugin"):
            resolve_plugins(None, value)
    tools = [make_tool(name) for name in ("t1", "t2", "t3")]
    for value in _unordered(tools):
        with pytest.raises(ConfigError, match="tools must be a sequence of Tool"):
            define_plugin(name="p", tools=value)
        with pytest.raises(ConfigError, match="session tools must be a sequence of Tool"):
            resolve_plugins(None, [], [], value)
    assert [entry.name for entry in resolve_plugins(None, (), (), tuple(tools)).tools] == ["t1", "t2", "t3"]


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"middleware": "junk"}, r"plugin 'x': middleware must be a MiddlewareConfig"),
        ({"middleware": None}, r"plugin 'x': middleware must be a MiddlewareConfig"),
        ({"name": "Not Valid!"}, r"plugin name 'Not Valid!' is invalid"),
        ({"name": 5}, r"plugin name 5 is invalid"),
        ({"hooks": {}}, r"plugin 'x': hooks must be a HookRegistry"),
        ({"tools": [object()]}, r"plugin 'x': expected a Tool"),
        ({"tools": {make_tool("t")}}, r"plugin 'x': tools must be a sequence of Tool"),
        ({"tools": (make_tool("t"), make_tool("t"))}, r"plugin 'x' defines tool 't' twice"),
    ],
)
def test_a_plugin_built_directly_is_checked_as_define_plugin_checks_it(fields: dict[str, Any], match: str) -> None:
    # Plugin("x", "junk", ...) reached resolve_plugins and failed there with an AttributeError; a bad
    # name was taken and became the tools' source ("plugin:Not Valid!").
    parts: dict[str, Any] = {"name": "x", "middleware": MiddlewareConfig(), "hooks": HookRegistry(), "tools": ()}
    with pytest.raises(ConfigError, match=match):
        Plugin(**{**parts, **fields})
    with pytest.raises(ConfigError, match=match):
        attrs.evolve(define_plugin(name="x"), **fields)
    plugin = Plugin(**parts)
    assert (plugin.name, plugin.middleware, plugin.tools, plugin.source_id) == ("x", MiddlewareConfig(), (), "plugin:x")
    assert Plugin(**{**parts, "tools": [make_tool("t")]}).tools[0].name == "t"  # a list is kept, as a tuple


async def _stop_hook(inp: HookInput) -> None:
    return None


@pytest.mark.parametrize(
    "source", ["session", "plugin:y", "builtin"], ids=["default-session", "another-plugin", "other"]
)
def test_a_plugin_built_directly_refuses_hooks_of_another_source(source: str) -> None:
    # docs/plugins.md: hooks is a HookRegistry whose source is "plugin:<name>"; a registry of another
    # source was taken, and its hooks' failures and decisions named the wrong owner.
    own = HookRegistry({HookEvent.STOP: [_stop_hook]}, source="plugin:x")
    other = HookRegistry({HookEvent.PRE_TOOL_USE: [_stop_hook]}, source=source)
    match = rf"plugin 'x': hooks must be a HookRegistry with source 'plugin:x', .* of PreToolUse has source '{source}'"
    for hooks in (other, HookRegistry.combine(own, other)):
        with pytest.raises(ConfigError, match=match):
            Plugin("x", MiddlewareConfig(), hooks, ())
    plugin = Plugin("x", MiddlewareConfig(), own, ())
    assert [entry.source for entry in plugin.hooks.for_event(HookEvent.STOP)] == ["plugin:x"]
    assert Plugin("x", MiddlewareConfig(), HookRegistry(), ()).hooks.events == frozenset()  # empty: any source
    # Renaming a plugin that has hooks would leave them named after the old one.
    with pytest.raises(ConfigError, match="source 'plugin:z'"):
        attrs.evolve(plugin, name="z")
    assert attrs.evolve(define_plugin(name="x"), name="z").source_id == "plugin:z"
