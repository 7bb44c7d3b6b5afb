"""The block manager: synchronous bookkeeping of cached KV blocks across GPU, host and file tiers.

Primitives (re-exported from here):

* :class:`BlockManager` -- blocks, sequences, the lookup tree and per-tier slot allocation. Every method
  is synchronous (no awaits, no device work): it decides, and returns a :class:`Plan` of copies (in
  order) for the async layer (:mod:`tiered_kv.cache`) to issue. That keeps it property-testable.
* :class:`Request` -- token ids + priority; :class:`Admission` -- one request's outcome.
* :class:`Block` -- one logical block: content key, tokens, tier + slot, reference count, priority.
* :class:`Move` -- one copy the plan needs (offload, spill, onboard, partial, fetch).
* :class:`Match`, :class:`BlockStatistics`, :class:`CacheFullError`, :data:`DEFAULT_PRIORITY`.

Modules, each layer built on the ones before it:

* :mod:`.records` -- the data types above and the manager's record of a live sequence.
* :mod:`.store` -- where blocks live: per-tier free slots, the LRUs of evictable blocks, the prefix lookup tree
  and its ghosts (checksums left behind, refused keys), adoption of file-tier blocks (warm restart).
* :mod:`.eviction` -- taking a slot: a free one, else the eviction cascade (GPU -> host -> file -> dropped).
* :mod:`.admission` -- two-phase admission of a batch: match, claim, then onboard, allocate and plan fetches.
* :mod:`.manager` -- :class:`BlockManager`, the public facade: argument checks, sequence lifecycle, blocks from
  outside the admission path, inspection and the invariant check.

The layers share one set of invariants, which :meth:`BlockManager.check` verifies as a whole, and every decision
stays synchronous.
"""

from .manager import BlockManager
from .records import (
    DEFAULT_PRIORITY,
    Admission,
    Block,
    BlockStatistics,
    CacheFullError,
    Match,
    Move,
    Plan,
    Request,
)
from .records import MAX_PRIORITY as MAX_PRIORITY
from .records import MIN_PRIORITY as MIN_PRIORITY
from .records import TIER_ORDER as TIER_ORDER
from .records import PageTableListener as PageTableListener

__all__ = [
    "DEFAULT_PRIORITY",
    "Admission",
    "Block",
    "BlockManager",
    "BlockStatistics",
    "CacheFullError",
    "Match",
    "Move",
    "Plan",
    "Request",
]
