"""CostModel.split: how many leading blocks of a file-tier match to compute while the rest is loaded."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import cached_in, random_tokens

from tiered_kv import KVLayout, TieredKVCache
from tiered_kv.cost_model import CostModel

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, tokens_per_block=16, dtype=torch.float16)
BLOCK = LAYOUT.bytes_per_block  # 4 KiB
ONE_MS_PER_BLOCK = BLOCK * 1000.0  # bytes per second: a block loads in 1 ms


def _cache(tmp_path: Path) -> TieredKVCache:
    return TieredKVCache(LAYOUT, gpu_blocks=64, host_blocks=64, file_blocks=64, file_dir=tmp_path, device="cpu")


@pytest.mark.parametrize(("compute_ms_per_block", "expect"), [(1.0, 6), (3.0, 3), (1 / 3, 9)])
async def test_the_split_balances_computing_the_head_against_loading_the_tail(
    tmp_path: Path, compute_ms_per_block: float, expect: int
) -> None:
    """12 file blocks at 1 ms each: computing a block in the same time splits 6/6; 3x slower computes 3, 9 loaded."""
    prompt = random_tokens(1, 12 * 16 + 5)
    async with _cache(tmp_path) as cache:
        await cached_in(cache, prompt[:-5], "file")
        cost = CostModel(
            cache, prefill_tokens_per_s=16_000 / compute_ms_per_block, bandwidth={"file": ONE_MS_PER_BLOCK}
        )
        match = cache.blocks.match(prompt)
        assert match.by_tier["file"] == 12
        c = cost.split(match, len(prompt))
        assert c == expect
        s = cost.statistics()
        assert s.hybrid_decisions == 1 and s.hybrid_splits == 1 and s.hybrid_recomputed == 0
        assert s.hybrid_blocks_computed == expect
        # against loading all 12 blocks (12 ms) before the last 5 tokens: the split saves 12 ms - max(both halves)
        assert s.hybrid_saved_s == pytest.approx(12e-3 - max(expect * compute_ms_per_block, 12 - expect) * 1e-3)


async def test_a_hopeless_disk_recomputes_the_whole_match_and_a_fast_one_loads_it(tmp_path: Path) -> None:
    prompt = random_tokens(2, 10 * 16 + 3)
    async with _cache(tmp_path) as cache:
        await cached_in(cache, prompt[:-3], "file")
        match = cache.blocks.match(prompt)
        slow = CostModel(cache, prefill_tokens_per_s=16_000, bandwidth={"file": 1e3})  # 4 s a block
        assert slow.split(match, len(prompt)) == 10
        assert slow.statistics().hybrid_recomputed == 1
        fast = CostModel(cache, prefill_tokens_per_s=16_000, bandwidth={"file": 1e12})
        assert fast.split(match, len(prompt)) == 0
        assert fast.statistics().hybrid_decisions == 1 and fast.statistics().hybrid_splits == 0


async def test_unknown_rates_compute_nothing(tmp_path: Path) -> None:
    prompt = random_tokens(3, 8 * 16 + 1)
    async with _cache(tmp_path) as cache:
        await cached_in(cache, prompt[:-1], "file")
        match = cache.blocks.match(prompt)
        nothing_known = CostModel(cache)
        assert nothing_known.split(match, len(prompt)) == 0
        assert nothing_known.statistics().hybrid_decisions == 0
        only_prefill = CostModel(cache)  # the model's speed measured, the file tier not yet: loading is free
        only_prefill.observe_prefill(100, 0.01)
        assert only_prefill.split(match, len(prompt)) == 0
        only_disk = CostModel(cache, bandwidth={"file": 1e3})
        assert only_disk.split(match, len(prompt)) == 0


@pytest.mark.parametrize("tier", ["gpu", "host"])
async def test_a_match_led_by_a_gpu_or_host_block_is_not_split(tmp_path: Path, tier: str) -> None:
    prompt = random_tokens(4, 8 * 16 + 1)
    async with _cache(tmp_path) as cache:
        await cached_in(cache, prompt[:-1], tier)
        match = cache.blocks.match(prompt)
        assert match.by_tier[tier] == 8
        cost = CostModel(cache, prefill_tokens_per_s=16_000, bandwidth={"host": 1e3, "file": 1e3})
        assert cost.split(match, len(prompt)) == 0
        assert cost.statistics().hybrid_decisions == 0


async def test_fitted_rates_and_the_forward_overhead_drive_the_split(tmp_path: Path) -> None:
    """Fitted, not given: prefill 1 ms per block + 2 ms per forward, the file tier 1 ms per block."""
    prompt = random_tokens(5, 12 * 16 + 5)
    async with _cache(tmp_path) as cache:
        await cached_in(cache, prompt[:-5], "file")
        cost = CostModel(cache)
        for tokens in (16, 64, 160, 320):
            cost.observe_prefill(tokens, 2e-3 + tokens / 16_000)
        for blocks in range(1, 10):
            cost.observe_admission({"file": blocks * BLOCK}, 0.5e-3 + blocks * 1e-3)
        assert cost.prefill_seconds_per_token() == pytest.approx(1 / 16_000)
        assert cost.prefill_overhead_seconds() == pytest.approx(2e-3)
        assert cost.bandwidth("file") == pytest.approx(ONE_MS_PER_BLOCK)
        # max(2 + c, 12 - c) is least at c = 5 (7 ms against 12 ms loading everything)
        assert cost.split(cache.blocks.match(prompt), len(prompt)) == 5
        assert cost.statistics().prefill_overhead_s == pytest.approx(2e-3)


async def test_an_admission_with_the_split_loads_only_the_tail(tmp_path: Path) -> None:
    prompt = random_tokens(6, 12 * 16 + 5)
    async with _cache(tmp_path) as cache:
        await cached_in(cache, prompt[:-5], "file")
        cost = CostModel(cache, prefill_tokens_per_s=16_000, bandwidth={"file": ONE_MS_PER_BLOCK})
        from tiered_kv import Request

        c = cost.split(cache.blocks.match(prompt), len(prompt))
        [adm] = await cache.add_sequences([Request(prompt, compute_blocks=c)])
        assert adm.tokens_computed_first == 6 * 16 and adm.tokens_reused == 6 * 16
        assert adm.blocks_from["file"] == 6
        cache.free(adm.seq_id)
        cache.blocks.check()
        assert cache.blocks.match(prompt).by_tier["file"] == 6  # the computed head's cached copies stayed there


def _true_forward(tokens: int, past: int) -> float:
    """A model whose attention matters: 2 ms a forward, 1 ms a block of 16 tokens, 1 us per query-key pair."""
    return 2e-3 + tokens / 16_000 + 1e-6 * (tokens * past + tokens * tokens / 2)


def test_the_forward_fit_prices_attention_over_the_prompt_and_over_the_past() -> None:
    cost = CostModel(None)  # type: ignore[arg-type]  # the fit alone: no cache needed
    assert cost.prefill_seconds(100) is None
    for tokens, past in ((16, 0), (64, 0), (128, 0), (192, 0), (5, 192), (5, 64), (32, 128)):
        cost.observe_prefill(tokens, _true_forward(tokens, past), past=past)
    for tokens, past in ((192, 0), (5, 192), (1000, 0), (3, 4000)):
        assert cost.prefill_seconds(tokens, past) == pytest.approx(_true_forward(tokens, past), rel=1e-6)
    assert cost.prefill_overhead_seconds() == pytest.approx(2e-3) and cost.prefill_seconds_per_token() == pytest.approx(
        1 / 16_000
    )
    batched = CostModel(None)  # type: ignore[arg-type]
    for rows in (1, 2, 4):  # a batch of rows: each row attends over its own past and its own tokens
        batched.observe_prefill(8 * rows, rows * (_true_forward(8, 100) - 2e-3) + 2e-3, past=100, rows=rows)
        batched.observe_prefill(16 * rows, rows * (_true_forward(16, 0) - 2e-3) + 2e-3, past=0, rows=rows)
    assert batched.prefill_seconds(8, 100) == pytest.approx(_true_forward(8, 100), rel=1e-6)


async def test_the_split_uses_the_attention_cost_of_the_head_and_of_the_forward_after_the_match(
    tmp_path: Path,
) -> None:
    """Fitted from forwards of a model whose attention matters: the split is the true optimum, not a linear fit's."""
    prompt = random_tokens(7, 12 * 16 + 5)
    async with _cache(tmp_path) as cache:
        await cached_in(cache, prompt[:-5], "file")
        cost = CostModel(cache, bandwidth={"file": ONE_MS_PER_BLOCK / 2})  # a block loads in 2 ms
        for tokens, past in ((16, 0), (48, 0), (96, 0), (192, 0), (5, 192), (5, 96), (32, 64)):
            cost.observe_prefill(tokens, _true_forward(tokens, past), past=past)
        m, n = 12, len(prompt)

        def ttft(c: int) -> float:
            if c == m:
                return _true_forward(n, 0)
            head = _true_forward(c * 16, 0) if c else 0.0
            return max(head, (m - c) * 2e-3) + _true_forward(n - m * 16, m * 16)

        best = min(range(m + 1), key=lambda c: (ttft(c), c))
        assert best == 6  # a linear fit of the same forwards picks 5 (9 % slower)
        assert cost.split(cache.blocks.match(prompt), n) == best


