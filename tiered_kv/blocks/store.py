"""Where blocks live: per-tier slots, the LRUs of evictable blocks, and the prefix lookup tree.

Lookup: a hash-chain map ``key -> block`` for the O(1)-per-block walk, plus parent/children links that make it a
tree, so that a cached block is always reachable from the root through cached blocks (the invariant
:meth:`BlockManager.check <tiered_kv.blocks.manager.BlockManager.check>` verifies). A block that leaves the lookup
takes its unused cached descendants with it (they could never be matched again: a prefix walk stops at the first
missing key); descendants in use by a live sequence are detached and freed when released.

LRUs: one per priority per tier, holding exactly the cached blocks with a reference count of zero, least recently
released first. A claimed block is in no LRU, so nothing evicts it.

Ghosts: a block that leaves the lookup leaves its checksum behind under its key, for a later adoption of that key
from the file tier (warm restart); a key whose bytes failed an integrity check is marked refused and never adopted
again. Bounded, oldest first out.

:class:`BlockStore` holds this state and the operations that keep it consistent; taking a slot (and evicting for
it) is :mod:`tiered_kv.blocks.eviction`'s.
"""

from __future__ import annotations

import collections
import itertools
from collections.abc import Callable
from typing import Any

import numpy as np

from ..keys import ContentKey, KeyHasher
from ..pools import Tier
from .records import DEFAULT_PRIORITY, TIER_ORDER, Block, Plan

__all__ = ["REFUSED", "BlockStore"]

REFUSED = object()
"""``BlockStore._ghosts`` value of a key whose bytes failed an integrity check: never adopted again."""


