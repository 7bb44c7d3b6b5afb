"""The CUDA stream waiter with the extension's completion wait: it polls each event from shortly before the end
expected from the bytes and the stream's measured rate, and keeps the host-function post as its fallback.

Whatever the estimate -- none, far too short (polls from the start), far too long (the post, or in event mode a
sliced sleep, must still end the wait) -- every callback runs once, in notify order, and only after its own event;
posts of items found done by polling are paid back without ending a later item's wait early.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

ITEM_BYTES = 16 << 20  # 4 Mi floats: tens of microseconds of work per item


@pytest.fixture
def ext() -> Any:
    from tiered_kv import _ext

    assert _ext.load(), f"the CUDA extension must build on a CUDA machine: {_ext.status()['error']}"
    return _ext


def _run_items(
    stream: Any,
    count: int,
    nbytes_of: Callable[[int], int],
    beside_of: Callable[[int], bool],
    stall_before: int | None = None,
) -> list[tuple[int, bool]]:
    """Notify ``count`` small items on ``stream`` (a long GPU stall before item ``stall_before``); per callback, in
    the order they ran: (item, whether its event was done)."""
    import torch

    x = torch.zeros(ITEM_BYTES // 4, device="cuda")
    events: dict[int, object] = {}
    seen: list[tuple[int, bool]] = []
    finished = threading.Event()

    def callback(i: int) -> None:
        while i not in events:  # the callback may fire before notify() has returned
            time.sleep(0)
        seen.append((i, events[i].query()))  # type: ignore[attr-defined]
        if len(seen) == count:
            finished.set()

    for i in range(count):
        with torch.cuda.stream(stream.torch_stream):
            if i == stall_before:
                torch.cuda._sleep(200_000_000)
            x.add_(1)
        events[i] = stream.notify(functools.partial(callback, i), beside=beside_of(i), nbytes=nbytes_of(i))
    assert finished.wait(60), f"{len(seen)} of {count} callbacks ran"
    assert float(x[0]) == count
    return seen


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["hostfunc", "event"])
@pytest.mark.parametrize("rate", [0.0, 1e9, 1e-6], ids=["guess", "far-too-short", "far-too-long"])
def test_callbacks_run_in_order_after_their_event_whatever_the_estimate(
    ext: Any, monkeypatch: pytest.MonkeyPatch, mode: str, rate: float
) -> None:
    import torch

    from tiered_kv import cuda_stream
    from tiered_kv.device import CudaStream

    monkeypatch.setattr(cuda_stream, "_RATE_MIN_BYTES", 1 << 62)  # keep the given rate: no learning
    stream = CudaStream("estimate-test", device=torch.device("cuda"), completion=mode)
    stream.rate = rate
    stream.rate_known = rate > 0  # taken as measured: the waiter sleeps to 4/5 of the span it gives
    try:
        count = 200
        seen = _run_items(
            stream,
            count,
            nbytes_of=lambda i: 0 if i % 7 == 6 else ITEM_BYTES,  # some items without an estimate: the post
            beside_of=lambda i: mode == "hostfunc" and i % 4 != 3,  # posts from the side stream may reorder
        )
        assert stream._wait_done is not None, "the extension's completion wait was not used"
        assert [i for i, _ in seen] == list(range(count))
        assert all(done for _, done in seen), [i for i, done in seen if not done][:5]
    finally:
        stream.close()


@pytest.mark.gpu
def test_posts_owed_by_polled_items_do_not_end_a_later_wait_early(ext: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Many items found done by polling (posts still to come), then items that wait for their post: a late post
    of an earlier item must pay its debt, not release the item waiting behind a long stall."""
    import torch

    from tiered_kv import cuda_stream
    from tiered_kv.device import CudaStream

    monkeypatch.setattr(cuda_stream, "_RATE_MIN_BYTES", 1 << 62)
    stream = CudaStream("owed-test", device=torch.device("cuda"), completion="hostfunc")
    stream.rate = 1e9  # every estimated item polls from the start
    stream.rate_known = True
    count = 60
    try:
        order = _run_items(  # a long stall before the first post-only item
            stream,
            count,
            nbytes_of=lambda i: ITEM_BYTES if i < count // 2 else 0,
            beside_of=lambda i: False,
            stall_before=count // 2,
        )
        assert [i for i, _ in order] == list(range(count))
        assert all(done for _, done in order), [i for i, done in order if not done][:5]
    finally:
        stream.close()


