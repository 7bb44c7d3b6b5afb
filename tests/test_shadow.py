"""The issue-order model (tiered_kv.tools.shadow): silent on a correct run, and it names what broke the order."""

from __future__ import annotations

import asyncio
import logging

import pytest
import torch

from tiered_kv import Tier, TieredKVCache
from tiered_kv.layout import KVLayout
from tiered_kv.testing import stall
from tiered_kv.tools.shadow import Shadow
from tiered_kv.tools.stress import StressConfig, stress
from tiered_kv.tools.workload import expected_tokens

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, tokens_per_block=4, dtype=torch.float32)


@pytest.fixture(autouse=True)
def _quiet_injected_faults(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.CRITICAL, logger="tiered_kv")


async def test_a_correct_run_has_no_mismatch(capsys: pytest.CaptureFixture[str]) -> None:
    """The stress with the model on: every copy checked, 0 mismatches (file faults and cancellations included)."""
    report = await stress(StressConfig(seed=11, seconds=3.0, shadow=True))
    assert report.wrong_tokens == 0 and report.shadow_mismatches == 0, capsys.readouterr().out[-3000:]
    assert report.verified_tokens > 1_000 and report.faults > 0


def _write(cache: TieredKVCache, shadow: Shadow, seq_id: int, content_of: int | None = None) -> list[int]:
    """Play the model for every token of ``seq_id`` (the KV of ``content_of``'s tokens if given); returns its slots."""
    pool = cache.engine.pool(Tier.GPU).tensor
    tokens = cache.blocks.sequence_tokens(seq_id)
    source = tokens if content_of is None else cache.blocks.sequence_tokens(content_of)
    slots = list(cache.page_table(seq_id))
    for b, slot in enumerate(slots):
        content = expected_tokens(cache.hasher, source, b * 4, min(len(tokens), b * 4 + 4))
        pool[slot, :, :, :, : content.shape[3]] = content
        shadow.wrote(slot, 0, content)
    return slots


async def test_a_write_that_overtakes_a_pending_offload_is_named() -> None:
    """A model write into a block that an offload has not read yet: the offload's host copy is reported, with the
    write that got there first marked as issued after the copy."""
    reports: list[str] = []
    async with TieredKVCache(LAYOUT, gpu_blocks=4, host_blocks=4, device="cpu", integrity=False) as cache:
        shadow = Shadow(cache, reports.append)
        [adm] = await cache.add_sequences([list(range(1, 9))])
        slots = _write(cache, shadow, adm.seq_id)
        cache.commit(adm.seq_id)
        cache.free(adm.seq_id)
        stall(cache.engine.stream("offload"), 0.3)
        evicting = asyncio.ensure_future(cache.evict(Tier.GPU, 2))
        await asyncio.sleep(0.05)  # the offloads are issued and wait behind the stall
        # breaking the cache's contract on purpose: the model writes a block an offload still has to read
        pool = cache.engine.pool(Tier.GPU).tensor
        garbage = torch.full_like(pool[slots[0]], 7.0)
        pool[slots[0]] = garbage
        shadow.wrote(slots[0], 0, garbage)
        await evicting
    assert shadow.mismatches == 1, reports
    assert "differ from the issue-order model" in reports[0]
    assert "(issued AFTER the copy); holds the bytes found in tokens [0, 1, 2, 3]" in reports[0]


async def test_a_write_that_did_not_land_is_named() -> None:
    """``landed`` after the synchronize ending a write: tokens not in the pool are reported."""
    reports: list[str] = []
    async with TieredKVCache(LAYOUT, gpu_blocks=4, host_blocks=4, device="cpu", integrity=False) as cache:
        shadow = Shadow(cache, reports.append)
        [adm] = await cache.add_sequences([list(range(1, 6))])
        slot = cache.page_table(adm.seq_id)[1]
        cache.engine.pool(Tier.GPU).tensor[slot] = 0.0  # what the block held before
        content = expected_tokens(cache.hasher, cache.blocks.sequence_tokens(adm.seq_id), 4, 5)
        shadow.wrote(slot, 0, content)  # the model says it wrote token 4; the pool never got it
        shadow.landed([(slot, 0, content)])
        cache.free(adm.seq_id)
    assert shadow.mismatches == 1
    assert reports[0].startswith(f"SHADOW WRITE gpu[{slot}] tokens [0] are not in the pool")


async def test_guard_blocks_around_the_gpu_pool() -> None:
    """With guard blocks the run uses a pool inside a larger allocation; a byte written outside it fails the run."""
    from tiered_kv.tools.stress_diagnostics import Guards

    report = await stress(StressConfig(seed=12, seconds=1.0, guard_blocks=3))
    assert report.wrong_tokens == 0, report.failures
    config = StressConfig(guard_blocks=2)
    guards = Guards(config.layout, config.gpu_blocks, config.guard_blocks, config.device)
    counts: dict[str, int] = {"wrong": 0}
    failures: list[str] = []
    guards.check("nothing", counts, failures)
    assert counts["wrong"] == 0 and guards.pool.shape[0] == config.gpu_blocks
    guards.whole[config.gpu_blocks + 3, 1, 0, 0, 2, 5] = 1.0  # the second guard block after the pool
    guards.check("a stray write", counts, failures)
    assert counts["wrong"] == 1
    assert failures == ["after a stray write: guard blocks [1] after the GPU pool were written"]


async def test_bytes_changed_outside_any_copy_are_named_with_their_window() -> None:
    """The scan after a model write compares every slot no copy is writing: a block changed by nothing the cache
    issued (here: a stray store) is reported once, with the window since the last clean scan."""
    reports: list[str] = []
    async with TieredKVCache(LAYOUT, gpu_blocks=4, host_blocks=4, device="cpu", integrity=False) as cache:
        shadow = Shadow(cache, reports.append)
        [a, b] = await cache.add_sequences([list(range(1, 9)), list(range(20, 25))])
        [first, _] = _write(cache, shadow, a.seq_id)
        shadow.scan()
        assert shadow.scan_mismatches == 0 and not reports
        cache.engine.pool(Tier.GPU).tensor[first, :, :, :, 1:3] = 0.0  # a stray store, no copy, no model write
        written = _write(cache, shadow, b.seq_id)
        shadow.landed([(written[0], 0, expected_tokens(cache.hasher, cache.blocks.sequence_tokens(b.seq_id), 0, 4))])
        shadow.scan()  # reported once: the model took the device's bytes
        cache.free(a.seq_id)
        cache.free(b.seq_id)
    assert shadow.scan_mismatches == 1 and shadow.mismatches == 0, reports
    assert reports[0].startswith(f"SHADOW SCAN gpu[{first}] tokens [1, 2] changed outside any copy between ")
