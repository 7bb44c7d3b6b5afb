"""Admission planning: match a batch against the cache, claim what it reuses, then onboard, allocate and fetch.

Two-phase admission: every reusable block of every request of the batch is matched and *claimed* first (claimed
blocks leave the LRUs), then blocks are onboarded and allocated. A one-phase order (claim, onboard, allocate, request
by request) lets onboarding for one request evict host blocks that a later request of the same batch was counted
on. Whether the batch fits is decided before anything is claimed, so a batch that does not fit changes nothing.

Hybrid prefill (:attr:`~tiered_kv.blocks.records.Request.compute_blocks`): the request's first matched blocks (after
:attr:`AdmissionPlanner.reuse_limit` has cut the match) are neither claimed nor onboarded; each gets a fresh GPU block,
allocated like a new block, that the caller writes. A fresh leading block is never offered to the lookup (the
sequence's ``registered`` count starts past it, so no commit or free can register it): its cached copy in whatever
tier stays the one a later request matches.

Every copy an admission needs (offloads and spills of its evictions, onboards, partial copies, remote fetches) is
appended to one :class:`~tiered_kv.blocks.records.Plan`, in the order the copies must run, and returned whole.
"""

from __future__ import annotations

import collections
import dataclasses
import heapq
from collections.abc import Callable, Iterable, Sequence

import numpy as np

from ..keys import ContentKey, KeyHasher, as_token_array
from ..pools import Tier
from .eviction import EvictingStore
from .records import (
    TIER_ORDER,
    Admission,
    Block,
    CacheFullError,
    LiveSequence,
    Match,
    Move,
    PageTableListener,
    Plan,
    Request,
    check_priority,
)

__all__ = ["AdmissionPlanner"]


