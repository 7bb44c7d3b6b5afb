"""Cancellation, statistics, lifecycle and bad input of TransferEngine."""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest
import torch
from helpers import fill_pool, same, snapshot

from tiered_kv import EngineClosedError, KVLayout, Tier, TransferEngine, TransferError
from tiered_kv.testing import stall

STALL = 0.25


def engine_threads() -> set[str]:
    return {t.name for t in threading.enumerate() if t.name.startswith("tiered_kv")}


async def test_cancelled_await_keeps_fences_and_order(device, layout):
    async with TransferEngine(layout, gpu_blocks=4, host_blocks=4, device=device) as engine:
        g = fill_pool(engine, "gpu", 1)
        fill_pool(engine, "host", 2)
        stall(engine.stream("offload"), STALL)
        offload = engine.copy(Tier.GPU, [0], Tier.HOST, [0])
        waiter = asyncio.create_task(_await(offload))
        await asyncio.sleep(0.01)
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        # The copy is still in flight and still fenced.
        assert not offload.done()
        write, _ = engine.fences.pending("host", 0)
        assert write is not None
        onboard = engine.copy(Tier.HOST, [0], Tier.GPU, [1])
        await onboard
        assert offload.done() and offload.result().nbytes == layout.bytes_per_block
        assert same(snapshot(engine, "gpu", 1), g[0])


async def _await(transfer):
    return await transfer


async def test_cancel_one_awaiter_others_still_get_the_result(device, layout):
    async with TransferEngine(layout, gpu_blocks=4, host_blocks=4, device=device) as engine:
        fill_pool(engine, "gpu", 3)
        stall(engine.stream("offload"), STALL)
        t = engine.copy(Tier.GPU, [0, 1], Tier.HOST, [2, 3])
        a, b = asyncio.create_task(_await(t)), asyncio.create_task(_await(t))
        await asyncio.sleep(0.01)
        a.cancel()
        result = await b
        assert result.num_blocks == 2 and result.seconds > 0
        assert a.cancelled()


async def test_cancelling_a_task_that_made_copies_does_not_undo_them(device, layout):
    async with TransferEngine(layout, gpu_blocks=8, host_blocks=8, device=device) as engine:
        g = fill_pool(engine, "gpu", 4)
        started = asyncio.Event()

        async def offload_all():
            stall(engine.stream("offload"), STALL)
            transfers = [engine.copy(Tier.GPU, [i], Tier.HOST, [i]) for i in range(8)]
            started.set()
            await asyncio.gather(*transfers)

        task = asyncio.create_task(offload_all())
        await started.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        # A reader issued after the cancellation still orders after every write.
        await engine.copy(Tier.HOST, list(range(8)), Tier.GPU, [0, 1, 2, 3, 4, 5, 6, 7][::-1])
        for i in range(8):
            assert same(snapshot(engine, "gpu", 7 - i), g[i])


async def test_fences_and_statistics_return_to_empty(device, layout):
    async with TransferEngine(layout, gpu_blocks=8, host_blocks=8, device=device) as engine:
        fill_pool(engine, "gpu", 5)
        stall(engine.stream("offload"), 0.05)
        transfers = [engine.copy(Tier.GPU, [i], Tier.HOST, [i]) for i in range(4)]
        transfers.append(engine.copy(Tier.HOST, [0, 1], Tier.GPU, [6, 7], num_tokens=3))
        transfers.append(engine.copy(Tier.HOST, [2], Tier.HOST, [7]))
        stats = engine.statistics()
        assert stats.in_flight == 6 and stats.fences.fenced_blocks > 0
        assert "in_flight:6" in repr(engine)
        await asyncio.gather(*transfers)
        stats = engine.statistics()
        assert stats.in_flight == 0 and stats.deferred == 0
        assert stats.fences.fenced_blocks == 0 and stats.fences.pending_reads == 0 and stats.fences.pending_writes == 0
        assert stats.submitted == stats.completed == 6 and stats.failed == 0
        assert stats.blocks_by_direction == {"gpu->host": 4, "host->gpu": 2, "host->host": 1}
        assert stats.bytes_by_direction["host->gpu"] == 2 * layout.partial_bytes(3)
        assert "fenced:0" in repr(engine)


async def test_close_drains_and_leaves_no_threads(device, layout):
    before = engine_threads()
    engine = TransferEngine(layout, gpu_blocks=4, host_blocks=4, device=device)
    g = fill_pool(engine, "gpu", 6)
    stall(engine.stream("offload"), STALL)
    t = engine.copy(Tier.GPU, [0], Tier.HOST, [0])
    engine.copy(Tier.HOST, [1], Tier.HOST, [2])
    await engine.close()
    assert t.done() and same(snapshot(engine, "host", 0), g[0])
    assert engine_threads() <= before
    assert len(engine.fences) == 0
    await engine.close()  # idempotent
    with pytest.raises(EngineClosedError):
        engine.copy(Tier.GPU, [0], Tier.HOST, [0])


async def test_empty_copy_completes_at_once(layout):
    async with TransferEngine(layout, gpu_blocks=2, host_blocks=2, device="cpu") as engine:
        t = engine.copy(Tier.GPU, [], Tier.HOST, np.array([], dtype=np.int64))
        assert t.done()
        assert (await t).nbytes == 0


