"""Providers by name: ``create_provider("openai", "gpt-4o-mini")``."""

from __future__ import annotations

import inspect
from typing import Any

import httpx

from .._errors import ProviderConfigError
from ._service import Provider

__all__ = ["PROVIDER_NAMES", "create_provider"]

PROVIDER_NAMES = ("openai", "anthropic", "test")


def create_provider(
    name: str,
    model: str,
    *,
    api_key: str | None = None,
    base_url: str | None = None,
    client: httpx.AsyncClient | None = None,
    **options: Any,
) -> Provider:
    """Build the provider called *name* for *model*.

    ``openai`` is any OpenAI-compatible Chat Completions server (set ``base_url`` for
    vLLM, Ollama, llama.cpp, LM Studio, OpenRouter, ...); ``anthropic`` is the
    Anthropic Messages API; ``test`` is the offline deterministic `TestModel`.
    API keys default to ``OPENAI_API_KEY`` / ``ANTHROPIC_API_KEY``. The HTTP
    providers are async context managers that own the client they create.
    """
    if name not in PROVIDER_NAMES:
        known = ", ".join(repr(known_name) for known_name in PROVIDER_NAMES)
        raise ProviderConfigError(f"unknown provider {name!r}; known providers: {known}")
    if not isinstance(model, str) or not model:
        raise ProviderConfigError(f"the {name} provider's model must be a non-empty string, got {model!r}")
    if name == "test":
        from ._test_model import TestModel

        return TestModel(model=model, **_options(name, TestModel, options))
    if name == "openai":
        from ._openai import OpenAIProvider as HTTPProvider
    else:
        from ._anthropic import AnthropicProvider as HTTPProvider  # type: ignore[assignment]
    return HTTPProvider(
        model, api_key=api_key, base_url=base_url, client=client, **_options(name, HTTPProvider, options)
    )


def _options(name: str, provider: type, options: dict[str, Any]) -> dict[str, Any]:
    """*options*, if *provider*'s constructor takes each by keyword; else `ProviderConfigError`
    naming the unknown ones and the known ones (a bare TypeError named only the class)."""
    known = [
        parameter.name
        for parameter in inspect.signature(provider).parameters.values()
        if parameter.kind in (parameter.KEYWORD_ONLY, parameter.POSITIONAL_OR_KEYWORD) and parameter.name not in _GIVEN
    ]
    unknown = [option for option in options if option not in known]
    if unknown:
        raise ProviderConfigError(
            f"the {name} provider has no option {', '.join(map(repr, unknown))}; its options are {', '.join(known)}"
        )
    return options


# Named arguments of create_provider itself: not options.
_GIVEN = frozenset(("self", "model", "api_key", "base_url", "client"))
