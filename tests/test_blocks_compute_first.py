"""BlockManager: ``Request.compute_blocks`` (hybrid prefill) -- fresh private leading blocks, the rest reused."""

from __future__ import annotations

import pytest
import torch

from tiered_kv import KVLayout, Tier
from tiered_kv.blocks import BlockManager, CacheFullError, Request
from tiered_kv.keys import KeyHasher

TPB = 4
LAYOUT = KVLayout(num_layers=1, num_kv_heads=1, head_dim=4, tokens_per_block=TPB, dtype=torch.float16)
PREFIX = list(range(24))  # 6 blocks


def manager(**caps: int) -> BlockManager:
    return BlockManager(KeyHasher(LAYOUT, "m"), caps, max_seqs=4, compute_last_token=True)


def in_file(bm: BlockManager, tokens: list[int]) -> list[int]:
    """Admit, commit and free ``tokens``, then evict everything down to the file tier; the block ids, in order."""
    [a], _ = bm.admit([Request(tokens)])
    bm.commit(a.seq_id)
    ids = [b.id for b in bm.sequence_blocks(a.seq_id)]
    bm.free(a.seq_id)
    bm.evict(Tier.GPU, bm.capacity[Tier.GPU])
    bm.evict(Tier.HOST, bm.capacity[Tier.HOST])
    bm.check()
    return ids


def test_leading_blocks_get_fresh_private_gpu_blocks_and_the_rest_is_onboarded() -> None:
    bm = manager(gpu=16, host=8, file=16)
    original = in_file(bm, PREFIX)
    prompt = [*PREFIX, 100, 101, 102]
    assert len(bm.match(prompt).blocks) == 6 and bm.match(prompt).by_tier["file"] == 6
    [a], plan = bm.admit([Request(prompt, compute_blocks=2)])
    bm.check()
    assert a.tokens_computed_first == 8
    assert a.tokens_reused == 16 and a.blocks_from == {"gpu": 0, "host": 0, "file": 4}
    assert a.tokens_to_compute == 27 - 16
    assert a.blocks_allocated == 2 + 1  # the fresh leading blocks and the block of the new tokens
    onboards = [m for m in plan.moves if m.kind == "onboard"]
    assert [m.block.id for m in onboards] == original[2:6]  # only the later blocks are read from the file tier
    blocks = bm.sequence_blocks(a.seq_id)
    fresh, loaded = blocks[:2], blocks[2:6]
    assert all(b.id not in original and b.tier is Tier.GPU and not b.cached and b.key is None for b in fresh)
    assert [b.id for b in loaded] == original[2:6] and all(b.refcount == 1 for b in loaded)
    # the cached copies of the computed blocks stay in the file tier, unclaimed and matchable
    leading = bm.match(prompt).blocks[:2]
    assert [b.id for b in leading] == original[:2]
    assert all(b.tier is Tier.FILE and b.refcount == 0 and b.cached for b in leading)
    assert bm.committed_tokens(a.seq_id) == 24
    stats = bm.statistics()
    assert stats.hits["file"] == 4 and stats.tokens_reused == 16


def test_commit_and_free_never_register_the_fresh_blocks_and_a_second_request_matches_the_originals() -> None:
    bm = manager(gpu=16, host=8, file=16)
    original = in_file(bm, PREFIX)
    prompt = [*PREFIX, 100, 101, 102, 103, 104, 105]  # 7 full blocks, a partial tail of 2
    [a], _ = bm.admit([Request(prompt, compute_blocks=3)])
    fresh = [b.id for b in bm.sequence_blocks(a.seq_id)[:3]]
    bm.commit(a.seq_id)  # the new full block and the 2 tokens of the tail
    bm.check()
    cached_ids = {b.id for b in bm.cached_blocks()}
    assert not cached_ids & set(fresh)
    assert set(original) <= cached_ids
    bm.free(a.seq_id)
    bm.check()
    assert not {b.id for b in bm.cached_blocks()} & set(fresh)
    # a second request matches the original blocks (the first ones still in the file tier), the new block after them
    again = bm.match([*prompt, 7])
    assert [b.id for b in again.blocks[:6]] == original
    assert [b.tier for b in again.blocks[:3]] == [Tier.FILE] * 3
    assert len(again.blocks) == 7 and again.partial is not None and again.partial[1] == 2
    [b], _ = bm.admit([[*prompt, 7]])
    assert [x.id for x in bm.sequence_blocks(b.seq_id)[:6]] == original
    bm.free(b.seq_id)
    bm.check()


