"""compose_lifecycle: one chain per hook, each with its composition rule (the `_loop/_hooks.py` table)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st

from trio_agent._abort import Abort, AbortHandle, AbortReason
from trio_agent._errors import ConfigError, ModelError
from trio_agent._loop._compose import LifecycleHookError, compose_lifecycle
from trio_agent._loop._context import RunContext
from trio_agent._loop._events import CustomEvent, RunEvent
from trio_agent._loop._hooks import NO_HOOKS, Finished, Lifecycle, ModelConfig, ToolOutcome, defines
from trio_agent._loop._ports import RunEventSink
from trio_agent._loop._rules import LoopState, StopReason
from trio_agent._models._messages import ToolCallPart, Usage
from trio_agent._tools._results import ToolResult
from trio_agent._tools._stages import Allow, Deny, StageRequest, ToolStages


def run_context(run_id: str = "run-1") -> RunContext:
    async def discard(event: RunEvent) -> None:
        return None

    return RunContext(
        run_id=run_id, thread_id="thread", agent_id="root", abort=AbortHandle(), events=discard, messages=lambda: ()
    )


CONFIG = ModelConfig(instructions="be brief", messages=(), tools=())
FINISHED = Finished(StopReason.END_TURN, "done", 1, LoopState())
STATE = LoopState(iteration=1)


class Recorder(Lifecycle):
    """Defines the hooks that only observe; each appends (name, hook) to a shared log."""

    def __init__(self, name: str, log: list[tuple[str, str]]) -> None:
        self.name = name
        self.log = log

    async def setup(self, ctx: Any) -> None:
        self.log.append((self.name, "setup"))

    async def on_start(self, ctx: Any) -> None:
        self.log.append((self.name, "on_start"))

    async def on_iteration(self, ctx: Any, iteration: int, message_id: str) -> None:
        self.log.append((self.name, f"on_iteration {iteration} {message_id}"))

    async def on_usage(self, ctx: Any, usage: Usage) -> None:
        self.log.append((self.name, f"on_usage {usage.total_tokens}"))

    async def on_tool_phase_complete(self, ctx: Any, outcomes: Sequence[ToolOutcome]) -> None:
        self.log.append((self.name, f"on_tool_phase_complete {len(outcomes)}"))


# -- shape ---------------------------------------------------------------------------------


def test_zero_parts_compose_to_no_hooks_and_one_part_to_itself() -> None:
    part = Recorder("a", [])
    assert compose_lifecycle() is NO_HOOKS
    assert compose_lifecycle(part) is part
    # A part that defines nothing is left out, so it costs no composition either.
    assert compose_lifecycle(NO_HOOKS, part, Lifecycle()) is part


def test_a_hook_no_part_defines_keeps_the_no_op_and_wrap_events_returns_the_sink_itself() -> None:
    composed = compose_lifecycle(Recorder("a", []), Recorder("b", []))
    assert defines(composed, "setup") and defines(composed, "on_usage")
    for hook in ("on_config", "wrap_events", "tool_stages", "should_continue", "on_finish", "before_stop"):
        assert not defines(composed, hook), hook

    async def sink(event: RunEvent) -> None:
        return None

    assert composed.wrap_events(run_context(), sink) is sink
    assert composed.tool_stages(run_context()) is None


def test_nested_compositions_are_flattened() -> None:
    log: list[tuple[str, str]] = []
    a, b, c = Recorder("a", log), Recorder("b", log), Recorder("c", log)
    nested = compose_lifecycle(compose_lifecycle(a, b), c)
    assert getattr(nested, "parts", None) == (a, b, c)


def test_a_part_that_is_not_a_lifecycle_is_a_config_error_naming_its_index() -> None:
    with pytest.raises(ConfigError, match="#1"):
        compose_lifecycle(NO_HOOKS, object())  # type: ignore[arg-type]


# -- all, in order --------------------------------------------------------------------------


async def test_1_2_setup_start_iteration_usage_and_tool_phase_complete_run_every_part_in_order() -> None:
    log: list[tuple[str, str]] = []
    composed = compose_lifecycle(Recorder("a", log), Recorder("b", log), Recorder("c", log))
    ctx = run_context()
    await composed.setup(ctx)
    await composed.on_start(ctx)
    await composed.on_iteration(ctx, 0, "m-0")
    await composed.on_usage(ctx, Usage(total_tokens=7))
    await composed.on_tool_phase_complete(ctx, ())
    hooks = ["setup", "on_start", "on_iteration 0 m-0", "on_usage 7", "on_tool_phase_complete 0"]
    assert log == [(name, hook) for hook in hooks for name in "abc"]


# -- pipes ----------------------------------------------------------------------------------


class Appender(Lifecycle):
    """Pipes: appends its tag to the config's instructions and to a cut-off call's output."""

    def __init__(self, tag: str) -> None:
        self.tag = tag

    async def on_config(self, ctx: Any, config: ModelConfig) -> ModelConfig:
        return ModelConfig(config.instructions + self.tag, config.messages, config.tools)

    async def on_cut_off_call(self, ctx: Any, call: ToolCallPart, result: ToolResult) -> ToolResult:
        return ToolResult.success(f"{result.output}{self.tag}")


async def test_1_2_on_config_and_on_cut_off_call_pipe_in_list_order() -> None:
    composed = compose_lifecycle(Appender("-a"), Recorder("x", []), Appender("-b"))
    ctx = run_context()
    assert (await composed.on_config(ctx, CONFIG)).instructions == "be brief-a-b"
    call = ToolCallPart("c1", "echo", '{"q":')
    assert (await composed.on_cut_off_call(ctx, call, ToolResult.success("r"))).output == "r-a-b"


class Tagger(Lifecycle):
    """An event decorator: logs what it sees and forwards the event with its tag appended to the name."""

    def __init__(self, tag: str, seen: list[tuple[str, str]]) -> None:
        self.tag = tag
        self.seen = seen

    def wrap_events(self, ctx: Any, sink: RunEventSink) -> RunEventSink:
        async def tag(event: RunEvent) -> None:
            assert isinstance(event, CustomEvent)
            self.seen.append((self.tag, event.name))
            await sink(CustomEvent(event.run_id, event.agent_id, event.name + self.tag))

        return tag


async def test_3_2_wrap_events_pipes_so_part_0_sees_each_event_first() -> None:
    seen: list[tuple[str, str]] = []
    out: list[str] = []

    async def sink(event: RunEvent) -> None:
        assert isinstance(event, CustomEvent)
        out.append(event.name)

    composed = compose_lifecycle(Tagger("-a", seen), Tagger("-b", seen), Tagger("-c", seen))
    wrapped = composed.wrap_events(run_context(), sink)
    await wrapped(CustomEvent("r", "root", "e1"))
    await wrapped(CustomEvent("r", "root", "e2"))
    assert seen == [("-a", "e1"), ("-b", "e1-a"), ("-c", "e1-a-b"), ("-a", "e2"), ("-b", "e2-a"), ("-c", "e2-a-b")]
    assert out == ["e1-a-b-c", "e2-a-b-c"]


# -- deciders ------------------------------------------------------------------------------


class Decider(Lifecycle):
    """Answers the deciding hooks with fixed values and logs every call."""

    def __init__(
        self,
        name: str,
        log: list[str],
        *,
        retry: bool = False,
        stop_message: str | None = None,
        go_on: bool = True,
    ) -> None:
        self.name = name
        self.log = log
        self.retry = retry
        self.stop_message = stop_message
        self.go_on = go_on

    async def on_model_error(self, ctx: Any, error: ModelError) -> bool:
        self.log.append(f"{self.name}.on_model_error")
        return self.retry

    async def before_stop(self, ctx: Any, state: LoopState) -> str | None:
        self.log.append(f"{self.name}.before_stop")
        return self.stop_message

    async def should_continue(self, ctx: Any, state: LoopState) -> bool:
        self.log.append(f"{self.name}.should_continue")
        return self.go_on


async def test_1_2_on_model_error_retries_if_any_part_asks_and_every_part_is_told() -> None:
    log: list[str] = []
    ctx, error = run_context(), ModelError("boom")
    asks = compose_lifecycle(Decider("a", log), Decider("b", log, retry=True), Decider("c", log))
    assert await asks.on_model_error(ctx, error) is True
    assert log == ["a.on_model_error", "b.on_model_error", "c.on_model_error"]
    nobody = compose_lifecycle(Decider("a", log), Decider("b", log))
    assert await nobody.on_model_error(ctx, error) is False


async def test_before_stop_the_first_message_wins_and_later_parts_are_not_asked() -> None:
    log: list[str] = []
    composed = compose_lifecycle(
        Decider("a", log), Decider("b", log, stop_message="one more"), Decider("c", log, stop_message="other")
    )
    assert await composed.before_stop(run_context(), STATE) == "one more"
    assert log == ["a.before_stop", "b.before_stop"]
    assert await compose_lifecycle(Decider("a", log), Decider("b", log)).before_stop(run_context(), STATE) is None


async def test_1_2_should_continue_is_an_and_that_short_circuits_on_the_first_false() -> None:
    log: list[str] = []
    composed = compose_lifecycle(Decider("a", log), Decider("b", log, go_on=False), Decider("c", log))
    assert await composed.should_continue(run_context(), STATE) is False
    assert log == ["a.should_continue", "b.should_continue"]
    log.clear()
    assert await compose_lifecycle(Decider("a", log), Decider("b", log)).should_continue(run_context(), STATE)
    assert log == ["a.should_continue", "b.should_continue"]


# -- tool stages ----------------------------------------------------------------------------


def stage(tag: str) -> Any:
    async def decide(request: StageRequest) -> Allow | Deny | None:
        return None

    decide.__qualname__ = tag
    return decide


class Staged(Lifecycle):
    def __init__(self, stages: ToolStages | None) -> None:
        self.stages = stages

    def tool_stages(self, ctx: Any) -> ToolStages | None:
        return self.stages


def test_tool_stages_are_concatenated_slot_by_slot_in_list_order() -> None:
    a = ToolStages(before=[stage("a.before")], guard=[stage("a.guard")], post_tool=[stage("a.post")])
    b = ToolStages(pre_tool=[stage("b.pre")], before=[stage("b.before")], post_tool=[stage("b.post")])
    composed = compose_lifecycle(Staged(a), Staged(None), Staged(b))
    stages = composed.tool_stages(run_context())
    assert stages is not None

    def names(slot: tuple[Any, ...]) -> list[str]:
        return [callback.__qualname__ for callback in slot]

    assert names(stages.pre_tool) == ["b.pre"]
    assert names(stages.before) == ["a.before", "b.before"]
    assert names(stages.guard) == ["a.guard"]
    assert names(stages.post_tool) == ["a.post", "b.post"]
    assert compose_lifecycle(Staged(None), Staged(None)).tool_stages(run_context()) is None


# -- terminal hooks ------------------------------------------------------------------------


class Terminal(Lifecycle):
    """Terminal hooks that log and optionally fail."""

    def __init__(self, name: str, log: list[str], fail: bool = False) -> None:
        self.name = name
        self.log = log
        self.fail = fail

    def _note(self, hook: str) -> None:
        self.log.append(f"{self.name}.{hook}")
        if self.fail:
            raise RuntimeError(f"{self.name} {hook} failed")

    async def on_finish(self, ctx: Any, outcome: Finished) -> None:
        self._note("on_finish")

    async def on_abort(self, ctx: Any, abort: Abort) -> None:
        self._note("on_abort")

    async def on_error(self, ctx: Any, error: BaseException) -> None:
        self._note("on_error")


async def test_2_7_on_finish_one_failure_is_reraised_as_is_after_every_part_ran() -> None:
    log: list[str] = []
    failing = Terminal("b", log, fail=True)
    composed = compose_lifecycle(Terminal("a", log), failing, Terminal("c", log))
    with pytest.raises(RuntimeError, match=r"^b on_finish failed$") as caught:
        await composed.on_finish(run_context(), FINISHED)
    assert not isinstance(caught.value, LifecycleHookError)
    assert log == ["a.on_finish", "b.on_finish", "c.on_finish"]


async def test_2_7_on_finish_several_failures_are_one_typed_error_naming_each_part() -> None:
    log: list[str] = []
    composed = compose_lifecycle(Terminal("a", log, fail=True), Terminal("b", log), Terminal("c", log, fail=True))
    with pytest.raises(LifecycleHookError) as caught:
        await composed.on_finish(run_context(), FINISHED)
    error = caught.value
    assert [name for name, _ in error.failures] == ["a", "c"]
    assert all(isinstance(exc, RuntimeError) for _, exc in error.failures)
    assert "'a'" in str(error) and "'c'" in str(error) and "on_finish" in str(error)
    assert log == ["a.on_finish", "b.on_finish", "c.on_finish"]


@pytest.mark.parametrize("hook", ["on_abort", "on_error"])
async def test_2_7_on_abort_and_on_error_failures_are_logged_and_never_raised(
    hook: str, caplog: pytest.LogCaptureFixture
) -> None:
    log: list[str] = []
    composed = compose_lifecycle(Terminal("a", log, fail=True), Terminal("b", log), Terminal("c", log, fail=True))
    with caplog.at_level(logging.ERROR, logger="trio_agent.lifecycle"):
        if hook == "on_abort":
            await composed.on_abort(run_context(), Abort(AbortReason.USER_ABORT, "stop"))
        else:
            await composed.on_error(run_context(), ValueError("the run's own error"))
    assert log == [f"a.{hook}", f"b.{hook}", f"c.{hook}"]
    failed = [record for record in caplog.records if record.name == "trio_agent.lifecycle"]
    assert [record.getMessage() for record in failed] == [f"{hook} of a failed", f"{hook} of c failed"]


async def test_terminal_isolation_never_swallows_cancellation() -> None:
    log: list[str] = []

    class Slow(Lifecycle):
        async def on_finish(self, ctx: Any, outcome: Finished) -> None:
            await trio.sleep_forever()

    composed = compose_lifecycle(Slow(), Terminal("b", log))
    with trio.move_on_after(0.01) as scope:
        await composed.on_finish(run_context(), FINISHED)
    assert scope.cancelled_caught
    assert log == []  # the cancellation ended the hook chain; it was not treated as a failure


# -- invariants over any list of parts ---------------------------------------------------------


class Random(Lifecycle):
    def __init__(self, index: int, add: int, go_on: bool, message: str | None, fail: bool, log: list[int]) -> None:
        self.name = f"p{index}"
        self.index, self.add, self.go_on, self.message, self.fail, self.log = index, add, go_on, message, fail, log

    async def on_config(self, ctx: Any, config: ModelConfig) -> ModelConfig:
        return ModelConfig(config.instructions + f"+{self.add}", config.messages, config.tools)

    async def should_continue(self, ctx: Any, state: LoopState) -> bool:
        self.log.append(self.index)
        return self.go_on

    async def before_stop(self, ctx: Any, state: LoopState) -> str | None:
        return self.message

    async def on_finish(self, ctx: Any, outcome: Finished) -> None:
        if self.fail:
            raise KeyError(self.name)


part_specs = st.lists(
    st.tuples(st.integers(0, 9), st.booleans(), st.none() | st.sampled_from(["x", "y"]), st.booleans()), max_size=6
)


@settings(max_examples=200, deadline=None)
@given(part_specs)
def test_composition_matches_the_rules_for_any_list_of_parts(specs: list[tuple[int, bool, str | None, bool]]) -> None:
    async def check() -> None:
        log: list[int] = []
        parts = [Random(i, add, go_on, message, fail, log) for i, (add, go_on, message, fail) in enumerate(specs)]
        composed = compose_lifecycle(*parts)
        ctx = run_context()
        config = await composed.on_config(ctx, CONFIG)
        assert config.instructions == "be brief" + "".join(f"+{add}" for add, *_ in specs)
        expected_go_on = all(go_on for _, go_on, _, _ in specs)
        assert await composed.should_continue(ctx, STATE) is expected_go_on
        first_false = next((i for i, (_, go_on, _, _) in enumerate(specs) if not go_on), len(specs) - 1)
        assert log == list(range(first_false + 1)) if specs else log == []
        assert await composed.before_stop(ctx, STATE) == next((m for _, _, m, _ in specs if m is not None), None)
        failing = [f"p{i}" for i, (*_, fail) in enumerate(specs) if fail]
        try:
            await composed.on_finish(ctx, FINISHED)
        except LifecycleHookError as exc:
            assert len(failing) > 1
            assert [name for name, _ in exc.failures] == failing
        except KeyError as exc:
            assert failing == [exc.args[0]]
        else:
            assert failing == []

    trio.run(check)