class AdmissionPlanner(EvictingStore):
    """An :class:`~tiered_kv.blocks.eviction.EvictingStore` with live sequences and the planning of their admission.

    Args:
        hasher, capacity, file_index, drop_below_priority: as for :class:`~tiered_kv.blocks.eviction.EvictingStore`.
        max_seqs, max_blocks_per_seq, compute_last_token, on_page_table: as for
            :class:`~tiered_kv.blocks.manager.BlockManager` (checked by the caller; ``max_blocks_per_seq`` at most the
            GPU capacity).
    """

    def __init__(
        self,
        hasher: KeyHasher,
        capacity: dict[Tier, int],
        file_index: Callable[[ContentKey], int | None] | None,
        drop_below_priority: int,
        *,
        max_seqs: int,
        max_blocks_per_seq: int,
        compute_last_token: bool,
        on_page_table: PageTableListener | None,
    ) -> None:
        super().__init__(hasher, capacity, file_index, drop_below_priority)
        self.max_seqs = max_seqs
        self.max_blocks_per_seq = max_blocks_per_seq
        self.compute_last_token = compute_last_token
        self.on_page_table = on_page_table
        #: ``reuse_limit(match, prompt_tokens) -> blocks`` (cost-aware reuse, :mod:`tiered_kv.cost_model`): how many
        #: of a match's full blocks an admission reuses; the rest (and the partial block) are recomputed.
        self.reuse_limit: Callable[[Match, int], int] | None = None
        #: where a new block's object from the remote tier lands: ``Tier.GPU`` (straight into the block's slot),
        #: ``Tier.HOST`` (through a ring of :attr:`fetch_ring` host slots, then an onboard copy), or ``None`` (no
        #: remote tier). Admission plans a ``"fetch"`` move for every new full block after the reused prefix that
        #: could be reused (see :meth:`BlockManager.fetched <tiered_kv.blocks.manager.BlockManager.fetched>`); a
        #: prefix of any length, as long as the sequence fits the GPU tier.
        self.fetch_tier: Tier | None = None
        self.fetch_ring = 8
        self._seqs: dict[int, LiveSequence] = {}  # seq id -> live sequence
        self._free_seq_slots = list(range(max_seqs))  # a heap: lowest free slot first
        self._next_seq = 0
        self._requests = self._tokens_requested = self._tokens_reused = 0
        self._hits = {t.value: 0 for t in TIER_ORDER}
        self._partial_hits = self._partial_tokens = self._allocated = 0
        self._fetched = 0

    # ------------------------------------------------------------------------------------ matching

    def _match(self, tokens: np.ndarray, keys: Sequence[ContentKey] | None = None) -> Match:
        """The longest cached prefix of ``tokens`` (adopting file-index hits as it walks) and the best partial block."""
        tpb = self.tokens_per_block
        n = len(tokens)
        max_reuse = n - 1 if self.compute_last_token else n
        if keys is None:
            keys = self.hasher.chain(tokens)
        blocks: list[Block] = []
        lookup = self._lookup
        for i, key in enumerate(keys[: max_reuse // tpb]):
            block = lookup.get(key)
            if block is None:
                if self.file_index is None:
                    break
                block = self._adopt(key, keys[i - 1] if i else self.hasher.root, tokens[i * tpb : (i + 1) * tpb])
                if block is None:
                    break
            blocks.append(block)
        counts = collections.Counter(b.tier for b in blocks)
        by_tier = {t.value: counts[t] for t in TIER_ORDER}
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

    def _computing(self, match: Match, compute_blocks: int) -> Match:
        """``match`` whose first ``compute_blocks`` full blocks (at most all of them) the request computes.

        Those blocks leave ``tokens_reused`` and ``by_tier``; when they are all of the full blocks the partial reuse
        is dropped too (nothing of the prefix is reused).
        """
        c = min(compute_blocks, len(match.blocks))
        if c == 0:
            return match
        tpb = self.tokens_per_block
        by_tier = {t.value: 0 for t in TIER_ORDER}
        for b in match.blocks[c:]:
            by_tier[b.tier.value] += 1  # type: ignore[union-attr]
        partial = match.partial if c < len(match.blocks) else None
        reused = (len(match.blocks) - c) * tpb + (partial[1] if partial else 0)
        return dataclasses.replace(match, partial=partial, tokens_reused=reused, by_tier=by_tier, compute_blocks=c)

    # ------------------------------------------------------------------------------------ admission

    def _validate(self, requests: Iterable[object]) -> list[tuple[np.ndarray, int, int]]:
        """The batch as ``(tokens, priority, compute_blocks)``, every request checked before anything changes."""
        if isinstance(requests, (Request, str, bytes)):
            raise TypeError("requests must be a sequence of requests (wrap a single request in a list)")
        out: list[tuple[np.ndarray, int, int]] = []
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
            compute = req.compute_blocks
            if isinstance(compute, bool) or not isinstance(compute, (int, np.integer)):
                raise TypeError(f"request {i} compute_blocks must be an int, got {type(compute).__name__}")
            if compute < 0:
                raise ValueError(f"request {i} compute_blocks must be >= 0, got {compute}")
            out.append((tokens, check_priority(req.priority), int(compute)))
        if not out:
            raise ValueError("the batch is empty")
        return out

    def _check_fits(self, reqs: Sequence[tuple[np.ndarray, int, int]], matches: Sequence[Match]) -> None:
        """Raise :class:`CacheFullError` unless the batch fits after evicting every block it does not claim."""
        if len(reqs) > len(self._free_seq_slots):
            raise CacheFullError(
                f"the batch needs {len(reqs)} sequence slots but only {len(self._free_seq_slots)} of "
                f"{self.max_seqs} are free"
            )
        tpb = self.tokens_per_block
        claimed: dict[int, Block] = {}  # block id -> every block the batch claims
        reused: dict[int, Block] = {}  # block id -> full blocks reused in place (onboarded if not on the GPU)
        for match in matches:
            for b in match.blocks[match.compute_blocks :]:  # leading computed blocks are not claimed
                reused[b.id] = b
            if match.partial is not None:
                claimed[match.partial[0].id] = match.partial[0]
        claimed.update(reused)
        # GPU blocks the batch needs: distinct reused blocks not on the GPU yet, plus new blocks (the fresh leading
        # blocks of computed matched blocks included).
        gpu = Tier.GPU
        need = sum(1 for b in reused.values() if b.tier is not gpu)
        need += sum(
            -(-len(req[0]) // tpb) - len(m.blocks) + m.compute_blocks for req, m in zip(reqs, matches, strict=True)
        )
        # Supply: free slots plus every unclaimed evictable GPU block (eviction of one always succeeds:
        # it is offloaded, or dropped when nothing below can take it). Partial sources count as claimed
        # although they are released during phase 2: conservative, so phase 2 never runs out.
        evictable = sum(len(d) for d in self._lru[Tier.GPU].values())
        evictable -= sum(1 for b in claimed.values() if b.tier is gpu and b.refcount == 0)
        supply = len(self._free[Tier.GPU]) + evictable
        if need > supply:
            raise CacheFullError(
                f"the batch needs {need} GPU blocks but at most {supply} can be made free "
                f"({len(self._free[Tier.GPU])} free + {evictable} evictable of {self.capacity[Tier.GPU]})"
            )

    def _claim(self, match: Match, priority: int) -> None:
        """Phase 1 for one request: hold its reused blocks (out of every LRU); its full blocks take its priority.

        The leading blocks it computes (``match.compute_blocks``) are not held.
        """
        for b in match.blocks[match.compute_blocks :]:
            self._ref(b)
            b.priority = priority
        if match.partial is not None:
            self._ref(match.partial[0])

    def _realize(self, tokens: np.ndarray, priority: int, match: Match, plan: Plan) -> Admission:
        """Phase 2 for one request: its live sequence, reused blocks onboarded, new blocks allocated and fetched."""
        tpb = self.tokens_per_block
        seq_slot = heapq.heappop(self._free_seq_slots)
        seq = LiveSequence(self._next_seq, seq_slot, tokens.tolist(), priority)
        self._next_seq += 1
        seq.keys = list(match.keys)
        c = match.compute_blocks
        for i, b in enumerate(match.blocks):
            if i < c:  # computed by the caller: a fresh private block, the cached one left alone
                parent_key = seq.keys[i - 1] if i else self.hasher.root
                b = self._allocate(parent_key, tokens[i * tpb : (i + 1) * tpb], priority, plan)
            elif b.tier is not Tier.GPU:
                self._move(b, Tier.GPU, "onboard", plan)
            seq.blocks.append(b)
        m = len(match.blocks)
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
        # New blocks become matchable only once committed: their KV is not written yet. The fresh leading blocks are
        # below ``registered`` (never offered to the lookup) and count as committed (commit and free start past them).
        seq.registered = m
        seq.committed = c * tpb + match.tokens_reused
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
        self._allocated += total - m + c
        page_table = tuple(b.slot for b in seq.blocks)
        self._notify(seq, page_table)
        return Admission(
            seq.seq_id,
            seq_slot,
            len(tokens),
            match.tokens_reused,
            dict(match.by_tier),
            partial_n,
            total - m + c,
            page_table,
            c * tpb,
        )

    def _plan_fetches(self, seq: LiveSequence, m: int, plan: Plan) -> None:
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

    def _notify(self, seq: LiveSequence, page_table: tuple[int, ...] | None) -> None:
        if self.on_page_table is not None:
            self.on_page_table(seq.slot, page_table)
