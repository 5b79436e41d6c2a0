"""Tests for the generic onion composer `compose_middleware`."""

from __future__ import annotations

import functools
from typing import Any

import pytest
import trio
import trio.testing
from hypothesis import given, settings
from hypothesis import strategies as st

from trio_agent import MiddlewareError, TrioAgentError
from trio_agent.middleware import MiddlewareShapeError, NextCalledTwiceError, compose_middleware

TWICE = "next() called multiple times"


# ---------------------------------------------------------------------------
# helpers


def tracing_layer(name: str, trace: list[Any]):
    """A sync pass-through layer recording before/after events."""

    def layer(request, next_):
        trace.append(("before", name, request))
        result = next_()
        trace.append(("after", name, result))
        return result

    return layer


def async_tracing_layer(name: str, trace: list[Any]):
    async def layer(request, next_):
        trace.append(("before", name, request))
        await trio.lowlevel.checkpoint()
        result = await next_()
        await trio.lowlevel.checkpoint()
        trace.append(("after", name, result))
        return result

    return layer


class Counter:
    def __init__(self) -> None:
        self.calls: list[Any] = []

    def terminal(self, request):
        self.calls.append(request)
        return ("terminal", request)

    async def aterminal(self, request):
        await trio.lowlevel.checkpoint()
        self.calls.append(request)
        return ("terminal", request)


# ---------------------------------------------------------------------------
# order


def test_sync_onion_order_first_registered_is_outermost():
    trace: list[Any] = []
    counter = Counter()
    composed = compose_middleware(
        [tracing_layer("a", trace), tracing_layer("b", trace), tracing_layer("c", trace)], counter.terminal
    )
    result = composed("req")
    assert result == ("terminal", "req")
    assert [(kind, name) for kind, name, _ in trace] == [
        ("before", "a"),
        ("before", "b"),
        ("before", "c"),
        ("after", "c"),
        ("after", "b"),
        ("after", "a"),
    ]
    assert counter.calls == ["req"]


async def test_async_onion_order_first_registered_is_outermost():
    trace: list[Any] = []
    counter = Counter()
    composed = compose_middleware(
        [async_tracing_layer("a", trace), async_tracing_layer("b", trace), async_tracing_layer("c", trace)],
        counter.aterminal,
    )
    awaitable = composed("req")
    # Nothing has run yet: the composed result is an awaitable, evaluated under trio.
    assert trace == []
    result = await awaitable
    assert result == ("terminal", "req")
    assert [(kind, name) for kind, name, _ in trace] == [
        ("before", "a"),
        ("before", "b"),
        ("before", "c"),
        ("after", "c"),
        ("after", "b"),
        ("after", "a"),
    ]
    assert counter.calls == ["req"]


def test_no_middleware_calls_terminal_directly():
    counter = Counter()
    composed = compose_middleware([], counter.terminal)
    assert composed(7) == ("terminal", 7)
    assert counter.calls == [7]


async def test_no_middleware_async_terminal():
    counter = Counter()
    composed = compose_middleware([], counter.aterminal)
    assert await composed(7) == ("terminal", 7)
    assert counter.calls == [7]


def test_layers_can_transform_the_result_while_unwinding():
    def add(n):
        def layer(request, next_):
            return [*next_(), n]

        return layer

    composed = compose_middleware([add(1), add(2), add(3)], lambda request: [request])
    assert composed(0) == [0, 3, 2, 1]


# ---------------------------------------------------------------------------
# request replacement and short-circuit


def test_next_with_argument_replaces_request_for_inner_layers():
    seen: list[tuple[str, Any]] = []

    def outer(request, next_):
        seen.append(("outer", request))
        return next_(request + "-outer")

    def middle(request, next_):
        seen.append(("middle", request))
        return next_()  # passes the current (already replaced) request

    def inner(request, next_):
        seen.append(("inner", request))
        return next_(request + "-inner")

    counter = Counter()
    composed = compose_middleware([outer, middle, inner], counter.terminal)
    assert composed("r") == ("terminal", "r-outer-inner")
    assert seen == [("outer", "r"), ("middle", "r-outer"), ("inner", "r-outer")]
    assert counter.calls == ["r-outer-inner"]


