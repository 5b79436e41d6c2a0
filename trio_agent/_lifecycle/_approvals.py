"""`PermissionGate`: the permission table as a loop `ToolGate` (approvals by pausing).

The table is walked for every call of a batch before any of them runs
(`PermissionEngine.evaluate`, stages 0-11). Where it says "ask", nobody is asked
in-process: the call becomes an approval interrupt and the run pauses. A
continuation's approval concludes the ask (`PermissionEngine.conclude`): stages 0-5
run again on the final, maybe edited, arguments, so an edit that a deny rule, the
schema, the path policy or the mode refuses is refused. The remembered decisions
reach the pipeline as one ``permission`` stage, so each call runs (or is refused)
exactly as the table decided; the pipeline's other stages, the schema check and the
guards still run after it.

A gate that does not screen (``screens=False``: a session that asks its
``permission_handler``) only concludes the approvals a continuation answers; every other
call is left to the pipeline's permission stage, which asks the handler while it waits.
A session's gates share one map with its permission stage: each gate takes back what it
left there when its run ends (`release`), so no decision outlives its run.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from .._abort import AbortHandle
from .._loop._ports import NeedsApproval
from .._permissions._engine import PermissionEngine
from .._permissions._rules import PermissionAllow
from .._permissions._table import AskNeeded
from .._tools._context import ExecutionContext, ToolCall
from .._tools._definition import Tool
from .._tools._results import JsonObject
from .._tools._stages import Allow, Deny, StageDecision, StageRequest, ToolStages

__all__ = ["PermissionGate"]


def _no_fence() -> int | None:
    return None


class PermissionGate:
    """One run's gate over *engine* (per run: it remembers that run's decisions)."""

    def __init__(
        self,
        engine: PermissionEngine,
        tools: Mapping[str, Tool[Any]],
        *,
        session_id: str,
        abort: AbortHandle,
        lineage: tuple[str, ...] = (),
        decisions: dict[tuple[str, str], StageDecision] | None = None,
        screens: bool = True,
    ) -> None:
        self._engine = engine
        self._tools = tools
        self._session_id = session_id
        self._abort = abort
        self._lineage = lineage
        # (agent id, call id) -> the decision; a session shares one map with its permission stage.
        self._decisions: dict[tuple[str, str], StageDecision] = {} if decisions is None else decisions
        self._written: list[tuple[str, str]] = []  # the keys this run put in the map (`release`)
        self._screens = screens
        self._stages = ToolStages(permission=(self._stage,))

    def _context(self, call: ToolCall, ctx: Any) -> ExecutionContext:
        return ExecutionContext(
            session_id=self._session_id,
            agent_id=ctx.agent_id,
            request_id=ctx.request_id,
            turn_id=ctx.run_id,
            tool_call_id=call.id,
            idempotency_key=f"{self._session_id}:{ctx.agent_id}:{call.id}",
            abort=self._abort,
            fence=_no_fence,
            lineage=self._lineage,
        )

    async def screen(self, call: ToolCall, ctx: Any) -> StageDecision | NeedsApproval:
        tool = self._tools.get(call.name) if self._screens else None
        if tool is None:  # a client tool (or unknown: the loop answers that), or no screening: the pipeline decides
            return _PASS
        verdict = await self._engine.evaluate(tool, call.input, self._context(call, ctx))
        if isinstance(verdict, AskNeeded):
            return NeedsApproval(_ask_message(verdict))
        decision = verdict.to_stage_decision(call.input)
        self._remember((ctx.agent_id, call.id), decision)
        return decision

    async def approve(self, call: ToolCall, edited_args: JsonObject | None, ctx: Any) -> StageDecision:
        tool = self._tools.get(call.name)
        if tool is None:
            return Deny(f"tool {call.name!r} is not offered any more")
        context = self._context(call, ctx)
        engine = self._engine
        verdict = await engine.evaluate(tool, call.input, context)
        if isinstance(verdict, AskNeeded):
            decision = await engine.conclude(tool, verdict, context, PermissionAllow(updated_input=edited_args))
        elif edited_args is None:
            decision = verdict
        else:
            # The table no longer asks about the original arguments (a rule changed since the
            # pause); the edit is still judged like any arguments, the approval answering an ask.
            again = await engine.evaluate(tool, edited_args, context)
            decision = (
                again
                if not isinstance(again, AskNeeded)
                else await engine.conclude(tool, again, context, PermissionAllow())
            )
        final = call.input if edited_args is None else edited_args
        stage = decision.to_stage_decision(final)
        if isinstance(stage, Allow) and stage.input is None and edited_args is not None:
            stage = Allow(edited_args)
        self._remember((ctx.agent_id, call.id), stage)
        return stage

    def _remember(self, key: tuple[str, str], decision: StageDecision) -> None:
        self._decisions[key] = decision
        self._written.append(key)

    def release(self) -> None:
        """The run ended: take back the decisions its calls never reached the pipeline with (a
        refused call, a pause, a continuation refused, stopped or aborted). The permission stage
        takes each decision once; what no call took would otherwise stay for the session's life."""
        decisions, written = self._decisions, self._written
        for key in written:
            decisions.pop(key, None)
        written.clear()

    def stages(self) -> ToolStages:
        return self._stages

    async def _stage(self, request: StageRequest) -> StageDecision | None:
        context = request.context
        return self._decisions.get((context.agent_id, context.tool_call_id))


_PASS = Allow()  # not the gate's call: the pipeline's permission stage decides


def _ask_message(ask: AskNeeded) -> str:
    detail = ask.message or (f"rule {ask.rule!r}" if ask.rule else None)
    text = f"approval required to run {ask.tool_name!r}"
    return f"{text}: {detail}" if detail else text
