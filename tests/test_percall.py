"""The per-call path of ``TransferEngine.copy``: the small-call fast path, batched completions, the list op."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
from typing import Any

import numpy as np
import pytest
import torch
from helpers import fill_pool, same, snapshot
from test_ops import KINDS, _logical, _make_side

from tiered_kv import KVLayout, Tier, TransferEngine, ops
from tiered_kv.completions import CompletionInbox
from tiered_kv.pools import SMALL_CALL_BLOCKS, small_pairs
from tiered_kv.testing import assert_blocks_equal

# --------------------------------------------------------------------------------------------- small_pairs


def test_small_pairs_accepts_valid_lists_and_small_arrays() -> None:
    assert small_pairs([3, 1], [0, 2], 4, 4, False) == ([3, 1], [0, 2])
    got = small_pairs(np.array([1, 2], dtype=np.int32), np.array([3, 0], dtype=np.uint8), 4, 4, True)
    assert got == ([1, 2], [3, 0]) and all(type(x) is int for x in got[0] + got[1])


def test_pairs_without_the_extension_count_the_runs_the_path_choice_needs() -> None:
    """The native route's index check without the C++ one: small_pairs' lists and the runs of consecutive pairs."""
    from tiered_kv.copyops import _pairs_in_python

    assert _pairs_in_python(8, 8, False, [0, 1, 2], [5, 6, 7]) == ([0, 1, 2], [5, 6, 7], 1)
    assert _pairs_in_python(8, 8, False, [0, 1, 3], [5, 6, 7]) == ([0, 1, 3], [5, 6, 7], 2)
    assert _pairs_in_python(8, 8, False, np.array([4, 2]), np.array([0, 1])) == ([4, 2], [0, 1], 2)
    assert _pairs_in_python(8, 8, True, [0, 1], [1, 2]) is None
    assert _pairs_in_python(8, 8, False, [3], [3]) == ([3], [3], 1)


@pytest.mark.parametrize(
    ("src", "dst", "same_pool"),
    [
        ([0], [4], False),  # out of range (dst pool has 4 blocks)
        ([-1], [0], False),  # negative
        ([0, 1], [2, 2], False),  # duplicate destination
        ([0, 1], [1, 2], True),  # a block on both sides of one pool
        ([0, 1], [2], False),  # length mismatch
        ([], [], False),  # empty: the general path handles it
        ([0, True], [1, 2], False),  # bool is not an index
        ([0.0], [1], False),  # float
        ([2], [2], True),  # one pair, the same block on both sides of one pool
        ([0], [True], False),  # one pair, a bool destination
        ((0,), (1,), False),  # tuples: the general path
        (np.array([[0]]), np.array([[1]]), False),  # 2-D
        (np.array([0.0]), np.array([1.0]), False),  # float arrays
        (list(range(SMALL_CALL_BLOCKS + 1)), list(range(SMALL_CALL_BLOCKS + 1)), False),  # too many for the fast path
    ],
)
def test_small_pairs_declines_what_the_general_path_must_judge(src: Any, dst: Any, same_pool: bool) -> None:
    blocks = 4 if len(src) <= 4 else 1000  # the too-many case is in range: only its length declines it
    assert small_pairs(src, dst, blocks, blocks, same_pool) is None


@pytest.mark.parametrize(
    ("src", "dst", "message"),
    [
        ([0], [9], "out of range"),
        ([-1], [0], "negative"),
        ([0, 1], [2, 2], "duplicates"),
        ([0], [True], "integers|sequence"),
        ([0, 1], [2], "pair up"),
    ],
)
async def test_fast_path_keeps_the_general_errors(layout: KVLayout, src: Any, dst: Any, message: str) -> None:
    async with TransferEngine(layout, gpu_blocks=4, host_blocks=4, device="cpu") as engine:
        with pytest.raises((ValueError, TypeError), match=message):
            engine.copy(Tier.GPU, src, Tier.HOST, dst)
        with pytest.raises(ValueError, match="both a source and a destination"):
            engine.copy(Tier.GPU, [0, 1], Tier.GPU, [1, 2])
        assert engine.statistics().submitted == 0


async def test_small_and_general_paths_copy_the_same(device: str, layout: KVLayout) -> None:
    """Lists, numpy and tensors (fast and general paths) move the same bytes, including across one pool."""
    async with TransferEngine(layout, gpu_blocks=8, host_blocks=8, device=device) as engine:
        g = fill_pool(engine, "gpu", 3)
        await engine.copy(Tier.GPU, [5, 1, 2], Tier.HOST, [0, 7, 3])  # fast path (list)
        await engine.copy(Tier.GPU, np.array([6], dtype=np.int32), Tier.HOST, np.array([4]))  # fast path (array)
        await engine.copy(Tier.GPU, torch.tensor([0]), Tier.HOST, torch.tensor([1]))  # general path (tensor)
        await engine.copy(Tier.GPU, [3, 4], Tier.GPU, [6, 7])  # same pool, disjoint
        for h, src in ((0, 5), (7, 1), (3, 2), (4, 6), (1, 0)):
            assert same(snapshot(engine, "host", h), g[src]), (h, src)
        assert same(snapshot(engine, "gpu", 6), g[3]) and same(snapshot(engine, "gpu", 7), g[4])


# --------------------------------------------------------------------------------------------- completions


async def test_inbox_batches_posts_that_arrive_while_the_loop_is_busy() -> None:
    seen: list[int] = []
    inbox: CompletionInbox[int] = CompletionInbox(asyncio.get_running_loop(), seen.append)
    threads = [threading.Thread(target=inbox.post, args=(i,)) for i in range(20)]
    for t in threads:  # the loop is busy (this coroutine holds it) while all 20 arrive
        t.start()
        t.join()
    assert seen == []
    await asyncio.sleep(0.01)
    assert seen == list(range(20))
    assert inbox.deliveries == 1 and inbox.posted == 20


async def test_inbox_poke_wakes_the_loop_without_an_item() -> None:
    """``poke`` (a stream's waiter, shortly before a long copy's expected end) queues a no-op loop callback from any
    thread, delivers nothing, and queues nothing while a delivery is pending."""
    loop = asyncio.get_running_loop()
    woken: list[object] = []

    class Counting:  # the loop, counting the thread-safe wake-ups
        def call_soon_threadsafe(self, callback: Any, *args: Any) -> Any:
            woken.append(callback)
            return loop.call_soon_threadsafe(callback, *args)

        def call_soon(self, callback: Any, *args: Any) -> Any:
            return loop.call_soon(callback, *args)

    seen: list[int] = []
    inbox: CompletionInbox[int] = CompletionInbox(Counting(), seen.append)  # type: ignore[arg-type]
    thread = threading.Thread(target=inbox.poke)
    thread.start()
    thread.join()
    assert len(woken) == 1
    await asyncio.sleep(0.01)
    assert seen == [] and inbox.deliveries == 0
    inbox.post(1)  # a delivery is pending now: a poke adds nothing
    inbox.poke()
    assert len(woken) == 2
    await asyncio.sleep(0.01)
    assert seen == [1] and inbox.deliveries == 1


async def test_inbox_strands_nothing_under_concurrent_posts() -> None:
    seen: list[tuple[int, int]] = []
    inbox: CompletionInbox[tuple[int, int]] = CompletionInbox(asyncio.get_running_loop(), seen.append)

    def poster(k: int) -> None:
        for i in range(3000):
            inbox.post((k, i))
            if i % 500 == 0:
                time.sleep(0.001)

    threads = [threading.Thread(target=poster, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads):  # noqa: ASYNC110 - polling threads, not a loop-side condition
        await asyncio.sleep(0.0005)
    for _ in range(100):
        if len(seen) == 12000:
            break
        await asyncio.sleep(0.005)
    assert len(seen) == 12000
    for k in range(4):  # each poster's items in its own order
        assert [i for kk, i in seen if kk == k] == list(range(3000))
    assert inbox.deliveries < inbox.posted


async def test_inbox_handler_error_does_not_drop_the_batch(caplog: pytest.LogCaptureFixture) -> None:
    seen: list[int] = []

    def handler(i: int) -> None:
        if i == 1:
            raise RuntimeError("boom")
        seen.append(i)

    inbox: CompletionInbox[int] = CompletionInbox(asyncio.get_running_loop(), handler)
    for i in range(3):
        inbox.post(i)
    await asyncio.sleep(0.01)
    assert seen == [0, 2]
    assert "completion handler raised" in caplog.text


async def test_engine_completions_that_arrive_together_wake_the_loop_once(layout: KVLayout) -> None:
    async with TransferEngine(layout, gpu_blocks=16, host_blocks=16, device="cpu") as engine:
        await engine.copy(Tier.GPU, [0], Tier.HOST, [0])
        inbox = engine._inbox
        assert inbox is not None
        before = inbox.deliveries
        transfers = [engine.copy(Tier.GPU, [i], Tier.HOST, [i]) for i in range(1, 16)]
        time.sleep(0.3)  # noqa: ASYNC251 - the point: the loop is blocked while the worker finishes all 15
        await asyncio.gather(*transfers)
        assert inbox.deliveries - before == 1
        assert engine.statistics().completed == 16 and not engine.fences


async def test_inbox_runs_after_behind_the_wake_ups_its_handlers_scheduled() -> None:
    loop = asyncio.get_running_loop()
    order: list[str] = []

    def wake(i: int) -> None:
        loop.call_soon(order.append, f"woken {i}")

    inbox: CompletionInbox[int] = CompletionInbox(loop, wake, lambda: order.append("after"))
    for i in range(2):
        inbox.post(i)
    await asyncio.sleep(0.01)
    assert order == ["woken 0", "woken 1", "after"]


async def test_engine_wakes_the_awaiter_before_its_bookkeeping(
    layout: KVLayout, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The fence release and statistics of a completion run after the awaiting coroutine resumed, not before."""
    from tiered_kv import FenceTable

    events: list[str] = []
    release = FenceTable.release

    def logged(self: FenceTable, marker: Any) -> None:
        events.append("release")
        release(self, marker)

    monkeypatch.setattr(FenceTable, "release", logged)
    async with TransferEngine(layout, gpu_blocks=4, host_blocks=4, device="cpu") as engine:
        await engine.copy(Tier.GPU, [0], Tier.HOST, [1])
        events.append("resumed")
        await asyncio.sleep(0)  # the bookkeeping callback queued behind the wake-up
        assert events == ["resumed", "release"]


