"""The durable journal: events, projection, stores, leases, recovery and subscriptions.

The names used every day are also exported from `trio_agent` itself; this
module adds the event classes and the projection for code that reads or
writes journals directly::

    from trio_agent import open_journal, open_sqlite_store
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
from ._journal._conversation import fold_conversation, read_conversation
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
    RecoveryDecision,
    RequestAccepted,
    RequestCompleted,
    RequestFailed,
    RequestInterrupted,
    RequestInterruptReason,
    RequestStarted,
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
from ._journal._projection import Projection, RecoveryItem, RecoveryKind, RecoveryPlan, ToolState
from ._journal._sqlite import SQLiteStore, open_sqlite_store
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

if TYPE_CHECKING:
    from contextlib import AbstractAsyncContextManager

    from ._journal._postgres import PostgresStore


def open_postgres_store(dsn: str, **options: Any) -> AbstractAsyncContextManager[PostgresStore]:
    """Open the PostgreSQL journal store (needs the ``postgres`` extra: ``pip install 'trio_agent[postgres]'``).

    See `trio_agent._journal._postgres.open_postgres_store` for the options.
    """
    try:
        from ._journal._postgres import open_postgres_store as _open
    except ImportError as exc:  # pragma: no cover - depends on the environment
        from ._errors import ConfigError

        raise ConfigError(
            f"the PostgreSQL store needs psycopg 3: pip install 'trio_agent[postgres]' ({exc})"
        ) from exc
    return _open(dsn, **options)


def __getattr__(name: str) -> Any:
    # PostgresStore needs the optional psycopg: imported only when asked for.
    if name == "PostgresStore":
        from ._journal._postgres import PostgresStore

        return PostgresStore
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
    "ConversationSeeded",
    "CursorError",
    "DurableEvent",
    "DurableEventStream",
    "DurableJournal",
    "ErrorInfo",
    "Event",
    "EventEnvelope",
    "ForeignStreamError",
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
    "PermissionUpdated",
    "PostgresStore",
    "Projection",
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
    "RequestStarted",
    "SQLiteStore",
    "SequenceConflictError",
    "SessionCloseReason",
    "SessionClosed",
    "SessionCreated",
    "SessionReopened",
    "StaleFencingTokenError",
    "StreamInfo",
    "SubagentCancelled",
    "SubagentCompleted",
    "SubagentStarted",
    "ToolCancelled",
    "ToolCompleted",
    "ToolFailed",
    "ToolOutcomeUnknown",
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
