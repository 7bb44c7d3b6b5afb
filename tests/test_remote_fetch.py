"""Remote reads planned by admission (:mod:`tiered_kv.remote.fetch`): what lands, in a row, is reused; nothing else.

Every reused token is checked against the oracle of :mod:`tiered_kv.tools.workload` (content derived from the
token prefix). The stores are real Redis servers on 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest
import torch
from remote_servers import redis_server, store_url  # noqa: F401

from tiered_kv import KVLayout, LayerMajorPool, Request, Tier, TieredKVCache, TransferEngine
from tiered_kv.remote import object_name, open_store
from tiered_kv.remote.servers import LocalServer, start_redis
from tiered_kv.tools.workload import expected_tokens, verify_expected, write_expected

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, tokens_per_block=16, dtype=torch.float16)
TPB = LAYOUT.tokens_per_block


def _cache(url: str, model: str, **kw: object) -> TieredKVCache:
    kw.setdefault("gpu_blocks", 96)
    kw.setdefault("host_blocks", 4)
    return TieredKVCache(LAYOUT, device="cpu", remote=url, model_id=model, **kw)  # type: ignore[arg-type]


def _prompt(blocks: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 30000, blocks * TPB + 1)


async def _compute(cache: TieredKVCache, prompts: list[np.ndarray]) -> None:
    """Play the model for each prompt, commit it, and put every block in the store."""
    for p in prompts:
        [adm] = await cache.add_sequences([p])
        write_expected(cache, adm.seq_id, adm.tokens_reused)
        cache.commit(adm.seq_id)
        cache.free(adm.seq_id)
    await cache.flush()


async def _delete(url: str, cache: TieredKVCache, prompt: np.ndarray, block: int) -> None:
    raw = open_store(url)
    await raw.connect()
    key = cache.hasher.chain(prompt)[block]
    await raw._require().delete(object_name(0, key))
    await raw.close()


async def test_a_gap_in_the_store_ends_the_reused_prefix(redis_server: LocalServer) -> None:  # noqa: F811
    url, model = store_url(redis_server), f"gap-{time.time_ns()}"
    prompt = _prompt(20, 1)
    async with _cache(url, model) as warm:
        await _compute(warm, [prompt])
        await _delete(url, warm, prompt, 13)
    async with _cache(url, model) as cold:
        [adm] = await cold.add_sequences([Request(prompt)])
        assert adm.tokens_reused == 13 * TPB and adm.blocks_from["remote"] == 13
        assert verify_expected(cold, adm.seq_id, 0, adm.tokens_reused) == []
        # the blocks after the gap landed too, but are not reused, nor cached before the model writes them
        assert cold.blocks.committed_tokens(adm.seq_id) == 13 * TPB
        assert cold.match(prompt)[0] == 13 * TPB
        s = cold.statistics()
        assert s.hits["remote"] == 13 and s.tokens_reused == 13 * TPB
        cold.blocks.check()


async def test_a_batch_of_prompts_sharing_a_remote_prefix(redis_server: LocalServer) -> None:  # noqa: F811
    url, model = store_url(redis_server), f"batch-{time.time_ns()}"
    base = _prompt(10, 2)[:-1]
    prompts = [np.concatenate([base, np.random.default_rng(s).integers(0, 30000, 2 * TPB + 1)]) for s in (3, 4)]
    async with _cache(url, model) as warm:
        await _compute(warm, [prompts[0]])  # base and the first tail: 12 blocks; the second tail is new
    async with _cache(url, model) as cold:
        a, b = await cold.add_sequences([Request(prompts[0]), Request(prompts[1])])
        assert (a.blocks_from["remote"], b.blocks_from["remote"]) == (12, 10)
        for adm in (a, b):
            assert verify_expected(cold, adm.seq_id, 0, adm.tokens_reused) == []
        cold.blocks.check()


async def test_a_remote_block_supersedes_a_local_partial_copy(redis_server: LocalServer) -> None:  # noqa: F811
    url, model = store_url(redis_server), f"partial-{time.time_ns()}"
    prompt = _prompt(6, 5)
    async with _cache(url, model) as warm:
        await _compute(warm, [prompt])
    async with _cache(url, model) as cold:
        # a local sequence that committed 2 blocks and 5 tokens of the same prompt: a partial block
        [first] = await cold.add_sequences([Request(prompt[: 2 * TPB + 6])])
        write_expected(cold, first.seq_id, 0)
        cold.commit(first.seq_id, 2 * TPB + 5)
        cold.free(first.seq_id)
        [adm] = await cold.add_sequences([Request(prompt)])
        assert adm.tokens_reused == 6 * TPB and adm.partial_tokens == 0
        assert adm.blocks_from["gpu"] == 2 and adm.blocks_from["remote"] == 4
        assert verify_expected(cold, adm.seq_id, 0, adm.tokens_reused) == []
        assert cold.statistics().partial_hits == 0
        cold.blocks.check()


async def test_a_cancelled_admission_leaves_no_fetched_block_reusable() -> None:
    srv = start_redis()
    try:
        url, model = store_url(srv), f"cancel-{time.time_ns()}"
        prompt = _prompt(24, 6)
        async with _cache(url, model) as warm:
            await _compute(warm, [prompt])
        async with _cache(url, model) as cold:
            srv.pause()  # the reads hang: the admission is cancelled while they are in flight
            task = asyncio.create_task(cold.add_sequences([Request(prompt)]))
            await asyncio.sleep(0.3)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            srv.resume()
            await cold.remote.tier.drain()
            # the read completed after its admission was gone: its blocks landed in freed slots, none is reusable
            assert cold.statistics().remote.blocks["get"] == 24
            assert cold.match(prompt)[0] == 0 and cold.blocks.live_sequences == ()
            cold.blocks.check()
            [adm] = await cold.add_sequences([Request(prompt)])
            assert adm.blocks_from["remote"] == 24
            assert verify_expected(cold, adm.seq_id, 0, adm.tokens_reused) == []
    finally:
        srv.stop()


async def test_a_layer_major_gpu_pool_streams_through_a_ring_of_host_slots(
    redis_server: LocalServer,  # noqa: F811
) -> None:
    url, model = store_url(redis_server), f"ring-{time.time_ns()}"
    prompt = _prompt(40, 7)  # ten times the host tier
    async with _cache(url, model) as warm:
        await _compute(warm, [prompt])
    pool = LayerMajorPool.allocate(LAYOUT, 96, "cpu")
    async with TransferEngine(LAYOUT, gpu_pool=pool, host_blocks=4, device="cpu") as engine:
        async with TieredKVCache(LAYOUT, gpu_blocks=96, host_blocks=4, device="cpu", engine=engine, remote=url,
                                 model_id=model, integrity=False) as cold:
            assert cold.blocks.fetch_tier is Tier.HOST
            [adm] = await cold.add_sequences([Request(prompt)])
            assert adm.tokens_reused == 40 * TPB and adm.blocks_from["remote"] == 40
            tokens = cold.blocks.sequence_tokens(adm.seq_id)
            for i, slot in enumerate(adm.page_table[:40]):
                want = expected_tokens(cold.hasher, tokens, i * TPB, (i + 1) * TPB)
                assert torch.equal(pool.block(slot).view(torch.uint8), want.view(torch.uint8))  # bytes: NaN patterns
            cold.blocks.check()