async def test_state_read_right_after_a_wakeup_is_settled(layout: KVLayout) -> None:
    """Whoever reads statistics, fences or drains right after a wake-up (bookkeeping still queued) sees it done."""
    async with TransferEngine(layout, gpu_blocks=4, host_blocks=4, device="cpu") as engine:
        table = engine.fences  # held across completions, as the cache holds it
        t = engine.copy(Tier.GPU, [0], Tier.HOST, [1])
        seen: list[tuple[int, int]] = []
        t.add_done_callback(lambda _: seen.append((engine.statistics().completed, engine.statistics().in_flight)))
        await t
        assert table.pending("host", 1) == (None, ()) and table.pending("gpu", 0) == (None, ()) and not table
        assert seen == [(1, 0)]  # a done-callback sees its own completion counted

        await engine.copy(Tier.GPU, [2], Tier.HOST, [3])
        s = engine.statistics()
        assert (s.completed, s.in_flight, s.fences.fenced_blocks) == (2, 0, 0)
        assert s.blocks_by_direction == {"gpu->host": 2}

        await engine.copy(Tier.GPU, [0], Tier.HOST, [2])
        await asyncio.wait_for(engine.drain(), 5)  # completed but unsettled copies must not keep drain spinning
        assert "in_flight:0" in repr(engine) and "fenced:0" in repr(engine)


