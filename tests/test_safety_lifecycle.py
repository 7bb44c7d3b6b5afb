"""Issue 11: lifecycle -- failed construction and unclosed engines leave nothing behind; close() from another loop."""

from __future__ import annotations

import asyncio
import gc
import os
import threading
import time
from pathlib import Path

import pytest
import torch

from tiered_kv import KVLayout, Tier, TieredKVCache, TransferEngine
from tiered_kv.errors import SlabInUseError

TPB = 4


@pytest.fixture
def small() -> KVLayout:
    return KVLayout(num_layers=2, num_kv_heads=1, head_dim=8, tokens_per_block=TPB, dtype=torch.float16)


def resources() -> tuple[int, int]:
    gc.collect()
    return threading.active_count(), len(os.listdir("/proc/self/fd"))


def settle(before: tuple[int, int]) -> tuple[int, int]:
    deadline = time.monotonic() + 5
    now = resources()
    while now != before and time.monotonic() < deadline:  # thread exits are asynchronous
        time.sleep(0.02)
        now = resources()
    return now


# ---------------------------------------------------------------------------------------- finding 4


def test_a_cache_constructor_that_fails_leaves_nothing(
    small: KVLayout, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Finding 4: ``max_seqs=0`` with ``file_dir`` left 3 threads, fds and the slab lock; the corrected retry
    failed with SlabInUseError. Both an argument error and a failure after the engine was built release all."""
    before = resources()
    with pytest.raises(ValueError, match="max_seqs"):
        TieredKVCache(small, gpu_blocks=4, host_blocks=4, file_blocks=4, file_dir=tmp_path, device="cpu", max_seqs=0)
    assert settle(before) == before

    import tiered_kv.cache as cache_mod

    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("out of device memory (injected)")

    monkeypatch.setattr(cache_mod, "BlockOffsetTable", broken)  # fails after the engine and its file tier exist
    with pytest.raises(RuntimeError, match="injected"):
        TieredKVCache(
            small, gpu_blocks=4, host_blocks=4, file_blocks=4, file_dir=tmp_path, device="cpu", block_offsets=True
        )
    monkeypatch.undo()
    assert settle(before) == before
    cache = TieredKVCache(small, gpu_blocks=4, host_blocks=4, file_blocks=4, file_dir=tmp_path, device="cpu")
    asyncio.run(cache.close())  # the corrected retry opens the same slab: no SlabInUseError
    assert settle(before) == before


def test_an_unclosed_engine_warns_and_releases_its_lock(small: KVLayout, tmp_path: Path) -> None:
    """Finding 4: an engine collected without close() kept its threads and the slab lock."""
    before = resources()
    engine = TransferEngine(small, gpu_blocks=4, host_blocks=4, device="cpu", file_dir=tmp_path, file_blocks=4)
    with pytest.raises(SlabInUseError):
        TransferEngine(small, gpu_blocks=4, host_blocks=4, device="cpu", file_dir=tmp_path, file_blocks=4)
    with pytest.warns(ResourceWarning, match="unclosed"):
        del engine
        gc.collect()
    assert settle(before) == before
    again = TransferEngine(small, gpu_blocks=4, host_blocks=4, device="cpu", file_dir=tmp_path, file_blocks=4)
    asyncio.run(again.close())
    assert settle(before) == before


# ---------------------------------------------------------------------------------------- finding 5


def test_close_from_another_loop_after_the_first_ended_with_a_copy_in_flight(small: KVLayout, tmp_path: Path) -> None:
    """Finding 5: the first loop ends while a copy is in flight; close() from a second loop hung. It completes
    within a bounded time (the copy finishes on its thread; its completion is taken over by the closer)."""
    engine = TransferEngine(small, gpu_blocks=4, host_blocks=4, device="cpu", file_dir=tmp_path, file_blocks=4)
    gate = threading.Event()

    async def first() -> None:
        engine.stream("offload").submit(gate.wait)  # the offload below queues behind this
        engine.copy(Tier.GPU, [0], Tier.HOST, [0])
        engine.copy(Tier.HOST, [1], Tier.FILE, [2], keys=[b"k"])

    asyncio.run(first())  # the loop ends with both copies in flight
    threading.Timer(0.2, gate.set).start()

    async def second() -> None:
        await asyncio.wait_for(engine.close(), 10)

    t0 = time.monotonic()
    asyncio.run(second())
    assert engine.closed and time.monotonic() - t0 < 10
    assert engine.statistics().in_flight == 0
