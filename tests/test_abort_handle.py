"""`AbortHandle`: its listeners run once, in the order they were added, whichever were removed."""

from __future__ import annotations

from collections.abc import Callable

from trio_agent._abort import Abort, AbortHandle, AbortReason


def _recorder(log: list[str], name: str) -> Callable[[Abort], None]:
    def listener(abort: Abort) -> None:
        log.append(f"{name}:{abort.reason.value}")

    return listener


def test_listeners_run_once_in_the_order_they_were_added() -> None:
    handle = AbortHandle()
    log: list[str] = []
    for name in "abc":
        handle.add_listener(_recorder(log, name))
    assert handle.abort(AbortReason.STEERING, "steered")
    assert not handle.abort()
    assert log == ["a:steering", "b:steering", "c:steering"]


def test_a_removed_listener_never_runs_and_later_ones_keep_their_order() -> None:
    handle = AbortHandle()
    log: list[str] = []
    first = handle.add_listener(_recorder(log, "a"))
    handle.add_listener(_recorder(log, "b"))
    handle.remove_listener(first)
    handle.add_listener(_recorder(log, "c"))  # added after b: runs after it
    handle.remove_listener(first)  # twice: ignored
    handle.remove_listener(12345)  # unknown: ignored
    handle.abort()
    assert log == ["b:user_abort", "c:user_abort"]


def test_a_listener_added_after_all_others_were_removed_runs_alone() -> None:
    handle = AbortHandle()
    log: list[str] = []
    tokens = [handle.add_listener(_recorder(log, name)) for name in "ab"]
    for token in tokens:
        handle.remove_listener(token)
    handle.add_listener(_recorder(log, "c"))
    handle.abort(AbortReason.SESSION_CLOSE)
    assert log == ["c:session_close"]


def test_a_listener_added_after_the_abort_runs_at_once() -> None:
    handle = AbortHandle()
    handle.abort(AbortReason.TIMEOUT, "too slow")
    log: list[str] = []
    assert handle.add_listener(_recorder(log, "late")) == -1
    assert log == ["late:timeout"]
    handle.remove_listener(-1)  # its token: ignored


def test_a_listener_that_removes_another_during_the_abort_does_not_stop_it() -> None:
    # Each listener runs: the ones the abort found are all told, as the abort took them all.
    handle = AbortHandle()
    log: list[str] = []
    tokens: list[int] = []

    def remover(abort: Abort) -> None:
        log.append("remover")
        handle.remove_listener(tokens[0])

    handle.add_listener(remover)
    tokens.append(handle.add_listener(_recorder(log, "b")))
    handle.abort()
    assert log == ["remover", "b:user_abort"]
