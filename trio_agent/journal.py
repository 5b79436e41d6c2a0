"""The durable journal: events, projection, stores, leases, recovery and subscriptions.

`JournalError` and `LeaseLostError` are also exported from `trio_agent` itself (the
same objects). `SQLiteStore`, `open_sqlite_store` and `PostgresStore` load their
database driver on first use::

    from trio_agent.journal import open_journal, open_sqlite_store
    from trio_agent.journal import ToolCompleted, RequestAccepted
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ._errors import (
    CommandConflictError,
    CursorError,
    ForeignStreamError,
    InvalidTransitionError,
    JournalCorruptError,
    JournalError,
    JournalFencedError,
    JournalUnavailableError,
    LeaseHeldError,
    LeaseLostError,
    SequenceConflictError,
    StaleFencingTokenError,
)
from ._journal._conversation import ConversationFold, fold_conversation, read_conversation
from ._journal._durable import (
    CallRecord,
    DurableJournal,
    RecoveryReport,
    open_journal,
    result_from_json,
    result_to_json,
    unknown_outcome_result,
)
from ._journal._events import (
    SCHEMA_VERSION,
    ConversationSeeded,
    ErrorInfo,
    Event,
    EventEnvelope,
    InboxNoted,
    InterruptsResolved,
    ModelAbortReason,
    ModelAttemptAborted,
    ModelAttemptCompleted,
    ModelAttemptFailed,
    ModelAttemptStarted,
    OutcomeUnknownReason,
    PermissionDecision,
    PermissionRequested,
    PermissionResolved,
    PermissionUpdated,
    PromptSubmitted,
    RecoveryDecision,
    RequestAccepted,
    RequestCompleted,
    RequestFailed,
    RequestInterrupted,
    RequestInterruptReason,
    RequestStarted,
    RunPaused,
    SessionClosed,
    SessionCloseReason,
    SessionCreated,
    SessionReopened,
    SubagentCancelled,
    SubagentCompleted,
    SubagentStarted,
    ToolCancelled,
    ToolCompleted,
    ToolFailed,
    ToolOutcomeUnknown,
    ToolRecoveryAction,
    ToolScheduled,
    ToolStarted,
    TurnAborted,
    TurnAbortReason,
    TurnCompleted,
    TurnStarted,
    decode_event,
    encode_event,
)
from ._journal._memory import MemoryStore
from ._journal._projection import (
    PermissionState,
    Projection,
    RecoveryItem,
    RecoveryKind,
    RecoveryPlan,
    RequestRecord,
    RequestState,
    SessionState,
    ToolRecord,
    ToolState,
)
from ._journal._store import (
    AppendBatch,
    AppendResult,
    AppendTicket,
    CommandRecord,
    JournalStore,
    Lease,
    StreamInfo,
    command_digest,
    stream_id_for,
)
from ._journal._subscribe import (
    CaughtUp,
    DurableEvent,
    DurableEventStream,
    JournalCursor,
    subscribe_durable_events,
)
from ._util import fixup_module_metadata as _fixup_module_metadata
from ._util import import_lazy as _import_lazy

if TYPE_CHECKING:
    from contextlib import AbstractAsyncContextManager

    from ._journal._postgres import PostgresStore
    from ._journal._sqlite import SQLiteStore, open_sqlite_store

# The stores import their database driver (sqlite3, psycopg): loaded on first use.
_LAZY: dict[str, str] = {
    "PostgresStore": "trio_agent._journal._postgres",
    "SQLiteStore": "trio_agent._journal._sqlite",
    "open_sqlite_store": "trio_agent._journal._sqlite",
}


def open_postgres_store(dsn: str, **options: Any) -> AbstractAsyncContextManager[PostgresStore]:
    """Open the PostgreSQL journal store (needs the ``postgres`` extra: ``pip install 'trio_agent[postgres]'``).

    See `trio_agent._journal._postgres.open_postgres_store` for the options.
    """
    try:
        from ._journal._postgres import open_postgres_store as _open
    except ImportError as exc:  # pragma: no cover - depends on the environment
        from ._errors import ConfigError

        raise ConfigError(f"the PostgreSQL store needs psycopg 3: pip install 'trio_agent[postgres]' ({exc})") from exc
    return _open(dsn, **options)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return _import_lazy(__name__, _LAZY, name, globals())
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "SCHEMA_VERSION",
    "AppendBatch",
    "AppendResult",
    "AppendTicket",
    "CallRecord",
    "CaughtUp",
    "CommandConflictError",
    "CommandRecord",
    "ConversationFold",
    "ConversationSeeded",
    "CursorError",
    "DurableEvent",
    "DurableEventStream",
    "DurableJournal",
    "ErrorInfo",
    "Event",
    "EventEnvelope",
    "ForeignStreamError",
    "InboxNoted",
    "InterruptsResolved",
    "InvalidTransitionError",
    "JournalCorruptError",
    "JournalCursor",
    "JournalError",
    "JournalFencedError",
    "JournalStore",
    "JournalUnavailableError",
    "Lease",
    "LeaseHeldError",
    "LeaseLostError",
    "MemoryStore",
    "ModelAbortReason",
    "ModelAttemptAborted",
    "ModelAttemptCompleted",
    "ModelAttemptFailed",
    "ModelAttemptStarted",
    "OutcomeUnknownReason",
    "PermissionDecision",
    "PermissionRequested",
    "PermissionResolved",
    "PermissionState",
    "PermissionUpdated",
    "PostgresStore",
    "Projection",
    "PromptSubmitted",
    "RecoveryDecision",
    "RecoveryItem",
    "RecoveryKind",
    "RecoveryPlan",
    "RecoveryReport",
    "RequestAccepted",
    "RequestCompleted",
    "RequestFailed",
    "RequestInterruptReason",
    "RequestInterrupted",
    "RequestRecord",
    "RequestStarted",
    "RequestState",
    "RunPaused",
    "SQLiteStore",
    "SequenceConflictError",
    "SessionCloseReason",
    "SessionClosed",
    "SessionCreated",
    "SessionReopened",
    "SessionState",
    "StaleFencingTokenError",
    "StreamInfo",
    "SubagentCancelled",
    "SubagentCompleted",
    "SubagentStarted",
    "ToolCancelled",
    "ToolCompleted",
    "ToolFailed",
    "ToolOutcomeUnknown",
    "ToolRecord",
    "ToolRecoveryAction",
    "ToolScheduled",
    "ToolStarted",
    "ToolState",
    "TurnAbortReason",
    "TurnAborted",
    "TurnCompleted",
    "TurnStarted",
    "command_digest",
    "decode_event",
    "encode_event",
    "fold_conversation",
    "open_journal",
    "open_postgres_store",
    "open_sqlite_store",
    "read_conversation",
    "result_from_json",
    "result_to_json",
    "stream_id_for",
    "subscribe_durable_events",
    "unknown_outcome_result",
]

_fixup_module_metadata(__name__, globals())