async def test_failed_op_raises_transfer_error_and_releases_fences(layout, monkeypatch):
    async with TransferEngine(layout, gpu_blocks=2, host_blocks=2, device="cpu") as engine:
        def broken(*args, **kwargs):
            def op():
                raise OSError("simulated device fault")
            return op

        monkeypatch.setattr(engine.route(Tier.GPU, Tier.HOST), "build_op", broken)
        t = engine.copy(Tier.GPU, [0], Tier.HOST, [1])
        with pytest.raises(TransferError, match="simulated device fault"):
            await t
        assert len(engine.fences) == 0
        assert engine.statistics().failed == 1


def test_copy_outside_a_loop_is_a_clear_error(layout):
    engine = TransferEngine(layout, gpu_blocks=2, host_blocks=2, device="cpu")
    try:
        with pytest.raises(RuntimeError, match="event loop"):
            engine.copy(Tier.GPU, [0], Tier.HOST, [0])
    finally:
        asyncio.run(engine.close())


# ------------------------------------------------------------------------------------------ bad input


BAD = [
    ((Tier.GPU, [4], Tier.HOST, [0]), {}, ValueError, "out of range"),
    ((Tier.GPU, [0], Tier.HOST, [4]), {}, ValueError, "out of range"),
    ((Tier.GPU, [-1], Tier.HOST, [0]), {}, ValueError, "negative"),
    ((Tier.GPU, [0, 1], Tier.HOST, [2, 2]), {}, ValueError, "duplicates"),
    ((Tier.GPU, [0, 1], Tier.GPU, [1, 2]), {}, ValueError, "both a source and a destination"),
    ((Tier.HOST, [3], Tier.HOST, [3]), {}, ValueError, "both a source and a destination"),
    ((Tier.GPU, [0, 1], Tier.HOST, [0]), {}, ValueError, "pair up"),
    ((Tier.GPU, [0], Tier.HOST, [0]), {"num_tokens": 0}, ValueError, "num_tokens"),
    ((Tier.GPU, [0], Tier.HOST, [0]), {"num_tokens": 9}, ValueError, "num_tokens"),
    ((Tier.GPU, [0], Tier.HOST, [0]), {"num_tokens": 2.0}, TypeError, "num_tokens"),
    ((Tier.GPU, [0], Tier.HOST, [0]), {"num_tokens": True}, TypeError, "num_tokens"),
    (("nvme", [0], Tier.HOST, [0]), {}, ValueError, "unknown tier"),
    ((Tier.FILE, [0], Tier.HOST, [0]), {}, ValueError, "no file pool"),
    ((Tier.GPU, [0.5], Tier.HOST, [0]), {}, TypeError, "integers"),
    ((Tier.GPU, 0, Tier.HOST, [0]), {}, TypeError, "sequence"),
    ((Tier.GPU, [[0]], Tier.HOST, [0]), {}, TypeError, "one-dimensional"),
    ((Tier.GPU, torch.tensor([0.0]), Tier.HOST, [0]), {}, TypeError, "integers"),
]


@pytest.mark.parametrize(("args", "kwargs", "error", "match"), BAD)
async def test_bad_input_raises_before_enqueueing(args, kwargs, error, match):
    layout = KVLayout(num_layers=1, num_kv_heads=1, head_dim=8, tokens_per_block=8)
    async with TransferEngine(layout, gpu_blocks=4, host_blocks=4, device="cpu") as engine:
        fill_pool(engine, "gpu", 7)
        h = fill_pool(engine, "host", 8)
        with pytest.raises(error, match=match):
            engine.copy(*args, **kwargs)
        stats = engine.statistics()
        assert stats.submitted == 0 and stats.in_flight == 0 and len(engine.fences) == 0
        await engine.drain()
        assert same(engine.pool("host").tensor, h)


def test_bad_constructor_arguments(layout):
    with pytest.raises(TypeError):
        TransferEngine("not a layout", gpu_blocks=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        TransferEngine(layout, gpu_blocks=-1)
    with pytest.raises(TypeError):
        TransferEngine(layout, gpu_blocks=2.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="larger than any"):
        TransferEngine(layout, host_blocks=2**60, device="cpu")
    with pytest.raises(MemoryError, match="cannot allocate"):
        TransferEngine(layout, host_blocks=2**40, device="cpu")
    with pytest.raises(ValueError, match="device"):
        TransferEngine(layout, gpu_blocks=1, device="tpu")
    with pytest.raises(ValueError, match="shape"):
        TransferEngine(layout, gpu_pool=torch.empty(2, 3), device="cpu")


async def test_block_view_bounds(layout):
    async with TransferEngine(layout, gpu_blocks=2, host_blocks=2, device="cpu") as engine:
        assert engine.block("gpu", 1).shape == layout.block_shape
        with pytest.raises(ValueError):
            engine.block("gpu", 2)
        with pytest.raises(TypeError):
            engine.block("gpu", 1.0)  # type: ignore[arg-type]
        with pytest.raises(ValueError):
            engine.stream("compute")


async def test_user_gpu_pool_is_used_in_place(layout):
    pool = torch.zeros((3, *layout.block_shape), dtype=layout.dtype)
    async with TransferEngine(layout, gpu_pool=pool, host_blocks=2, device="cpu") as engine:
        engine.block("host", 0).fill_(1.5)
        await engine.copy(Tier.HOST, [0], Tier.GPU, [2])
        assert bool((pool[2] == 1.5).all()) and bool((pool[:2] == 0).all())
