"""Answers to a paused request as an inbox row holds them (`submit_answers` writes, a worker reads).

Rules
=====

* The answers are the values `Session.resume` takes (`Approve`, `Reject`, `Respond`, `Cancel`),
  written with the project's own wire format (`answers_to_json`: cattrs, a ``type`` tag) as
  JSON text, canonical (sorted keys, no spaces, ASCII), so a retry with the same answers is
  the same text. Never pickled: a row is read by any worker, of any version.
* What cannot be written so is an `InterruptResumeError` (``invalid_payload``) before anything
  is stored, as `Session.resume` raises for answers that are not a list: a value that is not
  an answer, or a ``Respond`` value / ``edited_args`` that is not JSON.
* A worker reads the text back with `answers_from_json`; a row that does not decode (written
  around `submit_answers`) is an `InterruptResumeError` too, and the worker refuses the row.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from .._lifecycle._interrupts import answers_from_json, answers_to_json, continuation_answers
from .._loop._interrupts import Approve, Cancel, InterruptAnswer, InterruptIssue, InterruptResumeError, Reject, Respond

__all__ = ["decode_answers", "encode_answers"]

_ANSWER_TYPES = (Approve, Reject, Respond, Cancel)


def _invalid(message: str, interrupt_id: str | None = None) -> InterruptResumeError:
    return InterruptResumeError([InterruptIssue(interrupt_id, "invalid_payload", message)])


def encode_answers(answers: Sequence[InterruptAnswer]) -> str:
    """*answers* as the inbox stores them (module rules); `InterruptResumeError` if they cannot be."""
    checked = continuation_answers(answers)  # a list or a tuple, as resume() takes
    for index, answer in enumerate(checked):
        if not isinstance(answer, _ANSWER_TYPES):
            raise _invalid(f"answer #{index} is {type(answer).__name__}, not Approve, Reject, Respond or Cancel")
    try:
        return json.dumps(answers_to_json(checked), sort_keys=True, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError, RecursionError) as exc:
        raise _invalid(f"the answers are not JSON: {exc}") from None


def decode_answers(text: str) -> tuple[InterruptAnswer, ...]:
    """The answers a row holds; `InterruptResumeError` (``invalid_payload``) if it holds none."""
    try:
        data = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise _invalid(f"the stored answers are not JSON: {exc}") from None
    return answers_from_json(data)