def test_computing_every_matched_block_drops_the_partial_and_reuses_nothing() -> None:
    bm = manager(gpu=16, host=8, file=16)
    [a], _ = bm.admit([Request(list(range(10)))])  # 2 full blocks + 2 tokens
    bm.commit(a.seq_id)
    bm.free(a.seq_id)
    prompt = [*list(range(10)), 50, 51]
    assert bm.match(prompt).partial is not None
    [b], plan = bm.admit([Request(prompt, compute_blocks=99)])  # more than matched: all of them
    bm.check()
    assert b.tokens_computed_first == 8 and b.tokens_reused == 0 and b.partial_tokens == 0
    assert b.blocks_from == {"gpu": 0, "host": 0, "file": 0}
    assert [m.kind for m in plan.moves if m.kind in ("onboard", "partial")] == []
    assert all(x.refcount == 0 for x in bm.match(prompt).blocks)  # nothing claimed
    bm.free(b.seq_id)
    bm.check()


def test_the_fit_check_counts_fresh_blocks_and_not_the_unclaimed_ones() -> None:
    bm = manager(gpu=7, host=8, file=16)
    in_file(bm, PREFIX)  # 6 blocks in the file tier, GPU empty
    assert bm.match([*PREFIX, 1]).by_tier["file"] == 6
    prompt = [*PREFIX, 100, 101, 102]  # 7 GPU blocks whatever the split
    [a], _ = bm.admit([Request(prompt, compute_blocks=3)])
    assert len(bm.page_table(a.seq_id)) == 7
    bm.check()
    # the same prefix again: blocks 3..5 are on the GPU (shared), 3 fresh + 1 new are needed and none is free
    with pytest.raises(CacheFullError, match="needs 4 GPU blocks but at most 0"):
        bm.admit([Request([*PREFIX, 200, 201, 202], compute_blocks=3)])
    bm.check()
    bm.free(a.seq_id)
    bm.check()
    # the 3 fresh blocks and the uncommitted new block are freed; the 3 loaded ones stay cached (evictable)
    assert bm.free_blocks(Tier.GPU) == 4 and bm.evictable_blocks(Tier.GPU) == 3


@pytest.mark.parametrize(("value", "error"), [(-1, ValueError), (1.5, TypeError), (True, TypeError), ("2", TypeError)])
def test_a_bad_compute_blocks_is_refused_before_anything_changes(value: object, error: type[Exception]) -> None:
    bm = manager(gpu=16, host=8, file=16)
    in_file(bm, PREFIX)
    before = bm.statistics()
    with pytest.raises(error, match="compute_blocks"):
        bm.admit([Request([*PREFIX, 1]), Request([*PREFIX, 2], compute_blocks=value)])  # type: ignore[arg-type]
    assert bm.statistics() == before
    bm.check()


def test_a_batch_where_another_request_claims_the_computed_blocks() -> None:
    bm = manager(gpu=20, host=8, file=16)
    original = in_file(bm, PREFIX)
    adms, _ = bm.admit([Request([*PREFIX, 1, 2], compute_blocks=4), Request([*PREFIX, 3, 4])])
    bm.check()
    first, second = (bm.sequence_blocks(a.seq_id) for a in adms)
    assert [b.id for b in second[:6]] == original  # the plain request claims all of them
    assert [b.id for b in first[4:6]] == original[4:6] and not {b.id for b in first[:4]} & set(original)
    assert [b.refcount for b in second[:6]] == [1, 1, 1, 1, 2, 2]
    for a in adms:
        bm.free(a.seq_id)
    bm.check()


def test_fresh_blocks_stay_private_even_when_the_cached_copies_leave_the_lookup() -> None:
    """The originals are dropped while the sequence lives: committing it must still not register its fresh blocks."""
    bm = manager(gpu=16, host=8, file=16)
    in_file(bm, PREFIX)
    prompt = [*PREFIX, 100, 101, 102]
    [a], _ = bm.admit([Request(prompt, compute_blocks=2)])
    fresh = bm.sequence_blocks(a.seq_id)[:2]
    bm.refuse(bm.match(prompt).blocks[0])  # the first original leaves the lookup, its subtree with it
    assert bm.match(prompt).tokens_reused == 0
    bm.commit(a.seq_id)
    bm.check()
    assert not any(b.cached for b in fresh)
    assert bm.match(prompt).tokens_reused == 0  # nothing of this sequence's head is matchable
    bm.free(a.seq_id)
    bm.check()
