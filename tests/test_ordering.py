"""Hazard ordering under injected stalls (emulated device in CI; the same scenarios on CUDA).

Each scenario has a twin that removes the fence waits (``tests/helpers.py: disable_fences``) and
asserts that the corruption then *is* observed: proof that the scenario can see the race it guards.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from helpers import disable_fences, fill_pool, same, snapshot

from tiered_kv import EngineConfig, Tier, TransferEngine
from tiered_kv.device import CudaStream, resolve_device
from tiered_kv.testing import assert_blocks_equal, stall

STALL = 0.25


@pytest.fixture
def no_fences(monkeypatch):
    """Break the engine on purpose: no op waits for anything."""

    def apply():
        disable_fences(monkeypatch)

    return apply


async def raw_scenario(engine: TransferEngine) -> bool:
    """Offload G0->H0 behind a stall, onboard H0->G1 at once. True when G1 == G0."""
    g = fill_pool(engine, "gpu", 1)
    fill_pool(engine, "host", 2)
    stall(engine.stream("offload"), STALL)
    t1 = engine.copy(Tier.GPU, [0], Tier.HOST, [0])
    t2 = engine.copy(Tier.HOST, [0], Tier.GPU, [1])
    await asyncio.gather(t1, t2)
    return same(snapshot(engine, "gpu", 1), g[0])


async def waw_scenario(engine: TransferEngine) -> bool:
    """G1->H0 (offload, stalled) then H5->H0 (host threads). True when H0 ends as H5."""
    fill_pool(engine, "gpu", 3)
    h = fill_pool(engine, "host", 4)
    stall(engine.stream("offload"), STALL)
    t1 = engine.copy(Tier.GPU, [1], Tier.HOST, [0])
    t2 = engine.copy(Tier.HOST, [5], Tier.HOST, [0])
    await asyncio.gather(t1, t2)
    return same(snapshot(engine, "host", 0), h[5])


async def war_scenario(engine: TransferEngine) -> tuple[bool, bool]:
    """Onboard H0->G1 behind a stall, then offload G2->H0. (G1 got the old H0, H0 got G2)."""
    g = fill_pool(engine, "gpu", 5)
    h = fill_pool(engine, "host", 6)
    stall(engine.stream("onboard"), STALL)
    t1 = engine.copy(Tier.HOST, [0], Tier.GPU, [1])
    t2 = engine.copy(Tier.GPU, [2], Tier.HOST, [0])
    await asyncio.gather(t1, t2)
    return same(snapshot(engine, "gpu", 1), h[0]), same(snapshot(engine, "host", 0), g[2])


async def test_read_after_write(device, layout):
    async with TransferEngine(layout, gpu_blocks=4, host_blocks=4, device=device) as engine:
        assert await raw_scenario(engine)
        assert engine.fences.stream_waits >= 1  # stream-side, not a CPU wait


async def test_read_after_write_without_fences_is_corrupted(device, layout, no_fences):
    no_fences()
    async with TransferEngine(layout, gpu_blocks=4, host_blocks=4, device=device) as engine:
        assert not await raw_scenario(engine)


async def test_write_after_write_same_stream(device, layout):
    async with TransferEngine(layout, gpu_blocks=4, host_blocks=4, device=device) as engine:
        g = fill_pool(engine, "gpu", 7)
        t1 = engine.copy(Tier.GPU, [1], Tier.HOST, [0])
        stall(engine.stream("offload"), STALL)
        t2 = engine.copy(Tier.GPU, [2], Tier.HOST, [0])
        await asyncio.gather(t1, t2)
        assert_blocks_equal(snapshot(engine, "host", 0), g[2], "host 0 must hold the last write, never a mix")


async def test_write_after_write_across_lanes(device, layout):
    async with TransferEngine(layout, gpu_blocks=8, host_blocks=8, device=device) as engine:
        assert await waw_scenario(engine)
        assert engine.fences.loop_waits >= 1  # host threads wait on the loop for the stream op


async def test_write_after_write_without_fences_is_corrupted(device, layout, no_fences):
    no_fences()
    async with TransferEngine(layout, gpu_blocks=8, host_blocks=8, device=device) as engine:
        assert not await waw_scenario(engine)


async def test_write_after_read(device, layout):
    async with TransferEngine(layout, gpu_blocks=4, host_blocks=4, device=device) as engine:
        old_read_ok, new_write_ok = await war_scenario(engine)
        assert old_read_ok and new_write_ok


async def test_write_after_read_without_fences_is_corrupted(device, layout, no_fences):
    no_fences()
    async with TransferEngine(layout, gpu_blocks=4, host_blocks=4, device=device) as engine:
        old_read_ok, _ = await war_scenario(engine)
        assert not old_read_ok


async def test_gpu_and_host_indices_do_not_alias(device, layout):
    async with TransferEngine(layout, gpu_blocks=4, host_blocks=4, device=device) as engine:
        g = fill_pool(engine, "gpu", 8)
        h = fill_pool(engine, "host", 9)
        stall(engine.stream("offload"), STALL)
        t1 = engine.copy(Tier.GPU, [0], Tier.HOST, [1])
        t2 = engine.copy(Tier.HOST, [0], Tier.GPU, [1])
        assert not t2.done()
        await asyncio.gather(t1, t2)
        assert_blocks_equal(snapshot(engine, "host", 1), g[0])
        assert_blocks_equal(snapshot(engine, "gpu", 1), h[0])
        # GPU 0 / HOST 0 and HOST 1 / GPU 1 share indices, not blocks: nothing waited on anything.
        assert engine.fences.stream_waits == 0 and engine.fences.loop_waits == 0


async def test_chain_through_every_lane(device, layout):
    """Offload (stalled) -> host-to-host -> onboard: each waits for the previous one, loop-side."""
    async with TransferEngine(layout, gpu_blocks=4, host_blocks=4, device=device) as engine:
        g = fill_pool(engine, "gpu", 10)
        fill_pool(engine, "host", 11)
        stall(engine.stream("offload"), STALL)
        engine.copy(Tier.GPU, [0], Tier.HOST, [0])
        engine.copy(Tier.HOST, [0], Tier.HOST, [1])
        last = engine.copy(Tier.HOST, [1], Tier.GPU, [2])
        # the host copy waits on the loop for the offload, the onboard for the host copy
        assert engine.statistics().deferred == 2
        await last
        assert_blocks_equal(snapshot(engine, "gpu", 2), g[0])


async def test_sync_with_compute(device, layout):
    async with TransferEngine(layout, gpu_blocks=4, host_blocks=4, device=device) as engine:
        fill_pool(engine, "gpu", 12)
        compute = engine.device.new_stream("compute")
        try:
            new = engine.block(Tier.GPU, 3).clone()
            stall(compute, STALL)
            compute.submit(lambda: engine.block(Tier.GPU, 0).copy_(new))  # a "kernel" writing block 0
            engine.sync_with_compute(compute)
            await engine.copy(Tier.GPU, [0], Tier.HOST, [0])
            assert_blocks_equal(snapshot(engine, "host", 0), new.cpu())
        finally:
            compute.close()


async def test_sync_transfers(device, layout):
    async with TransferEngine(layout, gpu_blocks=4, host_blocks=4, device=device) as engine:
        fill_pool(engine, "gpu", 13)
        h = fill_pool(engine, "host", 14)
        compute = engine.device.new_stream("compute")
        try:
            stall(engine.stream("onboard"), STALL)
            transfer = engine.copy(Tier.HOST, [2], Tier.GPU, [0])
            engine.sync_transfers(compute)
            out = engine.block(Tier.GPU, 0).clone()
            compute.submit(lambda: out.copy_(engine.block(Tier.GPU, 0)))  # a "kernel" reading block 0
            compute.synchronize()
            assert_blocks_equal(out.cpu(), h[2])
            await transfer
        finally:
            compute.close()


@pytest.mark.parametrize("route", [("gpu", "host"), ("host", "gpu"), ("gpu", "gpu"), ("host", "host")])
@pytest.mark.parametrize("n", [1, 5, 7])
async def test_partial_copy_touches_only_first_tokens(device, layout, route, n):
    src, dst = route
    async with TransferEngine(layout, gpu_blocks=6, host_blocks=6, device=device) as engine:
        s = fill_pool(engine, src, 15)
        d = fill_pool(engine, dst, 16) if src != dst else s
        result = await engine.copy(src, [0, 1, 4], dst, [3, 2, 5], num_tokens=n)
        assert result.nbytes == 3 * layout.partial_bytes(n)
        for si, di in ((0, 3), (1, 2), (4, 5)):
            expected = d[di].clone()
            expected[:, :, :, :n] = s[si][:, :, :, :n]
            assert_blocks_equal(snapshot(engine, dst, di), expected, f"{src}->{dst} block {di}")


async def test_many_blocks_scattered_and_contiguous(device, layout):
    async with TransferEngine(layout, gpu_blocks=64, host_blocks=64, device=device) as engine:
        g = fill_pool(engine, "gpu", 17)
        src = [*range(10, 40), 3, 1, 60, 61, 62]
        dst = [*range(0, 30), 50, 40, 41, 42, 63]
        result = await engine.copy(Tier.GPU, src, Tier.HOST, dst)
        assert result.num_blocks == len(src) and result.nbytes == len(src) * layout.bytes_per_block
        for si, di in zip(src, dst, strict=True):
            assert_blocks_equal(snapshot(engine, "host", di), g[si], f"host {di}")


LARGE = 300  # more pairs than the small-call path takes: the general path, whose fence entries go in after the launch


def _large_pairs(seed: int, n: int = LARGE) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.permutation(2 * LARGE)[:n], rng.permutation(2 * LARGE)[:n], rng.permutation(2 * LARGE)


async def _decide_shapes(engine: TransferEngine, src: np.ndarray, host: np.ndarray, back: np.ndarray) -> None:
    """The offload ``src`` -> ``host`` (as lists) and the onboard ``host`` -> ``back`` (as arrays), each made once and
    awaited: the path of each call shape decided before the scenario runs."""
    await engine.copy(Tier.GPU, src.tolist(), Tier.HOST, host.tolist())
    await engine.copy(Tier.HOST, host, Tier.GPU, back)


async def large_raw_scenario(engine: TransferEngine, n: int, warm: bool = False) -> bool:
    """An offload of ``n`` blocks behind a stall, then an onboard of the same host blocks. True when the onboard
    read what the offload wrote. ``warm``: both calls made once before (awaited), so that the copier has decided
    their shapes (its memo) before the scenario's calls."""
    src, host, _ = _large_pairs(1, n)
    back = np.setdiff1d(np.arange(2 * LARGE), src)[:n]
    if warm:
        await _decide_shapes(engine, src, host, back)
    g = fill_pool(engine, "gpu", 31)
    fill_pool(engine, "host", 32)
    stall(engine.stream("offload"), STALL)
    t1 = engine.copy(Tier.GPU, src.tolist(), Tier.HOST, host.tolist())
    t2 = engine.copy(Tier.HOST, host, Tier.GPU, back)
    await asyncio.gather(t1, t2)
    return all(same(snapshot(engine, "gpu", int(b)), g[int(a)]) for a, b in zip(src, back, strict=True))


