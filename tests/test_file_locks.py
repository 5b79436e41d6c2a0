"""File locks: one lock per file whatever its name, path items that are not paths, and waits that
never sit on part of a call's paths (so a call tree and an unrelated call cannot deadlock)."""

from __future__ import annotations

import os
import pathlib
import random
from collections import Counter, defaultdict
from typing import Any

import pytest
import trio
import trio.testing
from trio.testing import wait_all_tasks_blocked

from trio_agent import AbortReason, ConfigError, define_tool
from trio_agent._errors import FileLockTimeoutError
from trio_agent._util import safe_repr
from trio_agent.testing import call_tool
from trio_agent.tools import (
    AbortHandle,
    CallOrigin,
    FileLockManager,
    SchedulerLimits,
    SettlementStatus,
    ToolCall,
    ToolPipeline,
    ToolScheduler,
)

# -- one file, one lock ---------------------------------------------------------------


class Inside:
    """A write tool that blocks until its call's event is set, recording who is inside."""

    def __init__(self) -> None:
        self.events: defaultdict[str, trio.Event] = defaultdict(trio.Event)
        self.inside: set[str] = set()
        self.started: list[str] = []
        self.overlaps: list[set[str]] = []

    def tool(self, paths: Any = None) -> Any:
        async def write(inp: dict[str, Any], ctx: Any) -> str:
            key = inp["id"]
            self.started.append(key)
            self.inside.add(key)
            if len(self.inside) > 1:
                self.overlaps.append(set(self.inside))
            try:
                await self.events[key].wait()
            finally:
                self.inside.discard(key)
            return key

        return define_tool(
            write,
            name="write",
            description="writes",
            side_effect="non_idempotent",
            kind="write",
            input_schema={"type": "object"},
            affected_paths=paths or (lambda inp: inp["paths"]),
        )


_OBJECT = object()


def workspace_with_link(tmp_path: pathlib.Path) -> str:
    """``<ws>/real/f.txt`` and ``<ws>/link`` -> ``<ws>/real``."""
    (tmp_path / "real").mkdir()
    (tmp_path / "real" / "f.txt").write_text("")
    (tmp_path / "link").symlink_to(tmp_path / "real")
    return str(tmp_path)


def real_name(ws: str) -> str:
    """What ``<ws>/link/f.txt`` resolves to."""
    return os.path.join(os.path.realpath(ws), "real", "f.txt")


@pytest.mark.parametrize("alias", ["link/f.txt", "real/../link/f.txt", "LINK_ABS"])
async def test_a_file_named_through_a_symlink_shares_the_lock_of_its_real_name(
    tmp_path: pathlib.Path, alias: str
) -> None:
    ws = workspace_with_link(tmp_path)
    if alias == "LINK_ABS":
        alias = os.path.join(ws, "link", "f.txt")
    gate = Inside()
    pipeline = ToolPipeline([gate.tool()], workspace=ws)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(call_tool, pipeline, "write", {"id": "real", "paths": ["real/f.txt"]})
        await wait_all_tasks_blocked()
        nursery.start_soon(call_tool, pipeline, "write", {"id": "alias", "paths": [alias]})
        await wait_all_tasks_blocked()
        assert gate.started == ["real"]  # the alias waits for the lock of the file it names
        assert pipeline.file_locks.held() == {real_name(ws): (0, True, 1)}
        gate.events["real"].set()
        await wait_all_tasks_blocked()
        assert gate.started == ["real", "alias"]
        gate.events["alias"].set()
    assert gate.overlaps == []
    assert pipeline.file_locks.held() == {}


def test_normalise_resolves_symlinks_like_the_path_policy(tmp_path: pathlib.Path) -> None:
    ws = workspace_with_link(tmp_path)
    assert FileLockManager.normalise(["link/f.txt", "real/f.txt", "./link/../real/f.txt"], ws) == (real_name(ws),)


@pytest.mark.parametrize(
    ("given", "item"),
    [
        (["real/f.txt", ["real/f.txt"]], ["real/f.txt"]),  # str() of it would lock "<ws>/['real/f.txt']"
        ([b"real/f.txt"], b"real/f.txt"),
        ([1, 2], 1),
        ([None], None),
        ([_OBJECT], _OBJECT),
    ],
)
async def test_an_affected_path_that_is_not_a_str_fails_the_call_naming_it(
    tmp_path: pathlib.Path, given: list[Any], item: object
) -> None:
    ws = workspace_with_link(tmp_path)
    gate = Inside()
    gate.events["w"].set()  # should it run, it returns at once
    pipeline = ToolPipeline([gate.tool(lambda inp: given)], workspace=ws)
    record = await call_tool(pipeline, "write", {"id": "w"})
    assert record.status is SettlementStatus.FAILED
    assert record.result.error is not None
    assert record.result.error.code == "tool_error"
    assert safe_repr(item) in record.result.error.message
    assert not record.tool_ran
    assert gate.started == []
    assert pipeline.file_locks.held() == {}