class BlockStore:
    """Per-tier slots, the LRUs and the lookup tree of a block manager.

    Args:
        hasher: content-key hasher (its layout gives ``tokens_per_block``; its root key is the tree's root).
        capacity: blocks per tier, every tier of :data:`~tiered_kv.blocks.records.TIER_ORDER` named (0 = none).
        file_index: ``content key -> file slot or None`` (the file tier's ``lookup``), kept only with a file tier.
    """

    def __init__(
        self, hasher: KeyHasher, capacity: dict[Tier, int], file_index: Callable[[ContentKey], int | None] | None
    ) -> None:
        self.hasher = hasher
        self.tokens_per_block = hasher.tokens_per_block
        self.capacity = capacity
        self.tiers = tuple(t for t in TIER_ORDER if capacity[t] > 0)
        self.file_index = file_index if capacity[Tier.FILE] else None
        # tier -> free slots, a stack. The GPU tier hands out its lowest slot first: a sequence's blocks, allocated in
        # order, fill ascending slots. The tiers below hand out their highest first: eviction takes a chain's last
        # block first, so its blocks land in ascending slots too, and a prefix brought back is a run of consecutive
        # slots on both sides (one 2-D copy per run, where a scattered run costs a descriptor per block)
        self._free: dict[Tier, list[int]] = {
            t: list(range(capacity[t] - 1, -1, -1)) if t is Tier.GPU else list(range(capacity[t])) for t in TIER_ORDER
        }
        self._gpu_free = self._free[Tier.GPU]  # the same list, without an Enum-keyed lookup on the hot path
        # tier -> priority -> block id -> block: cached blocks with refcount 0, least recently released first
        self._lru: dict[Tier, dict[int, collections.OrderedDict[int, Block]]] = {t: {} for t in TIER_ORDER}
        self._lookup: dict[ContentKey, Block] = {}  # content key -> the cached block
        # content key -> the checksum of a block that left the lookup (a block adopted from the file tier under that
        # key gets it back), or REFUSED (never adopt that key again: its bytes failed an integrity check); bounded
        self._ghosts: collections.OrderedDict[ContentKey, Any] = collections.OrderedDict()
        self._ghost_limit = 4 * sum(self.capacity.values()) + 64
        self._roots: dict[ContentKey, Block] = {}  # cached first blocks (children of the root key)
        self._ids = itertools.count()
        self._unreachable = self._adopted = 0

    # ------------------------------------------------------------------------------------ the lookup tree

    def _register(self, block: Block, key: ContentKey) -> None:
        """Make ``block`` matchable under ``key``, if no block has that key and its parent is cached."""
        block.key = key
        if key in self._lookup:
            return  # a duplicate (another sequence computed the same prefix): stays private
        if block.parent_key == self.hasher.root:
            siblings = self._roots
        else:
            parent = self._lookup.get(block.parent_key)
            if parent is None:
                return  # its parent left the lookup: it could never be reached
            siblings = parent.children
        siblings[key] = block
        self._lookup[key] = block
        block.cached = True
        if block.refcount == 0:
            self._lru_add(block)

    def _uncache(self, block: Block, plan: Plan) -> None:
        """Take ``block`` and its cached subtree out of the lookup.

        Unused descendants are dropped (their slots freed): no prefix walk could reach them again. Used
        ones (held by a sequence that computed them as duplicates' children) stay with their sequence and
        are freed when it releases them.
        """
        if block.parent_key == self.hasher.root:
            self._roots.pop(block.key, None)  # type: ignore[arg-type]
        else:
            parent = self._lookup.get(block.parent_key)
            if parent is not None:
                parent.children.pop(block.key, None)  # type: ignore[arg-type]
        stack = [block]
        while stack:
            b = stack.pop()
            stack.extend(b.children.values())
            b.children.clear()
            del self._lookup[b.key]  # type: ignore[arg-type]
            b.cached = False
            if b.checksum is not None:
                self._ghost(b.key, b.checksum)  # type: ignore[arg-type]
            if b is block:
                continue
            if b.refcount == 0:
                self._lru_remove(b)
                self._release_slot(b)
                self._unreachable += 1

    def _ghost(self, key: ContentKey, value: Any) -> None:
        ghosts = self._ghosts
        if ghosts.get(key) is REFUSED:
            return
        ghosts[key] = value
        ghosts.move_to_end(key)
        while len(ghosts) > self._ghost_limit:
            ghosts.popitem(last=False)

    def _adopt(self, key: ContentKey, parent_key: ContentKey, tokens: np.ndarray) -> Block | None:
        """Warm restart: a block of an earlier run that the file tier's index holds under ``key``, now cached.

        The parent (``parent_key``) is cached: the walk matched it one step before. The key is the hash chain
        of every token before and in the block, salted with the layout and model, so a hit is this prefix's
        block; its bytes are verified against the key and checksum when it is read.
        """
        assert self.file_index is not None
        if self._ghosts.get(key) is REFUSED:
            return None
        slot = self.file_index(key)
        if slot is None or not 0 <= slot < self.capacity[Tier.FILE]:
            return None
        free = self._free[Tier.FILE]
        try:
            free.remove(slot)  # O(file slots), once per adopted block
        except ValueError:
            return None  # the manager uses that slot for another block (its copy is about to overwrite it)
        block = Block(next(self._ids), Tier.FILE, slot, parent_key, tokens.copy(), DEFAULT_PRIORITY)
        block.refcount = 0
        block.checksum = self._ghosts.pop(key, None)
        self._register(block, key)
        assert block.cached, "the parent of an adopted block is cached"
        self._adopted += 1
        return block

    # ------------------------------------------------------------------------------------ references and LRUs

    def _ref(self, block: Block) -> None:
        if block.refcount == 0:
            self._lru_remove(block)
        block.refcount += 1

    def _unref(self, block: Block) -> None:
        assert block.refcount > 0, f"{block} released more often than claimed"
        block.refcount -= 1
        if block.refcount:
            return
        if block.cached:
            self._lru_add(block)
        else:
            self._release_slot(block)

    def _lru_add(self, block: Block) -> None:
        d = self._lru[block.tier].get(block.priority)  # type: ignore[index]
        if d is None:
            d = self._lru[block.tier][block.priority] = collections.OrderedDict()  # type: ignore[index]
        d[block.id] = block

    def _lru_remove(self, block: Block) -> None:
        d = self._lru[block.tier][block.priority]  # type: ignore[index]
        del d[block.id]
        if not d:
            del self._lru[block.tier][block.priority]  # type: ignore[index]

    def _release_slot(self, block: Block) -> None:
        self._free[block.tier].append(block.slot)  # type: ignore[index]
        block.tier = None