@pytest.mark.parametrize("warm", [False, True])
@pytest.mark.parametrize("n", [64, LARGE])  # the small-call path (native on CUDA) and the general path
async def test_large_calls_read_after_write(device, layout, n, warm):
    """Regression: a many-block call with nothing pending records its fence entries after the launch; the
    next call still sees them, whether its shape was decided before or not, and a pool whose every op was released
    has nothing live."""
    async with TransferEngine(layout, gpu_blocks=2 * LARGE, host_blocks=2 * LARGE, device=device) as engine:
        assert await large_raw_scenario(engine, n, warm)
        assert engine.fences.stream_waits >= 1
        assert not engine.fences.live("host") and not engine.fences.live("gpu")
        assert not engine.fences


@pytest.mark.parametrize("n", [64, LARGE])
async def test_large_calls_read_after_write_without_fences_is_corrupted(device, layout, no_fences, n):
    no_fences()
    async with TransferEngine(layout, gpu_blocks=2 * LARGE, host_blocks=2 * LARGE, device=device) as engine:
        assert not await large_raw_scenario(engine, n)


async def test_large_calls_write_after_read(device, layout):
    """A large onboard behind a stall reads host blocks that a large offload then overwrites: the onboard gets
    the old bytes, the host the new ones."""
    async with TransferEngine(layout, gpu_blocks=2 * LARGE, host_blocks=2 * LARGE, device=device) as engine:
        g = fill_pool(engine, "gpu", 33)
        h = fill_pool(engine, "host", 34)
        host, dst, _ = _large_pairs(2)
        src = np.setdiff1d(np.arange(2 * LARGE), dst)[:LARGE]
        stall(engine.stream("onboard"), STALL)
        t1 = engine.copy(Tier.HOST, host, Tier.GPU, dst)
        t2 = engine.copy(Tier.GPU, src, Tier.HOST, host)
        await asyncio.gather(t1, t2)
        for i in range(LARGE):
            assert same(snapshot(engine, "gpu", int(dst[i])), h[int(host[i])]), f"gpu {dst[i]} read the new bytes"
            assert same(snapshot(engine, "host", int(host[i])), g[int(src[i])]), f"host {host[i]}"


