"""Taking a slot of a tier: a free one, else the eviction cascade makes one.

Eviction, per tier, takes the lowest priority first and the least recently released block within a priority (one
LRU per priority per tier, :mod:`tiered_kv.blocks.store`). It cascades: a GPU victim is offloaded to a host slot
(or dropped without a copy when its priority is below ``drop_below_priority``, or when no host slot can be had), a
host victim is spilled to a file slot, a file victim is dropped. Only cached blocks with a reference count of zero
are ever victims: claimed blocks never move. Each offload or spill is a :class:`~tiered_kv.blocks.records.Move`
appended to the caller's plan, in the order the copies must run.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from ..keys import ContentKey, KeyHasher
from ..pools import Tier
from .records import TIER_ORDER, Block, Move, Plan
from .store import BlockStore

__all__ = ["EvictingStore"]


class EvictingStore(BlockStore):
    """A :class:`~tiered_kv.blocks.store.BlockStore` that takes slots, evicting down the cascade when a tier is full.

    Args:
        hasher, capacity, file_index: as for :class:`~tiered_kv.blocks.store.BlockStore`.
        drop_below_priority: a GPU victim with a lower priority is dropped without a copy (checked by the caller).
    """

    def __init__(
        self,
        hasher: KeyHasher,
        capacity: dict[Tier, int],
        file_index: Callable[[ContentKey], int | None] | None,
        drop_below_priority: int,
    ) -> None:
        super().__init__(hasher, capacity, file_index)
        self.drop_below_priority = drop_below_priority
        #: ``callback(block, plan)`` just before a cached block is evicted from its tier (it is still at its slot;
        #: ``plan`` holds the moves decided so far in this call, not yet issued)
        self.on_evict: Callable[[Block, Plan], None] | None = None
        self._evictions: dict[str, int] = {}  # "gpu->host", "gpu->dropped", ... -> blocks

    def _allocate(self, parent_key: ContentKey, tokens: np.ndarray, priority: int, plan: Plan) -> Block:
        """A new GPU block holding ``tokens`` (reference count 1), in a free slot or one the cascade frees."""
        free = self._gpu_free
        slot = free.pop() if free else self._take_slot(Tier.GPU, plan)  # fast path: no eviction needed
        assert slot is not None, "capacity was checked before any change"
        return Block(next(self._ids), Tier.GPU, slot, parent_key, tokens, priority)

    def _victim(self, tier: Tier) -> Block | None:
        lru = self._lru[tier]
        if not lru:
            return None
        return next(iter(lru[min(lru)].values()))

    def _take_slot(self, tier: Tier, plan: Plan) -> int | None:
        """A free slot of ``tier``, evicting (down the cascade) if needed; ``None`` if nothing can go."""
        if self.capacity[tier] == 0:
            return None
        free = self._free[tier]
        if free:
            return free.pop()
        victim = self._victim(tier)
        if victim is None:
            return None
        return self._evict(victim, plan)

    def _evict(self, block: Block, plan: Plan) -> int:
        """Move ``block`` one tier down (or drop it); returns its old slot, now the caller's."""
        tier = block.tier
        assert tier is not None and block.refcount == 0 and block.cached
        if self.on_evict is not None:
            self.on_evict(block, plan)
        old = block.slot
        self._lru_remove(block)
        below = TIER_ORDER[TIER_ORDER.index(tier) + 1] if tier is not Tier.FILE else None
        dst: int | None = None
        if below is not None and not (tier is Tier.GPU and block.priority < self.drop_below_priority):
            # Pinned while the tier below makes room: that eviction may drop one of this block's ancestors,
            # which must then detach this block (not free its slot, which is the caller's).
            block.refcount += 1
            dst = self._take_slot(below, plan)
            block.refcount -= 1
            if dst is not None and not block.cached:
                self._free[below].append(dst)  # became unreachable: not worth a copy
                self._count(f"{tier.value}->dropped")
                block.tier = None
                return old
        if dst is None:
            self._count(f"{tier.value}->dropped")
            block.tier = None
            if block.cached:
                self._uncache(block, plan)
            return old
        assert below is not None
        kind = "offload" if tier is Tier.GPU else "spill"
        plan.moves.append(Move(kind, tier, old, below, dst, None, block))
        block.tier, block.slot = below, dst
        self._lru_add(block)
        self._count(f"{tier.value}->{below.value}")
        return old

    def _move(self, block: Block, tier: Tier, kind: str, plan: Plan) -> None:
        """Bring a claimed block to ``tier`` (onboarding); its old slot is freed."""
        slot = self._take_slot(tier, plan)
        assert slot is not None, "capacity was checked before any change"
        src_tier, src_slot = block.tier, block.slot
        assert src_tier is not None
        plan.moves.append(Move(kind, src_tier, src_slot, tier, slot, None, block))
        self._free[src_tier].append(src_slot)
        block.tier, block.slot = tier, slot

    def _count(self, what: str) -> None:
        self._evictions[what] = self._evictions.get(what, 0) + 1
