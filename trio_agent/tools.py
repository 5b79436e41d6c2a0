"""The tool machinery under `trio_agent.define_tool`: for middleware, stage and runtime authors.

An application defines tools with `trio_agent.define_tool` and returns `trio_agent.ToolResult`;
this module holds what runs them: the `ToolPipeline` (middleware, stages, abort and
settlement), the `ToolScheduler`, the tool journal (`ToolJournal`, `InMemoryToolJournal`)
and the types a tool middleware or stage sees::

    from trio_agent.tools import Allow, Deny, StageRequest, ToolMiddlewareRequest
"""

from __future__ import annotations

from ._abort import Abort, AbortHandle
from ._errors import FileLockTimeoutError, SettlementError, ToolBehaviorError
from ._tools._call import FaultCode, MiddlewareFault
from ._tools._chain import CallNext
from ._tools._context import CallOrigin, Emit, ExecutionContext, ToolCall, ToolMiddlewareRequest
from ._tools._definition import BehaviorOverride, ToolBehavior
from ._tools._journal import InMemoryToolJournal, ScheduledCall, Settlement, SettlementStatus, ToolJournal
from ._tools._pipeline import ToolExecutionRecord, ToolPipeline
from ._tools._results import Effect, JsonObject, ToolError, ToolItem
from ._tools._scheduler import FileLockManager, SchedulerLimits, SchedulerStatistics, ToolScheduler
from ._tools._stages import Allow, Deny, PostStage, Skip, Stage, StageRequest, ToolStages
from ._util import fixup_module_metadata as _fixup_module_metadata

__all__ = [
    "Abort",
    "AbortHandle",
    "Allow",
    "BehaviorOverride",
    "CallNext",
    "CallOrigin",
    "Deny",
    "Effect",
    "Emit",
    "ExecutionContext",
    "FaultCode",
    "FileLockManager",
    "FileLockTimeoutError",
    "InMemoryToolJournal",
    "JsonObject",
    "MiddlewareFault",
    "PostStage",
    "ScheduledCall",
    "SchedulerLimits",
    "SchedulerStatistics",
    "Settlement",
    "SettlementError",
    "SettlementStatus",
    "Skip",
    "Stage",
    "StageRequest",
    "ToolBehavior",
    "ToolBehaviorError",
    "ToolCall",
    "ToolError",
    "ToolExecutionRecord",
    "ToolItem",
    "ToolJournal",
    "ToolMiddlewareRequest",
    "ToolPipeline",
    "ToolScheduler",
    "ToolStages",
]

_fixup_module_metadata(__name__, globals())

ToolLifecycle = ToolJournal  # the former name (not exported: the word "lifecycle" now means chat middleware)
