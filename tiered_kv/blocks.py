"""The block manager: synchronous bookkeeping of cached KV blocks across GPU, host and file tiers.

Primitives:

* :class:`BlockManager` -- blocks, sequences, the lookup tree and per-tier slot allocation. Every method
  is synchronous (no awaits, no device work): it decides, and returns a :class:`Plan` of copies (in
  order) for the async layer (:mod:`tiered_kv.cache`) to issue. That keeps it property-testable.
* :class:`Request` -- token ids + priority; :class:`Admission` -- one request's outcome.
* :class:`Block` -- one logical block: content key, tokens, tier + slot, reference count, priority.
* :class:`Move` -- one copy the plan needs (offload, spill, onboard, partial).

Lookup: a hash-chain map ``key -> block`` for the O(1)-per-block walk, plus parent/children links that
make it a tree, so that a cached block is always reachable from the root through cached blocks (the
invariant :meth:`BlockManager.check` verifies). A block that leaves the lookup takes its unused cached
descendants with it (they could never be matched again: a prefix walk stops at the first missing key);
descendants in use by a live sequence are detached and freed when released.

Eviction, per tier, takes the lowest priority first and the least recently released block within a
priority (one LRU per priority per tier). It cascades: a GPU victim is offloaded to a host slot (or
dropped without a copy when its priority is below ``drop_below_priority``, or when no host slot can be
had), a host victim is spilled to a file slot, a file victim is dropped. Only cached blocks with a
reference count of zero are ever victims: claimed blocks never move.

Size: one module of about a thousand lines, on purpose: the lookup tree, the LRUs, slot allocation and the
eviction cascade share one set of invariants (:meth:`BlockManager.check`), and keeping them in one class
keeps every decision synchronous and every invariant in view.

Two-phase admission: :meth:`BlockManager.admit` first matches and *claims* every reusable
block of every request of the batch (claimed blocks leave the LRUs), then onboards and allocates. A
one-phase order (claim, onboard, allocate, request by request) lets onboarding for one request evict host
blocks that a later request of the same batch was counted on.
"""

from __future__ import annotations