def test_a_warm_up_forward_far_off_the_rest_does_not_set_the_forward_fit() -> None:
    """A process's first forwards (kernels loaded and tuned: ~1 s for 64 tokens on the GPU machine) are not rates.

    With them in a plain least-squares fit the fixed cost of a forward came out at 0.2 s and its marginal rate at 0,
    so every head of a hybrid prefill looked as slow as a whole recompute (seen on an H200 at 8k tokens).
    """

    def forward(tokens: int, past: int) -> float:  # 8B-like: 2 ms a forward, 16k tokens/s, little attention
        return 2e-3 + tokens / 16_000 + 1e-9 * (tokens * past + tokens * tokens / 2)

    cost = CostModel(None)  # type: ignore[arg-type]  # the fit alone: no cache needed
    cost.observe_prefill(64, 1.2)  # the first forward of the process
    cost.observe_prefill(32, 1.0, past=1024)  # the first forward after a past
    for tokens, past in ((1056, 0), (32, 1024), (2080, 0), (32, 2048), (4128, 0), (32, 4096), (8224, 0), (32, 8192)):
        for _ in range(2):
            cost.observe_prefill(tokens, forward(tokens, past), past=past)
    assert cost.prefill_overhead_seconds() == pytest.approx(2e-3, abs=1e-4)
    assert cost.prefill_seconds_per_token() == pytest.approx(1 / 16_000, rel=0.02)
    for tokens, past in ((4096, 0), (32, 8192)):
        assert cost.prefill_seconds(tokens, past) == pytest.approx(forward(tokens, past), rel=0.02)
