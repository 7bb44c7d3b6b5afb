"""``TieredKVCache.add_sequences_layerwise``: reused blocks from host memory land one layer group at a time.

The admission returns before they land; compute waits per layer; ``settle`` checks every copy and checksum, and on a
failure frees the batch and drops the bad blocks, so a second admission recomputes them. Every byte compute reads
after its layer's wait is checked against the deterministic content written at commit.
"""

from __future__ import annotations

import asyncio
import random
import time
from typing import Any

import numpy as np
import pytest
import torch

from tiered_kv import KVLayout, TieredKVCache
from tiered_kv.device import stall_op
from tiered_kv.engine import Transfer
from tiered_kv.errors import TransferError
from tiered_kv.pools import Tier
from tiered_kv.tools.workload import expected_tokens, verify_expected, write_expected

LAYOUT = KVLayout(num_layers=4, num_kv_heads=2, head_dim=8, tokens_per_block=4, dtype=torch.float16)


async def _cached_on_host(cache: TieredKVCache, prompt: list[int]) -> None:
    """Compute and commit ``prompt``, then move every cached block off the GPU."""
    [adm] = await cache.add_sequences([prompt])
    write_expected(cache, adm.seq_id, 0)
    cache.commit(adm.seq_id)
    cache.free(adm.seq_id)
    await cache.evict(Tier.GPU, cache.blocks.capacity[Tier.GPU])


