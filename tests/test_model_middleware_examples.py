"""The examples of docs/model-middleware.md (examples/model_middleware_examples.py) do what the guide says."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import trio
import trio.testing

from trio_agent import ModelError, ModelTimeoutError, RateLimitError
from trio_agent.models import (
    AssistantMessage,
    FinishReason,
    ModelMiddlewareError,
    ModelResponse,
    ModelService,
    ProviderServerError,
    RetryEvent,
    RetryPolicy,
    SystemMessage,
    TextDelta,
    TextPart,
    ToolCallPart,
    ToolResultMessage,
    ToolSpec,
    Usage,
    UserMessage,
)
from trio_agent.testing import Reply, TestModel
from trio_agent.tools import AbortHandle

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "examples" / "model_middleware_examples.py"
GUIDE = ROOT / "docs" / "model-middleware.md"


def _load_examples() -> ModuleType:
    spec = importlib.util.spec_from_file_location("model_middleware_examples", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


ex: Any = _load_examples()


# -- call log -----------------------------------------------------------------------------------------


async def test_call_log_logs_chat_and_side_query_but_not_streams() -> None:
    log, requests = await ex.demo_call_log()
    assert log == [
        "chat test-model: 1 messages",
        "chat -> stop",
        "side_query test-model: 2 messages",
        "side_query -> stop",
    ]
    assert len(requests) == 3


# -- cache ---------------------------------------------------------------------------------------------


async def test_cache_answers_repeats_and_keeps_truncated_answers_out() -> None:
    demo = await ex.demo_cache()
    assert demo.texts == ["Paris", "Paris", "Paris, again", "Once upon", "Once upon a time"]
    assert demo.hits == 1
    assert demo.provider_calls == 4


async def test_cache_short_circuits_inner_layers_and_keys_on_everything_sent() -> None:
    inner_calls: list[str] = []

    class Inner:
        async def wrap_chat(self, request: Any, call_next: Any) -> ModelResponse:
            inner_calls.append(request.model)
            return await call_next(request)

    model = TestModel(default=Reply("answer"))
    cache = ex.ResponseCache()
    service = ModelService(model, [cache, Inner()])
    spec = ToolSpec("search", "Search", {"type": "object"})
    conversation = [SystemMessage("s"), UserMessage("q"), AssistantMessage((TextPart("a"),)), UserMessage("q2")]
    first = await service.chat(conversation, tools=[spec])
    again = await service.chat(list(conversation), tools=[ToolSpec("search", "Search", {"type": "object"})])
    assert again is first
    assert len(inner_calls) == 1 and len(model.requests) == 1
    # any difference in what the provider would see is a miss
    await service.chat(conversation)  # no tools
    await service.chat(conversation, tools=[ToolSpec("search", "Search v2", {"type": "object"})])
    await service.chat([*conversation, UserMessage("more")], tools=[spec])
    await service.with_model("other-model").chat(conversation, tools=[spec])
    assert len(model.requests) == 5
    assert cache.hits == 1


async def test_cache_ignores_metadata_the_provider_never_sees() -> None:
    model = TestModel(default=Reply("answer"))
    cache = ex.ResponseCache()
    service = ModelService(model, [cache])
    await service.chat([UserMessage("q")], metadata={"conversation_id": "a"})
    await service.chat([UserMessage("q")], metadata={"conversation_id": "b"})
    assert len(model.requests) == 1 and cache.hits == 1


async def test_cache_does_not_store_tool_calling_turns() -> None:
    model = TestModel(default=Reply(tool_calls=[("search", {"q": "x"})]))
    cache = ex.ResponseCache()
    service = ModelService(model, [cache])
    await service.chat([UserMessage("q")])
    await service.chat([UserMessage("q")])
    assert len(model.requests) == 2 and cache.entries == {}


async def test_cache_keeps_request_local_state_in_locals_under_concurrency() -> None:
    model = TestModel(respond=lambda request: Reply(f"re: {request.messages[-1].content}", latency=0))
    service = ModelService(model, [ex.ResponseCache()])
    answers: dict[int, str] = {}

    async def one(i: int) -> None:
        for _ in range(i % 3):
            await trio.lowlevel.checkpoint()
        answers[i] = (await service.chat([UserMessage(f"q{i % 20}")])).message.text

    async with trio.open_nursery() as nursery:
        for i in range(100):
            nursery.start_soon(one, i)
    assert answers == {i: f"re: q{i % 20}" for i in range(100)}


# -- routing ------------------------------------------------------------------------------------------------


async def test_routing_sets_temperature_by_tool_count() -> None:
    chat_temperatures, stream_temperatures = await ex.demo_routing()
    assert chat_temperatures == [0.7, 0.2, 0.0, 1.0]
    assert stream_temperatures == [0.2]


async def test_routing_keeps_other_options_and_the_callers_dict() -> None:
    model = TestModel(default=Reply("ok"))
    options = {"max_tokens": 100}
    await ModelService(model, [ex.TemperatureByTools()]).chat([UserMessage("x")], options=options)
    assert dict(model.requests[0].options) == {"max_tokens": 100, "temperature": 0.7}
    assert options == {"max_tokens": 100}


async def test_switching_the_model_in_middleware_fails_and_with_model_works() -> None:
    error, calls, models = await ex.demo_switch_model()
    assert error == "Model middleware cannot change the active model"
    assert calls == 0
    assert models == ["big-model", "long-context-model"]


async def test_service_for_keeps_the_stack() -> None:
    service = ModelService(TestModel(default=Reply("x")), [ex.TemperatureByTools()])
    assert ex.service_for(service, [UserMessage("a")]) is service
    other = ex.service_for(service, [UserMessage("a")] * 21)
    assert other.model == "long-context-model"
    assert other.middleware is service.middleware


# -- policy --------------------------------------------------------------------------------------------------


async def test_policy_blocks_every_operation_before_the_provider() -> None:
    demo = await ex.demo_policy()
    assert demo.blocked == {
        "chat": "SECRET_IN_PROMPT",
        "side_query": "SECRET_IN_PROMPT",
        "stream": "SECRET_IN_PROMPT",
        "chat_with_retry_events": "SECRET_IN_PROMPT",
    }
    assert demo.provider_calls_while_blocked == 0
    assert demo.allowed_text == "sure"


@pytest.mark.parametrize(
    "message",
    [
        UserMessage("aws AKIAABCDEFGHIJKLMNOP here"),
        SystemMessage("key: sk-0123456789abcdefghijXYZ"),
        ToolResultMessage("c1", "found sk-0123456789abcdefghijXYZ in .env"),
        AssistantMessage((ToolCallPart("c2", "deploy", '{"key": "AKIAABCDEFGHIJKLMNOP"}'),)),
    ],
    ids=["user", "system", "tool-result", "tool-call-arguments"],
)
async def test_policy_finds_secrets_in_any_message_kind(message: Any) -> None:
    model = TestModel(default=Reply("x"))
    service = ModelService(model, [ex.BlockSecrets()])
    with pytest.raises(ex.SecretInPromptError) as caught:
        await service.chat([UserMessage("hello"), message])
    assert isinstance(caught.value, ModelError) and not caught.value.retryable
    assert caught.value.code == "SECRET_IN_PROMPT"
    assert "message 1" in str(caught.value)
    assert model.requests == []


@pytest.mark.parametrize("text", ["sk-short", "task-0123456789abcdefghijXYZ", "AKIA123", "no secrets here"])
async def test_policy_lets_lookalikes_through(text: str) -> None:
    model = TestModel(default=Reply("x"))
    await ModelService(model, [ex.BlockSecrets()]).chat([UserMessage(text)])
    assert len(model.requests) == 1


async def test_policy_error_is_not_retried(autojump_clock: trio.testing.MockClock) -> None:
    model = TestModel(default=Reply("x"))
    start = trio.current_time()
    with pytest.raises(ex.SecretInPromptError):
        await ModelService(model, [ex.BlockSecrets()]).chat([UserMessage("sk-0123456789abcdefghijXYZ")])
    assert trio.current_time() == start


# -- stream metrics ------------------------------------------------------------------------------------------


async def test_stream_metrics_record_every_ending(autojump_clock: trio.testing.MockClock) -> None:
    complete, early, failing = await ex.demo_metrics()
    assert (complete.model, complete.chunks, complete.outcome) == ("test-model", 5, "completed")
    assert complete.first_chunk_after == pytest.approx(0.25) and complete.duration == pytest.approx(0.25)
    assert (early.chunks, early.outcome) == (2, "closed early")
    assert early.first_chunk_after == pytest.approx(0.1) and early.duration == pytest.approx(0.1)
    assert (failing.chunks, failing.first_chunk_after, failing.duration) == (2, 0.0, 0.0)
    assert failing.outcome == "StreamInterruptedError"


async def test_stream_metrics_are_recorded_before_the_block_exits() -> None:
    stats: list[Any] = []
    model = TestModel(default=Reply("a b c d e f"))
    async with ModelService(model, [ex.StreamMetrics(stats)]).stream([UserMessage("x")]) as chunks:
        async for _ in chunks:
            break
    assert [(s.chunks, s.outcome) for s in stats] == [(1, "closed early")]


async def test_stream_metrics_record_a_deadline(autojump_clock: trio.testing.MockClock) -> None:
    stats: list[Any] = []
    model = TestModel(default=Reply("late", latency=30))
    service = ModelService(model, [ex.StreamMetrics(stats)], request_timeout=5)
    with pytest.raises(ModelTimeoutError):
        await ex.stream_text(service, "x")
    assert [(s.chunks, s.first_chunk_after, s.duration, s.outcome) for s in stats] == [(0, None, 5.0, "Cancelled")]


async def test_stream_metrics_pass_chunks_through_unchanged() -> None:
    reply = Reply("one two three", reasoning="hm", usage=Usage(1, 2, 3), finish_reason=FinishReason.LENGTH)
    bare_service = ModelService(TestModel(default=reply))
    measured_service = ModelService(TestModel(default=reply), [ex.StreamMetrics([])])
    async with bare_service.stream([UserMessage("x")]) as chunks:
        bare = [c async for c in chunks]
    async with measured_service.stream([UserMessage("x")]) as chunks:
        through = [c async for c in chunks]
    assert through == bare
    assert len(bare) == 6


# -- streams: helpers ----------------------------------------------------------------------------------------


async def test_first_sentence_stops_reading_and_closes_the_provider() -> None:
    log: list[str] = []

    class Provider:
        name = "p"
        model = "m"

        async def chat(self, request: Any) -> ModelResponse:
            raise NotImplementedError

        def with_model(self, model: str) -> Any:
            return self

        async def stream(self, request: Any) -> Any:
            try:
                for word in ["Hello", " there.", " More", " text", " follows."]:
                    log.append(f"sent {word.strip()}")
                    yield TextDelta(word)
            finally:
                log.append("response closed")

    text = await ex.first_sentence(ModelService(Provider()), "hi")
    assert text == "Hello there."
    assert log == ["sent Hello", "sent there.", "response closed"]


async def test_stream_text_reassembles_the_reply() -> None:
    service = ModelService(TestModel(default=Reply("the whole  reply, spaces and all")))
    assert await ex.stream_text(service, "x") == "the whole  reply, spaces and all"


# -- retry events --------------------------------------------------------------------------------------------


async def test_retry_reporter_notifies_each_retry(autojump_clock: trio.testing.MockClock) -> None:
    start = trio.current_time()
    notes, text, calls = await ex.demo_retry_events()
    assert notes == [
        "attempt 1 failed (rate_limit_error); retrying in 0.2 s",
        "attempt 2 failed (provider_server_error); retrying in 0.1 s",
    ]
    assert text == "hello!"
    assert calls == 3
    assert trio.current_time() - start == pytest.approx(0.3)


async def test_retry_reporter_passes_every_item_and_the_final_error(autojump_clock: trio.testing.MockClock) -> None:
    notes: list[str] = []
    errors = [ProviderServerError("a", status=500), RateLimitError("b", retry_after=1)]
    model = TestModel({"hi": [Reply(error=errors[0]), Reply(error=errors[1])]})
    service = ModelService(model, [ex.RetryReporter(notes.append)], retry=RetryPolicy(max_attempts=2, jitter=False))
    items: list[Any] = []
    with pytest.raises(RateLimitError) as caught:
        async with service.chat_with_retry_events([UserMessage("hi")]) as events:
            async for item in events:
                items.append(item)
    assert caught.value is errors[1]
    assert items == [RetryEvent(1, 0.5, errors[0])]
    assert notes == ["attempt 1 failed (provider_server_error); retrying in 0.5 s"]


async def test_chat_with_progress_returns_the_response() -> None:
    model = TestModel(default=Reply("done"))
    response = await ex.chat_with_progress(ModelService(model), "x")
    assert response.message.text == "done"


# -- the whole stack -----------------------------------------------------------------------------------------


async def test_stack_order_and_behaviour() -> None:
    log, text, streamed, metrics = await ex.demo_stack()
    assert log == ["chat test-model: 1 messages", "chat -> stop"] * 2, "CallLog is outside the cache"
    assert text == "All good. Nothing else."
    assert streamed == "All good."
    assert [(m.chunks, m.outcome) for m in metrics] == [(2, "closed early")]


async def test_stack_blocks_secrets_before_logging_and_routes_before_caching() -> None:
    log: list[str] = []
    model = TestModel(default=Reply("ok"))
    service = ex.build_service(model, log, [])
    with pytest.raises(ex.SecretInPromptError):
        await service.chat([UserMessage("AKIAABCDEFGHIJKLMNOP")])
    assert log == [] and model.requests == []
    await service.chat([UserMessage("q")], tools=[ToolSpec("a", "", {})])
    await service.chat([UserMessage("q")], tools=[ToolSpec("a", "", {})], options={"temperature": 0.2})
    assert len(model.requests) == 1, "routing added temperature 0.2 before the cache built its key"
    assert model.requests[0].options["temperature"] == 0.2
    assert service.retry == RetryPolicy(max_attempts=4, base_delay=0.5, max_delay=20.0)
    assert service.request_timeout == 120


async def test_stack_passes_the_abort_handle_through() -> None:
    model = TestModel(default=Reply("ok"))
    service = ex.build_service(model, [], [])
    handle = AbortHandle()
    await service.chat([UserMessage("q")], abort=handle)
    async with service.stream([UserMessage("q2")], abort=handle) as chunks:
        async for _ in chunks:
            pass
    assert [request.abort for request in model.requests] == [handle, handle]


async def test_wrong_model_switch_is_rejected_even_behind_a_cache_hit() -> None:
    model = TestModel(default=Reply("ok"))
    cache = ex.ResponseCache()
    service = ModelService(model, [cache])
    await service.chat([UserMessage("q")])  # warm the cache
    with pytest.raises(ModelMiddlewareError, match="active model"):
        await ModelService(model, [ex.SwitchToSmallModel(), cache]).chat([UserMessage("q")])
    assert cache.hits == 0 and len(model.requests) == 1


# -- the script and the guide --------------------------------------------------------------------------------


def test_script_runs() -> None:
    done = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    assert "7. all examples in one stack" in done.stdout
    assert "SECRET_IN_PROMPT" in done.stdout


def test_guide_code_blocks_are_in_the_script() -> None:
    script = SCRIPT.read_text()
    blocks = re.findall(r"```python[^\n]*\n(.*?)```", GUIDE.read_text(), flags=re.DOTALL)
    assert len(blocks) >= 10
    missing = [block for block in blocks if block.strip() not in script]
    assert not missing, "guide code not found verbatim in the examples script:\n" + "\n---\n".join(missing)


def test_every_example_class_is_shown_in_the_guide() -> None:
    guide = GUIDE.read_text()
    for name in [
        "CallLog",
        "ResponseCache",
        "TemperatureByTools",
        "SwitchToSmallModel",
        "BlockSecrets",
        "SecretInPromptError",
        "StreamMetrics",
        "StreamStats",
        "RetryReporter",
        "build_service",
        "service_for",
        "stream_text",
        "first_sentence",
        "chat_with_progress",
    ]:
        assert f"class {name}" in guide or f"def {name}" in guide, name
