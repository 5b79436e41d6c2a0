"""Capabilities: typed values a middleware provides in ``setup`` and others read (spec
``requires`` / ``provides`` / ``optionalRequires`` / ``setup``; notes §4)."""

from __future__ import annotations

import copy
import logging
from pathlib import Path
from typing import Any

import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st
from typecheck import mypy_strict

from trio_agent import ConfigError, chat
from trio_agent.lifecycle import (
    Capability,
    CapabilityError,
    CapabilityRegistry,
    ChatMiddleware,
    ErrorInfo,
    RunContext,
    create_capability,
    define_chat_middleware,
    middleware_lifecycle,
    validate_capabilities,
)
from trio_agent.middleware import MiddlewareShapeError
from trio_agent.models import ModelService
from trio_agent.testing import Reply, TestModel


class Database:
    def __init__(self, url: str = "memory://") -> None:
        self.url = url


DB = create_capability("db", Database)
CACHE: Capability[dict[str, str]] = create_capability("cache")
AUTH: Capability[str] = create_capability("auth")


def model() -> TestModel:
    return TestModel(default=Reply(text="done"))


def provider(handle: Capability[Any], value: object, name: str = "provider") -> ChatMiddleware:
    return define_chat_middleware(name=name, provides=(handle,), setup=lambda ctx: ctx.provide(handle, value))


class Recorder(ChatMiddleware):
    """Records what happened, in order (``on_error``'s error included)."""

    name = "recorder"

    def __init__(self) -> None:
        self.seen: list[str] = []
        self.errors: list[BaseException] = []

    def setup(self, ctx: RunContext) -> None:
        self.seen.append("setup")

    def on_error(self, ctx: RunContext, info: ErrorInfo) -> None:
        self.seen.append("on_error")
        self.errors.append(info.error)

    def on_finish(self, ctx: RunContext, info: Any) -> None:
        self.seen.append("on_finish")


async def run_chat(middleware: list[ChatMiddleware], the_model: TestModel | None = None) -> str:
    with trio.fail_after(10):
        async with chat(the_model or model(), "go", middleware=middleware) as run:
            return (await run.result()).text


# -- handles -----------------------------------------------------------------------------


def test_a_handle_has_a_name_and_an_identity() -> None:
    assert DB.name == "db" and DB.value_type is Database
    assert CACHE.value_type is None
    assert repr(DB) == "<Capability 'db' (Database)>"
    assert repr(CACHE) == "<Capability 'cache'>"
    assert copy.copy(DB) is DB and copy.deepcopy([DB])[0] is DB
    with pytest.raises(CapabilityError, match="non-empty string"):
        create_capability("")
    with pytest.raises(CapabilityError):
        create_capability(3)  # type: ignore[arg-type]
    assert issubclass(CapabilityError, ConfigError)


def test_two_handles_with_one_name_are_distinct_capabilities() -> None:
    first: Capability[int] = create_capability("same")
    second: Capability[int] = create_capability("same")
    assert first != second
    registry = CapabilityRegistry()
    registry.provide(first, 1)
    assert registry.has(first) and not registry.has(second)
    assert registry.get_optional(second) is None
    with pytest.raises(CapabilityError, match="'same' was requested but never provided"):
        registry.get(second)
    consumer = define_chat_middleware(name="consumer", requires=(second,))
    with pytest.raises(CapabilityError, match="requires capability 'same'") as caught:
        middleware_lifecycle([provider(first, 1), consumer])
    assert "handles match by identity" in str(caught.value)
    assert caught.value.capability is second


# -- the per-run registry ----------------------------------------------------------------


def test_registry_provide_get_has_provided() -> None:
    registry = CapabilityRegistry()
    assert registry.provided() == () and not registry.has(DB)
    database = Database()
    registry.provide(DB, database)
    registry.provide(AUTH, "token")
    assert registry.get(DB) is database
    assert registry.get_optional(AUTH) == "token"
    assert registry.get_optional(CACHE) is None
    assert registry.has(DB) and not registry.has(CACHE)
    assert registry.provided() == ("db", "auth")
    assert repr(registry) == "<CapabilityRegistry: db, auth>"


