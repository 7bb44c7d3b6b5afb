"""Warm restart of the cache's lookup from the file tier's index (issue 5's open item)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tiered_kv import KVLayout, TieredKVCache
from tiered_kv.errors import LayoutMismatchError
from tiered_kv.pools import Tier
from tiered_kv.tools.workload import ChatWorkload, replay

TPB = 4


@pytest.fixture
def small() -> KVLayout:
    return KVLayout(num_layers=2, num_kv_heads=1, head_dim=8, tokens_per_block=TPB, dtype=torch.float16)


def workload() -> ChatWorkload:
    return ChatWorkload(seed=5, conversations=12, system_prompts=2, system_tokens=16, turns=(2, 3),
                        user_tokens=(4, 12), output_tokens=(4, 12), vocab=500)


def _order_writes(cache):
    """On CUDA, the offloads of blocks written on the current stream must wait for those writes."""
    if cache.engine.device.is_cuda:
        cache.engine.sync_with_compute(torch.cuda.current_stream())


async def run(layout, directory, *, model_id="m", warm_restart=True, file=96, device="cpu"):
    async with TieredKVCache(layout, gpu_blocks=32, host_blocks=8, file_blocks=file, file_dir=directory,
                             device=device, model_id=model_id, warm_restart=warm_restart) as cache:
        report = await replay(cache, workload())
        cache.blocks.check()
        stats = cache.statistics()
        indexed = len(cache.engine.file_tier.entries())
    return report, stats, indexed


async def test_reopened_cache_finds_prefixes_in_the_file_tier(small, tmp_path, device):
    first, stats1, indexed = await run(small, tmp_path, device=device)
    assert stats1.blocks.adopted == 0 and indexed > 0  # the first run spilled blocks and found none to adopt
    second, stats2, _ = await run(small, tmp_path, device=device)
    assert second.mismatched_tokens == 0 and second.verified_tokens == second.reused_tokens
    assert stats2.blocks.adopted > 0
    assert second.hits["file"] > first.hits["file"]
    assert second.reused_tokens > first.reused_tokens


async def test_without_warm_restart_the_old_blocks_are_not_found(small, tmp_path):
    first, _, _ = await run(small, tmp_path)
    cold, stats, _ = await run(small, tmp_path, warm_restart=False)
    assert stats.blocks.adopted == 0
    assert cold.hits["file"] == first.hits["file"]  # the same run from scratch: only its own spills
    assert cold.mismatched_tokens == 0


async def test_another_model_never_matches(small, tmp_path):
    first, _, _ = await run(small, tmp_path, model_id="m")
    other, stats, _ = await run(small, tmp_path, model_id="other")
    assert stats.blocks.adopted == 0
    assert other.hits["file"] == first.hits["file"] and other.mismatched_tokens == 0


async def test_another_layout_is_refused(small, tmp_path):
    await run(small, tmp_path)
    wider = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, tokens_per_block=TPB, dtype=torch.float16)
    with pytest.raises(LayoutMismatchError):
        TieredKVCache(
            wider, gpu_blocks=16, host_blocks=8, file_blocks=96, file_dir=tmp_path, device="cpu", model_id="m"
        )


async def test_adopted_block_is_served_from_its_slot_and_verified(small, tmp_path, device):
    prompt = np.arange(3 * TPB + 1, dtype=np.int64)
    async with TieredKVCache(
        small, gpu_blocks=4, host_blocks=4, file_blocks=8, file_dir=tmp_path, device=device
    ) as cache:
        [adm] = await cache.add_sequences([prompt])
        for b in cache.blocks.sequence_blocks(adm.seq_id):
            cache.engine.block(Tier.GPU, b.slot).fill_(float(b.tokens[0]))
        _order_writes(cache)
        cache.commit(adm.seq_id)
        cache.free(adm.seq_id)
        for tier in (Tier.GPU, Tier.HOST):
            await cache.evict(tier, 4)
        assert len(cache.engine.file_tier.entries()) == 4  # 3 full blocks + the 1-token tail (partial key)
    async with TieredKVCache(
        small, gpu_blocks=4, host_blocks=4, file_blocks=8, file_dir=tmp_path, device=device
    ) as cache:
        reused, by_tier = cache.match(prompt)
        assert reused == 3 * TPB and by_tier["file"] == 3
        assert cache.blocks.statistics().adopted == 3
        cache.blocks.check()
        [adm] = await cache.add_sequences([prompt])
        assert adm.blocks_from["file"] == 3
        for i, b in enumerate(cache.blocks.sequence_blocks(adm.seq_id)[:3]):
            assert (cache.engine.block(Tier.GPU, b.slot) == float(i * TPB)).all()
        cache.free(adm.seq_id)
        cache.blocks.check()


def _overwrite(path, offset, data):
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


async def test_corrupt_adopted_block_is_never_served(small, tmp_path):
    from tiered_kv.errors import TransferError
    from tiered_kv.slab import HEADER_SIZE

    prompt = np.arange(3 * TPB + 1, dtype=np.int64)
    async with TieredKVCache(
        small, gpu_blocks=4, host_blocks=4, file_blocks=8, file_dir=tmp_path, device="cpu"
    ) as cache:
        [adm] = await cache.add_sequences([prompt])
        for b in cache.blocks.sequence_blocks(adm.seq_id):
            cache.engine.block(Tier.GPU, b.slot).fill_(float(b.tokens[0]) + 1)
        cache.commit(adm.seq_id)
        cache.free(adm.seq_id)
        for tier in (Tier.GPU, Tier.HOST):
            await cache.evict(tier, 4)
        block = cache.blocks.lookup(cache.hasher.chain(prompt)[1])
        assert block is not None
        second = block.slot
        slot_size = cache.engine.file_tier.slot_size
    _overwrite(
        tmp_path / "kv.slab", HEADER_SIZE + second * slot_size + HEADER_SIZE + 8, b"\x00" * 16
    )  # tear its payload
    async with TieredKVCache(
        small, gpu_blocks=4, host_blocks=4, file_blocks=8, file_dir=tmp_path, device="cpu"
    ) as cache:
        with pytest.raises(TransferError):  # the read of the torn block fails verification: the batch fails
            await cache.add_sequences([prompt])
        assert cache.statistics().poisoned >= 1
        [adm] = await cache.add_sequences([prompt])  # retried: only the intact first block is reused
        assert adm.tokens_reused == TPB and adm.blocks_from["file"] == 1
        first = cache.blocks.sequence_blocks(adm.seq_id)[0]
        assert (cache.engine.block(Tier.GPU, first.slot) == 1.0).all()
        cache.free(adm.seq_id)
        cache.blocks.check()
