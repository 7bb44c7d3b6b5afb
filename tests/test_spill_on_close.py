"""Spill on close: a restart on the same directory reuses the prefixes that lived in the GPU and host tiers."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from tiered_kv import KVLayout, TieredKVCache
from tiered_kv.pools import Tier

TPB = 4
PROMPTS = [np.arange(2 * TPB + 1, dtype=np.int64) + 1000 * i for i in range(10)]  # no shared prefix


@pytest.fixture
def small() -> KVLayout:
    return KVLayout(num_layers=2, num_kv_heads=1, head_dim=8, tokens_per_block=TPB, dtype=torch.float16)


def _cache(layout: KVLayout, directory: object, **kw: object) -> TieredKVCache:
    return TieredKVCache(layout, gpu_blocks=8, host_blocks=8, file_blocks=64, file_dir=directory,  # type: ignore[arg-type]
                         device="cpu", model_id="m", **kw)  # type: ignore[arg-type]


async def _first_run(layout: KVLayout, directory: object, **kw: object) -> tuple[dict[str, int], int]:
    """Ten prompts computed and committed, one after the other; where their blocks are at close."""
    async with _cache(layout, directory, **kw) as cache:
        for prompt in PROMPTS:
            [adm] = await cache.add_sequences([prompt])
            for b in cache.blocks.sequence_blocks(adm.seq_id):
                cache.engine.block(Tier.GPU, b.slot).fill_(float(b.tokens[0]))
            cache.commit(adm.seq_id)
            cache.free(adm.seq_id)
        cached = list(cache.blocks.cached_blocks())
        where = {t.value: sum(1 for b in cached if b.tier is t) for t in (Tier.GPU, Tier.HOST, Tier.FILE)}
    return where, cache.spilled_on_close


async def _reused(layout: KVLayout, directory: object) -> int:
    """Prompts of the first run whose every full block a new cache on the directory reuses, with the right KV."""
    full = 0
    async with _cache(layout, directory) as cache:
        for prompt in PROMPTS:
            reused, _ = cache.match(prompt)
            if reused != 2 * TPB:
                continue
            [adm] = await cache.add_sequences([prompt])
            assert adm.tokens_reused == 2 * TPB
            for b in cache.blocks.sequence_blocks(adm.seq_id)[:2]:
                assert (cache.engine.block(Tier.GPU, b.slot) == float(b.tokens[0])).all()
            cache.free(adm.seq_id)
            full += 1
    return full


async def test_spill_on_close_keeps_every_committed_prompt(small: KVLayout, tmp_path: Path) -> None:
    where, spilled = await _first_run(small, tmp_path)
    assert where["gpu"] + where["host"] > 0  # blocks lived in memory at close
    assert spilled == where["gpu"] + where["host"]
    assert await _reused(small, tmp_path) == 10


async def test_without_spill_on_close_only_the_file_tier_comes_back(small: KVLayout, tmp_path: Path) -> None:
    where, spilled = await _first_run(small, tmp_path, spill_on_close=False)
    assert spilled == 0 and where["gpu"] + where["host"] > 0
    assert await _reused(small, tmp_path) < 10  # what lived in GPU and host memory is gone


async def test_spill_on_close_never_overwrites_blocks_of_an_earlier_run(small: KVLayout, tmp_path: Path) -> None:
    await _first_run(small, tmp_path)
    async with _cache(small, tmp_path) as cache:  # adopts nothing, holds nothing in memory: no spill
        before = cache.engine.file_tier.entries()
    assert cache.spilled_on_close == 0
    async with _cache(small, tmp_path) as cache:
        assert cache.engine.file_tier.entries() == before
    assert await _reused(small, tmp_path) == 10


def test_spill_on_close_must_be_a_bool(small: KVLayout, tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="spill_on_close"):
        _cache(small, tmp_path, spill_on_close="yes")
