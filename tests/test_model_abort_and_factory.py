"""Aborting model calls through their AbortHandle, and building providers by name."""

from __future__ import annotations

from typing import Any

import pytest
import trio
import trio.testing

import trio_agent as ta
from trio_agent.testing import Reply, TestModel, open_test_model


async def test_abort_during_chat_raises_typed_error_with_reason(autojump_clock: trio.abc.Clock) -> None:
    async with open_test_model(default=Reply("late", latency=10.0)) as model:
        service = ta.ModelService(model)
        abort = ta.AbortHandle()
        errors: list[ta.ModelAbortedError] = []

        async def call() -> None:
            try:
                await service.chat([ta.UserMessage("q")], abort=abort)
            except ta.ModelAbortedError as exc:
                errors.append(exc)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(call)
            await trio.sleep(1)
            abort.abort(ta.AbortReason.STEERING)
        assert trio.current_time() < 10  # did not wait for the reply
    (error,) = errors
    assert error.code == "model_request_aborted"
    assert isinstance(error.abort, ta.Abort) and error.abort.reason is ta.AbortReason.STEERING


async def test_already_aborted_request_never_completes() -> None:
    model = TestModel(default=Reply("never seen"))
    abort = ta.AbortHandle()
    abort.abort()
    with pytest.raises(ta.ModelAbortedError):
        await ta.ModelService(model).chat([ta.UserMessage("q")], abort=abort)


async def test_abort_during_stream_closes_layers_and_raises() -> None:
    log: list[str] = []

    class Closing(ta.ModelMiddleware):
        async def wrap_stream(self, request, call_next):  # type: ignore[no-untyped-def, override]
            try:
                async for chunk in call_next(request):
                    yield chunk
            finally:
                log.append("layer closed")

    model = TestModel(default=Reply(" ".join(f"w{i}" for i in range(50))))
    service = ta.ModelService(model, [Closing()])
    abort = ta.AbortHandle()
    received = 0
    with pytest.raises(ta.ModelAbortedError):
        async with service.stream([ta.UserMessage("q")], abort=abort) as chunks:
            async for _chunk in chunks:
                received += 1
                if received == 3:
                    abort.abort(ta.AbortReason.USER_ABORT)
    assert received == 3
    assert log == ["layer closed"]


async def test_a_finished_call_ignores_a_later_abort() -> None:
    abort = ta.AbortHandle()
    response = await ta.ModelService(TestModel(default=Reply("done"))).chat([ta.UserMessage("q")], abort=abort)
    abort.abort()
    assert response.message.text == "done"


def test_unknown_provider_name_lists_the_known_ones() -> None:
    with pytest.raises(ta.ProviderConfigError, match=r"unknown provider 'gemini'.*'openai'.*'anthropic'.*'test'"):
        ta.create_provider("gemini", "some-model")


def test_test_provider_by_name() -> None:
    provider = ta.create_provider("test", "offline")
    assert isinstance(provider, TestModel) and provider.model == "offline"


@pytest.mark.parametrize(
    ("name", "options", "words"),
    [
        ("test", {"foo": 1}, r"the test provider has no option 'foo'; its options are .*respond"),
        ("openai", {"api_key": "k", "foo": 1}, r"the openai provider has no option 'foo'; its options are .*timeout"),
        ("anthropic", {"api_key": "k", "bogus": 2, "x": 3}, r"no option 'bogus', 'x'; its options are .*max_tokens"),
    ],
)
def test_an_unknown_provider_option_is_a_provider_config_error_naming_it(
    name: str, options: dict[str, Any], words: str
) -> None:
    with pytest.raises(ta.ProviderConfigError, match=words):
        ta.create_provider(name, "m", **options)


@pytest.mark.parametrize("name", ["test", "openai", "anthropic"])
@pytest.mark.parametrize("model", [None, "", 5])
def test_a_model_that_is_no_name_is_a_provider_config_error(name: str, model: Any) -> None:
    with pytest.raises(ta.ProviderConfigError, match="model must be a non-empty string"):
        ta.create_provider(name, model, api_key="k")


def test_the_test_provider_takes_its_options_by_name() -> None:
    provider = ta.create_provider("test", "offline", default=Reply("scripted"))
    assert isinstance(provider, TestModel) and provider.model == "offline"


@pytest.mark.parametrize(("name", "variable"), [("openai", "OPENAI_API_KEY"), ("anthropic", "ANTHROPIC_API_KEY")])
def test_missing_api_key_names_the_environment_variable(
    name: str, variable: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(variable, raising=False)
    with pytest.raises(ta.ProviderConfigError, match=variable):
        ta.create_provider(name, "m")


@pytest.mark.parametrize("name", ["openai", "anthropic"])
def test_http_providers_by_name(name: str) -> None:
    provider = ta.create_provider(name, "m", api_key="k", base_url="http://127.0.0.1:9")
    assert provider.name == name and provider.model == "m"
    assert isinstance(provider, ta.Provider)
