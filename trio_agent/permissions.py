"""The permission engine behind `trio_agent.PermissionRules` and ``open_session(permission_mode=...)``.

A session's `PermissionEngine` (``session.permissions``) decides each tool call from the
mode (`MODE_TABLE`), the `Rule` s, the `PathPolicy` and the `ToolFilter`; a `Decision`
says which source decided::

    from trio_agent.permissions import PathPolicy, Rule, RuleBehavior

For an answer given elsewhere (a run that pauses for a person), ``engine.evaluate(...)``
returns an `AskNeeded` where ``engine.decide(...)`` would ask, and ``engine.conclude(...)``
turns the answer into a `Decision` (source ``interrupt``).

A `PermissionUpdate` (what ``on_updates_applied`` reports, what ``engine.replay_updates`` takes
again) is stored as JSON with `update_to_json` and read back with `update_from_json`.
"""

from __future__ import annotations

from ._permissions._engine import (
    PermissionEngine,
    PermissionHandler,
    PermissionHook,
    PermissionPhase,
    PermissionRecord,
    UpdatesApplied,
)
from ._permissions._rules import (
    MODE_TABLE,
    PathPolicy,
    PermissionResult,
    Rule,
    RuleBehavior,
    RuleMatch,
    ToolFilter,
    ToolPermissionCheck,
    update_from_json,
    update_to_json,
)
from ._permissions._table import AskNeeded, AskReason, Decision, DecisionSource
from ._util import fixup_module_metadata as _fixup_module_metadata

__all__ = [
    "MODE_TABLE",
    "AskNeeded",
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
    "update_from_json",
    "update_to_json",
]

_fixup_module_metadata(__name__, globals())