async def test_async_next_with_argument_replaces_request():
    async def outer(request, next_):
        return await next_({**request, "outer": True})

    async def inner(request, next_):
        await trio.lowlevel.checkpoint()
        return await next_()

    counter = Counter()
    composed = compose_middleware([outer, inner], counter.aterminal)
    original = {"q": 1}
    assert await composed(original) == ("terminal", {"q": 1, "outer": True})
    assert original == {"q": 1}
    assert counter.calls == [{"q": 1, "outer": True}]


def test_layer_not_calling_next_short_circuits():
    trace: list[Any] = []
    counter = Counter()

    def short(request, next_):
        trace.append(("short", request))
        return "cached"

    composed = compose_middleware([tracing_layer("a", trace), short, tracing_layer("c", trace)], counter.terminal)
    assert composed("req") == "cached"
    assert trace == [("before", "a", "req"), ("short", "req"), ("after", "a", "cached")]
    assert counter.calls == []


async def test_async_layer_not_calling_next_short_circuits():
    trace: list[Any] = []
    counter = Counter()

    async def short(request, next_):
        await trio.lowlevel.checkpoint()
        return "cached"

    composed = compose_middleware([async_tracing_layer("a", trace), short], counter.aterminal)
    assert await composed("req") == "cached"
    assert [(kind, name) for kind, name, _ in trace] == [("before", "a"), ("after", "a")]
    assert counter.calls == []


# ---------------------------------------------------------------------------
# next() called twice


def test_error_hierarchy():
    assert issubclass(NextCalledTwiceError, MiddlewareError)
    assert issubclass(NextCalledTwiceError, TrioAgentError)
    assert issubclass(MiddlewareShapeError, MiddlewareError)
    assert issubclass(MiddlewareShapeError, TypeError)
    assert TWICE in str(NextCalledTwiceError())


def test_sync_second_next_raises_and_terminal_runs_once():
    counter = Counter()

    def twice(request, next_):
        next_()
        return next_()

    composed = compose_middleware([twice], counter.terminal)
    with pytest.raises(NextCalledTwiceError, match=r"next\(\) called multiple times"):
        composed("req")
    assert counter.calls == ["req"]


def test_sync_second_next_with_new_request_also_raises():
    counter = Counter()

    def twice(request, next_):
        next_("first")
        return next_("second")

    composed = compose_middleware([twice], counter.terminal)
    with pytest.raises(NextCalledTwiceError) as info:
        composed("req")
    assert TWICE in str(info.value)
    assert counter.calls == ["first"]


async def test_async_second_next_raises_and_terminal_runs_once():
    counter = Counter()

    async def twice(request, next_):
        await next_()
        await trio.lowlevel.checkpoint()
        return await next_()

    composed = compose_middleware([twice], counter.aterminal)
    with pytest.raises(NextCalledTwiceError) as info:
        await composed("req")
    assert TWICE in str(info.value)
    assert counter.calls == ["req"]


def test_inner_layer_second_next_after_outer_called_once():
    counter = Counter()
    outer_calls = 0

    def outer(request, next_):
        nonlocal outer_calls
        outer_calls += 1
        return next_()

    def inner_twice(request, next_):
        next_()
        return next_()

    composed = compose_middleware([outer, inner_twice], counter.terminal)
    with pytest.raises(NextCalledTwiceError, match=r"next\(\) called multiple times"):
        composed("req")
    assert outer_calls == 1
    assert counter.calls == ["req"]


async def test_async_inner_layer_second_next_after_outer_called_once():
    counter = Counter()

    async def outer(request, next_):
        return await next_()

    async def inner_twice(request, next_):
        await next_()
        return await next_()

    composed = compose_middleware([outer, inner_twice], counter.aterminal)
    with pytest.raises(NextCalledTwiceError, match=r"next\(\) called multiple times"):
        await composed("req")
    assert counter.calls == ["req"]


def test_outer_layer_calling_next_again_after_inner_finished_raises():
    counter = Counter()

    def outer_twice(request, next_):
        next_()
        return next_()

    composed = compose_middleware([outer_twice, tracing_layer("inner", [])], counter.terminal)
    with pytest.raises(NextCalledTwiceError):
        composed("req")
    assert counter.calls == ["req"]


def test_outer_retry_after_inner_raised_is_still_refused():
    """A retry loop in middleware must not re-run the terminal."""
    counter = Counter()
    attempts = 0

    def flaky_terminal(request):
        counter.calls.append(request)
        raise RuntimeError("boom")

    def retry(request, next_):
        nonlocal attempts
        for _ in range(3):
            attempts += 1
            try:
                return next_()
            except RuntimeError:
                continue
        return "gave up"

    composed = compose_middleware([retry], flaky_terminal)
    with pytest.raises(NextCalledTwiceError):
        composed("req")
    assert attempts == 2
    assert counter.calls == ["req"]