@pytest.mark.gpu
def test_a_stream_learns_its_rate_from_copies_on_an_idle_stream(ext: Any) -> None:
    import torch

    from tiered_kv.device import CudaStream, expected_end

    stream = CudaStream("rate-test", device=torch.device("cuda"))
    src = torch.empty(64 << 20, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
    try:
        assert stream.rate == 0.0
        for _ in range(4):
            done = threading.Event()
            with torch.cuda.stream(stream.torch_stream):
                dst.copy_(src, non_blocking=True)
            stream.notify(done.set, nbytes=src.numel())
            assert done.wait(30)
        gbps = stream.rate  # bytes per nanosecond = GB/s
        assert 1.0 < gbps < 1000.0, gbps
        wake, due = expected_end(1000, src.numel(), stream.rate)
        assert 1000 < wake < due and 0.79 < (wake - 1000) / (due - 1000) < 0.81
    finally:
        stream.close()


@pytest.mark.gpu
def test_a_copy_seen_only_at_the_first_look_never_lowers_the_rate_or_counts_as_measured(ext: Any) -> None:
    """A waiter that comes late (its thread woke 0.2-0.4 ms after the notify on the GPU machines) finds a short copy
    already done at its first look: the span it sees is an upper bound, so the rate it gives is a lower bound. It
    may raise the rate (marked not known: the next copy is polled from its start), never lower it or mark it
    measured; a copy seen ending between two looks sets it and marks it known."""
    import torch

    from tiered_kv.device import CudaStream

    stream = CudaStream("first-look-test", device=torch.device("cuda"))
    src = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    try:
        stream.rate, stream.rate_known = 1e6, True  # far above any route: a late sample must not lower it
        done = threading.Event()
        with torch.cuda.stream(stream.torch_stream):
            dst.copy_(src, non_blocking=True)
        stream.notify(done.set, nbytes=src.numel())
        assert done.wait(30)
        # seen at its first look: unchanged; seen between looks: 2 % of the way down (the rate tracks the fastest)
        assert stream.rate_known and stream.rate >= 0.98e6
        # a long copy (behind a stall) is seen ending between looks: its rate, marked known
        stream.rate, stream.rate_known = 0.0, False
        done = threading.Event()
        with torch.cuda.stream(stream.torch_stream):
            torch.cuda._sleep(20_000_000)
            dst.copy_(src, non_blocking=True)
        stream.notify(done.set, nbytes=src.numel())
        assert done.wait(30)
        assert stream.rate_known and 0.0 < stream.rate < 1e4
    finally:
        stream.close()


def test_a_late_waiters_sample_only_raises_the_rate_and_leaves_it_unmeasured() -> None:
    """The waiter thread picks a copy up 0.2-0.4 ms after its notify on the GPU machines: a short copy is then done
    at the first look and its span is only an upper bound (a GPU->GPU copy of 64 MiB read as 150-380 B/ns against
    1,330). Such a sample may raise the rate (not known: the next copy is polled from its start), never lower it."""
    from tiered_kv.device import learn_rate

    # seen ending between looks: the rate, known; the fastest leads, a slower one eases it down 2 %
    assert learn_rate(0.0, False, 50.0, misses=3) == (50.0, True)
    assert learn_rate(50.0, True, 60.0, misses=1) == (60.0, True)
    rate, known = learn_rate(50.0, True, 40.0, misses=1)
    assert known and rate == pytest.approx(0.98 * 50.0 + 0.02 * 40.0)
    # done at the first look: a lower bound
    assert learn_rate(1300.0, True, 300.0, misses=0) == (1300.0, True)  # a measured rate is left alone
    assert learn_rate(0.0, False, 300.0, misses=0) == (300.0, False)  # raised, still to be measured
    assert learn_rate(300.0, True, 400.0, misses=0) == (400.0, False)  # faster than known: the rate was too low
    assert learn_rate(300.0, False, 200.0, misses=0) == (300.0, False)


def test_expected_end_polls_from_four_fifths_of_the_span() -> None:
    from tiered_kv.cuda_stream import _RATE_GUESS, expected_end

    assert expected_end(5_000, 0, 50.0) == (-1, -1)  # unknown bytes: the host-function post alone
    assert expected_end(5_000, 1_000_000, 50.0) == (5_000 + 16_000, 5_000 + 20_000)  # 50 bytes per ns
    assert expected_end(0, 1_000_000, 0.0) == expected_end(0, 1_000_000, _RATE_GUESS)  # not measured yet


def _stalled_event(cycles: int = 300_000_000) -> tuple[Any, Any]:
    """A stream stalled for ``cycles`` GPU cycles (a good fraction of a second) and an event after the stall."""
    import torch

    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        torch.cuda._sleep(cycles)
    event = torch.cuda.Event()
    event.record(stream)
    return stream, event


def _post(signal: Any) -> None:
    import ctypes
    import ctypes.util

    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    libc.sem_post(ctypes.c_void_p(signal.address))


@pytest.mark.gpu
@pytest.mark.parametrize("owed", [1, 0], ids=["an-owed-post", "a-later-items-post"])
def test_wait_done_returns_only_once_its_event_is_done(ext: Any, owed: int) -> None:
    """``wait_done`` with no estimate waits for a post: a post that comes during the wait and pays an owed one
    (``owed=1``), or belongs to a later item signalled beside its stream (``owed=0``), must not end the wait before
    the event is done."""
    import threading

    import torch

    from tiered_kv.cuda_stream import _HostFuncSignal

    native = ext.native()
    signal = _HostFuncSignal()
    stream, event = _stalled_event()
    try:
        signal.enqueue(stream)  # the item's own post, after the stall
        threading.Timer(0.02, _post, (signal,)).start()  # the stray post, while the wait is on
        result: list[tuple[int, bool]] = []

        def wait() -> None:
            left, finished, _seen, _misses = native.wait_done(
                event.cuda_event, torch.cuda.current_device(), signal.address, -1, -1, owed
            )
            assert finished
            result.append((left, event.query()))

        waiter = threading.Thread(target=wait)
        waiter.start()
        waiter.join(30)
        assert result, "wait_done did not return"
        left, done = result[0]
        assert done, "wait_done returned before its event was done"
        assert left == 0
    finally:
        torch.cuda.synchronize()
        signal.destroy()


@pytest.mark.gpu
def test_wait_done_stops_at_its_stop_time_and_the_next_call_finishes(ext: Any) -> None:
    """``stop_ns``: the waiter's early return (to wake the event loop just before a copy's expected end)."""
    import time

    import torch

    from tiered_kv.cuda_stream import _HostFuncSignal

    native = ext.native()
    signal = _HostFuncSignal()
    stream, event = _stalled_event()
    try:
        signal.enqueue(stream)
        device = torch.cuda.current_device()
        now = time.monotonic_ns()
        owed, done, seen, misses = native.wait_done(
            event.cuda_event, device, signal.address, now, now, 0, now + 20_000_000
        )
        assert (owed, done, seen) == (0, False, 0) and misses >= 1 and not event.query()
        assert time.monotonic_ns() - now < 150_000_000  # stopped near its stop time, not at the end of the stall
        owed, done, seen, misses = native.wait_done(event.cuda_event, device, signal.address, now, now, owed, -1)
        assert done and event.query()
        assert owed in (0, 1)  # found by polling (its post still to come) or by its post
        # the end as the waiter saw it, before it had the GIL back; seen ending between looks (the stall is long)
        assert now < seen <= time.monotonic_ns() and misses >= 1
    finally:
        torch.cuda.synchronize()
        signal.destroy()


@pytest.mark.gpu
def test_wait_done_says_when_an_event_was_done_at_its_first_look(ext: Any) -> None:
    """A waiter that comes late finds the work done at once: ``misses`` 0 (its rate must not be read from it)."""
    import time

    import torch

    native = ext.native()
    event = torch.cuda.Event()
    event.record()
    event.synchronize()
    device = torch.cuda.current_device()
    now = time.monotonic_ns()
    owed, done, seen, misses = native.wait_done(event.cuda_event, device, 0, now - 1000, now, 0, -1)
    assert (owed, done, misses) == (0, True, 0) and now <= seen <= time.monotonic_ns()


def _record(into: list[int], value: int, _transfer: object) -> None:
    into.append(value)


@pytest.mark.gpu
async def test_native_copies_without_a_post_complete_in_order_behind_a_stall(ext: Any) -> None:
    """A small native copy names its bytes and gets no host-function post: its stream's waiter polls alone, backing
    off past the expected end. Behind a 0.3 s stall it must still complete every copy, in order, soon after the
    stall (the loop-side poll is off: the waiter is the only completion here)."""
    import asyncio

    import numpy as np
    import torch

    from tiered_kv import EngineConfig, KVLayout, Tier, TransferEngine
    from tiered_kv.testing import stall

    layout = KVLayout(num_layers=2, num_kv_heads=2, head_dim=64, tokens_per_block=16, dtype=torch.float16)
    cfg = EngineConfig(completion_spin_us=0)
    async with TransferEngine(layout, gpu_blocks=32, host_blocks=32, device="cuda", config=cfg) as engine:
        assert engine.copier.native
        gpu = engine.pool(Tier.GPU).tensor
        gpu.copy_(torch.randn(gpu.shape, device="cuda").to(gpu.dtype))
        torch.cuda.synchronize()
        stream = engine.stream("offload")
        order: list[int] = []
        stall(stream, 0.3)
        t0 = time.perf_counter()
        transfers = [engine.copy(Tier.GPU, [i], Tier.HOST, [31 - i]) for i in range(16)]
        for i, t in enumerate(transfers):
            t.add_done_callback(functools.partial(_record, order, i))
        await asyncio.gather(*transfers)
        waited = time.perf_counter() - t0
        assert order == list(range(16))
        assert 0.25 < waited < 0.45, waited
        host = engine.pool(Tier.HOST).tensor
        expected = gpu[np.arange(16)].cpu()
        assert torch.equal(host[np.arange(31, 15, -1)], expected)


@pytest.mark.gpu
def test_close_waits_for_posts_still_on_their_way(ext: Any) -> None:
    """An item found done by polling leaves its host-function post behind; one signalled beside its stream can
    come long after (here behind a stall on the side stream). ``close()`` must not destroy the semaphore under
    it: a late ``sem_post`` on freed memory corrupts the process (a segfault in an unrelated test, session h)."""
    import torch

    from tiered_kv.device import CudaStream

    stream = CudaStream("late-post", device=torch.device("cuda"))
    x = torch.zeros(1024, device="cuda")
    ran = threading.Event()
    with torch.cuda.stream(stream.torch_stream):
        x.add_(1)
    stream.notify(lambda: None, nbytes=4096)  # starts the waiter, makes the side stream usable
    side = stream._side_stream()
    with torch.cuda.stream(side):
        torch.cuda._sleep(300_000_000)  # ~0.2 s on the side stream, ahead of the beside post
    with torch.cuda.stream(stream.torch_stream):
        x.add_(1)
    stream.notify(ran.set, beside=True, nbytes=4096)
    assert ran.wait(10), "the waiter polls the item done without its post"
    assert not side.query(), "the beside post is still behind the stall"
    stream.close()
    assert side.query(), "close() returned before the side stream's post ran"