@pytest.mark.parametrize("pool_blocks", [2 * LARGE, 64 * LARGE])
async def test_large_call_index_errors(device, layout, pool_blocks):
    """The vectorized checks of a large call (a count per block in a small pool, a sort in a large one) give the
    same errors as the small-call path, before anything is enqueued."""
    async with TransferEngine(layout, gpu_blocks=pool_blocks, host_blocks=pool_blocks, device=device) as engine:
        src = np.arange(LARGE)
        dup = np.arange(LARGE)
        dup[7] = dup[200]
        with pytest.raises(ValueError, match=r"destination indices contain duplicates: \[200\]"):
            engine.copy(Tier.GPU, src, Tier.HOST, dup)
        with pytest.raises(ValueError, match=r"blocks \[299\] are both a source and a destination"):
            engine.copy(Tier.GPU, src, Tier.GPU, np.arange(LARGE - 1, 2 * LARGE - 1))
        assert engine.statistics().submitted == 0 and not engine.fences


async def test_done_respects_fence_order(device, layout):
    """A transfer is never reported done before one it waited for (their completion callbacks come from
    different streams' waiter threads, in any order)."""
    async with TransferEngine(layout, gpu_blocks=4, host_blocks=4, device=device) as engine:
        fill_pool(engine, "gpu", 20)
        for _ in range(20):
            stall(engine.stream("offload"), 0.01)
            first = engine.copy(Tier.GPU, [0], Tier.HOST, [0])
            second = engine.copy(Tier.HOST, [0], Tier.GPU, [1])
            await second
            assert first.done()


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["hostfunc", "event"])
async def test_both_cuda_completion_signals_keep_order(layout, mode):
    """The waiter learns of completions from a CUDA host function (default) or by event synchronize."""
    config = EngineConfig(completion=mode)
    async with TransferEngine(layout, gpu_blocks=4, host_blocks=4, device="cuda", config=config) as engine:
        for _ in range(3):
            assert await raw_scenario(engine)
        stream = engine.stream("offload")
        assert isinstance(stream, CudaStream)
        assert stream.completion == mode
        war_old, war_new = await war_scenario(engine)
        assert war_old and war_new