# ---------------------------------------------------------------------------
# per-call dispatch state


def test_each_call_has_its_own_dispatch_state():
    counter = Counter()
    composed = compose_middleware([tracing_layer("a", []), tracing_layer("b", [])], counter.terminal)
    for i in range(200):
        assert composed(i) == ("terminal", i)
    assert counter.calls == list(range(200))


def test_reentrant_call_from_inside_middleware_is_independent():
    calls: list[Any] = []
    composed = None

    def layer(request, next_):
        if request == "outer":
            assert composed is not None
            nested = composed("nested")
            return (next_(), nested)
        return next_()

    def terminal(request):
        calls.append(request)
        return request

    composed = compose_middleware([layer, tracing_layer("t", [])], terminal)
    assert composed("outer") == ("outer", "nested")
    assert calls == ["nested", "outer"]


async def test_concurrent_calls_from_many_tasks_keep_requests_separate():
    entered: list[int] = []

    async def checkpointing(request, next_):
        entered.append(request["id"])
        await trio.lowlevel.checkpoint()
        result = await next_({**request, "seen": [*request["seen"], "a"]})
        await trio.lowlevel.checkpoint()
        return result

    async def checkpointing_b(request, next_):
        await trio.lowlevel.checkpoint()
        result = await next_({**request, "seen": [*request["seen"], "b"]})
        await trio.lowlevel.checkpoint()
        return {**result, "wrapped": request["id"]}

    async def terminal(request):
        await trio.lowlevel.checkpoint()
        return {"id": request["id"], "seen": request["seen"]}

    composed = compose_middleware([checkpointing, checkpointing_b], terminal)
    results: dict[int, Any] = {}

    async def worker(i: int) -> None:
        for round_ in range(3):
            key = i * 10 + round_
            results[key] = await composed({"id": key, "seen": []})

    async with trio.open_nursery() as nursery:
        for i in range(50):
            nursery.start_soon(worker, i)

    assert len(results) == 150
    for key, result in results.items():
        assert result == {"id": key, "seen": ["a", "b"], "wrapped": key}
    assert sorted(entered) == sorted(results)


async def test_concurrent_calls_interleave_inside_middleware():
    """Many chains are suspended inside the same layer at once; none trips the next-twice guard."""
    inside = 0
    max_inside = 0
    release = trio.Event()

    async def gate(request, next_):
        nonlocal inside, max_inside
        inside += 1
        max_inside = max(max_inside, inside)
        await release.wait()
        inside -= 1
        return await next_(request * 2)

    async def terminal(request):
        await trio.lowlevel.checkpoint()
        return request + 1

    composed = compose_middleware([gate], terminal)
    results: dict[int, int] = {}

    async def worker(i: int) -> None:
        results[i] = await composed(i)

    async with trio.open_nursery() as nursery:
        for i in range(20):
            nursery.start_soon(worker, i)
        await trio.testing.wait_all_tasks_blocked()
        assert inside == 20
        release.set()

    assert max_inside == 20
    assert results == {i: i * 2 + 1 for i in range(20)}


# ---------------------------------------------------------------------------
# layer list copied


def test_middleware_list_is_copied_at_compose_time():
    trace: list[Any] = []
    layers = [tracing_layer("a", trace)]
    counter = Counter()
    composed = compose_middleware(layers, counter.terminal)

    def short(request, next_):
        return "short"

    layers.append(short)
    layers.insert(0, short)
    assert composed("r") == ("terminal", "r")
    assert [(kind, name) for kind, name, _ in trace] == [("before", "a"), ("after", "a")]
    layers.clear()
    trace.clear()
    assert composed("s") == ("terminal", "s")
    assert len(trace) == 2
    assert counter.calls == ["r", "s"]


def test_accepts_any_sequence_of_layers():
    trace: list[Any] = []
    composed = compose_middleware((tracing_layer("a", trace), tracing_layer("b", trace)), lambda r: r)
    assert composed(1) == 1
    assert [name for kind, name, _ in trace if kind == "before"] == ["a", "b"]


# ---------------------------------------------------------------------------
# check=