def _layer_ok(cache: TieredKVCache, seq_id: int, layer: int, stop: int) -> bool:
    """Whether layer ``layer`` of positions ``[0, stop)`` of the sequence holds what was committed."""
    tokens = cache.blocks.sequence_tokens(seq_id)
    pool = cache.engine.pool(Tier.GPU).tensor
    tpb = cache.layout.tokens_per_block
    table = cache.page_table(seq_id)
    for a in range(0, stop, tpb):
        b = min(stop, a + tpb)
        want = expected_tokens(cache.hasher, tokens, a, b)[layer]
        got = pool[table[a // tpb], layer, :, :, : b - a, :]
        if not torch.equal(got.contiguous().cpu().view(torch.uint8), want.view(torch.uint8)):
            return False
    return True


async def test_a_host_hit_returns_before_its_layers_land_and_each_wait_gives_that_layer() -> None:
    prompt = list(range(1, 30))  # 7 full blocks and one token
    async with TieredKVCache(LAYOUT, gpu_blocks=16, host_blocks=16, device="cpu") as cache:
        await _cached_on_host(cache, prompt)
        expected, _ = cache.match(prompt)
        [adm], load = await cache.add_sequences_layerwise([prompt], group_layers=2)
        assert load is not None and load.groups == [(0, 2), (2, 3), (3, 4)]  # the last group tapered
        assert adm.tokens_reused == expected and adm.blocks_from["host"] == 7
        reused = adm.tokens_reused - adm.partial_tokens
        for layer in range(LAYOUT.num_layers):
            load.wait_layer(layer, None)
            assert _layer_ok(cache, adm.seq_id, layer, reused)
        await load.settle()
        await load.settle()  # idempotent
        assert verify_expected(cache, adm.seq_id, 0, adm.tokens_reused) == []
        write_expected(cache, adm.seq_id, adm.tokens_reused)
        cache.commit(adm.seq_id)
        cache.free(adm.seq_id)
        assert cache.statistics().integrity_errors == 0


async def test_the_admission_returns_while_the_layers_are_held_and_a_wait_orders_its_layer_only() -> None:
    """The onboard stream held: the admission returns with the copies pending; each layer's wait gives its layer."""
    prompt = list(range(1, 30))
    async with TieredKVCache(LAYOUT, gpu_blocks=16, host_blocks=16, device="cpu") as cache:
        await _cached_on_host(cache, prompt)
        for slot in range(16):  # what the GPU slots held is gone: landed data can only come from these copies
            cache.engine.pool(Tier.GPU).tensor[slot].fill_(0)
        onboard = cache.engine.stream("onboard")
        onboard.submit(stall_op(onboard, 0.2))
        t0 = time.perf_counter()
        [adm], load = await cache.add_sequences_layerwise([prompt], group_layers=2)
        assert load is not None and time.perf_counter() - t0 < 0.15  # returned while the copies were held
        [second] = load.transfers[1]
        assert not second.done()
        load.wait_layer(0, None)
        assert _layer_ok(cache, adm.seq_id, 0, 28) and _layer_ok(cache, adm.seq_id, 1, 28)
        load.wait_layer(3, None)
        assert _layer_ok(cache, adm.seq_id, 3, 28)
        await load.settle()
        cache.free(adm.seq_id)


async def test_without_host_blocks_the_admission_is_complete_and_bad_groups_are_refused_first() -> None:
    prompt = list(range(1, 20))
    async with TieredKVCache(LAYOUT, gpu_blocks=16, host_blocks=16, device="cpu") as cache:
        for bad in (0, -1, 1.5, True):
            with pytest.raises((ValueError, TypeError)):
                await cache.add_sequences_layerwise([prompt], group_layers=bad)  # type: ignore[arg-type]
        assert not cache.blocks.live_sequences
        [adm], load = await cache.add_sequences_layerwise([prompt], group_layers=1)  # a miss
        assert load is None and adm.tokens_reused == 0
        write_expected(cache, adm.seq_id, 0)
        cache.commit(adm.seq_id)
        cache.free(adm.seq_id)
        [adm], load = await cache.add_sequences_layerwise([prompt], group_layers=1)  # a GPU hit
        assert load is None and adm.blocks_from["gpu"] == 4
        assert verify_expected(cache, adm.seq_id, 0, adm.tokens_reused) == []
        cache.free(adm.seq_id)
        [adm], load = await cache.add_sequences_layerwise([prompt], group_layers=LAYOUT.num_layers)  # one group
        assert load is None
        cache.free(adm.seq_id)


async def test_a_host_block_changed_after_commit_fails_the_settle_and_is_recomputed() -> None:
    prompt = list(range(1, 30))
    async with TieredKVCache(LAYOUT, gpu_blocks=16, host_blocks=16, device="cpu") as cache:
        await _cached_on_host(cache, prompt)
        block = cache.blocks.lookup(cache.hasher.chain(np.asarray(prompt))[2])
        assert block is not None and block.tier is Tier.HOST
        cache.engine.pool(Tier.HOST).tensor[block.slot, 3, 1, 0, 2, 5] += 1  # in the last layer group
        [adm], load = await cache.add_sequences_layerwise([prompt], group_layers=1)
        assert load is not None
        load.wait_all(None)
        with pytest.raises(TransferError, match="changed since their commit"):
            await load.settle()
        assert adm.seq_id not in cache.blocks.live_sequences  # the batch was freed
        assert cache.statistics().integrity_errors == 1
        [again] = await cache.add_sequences([prompt])  # the changed block and those after it are recomputed
        assert again.tokens_reused == 8
        assert verify_expected(cache, again.seq_id, 0, again.tokens_reused) == []
        cache.free(again.seq_id)


def _failing_layer_copies(cache: TieredKVCache, chance: float, rng: random.Random) -> None:
    """Make a share of the cache's layer-group copies fail as they are issued (as a copy the engine refuses)."""
    copy_groups = cache._copy_layer_groups

    def maybe_fail(*args: Any, **kwargs: Any) -> list[Transfer]:
        if rng.random() < chance:
            raise TransferError("injected: this layer-group copy failed")
        return copy_groups(*args, **kwargs)

    cache._copy_layer_groups = maybe_fail


async def test_a_failed_layer_copy_fails_the_admission_and_drops_its_blocks() -> None:
    """A copy that fails as it is issued is known before the admission returns: it raises there (a copy failing
    later is found by the settle, as the randomized test below exercises)."""
    prompt = list(range(1, 30))
    async with TieredKVCache(LAYOUT, gpu_blocks=16, host_blocks=16, device="cpu") as cache:
        await _cached_on_host(cache, prompt)
        copy_groups = cache._copy_layer_groups
        _failing_layer_copies(cache, 1.0, random.Random(0))
        with pytest.raises(TransferError, match="could not be brought"):
            await cache.add_sequences_layerwise([prompt], group_layers=1)
        cache._copy_layer_groups = copy_groups
        assert not cache.blocks.live_sequences
        [again] = await cache.add_sequences([prompt])
        assert again.blocks_from["host"] == 0  # every block a failed copy produced was dropped
        assert verify_expected(cache, again.seq_id, 0, again.tokens_reused) == []
        cache.free(again.seq_id)


@pytest.mark.parametrize("seed", range(3))
async def test_randomized_layerwise_admissions_with_evictions_faults_and_cancellations(seed: int) -> None:
    """Prompts sharing prefixes over tiny tiers, an evictor, copies failing as they are issued, host blocks changed
    behind the cache's back, cancelled admissions: every reused byte a layer's wait hands out is what was committed,
    or the admission or its settle fails and nothing is served."""
    rng = random.Random(seed)
    systems = [[rng.randrange(1, 500) for _ in range(rng.randrange(4, 13))] for _ in range(3)]
    prompts = [rng.choice(systems) + [rng.randrange(1, 500) for _ in range(rng.randrange(1, 9))] for _ in range(10)]
    counts = {"served": 0, "admission failed": 0, "settle failed": 0, "cancelled": 0, "layered": 0}
    async with TieredKVCache(LAYOUT, gpu_blocks=24, host_blocks=16, device="cpu") as cache:
        _failing_layer_copies(cache, 0.15, rng)
        host = cache.engine.pool(Tier.HOST).tensor
        onboard = cache.engine.stream("onboard")
        stop = asyncio.Event()

        async def evictor() -> None:
            while not stop.is_set():
                tier = rng.choice([Tier.GPU, Tier.GPU, Tier.HOST])
                await cache.evict(tier, rng.choice([1, 3, cache.blocks.capacity[tier]]))
                await asyncio.sleep(rng.uniform(0, 0.002))

        async def worker() -> None:
            for _ in range(40):
                prompt = rng.choice(prompts)
                if rng.random() < 0.3:  # whatever is cached on the GPU moves to host memory (or out)
                    await cache.evict(Tier.GPU, cache.blocks.capacity[Tier.GPU])
                if rng.random() < 0.3:  # the onboard stream busy for a while: copies still running at admission
                    onboard.submit(stall_op(onboard, rng.uniform(0.001, 0.01)))
                if rng.random() < 0.15:  # a host slot's bytes change (a stray write): its block must not be served
                    host[rng.randrange(host.shape[0]), rng.randrange(LAYOUT.num_layers), 0, 0, 0, 0] += 1
                try:
                    [adm], load = await asyncio.wait_for(
                        cache.add_sequences_layerwise([prompt], group_layers=rng.choice([1, 2, 3])),
                        rng.choice([None, None, None, 1e-4]),
                    )
                except TimeoutError:
                    counts["cancelled"] += 1
                    continue
                except TransferError:
                    counts["admission failed"] += 1
                    continue
                try:
                    reused = adm.tokens_reused
                    if load is not None:
                        counts["layered"] += 1
                        full = reused - adm.partial_tokens
                        seen = []  # each layer as the compute would read it, right after its wait
                        for layer in range(LAYOUT.num_layers):
                            load.wait_layer(layer, None)
                            seen.append(_layer_ok(cache, adm.seq_id, layer, full))
                        try:
                            await load.settle()
                        except TransferError:
                            counts["settle failed"] += 1
                            continue
                        assert all(seen), seen  # settled: every layer was in place when its wait returned
                    assert verify_expected(cache, adm.seq_id, 0, reused) == []
                    counts["served"] += reused
                    write_expected(cache, adm.seq_id, reused)
                    cache.commit(adm.seq_id)
                finally:
                    if adm.seq_id in cache.blocks.live_sequences:
                        cache.free(adm.seq_id)

        task = asyncio.ensure_future(evictor())
        try:
            await asyncio.gather(*(worker() for _ in range(4)))
        finally:
            stop.set()
            await task
        assert not cache.blocks.live_sequences
    # the failures counted here were of both kinds over the seeds; each seed covers one at least
    assert counts["served"] > 0 and counts["layered"] >= 10, counts
    assert counts["admission failed"] + counts["settle failed"] > 0, counts


def test_layer_groups_are_issued_after_the_plans_other_copies_unless_one_shares_their_slots() -> None:
    from types import SimpleNamespace

    from tiered_kv.cache_copies import _layered_last

    def move(src: Tier, s: int, dst: Tier, d: int, n: int | None = None) -> Any:
        return SimpleNamespace(src_tier=src, src_slot=s, dst_tier=dst, dst_slot=d, num_tokens=n)

    offload = [move(Tier.GPU, 5, Tier.HOST, 9)]
    onboard = [move(Tier.HOST, 1, Tier.GPU, 2), move(Tier.HOST, 3, Tier.GPU, 4)]
    partial = [move(Tier.HOST, 7, Tier.GPU, 8, n=2)]
    ranges = [(0, 2), (2, 4)]
    # the partial copy would otherwise queue behind every layer group on the onboard stream
    assert _layered_last([offload, onboard, partial], ranges) == [0, 2, 1]
    assert _layered_last([offload, onboard, partial], None) is None
    reads_landing = [move(Tier.GPU, 4, Tier.GPU, 6, n=2)]  # reads a slot a layer group writes: must follow it
    assert _layered_last([offload, onboard, reads_landing], ranges) is None
    assert _layered_last([offload, onboard], [(0, 4)]) == [0, 1]  # one range: nothing is layered, order kept


async def test_a_long_reuse_in_flight_holds_tracked_objects_per_copy_not_per_block() -> None:
    """A 512-block host hit, its layer groups in flight, keeps O(copies) objects the garbage collector tracks.

    Per-block records that live until the batch settles (one per block and layer group: 4,096 here) are promoted
    through the collector's generations and set off full collections (~100 ms with an inference stack loaded) in
    the middle of admissions; the layer-wise loads then waited behind them.
    """
    import gc

    layout = KVLayout(num_layers=8, num_kv_heads=1, head_dim=4, tokens_per_block=4, dtype=torch.float16)
    prompt = list(range(1, 512 * 4 + 2))  # 512 full blocks and one token
    async with TieredKVCache(layout, gpu_blocks=520, host_blocks=520, device="cpu") as cache:
        await _cached_on_host(cache, prompt)
        await cache.engine.drain()
        gc.collect()
        gc.disable()
        try:
            before = len(gc.get_objects())
            [adm], load = await cache.add_sequences_layerwise([prompt], group_layers=2)
            held = len(gc.get_objects()) - before
        finally:
            gc.enable()
        assert load is not None and adm.blocks_from["host"] == 512
        assert held < 512, f"{held} tracked objects held for a reuse of 512 blocks in 4 layer groups"
        load.wait_all(None)
        await load.settle()
        cache.free(adm.seq_id)


async def test_the_reuse_check_is_enqueued_at_admission_behind_the_layer_copies(device: str) -> None:
    """The integrity check of a layer-by-layer host hit is enqueued when the admission returns, on a stream of its
    own behind the copies still held, so it runs while the forward does and the settle only reads its outcome. The GPU
    slots are zeroed first: a check that read them before the copies landed would refuse every block."""
    prompt = list(range(1, 30))
    async with TieredKVCache(LAYOUT, gpu_blocks=16, host_blocks=16, device=device) as cache:
        await _cached_on_host(cache, prompt)
        [warm], load = await cache.add_sequences_layerwise([prompt], group_layers=2)  # the kernels it runs, loaded
        assert load is not None
        await load.settle()
        cache.free(warm.seq_id)
        await cache.evict(Tier.GPU, 16)
        cache.engine.pool(Tier.GPU).tensor.zero_()
        if device == "cuda":
            torch.cuda.synchronize()
        onboard = cache.engine.stream("onboard")
        onboard.submit(stall_op(onboard, 0.3))
        t0 = time.perf_counter()
        [adm], load = await cache.add_sequences_layerwise([prompt], group_layers=2)
        # returned while the copies are held: enqueuing the check waited for nothing (on CUDA, an upload from
        # pageable memory on the checker stream waited for the whole load)
        assert load is not None and time.perf_counter() - t0 < 0.15
        await load.settle()
        assert cache.statistics().integrity_errors == 0
        load.wait_all(None if device == "cpu" else torch.cuda.current_stream())
        if device == "cuda":
            torch.cuda.synchronize()
        assert all(_layer_ok(cache, adm.seq_id, layer, 28) for layer in range(LAYOUT.num_layers))
        cache.free(adm.seq_id)