@pytest.mark.gpu
def test_signals_beside_the_stream_keep_callback_order_and_never_run_early():
    """``notify(beside=True)`` posts from the side stream: posts may arrive out of notify order (in-stream ones can
    overtake), yet every callback runs in notify order and only once its own event is done."""
    import functools
    import threading
    import time

    import torch

    stream = CudaStream("beside-test", device=torch.device("cuda"), completion="hostfunc")
    x = torch.zeros(4 << 20, device="cuda")
    events: dict[int, object] = {}
    seen: list[tuple[int, bool]] = []
    finished = threading.Event()
    count = 300

    def callback(i: int) -> None:
        while i not in events:  # the callback may fire before notify() has returned
            time.sleep(0)
        seen.append((i, events[i].query()))  # type: ignore[attr-defined]
        if len(seen) == count:
            finished.set()

    try:
        for i in range(count):
            with torch.cuda.stream(stream.torch_stream):
                x.add_(1)  # tens of microseconds of work per item
            events[i] = stream.notify(functools.partial(callback, i), beside=i % 4 != 3)
        assert finished.wait(30), f"{len(seen)} of {count} callbacks ran"
        assert stream.completion == "hostfunc" and stream._side is not None
        assert [i for i, _ in seen] == list(range(count))
        assert all(done for _, done in seen), [i for i, done in seen if not done][:5]
        assert float(x[0]) == count
    finally:
        stream.close()