def test_a_strict_get_of_an_unprovided_capability_names_it() -> None:
    registry = CapabilityRegistry()
    with pytest.raises(CapabilityError) as caught:
        registry.get(DB)
    assert str(caught.value) == (
        "Capability 'db' was requested but never provided. "
        "Ensure a middleware provides it in setup(), ordered before this consumer."
    )
    assert caught.value.capability is DB


def test_a_second_provide_wins_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    registry = CapabilityRegistry()
    with caplog.at_level(logging.WARNING, logger="trio_agent.lifecycle"):
        registry.provide(AUTH, "first")
        assert not caplog.records
        registry.provide(AUTH, "second")
    assert registry.get(AUTH) == "second"
    assert registry.provided() == ("auth",)
    [record] = caplog.records
    assert record.levelno == logging.WARNING
    assert "'auth' provided more than once; last provider wins" in record.getMessage()


def test_the_registry_takes_handles_only() -> None:
    registry = CapabilityRegistry()
    for call in (
        lambda: registry.provide("db", 1),  # type: ignore[arg-type]
        lambda: registry.get("db"),  # type: ignore[arg-type]
        lambda: registry.get_optional("db"),  # type: ignore[arg-type]
        lambda: registry.has("db"),  # type: ignore[arg-type]
    ):
        with pytest.raises(CapabilityError, match="takes a handle from create_capability"):
            call()


async def test_two_runs_have_two_registries() -> None:
    seen: list[Database | None] = []

    def read(ctx: RunContext) -> None:
        seen.append(ctx.get_optional(DB))
        ctx.provide(DB, Database(ctx.run_id))

    middleware = [define_chat_middleware(setup=read)]
    await run_chat(middleware)
    await run_chat(middleware)
    assert seen == [None, None]


# -- in a run ----------------------------------------------------------------------------


async def test_provided_in_setup_then_read_in_on_config_and_on_start() -> None:
    database = Database("postgres://db")
    reads: list[tuple[str, object]] = []

    class Provider(ChatMiddleware):
        provides = (DB, CACHE)

        def setup(self, ctx: RunContext) -> None:
            ctx.provide(DB, database)
            ctx.capabilities.provide(CACHE, {"k": "v"})

    class Consumer(ChatMiddleware):
        requires = (DB,)
        optional_requires = (CACHE, AUTH)

        def on_config(self, ctx: RunContext, config: Any) -> None:
            reads.append((f"on_config:{ctx.phase.value}", ctx.get(DB)))

        def on_start(self, ctx: RunContext) -> None:
            reads.append(("on_start", ctx.capabilities.get(DB)))
            reads.append(("cache", ctx.get_optional(CACHE)))
            reads.append(("auth", ctx.get_optional(AUTH)))
            reads.append(("provided", ctx.capabilities.provided()))

    assert await run_chat([Provider(), Consumer()]) == "done"
    assert reads[:2] == [("on_config:init", database), ("on_start", database)]
    assert reads[2:5] == [("cache", {"k": "v"}), ("auth", None), ("provided", ("db", "cache"))]


async def test_a_provider_after_its_consumer_passes_validation_and_setup_runs_first() -> None:
    reads: list[Database] = []
    consumer = define_chat_middleware(name="consumer", requires=(DB,), on_start=lambda ctx: reads.append(ctx.get(DB)))
    database = Database()
    middleware_lifecycle([consumer, provider(DB, database)])  # order is not checked
    assert await run_chat([consumer, provider(DB, database)]) == "done"
    assert reads == [database]  # every setup ran before the first on_config / on_start


async def test_reading_before_the_provider_ran_fails_the_run() -> None:
    # Validation passes (order is not checked); the read in setup comes before the provide.
    recorder = Recorder()
    the_model = model()
    consumer = define_chat_middleware(name="early", requires=(DB,), setup=lambda ctx: ctx.get(DB))
    with trio.fail_after(10):
        async with chat(the_model, "go", middleware=[recorder, consumer, provider(DB, Database())]) as run:
            with pytest.raises(CapabilityError, match="'db' was requested but never provided"):
                await run.result()
    assert recorder.seen == ["setup", "on_error"]
    assert the_model.requests == []