async def test_a_path_with_a_nul_byte_fails_the_call(tmp_path: pathlib.Path) -> None:
    gate = Inside()
    gate.events["w"].set()
    pipeline = ToolPipeline([gate.tool()], workspace=str(tmp_path))
    record = await call_tool(pipeline, "write", {"id": "w", "paths": ["a\x00b"]})
    assert record.result.error is not None and record.result.error.code == "tool_error"
    assert "NUL" in record.result.error.message
    assert not record.tool_ran


async def test_path_like_items_are_locked_as_the_paths_they_name(tmp_path: pathlib.Path) -> None:
    ws = workspace_with_link(tmp_path)
    seen: list[dict[str, tuple[int, bool, int]]] = []
    holder: list[ToolPipeline] = []

    async def write(inp: dict[str, Any], ctx: Any) -> str:
        seen.append(holder[0].file_locks.held())
        return "ok"

    tool = define_tool(
        write, name="write", description="w", side_effect="pure", kind="write", input_schema={"type": "object"},
        affected_paths=lambda inp: [pathlib.PurePosixPath("link/f.txt")],
    )  # fmt: skip
    assert tool.paths_for({}) == ("link/f.txt",)
    pipeline = ToolPipeline([tool], workspace=ws)
    holder.append(pipeline)
    record = await call_tool(pipeline, "write", {})
    assert record.result.ok
    assert seen == [{real_name(ws): (0, True, 0)}]


def test_paths_for_refuses_an_item_that_is_not_a_path() -> None:
    async def run(inp: dict[str, Any], ctx: Any) -> str:
        return "ok"

    tool = define_tool(
        run, name="t", description="t", side_effect="pure", input_schema={"type": "object"},
        affected_paths=lambda inp: ["a", ["b"]],
    )  # fmt: skip
    with pytest.raises(TypeError, match=r"\['b'\]"):
        tool.paths_for({})


# -- a waiter holds none of its paths -----------------------------------------------------


