"""The permission engine behind `trio_agent.PermissionRules` and ``open_session(permission_mode=...)``.

A session's `PermissionEngine` (``session.permissions``) decides each tool call from the
mode (`MODE_TABLE`), the `Rule` s, the `PathPolicy` and the `ToolFilter`; a `Decision`
says which source decided::

    from trio_agent.permissions import PathPolicy, Rule, RuleBehavior
"""

from __future__ import annotations

from ._session._permissions import (
    MODE_TABLE,
    AskReason,
    Decision,
    DecisionSource,
    PathPolicy,
    PermissionEngine,
    PermissionHandler,
    PermissionHook,
    PermissionPhase,
    PermissionRecord,
    PermissionResult,
    Rule,
    RuleBehavior,
    RuleMatch,
    ToolFilter,
    ToolPermissionCheck,
    UpdatesApplied,
)
from ._util import fixup_module_metadata as _fixup_module_metadata

__all__ = [
    "MODE_TABLE",
    "AskReason",
    "Decision",
    "DecisionSource",
    "PathPolicy",
    "PermissionEngine",
    "PermissionHandler",
    "PermissionHook",
    "PermissionPhase",
    "PermissionRecord",
    "PermissionResult",
    "Rule",
    "RuleBehavior",
    "RuleMatch",
    "ToolFilter",
    "ToolPermissionCheck",
    "UpdatesApplied",
]

_fixup_module_metadata(__name__, globals())