def test_completion_mode_is_validated(monkeypatch):
    """``EngineConfig.completion`` is ``hostfunc`` or ``event``; a bad value from the environment names the variable."""
    with pytest.raises(ValueError, match="completion must be 'hostfunc' or 'event'"):
        EngineConfig(completion="spin")
    with pytest.raises(ValueError, match="completion must be 'hostfunc' or 'event'"):
        CudaStream("bad", completion="spin")
    with pytest.raises(ValueError, match="completion must be 'hostfunc' or 'event'"):
        resolve_device("cpu").new_stream("bad", completion="spin")
    monkeypatch.setenv("TIERED_KV_COMPLETION", "spin")
    with pytest.raises(ValueError, match="TIERED_KV_COMPLETION must be 'hostfunc' or 'event'"):
        EngineConfig.from_env()
    monkeypatch.setenv("TIERED_KV_COMPLETION", " Event")
    assert EngineConfig.from_env().completion == "event"
    assert EngineConfig.from_env(completion="hostfunc").completion == "hostfunc"  # an argument wins


@pytest.mark.parametrize("warm", [False, True])
@pytest.mark.parametrize("n", [64, LARGE])
async def test_caller_reusing_its_index_lists_does_not_move_the_fences(device, layout, n, warm):
    """The engine keeps its own copy of a call's indices: a server that refills its index lists right after the call
    (a scratch list per step) must not move the fence entries of a copy still running."""
    async with TransferEngine(layout, gpu_blocks=2 * LARGE, host_blocks=2 * LARGE, device=device) as engine:
        src, host, _ = _large_pairs(3, n)
        back = np.setdiff1d(np.arange(2 * LARGE), src)[:n]
        if warm:
            await _decide_shapes(engine, src, host, back)
        g = fill_pool(engine, "gpu", 35)
        fill_pool(engine, "host", 36)
        s, h = src.tolist(), host.tolist()
        stall(engine.stream("offload"), STALL)
        t1 = engine.copy(Tier.GPU, s, Tier.HOST, h)
        others = np.setdiff1d(np.arange(2 * LARGE), host)[:n].tolist()
        s[:], h[:] = others, others  # reused for the next step
        t2 = engine.copy(Tier.HOST, host, Tier.GPU, back)
        await asyncio.gather(t1, t2)
        for a, b in zip(src, back, strict=True):
            assert same(snapshot(engine, "gpu", int(b)), g[int(a)]), f"gpu {b} did not read what the offload wrote"