async def test_a_declared_provide_never_provided_fails_the_run_after_every_setup() -> None:
    recorder = Recorder()
    the_model = model()
    lazy = define_chat_middleware(name="lazy", provides=(DB,), setup=lambda ctx: None)
    with trio.fail_after(10):
        async with chat(the_model, "go", middleware=[lazy, recorder]) as run:
            with pytest.raises(CapabilityError) as caught:
                await run.result()
    assert str(caught.value) == "Middleware 'lazy' declares it provides 'db' but never called provide() in setup()."
    assert recorder.seen == ["setup", "on_error"]  # the check ran after the later middleware's setup
    assert recorder.errors == [caught.value]
    assert the_model.requests == []


async def test_a_declared_provide_without_any_setup_fails_too() -> None:
    class Declares(ChatMiddleware):
        provides = (AUTH,)

    with pytest.raises(CapabilityError, match="Middleware 'Declares' declares it provides 'auth'"):
        await run_chat([Declares()])


async def test_a_capability_provided_by_another_middleware_in_setup_satisfies_a_declaration() -> None:
    # Presence is what counts: the check runs once, after every setup.
    declares = define_chat_middleware(name="declares", provides=(AUTH,))
    provides = define_chat_middleware(name="provides", setup=lambda ctx: ctx.provide(AUTH, "token"))
    assert await run_chat([declares, provides]) == "done"


async def test_a_duplicate_provide_in_a_run_is_last_wins(caplog: pytest.LogCaptureFixture) -> None:
    got: list[str] = []
    reader = define_chat_middleware(requires=(AUTH,), on_start=lambda ctx: got.append(ctx.get(AUTH)))
    with caplog.at_level(logging.WARNING, logger="trio_agent.lifecycle"):
        await run_chat([provider(AUTH, "first", "a"), provider(AUTH, "second", "b"), reader])
    assert got == ["second"]
    assert any("provided more than once; last provider wins" in r.getMessage() for r in caplog.records)


# -- validation before the run -----------------------------------------------------------


def test_a_missing_requirement_fails_at_construction_naming_it_and_the_provided_ones() -> None:
    consumer = define_chat_middleware(name="reporter", requires=(AUTH, DB))
    with pytest.raises(CapabilityError) as caught:
        middleware_lifecycle([provider(CACHE, {}), provider(AUTH, "t"), consumer])
    assert str(caught.value) == (
        "Middleware 'reporter' requires capability 'db'. Provided capabilities: cache, auth. "
        "Add a middleware that provides 'db'."
    )
    assert caught.value.capability is DB


def test_with_nothing_provided_the_list_says_none() -> None:
    class Needs(ChatMiddleware):
        requires = (DB,)

    message = r"Middleware 'Needs' requires capability 'db'\. Provided capabilities: none\."
    with pytest.raises(CapabilityError, match=message):
        validate_capabilities([Needs()])
    with pytest.raises(CapabilityError, match="Provided capabilities: none"):
        middleware_lifecycle([Needs()])


async def test_chat_fails_before_any_model_call_on_a_missing_requirement() -> None:
    the_model = model()
    with pytest.raises(CapabilityError, match="requires capability 'db'"):
        async with chat(the_model, "go", middleware=[define_chat_middleware(name="x", requires=(DB,))]):
            pass
    assert the_model.requests == []


def test_optional_requires_are_never_checked() -> None:
    middleware = [define_chat_middleware(optional_requires=(DB, AUTH))]
    validate_capabilities(middleware)
    middleware_lifecycle(middleware)


class Adapter:
    def __init__(self, *requires: Capability[Any], name: str | None = None, model: str | None = None) -> None:
        self.requires = requires
        self.name = name
        self.model = model


