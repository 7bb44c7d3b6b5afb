"""Cost-aware reuse: a tier's blocks are reused only where bringing them back beats recomputing them."""

from __future__ import annotations

import pytest
import torch
from helpers import cached_in, random_tokens

from tiered_kv import KVLayout, TieredKVCache
from tiered_kv.cost_model import CostModel

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, tokens_per_block=16, dtype=torch.float16)
BLOCK = LAYOUT.bytes_per_block  # 4 KiB


async def test_a_slow_file_tier_is_skipped_for_a_short_prefix_and_used_for_a_long_one(tmp_path):
    # file: 4 KiB per block at 1 MB/s = 4.1 ms per block of 16 tokens; prefill: 10 us per token = 0.16 ms per block
    async with TieredKVCache(
        LAYOUT, gpu_blocks=64, host_blocks=64, file_blocks=64, file_dir=tmp_path, device="cpu"
    ) as cache:
        cost = CostModel(cache, prefill_tokens_per_s=100_000, bandwidth={"file": 1e6}).attach()
        prompt = random_tokens(1, 160)
        await cached_in(cache, prompt, "file")
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
    async with TieredKVCache(
        LAYOUT, gpu_blocks=64, host_blocks=64, file_blocks=64, file_dir=tmp_path, device="cpu"
    ) as cache:
        head = random_tokens(2, 64)
        await cached_in(cache, head + random_tokens(3, 96), "file")
        await cached_in(cache, head + random_tokens(4, 16), "gpu")  # the first 4 blocks are on the GPU again
        cost = CostModel(cache, prefill_tokens_per_s=100_000, bandwidth={"file": 1e6}).attach()
        prompt = head + random_tokens(3, 96) + [9]
        assert cache.match(prompt)[1] == {"gpu": 4, "host": 0, "file": 6}
        [adm] = await cache.add_sequences([prompt])
        assert adm.tokens_reused == 64 and adm.blocks_from == {"gpu": 4, "host": 0, "file": 0}
        assert cost.statistics().skipped_blocks == {"file": 6}
        cache.free(adm.seq_id)
        cache.blocks.check()


async def test_per_byte_costs_are_fitted_from_admissions_and_unknowns_reuse(tmp_path):
    async with TieredKVCache(
        LAYOUT, gpu_blocks=64, host_blocks=64, file_blocks=64, file_dir=tmp_path, device="cpu"
    ) as cache:
        cost = CostModel(cache).attach()
        assert cost.bandwidth("file") is None and cost.prefill_seconds_per_token() is None
        prompt = random_tokens(5, 160)
        await cached_in(cache, prompt, "file")
        [adm] = await cache.add_sequences([[*prompt, 1]])  # nothing known yet: everything matched is reused
        assert adm.tokens_reused == 160 and cost.statistics().decisions == 0
        cache.free(adm.seq_id)
        # admissions: 5 ms each (evictions, bookkeeping) + 2 ns per host byte + 100 ns per file byte
        for host, file in (
            (0, 0),
            (4096, 0),
            (0, 8192),
            (40960, 4096),
            (8192, 40960),
            (0, 4096),
            (81920, 0),
            (4096, 4096),
        ):
            cost.observe_admission({"host": host, "file": file}, 0.005 + 2e-9 * host + 1e-7 * file)
        assert cost.bandwidth("host") == pytest.approx(5e8, rel=1e-6)
        # the 5 ms every admission pays are not the file's
        assert cost.bandwidth("file") == pytest.approx(1e7, rel=1e-6)
        cost.observe_prefill(1000, 0.01)  # 10 us per token: 0.16 ms per block, against 0.41 ms to read one
        await cached_in(cache, prompt, "file")
        [adm] = await cache.add_sequences([[*prompt, 2]])
        assert adm.tokens_reused == 0 and cost.statistics().skipped_blocks == {"file": 10}
        cache.free(adm.seq_id)


async def test_a_small_estimated_gain_does_not_skip_blocks(tmp_path):
    async with TieredKVCache(
        LAYOUT, gpu_blocks=64, host_blocks=64, file_blocks=64, file_dir=tmp_path, device="cpu"
    ) as cache:
        prompt = random_tokens(6, 160)
        # reading 10 file blocks: 1.93 ms + 3 tokens; recomputing 163 tokens: 1.63 ms -- 1.2x, inside the margin
        for margin, reused in ((1.5, 160), (1.0, 0)):
            await cached_in(cache, prompt, "file")
            CostModel(
                cache, prefill_tokens_per_s=100_000, bandwidth={"file": 10 * BLOCK / 1.93e-3}, margin=margin
            ).attach()
            [adm] = await cache.add_sequences([[*prompt, 7]])
            assert adm.tokens_reused == reused, margin
            cache.free(adm.seq_id)


async def test_bad_rates_are_refused():
    async with TieredKVCache(LAYOUT, gpu_blocks=4, device="cpu") as cache:
        with pytest.raises(ValueError, match="prefill_tokens_per_s"):
            CostModel(cache, prefill_tokens_per_s=0)
        with pytest.raises(ValueError, match="bandwidth"):
            CostModel(cache, bandwidth={"gpu": 1e9})
        with pytest.raises(ValueError, match="bandwidth"):
            CostModel(cache, bandwidth={"file": -1})
        with pytest.raises(ValueError, match="margin"):
            CostModel(cache, margin=0.5)
