"""The loop's journal outlet (`RunRecorder`) over a `DurableJournal`, for sessions and durable ``chat()`` runs.

It keeps the batching sessions always had: a turn opens with its first model
attempt (one append), a reply without calls closes its turn (one append).
Structurally a `trio_agent._loop._ports.RunRecorder`; the journal does not import the loop.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from .._abort import Abort
from .._errors import ModelError
from .._loop._interrupts import InterruptAnswer, answer_to_json
from .._loop._rules import model_text
from .._models._assemble import ModelReply
from .._models._messages import ToolResultMessage
from .._tools._results import ToolResult
from ._conversation import reply_payload, settled_answer
from ._durable import DurableJournal
from ._events import (
    ErrorInfo,
    InterruptsResolved,
    ModelAbortReason,
    ModelAttemptAborted,
    ModelAttemptFailed,
    TurnStarted,
    model_attempt_completed,
    model_attempt_replied,
    model_attempt_started,
    turn_completed,
    turn_started,
)
from ._projection import RequestState

if TYPE_CHECKING:
    from .._loop._ports import TurnRef

__all__ = ["JournalRecorder"]


class JournalRecorder:
    """The loop's outlet into the session's journal, batching as before: a turn opens with its
    first attempt (one append), a reply without calls closes its turn (one append)."""

    __slots__ = ("agent_id", "journal")

    def __init__(self, journal: DurableJournal, agent_id: str) -> None:
        self.journal = journal
        self.agent_id = agent_id

    async def model_call_started(self, turn: TurnRef, model: str, *, opens_turn: bool) -> None:
        started = model_attempt_started(turn.run_id, turn.turn_id, turn.attempt_id, model)
        # Deferred: lost in a crash, an attempt that started is one that never did (it is asked again).
        # One event per defer: each alone is a valid next step, so nothing needs saving for a rollback.
        # No checkpoint of its own: the model call that follows is one.
        if opens_turn:
            self.journal.defer(turn_started(turn.run_id, turn.turn_id, turn.turn), agent_id=self.agent_id)
        self.journal.defer(started, agent_id=self.agent_id)

    async def model_call_completed(
        self, turn: TurnRef, reply: ModelReply, *, inputs: Sequence[str], rejected: Mapping[str, str]
    ) -> None:
        response = reply_payload(reply, inputs=inputs, rejected=rejected)
        # The reply is the assembler's, from checked chunks: only the turn's inputs (text from the
        # host's inbox) are judged here; anything but plain text gets the event's full check.
        build = model_attempt_replied if all(type(text) is str for text in inputs) else model_attempt_completed
        # Deferred: the reply is written with what it leads to (a call's start, which must be
        # durable before the tool runs, or the request's end); a crash before that asks the model again.
        self.journal.defer(build(turn.run_id, turn.turn_id, turn.attempt_id, response), agent_id=self.agent_id)
        if not reply.tool_calls:
            self.journal.defer(turn_completed(turn.run_id, turn.turn_id, False), agent_id=self.agent_id)

    async def model_call_failed(self, turn: TurnRef, error: ModelError) -> None:
        await self.journal.append(
            ModelAttemptFailed(
                request_id=turn.run_id,
                turn_id=turn.turn_id,
                attempt_id=turn.attempt_id,
                error=ErrorInfo.of(error),
            ),
            agent_id=self.agent_id,
        )

    async def model_call_aborted(self, turn: TurnRef, abort: Abort | None) -> None:
        await self.journal.append(
            ModelAttemptAborted(
                request_id=turn.run_id,
                turn_id=turn.turn_id,
                attempt_id=turn.attempt_id,
                reason=ModelAbortReason.REQUEST_INTERRUPTED,
            ),
            agent_id=self.agent_id,
        )

    async def turn_completed(self, turn: TurnRef) -> None:
        # Deferred: its calls' settlements are durable already; the next write carries it.
        self.journal.defer(turn_completed(turn.run_id, turn.turn_id, True), agent_id=self.agent_id)

    async def turn_started(self, turn: TurnRef) -> None:
        await self.journal.append(
            TurnStarted(request_id=turn.run_id, turn_id=turn.turn_id, turn=turn.turn), agent_id=self.agent_id
        )

    async def interrupts_resolved(
        self,
        paused_run_id: str,
        run_id: str,
        answers: Mapping[str, InterruptAnswer],
        answered: Mapping[str, ToolResult],
        approved: Sequence[str] = (),
    ) -> None:
        await self.journal.append(
            InterruptsResolved(
                request_id=paused_run_id,
                continuation_id=run_id,
                answers={interrupt_id: answer_to_json(answer) for interrupt_id, answer in answers.items()},
                results={
                    call_id: {"text": model_text(result), "is_error": not result.ok}
                    for call_id, result in answered.items()
                },
                approved=tuple(approved),
            ),
            agent_id=self.agent_id,
        )

    def pause_is_open(self, paused_run_id: str) -> bool | None:
        record = self.journal.projection(self.agent_id).request(paused_run_id)
        return record is not None and record.state is RequestState.PAUSED

    def settled_answer(self, call_id: str) -> ToolResultMessage | None:
        record = self.journal.call(call_id, self.agent_id)
        return None if record is None else settled_answer(record.settlement)