import collections
import dataclasses
import heapq
import itertools
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from .errors import TieredKVError
from .keys import ContentKey, KeyHasher, as_token_array
from .pools import Tier

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
    """

    tokens: Sequence[int] | np.ndarray
    priority: int = DEFAULT_PRIORITY

    @classmethod
    def coerce(cls, value: object) -> Request:
        """A :class:`Request` as is, or a plain sequence of token ids with the default priority."""
        if isinstance(value, Request):
            return value
        return cls(value)  # type: ignore[arg-type]


_REFUSED = object()
"""``BlockManager._ghosts`` value of a key whose bytes failed an integrity check: never adopted again."""


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
        "cached", "checksum", "children", "id", "key", "parent_key", "priority", "refcount", "slot", "sources", "tier",
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


@dataclasses.dataclass(frozen=True, slots=True)
class Move:
    """One copy a plan needs, in order. Issue the moves of a plan in list order.

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
    """

    blocks: tuple[Block, ...]
    partial: tuple[Block, int] | None
    keys: tuple[ContentKey, ...]
    tokens_reused: int
    by_tier: dict[str, int]
    cut: bool = False


@dataclasses.dataclass(frozen=True, slots=True)
class Admission:
    """One request's own outcome of :meth:`BlockManager.admit` (equal to admitting it alone on the same state).

    Attributes:
        seq_id: the new sequence's id (never reused).
        slot: its slot in ``[0, max_seqs)`` (reused after the sequence is freed): its row in page-table tensors.
        num_tokens: prompt tokens.
        tokens_reused: tokens whose KV came from the cache (full blocks + the partial copy).
        blocks_from: full blocks reused, per tier they were found in (``"gpu"``, ``"host"``, ``"file"``; the cache
            adds ``"remote"``: blocks whose fetch landed, see :meth:`BlockManager.fetched`).
        partial_tokens: tokens reused through the partial copy of one block (0 if none).
        blocks_allocated: GPU blocks newly allocated for it (including the partial-copy target).
        page_table: GPU block indices of the sequence, in order.
    """

    seq_id: int
    slot: int
    num_tokens: int
    tokens_reused: int
    blocks_from: dict[str, int]
    partial_tokens: int
    blocks_allocated: int
    page_table: tuple[int, ...]

    @property
    def tokens_to_compute(self) -> int:
        """Tokens that were not reused: the model computes them."""
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


class _Sequence:
    __slots__ = ("blocks", "committed", "keys", "priority", "registered", "seq_id", "slot", "tokens")

    def __init__(self, seq_id: int, slot: int, tokens: list[int], priority: int) -> None:
        self.seq_id = seq_id
        self.slot = slot
        self.tokens = tokens  # every token id so far (prompt + appended)
        self.blocks: list[Block] = []
        self.keys: list[ContentKey] = []  # keys of the full blocks, in order
        self.priority = priority
        self.committed = 0  # tokens whose KV the caller declared written (commit)
        self.registered = 0  # leading blocks offered to the lookup so far


def _check_priority(priority: object) -> int:
    if isinstance(priority, bool) or not isinstance(priority, (int, np.integer)):
        raise TypeError(f"priority must be an int, got {type(priority).__name__}")
    if not MIN_PRIORITY <= priority <= MAX_PRIORITY:
        raise ValueError(f"priority must be in {MIN_PRIORITY}..{MAX_PRIORITY}, got {priority}")
    return int(priority)


class BlockManager:
    """Synchronous bookkeeping of KV blocks over up to three tiers.

    Args:
        hasher: content-key hasher (its layout gives ``tokens_per_block``).
        capacities: blocks per tier; GPU is required, host and file are optional (0 or missing = none).
        max_seqs: live sequences at most (page-table rows).
        max_blocks_per_seq: blocks one sequence may hold (default: the GPU capacity).
        drop_below_priority: a GPU victim with a lower priority is dropped without a copy.
        compute_last_token: reuse at most ``len(prompt) - 1`` tokens so the model has a token to compute
            logits from (what servers need); ``False`` reuses whole prompts.
        on_page_table: called ``(slot, page_table)`` whenever a live sequence's page table changes and
            ``(slot, None)`` when it is freed (for a block-offset table).
        file_index: ``content key -> file slot or None`` (the file tier's ``lookup``): warm restart. A prefix
            walk that misses in memory asks it for the next block's key and adopts a hit as a cached
            FILE-tier block (child of the block before it), if the manager is not using that slot.

    Notes:
        Not thread-safe and never awaits: call it from one thread (the event loop). Every public method
        validates all its arguments and capacity before changing anything, so a raised error leaves the
        state untouched -- except that blocks adopted from ``file_index`` while matching stay cached (they
        were in the file tier all along; the manager only learned of them).
    """

    def __init__(
        self,
        hasher: KeyHasher,
        capacities: Mapping[Tier | str, int],
        *,
        max_seqs: int = 256,
        max_blocks_per_seq: int | None = None,
        drop_below_priority: int = MIN_PRIORITY,
        compute_last_token: bool = True,
        on_page_table: PageTableListener | None = None,
        file_index: Callable[[ContentKey], int | None] | None = None,
    ) -> None:
        caps: dict[Tier, int] = {t: 0 for t in TIER_ORDER}
        for tier, n in capacities.items():
            if isinstance(n, bool) or not isinstance(n, int) or n < 0:
                raise ValueError(f"capacity of tier {tier!r} must be a non-negative int, got {n!r}")
            caps[Tier.coerce(tier)] = n
        if caps[Tier.GPU] < 1:
            raise ValueError("the GPU tier needs at least one block")
        if isinstance(max_seqs, bool) or not isinstance(max_seqs, int) or max_seqs < 1:
            raise ValueError(f"max_seqs must be a positive int, got {max_seqs!r}")
        if max_blocks_per_seq is None:
            max_blocks_per_seq = caps[Tier.GPU]
        if isinstance(max_blocks_per_seq, bool) or not isinstance(max_blocks_per_seq, int) or max_blocks_per_seq < 1:
            raise ValueError(f"max_blocks_per_seq must be a positive int, got {max_blocks_per_seq!r}")
        self.hasher = hasher
        self.tokens_per_block = hasher.tokens_per_block
        self.capacity = caps
        self.tiers = tuple(t for t in TIER_ORDER if caps[t] > 0)
        self.max_seqs = max_seqs
        self.max_blocks_per_seq = min(max_blocks_per_seq, caps[Tier.GPU])
        self.drop_below_priority = _check_priority(drop_below_priority)
        self.compute_last_token = bool(compute_last_token)
        self.on_page_table = on_page_table
        self.file_index = file_index if caps[Tier.FILE] else None
        #: ``reuse_limit(match, prompt_tokens) -> blocks`` (cost-aware reuse, :mod:`tiered_kv.cost_model`): how many
        #: of a match's full blocks an admission reuses; the rest (and the partial block) are recomputed.
        self.reuse_limit: Callable[[Match, int], int] | None = None
        #: ``callback(block, plan)`` just before a cached block is evicted from its tier (it is still at its slot;
        #: ``plan`` holds the moves decided so far in this call, not yet issued)
        self.on_evict: Callable[[Block, Plan], None] | None = None
        #: where a new block's object from the remote tier lands: ``Tier.GPU`` (straight into the block's slot),
        #: ``Tier.HOST`` (through a ring of :attr:`fetch_ring` host slots, then an onboard copy), or ``None`` (no
        #: remote tier). Admission plans a ``"fetch"`` move for every new full block after the reused prefix that
        #: could be reused (see :meth:`fetched`); a prefix of any length, as long as the sequence fits the GPU tier.
        self.fetch_tier: Tier | None = None
        self.fetch_ring = 8

        # tier -> free slots (a stack, lowest index on top so fresh pools fill from 0)
        self._free: dict[Tier, list[int]] = {t: list(range(caps[t] - 1, -1, -1)) for t in TIER_ORDER}
        self._gpu_free = self._free[Tier.GPU]  # the same list, without an Enum-keyed lookup on the hot path
        # tier -> priority -> block id -> block: cached blocks with refcount 0, least recently released first
        self._lru: dict[Tier, dict[int, collections.OrderedDict[int, Block]]] = {t: {} for t in TIER_ORDER}
        self._lookup: dict[ContentKey, Block] = {}  # content key -> the cached block
        # content key -> the checksum of a block that left the lookup (a block adopted from the file tier under that
        # key gets it back), or _REFUSED (never adopt that key again: its bytes failed an integrity check); bounded
        self._ghosts: collections.OrderedDict[ContentKey, Any] = collections.OrderedDict()
        self._ghost_limit = 4 * sum(self.capacity.values()) + 64
        self._roots: dict[ContentKey, Block] = {}  # cached first blocks (children of the root key)
        self._seqs: dict[int, _Sequence] = {}  # seq id -> live sequence
        self._free_seq_slots = list(range(max_seqs))  # a heap: lowest free slot first
        self._next_seq = 0
        self._ids = itertools.count()
        self._tick = 0

        self._requests = self._tokens_requested = self._tokens_reused = 0
        self._hits = {t.value: 0 for t in TIER_ORDER}
        self._partial_hits = self._partial_tokens = self._allocated = self._unreachable = self._adopted = 0
        self._fetched = 0
        self._evictions: dict[str, int] = {}

    # ------------------------------------------------------------------------------------ lookup

    def match(self, tokens: Sequence[int] | np.ndarray) -> Match:
        """The longest cached prefix of ``tokens`` in any tier (claims nothing, changes nothing).

        Raises:
            TypeError: ``tokens`` is not a 1-D sequence of integers.
        """
        return self._match(as_token_array(tokens))

    def _match(self, tokens: np.ndarray, keys: Sequence[ContentKey] | None = None) -> Match:
        tpb = self.tokens_per_block
        n = len(tokens)
        max_reuse = n - 1 if self.compute_last_token else n
        if keys is None:
            keys = self.hasher.chain(tokens)
        blocks: list[Block] = []
        by_tier = {t.value: 0 for t in TIER_ORDER}
        for i, key in enumerate(keys):
            if (i + 1) * tpb > max_reuse:
                break
            block = self._lookup.get(key)
            if block is None:
                if self.file_index is None:
                    break
                block = self._adopt(key, keys[i - 1] if i else self.hasher.root, tokens[i * tpb : (i + 1) * tpb])
                if block is None:
                    break
            blocks.append(block)
            by_tier[block.tier.value] += 1  # type: ignore[union-attr]
        m = len(blocks)
        partial: tuple[Block, int] | None = None
        budget = max_reuse - m * tpb
        if budget > 0:
            children = blocks[-1].children if blocks else self._roots
            rest = tokens[m * tpb : m * tpb + min(tpb, budget)]
            best, best_n = None, 0
            for child in children.values():
                # A file block would need a bounce through host for a partial read; it is not worth it
                # for less than one block of tokens.
                if child.tier is Tier.FILE:
                    continue
                k = min(len(child.tokens), len(rest))
                if k <= best_n:
                    continue
                eq = child.tokens[:k] == rest[:k]
                common = k if eq.all() else int(np.argmin(eq))
                if common > best_n:
                    best, best_n = child, common
            if best is not None:
                partial = (best, best_n)
        return Match(tuple(blocks), partial, tuple(keys), m * tpb + (partial[1] if partial else 0), by_tier)

    def _limited(self, match: Match, num_tokens: int) -> Match:
        """``match`` cut to the blocks :attr:`reuse_limit` says are worth reusing (all of them without a limit)."""
        if self.reuse_limit is None or not match.blocks:
            return match
        keep = max(0, min(len(match.blocks), int(self.reuse_limit(match, num_tokens))))
        if keep == len(match.blocks):
            return match
        blocks = match.blocks[:keep]
        by_tier = {t.value: 0 for t in TIER_ORDER}
        for b in blocks:
            by_tier[b.tier.value] += 1  # type: ignore[union-attr]
        return Match(blocks, None, match.keys, keep * self.tokens_per_block, by_tier, cut=True)

    def _adopt(self, key: ContentKey, parent_key: ContentKey, tokens: np.ndarray) -> Block | None:
        """Warm restart: a block of an earlier run that the file tier's index holds under ``key``, now cached.

        The parent (``parent_key``) is cached: the walk matched it one step before. The key is the hash chain
        of every token before and in the block, salted with the layout and model, so a hit is this prefix's
        block; its bytes are verified against the key and checksum when it is read.
        """
        assert self.file_index is not None
        if self._ghosts.get(key) is _REFUSED:
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

    def lookup(self, key: ContentKey) -> Block | None:
        """The cached block with content key ``key``, if any."""
        return self._lookup.get(key)

    # ------------------------------------------------------------------------------------ admission

    def admit(self, requests: Iterable[object]) -> tuple[list[Admission], Plan]:
        """Admit a batch: claim every reusable block of every request, then onboard and allocate.

        Args:
            requests: :class:`Request` objects or plain token-id sequences.

        Returns:
            One :class:`Admission` per request (its own figures) and the plan of copies to issue.

        Raises:
            ValueError: an empty batch, an empty request, a request longer than ``max_blocks_per_seq``
                blocks, a priority out of range.
            TypeError: tokens that are not integers.
            CacheFullError: the batch does not fit in the GPU tier after evicting every unclaimed block,
                or there are not enough free sequence slots. Nothing was changed.
        """
        reqs = self._validate(requests)
        matches = [self._limited(self._match(tokens), len(tokens)) for tokens, _ in reqs]
        self._check_fits(reqs, matches)
        # Phase 1: claim every matched block of every request before anything can evict.
        for match, (_, prio) in zip(matches, reqs, strict=True):
            self._claim(match, prio)
        # Phase 2: onboard and allocate; claimed blocks are out of every LRU, so no eviction touches them.
        plan = Plan()
        admissions = [
            self._realize(tokens, prio, match, plan) for (tokens, prio), match in zip(reqs, matches, strict=True)
        ]
        return admissions, plan

    def _admit_one_phase(self, requests: Iterable[object]) -> tuple[list[Admission], Plan]:
        """Claim, onboard and allocate request by request: the order that loses planned reuse.

        A later request's host blocks may be evicted by an earlier one's onboarding. Only the naive baseline
        of :mod:`tiered_kv.tools.baselines` uses it.
        """
        reqs = self._validate(requests)
        plan = Plan()
        admissions: list[Admission] = []
        try:
            for tokens, prio in reqs:
                match = self._limited(self._match(tokens), len(tokens))
                self._check_fits([(tokens, prio)], [match])
                self._claim(match, prio)
                admissions.append(self._realize(tokens, prio, match, plan))
        except CacheFullError:
            for a in admissions:
                self.free(a.seq_id)
            raise
        return admissions, plan

    def _validate(self, requests: Iterable[object]) -> list[tuple[np.ndarray, int]]:
        if isinstance(requests, (Request, str, bytes)):
            raise TypeError("requests must be a sequence of requests (wrap a single request in a list)")
        out: list[tuple[np.ndarray, int]] = []
        for i, raw in enumerate(requests):
            req = Request.coerce(raw)
            tokens = as_token_array(req.tokens, f"request {i} tokens")
            if tokens.size == 0:
                raise ValueError(f"request {i} has no tokens; a sequence needs at least one")
            blocks = -(-tokens.size // self.tokens_per_block)
            if blocks > self.max_blocks_per_seq:
                raise ValueError(
                    f"request {i} has {tokens.size} tokens ({blocks} blocks), more than a sequence may hold "
                    f"({self.max_blocks_per_seq} blocks of {self.tokens_per_block} tokens)"
                )
            out.append((tokens, _check_priority(req.priority)))
        if not out:
            raise ValueError("the batch is empty")
        return out

    def _check_fits(self, reqs: Sequence[tuple[np.ndarray, int]], matches: Sequence[Match]) -> None:
        if len(reqs) > len(self._free_seq_slots):
            raise CacheFullError(
                f"the batch needs {len(reqs)} sequence slots but only {len(self._free_seq_slots)} of "
                f"{self.max_seqs} are free"
            )
        tpb = self.tokens_per_block
        claimed: dict[int, Block] = {}  # block id -> every block the batch claims
        reused: dict[int, Block] = {}  # block id -> full blocks reused in place (onboarded if not on the GPU)
        for match in matches:
            for b in match.blocks:
                reused[b.id] = b
            if match.partial is not None:
                claimed[match.partial[0].id] = match.partial[0]
        claimed.update(reused)
        # GPU blocks the batch needs: distinct reused blocks not on the GPU yet, plus new blocks.
        need = sum(1 for b in reused.values() if b.tier is not Tier.GPU)
        need += sum(-(-len(tokens) // tpb) - len(m.blocks) for (tokens, _), m in zip(reqs, matches, strict=True))
        # Supply: free slots plus every unclaimed evictable GPU block (eviction of one always succeeds:
        # it is offloaded, or dropped when nothing below can take it). Partial sources count as claimed
        # although they are released during phase 2: conservative, so phase 2 never runs out.
        evictable = sum(len(d) for d in self._lru[Tier.GPU].values())
        evictable -= sum(1 for b in claimed.values() if b.tier is Tier.GPU and b.refcount == 0)
        supply = len(self._free[Tier.GPU]) + evictable
        if need > supply:
            raise CacheFullError(
                f"the batch needs {need} GPU blocks but at most {supply} can be made free "
                f"({len(self._free[Tier.GPU])} free + {evictable} evictable of {self.capacity[Tier.GPU]})"
            )

    def _claim(self, match: Match, priority: int) -> None:
        for b in match.blocks:
            self._ref(b)
            b.priority = priority
        if match.partial is not None:
            self._ref(match.partial[0])

    def _ref(self, block: Block) -> None:
        if block.refcount == 0:
            self._lru_remove(block)
        block.refcount += 1

    def _realize(self, tokens: np.ndarray, priority: int, match: Match, plan: Plan) -> Admission:
        tpb = self.tokens_per_block
        seq_slot = heapq.heappop(self._free_seq_slots)
        seq = _Sequence(self._next_seq, seq_slot, tokens.tolist(), priority)
        self._next_seq += 1
        for b in match.blocks:
            if b.tier is not Tier.GPU:
                self._move(b, Tier.GPU, "onboard", plan)
            seq.blocks.append(b)
        m = len(match.blocks)
        seq.keys = list(match.keys)
        total = -(-len(tokens) // tpb)
        for i in range(m, total):
            parent_key = seq.keys[i - 1] if i else self.hasher.root
            block = self._allocate(parent_key, tokens[i * tpb : (i + 1) * tpb], priority, plan)
            if i == m and match.partial is not None:
                src, n = match.partial
                plan.moves.append(Move("partial", src.tier, src.slot, Tier.GPU, block.slot, n, block, src))  # type: ignore[arg-type]
                self._unref(src)  # the claim only had to last until the copy was planned
            seq.blocks.append(block)
        if self.fetch_tier is not None and not match.cut:
            self._plan_fetches(seq, m, plan)
        # New blocks become matchable only once committed: their KV is not written yet.
        seq.registered = m
        seq.committed = match.tokens_reused
        self._seqs[seq.seq_id] = seq

        partial_n = match.partial[1] if match.partial else 0
        self._requests += 1
        self._tokens_requested += len(tokens)
        self._tokens_reused += match.tokens_reused
        for tier, count in match.by_tier.items():
            self._hits[tier] += count
        if partial_n:
            self._partial_hits += 1
            self._partial_tokens += partial_n
        self._allocated += total - m
        page_table = tuple(b.slot for b in seq.blocks)
        self._notify(seq, page_table)
        return Admission(
            seq.seq_id, seq_slot, len(tokens), match.tokens_reused, dict(match.by_tier), partial_n, total - m,
            page_table,
        )

    def _plan_fetches(self, seq: _Sequence, m: int, plan: Plan) -> None:
        """Plan the remote reads of a new sequence's full blocks ``m..`` that could be reused (see :attr:`fetch_tier`).

        Through the host, each block's object lands in a ring slot and is onboarded from there; a ring slot is
        written again only after the onboard copy before it read it (plan order, kept by the engine's fences). The
        ring slots go back to the free list at once: later moves of the plan touching them are ordered after these.
        """
        tpb = self.tokens_per_block
        usable = (len(seq.tokens) - 1 if self.compute_last_token else len(seq.tokens)) // tpb
        if usable <= m:
            return
        ring: list[int] = []
        if self.fetch_tier is Tier.HOST:
            for _ in range(min(self.fetch_ring, usable - m)):
                slot = self._take_slot(Tier.HOST, plan)
                if slot is None:
                    break
                ring.append(slot)
            if not ring:
                return
        for i in range(m, usable):
            block, key = seq.blocks[i], seq.keys[i]
            if not ring:
                plan.moves.append(
                    Move("fetch", Tier.REMOTE, len(plan.moves), Tier.GPU, block.slot, None, block, key=key)
                )
                continue
            slot = ring[(i - m) % len(ring)]
            plan.moves.append(Move("fetch", Tier.REMOTE, len(plan.moves), Tier.HOST, slot, None, block, key=key))
            plan.moves.append(Move("fetch", Tier.HOST, slot, Tier.GPU, block.slot, None, block))
        self._free[Tier.HOST].extend(ring)

    def fetched(self, seq_id: int, count: int) -> int:
        """Reuse the first ``count`` new blocks after a just-admitted sequence's reused prefix: their fetch landed.

        The caller saw every ``"fetch"`` move of those blocks complete with a verified object. They are committed
        (cached, matchable), a partial reuse of the first of them is superseded, and the reuse counters follow.
        Returns the tokens the sequence now reuses.

        Raises:
            ValueError: unknown sequence, ``count`` negative or past the blocks that could be reused.
        """
        seq = self._live(seq_id)
        tpb = self.tokens_per_block
        before = seq.committed
        m = before // tpb
        usable = (len(seq.tokens) - 1 if self.compute_last_token else len(seq.tokens)) // tpb
        if isinstance(count, bool) or not isinstance(count, int) or not 0 <= count <= usable - m:
            raise ValueError(f"count must be in 0..{max(0, usable - m)} (blocks that could be fetched), got {count!r}")
        if count == 0:
            return before
        if before % tpb:
            self._partial_hits -= 1
            self._partial_tokens -= before % tpb
        self._tokens_reused += (m + count) * tpb - before
        self._fetched += count
        return self.commit(seq_id, (m + count) * tpb)

    # ------------------------------------------------------------------------------------ lifecycle

    def append(self, seq_id: int, tokens: Sequence[int] | np.ndarray) -> tuple[tuple[int, ...], Plan]:
        """Append generated tokens to a live sequence; new GPU blocks are allocated as blocks fill.

        Returns:
            The sequence's page table and the plan of copies (evictions) to issue.

        Raises:
            ValueError: unknown or freed sequence, the sequence would exceed ``max_blocks_per_seq``.
            TypeError: tokens that are not integers.
            CacheFullError: the new blocks do not fit in the GPU tier after eviction. Nothing was changed.
        """
        seq = self._live(seq_id)
        new = as_token_array(tokens)
        plan = Plan()
        if new.size == 0:
            return tuple(b.slot for b in seq.blocks), plan
        tpb = self.tokens_per_block
        old_len = len(seq.tokens)
        total = -(-(old_len + new.size) // tpb)
        if total > self.max_blocks_per_seq:
            raise ValueError(
                f"sequence {seq_id} would hold {total} blocks, more than a sequence may hold "
                f"({self.max_blocks_per_seq})"
            )
        need = total - len(seq.blocks)
        supply = len(self._free[Tier.GPU]) + sum(len(d) for d in self._lru[Tier.GPU].values())
        if need > supply:
            raise CacheFullError(
                f"appending to sequence {seq_id} needs {need} GPU blocks but at most {supply} can be made free"
            )
        seq.tokens.extend(new.tolist())
        all_tokens = np.asarray(seq.tokens, dtype="<i8")
        parent = seq.keys[-1] if seq.keys else None
        seq.keys.extend(self.hasher.chain(all_tokens[len(seq.keys) * tpb :], parent))
        # Fill the partial tail block, if any (it is always this sequence's own block).
        if old_len % tpb:
            i = len(seq.blocks) - 1
            seq.blocks[-1].tokens = all_tokens[i * tpb : (i + 1) * tpb]
        for i in range(len(seq.blocks), total):
            parent_key = seq.keys[i - 1] if i else self.hasher.root
            seq.blocks.append(self._allocate(parent_key, all_tokens[i * tpb : (i + 1) * tpb], seq.priority, plan))
        self._allocated += need
        page_table = tuple(b.slot for b in seq.blocks)
        if need:
            self._notify(seq, page_table)
        return page_table, plan

    def free(self, seq_id: int) -> None:
        """Release a sequence: its cached blocks become reusable (evictable) cache, the others free slots.

        Blocks are released last to first, so a prefix's first blocks are evicted last. A partial tail
        block is cached too (keyed by its tokens), so a later request can reuse it by a partial copy.

        Raises:
            ValueError: unknown or already freed sequence. Nothing was changed.
        """
        seq = self._live(seq_id)
        del self._seqs[seq_id]
        tpb = self.tokens_per_block
        n = seq.committed
        if n % tpb:
            tail = seq.blocks[n // tpb]
            if tail.key is None and tail.refcount == 1:
                parent_key = seq.keys[n // tpb - 1] if n >= tpb else self.hasher.root
                tail.tokens = tail.tokens[: n % tpb]  # only the tokens whose KV was written
                self._register(tail, self.hasher.block_key(parent_key, tail.tokens))
        for block in reversed(seq.blocks):
            self._unref(block)
        heapq.heappush(self._free_seq_slots, seq.slot)
        self._notify(seq, None)

    def commit(self, seq_id: int, num_tokens: int | None = None) -> int:
        """Declare that the KV of the first ``num_tokens`` tokens (default: all so far) is written.

        The sequence's full blocks within them become matchable by other requests at once, and on
        :meth:`free` a partly committed block is cached as a partial block. Blocks never committed are
        never served to anyone (their content is unknown). Committing less than before is a no-op.

        Returns:
            The committed token count.

        Raises:
            ValueError: unknown sequence, ``num_tokens`` beyond the sequence's tokens or negative.
        """
        seq = self._live(seq_id)
        n = len(seq.tokens) if num_tokens is None else num_tokens
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)):
            raise TypeError(f"num_tokens must be an int, got {type(n).__name__}")
        if not 0 <= n <= len(seq.tokens):
            raise ValueError(f"num_tokens must be in 0..{len(seq.tokens)} (the sequence's tokens), got {n}")
        seq.committed = max(seq.committed, int(n))
        for i in range(seq.registered, seq.committed // self.tokens_per_block):
            self._register(seq.blocks[i], seq.keys[i])
            seq.registered = i + 1
        return seq.committed

    def set_priority(self, seq_id: int, priority: int) -> None:
        """Change the retention priority of a live sequence's blocks (takes effect when they are released).

        Raises:
            ValueError: unknown sequence or priority out of range.
        """
        seq = self._live(seq_id)
        prio = _check_priority(priority)
        seq.priority = prio
        for b in seq.blocks:
            b.priority = prio

    def evict(self, tier: Tier | str, count: int) -> Plan:
        """Evict up to ``count`` unclaimed cached blocks of ``tier`` (down the cascade), e.g. to make room ahead.

        Returns:
            The plan of copies; the freed slots go back to the tier's free list.
        """
        t = Tier.coerce(tier)
        plan = Plan()
        for _ in range(count):
            victim = self._victim(t)
            if victim is None:
                break
            self._free[t].append(self._evict(victim, plan))
        return plan

    # ------------------------------------------------------------------------------------ inspection

    def committed_tokens(self, seq_id: int) -> int:
        """Tokens of a live sequence whose KV is committed (reused at admission, or declared by :meth:`commit`)."""
        return self._live(seq_id).committed

    def page_table(self, seq_id: int) -> tuple[int, ...]:
        """GPU block indices of a live sequence, in token order."""
        return tuple(b.slot for b in self._live(seq_id).blocks)

    def sequence_tokens(self, seq_id: int) -> np.ndarray:
        """Every token id of a live sequence so far (int64)."""
        return np.asarray(self._live(seq_id).tokens, dtype="<i8")

    def sequence_blocks(self, seq_id: int) -> tuple[Block, ...]:
        """The blocks of a live sequence, in order."""
        return tuple(self._live(seq_id).blocks)

    def sequence_slot(self, seq_id: int) -> int:
        """The page-table slot of a live sequence."""
        return self._live(seq_id).slot

    @property
    def live_sequences(self) -> tuple[int, ...]:
        """Ids of the live sequences."""
        return tuple(self._seqs)

    def free_blocks(self, tier: Tier | str) -> int:
        """Blocks of ``tier`` that hold nothing."""
        return len(self._free[Tier.coerce(tier)])

    def evictable_blocks(self, tier: Tier | str) -> int:
        """Blocks of ``tier`` that may be evicted (cached, reference count zero)."""
        return sum(len(d) for d in self._lru[Tier.coerce(tier)].values())

    def cached_blocks(self) -> Iterable[Block]:
        """Every block in the prefix lookup."""
        return self._lookup.values()

    def statistics(self) -> BlockStatistics:
        """A snapshot: capacity, free, cached and evictable blocks per tier, and counters."""
        cap = {t.value: self.capacity[t] for t in TIER_ORDER}
        free = {t.value: len(self._free[t]) for t in TIER_ORDER}
        cached = {t.value: self.evictable_blocks(t) for t in TIER_ORDER}
        in_use = {t: cap[t] - free[t] - cached[t] for t in cap}
        return BlockStatistics(
            capacity=cap,
            free=free,
            cached=cached,
            in_use=in_use,
            live_sequences=len(self._seqs),
            requests=self._requests,
            tokens_requested=self._tokens_requested,
            tokens_reused=self._tokens_reused,
            hits=dict(self._hits),
            partial_hits=self._partial_hits,
            partial_tokens=self._partial_tokens,
            blocks_allocated=self._allocated,
            evictions=dict(self._evictions),
            unreachable_dropped=self._unreachable,
            adopted=self._adopted,
            fetched=self._fetched,
        )

    def __repr__(self) -> str:
        tiers = ", ".join(f"{t.value}:{self.capacity[t] - len(self._free[t])}/{self.capacity[t]}" for t in self.tiers)
        return f"<BlockManager [seqs:{len(self._seqs)}, cached:{len(self._lookup)}] used({tiers})>"

    def check(self) -> None:
        """Verify every internal invariant; raises ``AssertionError`` naming the first broken one (tests)."""
        occupied: dict[tuple[Tier, int], Block] = {}
        blocks: dict[int, Block] = {}
        for seq in self._seqs.values():
            for b in seq.blocks:
                blocks[b.id] = b
        blocks.update((b.id, b) for b in self._lookup.values())
        refs: collections.Counter[int] = collections.Counter(b.id for s in self._seqs.values() for b in s.blocks)
        for b in blocks.values():
            assert b.tier is not None, f"{b} is reachable but gone"
            assert 0 <= b.slot < self.capacity[b.tier], f"{b} has a slot out of range"
            where = (b.tier, b.slot)
            assert where not in occupied, f"{b} and {occupied[where]} share {b.tier.value} slot {b.slot}"
            occupied[where] = b
            assert b.refcount >= 0, f"{b} has a negative reference count"
            assert b.refcount == refs[b.id], f"{b} refcount {b.refcount} != {refs[b.id]} sequences holding it"
            in_lru = b.id in self._lru[b.tier].get(b.priority, {})
            assert in_lru == (b.cached and b.refcount == 0), f"{b} LRU membership {in_lru} is wrong"
            if b.refcount:
                assert b.tier is Tier.GPU, f"{b} is held by a sequence but not on the GPU"
        for t in TIER_ORDER:
            free = self._free[t]
            assert len(set(free)) == len(free), f"{t.value} free list has duplicates"
            for s in free:
                assert (t, s) not in occupied, f"{t.value} slot {s} is both free and used by {occupied[(t, s)]}"
            used = sum(1 for (tt, _) in occupied if tt is t)
            assert used + len(free) == self.capacity[t], (
                f"{t.value}: {used} used + {len(free)} free != {self.capacity[t]} (lost)"
            )
            for prio, d in self._lru[t].items():
                for b in d.values():
                    ok = b.tier is t and b.priority == prio and b.refcount == 0 and b.cached
                    assert ok, f"{b} misfiled in the {t.value} LRU"
        for key, b in self._lookup.items():
            assert b.cached and b.key == key, f"{b} filed under a key that is not its own"
            if b.parent_key == self.hasher.root:
                assert self._roots.get(key) is b, f"{b} is not linked under the root"
            else:
                parent = self._lookup.get(b.parent_key)
                assert parent is not None, f"{b} is cached but its parent is not (unreachable)"
                assert parent.children.get(key) is b, f"{b} is not linked under its parent"
            for ck, child in b.children.items():
                assert self._lookup.get(ck) is child, f"{child} is a child of {b} but not cached"
        assert set(self._roots) <= set(self._lookup), "a root child is not cached"

    # ------------------------------------------------------------------------------------ internals

    def _live(self, seq_id: int) -> _Sequence:
        if isinstance(seq_id, bool) or not isinstance(seq_id, (int, np.integer)):
            raise TypeError(f"sequence id must be an int, got {type(seq_id).__name__}")
        seq = self._seqs.get(int(seq_id))
        if seq is None:
            if 0 <= seq_id < self._next_seq:
                raise ValueError(f"sequence {seq_id} was already freed")
            raise ValueError(f"unknown sequence id {seq_id}")
        return seq

    def _notify(self, seq: _Sequence, page_table: tuple[int, ...] | None) -> None:
        if self.on_page_table is not None:
            self.on_page_table(seq.slot, page_table)

    def _allocate(self, parent_key: ContentKey, tokens: np.ndarray, priority: int, plan: Plan) -> Block:
        free = self._gpu_free
        slot = free.pop() if free else self._take_slot(Tier.GPU, plan)  # fast path: no eviction needed
        assert slot is not None, "capacity was checked before any change"
        return Block(next(self._ids), Tier.GPU, slot, parent_key, tokens, priority)

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

    # ------------------------------------------------------------------------------------ blocks from outside

    def reserve(self, tier: Tier | str, count: int) -> tuple[list[int], Plan]:
        """Take up to ``count`` slots of ``tier`` for data written from outside the admission path (a spill on close).

        Free slots first, then slots of evicted blocks (down the cascade, as for any allocation). Returns the
        slots (possibly fewer) and the plan of copies the evictions need. Give back the slots not used with
        :meth:`unreserve`.
        """
        t_ = Tier.coerce(tier)
        plan = Plan()
        slots: list[int] = []
        for _ in range(max(0, count)):
            slot = self._take_slot(t_, plan)
            if slot is None:
                break
            slots.append(slot)
        return slots, plan

    def unreserve(self, tier: Tier | str, slots: Iterable[int]) -> None:
        """Return reserved slots unused."""
        self._free[Tier.coerce(tier)].extend(slots)

    def invalidate(self, block: Block) -> None:
        """Take a block whose data is wrong (a failed copy) out of the lookup, with its subtree.

        An unused block's slot is freed; a used one stays with its sequences (which must fail) and is
        freed when they release it.
        """
        if block.tier is None or not block.cached:
            return
        if block.refcount == 0:
            self._lru_remove(block)
            self._uncache(block, Plan())
            self._release_slot(block)
        else:
            self._uncache(block, Plan())

    def refuse(self, block: Block) -> None:
        """Drop a block whose bytes failed an integrity check, and never adopt its key from the file tier again."""
        key = block.key
        self.invalidate(block)
        if key is not None:
            self._ghost(key, _REFUSED)

    def _ghost(self, key: ContentKey, value: Any) -> None:
        ghosts = self._ghosts
        if ghosts.get(key) is _REFUSED:
            return
        ghosts[key] = value
        ghosts.move_to_end(key)
        while len(ghosts) > self._ghost_limit:
            ghosts.popitem(last=False)

    def file_slot_dropped(self, slot: int, key: ContentKey) -> Block | None:
        """The file tier gave up ``slot`` (which held ``key``): take the block recorded there out of the lookup.

        Called in order, on the loop, before any later plan (:mod:`tiered_kv.slotstate`), so the manager never
        plans a read of a slot the tier no longer holds. Returns the block dropped, if the manager had one there.
        """
        block = self._lookup.get(key)
        if block is None or block.tier is not Tier.FILE or block.slot != slot:
            return None
        self.invalidate(block)
        return block

    def _count(self, what: str) -> None:
        self._evictions[what] = self._evictions.get(what, 0) + 1

