"""BlockManager alone (synchronous bookkeeping, no engine): reachability and eviction edge cases."""

from __future__ import annotations

import pytest
import torch

from tiered_kv import KVLayout, Tier
from tiered_kv.blocks import BlockManager, CacheFullError, Request
from tiered_kv.keys import KeyHasher

TPB = 4
LAYOUT = KVLayout(num_layers=1, num_kv_heads=1, head_dim=4, tokens_per_block=TPB, dtype=torch.float16)


def manager(**caps: int) -> BlockManager:
    return BlockManager(KeyHasher(LAYOUT, "m"), caps, max_seqs=4, compute_last_token=False)


def seen(bm: BlockManager, tokens: list[int], priority: int = 50, commit: int | None = None) -> None:
    [a], _ = bm.admit([Request(tokens, priority)])
    bm.commit(a.seq_id, commit)
    bm.free(a.seq_id)
    bm.check()


def test_gpu_victim_whose_parent_is_dropped_from_host_is_detached() -> None:
    """Evicting P1 needs a host slot; the host's victim is P1's own parent P0, dropped: P1 must go too."""
    bm = manager(gpu=3, host=1)
    seen(bm, list(range(8)))  # P0, P1
    seen(bm, [0, 1, 2, 3, 100], priority=10, commit=4)  # P0 now has priority 10: evicted before P1
    plan = bm.evict(Tier.GPU, 1)
    assert [m.kind for m in plan.moves] == ["offload"]  # P0 to the host
    assert bm.match(list(range(8))).by_tier == {"gpu": 1, "host": 1, "file": 0}  # P0 on the host, P1 on the GPU
    plan = bm.evict(Tier.GPU, 1)  # P1: its host target is P0's slot; P0 dropped, so P1 is unreachable
    bm.check()
    assert plan.moves == []
    assert bm.match(list(range(8))).tokens_reused == 0
    s = bm.statistics()
    assert s.evictions == {"gpu->host": 1, "host->dropped": 1, "gpu->dropped": 1}
    assert s.free == {"gpu": 3, "host": 1, "file": 0}


def test_dropping_a_parent_drops_unused_descendants_in_other_tiers() -> None:
    bm = manager(gpu=4, host=2)
    seen(bm, list(range(12)))  # P0 P1 P2 on the GPU
    bm.evict(Tier.GPU, 2)  # P2, P1 to the host (released last-to-first: P2 oldest)
    seen(bm, list(range(200, 216)))  # 4 new blocks: evicts P0 to the host, whose victim (P2) is dropped
    bm.check()
    seen(bm, list(range(300, 316)))
    bm.check()
    assert bm.match(list(range(12))).tokens_reused < 12
    assert len(list(bm.cached_blocks())) <= 6


def test_refused_batch_changes_nothing() -> None:
    bm = manager(gpu=4, host=2)
    seen(bm, list(range(8)))
    before = bm.statistics()
    with pytest.raises(CacheFullError):
        bm.admit([list(range(8)) + [9] * 8, list(range(50, 58))])
    assert bm.statistics() == before
    bm.check()


def test_partial_blocks_never_match_as_full_blocks() -> None:
    bm = manager(gpu=8)
    seen(bm, list(range(6)))  # P0 full + a cached partial block [4, 5]
    m = bm.match([0, 1, 2, 3, 4, 5, 6, 7, 8])
    assert len(m.blocks) == 1 and m.partial is not None and m.partial[1] == 2
    assert m.tokens_reused == 6


@pytest.mark.parametrize("step", [1, 3, 64])
def test_a_prefix_moved_down_and_back_is_a_run_of_consecutive_slots_on_both_sides(step: int) -> None:
    """A chain evicted down the tiers lands in ascending consecutive slots and comes back as one run.

    Eviction takes a chain's last block first and the tiers below fill from their highest slot, whatever the batch size
    of the evictions. A run is one 2-D copy; a prefix in descending slots cost a copy descriptor per block and group.
    """
    bm = manager(gpu=24, host=24, file=24)
    prompt = list(range(16 * TPB))  # 16 blocks
    seen(bm, list(range(1000, 1000 + 3 * TPB)))  # something released earlier, evicted first
    seen(bm, prompt)
    for tier in (Tier.GPU, Tier.HOST):
        while bm.evictable_blocks(tier):
            bm.evict(tier, step)
    bm.check()
    [a], plan = bm.admit([Request(prompt, 50)])
    onboards = [m for m in plan.moves if m.kind == "onboard"]
    assert [m.src_tier for m in onboards] == [Tier.FILE] * 16
    for side in ([m.src_slot for m in onboards], [m.dst_slot for m in onboards]):
        assert side == list(range(side[0], side[0] + 16)), side
    bm.free(a.seq_id)
    bm.check()
