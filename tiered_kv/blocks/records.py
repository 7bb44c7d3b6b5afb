"""The data types of the block manager: what a caller passes in and gets back, and one block's bookkeeping.

Primitives:

* :class:`Request` -- token ids + priority (+ leading blocks the caller computes); :class:`Admission` -- one
  request's outcome.
* :class:`Block` -- one logical block: content key, tokens, tier + slot, reference count, priority.
* :class:`Move` -- one copy a plan needs (offload, spill, onboard, partial, fetch); :class:`Plan` -- the moves of one
  manager call, in order.
* :class:`Match` -- what the cache holds of one request's prefix.
* :class:`BlockStatistics` -- a snapshot of the manager's blocks and counters.
* :class:`LiveSequence` -- one live sequence's blocks, keys and commit state (the manager's own record).
* :class:`CacheFullError`, the priority range and :data:`TIER_ORDER`, the order of the eviction cascade.

These types hold data only: the decisions are the manager's (:mod:`tiered_kv.blocks.manager`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ..errors import TieredKVError
from ..keys import ContentKey
from ..pools import Tier

__all__ = [
    "DEFAULT_PRIORITY",
    "MAX_PRIORITY",
    "MIN_PRIORITY",
    "TIER_ORDER",
    "Admission",
    "Block",
    "BlockStatistics",
    "CacheFullError",
    "LiveSequence",
    "Match",
    "Move",
    "PageTableListener",
    "Plan",
    "Request",
    "check_priority",
]

#: Priority of a request that names none (0 = first to go .. 100 = last to go).
DEFAULT_PRIORITY = 50
MIN_PRIORITY, MAX_PRIORITY = 0, 100

#: Tiers from fastest to slowest: where an evicted block goes next.
TIER_ORDER = (Tier.GPU, Tier.HOST, Tier.FILE)

PageTableListener = Callable[[int, "tuple[int, ...] | None"], None]


class CacheFullError(TieredKVError):
    """The request does not fit now (GPU blocks after every possible eviction, or sequence slots).

    Nothing was claimed or allocated; retry after freeing sequences.
    """


@dataclasses.dataclass(frozen=True, slots=True)
class Request:
    """One sequence to admit.

    Attributes:
        tokens: the prompt's token ids (at least one).
        priority: retention priority of its blocks, 0 (evicted first) .. 100 (evicted last). A reused block
            takes the priority of the latest request that claims it.
        compute_blocks: leading blocks of the match that the caller computes instead of bringing them to the GPU
            (hybrid prefill: the model computes them while the rest of the match is loaded). They get fresh GPU
            blocks, private to the sequence (never matchable, freed with it), which the caller writes; the cached
            copies stay where they are, unclaimed. At most the matched full blocks count (see
            :attr:`Admission.tokens_computed_first`); when it covers all of them the partial reuse is dropped too.
    """

    tokens: Sequence[int] | np.ndarray
    priority: int = DEFAULT_PRIORITY
    compute_blocks: int = 0

    @classmethod
    def coerce(cls, value: object) -> Request:
        """A :class:`Request` as is, or a plain sequence of token ids with the default priority."""
        if isinstance(value, Request):
            return value
        return cls(value)  # type: ignore[arg-type]


class Block:
    """One logical KV block: lives in exactly one (tier, slot) while alive.

    Attributes:
        id: unique per manager, for LRU bookkeeping.
        key: content key, ``None`` until the block's tokens are known (a partial tail block).
        tokens: token ids the block holds (int64); fewer than ``tokens_per_block`` for a partial block.
        parent_key: key of the block before it (the root key for a first block).
        tier, slot: where the data is. ``tier`` is ``None`` once the block is gone.
        refcount: live sequences holding it (plus in-flight claims of the current admission).
        priority: retention priority.
        cached: in the lookup (can be matched by a new request).
        children: cached blocks whose parent is this block (key -> block); only while cached.
        sources: transfers that produced the data in the current slot, oldest first. The async layer
            appends to it and checks it: a failed one poisons the block.
        checksum: what the cache's integrity checks recorded when the block was committed (``None`` before, and for
            blocks never committed in this process: adopted from a file tier an earlier run left, fetched from a
            store). A block that leaves the lookup leaves its checksum behind for a later adoption of its key.
    """

    __slots__ = (
        "cached",
        "checksum",
        "children",
        "id",
        "key",
        "parent_key",
        "priority",
        "refcount",
        "slot",
        "sources",
        "tier",
        "tokens",
    )

    def __init__(
        self, block_id: int, tier: Tier, slot: int, parent_key: ContentKey, tokens: np.ndarray, priority: int
    ) -> None:
        self.id = block_id
        self.tier: Tier | None = tier
        self.slot = slot
        self.parent_key = parent_key
        self.tokens = tokens
        self.key: ContentKey | None = None
        self.refcount = 1
        self.priority = priority
        self.cached = False
        self.children: dict[ContentKey, Block] = {}
        self.sources: list[object] = []
        self.checksum: Any = None  # its tiered_kv.integrity.Checksum once committed (the cache's integrity checks)

    @property
    def num_tokens(self) -> int:
        """Tokens of the request."""
        return len(self.tokens)

    def __repr__(self) -> str:
        where = f"{self.tier.value}:{self.slot}" if self.tier is not None else "gone"
        key = self.key.hex()[:8] if self.key else "-"
        flags = " cached" if self.cached else ""
        return (
            f"<Block #{self.id} {where} key={key} tokens={len(self.tokens)} ref={self.refcount} "
            f"prio={self.priority}{flags}>"
        )


@dataclasses.dataclass(slots=True, eq=False)
class Move:
    """One copy a plan needs, in order. Issue the moves of a plan in list order.

    Read-only by rule, not frozen: a frozen dataclass costs ~6x as much to build, and the plan of a long prefix holds
    one move per block (2,048 at 32k tokens), all made before its first copy starts.

    Attributes:
        kind: ``"offload"`` (GPU->host eviction), ``"spill"`` (host->file eviction), ``"onboard"``
            (host/file -> GPU for a reused block), ``"partial"`` (first ``num_tokens`` of a cached block
            into a new GPU block), ``"fetch"`` (a new block's object read from the remote tier, straight into its
            GPU slot or through a host ring slot; see :attr:`BlockManager.fetch_tier`).
        src_tier, src_slot, dst_tier, dst_slot: the copy. A read from ``Tier.REMOTE`` is named by ``key``; its
            ``src_slot`` only tells the plan's remote reads apart.
        num_tokens: tokens to copy, ``None`` for whole blocks.
        block: the block whose data lands in ``dst_slot`` (for a partial copy: the new block).
        source: for a partial copy, the cached block read from.
        key: for a read from ``Tier.REMOTE``, the content key of the object read.
    """

    kind: str
    src_tier: Tier
    src_slot: int
    dst_tier: Tier
    dst_slot: int
    num_tokens: int | None
    block: Block
    source: Block | None = None
    key: ContentKey | None = None


@dataclasses.dataclass(slots=True)
class Plan:
    """Copies to issue (in order) for one manager call."""

    moves: list[Move] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(frozen=True, slots=True)
class Match:
    """What the cache holds of one request's prefix (a lookup, claims nothing).

    Attributes:
        blocks: the cached full blocks of the longest prefix, in order.
        partial: ``(block, num_tokens)``: a cached block whose first ``num_tokens`` tokens continue the
            prefix, reused by a partial copy; or ``None``.
        keys: the request's full-block keys (all of them, not only the matched ones).
        tokens_reused: ``len(blocks) * tokens_per_block + num_tokens``.
        by_tier: matched full blocks per tier (``Tier.value`` -> count) at lookup time.
        cut: :attr:`BlockManager.reuse_limit` cut cached blocks off (they are recomputed, not fetched).
        compute_blocks: leading ``blocks`` the request computes (:attr:`Request.compute_blocks`): not reused, not
            in ``tokens_reused`` or ``by_tier``.
    """

    blocks: tuple[Block, ...]
    partial: tuple[Block, int] | None
    keys: tuple[ContentKey, ...]
    tokens_reused: int
    by_tier: dict[str, int]
    cut: bool = False
    compute_blocks: int = 0


@dataclasses.dataclass(frozen=True, slots=True)
class Admission:
    """One request's own outcome of :meth:`BlockManager.admit` (equal to admitting it alone on the same state).

    Attributes:
        seq_id: the new sequence's id (never reused).
        slot: its slot in ``[0, max_seqs)`` (reused after the sequence is freed): its row in page-table tensors.
        num_tokens: prompt tokens.
        tokens_reused: tokens whose KV came from the cache (full blocks + the partial copy): positions
            ``[tokens_computed_first, tokens_computed_first + tokens_reused)``.
        blocks_from: full blocks reused, per tier they were found in (``"gpu"``, ``"host"``, ``"file"``; the cache
            adds ``"remote"``: blocks whose fetch landed, see :meth:`BlockManager.fetched`).
        partial_tokens: tokens reused through the partial copy of one block (0 if none).
        blocks_allocated: GPU blocks newly allocated for it (including the partial-copy target and the fresh
            leading blocks of ``compute_blocks``).
        page_table: GPU block indices of the sequence, in order.
        tokens_computed_first: tokens of the leading matched blocks the caller computes and writes into the first
            blocks of ``page_table`` (:attr:`Request.compute_blocks`, at most the matched full blocks); 0 otherwise.
    """

    seq_id: int
    slot: int
    num_tokens: int
    tokens_reused: int
    blocks_from: dict[str, int]
    partial_tokens: int
    blocks_allocated: int
    page_table: tuple[int, ...]
    tokens_computed_first: int = 0

    @property
    def tokens_to_compute(self) -> int:
        """Tokens that were not reused: the model computes them (``tokens_computed_first`` included)."""
        return self.num_tokens - self.tokens_reused


@dataclasses.dataclass(frozen=True, slots=True)
class BlockStatistics:
    """A snapshot of a :class:`BlockManager`.

    Attributes:
        capacity, free, cached, in_use: blocks per tier (``Tier.value`` -> count). ``cached`` counts
            blocks with no reference that can be matched (evictable); ``in_use`` blocks held by sequences.
        live_sequences: sequences not yet freed.
        requests: requests admitted.
        tokens_requested, tokens_reused: prompt tokens admitted, and those reused.
        hits: reused full blocks per tier they were found in.
        partial_hits, partial_tokens: partial reuses and the tokens they brought.
        blocks_allocated: GPU blocks newly allocated (prompts and appends).
        evictions: ``"gpu->host"``, ``"host->file"`` (moves) and ``"gpu->dropped"``, ``"host->dropped"``,
            ``"file->dropped"`` (victims dropped without a copy) -> blocks.
        unreachable_dropped: cached descendants dropped because their parent left the lookup.
        adopted: file-tier blocks of an earlier run adopted into the lookup (warm restart, ``file_index``).
        fetched: new blocks reused because their remote-tier fetch landed (:meth:`BlockManager.fetched`); not in
            ``hits``.
    """

    capacity: dict[str, int]
    free: dict[str, int]
    cached: dict[str, int]
    in_use: dict[str, int]
    live_sequences: int
    requests: int
    tokens_requested: int
    tokens_reused: int
    hits: dict[str, int]
    partial_hits: int
    partial_tokens: int
    blocks_allocated: int
    evictions: dict[str, int]
    unreachable_dropped: int
    adopted: int = 0
    fetched: int = 0


class LiveSequence:
    """One live sequence, as the manager records it (callers see its id, slot and page table only).

    Attributes:
        seq_id, slot: its id (never reused) and page-table slot.
        tokens: every token id so far (prompt + appended).
        blocks: its blocks, in token order.
        keys: the content keys of its full blocks, in order.
        priority: the retention priority its blocks take.
        committed: tokens whose KV the caller declared written (:meth:`BlockManager.commit`).
        registered: leading blocks offered to the lookup so far.
    """

    __slots__ = ("blocks", "committed", "keys", "priority", "registered", "seq_id", "slot", "tokens")

    def __init__(self, seq_id: int, slot: int, tokens: list[int], priority: int) -> None:
        self.seq_id = seq_id
        self.slot = slot
        self.tokens = tokens
        self.blocks: list[Block] = []
        self.keys: list[ContentKey] = []
        self.priority = priority
        self.committed = 0
        self.registered = 0


def check_priority(priority: object) -> int:
    """``priority`` as an int, checked to be an integer in ``MIN_PRIORITY..MAX_PRIORITY``.

    Raises:
        TypeError: not an integer.
        ValueError: out of range.
    """
    if isinstance(priority, bool) or not isinstance(priority, (int, np.integer)):
        raise TypeError(f"priority must be an int, got {type(priority).__name__}")
    if not MIN_PRIORITY <= priority <= MAX_PRIORITY:
        raise ValueError(f"priority must be in {MIN_PRIORITY}..{MAX_PRIORITY}, got {priority}")
    return int(priority)
