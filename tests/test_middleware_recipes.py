"""The recipes of docs/middleware-guide.md (examples/middleware_recipes.py) do what the guide says."""

from __future__ import annotations

import importlib.util
import logging
import re
import subprocess
import sys
from functools import partial
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import trio
import trio.testing

from trio_agent import (
    AbortReason,
    InterruptBehavior,
    Progress,
    ToolContext,
    ToolErrorType,
    ToolMessage,
    ToolResult,
    define_tool,
)
from trio_agent.testing import ItemRecorder, call_tool
from trio_agent.tools import (
    CallNext,
    FaultCode,
    InMemoryToolJournal,
    SettlementStatus,
    ToolMiddlewareRequest,
    ToolPipeline,
)

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "examples" / "middleware_recipes.py"
GUIDE = ROOT / "docs" / "middleware-guide.md"


def _load_recipes() -> ModuleType:
    spec = importlib.util.spec_from_file_location("middleware_recipes", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


recipes: Any = _load_recipes()


def _entries(journal: InMemoryToolJournal, call_id: str, kind: str) -> list[dict[str, Any]]:
    return [entry.data for entry in journal.entries if entry.call_id == call_id and entry.kind == kind]


# -- 1. audit logging -----------------------------------------------------------------


async def test_audit_logs_each_call_before_and_after(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="middleware_recipes.audit")
    records = await recipes.demo_audit()

    assert [record.status for record in records] == [SettlementStatus.COMPLETED, SettlementStatus.FAILED]
    messages = [r.getMessage() for r in caplog.records if r.name == "middleware_recipes.audit"]
    assert len(messages) == 4
    assert messages[0] == "call audit-1: search started"
    assert re.fullmatch(r"call audit-1: search -> ok in \d+\.\d{3} s", messages[1])
    assert messages[2] == "call audit-2: search started"
    assert re.fullmatch(r"call audit-2: search -> validation in \d+\.\d{3} s", messages[3])


async def test_audit_passes_the_result_through_unchanged() -> None:
    expected = ToolResult.success("x", display="d", data={"k": 1}, metadata={"m": 2})

    @define_tool(side_effect="pure", kind="readonly", input_schema={"type": "object"})
    async def fixed(input: dict[str, Any], ctx: ToolContext) -> ToolResult:
        """Return a fixed result."""
        return expected

    record = await call_tool(ToolPipeline([fixed], middleware=[recipes.audit]), "fixed")
    assert record.result == expected


# -- 2. input normalisation -------------------------------------------------------------


async def test_normalise_strips_the_query_before_the_tool_runs() -> None:
    (trimmed, empty), journal = await recipes.demo_normalise()

    assert trimmed.call.input == {"query": "  cancel scopes \n"}
    assert trimmed.effective_input == {"query": "cancel scopes"}
    assert trimmed.result.output == "3 results for 'cancel scopes'"
    # The journal keeps what the model sent and what the tool ran with.
    assert _entries(journal, "norm-1", "scheduled")[0]["input"] == {"query": "  cancel scopes \n"}
    assert _entries(journal, "norm-1", "started")[0]["input"] == {"query": "cancel scopes"}

    # The schema check sees the normalised input: a blank query is rejected, the tool never runs.
    assert not empty.tool_ran
    assert empty.result.error is not None
    assert empty.result.error.type is ToolErrorType.VALIDATION
    assert journal.kinds("norm-2") == ["scheduled", "settled"]


async def test_normalise_passes_untouched_input_through_as_is() -> None:
    seen: list[ToolMiddlewareRequest] = []

    async def spy(request: ToolMiddlewareRequest, call_next: CallNext) -> ToolResult:
        seen.append(request)
        return await call_next()

    pipeline = ToolPipeline([recipes.search], middleware=[recipes.normalise_query, spy])
    record = await call_tool(pipeline, "search", {"query": "clean", "extra": 1})
    assert seen[0].input == {"query": "clean", "extra": 1}
    # Middleware works on the pipeline's copy; the model's call stays as it was sent.
    assert seen[0].input is not record.call.input


# -- 3. result redaction ----------------------------------------------------------------


async def test_redaction_masks_the_result_and_the_journal(autojump_clock: trio.testing.MockClock) -> None:
    demo, journal = await recipes.demo_redaction()

    plain = demo.plain
    assert plain.status is SettlementStatus.COMPLETED
    assert plain.result.output == "endpoint = https://api.example.com\napi_key = [REDACTED]\n"
    settled = _entries(journal, "redact-plain", "settled")[0]
    assert settled["result"] == plain.result
    assert settled["published"] is True


async def test_redaction_applies_when_the_request_is_aborted_during_the_unwind(
    autojump_clock: trio.testing.MockClock,
) -> None:
    demo, journal = await recipes.demo_redaction()

    aborted = demo.aborted
    assert aborted.aborted is not None and aborted.aborted.reason is AbortReason.USER_ABORT
    assert aborted.status is SettlementStatus.COMPLETED  # the core had finished: the result is committed
    assert aborted.published
    assert "[REDACTED]" in aborted.result.output
    assert "sk-live" not in aborted.result.output
    assert _entries(journal, "redact-abort", "settled")[0]["result"] == aborted.result


async def test_redaction_applies_when_the_caller_is_cancelled_during_the_unwind(
    autojump_clock: trio.testing.MockClock,
) -> None:
    demo, journal = await recipes.demo_redaction()

    assert demo.outside_cancelled  # trio.Cancelled reached the caller ...
    settled = demo.outside_settled  # ... after the redacted result was settled
    assert settled["status"] == "completed"
    assert settled["published"] is True
    assert "[REDACTED]" in settled["result"].output
    assert "sk-live" not in settled["result"].output
    assert journal.kinds("redact-cancel") == ["scheduled", "started", "settled"]


async def test_missed_unwind_deadline_persists_the_raw_result_unpublished(
    autojump_clock: trio.testing.MockClock,
) -> None:
    demo, _ = await recipes.demo_redaction(unwind_grace=0.5)

    missed = demo.missed
    assert missed.published is False
    assert missed.status is SettlementStatus.COMPLETED
    assert missed.result.error is not None
    assert missed.result.error.code == "unwind_deadline_missed"
    assert "sk-live" not in str(missed.result)  # the model never sees the raw result
    assert [fault.code for fault in missed.faults] == [FaultCode.UNWIND_DEADLINE_MISSED]
    assert demo.missed_settled["published"] is False
    assert "sk-live-4f9a8b7c6d5e4f3a" in demo.missed_settled["result"].output  # raw, unredacted


async def test_redaction_masks_error_messages_and_keeps_errors_errors() -> None:
    @define_tool(side_effect="pure", kind="readonly", input_schema={"type": "object"})
    async def leaky(input: dict[str, Any], ctx: ToolContext) -> str:
        """Fail with a secret in the message."""
        raise RuntimeError("auth failed for token ghp_abcdefghijklmnop")

    record = await call_tool(ToolPipeline([leaky], middleware=[recipes.redact_secrets]), "leaky")
    assert record.result.error is not None
    assert record.result.error.type is ToolErrorType.EXECUTION
    assert "ghp_" not in record.result.error.message
    assert "ghp_" not in record.result.output
    assert record.faults == ()


def test_mask_patterns() -> None:
    assert recipes.mask("a sk-live-4f9a8b7c6d5e4f3a b") == "a [REDACTED] b"
    assert recipes.mask("xoxb-123456789012") == "[REDACTED]"
    assert recipes.mask("sk-short") == "sk-short"  # too short to be a key
    assert recipes.mask("task-manager-output") == "task-manager-output"  # no word boundary before "sk"


# -- 4. cache short-circuit ---------------------------------------------------------------


async def test_cache_hit_skips_the_tool_hooks_and_permissions() -> None:
    demo = await recipes.demo_cache()
    miss, hit = demo.records

    assert len(demo.tool_runs) == 1  # the second call did not run the tool
    assert len(demo.permission_checks) == 1  # ... nor the permission stage
    assert miss.tool_ran and not miss.synthetic_start
    assert not hit.tool_ran and hit.synthetic_start
    assert hit.status is SettlementStatus.COMPLETED
    assert hit.result.output == miss.result.output == "EUR/USD = 1.0842"
    assert hit.result.metadata == {"cache": "hit"}
    assert "cache" not in miss.result.metadata


async def test_cache_hit_records_a_synthetic_start() -> None:
    demo = await recipes.demo_cache()
    journal = demo.journal

    assert journal.kinds("quote-2") == ["scheduled", "started", "settled"]
    started = _entries(journal, "quote-2", "started")[0]
    assert started == {"input": {"pair": "EUR/USD"}, "side_effect": "pure", "synthetic": True}
    assert _entries(journal, "quote-1", "started")[0]["synthetic"] is False
    assert _entries(journal, "quote-2", "settled")[0]["result"] == demo.records[1].result


async def test_cache_ignores_unlisted_tools_and_failures() -> None:
    get_quote, runs = recipes.make_quote_tool()
    pipeline = ToolPipeline([get_quote, recipes.flaky], middleware=[recipes.ResultCache({"flaky"})])
    for _ in range(2):
        await call_tool(pipeline, "get_quote", {"pair": "EUR/USD"})
    assert len(runs) == 2  # not listed: never cached

    records = [await call_tool(pipeline, "flaky") for _ in range(2)]
    assert all(record.tool_ran for record in records)  # failures are not cached


# -- 5. progress filter ----------------------------------------------------------------------


async def test_progress_filter_drops_and_rewrites_progress_only() -> None:
    demo = await recipes.demo_progress()

    progress = [item for item in demo.observed if isinstance(item, Progress)]
    assert [item.message for item in progress] == ["10% done", "40% done", "70% done", "100% done"]
    assert [item.completed for item in progress] == [1, 4, 7, 10]
    assert [item for item in demo.observed if isinstance(item, ToolMessage)] == [ToolMessage("download finished")]
    assert [effect.kind for effect in demo.filtered.effects] == ["new_messages"]


async def test_throttle_state_is_per_wrapper() -> None:
    first: list[Any] = []
    second: list[Any] = []

    async def into(items: list[Any], item: Any) -> None:
        items.append(item)

    a = recipes.throttle_progress(lambda item: into(first, item))
    b = recipes.throttle_progress(lambda item: into(second, item))
    await a(Progress(completed=5, total=10))
    await b(Progress(completed=5, total=10))  # b has its own "last"
    await a(Progress(completed=6, total=10))  # dropped: only 10 % more
    assert len(first) == 1
    assert len(second) == 1


async def test_progress_filter_is_per_call_under_concurrency() -> None:
    """Two concurrent calls through one progress_filter instance each get their own throttle."""
    pipeline = ToolPipeline([recipes.download], middleware=[recipes.progress_filter])
    recorders = [ItemRecorder(), ItemRecorder()]
    async with trio.open_nursery() as nursery:
        for recorder in recorders:
            nursery.start_soon(partial(call_tool, pipeline, "download", on_item=recorder))
    for recorder in recorders:
        progress = [item.message for item in recorder.items if isinstance(item, Progress)]
        assert progress == ["10% done", "40% done", "70% done", "100% done"]


# -- what middleware must not do ------------------------------------------------------------------


async def test_rules_checked_before_the_tool_runs(autojump_clock: trio.testing.MockClock) -> None:
    out = await recipes.demo_violations()
    expected = {
        "rename_tool": "cannot change the tool name",
        "replace_context": "cannot replace the execution context",
        "force_dry_run": "cannot change the tool interrupt behavior",
    }
    for name, text in expected.items():
        record = out[name]
        assert not record.tool_ran, name
        assert record.status is SettlementStatus.FAILED, name
        assert record.result.error is not None
        assert record.result.error.code == "middleware_violation", name
        assert text in record.result.error.message, name
        assert record.faults == (), name


async def test_rules_checked_after_the_core_keep_the_real_result(autojump_clock: trio.testing.MockClock) -> None:
    out = await recipes.demo_violations()
    expected = {
        "retry_once": (ToolErrorType.EXECUTION, [FaultCode.NEXT_CALLED_TWICE, FaultCode.MIDDLEWARE_RAISED_AFTER_CORE]),
        "pretend_success/failed": (ToolErrorType.EXECUTION, [FaultCode.FAILED_CORE_TURNED_SUCCESS]),
        "pretend_success/timeout": (ToolErrorType.TIMEOUT, [FaultCode.TIMEOUT_OVERWRITTEN]),
        "pretend_success/cancelled": (ToolErrorType.INTERRUPTED, [FaultCode.CANCELLATION_OVERWRITTEN]),
    }
    for name, (error_type, faults) in expected.items():
        record = out[name]
        assert record.tool_ran, name
        assert record.result.error is not None, name
        assert record.result.error.type is error_type, name
        assert [fault.code for fault in record.faults] == faults, name
    assert out["pretend_success/cancelled"].status is SettlementStatus.CANCELLED


async def test_deploy_without_middleware_runs_with_its_resolved_behaviour() -> None:
    pipeline = ToolPipeline([recipes.deploy])
    record = await call_tool(pipeline, "deploy", {"service": "api", "dry_run": True})
    assert record.result.output == "planned api"
    assert record.behavior.interrupt is InterruptBehavior.CANCEL


# -- concurrency safety ---------------------------------------------------------------------------


async def test_state_on_self_leaks_between_concurrent_calls() -> None:
    tags = await recipes.demo_concurrency(recipes.TagCallWrong())
    assert set(tags) == {"call-a", "call-b"}
    assert len(set(tags.values())) == 1  # both calls carry the tag of whichever entered last


async def test_state_in_locals_stays_with_its_call() -> None:
    tags = await recipes.demo_concurrency(recipes.TagCallRight())
    assert tags == {"call-a": "call-a", "call-b": "call-b"}


# -- all recipes in one stack ----------------------------------------------------------------------


async def test_stack_caches_normalised_input_and_stores_redacted_results() -> None:
    records, journal = await recipes.demo_stack()
    ran = [record.tool_ran for record in records]
    assert ran == [True, False, True, False]
    assert records[1].result.output == records[0].result.output
    assert records[1].effective_input == {"query": "nurseries"}  # normalised before the cache lookup
    for record in records[2:]:
        assert "[REDACTED]" in record.result.output
        assert "sk-live" not in record.result.output
    assert all("sk-live" not in str(entry.data) for entry in journal.entries)


# -- compose_middleware -------------------------------------------------------------------------


def test_compose_order_and_next_once() -> None:
    assert recipes.demo_compose() == ("hello WORLD!", "next() called multiple times")


# -- the script and the guide -----------------------------------------------------------------------


def test_script_runs() -> None:
    done = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    assert "9. compose_middleware" in done.stdout


def test_guide_code_blocks_are_in_the_script() -> None:
    script = SCRIPT.read_text()
    blocks = re.findall(r"```python[^\n]*\n(.*?)```", GUIDE.read_text(), flags=re.DOTALL)
    assert len(blocks) >= 8
    missing = [block for block in blocks if block.strip() not in script]
    assert not missing, "guide code not found verbatim in examples/middleware_recipes.py:\n" + "\n---\n".join(missing)
