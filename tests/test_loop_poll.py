"""The loop-side poll of awaited copies about to end (``EventPoller``, ``EngineConfig.completion_spin_us``).

An awaited copy expected to end soon is completed by the event loop from its event, not after its thread's
completion callback wakes the loop. The tests hold that callback back (a timer in front of it) so that only the poll
can complete the copy early, and check what must not change: a failed op still fails, copies on one stream still
complete in order, the late callback is a no-op, the bookkeeping (fences, statistics) is the same.
"""

from __future__ import annotations

import asyncio
import functools
import sys
import threading
import time
from typing import Any

import numpy as np
import pytest
import torch
from helpers import fill_pool, same, snapshot

from tiered_kv import EngineConfig, KVLayout, Tier, Transfer, TransferEngine, TransferError
from tiered_kv.completions import EventPoller
from tiered_kv.testing import stall

LATE = 0.4  # seconds the completion callbacks are held back
LATE_US = int(LATE * 1e6)


@pytest.fixture
def layout() -> KVLayout:
    return KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, tokens_per_block=4)


def _hold_back_callbacks(engine: TransferEngine, name: str, monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """The stream's completion callbacks run ``LATE`` s after their work; returns when each ran (filled later)."""
    stream = engine.stream(name)
    real = stream.notify
    ran: list[float] = []

    def late(callback: Any, *, beside: bool = False, nbytes: int = 0) -> Any:
        def delayed() -> None:
            def run() -> None:
                ran.append(time.perf_counter())
                callback()

            threading.Timer(LATE, run).start()

        return real(delayed, beside=beside, nbytes=nbytes)

    monkeypatch.setattr(stream, "notify", late)
    return ran


def _append(into: list[int], value: int, _transfer: object) -> None:
    into.append(value)


def _two_copies(engine: TransferEngine, order: list[int], *pairs: tuple[int, int]) -> tuple[Transfer, Transfer]:
    """GPU->host copies of ``(src, dst)`` block pairs on one stream; each appends its number (1, 2) to ``order``."""
    transfers = []
    for k, (src, dst) in enumerate(pairs, 1):
        transfer = engine.copy(Tier.GPU, [src], Tier.HOST, [dst])
        transfer.add_done_callback(functools.partial(_append, order, k))
        transfers.append(transfer)
    first, second = transfers
    return first, second


def _random_copy(
    engine: TransferEngine,
    model: dict[str, torch.Tensor],
    rng: np.random.Generator,
    routes: tuple[tuple[str, str], ...],
) -> Transfer:
    """One copy of 1-3 random blocks on a random route of ``routes``; ``model`` (tier -> blocks) follows it."""
    src, dst = routes[int(rng.integers(len(routes)))]
    k = int(rng.integers(1, 4))
    s = rng.choice(8, size=k, replace=False)
    free = np.setdiff1d(np.arange(8), s) if src == dst else np.arange(8)
    d = rng.choice(free, size=k, replace=False)
    before = model[src][s].clone()
    transfer = engine.copy(Tier(src), s, Tier(dst), d)
    model[dst][d] = before
    return transfer


async def _check_model(engine: TransferEngine, model: dict[str, torch.Tensor]) -> None:
    """Drain, then every block of both pools as ``model`` says."""
    await engine.drain()
    for tier in ("gpu", "host"):
        for b in range(8):
            assert same(snapshot(engine, tier, b), model[tier][b]), f"{tier} block {b}"


def _broken_build_op(*args: Any, **kwargs: Any) -> Any:
    """A handler's ``build_op`` whose op raises (a device fault); the op still reaches its event."""

    def op() -> None:
        raise OSError("simulated device fault")

    return op


def _engine(layout: KVLayout, spin_us: int, await_spin_us: int | None = None) -> TransferEngine:
    config = EngineConfig(completion_spin_us=spin_us, await_spin_us=await_spin_us)
    return TransferEngine(layout, gpu_blocks=8, host_blocks=8, device="cpu", config=config)


# ------------------------------------------------------------------------------------------- the engine


@pytest.mark.parametrize("spin_us", [200_000, 0], ids=["polled", "off"])
async def test_an_awaited_copy_completes_from_its_event(
    layout: KVLayout, monkeypatch: pytest.MonkeyPatch, spin_us: int
) -> None:
    async with _engine(layout, spin_us) as engine:
        ran = _hold_back_callbacks(engine, "offload", monkeypatch)
        expected = fill_pool(engine, "gpu", seed=1)
        t0 = time.perf_counter()
        result = await engine.copy(Tier.GPU, [2, 5], Tier.HOST, [0, 7])
        waited = time.perf_counter() - t0
        assert same(snapshot(engine, "host", 0), expected[2]) and same(snapshot(engine, "host", 7), expected[5])
        if spin_us:
            assert waited < LATE / 2, f"the poll should have completed it ({waited * 1e3:.0f} ms)"
            assert not ran, "completed before its callback ran"
            assert result.seconds < LATE / 2
        else:
            assert waited >= LATE * 0.9 and ran, "without the poll only the callback completes it"
        await engine.drain()
        stats = engine.statistics()
        assert (stats.submitted, stats.completed, stats.failed, stats.in_flight) == (1, 1, 0, 0)
        assert len(engine.fences) == 0
        await asyncio.sleep(LATE + 0.1)  # the held-back callback arrives and changes nothing
        assert ran and engine.statistics().completed == 1


async def test_a_failed_op_is_not_completed_from_its_event(layout: KVLayout, monkeypatch: pytest.MonkeyPatch) -> None:
    """The op raised: its event is still reached, but only its callback carries the error (``ok_at_event``)."""
    async with _engine(layout, 200_000) as engine:
        _hold_back_callbacks(engine, "offload", monkeypatch)

        monkeypatch.setattr(engine.route(Tier.GPU, Tier.HOST), "build_op", _broken_build_op)
        with pytest.raises(TransferError, match="simulated device fault"):
            await engine.copy(Tier.GPU, [0], Tier.HOST, [1])
        stats = engine.statistics()
        assert (stats.completed, stats.failed) == (1, 1)
        assert len(engine.fences) == 0


def _until_reached(transfer: Any) -> None:
    """Block the loop's thread until ``transfer``'s event is reached (its callback is held back)."""
    marker = transfer._marker
    deadline = time.perf_counter() + LATE / 2
    while marker.event is None or not marker.event.query():
        assert time.perf_counter() < deadline, "the op never reached its event"
        time.sleep(0.001)


async def test_a_copy_awaited_after_its_end_resumes_without_a_loop_round(
    layout: KVLayout, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Awaited past its end: one look at its event completes it in the await, which does not yield to the loop."""
    async with _engine(layout, 200_000) as engine:
        ran = _hold_back_callbacks(engine, "offload", monkeypatch)
        expected = fill_pool(engine, "gpu", seed=5)
        order: list[int] = []
        first, second = _two_copies(engine, order, (1, 1), (3, 6))
        _until_reached(second)
        rounds: list[int] = []
        asyncio.get_running_loop().call_soon(rounds.append, 1)  # runs as soon as the awaiting task yields
        result = await second
        assert not rounds, "the await yielded to the loop for a copy that had ended"
        assert not ran and first.done() and order == [1, 2], "completed from its event, in stream order"
        assert result.num_blocks == 1 and same(snapshot(engine, "host", 6), expected[3])
        stats = engine.statistics()  # the bookkeeping as after any completion
        assert (stats.completed, stats.failed, stats.in_flight) == (2, 0, 0) and len(engine.fences) == 0


async def test_a_failed_op_awaited_after_its_event_still_fails(
    layout: KVLayout, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The inline look leaves a failed op to its callback, which carries the error."""
    async with _engine(layout, 200_000) as engine:
        _hold_back_callbacks(engine, "offload", monkeypatch)

        monkeypatch.setattr(engine.route(Tier.GPU, Tier.HOST), "build_op", _broken_build_op)
        transfer = engine.copy(Tier.GPU, [0], Tier.HOST, [1])
        _until_reached(transfer)
        with pytest.raises(TransferError, match="simulated device fault"):
            await transfer
        stats = engine.statistics()
        assert (stats.completed, stats.failed) == (1, 1) and len(engine.fences) == 0


async def test_copies_on_one_stream_still_complete_in_order(layout: KVLayout, monkeypatch: pytest.MonkeyPatch) -> None:
    """Awaiting only the last of three copies on one stream: the poll completes the earlier two first."""
    async with _engine(layout, 200_000) as engine:
        _hold_back_callbacks(engine, "offload", monkeypatch)
        fill_pool(engine, "gpu", seed=2)
        order: list[int] = []
        transfers = [engine.copy(Tier.GPU, [i], Tier.HOST, [i]) for i in range(3)]
        for i, t in enumerate(transfers):
            t.add_done_callback(functools.partial(_append, order, i))
        t0 = time.perf_counter()
        await transfers[-1]
        assert time.perf_counter() - t0 < LATE / 2
        assert order == [0, 1, 2] and all(t.done() for t in transfers)


async def test_an_earlier_failed_copy_keeps_the_later_one_for_the_callbacks(
    layout: KVLayout, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A failed copy ahead on the stream: the later one is not completed before it (both wait for the callbacks)."""
    async with _engine(layout, 200_000) as engine:
        _hold_back_callbacks(engine, "offload", monkeypatch)
        route = engine.route(Tier.GPU, Tier.HOST)
        real = route.build_op  # type: ignore[attr-defined]  # the memory pairs' handler (StreamCopier)

        monkeypatch.setattr(route, "build_op", _broken_build_op)
        first = engine.copy(Tier.GPU, [0], Tier.HOST, [0])
        monkeypatch.setattr(route, "build_op", real)
        second = engine.copy(Tier.GPU, [1], Tier.HOST, [1])
        await second
        assert first.done(), "the earlier copy completes first"
        with pytest.raises(TransferError):
            first.result()


async def test_polled_copies_soak_per_byte(layout: KVLayout) -> None:
    """Random copies in every direction, awaited singly and in groups, with the poll on: every block as expected."""
    rng = np.random.default_rng(7)
    async with _engine(layout, 50_000) as engine:
        gpu = fill_pool(engine, "gpu", seed=3).clone()
        host = fill_pool(engine, "host", seed=4).clone()
        model = {"gpu": gpu, "host": host}
        for _ in range(60):
            t = _random_copy(engine, model, rng, (("gpu", "host"), ("host", "gpu"), ("gpu", "gpu")))
            if rng.random() < 0.7:
                await t
        await _check_model(engine, model)
        stats = engine.statistics()
        assert stats.completed == stats.submitted == 60 and stats.failed == 0
        assert len(engine.fences) == 0


# ------------------------------------------------------------------------------- waiting in place


@pytest.mark.parametrize("spin_us", [200_000, 0], ids=["with-poller", "no-poller"])
async def test_an_awaited_copy_due_soon_is_waited_for_in_place(
    layout: KVLayout, monkeypatch: pytest.MonkeyPatch, spin_us: int
) -> None:
    """Due within ``await_spin_us``: the await polls the event itself and resumes without yielding to the loop."""
    async with _engine(layout, spin_us, await_spin_us=LATE_US // 2) as engine:
        ran = _hold_back_callbacks(engine, "offload", monkeypatch)
        expected = fill_pool(engine, "gpu", seed=11)
        order: list[int] = []
        _first, second = _two_copies(engine, order, (0, 2), (4, 5))
        rounds: list[int] = []
        asyncio.get_running_loop().call_soon(rounds.append, 1)  # runs as soon as the awaiting task yields
        t0 = time.perf_counter()
        result = await second
        assert time.perf_counter() - t0 < LATE / 2
        assert not rounds, "the await yielded to the loop although its copy was due within the in-place budget"
        assert not ran and order == [1, 2], "completed from its event, in stream order, before the callbacks"
        assert engine._in_place == 1
        assert result.num_blocks == 1 and same(snapshot(engine, "host", 5), expected[4])
        assert same(snapshot(engine, "host", 2), expected[0])
        stats = engine.statistics()  # the bookkeeping as after any completion
        assert (stats.completed, stats.failed, stats.in_flight) == (2, 0, 0) and len(engine.fences) == 0
        await asyncio.sleep(LATE + 0.1)  # the held-back callbacks arrive and change nothing
        assert len(ran) == 2 and engine.statistics().completed == 2


async def test_an_in_place_wait_gives_up_after_its_budget(layout: KVLayout, monkeypatch: pytest.MonkeyPatch) -> None:
    """A copy still running when the budget is spent: the await yields and the copy completes as usual."""
    budget_us = 5_000
    async with _engine(layout, 0, await_spin_us=budget_us) as engine:
        fill_pool(engine, "gpu", seed=12)
        stall(engine.stream("offload"), 0.2)  # the copy starts 200 ms from now: far past the budget
        transfer = engine.copy(Tier.GPU, [1], Tier.HOST, [1])
        rounds: list[int] = []
        asyncio.get_running_loop().call_soon(rounds.append, 1)
        t0 = time.perf_counter()
        await transfer
        waited = time.perf_counter() - t0
        assert rounds == [1], "the await yielded once its budget was spent"
        assert waited >= 0.15 and engine._in_place == 0
        assert engine.statistics().completed == 1 and len(engine.fences) == 0


async def test_a_failed_op_waited_for_in_place_still_fails(layout: KVLayout, monkeypatch: pytest.MonkeyPatch) -> None:
    """The in-place poll leaves a failed op to its callback, which carries the error."""
    async with _engine(layout, 0, await_spin_us=LATE_US // 2) as engine:
        _hold_back_callbacks(engine, "offload", monkeypatch)
        monkeypatch.setattr(engine.route(Tier.GPU, Tier.HOST), "build_op", _broken_build_op)
        with pytest.raises(TransferError, match="simulated device fault"):
            await engine.copy(Tier.GPU, [0], Tier.HOST, [1])
        stats = engine.statistics()
        assert (stats.completed, stats.failed) == (1, 1) and len(engine.fences) == 0


async def test_in_place_waits_soak_per_byte(layout: KVLayout) -> None:
    """Random copies in every direction, awaited singly and in groups, cancelled at times, waited for in place."""
    rng = np.random.default_rng(17)
    async with _engine(layout, 0, await_spin_us=20_000) as engine:
        model = {"gpu": fill_pool(engine, "gpu", seed=13).clone(), "host": fill_pool(engine, "host", seed=14).clone()}
        cancelled = 0
        for _ in range(80):
            t = _random_copy(engine, model, rng, (("gpu", "host"), ("host", "gpu"), ("gpu", "gpu"), ("host", "host")))
            roll = rng.random()
            if roll < 0.15:  # a wait cancelled: the copy itself goes on
                waiter = asyncio.ensure_future(_await(t))
                await asyncio.sleep(0)
                waiter.cancel()
                cancelled += 1
            elif roll < 0.8:
                await t
        await _check_model(engine, model)
        stats = engine.statistics()
        assert stats.completed == stats.submitted == 80 and stats.failed == 0
        assert len(engine.fences) == 0 and cancelled > 0 and engine._in_place > 0


async def _await(transfer: Any) -> None:
    await transfer


async def test_an_in_place_wait_lets_other_threads_run(layout: KVLayout) -> None:
    """The in-place poll gives up the GIL between looks: the emulated stream's thread runs the op meanwhile.

    The budget is half the interpreter's switch interval, so a poll that held the GIL throughout would see the op
    run only after its budget was spent (nearly never in place).
    """
    budget_us = int(sys.getswitchinterval() * 1e6 / 2)
    async with _engine(layout, 0, await_spin_us=budget_us) as engine:
        for i in range(40):
            await engine.copy(Tier.GPU, [i % 8], Tier.HOST, [i % 8])
        assert engine._in_place >= 20, f"{engine._in_place} of 40 awaits saw their copy done in place"


def test_await_spin_from_config_and_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for bad in (-1, 1.5, True, "50"):
        with pytest.raises(ValueError, match="await_spin_us"):
            EngineConfig(await_spin_us=bad)  # type: ignore[arg-type]
    monkeypatch.setenv("TIERED_KV_AWAIT_SPIN_US", "30")
    assert EngineConfig.from_env().await_spin_us == 30
    monkeypatch.setenv("TIERED_KV_AWAIT_SPIN_US", "soon")
    with pytest.raises(ValueError, match="TIERED_KV_AWAIT_SPIN_US must be an int"):
        EngineConfig.from_env()


async def test_the_emulated_device_does_not_wait_in_place_by_default(layout: KVLayout) -> None:
    async with TransferEngine(layout, gpu_blocks=8, host_blocks=8, device="cpu") as engine:
        await engine.copy(Tier.GPU, [0], Tier.HOST, [0])
        assert engine._await_spin == 0


# ------------------------------------------------------------------------------------------- the poller


async def test_poller_polls_each_round_until_the_item_ends() -> None:
    loop = asyncio.get_running_loop()
    flag = threading.Event()
    seen = asyncio.Event()
    settled: list[int] = []

    def poll(item: threading.Event) -> bool:
        if item.is_set():
            seen.set()
            return True
        return False

    poller: EventPoller[threading.Event] = EventPoller(loop, poll, lambda: settled.append(1), window=1.0)
    poller.watch(flag, time.perf_counter())
    threading.Timer(0.02, flag.set).start()
    await asyncio.wait_for(seen.wait(), 5)  # this coroutine sleeps; the loop polls
    assert poller.finished == 1 and poller.polls > 1
    await asyncio.sleep(0)
    assert settled == [1]
    polls = poller.polls
    await asyncio.sleep(0.01)
    assert poller.polls == polls, "nothing watched: the loop stops polling"


async def test_poller_gives_up_past_the_window() -> None:
    loop = asyncio.get_running_loop()
    poller: EventPoller[int] = EventPoller(loop, lambda _item: False, None, window=0.005)
    poller.watch(1, time.perf_counter())
    await asyncio.sleep(0.05)
    polls = poller.polls
    assert polls > 0 and poller.finished == 0
    await asyncio.sleep(0.02)
    assert poller.polls == polls, "given up: no more polls"


async def test_poller_polls_a_long_item_up_to_its_slack_past_due() -> None:
    """A long copy running slower than its stream's best rate (a partial copy) is still polled past its due time:
    up to ``slack`` (the engine gives a quarter of the expected span), not only the window."""
    loop = asyncio.get_running_loop()
    ends: dict[int, float] = {}
    now = time.perf_counter()

    def poll(item: int) -> bool:
        return time.perf_counter() >= ends[item]

    poller: EventPoller[int] = EventPoller(loop, poll, None, window=0.002)
    ends[1] = ends[2] = now + 0.03  # both end 30 ms after the due time they were watched with
    poller.watch(1, now, slack=0.06)
    poller.watch(2, now)  # the window alone: given up after 2 ms
    await asyncio.sleep(0.1)
    assert poller.finished == 1, "the item with slack was polled until it ended; the other was given up on"


async def test_poller_keeps_far_items_until_woken_near_their_end() -> None:
    loop = asyncio.get_running_loop()
    polled: list[int] = []

    def poll(item: int) -> bool:
        polled.append(item)
        return True

    poller: EventPoller[int] = EventPoller(loop, poll, None, window=0.01)
    due = time.perf_counter() + 0.1
    poller.watch(7, due)  # 100 ms away, lead 20 ms: kept
    await asyncio.sleep(0.01)
    assert polled == [] and poller.polls == 0
    poller.near_end()  # still too early
    await asyncio.sleep(0)
    assert polled == []
    await asyncio.sleep(max(0.0, due - time.perf_counter() - 0.015))
    threading.Thread(target=poller.wake).start()  # a stream's waiter, shortly before the end
    for _ in range(100):
        if polled:
            break
        await asyncio.sleep(0.001)
    assert polled == [7]


def test_poller_and_config_refuse_bad_values() -> None:
    loop = asyncio.new_event_loop()
    try:
        with pytest.raises(ValueError, match="window"):
            EventPoller(loop, lambda _item: True, None, window=0)
    finally:
        loop.close()
    for bad in (-1, 1.5, True, "200"):
        with pytest.raises(ValueError, match="completion_spin_us"):
            EngineConfig(completion_spin_us=bad)  # type: ignore[arg-type]


def test_spin_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TIERED_KV_COMPLETION_SPIN_US", "150")
    assert EngineConfig.from_env().completion_spin_us == 150
    monkeypatch.setenv("TIERED_KV_COMPLETION_SPIN_US", "soon")
    with pytest.raises(ValueError, match="TIERED_KV_COMPLETION_SPIN_US must be an int"):
        EngineConfig.from_env()


@pytest.mark.gpu
async def test_an_awaited_small_cuda_copy_is_waited_for_in_place_by_default() -> None:
    """On CUDA, by default: a 1-block copy is due within the in-place budget and seen done before the await yields."""
    layout = KVLayout(num_layers=2, num_kv_heads=2, head_dim=64, tokens_per_block=16, dtype=torch.float16)
    async with TransferEngine(layout, gpu_blocks=64, host_blocks=64, device="cuda") as engine:
        for i in range(50):
            await engine.copy(Tier.GPU, [i], Tier.HOST, [i])
        assert engine._await_spin > 0 and engine._in_place >= 25, engine._in_place
        await engine.drain()
        stats = engine.statistics()
        assert stats.completed == stats.submitted == 50 and len(engine.fences) == 0


@pytest.mark.gpu
async def test_an_awaited_small_cuda_copy_is_completed_by_the_poll() -> None:
    """On CUDA, by default: a 1-block copy is seen done by the loop (a poll, or the await's own look at its event)."""
    layout = KVLayout(num_layers=2, num_kv_heads=2, head_dim=64, tokens_per_block=16, dtype=torch.float16)
    async with TransferEngine(layout, gpu_blocks=64, host_blocks=64, device="cuda") as engine:
        assert engine._poller is not None
        for i in range(50):
            await engine.copy(Tier.GPU, [i], Tier.HOST, [i])
        assert engine._poller.finished >= 25, engine._poller
        await engine.drain()
        stats = engine.statistics()
        assert stats.completed == stats.submitted == 50 and len(engine.fences) == 0
