"""Providers by name: ``create_provider("openai", "gpt-4o-mini")``."""

from __future__ import annotations

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
    if name == "openai":
        from ._openai import OpenAIProvider

        return OpenAIProvider(model, api_key=api_key, base_url=base_url, client=client, **options)
    if name == "anthropic":
        from ._anthropic import AnthropicProvider

        return AnthropicProvider(model, api_key=api_key, base_url=base_url, client=client, **options)
    if name == "test":
        from ._test_model import TestModel

        return TestModel(model=model, **options)
    known = ", ".join(repr(known_name) for known_name in PROVIDER_NAMES)
    raise ProviderConfigError(f"unknown provider {name!r}; known providers: {known}")
