"""The block manager: synchronous bookkeeping of cached KV blocks across GPU, host and file tiers.

:class:`BlockManager` is the facade over the layers of :mod:`tiered_kv.blocks`: its public methods validate their
arguments and capacity before changing anything, then decide with the layers below (the lookup tree and slots of
:mod:`~tiered_kv.blocks.store`, the eviction cascade of :mod:`~tiered_kv.blocks.eviction`, the admission planning of
:mod:`~tiered_kv.blocks.admission`) and return a :class:`~tiered_kv.blocks.records.Plan` of copies, in order, for the
async layer (:mod:`tiered_kv.cache`) to issue. Every method is synchronous (no awaits, no device work), which keeps
the manager property-testable; :meth:`BlockManager.check` verifies the invariants every layer keeps.
"""

from __future__ import annotations

import collections
import heapq
from collections.abc import Callable, Iterable, Mapping, Sequence

import numpy as np

from ..keys import ContentKey, KeyHasher, as_token_array
from ..pools import Tier
from .admission import AdmissionPlanner
from .records import (
    MIN_PRIORITY,
    TIER_ORDER,
    Admission,
    Block,
    BlockStatistics,
    CacheFullError,
    LiveSequence,
    Match,
    PageTableListener,
    Plan,
    check_priority,
)
from .store import REFUSED

__all__ = ["BlockManager"]


class BlockManager(AdmissionPlanner):
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
        super().__init__(
            hasher,
            caps,
            file_index,
            check_priority(drop_below_priority),
            max_seqs=max_seqs,
            max_blocks_per_seq=min(max_blocks_per_seq, caps[Tier.GPU]),
            compute_last_token=bool(compute_last_token),
            on_page_table=on_page_table,
        )

    # ------------------------------------------------------------------------------------ lookup

    def match(self, tokens: Sequence[int] | np.ndarray) -> Match:
        """The longest cached prefix of ``tokens`` in any tier (claims nothing, changes nothing).

        Raises:
            TypeError: ``tokens`` is not a 1-D sequence of integers.
        """
        return self._match(as_token_array(tokens))

    def lookup(self, key: ContentKey) -> Block | None:
        """The cached block with content key ``key``, if any."""
        return self._lookup.get(key)

    # ------------------------------------------------------------------------------------ admission

    def admit(self, requests: Iterable[object]) -> tuple[list[Admission], Plan]:
        """Admit a batch: claim every reusable block of every request, then onboard and allocate.

        Args:
            requests: :class:`Request` objects or plain token-id sequences. A request's ``compute_blocks`` leading
                matched blocks are left where they are; fresh GPU blocks take their place (see
                :attr:`Request.compute_blocks`).

        Returns:
            One :class:`Admission` per request (its own figures) and the plan of copies to issue.

        Raises:
            ValueError: an empty batch, an empty request, a request longer than ``max_blocks_per_seq``
                blocks, a priority out of range, a negative ``compute_blocks``.
            TypeError: tokens, or ``compute_blocks``, that are not integers.
            CacheFullError: the batch does not fit in the GPU tier after evicting every unclaimed block,
                or there are not enough free sequence slots. Nothing was changed.
        """
        reqs = self._validate(requests)
        matches = [self._computing(self._limited(self._match(tokens), len(tokens)), c) for tokens, _, c in reqs]
        self._check_fits(reqs, matches)
        # Phase 1: claim every reused block of every request before anything can evict.
        for match, (_, prio, _) in zip(matches, reqs, strict=True):
            self._claim(match, prio)
        # Phase 2: onboard and allocate; claimed blocks are out of every LRU, so no eviction touches them.
        plan = Plan()
        admissions = [
            self._realize(tokens, prio, match, plan) for (tokens, prio, _), match in zip(reqs, matches, strict=True)
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
            for tokens, prio, compute in reqs:
                match = self._computing(self._limited(self._match(tokens), len(tokens)), compute)
                self._check_fits([(tokens, prio, compute)], [match])
                self._claim(match, prio)
                admissions.append(self._realize(tokens, prio, match, plan))
        except CacheFullError:
            for a in admissions:
                self.free(a.seq_id)
            raise
        return admissions, plan

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
        prio = check_priority(priority)
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
            self._ghost(key, REFUSED)

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

    def _live(self, seq_id: int) -> LiveSequence:
        if isinstance(seq_id, bool) or not isinstance(seq_id, (int, np.integer)):
            raise TypeError(f"sequence id must be an int, got {type(seq_id).__name__}")
        seq = self._seqs.get(int(seq_id))
        if seq is None:
            if 0 <= seq_id < self._next_seq:
                raise ValueError(f"sequence {seq_id} was already freed")
            raise ValueError(f"unknown sequence id {seq_id}")
        return seq