async def test_copies_behind_a_completed_unsettled_copy_keep_their_order(layout: KVLayout) -> None:
    """A completed copy whose fence entries are still to be dropped orders nothing, and its late release drops
    nothing of the copies registered since."""
    from tiered_kv.testing import stall

    async with TransferEngine(layout, gpu_blocks=8, host_blocks=8, device="cpu") as engine:
        g = fill_pool(engine, "gpu", 5)
        for _ in range(3):
            await engine.copy(Tier.GPU, [0], Tier.HOST, [1])  # its entries are still in the table now
            stall(engine.stream("onboard"), 0.1)
            read = engine.copy(Tier.HOST, [1], Tier.GPU, [2])  # reads host 1: no wait on the completed write
            write = engine.copy(Tier.GPU, [3], Tier.HOST, [1])  # overwrites host 1: must wait for `read`
            assert write._marker.after == [read._marker]
            await asyncio.sleep(0)  # the first copy's bookkeeping runs: it must not drop the newer entries
            assert engine.fences.pending("host", 1) == (write._marker, ())
            await asyncio.gather(read, write)
            assert same(snapshot(engine, "gpu", 2), g[0]) and same(snapshot(engine, "host", 1), g[3])
        assert not engine.fences and engine.statistics().completed == 9


# --------------------------------------------------------------------------------------------- copy_blocks_list


def test_copy_blocks_list_reference_matches_copy_blocks() -> None:
    src, _ = _make_side("layer", 6, torch.float16, "cpu")
    dst, _ = _make_side("block", 7, torch.float16, "cpu")
    want = [t.clone() for t in dst]
    ops.copy_blocks(want, src, torch.tensor([5, 0, 2]), torch.tensor([1, 6, 0]), num_tokens=3)
    torch.ops.tiered_kv.copy_blocks_list(dst, src, [5, 0, 2], [1, 6, 0], 3, ops.METHOD_KERNEL, 0)
    assert_blocks_equal(_logical("block", dst), _logical("block", want), "list op")
    with pytest.raises(ValueError, match="out of range"):
        torch.ops.tiered_kv.copy_blocks_list(dst, src, [6], [0], 3, ops.METHOD_KERNEL, 0)


