"""Spill on close: the cached blocks that live only in memory are written to the file tier before the cache closes.

Primitives:

* :func:`spill_cached_blocks` -- copy every cached block of the GPU and host tiers whose key the file tier
  does not hold into a free file slot (parents before children), await the copies, return how many landed.

Rules:

* Only *empty* file slots are used: blocks the file tier already holds stay (no file block is evicted for a
  memory block, and none an earlier run left is overwritten), so a restart finds at least what it would have
  found without the spill.
* Blocks are taken in the order they entered the prefix lookup, which puts every parent before its children:
  when the free slots run out, whole prefixes survive, not stray tails a restart could not reach.
* The copies are the cache's own (``keys`` = content keys, in every slot header): a warm restart on the same
  directory adopts them like any block an earlier run spilled. A copy that fails (a full disk, a stalled one:
  bounded by the file tier's deadline) only means that block is not kept.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from .blocks import Block, BlockManager
from .errors import TransferError
from .file import FileTier
from .pools import Tier

__all__ = ["spill_cached_blocks"]

log = logging.getLogger(__name__)


async def spill_cached_blocks(
    blocks: BlockManager, file_tier: FileTier, copy: Callable[..., Any]
) -> int:
    """Write the memory-only cached blocks to free file slots; returns the blocks written.

    Args:
        blocks: the cache's block manager (its prefix lookup and its free file slots).
        file_tier: the engine's file tier (what it holds already).
        copy: the cache's copy function (``engine.copy`` under the cache's claim).

    Cancellation: the copies already issued still complete.
    """
    held = file_tier.entries()
    todo: list[Block] = [
        b for b in blocks.cached_blocks()
        if b.tier in (Tier.GPU, Tier.HOST) and b.key is not None and b.key not in held
    ]
    if not todo:
        return 0
    # Free slots only (nothing is evicted for them), and of those the empty ones: a free slot may still hold a
    # block of an earlier run that this run has not adopted yet.
    free, _ = blocks.reserve(Tier.FILE, blocks.free_blocks(Tier.FILE))
    slots = [s for s in free if not file_tier.is_valid(s) and not file_tier.is_pending(s)][: len(todo)]
    chosen = set(slots)
    blocks.unreserve(Tier.FILE, [s for s in free if s not in chosen])
    todo = todo[: len(slots)]
    if not todo:
        return 0
    transfers = []
    for tier in (Tier.GPU, Tier.HOST):
        pairs = [(b, s) for b, s in zip(todo, slots, strict=True) if b.tier is tier]
        if pairs:
            transfers.append((len(pairs), copy(
                tier, [b.slot for b, _ in pairs], Tier.FILE, [s for _, s in pairs], keys=[b.key for b, _ in pairs]
            )))
    written = 0
    for n, t in transfers:
        try:
            await t
            written += n
        except TransferError as exc:
            log.warning("spill on close: %d blocks were not written to the file tier: %s", n, exc)
    return written
