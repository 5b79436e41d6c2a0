"""A paused run between two HTTP requests: `PausedRun`, its JSON and its signature.

Rules
=====

* ``chat()`` that pauses returns a `PausedRun` (``result.paused``): the run's ids and
  its `PauseState` (the batch, the conversation, the pending calls, the counters).
  `PausedRun.to_json` / `PausedRun.from_json` (cattrs) make it plain JSON a web
  server can hand to a client or keep.
* State a client holds comes back untrusted. With a ``signing_key`` the state is
  signed: HMAC-SHA256 over the canonical JSON of everything in it (run id, the
  batch, every pending call id and its arguments, the history). A continuation
  checks the signature before anything else; a forged or edited state is one
  `InterruptResumeError` (code ``tampered``). Without a key, keep the state on the
  server: an unsigned state is taken as it is.
* A continuation carries only answers (`Approve`, `Reject`, `Respond`, `Cancel`);
  `answers_from_json` reads them from JSON (``{"type": "approve", "interrupt_id":
  ..., "edited_args": {...}}``), each bad item named.
"""

from __future__ import annotations

import enum
import functools
import hashlib
import hmac
from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import cattrs
from cattrs.strategies import configure_tagged_union

from .._errors import ConfigError, MiddlewareShapeError
from .._loop._interrupts import (
    Approve,
    Cancel,
    ClientTool,
    Interrupt,
    InterruptAnswer,
    InterruptDefinition,
    InterruptIssue,
    InterruptKind,
    InterruptResumeError,
    PauseState,
    Reject,
    Respond,
    canonical_json,
)
from .._loop._rules import Phase
from .._models._messages import FinishReason, configure_messages
from .._tools._definition import Tool
from .._util import safe_repr

__all__ = [
    "PausedRun",
    "answers_from_json",
    "answers_to_json",
    "check_signing_key",
    "pause_from_json",
    "pause_to_json",
    "registered_interrupts",
    "split_client_tools",
]


def _make_converter() -> cattrs.Converter:
    for cls in (Interrupt, PauseState, PausedRun):
        attrs.resolve_types(cls)
    converter = configure_messages(cattrs.Converter(forbid_extra_keys=True))
    converter.register_unstructure_hook(enum.Enum, lambda member: member.value)
    converter.register_structure_hook(str, _strict_str)
    for kind in (InterruptKind, Phase, FinishReason):  # a StrEnum is a str: it needs its own hook
        converter.register_structure_hook(kind, lambda value, cls: cls(value))
    configure_tagged_union(
        Approve | Reject | Respond | Cancel,
        converter,
        tag_name="type",
        tag_generator=lambda cls: cls.__name__.lower(),
    )
    return converter


def _detail(exc: Exception) -> str:
    """What cattrs found wrong, one line per problem (``transform_error``'s paths)."""
    return "; ".join(cattrs.transform_error(exc)) if isinstance(exc, cattrs.BaseValidationError) else str(exc)


def _strict_str(value: object, _: type) -> str:
    if not isinstance(value, str):
        raise ValueError(f"expected a string, got {type(value).__name__}")
    return value


@attrs.frozen
class PausedRun:
    """A run that paused (``chat()``'s ``result.paused``): hand it back with the answers to resume."""

    run_id: str
    thread_id: str
    agent_id: str
    state: PauseState
    signature: str = ""

    @property
    def interrupts(self) -> tuple[Any, ...]:
        """The batch of questions to answer (each an `Interrupt`)."""
        return self.state.interrupts

    def to_json(self) -> dict[str, Any]:
        data: dict[str, Any] = _wire().unstructure(self)
        return data

    @classmethod
    def from_json(cls, data: object) -> PausedRun:
        """Read a paused state (untrusted: a typed error names what is wrong)."""
        try:
            return _wire().structure(data, cls)
        except Exception as exc:
            detail = _detail(exc)
            raise InterruptResumeError(
                [InterruptIssue(None, "invalid_payload", f"not a paused run: {detail}")]
            ) from None

    def signed(self, key: bytes) -> PausedRun:
        return attrs.evolve(self, signature=_digest(self, key))

    def verify(self, key: bytes | None) -> None:
        """Raise `InterruptResumeError` (``tampered``) unless the signature matches; a signed state
        needs its key (an unsigned one, kept on the server, is taken as it is)."""
        if key is None:
            if self.signature:
                raise InterruptResumeError(
                    [InterruptIssue(None, "tampered", "the paused state is signed: pass its signing_key to check it")]
                )
            return
        if not _signature_matches(self.signature, key, self):
            raise InterruptResumeError(
                [
                    InterruptIssue(
                        None,
                        "tampered",
                        "the paused state's signature does not match: it was changed "
                        "or forged, or signed with another key",
                    )
                ]
            )


_wire = functools.cache(_make_converter)  # built on first use (an import should not pay for cattrs' code generation)


def _signature_matches(signature: object, key: bytes, paused: PausedRun) -> bool:
    if not signature or not isinstance(signature, str):
        return False
    # As bytes: compare_digest refuses a str holding non-ASCII text, which a forged signature may.
    return hmac.compare_digest(signature.encode("utf-8", "surrogatepass"), _digest(paused, key).encode())


def check_signing_key(key: object) -> bytes:
    """*key* as a signing key (bytes, at least 16 of them), else `ConfigError`: checked where it is
    given, before anything runs, and again where a state is signed or verified."""
    if not isinstance(key, (bytes, bytearray)) or len(key) < 16:
        raise ConfigError("signing_key must be bytes, at least 16 of them")
    return bytes(key)


