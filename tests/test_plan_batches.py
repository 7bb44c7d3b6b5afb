"""``batch_moves``: a plan's moves grouped into batched copies, every pair touching a common slot in plan order."""

from __future__ import annotations

import random

import pytest

from tiered_kv.blocks import Move
from tiered_kv.plan_batches import _no_conflicts, _place_each, batch_moves
from tiered_kv.pools import Tier

TIERS = (Tier.GPU, Tier.HOST, Tier.FILE)


def _moves(rng: random.Random, n: int, slots: int, one_direction: bool) -> list[Move]:
    src_tier, dst_tier = rng.choice(TIERS), rng.choice(TIERS)
    tokens = rng.choice([None, 3])
    out = []
    for _ in range(n):
        if not one_direction:
            src_tier, dst_tier = rng.choice(TIERS), rng.choice(TIERS)
        out.append(Move("onboard", src_tier, rng.randrange(slots), dst_tier, rng.randrange(slots), tokens, None))  # type: ignore[arg-type]
    return out


def _ordered(moves: list[Move], placed: list[int]) -> bool:
    """Every pair of moves touching a common slot (other than two reads) is in plan order across groups."""
    for i, a in enumerate(moves):
        for j in range(i + 1, len(moves)):
            b = moves[j]
            writes_a, writes_b = (a.dst_tier, a.dst_slot), (b.dst_tier, b.dst_slot)
            reads_a, reads_b = (a.src_tier, a.src_slot), (b.src_tier, b.src_slot)
            if (writes_a in (writes_b, reads_b) or reads_a == writes_b) and not placed[i] < placed[j]:
                return False
    return True


@pytest.mark.parametrize("seed", range(300))
def test_the_single_group_shortcut_gives_what_placing_each_move_gives(seed: int) -> None:
    rng = random.Random(seed)
    n = rng.randrange(1, 40)
    moves = _moves(rng, n, slots=rng.choice([8, 64, 1000]), one_direction=rng.random() < 0.8)
    groups, placed = batch_moves(moves)
    assert (groups, placed) == _place_each(moves)
    assert _ordered(moves, placed)
    if _no_conflicts(moves):
        assert len(groups) == len({(m.src_tier, m.dst_tier, m.num_tokens) for m in moves})


def test_an_onboarding_of_distinct_slots_is_one_group_and_a_conflict_orders_two() -> None:
    moves = [Move("onboard", Tier.HOST, 10 + i, Tier.GPU, i, None, None) for i in range(2048)]  # type: ignore[arg-type]
    assert _no_conflicts(moves) and batch_moves(moves) == ([moves], [0] * 2048)
    twice = [*moves, Move("onboard", Tier.HOST, 5000, Tier.GPU, 7, None, None)]  # type: ignore[arg-type]
    assert not _no_conflicts(twice) and len(batch_moves(twice)[0]) == 2
    same_tier = [Move("partial", Tier.GPU, 1, Tier.GPU, 2, 3, None), Move("partial", Tier.GPU, 2, Tier.GPU, 3, 3, None)]  # type: ignore[arg-type]
    assert not _no_conflicts(same_tier) and batch_moves(same_tier)[1] == [0, 1]
    with_partial = [*moves, Move("partial", Tier.GPU, 3000, Tier.GPU, 3001, 5, None)]  # type: ignore[arg-type]
    assert _no_conflicts(with_partial) and batch_moves(with_partial)[1] == [0] * 2048 + [1]
    assert batch_moves([]) == ([], [])