@pytest.mark.gpu
@pytest.mark.parametrize("src_kind", KINDS)
@pytest.mark.parametrize("dst_kind", KINDS)
@pytest.mark.parametrize("pairs", [1, 5, 40, 200])  # inline parameters up to ~40 pairs here, then one pinned H2D
@pytest.mark.parametrize("method", [ops.METHOD_KERNEL, ops.METHOD_DMA])
@pytest.mark.parametrize("num_tokens", [None, 2])
def test_copy_blocks_list_cuda_matches_reference(
    src_kind: str, dst_kind: str, pairs: int, method: int, num_tokens: int | None
) -> None:
    rng = np.random.default_rng(pairs)
    src, _ = _make_side(src_kind, 220, torch.float16, "cuda")
    dst, _ = _make_side(dst_kind, 230, torch.float16, "pinned")
    want = [t.clone() for t in dst]
    s = rng.permutation(220)[:pairs].tolist()
    d = rng.permutation(230)[:pairs].tolist()
    n = src[0].shape[-2] if num_tokens is None else num_tokens
    ops.copy_blocks(want, [t.cpu() for t in src], torch.tensor(s), torch.tensor(d), num_tokens=num_tokens)
    stream = torch.cuda.Stream()
    torch.cuda.synchronize()  # the sides were filled on the default stream
    torch.cuda._sleep(50_000_000)  # the default stream is busy: the op must not run on it
    torch.ops.tiered_kv.copy_blocks_list(dst, src, s, d, n, method, stream.cuda_stream)
    stream.synchronize()
    assert_blocks_equal(_logical(dst_kind, dst), _logical(dst_kind, want), f"{src_kind}->{dst_kind} {pairs} {method}")
    # The C++ range check of the raw op is not exercised here: with torch 2.11+cu130 an error raised inside the
    # extension can end the process with SIGSEGV instead of a RuntimeError.
    # The public paths check ranges in Python first (copy_blocks_list_ref on CPU, the engine's small_pairs).