def test_check_sees_every_request_entering_layers_and_terminal():
    checked: list[Any] = []

    def replace(suffix):
        def layer(request, next_):
            return next_(request + suffix)

        return layer

    def passthrough(request, next_):
        return next_()

    composed = compose_middleware([replace("1"), passthrough, replace("3")], lambda r: r, check=checked.append)
    assert composed("r") == "r13"
    # three layers + the terminal
    assert checked == ["r", "r1", "r1", "r13"]


def test_check_raising_stops_chain_before_inner_layer():
    entered: list[str] = []
    counter = Counter()

    def check(request):
        if request == "forbidden":
            raise PermissionError("no")

    def outer(request, next_):
        entered.append("outer")
        return next_("forbidden")

    def inner(request, next_):
        entered.append("inner")
        return next_()

    composed = compose_middleware([outer, inner], counter.terminal, check=check)
    with pytest.raises(PermissionError):
        composed("ok")
    assert entered == ["outer"]
    assert counter.calls == []


def test_check_raising_before_terminal_stops_terminal():
    counter = Counter()

    def check(request):
        if request == "bad":
            raise ValueError("refused")

    def replace(request, next_):
        return next_("bad")

    composed = compose_middleware([replace], counter.terminal, check=check)
    with pytest.raises(ValueError, match="refused"):
        composed("ok")
    assert counter.calls == []


def test_check_raising_on_first_request_runs_nothing():
    entered: list[str] = []

    def check(request):
        raise LookupError(request)

    def layer(request, next_):
        entered.append("layer")
        return next_()

    composed = compose_middleware([layer], lambda r: entered.append("terminal"), check=check)
    with pytest.raises(LookupError):
        composed("x")
    assert entered == []


async def test_check_with_async_chain():
    checked: list[Any] = []

    async def replace(request, next_):
        return await next_(request + 1)

    async def terminal(request):
        return request * 10

    composed = compose_middleware([replace, replace], terminal, check=checked.append)
    assert await composed(0) == 20
    assert checked == [0, 1, 2]


# ---------------------------------------------------------------------------
# hypothesis: order model


layer_choice = st.one_of(
    st.just(("pass",)),
    st.tuples(st.just("replace"), st.integers(0, 1000)),
    st.just(("short",)),
)


def build_model_chain(choices, trace):
    layers = []
    for index, choice in enumerate(choices):

        def layer(request, next_, index=index, choice=choice):
            trace.append(("before", index, request))
            if choice[0] == "short":
                return ("short", index)
            result = next_() if choice[0] == "pass" else next_((*request, choice[1]))
            trace.append(("after", index, result))
            return ("wrap", index, result)

        layers.append(layer)
    return layers


def expected_model(choices):
    trace = []
    request: tuple[int, ...] = ()
    stop = None
    for index, choice in enumerate(choices):
        trace.append(("before", index, request))
        if choice[0] == "short":
            stop = index
            break
        if choice[0] == "replace":
            request = (*request, choice[1])
    if stop is None:
        result: Any = ("terminal", request)
        inner = len(choices)
    else:
        result = ("short", stop)
        inner = stop
    for index in reversed(range(inner)):
        trace.append(("after", index, result))
        result = ("wrap", index, result)
    return trace, result, stop is None, request


@settings(max_examples=150, deadline=None)
@given(st.lists(layer_choice, min_size=0, max_size=15))
def test_model_order_sync(choices):
    trace: list[Any] = []
    terminal_calls: list[Any] = []

    def terminal(request):
        terminal_calls.append(request)
        return ("terminal", request)

    composed = compose_middleware(build_model_chain(choices, trace), terminal)
    result = composed(())
    expected_trace, expected_result, terminal_ran, final_request = expected_model(choices)
    assert trace == expected_trace
    assert result == expected_result
    assert terminal_calls == ([final_request] if terminal_ran else [])


def build_async_model_chain(choices, trace):
    layers = []
    for index, choice in enumerate(choices):

        async def layer(request, next_, index=index, choice=choice):
            trace.append(("before", index, request))
            await trio.lowlevel.checkpoint()
            if choice[0] == "short":
                return ("short", index)
            result = await (next_() if choice[0] == "pass" else next_((*request, choice[1])))
            trace.append(("after", index, result))
            return ("wrap", index, result)

        layers.append(layer)
    return layers


