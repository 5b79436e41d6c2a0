"""The built-in ``task`` and ``task_output`` tools (registered when an agent defines subagents).

The tools are defined once per agent spec and shared by all its sessions; a call
finds its own session's `SubagentSupervisor` by the call's ``session_key`` (the token of
the open session whose pipeline runs it: not its session id, which two sessions in two
stores may share) in `TaskTools`, where each session registers its supervisor for its
lifetime (`TaskTools.route`, `TaskTools.unroute`). They use the supervisor's public
methods only.
"""

from __future__ import annotations

from typing import Any

import trio

from .._errors import RequestAbortedError
from .._tools._context import ToolContext
from .._tools._definition import SideEffect, Tool, ToolKind, define_tool, unscheduled
from .._tools._results import ToolErrorType, ToolResult
from ._hooks import HookAbortedError, HookError
from ._messages import SessionEvent, SubagentStatus
from ._requests import _Request
from ._stream import EventSink, discard
from ._subagents import SubagentSupervisor

__all__ = ["TaskTools"]


class TaskTools:
    """The two tools, and which supervisor serves each open session."""

    def __init__(self) -> None:
        self._supervisors: dict[object, SubagentSupervisor] = {}
        # Neither takes a scheduler slot: they only start, wait for or look at subagents, and background
        # subagents whose long calls hold every slot of the kind must not keep the root from them.
        self.tools: tuple[Tool[Any], ...] = (unscheduled(self._task_tool()), unscheduled(self._task_output_tool()))

    def route(self, session_key: object, supervisor: SubagentSupervisor) -> None:
        """Route the calls made with *session_key* (an open session's own token) to *supervisor*
        (until `unroute`)."""
        if session_key is None or session_key in self._supervisors:
            raise ValueError(f"session key {session_key!r} is not one open session's own")
        self._supervisors[session_key] = supervisor

    def unroute(self, session_key: object) -> None:
        del self._supervisors[session_key]

    def _supervisor(self, ctx: ToolContext) -> SubagentSupervisor | None:
        key = ctx.execution.session_key
        return None if key is None else self._supervisors.get(key)

    def _task_tool(self) -> Tool[Any]:
        @define_tool(
            name="task",
            description=(
                "Run a named subagent on a task. Foreground (default): waits and returns its answer. "
                "With background=true: starts it and returns its id; its result arrives at a later turn "
                "(or check with task_output)."
            ),
            input_schema={
                "type": "object",
                "properties": {
                    "subagent": {"type": "string", "description": "the subagent's name"},
                    "prompt": {"type": "string", "minLength": 1},
                    "background": {"type": "boolean", "default": False},
                },
                "required": ["subagent", "prompt"],
                "additionalProperties": False,
            },
            side_effect=SideEffect.NON_IDEMPOTENT,
            kind=ToolKind.READONLY,
            # Steering reaches a foreground subagent itself (its cancel tools stop, its block
            # tools finish, then it ends), so the call is not cancelled from outside by it.
            interrupt="block",
        )
        async def task(input: dict[str, Any], ctx: ToolContext) -> ToolResult:
            supervisor = self._supervisor(ctx)
            if supervisor is None:
                return _not_served(ctx)
            name = input["subagent"]
            if name not in supervisor.definitions:
                known = ", ".join(sorted(supervisor.definitions)) or "none"
                return ToolResult.failure(
                    ToolErrorType.VALIDATION, f"unknown subagent {name!r} (defined: {known})", code="unknown_subagent"
                )
            if not input["prompt"].strip():  # the schema's minLength lets a blank one through; send() refuses it
                return ToolResult.failure(
                    ToolErrorType.VALIDATION, "the subagent's prompt must not be blank", code="invalid_input"
                )
            try:
                if input.get("background"):
                    handle = await supervisor.spawn_background(
                        name, input["prompt"], ctx.agent_id, ctx.request_id, call_id=ctx.tool_call_id
                    )
                    return ToolResult.success(
                        f"started background subagent {handle.id}; its result arrives at a later turn",
                        data={"task_id": handle.id, "status": "running"},
                    )
                # The subagent's events go to the stream of the request that called the tool.
                parent = supervisor.host.running.get((ctx.agent_id, ctx.request_id))
                sink: EventSink = discard if parent is None else _following(parent)
                text = await supervisor.run_foreground(name, input["prompt"], ctx, sink)
            except RequestAbortedError as exc:
                # Steered or aborted: the call settles cancelled with the subagent's reason.
                return ToolResult.failure(ToolErrorType.INTERRUPTED, f"subagent {name!r}: {exc}", code=exc.reason)
            except HookError as exc:
                code = (
                    exc.code
                    if exc.code == "hook_skip"
                    else ("hook_abort" if isinstance(exc, HookAbortedError) else "hook_error")
                )
                return ToolResult.failure(ToolErrorType.EXECUTION, str(exc), code=code)
            return ToolResult.success(text, data={"subagent": name})

        return task

    def _task_output_tool(self) -> Tool[Any]:
        @define_tool(
            name="task_output",
            description="Check (or wait for, with block=true) a background subagent started by the task tool.",
            input_schema={
                "type": "object",
                "properties": {
                    "task_id": {"type": "string"},
                    "block": {"type": "boolean", "default": True},
                    "timeout": {"type": "number", "minimum": 0, "maximum": 600, "default": 30},
                },
                "required": ["task_id"],
                "additionalProperties": False,
            },
            side_effect=SideEffect.PURE,
            kind=ToolKind.READONLY,
            interrupt="cancel",
        )
        async def task_output(input: dict[str, Any], ctx: ToolContext) -> ToolResult:
            supervisor = self._supervisor(ctx)
            if supervisor is None:
                return _not_served(ctx)
            handle = supervisor.subagents.get(input["task_id"])
            if handle is None:
                return ToolResult.failure(
                    ToolErrorType.VALIDATION, f"no task {input['task_id']!r}", code="unknown_task"
                )
            if input.get("block", True) and handle.status is SubagentStatus.RUNNING:
                with trio.move_on_after(float(input.get("timeout", 30))):
                    await handle.wait()
            return ToolResult.success(
                f"task {handle.id}: {handle.status.value}"
                + (f"\n{handle.result}" if handle.result else "")
                + (f"\nerror: {handle.error}" if handle.error else ""),
                data={"task_id": handle.id, "status": handle.status.value},
            )

        return task_output


def _following(parent: _Request) -> EventSink:
    async def sink(event: SessionEvent) -> None:
        await parent.sink(event)  # the parent's sink of the moment (a stream may join it later)

    return sink


def _not_served(ctx: ToolContext) -> ToolResult:
    # Run outside an open session (a pipeline of its own, say): there are no subagents to reach.
    return ToolResult.failure(
        ToolErrorType.EXECUTION, f"no open session {ctx.session_id!r} serves subagents here", code="no_session"
    )