@pytest.mark.gpu
@pytest.mark.parametrize("native", [True, False])
async def test_engine_small_calls_use_the_list_op_on_their_stream(
    layout: KVLayout, native: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A small call is one native submission (or, with TIERED_KV_NATIVE=0, the list op); a big one the tensor op."""
    from tiered_kv.copyops import NativeRoute

    monkeypatch.setenv("TIERED_KV_NATIVE", "1" if native else "0")
    big = SMALL_CALL_BLOCKS + 8
    async with TransferEngine(layout, gpu_blocks=big, host_blocks=big, device="cuda") as engine:
        assert engine.copier.native is native
        g = fill_pool(engine, "gpu", 9)
        torch.cuda.synchronize()
        calls: list[str] = []
        real_build, real_job = engine.copier.build, NativeRoute.job

        def build(*args, **kwargs):
            op = real_build(*args, **kwargs)
            calls.append("list" if getattr(op, "explicit_stream", False) else "tensor")
            return op

        def job(self, s, d, num_tokens=None, runs=None):
            calls.append("native")
            return real_job(self, s, d, num_tokens, runs)

        engine.copier.build = build  # type: ignore[method-assign]
        monkeypatch.setattr(NativeRoute, "job", job)
        engine.stream("offload").submit(lambda: torch.cuda._sleep(50_000_000))  # later work must queue behind it
        await engine.copy(Tier.GPU, [1, 2], Tier.HOST, [3, 4])
        everything = np.arange(big)
        await engine.copy(Tier.GPU, everything, Tier.HOST, everything[::-1].copy())
        assert calls == ["native" if native else "list", "tensor"]
        host = engine.pool(Tier.HOST).tensor.cpu()
        for i in range(big):
            assert same(host[big - 1 - i], g[i]), i


async def test_cancelled_transfer_await_forgets_its_waiter(layout: KVLayout) -> None:
    """Transfer.__await__ waits through Marker.wait_steps: a cancelled await leaves no waiter behind."""
    from tiered_kv.testing import stall

    async with TransferEngine(layout, gpu_blocks=2, host_blocks=2, device="cpu") as engine:
        stall(engine.stream("offload"), 0.2)
        t = engine.copy(Tier.GPU, [0], Tier.HOST, [1])

        async def wait() -> None:
            await t

        tasks = [asyncio.create_task(wait()) for _ in range(3)]
        await asyncio.sleep(0.01)
        assert len(t._marker._waiters) == 3
        tasks[0].cancel()
        with pytest.raises(asyncio.CancelledError):
            await tasks[0]
        assert len(t._marker._waiters) == 2 and not t.done()
        await asyncio.gather(*tasks[1:])
        assert t.done() and t._marker._waiters == [] and (await t).num_blocks == 1


# --------------------------------------------------------------------------------------------- host work


async def _host_work_of_one_copy(device: str) -> dict[str, Any]:
    """Bytecodes and Python calls per 1-block ``copy()`` (warmed up), counted by the per-call probe."""
    from tiered_kv.tools.bench.percall_probe import host_work

    layout = KVLayout(num_layers=1, num_kv_heads=1, head_dim=8, tokens_per_block=4)
    async with TransferEngine(layout, gpu_blocks=64, host_blocks=64, device=device) as engine:
        if device == "cuda":
            assert engine.copier.native, "the extension must expose the native submission path on a CUDA machine"
        for _ in range(20):
            await engine.copy(Tier.GPU, [0], Tier.HOST, [1])
        work = host_work(engine)
        await asyncio.gather(*work.pop("_transfers"))
    return work


async def test_host_work_of_one_small_copy_stays_within_budget() -> None:
    """The Python work of one 1-block ``copy()``, counted in bytecodes and calls (the same on any machine).

    1,564 bytecodes and 54 Python calls before a pair's route was resolved once per pair and small-call plans
    were memoized; 1,226 / 31 after (CPython 3.11); 1,120 / 28 before and 1,094 / 26 after the open-and-loop
    check was inlined into ``_copy`` and the in-flight set and the per-copy statistics became one dict (CPython
    3.11.7). The budget leaves room for another interpreter version, not for new per-call work: that needs a
    measurement and a new budget.
    """
    work = await _host_work_of_one_copy("cpu")
    assert work["python_calls_per_copy"] <= 30, work["by_function"]
    assert work["bytecodes_per_copy"] <= 1250, work["by_function"]


@pytest.mark.gpu
async def test_host_work_of_one_native_copy_stays_within_budget() -> None:
    """The same count on CUDA, where a small whole-block copy takes the native submission path.

    1,030 bytecodes and 31 Python calls through the torch ops; 533 / 13.7 through the native path (H100 and
    H200, CPython 3.12, measured by ``python -m tiered_kv.tools.bench.percall_probe``). The budget then was 650 /
    18; lowered by what the CPU count of the same code before the native branch lost since (the inlined
    open-and-loop check, one in-flight dict: 25 bytecodes and 2 calls, counted on the emulated device through a
    stand-in native route), with the same room above the expected ~508 / 11.7. With the one-call launch (a decided
    shape whose blocks have no op to wait for is enqueued by one call into C++): 573 / 11.7 on an H100, where 68 of
    the 100 copies find their blocks busy (the probe cycles through 32 blocks with all copies in flight) and go the
    per-step way after the launch declined them.
    """
    work = await _host_work_of_one_copy("cuda")
    assert work["python_calls_per_copy"] <= 16, work["by_function"]
    assert work["bytecodes_per_copy"] <= 625, work["by_function"]


# ------------------------------------------------------------------------------- the one-call launch, on the CPU


class _DoneEvent:
    """An event already reached (the fake native calls below copy synchronously)."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


class _FakeNativeStream:
    """What the engine and :class:`~tiered_kv.copyops.NativeRoute` use of a CUDA stream, completing from a thread.

    Completions are held until :meth:`release` (so a copy stays in flight, with its fences live, as long as a test
    needs it), then delivered in order from a thread, as the stream's waiter does.
    """

    rate = 0.0
    closed = False

    def __init__(self) -> None:
        self.native_args: tuple[int, int] | None = (0, 0)
        self.held: list[Any] = []
        self.notified = 0  # completions through notify_native (the per-step path)
        self.watched = 0  # completions through watch_native (the one-call launch)

    def notify_native(self, issue: Any, callback: Any, *, beside: bool = False, nbytes: int = 0) -> Any:
        event = issue(0, 0, 0)
        self.notified += 1
        self.held.append(callback)
        return event

    def watch_native(self, event: Any, callback: Any, nbytes: int) -> None:
        self.watched += 1
        self.held.append(callback)

    def wait(self, event: Any) -> None:  # a stream-side wait: the fake copies are done at once
        pass

    def release(self) -> None:
        held, self.held = self.held, []
        thread = threading.Thread(target=lambda: [cb() for cb in held])
        thread.start()
        thread.join()


def _gpu_pool(engine: TransferEngine) -> torch.Tensor:
    return engine.pool(Tier.GPU).tensor.clone()


def _fake_native(engine: TransferEngine, monkeypatch: pytest.MonkeyPatch) -> tuple[Any, _FakeNativeStream, list[str]]:
    """A NativeRoute for GPU->GPU copies of ``engine`` (emulated device) whose C++ calls are Python doubles.

    ``submit`` / ``launch`` copy tokens [0, n) of the named blocks at once (torch on the CPU) and log which entry
    ran. Returns the route, its stream and the log.
    """
    from tiered_kv import copyops
    from tiered_kv.copyops import NativeRoute, _pairs_in_python

    monkeypatch.setattr(copyops, "choose_path", lambda *a, **k: "kernel")  # the emulated device's path is "reference"
    route = engine._resolve_route(Tier.GPU, Tier.GPU)
    copier = engine.route(Tier.GPU, Tier.GPU).copier  # type: ignore[attr-defined]
    pool = engine.pool(Tier.GPU)
    tensor = pool.tensor
    tokens: dict[int, int] = {}
    log: list[str] = []

    def plan(info: Any, n: int, method: int) -> int:
        tokens[len(tokens) + 1] = n
        return len(tokens)

    monkeypatch.setattr(copier, "_native_plan", plan)

    def copy(plan_id: int, s: list[int], d: list[int]) -> None:
        n = tokens[plan_id]
        for x, y in zip(s, d, strict=True):
            tensor[y, ..., :n, :] = tensor[x, ..., :n, :]

    def submit(plan_id: int, s: list[int], d: list[int], stream: int, sem: int, side: int = 0) -> _DoneEvent:
        log.append("submit")
        copy(plan_id, s, d)
        return _DoneEvent()

    def pending(table: dict[int, Any] | None, block: int) -> bool:  # fast_path.cpp's rule
        entry = table.get(block) if table else None
        if entry is None:
            return False
        return any(not m.completed for m in entry) if isinstance(entry, dict) else not entry.completed

    def live(holders: dict[Any, None] | None) -> bool:  # fast_path.cpp's rule
        return holders is None or any(not m.completed for m in holders)

    def launch(sn: int, dn: int, same: bool, *args: Any) -> Any:
        src_writes, dst_writes, dst_reads, src_holders, dst_holders, src, dst, choices = args[:8]
        checked = _pairs_in_python(sn, dn, same, src, dst)
        if checked is None:
            return None
        s, d, runs = checked
        choice = choices.get((len(s), runs))
        if choice is None:
            return None
        if live(src_holders) or live(dst_holders):
            for x, y in zip(s, d, strict=True):
                if pending(src_writes, x) or pending(dst_writes, y) or pending(dst_reads, y):
                    return None
        log.append("launch")
        copy(choice[0], s, d)
        return _DoneEvent(), s, d, choice

    stream = _FakeNativeStream()
    info = copier._pair(pool, pool, engine.layout.tokens_per_block)
    native = NativeRoute(copier, info, stream, submit, None, launch)  # type: ignore[arg-type]
    native.bind_fences(engine._fences.tables(pool.name, pool.name))
    copier._native_routes.append(native)  # as Copier.native_route keeps it (statistics, forget_plans)
    engine._resolved[Tier.GPU, Tier.GPU] = (*route[:7], native)
    return native, stream, log


async def test_one_call_launch_takes_decided_shapes_with_fences_and_completion(
    layout: KVLayout, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The engine's one-call launch (NativeRoute.launch), wired as on CUDA, with the C++ calls replaced:

    - a call shape (token count, pairs, runs) goes the per-step way once, then in one call;
    - the launched copy holds its fence entries until it completes: a copy that reads what it writes, or overwrites
      what it reads or writes, takes the per-step path and waits for it; a copy of other blocks of the same pool
      is launched beside it;
    - completion, statistics and the route's per-path totals count launched copies like the others;
    - bytes land as named, whole and partial, lists and arrays.
    """
    async with TransferEngine(layout, gpu_blocks=16, host_blocks=2, device="cpu") as engine:
        native, stream, log = _fake_native(engine, monkeypatch)
        expected = fill_pool(engine, Tier.GPU, seed=3)
        try:
            name = engine.pool(Tier.GPU).name

            async def copy(src: Any, dst: Any, n: int | None = None) -> Any:
                transfer = engine.copy(Tier.GPU, src, Tier.GPU, dst, num_tokens=n)
                stream.release()
                await transfer
                t = layout.tokens_per_block if n is None else n
                for x, y in zip(list(src), list(dst), strict=True):
                    expected[int(y), ..., :t, :] = expected[int(x), ..., :t, :]
                assert same(_gpu_pool(engine), expected)
                return transfer

            await copy([0, 1], [8, 9])  # first of its shape (2 pairs, 1 run): decided on the per-step path
            assert log == ["submit"] and native.launched == 0
            await copy([2, 3], [10, 11])  # same shape: one call
            await copy(np.array([4, 5]), np.array([12, 13]))  # arrays too
            assert log == ["submit", "launch", "launch"] and native.launched == 2
            await copy([0, 2], [14, 15])  # 2 runs: a new shape
            await copy([1, 4], [13, 8])
            assert log[-2:] == ["submit", "launch"]
            await copy([5], [6], 3)  # partial: a shape of its own token count
            await copy([7], [4], 3)
            await copy([6], [3], layout.tokens_per_block)  # whole blocks named by their token count ...
            await copy([3], [2])  # ... are the shape of whole blocks
            assert log[-4:] == ["submit", "launch", "submit", "launch"]
            assert sum(calls for calls, _ in native.totals.values()) == len(log)

            # in flight (completion held): its entries are live, so a copy that touches its blocks waits for it ...
            def apply(src: list[int], dst: list[int]) -> None:  # each copy's effect, in call order (the fences' order)
                for x, y in zip(src, dst, strict=True):
                    expected[y] = expected[x]

            first = engine.copy(Tier.GPU, [2, 3], Tier.GPU, [10, 11])
            apply([2, 3], [10, 11])
            assert log[-1] == "launch" and not first.done()
            assert engine.fences.dependencies([(name, [10])], []) == {first._marker}, "its writes were not fenced"
            assert engine.fences.dependencies([], [(name, [3])]) == {first._marker}, "its reads were not fenced"
            # reads what it writes / overwrites what it reads / overwrites what it writes
            for src, dst in (([10, 11], [0, 1]), ([0, 1], [12, 3]), ([5, 6], [11, 13])):
                busy = engine.copy(Tier.GPU, src, Tier.GPU, dst)
                assert log[-1] == "submit", f"{src}->{dst} has an op to wait for: the per-step path must take it"
                stream.release()
                await busy
                assert first.done(), "a copy completed before the launched copy it depended on"
                apply(src, dst)
                first = engine.copy(Tier.GPU, [2, 3], Tier.GPU, [10, 11])  # in flight again (the shape is decided)
                apply([2, 3], [10, 11])
                assert log[-1] == "launch"
            # ... and one of other blocks of the same pool does not
            other = engine.copy(Tier.GPU, [4, 5], Tier.GPU, [14, 15])
            apply([4, 5], [14, 15])
            assert log[-1] == "launch" and not other.done() and not first.done()
            stream.release()
            await asyncio.gather(first, other)
            assert same(_gpu_pool(engine), expected)

            # nothing in flight again: launched; the engine's statistics count every copy
            await copy([2, 3], [10, 11])
            assert log[-1] == "launch"
            stats = engine.statistics()
            assert stats.submitted == stats.completed == len(log) and stats.in_flight == 0
            assert stats.bytes_by_direction["gpu->gpu"] == sum(nbytes for _, nbytes in native.totals.values())
            assert stream.watched == log.count("launch") and stream.notified == log.count("submit")
        finally:  # a failed assertion must not leave completions held (the engine's exit would wait)
            stream.release()


class _SpinEvent:
    """A native event the test reaches by hand: ``state`` 0 running, 1 done, -1 a CUDA error (``DeviceEvent.spin``)."""

    def __init__(self) -> None:
        self.state = 0
        self.spins = 0

    def spin(self, budget_ns: int) -> int:
        self.spins += 1
        return self.state

    def query(self) -> bool:
        if self.state < 0:
            raise RuntimeError("cudaEventQuery failed: an illegal memory access was encountered")
        return self.state == 1

    def synchronize(self) -> None:
        pass


async def test_in_place_await_of_a_native_event_completes_in_order(
    layout: KVLayout, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The in-place await of a launched copy's native event (``DeviceEvent.spin``), as on CUDA.

    - the oldest copy in flight is completed right where its end is seen, without ``_poll``; its fences and
      statistics settle as any completion's;
    - a copy with an older one still in flight on its stream takes ``_poll``, which completes the older one first:
      no transfer is done before one enqueued before it on its stream;
    - a CUDA error seen by the look completes nothing: the await raises it, and the copy completes (failed or not)
      only from its stream's thread.
    """
    async with TransferEngine(layout, gpu_blocks=16, host_blocks=2, device="cpu") as engine:
        native, stream, log = _fake_native(engine, monkeypatch)
        fill_pool(engine, Tier.GPU, seed=9)
        events: list[_SpinEvent] = []
        launch = native.launch

        def spin_launch(*args: Any) -> Any:
            got = launch(*args)
            if got is None:
                return None
            events.append(_SpinEvent())
            return (events[-1], *got[1:])

        native.launch = spin_launch
        monkeypatch.setattr(engine, "_native_event", _SpinEvent)
        monkeypatch.setattr(engine, "_await_spin", 1e-3)
        stream.watch = engine._watch  # type: ignore[attr-defined]  # as the engine binds its own streams
        polls: list[Any] = []
        poll = engine._poll
        def counted_poll(marker: Any) -> bool:
            polls.append(marker)
            return poll(marker)

        monkeypatch.setattr(engine, "_poll", counted_poll)
        try:
            first = engine.copy(Tier.GPU, [0, 1], Tier.GPU, [8, 9])  # decides the shape (per-step path)
            stream.release()
            await first
            engine.statistics()  # settled: nothing older in flight
            one = engine.copy(Tier.GPU, [2, 3], Tier.GPU, [10, 11])
            assert log[-1] == "launch" and len(events) == 1
            events[0].state = 1
            polls.clear()
            await one
            assert one.done() and events[0].spins == 1 and polls == [], "the oldest copy is completed in place"
            stats = engine.statistics()
            assert stats.in_flight == 0 and stats.completed == 2 and not engine.fences
            # an older copy in flight on the same stream: _poll completes it first
            older = engine.copy(Tier.GPU, [4, 5], Tier.GPU, [12, 13])
            newer = engine.copy(Tier.GPU, [6, 7], Tier.GPU, [14, 15])
            assert log[-2:] == ["launch", "launch"] and len(events) == 3
            events[1].state = events[2].state = 1
            await newer
            assert polls == [newer._marker] and older.done() and newer.done()
            done_at = (older._marker.done_at, newer._marker.done_at)
            assert done_at[0] is not None and done_at[1] is not None and done_at[0] <= done_at[1]
            await older
            # a CUDA error seen by the look: the await raises it, the copy is not taken for done
            engine.statistics()
            failed = engine.copy(Tier.GPU, [0, 1], Tier.GPU, [10, 11])
            events[-1].state = -1
            with pytest.raises(RuntimeError, match="illegal memory access"):
                await failed
            assert not failed.done()
            stream.release()  # its thread's completion
            await asyncio.wait_for(failed._marker.wait(), 5)
            assert failed.done()
        finally:
            stream.release()


async def test_one_call_launch_declines_to_the_per_step_path(layout: KVLayout, monkeypatch: pytest.MonkeyPatch) -> None:
    """Whatever the one-call launch cannot take goes the per-step way, with the same results and errors.

    Invalid indices (the descriptive errors, nothing copied), a closed waiter (``native_args`` None), a changed
    copier config (the decided shapes are forgotten), and a launch that raises (the CUDA runtime failing).
    """
    async with TransferEngine(layout, gpu_blocks=16, host_blocks=2, device="cpu") as engine:
        native, stream, log = _fake_native(engine, monkeypatch)
        fill_pool(engine, Tier.GPU, seed=5)
        try:

            async def copy(src: Any, dst: Any) -> None:
                transfer = engine.copy(Tier.GPU, src, Tier.GPU, dst)
                stream.release()
                await transfer

            await copy([0], [1])
            await copy([2], [3])
            assert log == ["submit", "launch"]
            before = _gpu_pool(engine)
            for src, dst, message in (([0], [16], "out of range"), ([0, 1], [2, 2], "duplicates"), ([4], [4], "both")):
                with pytest.raises(ValueError, match=message):
                    engine.copy(Tier.GPU, src, Tier.GPU, dst)
            assert same(_gpu_pool(engine), before) and log == ["submit", "launch"]

            stream.native_args = None
            await copy([4], [5])
            assert log[-1] == "submit"
            stream.native_args = (0, 0)
            await copy([4], [5])
            assert log[-1] == "launch"

            copier = engine.route(Tier.GPU, Tier.GPU).copier  # type: ignore[attr-defined]
            copier.config = dataclasses.replace(copier.config)  # a new config object
            await copy([6], [7])
            assert log[-1] == "submit", "a shape decided under another config must be decided again"
            await copy([6], [7])
            assert log[-1] == "launch"

            def failing(*a: Any) -> Any:
                raise RuntimeError("cudaErrorLaunchFailure")

            monkeypatch.setattr(native, "launch", failing)
            await copy([8], [9])
            assert log[-1] == "submit"
            assert engine.statistics().failed == 0
        finally:  # a failed assertion must not leave completions held (the engine's exit would wait)
            stream.release()