async def test_an_unrelated_call_waiting_for_a_parent_s_path_does_not_block_its_child(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # Parent P holds {a, c} and runs a child under it that needs {b}; Z, unrelated, wants {b, c}.
    # Holding b while it waited for c, Z kept the child (and so P, and so itself) waiting until
    # Z's lock_timeout failed it.
    events: defaultdict[str, trio.Event] = defaultdict(trio.Event)
    holder: list[ToolPipeline] = []
    child: list[Any] = []

    async def parent(inp: dict[str, Any], ctx: Any) -> str:
        await events["parent"].wait()
        async with ctx.slot_released():
            origin = CallOrigin(lineage=(ctx.execution.call_key,))
            child.append(await holder[0].execute(ToolCall("child", "leaf", {"paths": ["b"]}), origin))
        return "parent"

    async def leaf(inp: dict[str, Any], ctx: Any) -> str:
        return "leaf"

    tools = [
        define_tool(
            run, name=run.__name__, description="x", side_effect="pure", kind="write",
            input_schema={"type": "object"}, affected_paths=lambda inp: inp["paths"],
        )
        for run in (parent, leaf)
    ]  # fmt: skip
    pipeline = ToolPipeline(tools, workspace="/ws", lock_timeout=30.0)
    holder.append(pipeline)
    records: dict[str, Any] = {}

    async def call(call_id: str, name: str, paths: list[str]) -> None:
        records[call_id] = await call_tool(pipeline, name, {"paths": paths}, call_id=call_id)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(call, "P", "parent", ["a", "c"])
        await wait_all_tasks_blocked()
        nursery.start_soon(call, "Z", "leaf", ["b", "c"])
        await wait_all_tasks_blocked()
        # Z waits for c and holds nothing meanwhile (b is only queued for).
        assert pipeline.file_locks.held() == {"/ws/a": (0, True, 0), "/ws/b": (0, False, 1), "/ws/c": (0, True, 1)}
        events["parent"].set()
    assert trio.current_time() == 0  # no one waited out a lock_timeout
    assert child[0].result.ok
    assert records["P"].result.ok
    assert records["Z"].result.ok
    assert pipeline.file_locks.held() == {}


# -- pipelines that share one manager ---------------------------------------------------------


@pytest.mark.parametrize("keys", [(None, None), ("object", "object")])
async def test_a_call_of_another_pipeline_with_the_same_ids_is_no_ancestor(keys: tuple[Any, Any]) -> None:
    # Sessions A and B share one FileLockManager; both name their first call call_0. B's subagent
    # call runs under B's own call_0 (lineage ("root/call_0",)): A's root call_0, holding the
    # file, is no ancestor of it, so it waits for A as any unrelated call does. The lock owners
    # were the bare "<agent id>/<call id>", so B took A's hold for its ancestor's and both wrote.
    inside = Inside()
    tool = inside.tool()
    locks = FileLockManager()
    a_key, b_key = (object() if key == "object" else key for key in keys)
    a = ToolPipeline([tool], file_locks=locks, workspace="/ws", session_key=a_key)
    b = ToolPipeline([tool], file_locks=locks, workspace="/ws", session_key=b_key)
    results: dict[str, Any] = {}

    async def run(pipeline: ToolPipeline, key: str, origin: CallOrigin) -> None:
        call = ToolCall("call_0", "write", {"id": key, "paths": ["f.txt"]})
        results[key] = await pipeline.execute(call, origin)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(run, a, "A", CallOrigin(session_id="A"))
        await wait_all_tasks_blocked()
        assert inside.started == ["A"]
        origin = CallOrigin(session_id="B", agent_id="sub-1", lineage=("root/call_0",))
        nursery.start_soon(run, b, "B", origin)
        await wait_all_tasks_blocked()
        assert inside.started == ["A"]  # B waits for A's hold
        assert locks.held() == {"/ws/f.txt": (0, True, 1)}
        inside.events["A"].set()
        await wait_all_tasks_blocked()
        assert inside.started == ["A", "B"]
        inside.events["B"].set()
    assert inside.overlaps == []
    assert results["A"].result.ok
    assert results["B"].result.ok
    assert locks.held() == {}


async def test_pipelines_of_one_session_key_share_its_call_tree() -> None:
    # Two pipelines given one session's key run one session's calls: a call of one under a call of
    # the other (its lineage names it) goes ahead, as it would in one pipeline.
    inside = Inside()
    tool = inside.tool()
    locks = FileLockManager()
    key = object()
    a = ToolPipeline([tool], file_locks=locks, workspace="/ws", session_key=key)
    b = ToolPipeline([tool], file_locks=locks, workspace="/ws", session_key=key)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(a.execute, ToolCall("call_0", "write", {"id": "A", "paths": ["f.txt"]}))
        await wait_all_tasks_blocked()
        child = ToolCall("call_0", "write", {"id": "child", "paths": ["g.txt", "f.txt"]})
        nursery.start_soon(b.execute, child, CallOrigin(agent_id="sub-1", lineage=("root/call_0",)))
        await wait_all_tasks_blocked()
        assert inside.started == ["A", "child"]  # under A's call: A's hold does not keep it out
        inside.events["child"].set()
        await wait_all_tasks_blocked()
        inside.events["A"].set()
    assert locks.held() == {}


def test_a_session_key_that_cannot_name_a_lock_holder_is_refused_when_the_pipeline_is_made() -> None:
    # It names the holders of file locks: an unhashable one raised a bare TypeError from execute,
    # and only for a call that locked a file.
    with pytest.raises(ConfigError, match=r"session_key must be hashable, got \['s'\]"):
        ToolPipeline([Inside().tool()], session_key=["s"])


async def test_a_waiter_keeps_its_place_on_its_free_paths(autojump_clock: trio.testing.MockClock) -> None:
    # W wants {a, b, c}; b and c are held. Calls for a alone that come later queue behind W on a (W
    # holds nothing, but it is not overtaken there), so a stream of them cannot starve it.
    locks = FileLockManager()
    held_b = await locks.acquire_all(("/w/b",), True, 1.0, owner="hb")
    held_c = await locks.acquire_all(("/w/c",), True, 1.0, owner="hc")
    order: list[str] = []

    async def take(owner: str, paths: tuple[str, ...]) -> None:
        taken = await locks.acquire_all(paths, True, 100.0, owner=owner)
        order.append(owner)
        await trio.sleep(1)  # holds it a while (virtual time)
        locks.release_all(taken, exclusive=True, owner=owner)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(take, "W", ("/w/a", "/w/b", "/w/c"))
        await wait_all_tasks_blocked()
        assert locks.held()["/w/a"] == (0, False, 1)  # queued for, not held
        nursery.start_soon(take, "A1", ("/w/a",))
        await wait_all_tasks_blocked()
        assert order == []  # behind W on a
        locks.release_all(held_b, exclusive=True, owner="hb")
        await wait_all_tasks_blocked()
        assert order == []  # c is still held: W waits, holding none
        assert locks.held()["/w/b"] == (0, False, 1)
        locks.release_all(held_c, exclusive=True, owner="hc")
    assert order == ["W", "A1"]
    assert locks.held() == {}


async def test_a_cancelled_waiter_lets_the_calls_queued_behind_it_go() -> None:
    locks = FileLockManager()
    held_b = await locks.acquire_all(("/w/b",), True, 1.0, owner="hb")
    order: list[str] = []

    async def take(owner: str, paths: tuple[str, ...]) -> None:
        taken = await locks.acquire_all(paths, True, 100.0, owner=owner)
        order.append(owner)
        locks.release_all(taken, exclusive=True, owner=owner)

    scope = trio.CancelScope()

    async def cancellable() -> None:
        with scope:
            await take("W", ("/w/a", "/w/b"))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(cancellable)
        await wait_all_tasks_blocked()
        nursery.start_soon(take, "A", ("/w/a",))
        await wait_all_tasks_blocked()
        assert order == []  # behind W on a
        scope.cancel()
        await wait_all_tasks_blocked()
        assert order == ["A"]
        assert locks.held() == {"/w/b": (0, True, 0)}
        locks.release_all(held_b, exclusive=True, owner="hb")
    assert locks.held() == {}


# -- many calls: exclusive stays exclusive, nothing deadlocks ------------------------------------


@pytest.mark.parametrize("seed", range(12))
async def test_many_calls_and_call_trees_never_overlap_and_never_wait_out_the_bound(
    autojump_clock: trio.testing.MockClock, seed: int
) -> None:
    """Flat calls on any paths, and parents holding "parent paths" while children under them take
    "child paths" or one of their parent's. The only waits no lock manager can end are between two
    trees that each hold what the other's descendants need (nested holds), which this load never
    makes; any other stall shows as a lock timeout."""
    rnd = random.Random(seed)
    locks = FileLockManager()
    parent_paths = ["/w/p0", "/w/p1", "/w/p2"]
    child_paths = ["/w/c0", "/w/c1", "/w/c2", "/w/c3"]
    holders: defaultdict[str, list[tuple[str, bool, tuple[str, ...]]]] = defaultdict(list)
    overlaps: list[tuple[str, str, str]] = []
    timeouts: list[str] = []
    finished: list[str] = []

    def related(a: tuple[str, tuple[str, ...]], b: tuple[str, tuple[str, ...]]) -> bool:
        return a[0] in b[1] or b[0] in a[1]

    async def hold(owner: str, paths: tuple[str, ...], exclusive: bool, lineage: tuple[str, ...]) -> bool:
        try:
            await locks.acquire_all(paths, exclusive, 1000.0, owner=owner, lineage=lineage)
        except FileLockTimeoutError:
            timeouts.append(owner)
            return False
        for path in paths:
            for other, other_exclusive, other_lineage in holders[path]:
                if (exclusive or other_exclusive) and not related((owner, lineage), (other, other_lineage)):
                    overlaps.append((path, owner, other))
            holders[path].append((owner, exclusive, lineage))
        return True

    def let_go(owner: str, paths: tuple[str, ...], exclusive: bool, lineage: tuple[str, ...]) -> None:
        for path in paths:
            holders[path].remove((owner, exclusive, lineage))
        locks.release_all(paths, exclusive=exclusive, owner=owner)
        finished.append(owner)

    def some(universe: list[str], most: int) -> tuple[str, ...]:
        return tuple(sorted(rnd.sample(universe, rnd.randint(1, most))))

    async def flat(owner: str, delay: float) -> None:
        await trio.sleep(delay)
        paths, exclusive = some(parent_paths + child_paths, 4), rnd.random() < 0.7
        if await hold(owner, paths, exclusive, ()):
            await trio.sleep(rnd.choice([0, 0.5, 2]))
            let_go(owner, paths, exclusive, ())

    async def parent(owner: str, delay: float) -> None:
        await trio.sleep(delay)
        paths, exclusive = some(parent_paths, 2), rnd.random() < 0.8
        if not await hold(owner, paths, exclusive, ()):
            return
        async with trio.open_nursery() as nursery:
            for index in range(rnd.randint(1, 3)):
                # One of its parent's paths only under an exclusive hold: two parents reading a path
                # whose children each write it wait for each other (nested holds, for ever).
                mine = exclusive and rnd.random() < 0.3
                child_set = tuple(sorted(rnd.sample(paths, 1))) if mine else some(child_paths, 2)
                nursery.start_soon(child, f"{owner}.{index}", child_set, (owner,), rnd.random() * 2)
        let_go(owner, paths, exclusive, ())

    async def child(owner: str, paths: tuple[str, ...], lineage: tuple[str, ...], delay: float) -> None:
        await trio.sleep(delay)
        exclusive = rnd.random() < 0.6
        if await hold(owner, paths, exclusive, lineage):
            await trio.sleep(rnd.choice([0, 0.5, 1]))
            let_go(owner, paths, exclusive, lineage)

    with trio.fail_after(10_000):
        async with trio.open_nursery() as nursery:
            for index in range(60):
                runner = parent if rnd.random() < 0.3 else flat
                nursery.start_soon(runner, f"call{index}", rnd.random() * 10)
    assert overlaps == []
    assert timeouts == []
    assert trio.current_time() < 1000  # no one waited out the bound
    assert locks.held() == {}
    assert len(finished) >= 60


@pytest.mark.parametrize("seed", range(3))
async def test_many_pipeline_calls_keep_slots_and_locks_exclusive(
    autojump_clock: trio.testing.MockClock, seed: int
) -> None:
    """Calls of every kind on overlapping path sets in any order, some aborted, some timing out:
    no bucket runs more calls than its slots, no exclusive hold overlaps another, all settle."""
    rnd = random.Random(seed)
    limits = SchedulerLimits(readonly=2, write=2, execute=1)
    running: Counter[str] = Counter()
    holders: defaultdict[str, list[bool]] = defaultdict(list)  # path -> exclusive of each hold
    violations: list[object] = []

    def make(kind: str, safe: bool) -> Any:
        exclusive = not (kind == "readonly" and safe)

        async def run(inp: dict[str, Any], ctx: Any) -> str:
            running[kind] += 1
            if running[kind] > getattr(limits, kind):
                violations.append(("slots", kind, running[kind]))
            for path in inp["paths"]:
                if holders[path] and (exclusive or any(holders[path])):
                    violations.append(("lock", path, list(holders[path])))
                holders[path].append(exclusive)
            try:
                await trio.sleep(inp["t"])
            finally:
                for path in inp["paths"]:
                    holders[path].remove(exclusive)
                running[kind] -= 1
            return "ok"

        return define_tool(
            run, name=f"{kind}_{safe}", description="x", side_effect="pure", kind=kind, concurrency_safe=safe,
            input_schema={"type": "object"}, affected_paths=lambda inp: inp["paths"],
        )  # fmt: skip

    tools = [make(kind, safe) for kind in ("readonly", "write", "execute") for safe in (True, False)]
    pipeline = ToolPipeline(tools, scheduler=ToolScheduler(limits), workspace="/ws", lock_timeout=500.0, timeout=30.0)
    statuses: Counter[str] = Counter()

    async def one() -> None:
        await trio.sleep(rnd.random() * 20)
        tool = rnd.choice(tools)
        paths = rnd.sample(["a", "b", "c", "d"], rnd.randint(0, 3))
        abort = AbortHandle()
        async with trio.open_nursery() as nursery:
            if rnd.random() < 0.2:

                async def aborter(delay: float = rnd.random() * 5) -> None:
                    await trio.sleep(delay)
                    abort.abort(AbortReason.USER_ABORT, "stop")

                nursery.start_soon(aborter)
            inp = {"paths": paths, "t": rnd.choice([0, 0.5, 1, 3, 40])}
            record = await call_tool(pipeline, tool.name, inp, abort=abort)
            nursery.cancel_scope.cancel()
        statuses[record.result.error.code if record.result.error else "ok"] += 1

    with trio.fail_after(100_000):
        async with trio.open_nursery() as nursery:
            for _ in range(120):
                nursery.start_soon(one)
    assert violations == []
    assert sum(statuses.values()) == 120
    assert "lock_timeout" not in statuses
    assert statuses["ok"] > 0
    assert pipeline.file_locks.held() == {}
    assert all(
        borrowed == 0 and waiting == 0 for borrowed, waiting, _ in pipeline.scheduler.statistics().buckets.values()
    )
