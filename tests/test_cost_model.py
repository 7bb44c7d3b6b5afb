"""Cost-aware reuse: a tier's blocks are reused only where bringing them back beats recomputing them."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tiered_kv import KVLayout, Tier, TieredKVCache
from tiered_kv.cost_model import CostModel

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, tokens_per_block=16, dtype=torch.float16)
BLOCK = LAYOUT.bytes_per_block  # 4 KiB


def _tokens(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, 1000, n).tolist()


async def _cached_in(cache: TieredKVCache, prompt: list[int], tier: str) -> None:
    [adm] = await cache.add_sequences([prompt])
    cache.commit(adm.seq_id)
    cache.free(adm.seq_id)
    if tier in ("host", "file"):
        await cache.evict(Tier.GPU, cache.blocks.capacity[Tier.GPU])
    if tier == "file":
        await cache.evict(Tier.HOST, cache.blocks.capacity[Tier.HOST])


async def test_a_slow_file_tier_is_skipped_for_a_short_prefix_and_used_for_a_long_one(tmp_path):
    # file: 4 KiB per block at 1 MB/s = 4.1 ms per block of 16 tokens; prefill: 10 us per token = 0.16 ms per block
    async with TieredKVCache(LAYOUT, gpu_blocks=64, host_blocks=64, file_blocks=64, file_dir=tmp_path,
                             device="cpu") as cache:
        cost = CostModel(cache, prefill_tokens_per_s=100_000, bandwidth={"file": 1e6}).attach()
        prompt = _tokens(1, 160)
        await _cached_in(cache, prompt, "file")
        [adm] = await cache.add_sequences([[*prompt, 1, 2, 3]])
        assert adm.tokens_reused == 0 and adm.blocks_from["file"] == 0  # recomputed: 1.6 ms against 41 ms
        cache.free(adm.seq_id)
        s = cost.statistics()
        assert s.decisions == 1 and s.skipped_admissions == 1 and s.skipped_blocks == {"file": 10}
        assert s.saved_vs_reuse_all_s == pytest.approx(10 * BLOCK / 1e6 - 160 * 1e-5)
        assert s.saved_vs_recompute_s == 0.0
        # a slow model (1000 tokens/s = 16 ms per block): reading the file (4.1 ms per block) wins
        slow = CostModel(cache, prefill_tokens_per_s=1000, bandwidth={"file": 1e6}).attach()
        [adm] = await cache.add_sequences([[*prompt, 4, 5]])
        assert adm.tokens_reused == 160 and adm.blocks_from["file"] == 10
        cache.free(adm.seq_id)
        st = slow.statistics()
        assert st.skipped_admissions == 0 and st.saved_vs_reuse_all_s == 0.0
        assert st.saved_vs_recompute_s == pytest.approx(160 / 1000 - 10 * BLOCK / 1e6)


async def test_the_gpu_part_of_a_prefix_is_kept_and_the_slow_rest_recomputed(tmp_path):
    async with TieredKVCache(LAYOUT, gpu_blocks=64, host_blocks=64, file_blocks=64, file_dir=tmp_path,
                             device="cpu") as cache:
        head = _tokens(2, 64)
        await _cached_in(cache, head + _tokens(3, 96), "file")
        await _cached_in(cache, head + _tokens(4, 16), "gpu")  # the first 4 blocks are on the GPU again
        cost = CostModel(cache, prefill_tokens_per_s=100_000, bandwidth={"file": 1e6}).attach()
        prompt = head + _tokens(3, 96) + [9]
        assert cache.match(prompt)[1] == {"gpu": 4, "host": 0, "file": 6}
        [adm] = await cache.add_sequences([prompt])
        assert adm.tokens_reused == 64 and adm.blocks_from == {"gpu": 4, "host": 0, "file": 0}
        assert cost.statistics().skipped_blocks == {"file": 6}
        cache.free(adm.seq_id)
        cache.blocks.check()


async def test_bandwidth_is_measured_from_the_caches_own_transfers_and_unknowns_reuse(tmp_path):
    async with TieredKVCache(LAYOUT, gpu_blocks=64, host_blocks=64, device="cpu") as cache:
        cost = CostModel(cache).attach()
        assert cost.bandwidth("host") is None and cost.prefill_seconds_per_token() is None
        prompt = _tokens(5, 96)
        await _cached_in(cache, prompt, "host")
        [adm] = await cache.add_sequences([[*prompt, 1]])  # no prefill rate known: everything is reused
        assert adm.tokens_reused == 96
        cache.free(adm.seq_id)
        assert cost.statistics().decisions == 0
        measured = cost.bandwidth("host")
        stats = cache.engine.statistics()
        assert measured == stats.bytes_by_direction["host->gpu"] / stats.seconds_by_direction["host->gpu"] > 0
        for tokens, seconds in ((1, 0.0101), (100, 0.020), (1000, 0.110)):  # 10 ms + 0.1 ms per token
            cost.observe_prefill(tokens, seconds)
        assert cost.prefill_seconds_per_token() == pytest.approx(1e-4, rel=1e-6)  # the slope, not 0.14 s / 1101 tokens
        await _cached_in(cache, prompt, "host")
        [adm] = await cache.add_sequences([[*prompt, 2]])  # host memcpy is far faster than 0.1 ms per token
        assert adm.tokens_reused == 96 and cost.statistics().decisions == 1
        cache.free(adm.seq_id)


async def test_bad_rates_are_refused():
    async with TieredKVCache(LAYOUT, gpu_blocks=4, device="cpu") as cache:
        with pytest.raises(ValueError, match="prefill_tokens_per_s"):
            CostModel(cache, prefill_tokens_per_s=0)
        with pytest.raises(ValueError, match="bandwidth"):
            CostModel(cache, bandwidth={"gpu": 1e9})
        with pytest.raises(ValueError, match="bandwidth"):
            CostModel(cache, bandwidth={"file": -1})