@settings(max_examples=75, deadline=None)
@given(st.lists(layer_choice, min_size=0, max_size=15))
def test_model_order_async(choices):
    trace: list[Any] = []
    terminal_calls: list[Any] = []

    async def terminal(request):
        await trio.lowlevel.checkpoint()
        terminal_calls.append(request)
        return ("terminal", request)

    composed = compose_middleware(build_async_model_chain(choices, trace), terminal)
    result = trio.run(composed, ())
    expected_trace, expected_result, terminal_ran, final_request = expected_model(choices)
    assert trace == expected_trace
    assert result == expected_result
    assert terminal_calls == ([final_request] if terminal_ran else [])


# ---------------------------------------------------------------------------
# hypothesis: double next


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_double_next_anywhere_always_raises(data):
    n_layers = data.draw(st.integers(1, 12), label="layers")
    doubler = data.draw(st.integers(0, n_layers - 1), label="doubler")
    second_request = data.draw(st.sampled_from([None, "other"]), label="second_request")
    terminal_calls: list[Any] = []

    def terminal(request):
        terminal_calls.append(request)
        return request

    def passthrough(request, next_):
        return next_()

    def double(request, next_):
        next_()
        return next_() if second_request is None else next_(second_request)

    layers = [double if i == doubler else passthrough for i in range(n_layers)]
    composed = compose_middleware(layers, terminal)
    with pytest.raises(NextCalledTwiceError, match=r"next\(\) called multiple times"):
        composed("req")
    assert terminal_calls == ["req"]


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_double_next_anywhere_always_raises_async(data):
    n_layers = data.draw(st.integers(1, 12), label="layers")
    doubler = data.draw(st.integers(0, n_layers - 1), label="doubler")
    terminal_calls: list[Any] = []

    async def terminal(request):
        await trio.lowlevel.checkpoint()
        terminal_calls.append(request)
        return request

    async def passthrough(request, next_):
        return await next_()

    async def double(request, next_):
        await next_()
        await trio.lowlevel.checkpoint()
        return await next_()

    layers = [double if i == doubler else passthrough for i in range(n_layers)]
    composed = compose_middleware(layers, terminal)
    with pytest.raises(NextCalledTwiceError, match=r"next\(\) called multiple times"):
        trio.run(composed, "req")
    assert terminal_calls == ["req"]


# ---------------------------------------------------------------------------
# bad input


@pytest.mark.parametrize("bad", [42, "x", None, 1.5, b"bytes"])
def test_non_callable_middleware_rejected_naming_index(bad):
    def ok(request, next_):
        return next_()

    with pytest.raises(MiddlewareShapeError) as info:
        compose_middleware([ok, ok, bad], lambda r: r)
    assert isinstance(info.value, TypeError)
    assert isinstance(info.value, MiddlewareError)
    assert "#2" in str(info.value)


@pytest.mark.parametrize("bad", [5, None, object()])
def test_a_middleware_list_that_is_not_iterable_is_a_shape_error(bad):
    with pytest.raises(MiddlewareShapeError, match="middleware must be a list"):
        compose_middleware(bad, lambda r: r)


def test_non_callable_middleware_at_index_zero():
    with pytest.raises(MiddlewareShapeError, match="#0"):
        compose_middleware([None], lambda r: r)


def _one_arg(request):
    return request


def _three_args(request, next_, extra):
    return next_()


def _kw_only(request, *, next_):
    return next_()


def _required_kw(request, next_, *, flag):
    return next_()


@pytest.mark.parametrize("bad", [_one_arg, _three_args, _kw_only, _required_kw, lambda: None])
def test_wrongly_shaped_callable_rejected(bad):
    def ok(request, next_):
        return next_()

    with pytest.raises(MiddlewareShapeError) as info:
        compose_middleware([ok, bad], lambda r: r)
    assert isinstance(info.value, TypeError)
    assert "#1" in str(info.value)


def test_flexible_signatures_accepted():
    def var_args(*args):
        return args[1]()

    def with_default(request, next_, extra=None):
        return next_()

    class Layer:
        def __call__(self, request, next_):
            return next_(request + 1)

    def with_partial(tag, request, next_):
        return next_(request + tag)

    composed = compose_middleware([var_args, with_default, Layer(), functools.partial(with_partial, 10)], lambda r: r)
    assert composed(0) == 11


@pytest.mark.parametrize("bad", [42, "x", None])
def test_non_callable_terminal_rejected(bad):
    with pytest.raises(MiddlewareShapeError) as info:
        compose_middleware([], bad)
    assert isinstance(info.value, TypeError)
    assert "terminal" in str(info.value)
