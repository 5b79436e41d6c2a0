"""Workers: serve sessions from many processes and machines on one PostgreSQL database.

Submit from anywhere (a plain blocking function, usable outside Trio), serve with as
many worker processes as the load needs, and read outcomes back from the journal::

    from trio_agent.workers import submit, serve_sessions, wait_for_request

    request_id = submit("session-42", "summarise the report", dsn=DSN)   # any process
    await serve_sessions(spec, DSN, concurrency=8)                        # each worker
    outcome = await wait_for_request(store, "session-42", request_id)    # any process

A request that paused for a person (``outcome.state == "paused"``) is answered from any
process too, with the answers `Session.resume` takes; a worker resumes the session::

    resumed = submit_answers("session-42", [Approve("approval_call_1")], dsn=DSN)
    outcome = await wait_for_request(store, "session-42", resumed)      # the continuation's end

``trio-agent worker --dsn ... --agent module:spec`` runs a worker from the command
line; ``trio-agent answer SESSION --approve ID`` answers a paused session;
``trio-agent sessions`` and ``trio-agent workers`` show the registry. See
docs/deployment.md.
"""

from __future__ import annotations

from ._util import fixup_module_metadata as _fixup_module_metadata
from ._workers._control import WorkerIdInUseError
from ._workers._queue import (
    DEFAULT_MAX_PROMPT_BYTES,
    DSN_ENV,
    PromptTooLargeError,
    RequestStatus,
    SessionStatus,
    Submitter,
    WorkerStatus,
    list_sessions,
    list_workers,
    request_status,
    submit,
    submit_answers,
)
from ._workers._results import LiveDelta, LiveSubscription, RequestOutcome, subscribe_live, wait_for_request
from ._workers._serve import WorkerReport, serve_sessions

__all__ = [
    "DEFAULT_MAX_PROMPT_BYTES",
    "DSN_ENV",
    "LiveDelta",
    "LiveSubscription",
    "PromptTooLargeError",
    "RequestOutcome",
    "RequestStatus",
    "SessionStatus",
    "Submitter",
    "WorkerIdInUseError",
    "WorkerReport",
    "WorkerStatus",
    "list_sessions",
    "list_workers",
    "request_status",
    "serve_sessions",
    "submit",
    "submit_answers",
    "subscribe_live",
    "wait_for_request",
]

_fixup_module_metadata(__name__, globals())
