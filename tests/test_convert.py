"""`LazyConverter`: configured on first use, through every entry point, once."""

from __future__ import annotations

import threading
from typing import Any

import cattrs
import pytest

from trio_agent._convert import LazyConverter
from trio_agent.models import Message, UserMessage, message_converter


def test_the_hook_getters_configure_first() -> None:
    converter = LazyConverter(configure=_tagged, forbid_extra_keys=True)
    unstructure = converter.get_unstructure_hook(Message)
    assert unstructure(UserMessage("hi")) == {"content": "hi", "type": "UserMessage"}
    assert converter.get_structure_hook(Message)({"type": "UserMessage", "content": "x"}, Message) == UserMessage("x")


def test_a_hook_registered_before_first_use_wins_as_on_a_plain_converter() -> None:
    converter = LazyConverter(configure=_tagged, forbid_extra_keys=True)
    converter.register_structure_hook(Message, lambda value, _: "custom")
    assert converter.structure({"type": "UserMessage", "content": "x"}, Message) == "custom"


def test_configure_runs_once_even_when_many_threads_come_first() -> None:
    calls: list[int] = []

    def configure(converter: cattrs.Converter) -> None:
        calls.append(1)
        _tagged(converter)

    converter = LazyConverter(configure=configure, forbid_extra_keys=True)
    results: list[Any] = []
    barrier = threading.Barrier(16)

    def use() -> None:
        barrier.wait()
        results.append(converter.structure({"type": "UserMessage", "content": "x"}, Message))

    threads = [threading.Thread(target=use) for _ in range(16)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert calls == [1] and results == [UserMessage("x")] * 16


def test_copy_works_and_keeps_the_plain_converter_semantics() -> None:
    copied = message_converter.copy()
    assert isinstance(copied, cattrs.Converter)
    assert copied.unstructure(UserMessage("hi"), UserMessage) == {"content": "hi"}


def _tagged(converter: cattrs.Converter) -> None:
    from trio_agent._models._messages import configure_messages

    configure_messages(converter)


@pytest.mark.parametrize("converter", [message_converter])
def test_the_public_converter_reads_what_it_writes(converter: cattrs.Converter) -> None:
    data = converter.unstructure(UserMessage("hi"), Message)
    assert converter.structure(data, Message) == UserMessage("hi")
