"""How a block-manager :class:`~tiered_kv.blocks.Plan` becomes a handful of batched engine copies.

Primitives:

* :func:`batch_moves` -- group a plan's moves by direction (and token count) so that every pair of moves
  touching a common slot (other than two reads) keeps its plan order: one ``engine.copy`` per group.
* :func:`unissued_transfer` -- the failed :class:`~tiered_kv.Transfer` standing for a group that could not be
  issued (its blocks are then poisoned like the products of any failed copy).
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

from .blocks import Move
from .errors import TransferError
from .fences import Marker
from .pools import Tier
from .transfer import Transfer

__all__ = ["batch_moves", "unissued_transfer"]


def batch_moves(moves: Sequence[Move]) -> tuple[list[list[Move]], list[int]]:
    """Group ``moves`` for batched issue; returns ``(groups, group of each move)``.

    A move joins the first group of its direction (and token count) that comes after every group it
    conflicts with -- one that writes its source, or reads or writes its destination -- so every pair of
    moves touching a common slot (other than two reads) keeps its plan order, and the engine's fences
    order them on the device when the groups are issued in list order. Plans alternate offloads and onboards
    (each onboard frees the host slot the next offload fills), so this turns thousands of single-block copies
    into a handful of calls.
    """
    if _no_conflicts(moves):
        return _by_direction(moves)
    return _place_each(moves)


def _place_each(moves: Sequence[Move]) -> tuple[list[list[Move]], list[int]]:
    """:func:`batch_moves` move by move (the rule itself)."""
    groups: list[list[Move]] = []
    by_kind: dict[tuple[Tier, Tier, int | None], list[int]] = {}  # direction -> its group indices, ascending
    last_read: dict[tuple[Tier, int], int] = {}  # slot -> last group reading it
    last_write: dict[tuple[Tier, int], int] = {}  # slot -> last group writing it
    placed: list[int] = []  # move -> its group
    for move in moves:
        src, dst = (move.src_tier, move.src_slot), (move.dst_tier, move.dst_slot)
        after = max(last_write.get(src, -1), last_write.get(dst, -1), last_read.get(dst, -1))
        kind = (move.src_tier, move.dst_tier, move.num_tokens)
        candidates = by_kind.setdefault(kind, [])
        i = bisect.bisect_right(candidates, after)
        if i < len(candidates):
            g = candidates[i]
        else:
            g = len(groups)
            groups.append([])
            candidates.append(g)
        groups[g].append(move)
        placed.append(g)
        last_read[src] = max(last_read.get(src, -1), g)
        last_write[dst] = max(last_write.get(dst, -1), g)
    return groups, placed


def _no_conflicts(moves: Sequence[Move]) -> bool:
    """No slot is written twice, and none is both written and read: no pair of moves needs an order.

    Then :func:`batch_moves` groups by direction alone (:func:`_by_direction`): an onboarding of a long prefix
    (2,048 moves at 32k tokens) costs a set of its slots instead of placing each move against the others.
    """
    writes = {(m.dst_tier, m.dst_slot) for m in moves}
    return len(writes) == len(moves) and writes.isdisjoint((m.src_tier, m.src_slot) for m in moves)


def _by_direction(moves: Sequence[Move]) -> tuple[list[list[Move]], list[int]]:
    """:func:`batch_moves` of moves without conflicts: a group per direction (and token count), in first-seen order."""
    index: dict[tuple[Tier, Tier, int | None], int] = {}
    groups: list[list[Move]] = []
    placed: list[int] = []
    for m in moves:
        kind = (m.src_tier, m.dst_tier, m.num_tokens)
        g = index.get(kind)
        if g is None:
            g = index[kind] = len(groups)
            groups.append([])
        groups[g].append(m)
        placed.append(g)
    return groups, placed


def unissued_transfer(group: list[Move], cause: BaseException) -> Transfer:
    """A transfer that failed without being issued: its group of moves could not be issued whole."""
    head = group[0]
    marker = Marker(None)
    error = TransferError(
        f"a {head.src_tier.value}->{head.dst_tier.value} copy of {len(group)} blocks was not issued: "
        f"its plan could not be issued whole ({cause})"
    )
    error.__cause__ = cause
    marker.error = error
    marker.complete()
    return Transfer(marker, head.src_tier, head.dst_tier, len(group), 0)