def test_the_adapter_is_checked_first() -> None:
    consumer = define_chat_middleware(name="consumer", requires=(DB,))
    with pytest.raises(CapabilityError) as caught:
        validate_capabilities([consumer, provider(CACHE, {})], Adapter(AUTH, name="harness"))
    assert str(caught.value) == (
        "Adapter 'harness' requires capability 'auth'. Provided capabilities: cache. "
        "Add a middleware that provides 'auth'."
    )
    with pytest.raises(CapabilityError, match="Adapter 'gpt-x' requires"):
        validate_capabilities([], Adapter(AUTH, model="gpt-x"))
    with pytest.raises(CapabilityError, match="Adapter 'Adapter' requires"):
        validate_capabilities([], Adapter(AUTH))
    # Satisfied by a middleware; an adapter without ``requires`` needs nothing.
    validate_capabilities([provider(AUTH, "t")], Adapter(AUTH))
    validate_capabilities([], object())
    validate_capabilities([], model())


def test_every_adapter_is_checked_in_the_order_given_and_none_is_skipped() -> None:
    with pytest.raises(CapabilityError, match="Adapter 'outer' requires capability 'auth'"):
        validate_capabilities([], Adapter(AUTH, name="outer"), Adapter(DB, name="inner"))
    with pytest.raises(CapabilityError, match="Adapter 'inner' requires capability 'db'"):
        validate_capabilities([provider(AUTH, "t")], None, Adapter(AUTH, name="outer"), Adapter(DB, name="inner"))
    validate_capabilities([provider(AUTH, "t"), provider(DB, {})], Adapter(AUTH), Adapter(DB), None)


class NeedsAuth(ModelService):
    """A model service that declares what it needs (capabilities.md: an adapter such as a model service)."""

    requires = (AUTH,)


class NeedsDB(TestModel):
    requires = (DB,)


@pytest.mark.parametrize("form", ["await", "block"])
async def test_chat_checks_the_requires_of_a_model_service_and_of_its_provider(form: str) -> None:
    async def run(agent_or_model: Any, middleware: list[ChatMiddleware]) -> str:
        if form == "await":
            return (await chat(agent_or_model, "hi", middleware=middleware)).text
        async with chat(agent_or_model, "hi", middleware=middleware) as run:
            return (await run.result()).text

    backend = NeedsDB(default=Reply(text="ok"))
    with pytest.raises(CapabilityError, match="requires capability 'auth'"):
        await run(NeedsAuth(model()), [])
    with pytest.raises(CapabilityError, match="requires capability 'db'"):  # the service's own, then its provider's
        await run(NeedsAuth(backend), [provider(AUTH, "t")])
    assert backend.requests == []  # refused before any model call
    assert await run(NeedsAuth(backend), [provider(AUTH, "t"), provider(DB, {})]) == "ok"


def test_an_adapters_requires_must_be_handles() -> None:
    with pytest.raises(CapabilityError, match="requires of adapter 'bad' holds 'db', which is not a capability handle"):
        validate_capabilities([], Adapter("db", name="bad"))  # type: ignore[arg-type]


# -- shapes ------------------------------------------------------------------------------


def test_define_chat_middleware_checks_its_declarations() -> None:
    with pytest.raises(MiddlewareShapeError, match="requires of middleware 'm' holds 'db', which is not a capability"):
        define_chat_middleware(name="m", requires=["db"])  # type: ignore[list-item]
    with pytest.raises(MiddlewareShapeError, match="provides of middleware 'm' must be a tuple"):
        define_chat_middleware(name="m", provides=DB)  # type: ignore[arg-type]
    with pytest.raises(MiddlewareShapeError, match="optional_requires of middleware"):
        define_chat_middleware(name="m", optional_requires=[DB, None])  # type: ignore[list-item]
    built = define_chat_middleware(name="m", requires=[DB], provides=[AUTH])
    assert built.requires == (DB,) and built.provides == (AUTH,) and built.optional_requires == ()


