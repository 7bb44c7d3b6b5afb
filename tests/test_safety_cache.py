"""Issue 11: the prefix cache never serves wrong KV.

Failed spills, plan atomicity, ownership, callbacks, token ids.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from pathlib import Path

import numpy as np
import pytest
import torch
from tiered_kv.backends.posix import PosixBackend

from tiered_kv import KVLayout, Tier, TransferEngine
from tiered_kv.blocks import Request
from tiered_kv.cache import TieredKVCache
from tiered_kv.errors import TransferError
from tiered_kv.file import FileTierConfig
from tiered_kv.testing import FaultyBackend
from tiered_kv.tools.workload import verify_expected, write_expected

TPB = 4


@pytest.fixture
def small() -> KVLayout:
    return KVLayout(num_layers=2, num_kv_heads=1, head_dim=8, tokens_per_block=TPB, dtype=torch.float16)


def toks(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


@contextlib.asynccontextmanager
async def faulty_cache(layout: KVLayout, tmp: Path, *, gpu: int, host: int, file: int,
                       **faults: object) -> AsyncIterator[tuple[TieredKVCache, list[FaultyBackend]]]:
    backends: list[FaultyBackend] = []

    def factory(path: str) -> FaultyBackend:
        backends.append(FaultyBackend(PosixBackend(path, direct=False), **faults))  # type: ignore[arg-type]
        return backends[-1]

    cfg = FileTierConfig(tmp, file, backend_factory=factory)
    engine = TransferEngine(layout, gpu_blocks=gpu, host_blocks=host, device="cpu", file_config=cfg)
    async with engine:
        cache = TieredKVCache(layout, gpu_blocks=gpu, host_blocks=host, file_blocks=file, engine=engine)
        async with cache:
            yield cache, backends
            cache.blocks.check()


async def serve(cache: TieredKVCache, tokens: list[int]) -> int:
    """Admit, check every reused token, write the rest, commit, free; returns tokens reused."""
    [adm] = await cache.add_sequences([Request(tokens)])
    try:
        assert verify_expected(cache, adm.seq_id, 0, adm.tokens_reused) == [], "a reused token has wrong KV"
        write_expected(cache, adm.seq_id, adm.tokens_reused)
        cache.commit(adm.seq_id)
    finally:
        cache.free(adm.seq_id)
    return adm.tokens_reused


# ---------------------------------------------------------------------------------------- finding 1


async def test_failed_spill_dropped_before_the_loop_heard_is_never_planned_from(
    small: KVLayout, tmp_path: Path
) -> None:
    """Finding 1: a spill fails; the tier gives the slot up on its I/O thread before the loop completes the
    transfer; the next admission plans from that slot. It must be served right (or fail with
    TransferError), leave no sequence behind and no half-moved block."""
    async with faulty_cache(small, tmp_path, gpu=6, host=1, file=6, eio_on_write=2, stall_writes=0.3) as (cache, be):
        a = toks(0, 2 * TPB + 1)
        await serve(cache, a)  # A0, A1 and a 1-token tail cached on the GPU
        await serve(cache, toks(500, 2 * TPB + 1))  # C fills the rest of the GPU
        # B evicts A down the tiers: GPU -> host -> file; the spill of A1 (the 2nd write) stalls, then fails.
        other = asyncio.create_task(serve(cache, toks(1000, 2 * TPB + 1)))
        while be[0].writes < 2:  # noqa: ASYNC110 -- B's plan is issued; A1's spill started (it stalls, then fails)
            await asyncio.sleep(0.005)
        # Block the loop (no callback runs) until the failing write is over on the I/O threads: the tier
        # has given the slot up, the loop has not heard of it yet.
        time.sleep(0.6)  # noqa: ASYNC251 (the point: the loop must not run)
        # Then plan from the tier's state as it is now (no loop step in between).
        try:
            reused = await serve(cache, [*a[: 2 * TPB], 77])
        except TransferError:
            reused = -1
        await other
        assert cache.blocks.live_sequences == ()
        cache.blocks.check()
        await cache.engine.drain()
        # Whatever happened, every later reuse is correct and nothing is left half-moved.
        for _ in range(3):
            await serve(cache, [*a[: 2 * TPB], 77])
            await serve(cache, toks(1000, 2 * TPB + 1))
        assert cache.blocks.live_sequences == ()
        assert reused in (-1, 0, TPB, 2 * TPB)


async def test_a_plan_that_cannot_be_issued_whole_issues_nothing(small: KVLayout, tmp_path: Path) -> None:
    """Finding 1: a plan is issued whole or not at all. A file slot lost without the manager hearing of it
    (simulated: the tier's index entry is cleared behind everyone's back) fails the batch with
    TransferError before any copy of it is issued; no sequence, no half-moved block is left."""
    async with faulty_cache(small, tmp_path, gpu=6, host=1, file=6) as (cache, _):
        a = toks(0, 2 * TPB + 1)
        await serve(cache, a)
        await serve(cache, toks(500, 2 * TPB + 1))
        await serve(cache, toks(1000, 2 * TPB + 1))  # A goes down to the host and file tiers
        await cache.engine.drain()
        tier = cache.engine.file_tier
        a1 = cache.blocks.lookup(cache.hasher.chain(np.asarray(a, dtype=np.int64))[1])
        assert a1 is not None and a1.tier is Tier.FILE
        with tier.index._lock:
            tier.index._drop_locked(a1.slot)  # the tier forgets the slot and tells nobody
        submitted = cache.engine.statistics().submitted
        with pytest.raises(TransferError, match="could not be brought"):
            await cache.add_sequences([[*a[: 2 * TPB], 77]])
        assert cache.engine.statistics().submitted == submitted, "part of the plan was issued"
        assert cache.blocks.live_sequences == ()
        cache.blocks.check()
        await cache.engine.drain()
        for _ in range(2):
            await serve(cache, [*a[: 2 * TPB], 77])
            await serve(cache, toks(1000, 2 * TPB + 1))
            await serve(cache, toks(500, 2 * TPB + 1))


async def test_the_manager_hears_of_a_dropped_slot_before_the_failed_spill_completes(
    small: KVLayout, tmp_path: Path
) -> None:
    """Finding 1: slot-state changes reach the block manager in one ordered place (on the loop, before the
    failed copy is seen done): by the time anyone can observe the failed spill, its block left the lookup."""
    async with faulty_cache(small, tmp_path, gpu=6, host=1, file=6, eio_on_write=2, stall_writes=0.1) as (cache, be):
        a = toks(0, 2 * TPB + 1)
        await serve(cache, a)
        await serve(cache, toks(500, 2 * TPB + 1))
        a1_key = cache.hasher.chain(np.asarray(a, dtype=np.int64))[1]
        seen: list[bool] = []
        issue = cache._issue

        def watch(plan):
            transfers = issue(plan)
            for t, blocks in cache._unchecked:
                if any(b.key == a1_key for b in blocks) and t.dst_tier is Tier.FILE:
                    t.add_done_callback(lambda _t: seen.append(cache.blocks.lookup(a1_key) is not None))
            return transfers

        cache._issue = watch  # type: ignore[method-assign]
        await serve(cache, toks(1000, 2 * TPB + 1))  # A1's spill is the failing 2nd write
        await cache.engine.drain()
        assert be[0].faults == 1
        assert seen == [False], "the failed spill completed while its block was still in the lookup"
        assert cache.statistics().poisoned == 1


# ---------------------------------------------------------------------------------------- finding 3


async def test_a_raising_done_callback_breaks_nothing(small: KVLayout) -> None:
    """Finding 3: every callback runs, the exception reaches the loop's exception handler, dependent copies
    and close() complete -- in either completion order of two streams (repeated to meet both)."""
    loop = asyncio.get_running_loop()
    reported: list[dict[str, object]] = []
    loop.set_exception_handler(lambda _loop, ctx: reported.append(ctx))
    engine = TransferEngine(small, gpu_blocks=4, host_blocks=4, device="cpu")
    rounds = 20
    async with engine:
        for _ in range(rounds):
            ran: list[str] = []

            def bad(_t: object, ran: list[str] = ran) -> None:
                ran.append("bad")
                raise RuntimeError("callback bug")

            t1 = engine.copy(Tier.GPU, [0], Tier.HOST, [1])  # offload stream
            t1.add_done_callback(bad)

            def second(_t: object, ran: list[str] = ran) -> None:
                ran.append("second")

            t1.add_done_callback(second)
            t2 = engine.copy(Tier.HOST, [1], Tier.GPU, [2])  # onboard stream, waits for t1 stream-side
            await asyncio.wait_for(t2, 5)
            await asyncio.wait_for(t1, 5)
            assert ran == ["bad", "second"], ran
        await asyncio.wait_for(engine.drain(), 5)
    assert engine.closed
    assert len(reported) == rounds
    assert all(isinstance(c.get("exception"), RuntimeError) for c in reported)
    # a callback added after completion that raises is reported too, and does not raise into the caller
    t1.add_done_callback(bad)
    assert len(reported) == rounds + 1


# ---------------------------------------------------------------------------------------- finding 8


@pytest.mark.parametrize(
    "bad",
    [[1, 2, 2**63], [2**63 + 5], [2**64 + 1, 3], [-1, 4, 5], [4, 2**63, -1],
     np.array([7, 2**63 + 7], dtype=np.uint64), np.array([-7, 1], dtype=np.int32)],
    ids=["2**63", "2**63+5", "beyond-uint64", "negative", "mixed", "uint64-array", "negative-int32"],
)
async def test_out_of_range_token_ids_are_refused_before_anything_changes(small: KVLayout, bad: object) -> None:
    """Finding 8: an id >= 2**63 wrapped to a negative int64 and aliased another prompt's KV (2**63 + 7 is
    -2**63 + 7 as int64); negative ids were accepted. Both raise ValueError; nothing changes."""
    async with TieredKVCache(small, gpu_blocks=8, device="cpu") as cache:
        [adm] = await cache.add_sequences([[7, *range(1, 2 * TPB + 1)]])
        write_expected(cache, adm.seq_id, 0)
        cache.commit(adm.seq_id)
        before = cache.statistics().blocks
        with pytest.raises(ValueError, match=r"0\.\.2\*\*63-1"):
            await cache.add_sequences([bad])  # type: ignore[list-item]
        with pytest.raises(ValueError, match=r"0\.\.2\*\*63-1"):
            cache.match(bad)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match=r"0\.\.2\*\*63-1"):
            await cache.append_tokens(adm.seq_id, bad)  # type: ignore[arg-type]
        assert cache.statistics().blocks == before
        assert len(cache.blocks.sequence_tokens(adm.seq_id)) == 2 * TPB + 1
        cache.free(adm.seq_id)
        cache.blocks.check()


def test_ids_near_the_int64_edge_do_not_alias(small: KVLayout) -> None:
    from tiered_kv.keys import KeyHasher, as_token_array

    h = KeyHasher(small, "m")
    top = as_token_array([2**63 - 1] * TPB)
    assert h.chain(top) != h.chain(as_token_array([0] * TPB))
    with pytest.raises(ValueError):
        as_token_array([2**63] * TPB)


# ---------------------------------------------------------------------------------------- finding 2


async def test_the_engine_under_a_cache_refuses_copies(small: KVLayout) -> None:
    """Finding 2: README's ``cache.engine.copy(Tier.GPU, [0, 1], Tier.HOST, [5, 6], num_tokens=8)`` into host
    slots the cache owns served wrong tokens later. The engine refuses every copy while the cache owns it."""
    from tiered_kv import OwnedEngineError

    async with TieredKVCache(small, gpu_blocks=4, host_blocks=8, device="cpu") as cache:
        a = toks(0, 2 * TPB + 1)
        await serve(cache, a)
        await cache.evict(Tier.GPU, 4)  # A's blocks are in host slots now
        submitted = cache.engine.statistics().submitted
        with pytest.raises(OwnedEngineError, match="belong to TieredKVCache"):
            cache.engine.copy(Tier.GPU, [0, 1], Tier.HOST, [0, 1], num_tokens=TPB)
        with pytest.raises(ValueError):  # OwnedEngineError is a ValueError: bad use, nothing enqueued
            cache.engine.copy(Tier.HOST, [0], Tier.GPU, [3])
        assert cache.engine.statistics().submitted == submitted
        assert await serve(cache, [*a[: 2 * TPB], 9]) == 2 * TPB  # served, and right (serve verifies)
        assert cache.engine.statistics().in_flight == 0  # inspection stays open
    # closed: the engine is the user's again (a user-supplied engine outlives the cache)
    engine = TransferEngine(small, gpu_blocks=4, host_blocks=8, device="cpu")
    async with engine:
        async with TieredKVCache(small, gpu_blocks=4, host_blocks=8, engine=engine) as cache:
            with pytest.raises(OwnedEngineError):
                engine.copy(Tier.GPU, [0], Tier.HOST, [0])
            with pytest.raises(ValueError, match="already belongs"):
                TieredKVCache(small, gpu_blocks=4, host_blocks=8, engine=engine)
        await engine.copy(Tier.GPU, [0], Tier.HOST, [0])


# ---------------------------------------------------------------------------------------- slot events


async def test_slot_events_apply_on_the_loop_in_order_and_at_once_without_one() -> None:
    """tiered_kv.slotstate: changes posted from threads apply on the loop, FIFO, between loop steps; a listener
    that raises does not stop the others; with no loop (or a closed one) a change applies on the spot."""
    import threading as th

    from tiered_kv.slotstate import SlotEvent, SlotEvents

    events = SlotEvents()
    seen: list[int] = []
    events.subscribe(lambda e: (_ for _ in ()).throw(RuntimeError("listener bug")))  # raises
    events.subscribe(lambda e: seen.append(e.slot))
    events.post(lambda: [SlotEvent(0, b"k", 1, "write failed")])  # no loop yet: at once
    assert seen == [0]
    events.bind(asyncio.get_running_loop())
    posters = [
        th.Thread(target=events.post, args=(lambda i=i: [SlotEvent(i, b"k", 1, "write failed")],)) for i in range(1, 6)
    ]
    for p in posters:
        p.start()
        p.join()  # one after another: their order is the posting order
    assert seen == [0], "applied off the loop"
    await asyncio.sleep(0)
    assert seen == [0, 1, 2, 3, 4, 5]