def _digest(paused: PausedRun, key: bytes) -> str:
    key = check_signing_key(key)
    body = _wire().unstructure(attrs.evolve(paused, signature=""))
    return hmac.new(key, canonical_json(body).encode(), hashlib.sha256).hexdigest()


def pause_to_json(state: PauseState, *, with_messages: bool = True) -> dict[str, Any]:
    """Where a run paused, as JSON (a journal keeps it without the history: it has the history)."""
    if not with_messages:
        state = attrs.evolve(state, messages=())
    data: dict[str, Any] = _wire().unstructure(state)
    return data


def pause_from_json(data: object) -> PauseState:
    """`pause_to_json`'s inverse; a typed error (``invalid_payload``) names what is wrong."""
    try:
        return _wire().structure(data, PauseState)
    except Exception as exc:
        detail = _detail(exc)
        raise InterruptResumeError([InterruptIssue(None, "invalid_payload", f"not a paused state: {detail}")]) from None


def split_client_tools(tools: Sequence[Tool[Any] | ClientTool]) -> tuple[list[Tool[Any]], dict[str, ClientTool]]:
    """The run's tools and client tools (by name); `ConfigError` for anything else in *tools*."""
    if not isinstance(tools, (list, tuple)):
        raise ConfigError(f"tools must be a list of Tool (define_tool) and ClientTool values, not {safe_repr(tools)}")
    server: list[Tool[Any]] = []
    client: dict[str, ClientTool] = {}
    for index, tool in enumerate(tools):
        if not isinstance(tool, (Tool, ClientTool)):
            raise ConfigError(f"tools[{index}] is not a Tool (define_tool) or a ClientTool: {safe_repr(tool)}")
        if isinstance(tool, ClientTool):
            if tool.name in client:
                raise ConfigError(f"two client tools are named {tool.name!r}")
            client[tool.name] = tool
        else:
            server.append(tool)
    clash = {tool.name for tool in server} & set(client) if client else None
    if clash:
        raise ConfigError(f"a tool and a client tool share the name {sorted(clash)[0]!r}")
    return server, client


def registered_interrupts(
    interrupts: Sequence[InterruptDefinition], middleware: Sequence[object]
) -> dict[str, InterruptDefinition]:
    """The run's interrupt definitions by id (``interrupts=`` and every middleware's ``interrupts``).

    Raises:
        ConfigError: *interrupts* is not a list, or holds anything but `InterruptDefinition` values,
            or two definitions share an id.
        MiddlewareShapeError: *middleware* is not a list, or a middleware's ``interrupts`` is not one.
    """
    registered: dict[str, InterruptDefinition] = {}
    if not isinstance(interrupts, (list, tuple)):
        raise ConfigError(
            f"interrupts must be a list of InterruptDefinition values (define_interrupt), got {safe_repr(interrupts)}"
        )
    if not isinstance(middleware, (list, tuple)):
        raise MiddlewareShapeError(f"middleware must be a list of ChatMiddleware, got {safe_repr(middleware)}")
    if not interrupts and not middleware:
        return registered
    declared = list(interrupts)
    for index, mw in enumerate(middleware):
        own = getattr(mw, "interrupts", ())
        if not isinstance(own, (list, tuple)):
            raise MiddlewareShapeError(
                f"the interrupts of middleware #{index} must be a tuple of InterruptDefinition values, "
                f"got {safe_repr(own)}"
            )
        declared.extend(own)
    for definition in declared:
        if not isinstance(definition, InterruptDefinition):
            raise ConfigError(
                f"interrupts must be InterruptDefinition values (define_interrupt), got {safe_repr(definition)}"
            )
        known = registered.get(definition.id)
        if known is not None and known is not definition:
            raise ConfigError(f"duplicate interrupt definition id {definition.id!r}")
        registered[definition.id] = definition
    return registered


def continuation_answers(answers: object) -> tuple[InterruptAnswer, ...]:
    """The answers a continuation was given (``chat(resume=..., answers=...)``, `Session.resume`),
    kept as they are now; anything but a list or tuple (a str, a mapping, an iterator) is an
    `InterruptResumeError` (``invalid_payload``). The run checks each answer against its pause."""
    if isinstance(answers, (str, bytes)) or not isinstance(answers, Sequence):
        raise InterruptResumeError([InterruptIssue(None, "invalid_payload", "answers must be a list")])
    return tuple(answers)


def answers_to_json(answers: Sequence[InterruptAnswer]) -> list[dict[str, Any]]:
    return [_wire().unstructure(answer, Approve | Reject | Respond | Cancel) for answer in answers]


def answers_from_json(data: object) -> tuple[InterruptAnswer, ...]:
    """Answers from JSON (a list of ``{"type": "approve" | "reject" | "respond" | "cancel", ...}``)."""
    if not isinstance(data, Sequence) or isinstance(data, (str, bytes)):
        raise InterruptResumeError([InterruptIssue(None, "invalid_payload", "answers must be a JSON list")])
    answers: list[InterruptAnswer] = []
    issues: list[InterruptIssue] = []
    for index, item in enumerate(data):
        interrupt_id = item.get("interrupt_id") if isinstance(item, Mapping) else None
        try:
            answers.append(_wire().structure(item, Approve | Reject | Respond | Cancel))  # type: ignore[arg-type]
        except Exception as exc:
            detail = _detail(exc)
            issues.append(
                InterruptIssue(
                    interrupt_id if isinstance(interrupt_id, str) else None,
                    "invalid_payload",
                    f"answer #{index}: {detail}",
                )
            )
    if issues:
        raise InterruptResumeError(issues)
    return tuple(answers)