def test_class_declarations_are_checked_by_middleware_lifecycle() -> None:
    class NotATuple(ChatMiddleware):
        requires = DB  # type: ignore[assignment]

    class BadEntry(ChatMiddleware):
        provides = (DB, "cache")  # type: ignore[assignment]

    with pytest.raises(MiddlewareShapeError, match="requires of middleware 'NotATuple' must be a tuple"):
        middleware_lifecycle([NotATuple()])
    with pytest.raises(MiddlewareShapeError, match="provides of middleware 'BadEntry' holds 'cache'"):
        middleware_lifecycle([BadEntry()])
    with pytest.raises(MiddlewareShapeError, match="must be a list"):
        validate_capabilities(BadEntry())  # type: ignore[arg-type]


def test_the_defaults_declare_nothing() -> None:
    assert ChatMiddleware.requires == ChatMiddleware.provides == ChatMiddleware.optional_requires == ()
    validate_capabilities([ChatMiddleware(), define_chat_middleware()])


# -- property: validation passes iff requires ⊆ the union of provides --------------------

POOL: list[Capability[int]] = [create_capability(f"c{index % 3}") for index in range(6)]  # names repeat
_indexes = st.frozensets(st.integers(0, len(POOL) - 1), max_size=4)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.tuples(_indexes, _indexes, _indexes), max_size=5),
    st.one_of(st.none(), _indexes),
)
def test_validation_passes_iff_every_requirement_is_provided(
    declarations: list[tuple[frozenset[int], frozenset[int], frozenset[int]]], adapter: frozenset[int] | None
) -> None:
    middleware = [
        define_chat_middleware(
            name=f"m{index}",
            requires=[POOL[i] for i in sorted(requires)],
            provides=[POOL[i] for i in sorted(provides)],
            optional_requires=[POOL[i] for i in sorted(optional)],
        )
        for index, (requires, provides, optional) in enumerate(declarations)
    ]
    provided = {i for _, provides, _ in declarations for i in provides}
    required = {i for requires, _, _ in declarations for i in requires} | set(adapter or ())
    the_adapter = None if adapter is None else Adapter(*(POOL[i] for i in sorted(adapter)), name="a")
    if required <= provided:
        validate_capabilities(middleware, the_adapter)
        validate_capabilities(middleware[::-1], the_adapter)  # order is not checked
        middleware_lifecycle(middleware)
    else:
        with pytest.raises(CapabilityError) as caught:
            validate_capabilities(middleware, the_adapter)
        assert caught.value.capability is not None
        assert caught.value.capability in [POOL[i] for i in required - provided]
        adapter_gap = bool(set(adapter or ()) - provided)
        assert str(caught.value).startswith("Adapter 'a'" if adapter_gap else "Middleware 'm")


def test_a_handle_types_its_value_under_mypy_strict(tmp_path: Path) -> None:
    """`ctx.get(handle)` is typed by the handle; providing a value of another type is an error."""
    status, report = mypy_strict(
        tmp_path,
        "good.py",
        "from typing import assert_type\n"
        "from trio_agent.lifecycle import Capability, RunContext, create_capability\n"
        "class Database:\n"
        "    def query(self) -> int:\n"
        "        return 1\n"
        "DB = create_capability('db', Database)\n"
        "assert_type(DB, Capability[Database])\n"
        "def use(ctx: RunContext) -> int:\n"
        "    assert_type(ctx.get(DB), Database)\n"
        "    assert_type(ctx.capabilities.get_optional(DB), Database | None)\n"
        "    ctx.provide(DB, Database())\n"
        "    return ctx.get(DB).query()\n",
    )
    assert status == 0, report
    status, report = mypy_strict(
        tmp_path,
        "bad.py",
        "from trio_agent.lifecycle import RunContext, create_capability\n"
        "class Database: ...\n"
        "DB = create_capability('db', Database)\n"
        "def use(ctx: RunContext) -> None:\n"
        "    ctx.provide(DB, 'not a database')\n",
    )
    assert status == 1 and "bad.py:5" in report and "provide" in report, report
