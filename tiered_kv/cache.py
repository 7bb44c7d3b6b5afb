"""``TieredKVCache``: what a server calls -- prefix reuse across GPU, host and file tiers.

Primitives:

* :class:`TieredKVCache` -- async context manager over a :class:`~tiered_kv.TransferEngine` and a
  :class:`~tiered_kv.blocks.BlockManager`: ``await add_sequences(requests)``, ``await append_tokens(...)``,
  ``free(...)``, ``page_table(...)``, ``statistics()``.
* :class:`CacheStatistics` -- hits per tier, evictions, bytes moved per direction.

The block manager decides synchronously (a decision and its copies are issued in one step of the loop, so tasks
never interleave inside a decision); this layer issues the planned copies in plan order (the engine's per-block
fences order them) and awaits, for every GPU slot it hands out, the pending copies of that slot. A failed copy
poisons the blocks whose data it produced. Every reused block is checked against its checksum from commit before
it is served (:mod:`tiered_kv.integrity`). Issuing a plan and following its copies (lineage, poisoning, the wait
for a GPU slot's copies) is :mod:`tiered_kv.cache_copies`; batching a plan's moves is :mod:`tiered_kv.plan_batches`.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np
import torch

from .blocks import (
    DEFAULT_PRIORITY,
    Admission,
    Block,
    BlockManager,
    BlockStatistics,
    CacheFullError,
    PageTableListener,
    Plan,
    Request,
)
from .cache_copies import CacheCopies, landed, layered
from .engine import EngineStatistics, Transfer, TransferEngine
from .errors import EngineClosedError, TransferError
from .integrity import IntegrityChecks
from .keys import KeyHasher
from .layerwise import LayerLoad, tapered_groups
from .layout import KVLayout
from .pools import BlockPool, Tier
from .slotstate import SlotEvent, SlotEvents
from .staging import BlockOffsetTable

__all__ = ["DEFAULT_PRIORITY", "Admission", "CacheFullError", "CacheStatistics", "Request", "TieredKVCache"]

#: Admissions of one batch made again after reused blocks failed their integrity check (each time without them).
_INTEGRITY_RETRIES = 3


@dataclasses.dataclass(frozen=True, slots=True)
class CacheStatistics:
    """A snapshot of a :class:`TieredKVCache`.

    Attributes:
        requests: requests admitted.
        tokens_requested, tokens_reused: prompt tokens admitted and reused from the cache.
        hit_rate: ``tokens_reused / tokens_requested``.
        hits: reused full blocks per tier they were found in (``"gpu"``, ``"host"``, ``"file"``, ``"remote"``).
        partial_hits: partial reuses (first tokens of one block by a partial copy).
        evictions: ``"gpu->host"``, ``"host->file"``, ``"gpu->dropped"``, ... -> blocks.
        bytes_moved: engine bytes per direction (``"host->gpu"`` ...), completed copies only.
        poisoned: blocks dropped because a copy producing them failed.
        blocks: the block manager's snapshot (occupancy per tier, ...).
        engine: the transfer engine's snapshot.
        remote: the remote tier's :class:`~tiered_kv.remote.RemoteStatistics`, or ``None``.
        integrity_errors: reused blocks whose KV no longer matched its checksum from commit: dropped, never
            served, and recomputed by the request (see ``TieredKVCache(integrity=...)``).
    """

    requests: int
    tokens_requested: int
    tokens_reused: int
    hit_rate: float
    hits: dict[str, int]
    partial_hits: int
    evictions: dict[str, int]
    bytes_moved: dict[str, int]
    poisoned: int
    blocks: BlockStatistics
    engine: EngineStatistics
    remote: Any = None  # RemoteStatistics of the remote tier, if the cache has one
    integrity_errors: int = 0


class TieredKVCache(CacheCopies):
    """A KV cache over GPU, pinned host and (optionally) file tiers, with prefix reuse.

    Args:
        layout: block geometry.
        gpu_blocks: GPU pool size (blocks).
        host_blocks: host pool size; 0 for a GPU-only cache.
        file_blocks: file tier size; 0 for none. Needs an engine with a file pool (see ``file_dir``).
        file_dir: directory of the file tier's slab files (used when the engine is built here).
        device: ``"auto"``, ``"cpu"`` (emulated) or ``"cuda[:N]"``.
        model_id: identity of the model; part of every content key.
        max_seqs: live sequences at most; each gets a page-table row ``slot`` in ``[0, max_seqs)``.
        max_blocks_per_seq: blocks a sequence may hold (default: the GPU pool).
        drop_below_priority: GPU victims with a lower priority are dropped instead of offloaded.
        compute_last_token: reuse at most ``len(prompt) - 1`` tokens (default ``True``).
        on_page_table: ``callback(slot, page_table | None)`` when a sequence's page table changes or it
            is freed (``None``); e.g. to fill a block-offset table.
        engine: use this engine (its pools must match the sizes) instead of building one; it is then not
            closed by :meth:`close`. Either way, while the cache is open every block of its engine is the
            cache's: ``engine.copy()`` raises :class:`~tiered_kv.errors.OwnedEngineError` (a copy into a slot
            the cache owns would change KV it serves); inspection (``statistics``, ``pool``, ``block``) stays open.
        block_offsets: also keep a :class:`~tiered_kv.staging.BlockOffsetTable` (one pool, the cache's
            ``max_seqs`` and ``max_blocks_per_seq``) filled from every page-table change, as
            ``cache.block_offsets``; row ``adm.slot`` is a sequence's page table.
        warm_restart: find prefixes whose blocks an earlier run left in the file tier (same directory, layout
            and ``model_id``): a prefix walk that misses in memory asks the file tier's index for the next
            block's content key and adopts the slot as a cached FILE-tier block (read back verified).
        remote: a shared store as a fourth tier (``"redis://host:port/0"``, ``"mooncake://host:port"``, or a
            :class:`~tiered_kv.remote.RemoteTier` over this cache's engine; needs ``host_blocks``): prompts
            look there after GPU, host and file, and committed blocks are put there (see ``remote_policy``).
            A store that cannot be reached leaves the cache running without it. See :mod:`tiered_kv.remote`.
        remote_policy: ``"commit"`` (put every committed full block in the background), ``"evict"`` (put a
            block when it leaves the host tier) or ``"off"`` (read only).
        remote_rank: tensor-parallel rank of this process's KV shard (part of every object name).
        integrity: checksum every committed block on the device (per token, on the current stream, after the
            compute that wrote it) and check the checksums of every reused block on the GPU before
            ``add_sequences`` returns it; a block that changed is dropped (never served), counted in
            ``statistics().integrity_errors``, logged, and recomputed by the request. Default on.
        spill_on_close: :meth:`close` first writes every cached block that lives only in the GPU or host tier to
            an empty file slot (:mod:`tiered_kv.close_spill`), so that a restart on the same directory reuses
            it. Default on (it needs a file tier; see docs/configuration.md for why).

    Example::

        async with TieredKVCache(layout, gpu_blocks=1024, host_blocks=8192, device="cuda") as cache:
            [adm] = await cache.add_sequences([prompt_ids])
            run_prefill(adm.page_table, start=adm.tokens_reused)
            await cache.append_tokens(adm.seq_id, [next_id])
            cache.free(adm.seq_id)

    Notes:
        All calls must come from one event loop. Any number of tasks on it may call concurrently: each
        decision is made and its copies issued without an await in between.
        The caller's compute must not touch a block before ``add_sequences``/``append_tokens`` returned
        it. ``commit`` orders the cache's later copies after the work queued on the current CUDA stream; compute
        on streams of its own must be ordered before the commit (``engine.sync_with_compute``).
    """

    def __init__(
        self,
        layout: KVLayout,
        *,
        gpu_blocks: int,
        host_blocks: int = 0,
        file_blocks: int = 0,
        file_dir: str | os.PathLike[str] | None = None,
        device: str | None = None,
        model_id: str = "default",
        max_seqs: int = 256,
        max_blocks_per_seq: int | None = None,
        drop_below_priority: int = 0,
        compute_last_token: bool = True,
        on_page_table: PageTableListener | None = None,
        engine: TransferEngine | None = None,
        block_offsets: bool = False,
        warm_restart: bool = True,
        remote: Any = None,
        remote_policy: str = "commit",
        remote_rank: int = 0,
        integrity: bool = True,
        spill_on_close: bool = True,
    ) -> None:
        for name, value in (("gpu_blocks", gpu_blocks), ("host_blocks", host_blocks), ("file_blocks", file_blocks)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be a non-negative int, got {value!r}")
        if gpu_blocks < 1:
            raise ValueError("gpu_blocks must be at least 1")
        if not isinstance(spill_on_close, bool):
            raise TypeError(f"spill_on_close must be a bool, got {spill_on_close!r}")
        self._spill_on_close = spill_on_close and file_blocks > 0
        self.spilled_on_close = 0
        """Blocks :meth:`close` wrote to the file tier (``spill_on_close``)."""
        self.layout = layout
        self.hasher = KeyHasher(layout, model_id)
        # Every argument is checked before anything is built (the block manager validates its own).
        self.blocks = BlockManager(
            self.hasher,
            {Tier.GPU: gpu_blocks, Tier.HOST: host_blocks, Tier.FILE: file_blocks},
            max_seqs=max_seqs,
            max_blocks_per_seq=max_blocks_per_seq,
            drop_below_priority=drop_below_priority,
            compute_last_token=compute_last_token,
            on_page_table=on_page_table,
        )
        self._owns_engine = engine is None
        if engine is None:
            engine = self._make_engine(layout, gpu_blocks, host_blocks, file_blocks, file_dir, device)
        else:
            for tier, n in ((Tier.GPU, gpu_blocks), (Tier.HOST, host_blocks), (Tier.FILE, file_blocks)):
                if n and engine.medium(tier).num_blocks != n:
                    have = engine.medium(tier).num_blocks
                    raise ValueError(f"the engine's {tier.value} pool has {have} blocks, not {n}")
        self.engine = engine
        gpu_pool = engine.pool(Tier.GPU)
        # block-major GPU pools only (the cache's own engine makes one); a layer-major pool is checked by its engine
        self._integrity = (
            IntegrityChecks(gpu_pool.tensor, engine.device) if integrity and isinstance(gpu_pool, BlockPool) else None
        )
        self._integrity_errors = 0
        self._closed = False
        self._owner_name = f"TieredKVCache@{id(self):x}"
        self._slot_events: SlotEvents | None = None
        self.remote: Any = None  # a tiered_kv.remote.cachelink.RemoteLink
        try:
            self._attach(engine, file_blocks, warm_restart, block_offsets, max_seqs, on_page_table)
            if remote is not None:
                from .remote.cachelink import RemoteLink  # the optional [remote] extra, imported only when used

                self.remote = RemoteLink(self, remote, policy=remote_policy, rank=remote_rank)
        except BaseException:
            # A failed constructor leaves nothing behind: no claim, no listener, and an engine built here is
            # released (threads, fds, the slab lock), so a corrected retry on the same directory works.
            self._detach()
            if self._owns_engine:
                engine._release_resources()
            raise

    def _attach(self, engine: TransferEngine, file_blocks: int, warm_restart: bool, block_offsets: bool, max_seqs: int,
                on_page_table: PageTableListener | None) -> None:
        # Ownership: every block of the engine is this cache's; engine.copy() refuses,
        # the cache copies through the function the claim returns.
        self._copy = engine.claim(self._owner_name)
        self._copy_layer_groups = engine.claimed_layer_groups(self._owner_name)
        if file_blocks and warm_restart:
            self.blocks.file_index = engine.file_tier.lookup
        self.block_offsets: BlockOffsetTable | None = None
        if block_offsets:
            table = BlockOffsetTable(1, max_seqs, self.blocks.max_blocks_per_seq, kv_factor=self.layout.kv_factor,
                                     device=engine.device)
            self.block_offsets = table
            user_hook = on_page_table

            def both(slot: int, page_table: tuple[int, ...] | None) -> None:
                table.on_page_table(slot, page_table)
                if user_hook is not None:
                    user_hook(slot, page_table)

            self.blocks.on_page_table = both
        self._unchecked: list[tuple[Transfer, list[Block]]] = []  # issued copies not yet seen complete
        self._poisoned = 0
        # The file tier's slot-state changes (a failed spill, a slot that failed verification) reach the block
        # manager here, on the loop, in order, before any later plan (tiered_kv.slotstate).
        self._slot_events = engine.file_tier.index.events if file_blocks else None
        if self._slot_events is not None:
            self._slot_events.subscribe(self._on_file_slot_dropped)

    def _detach(self) -> None:
        """Give the engine back: end the claim, stop listening to the file tier (idempotent)."""
        self.engine.release(self._owner_name)
        if self._slot_events is not None:
            self._slot_events.unsubscribe(self._on_file_slot_dropped)

    def _on_file_slot_dropped(self, event: SlotEvent) -> None:
        # the cache writes content keys (bytes) only; a slot another writer keyed otherwise is none of its blocks
        if isinstance(event.key, bytes) and self.blocks.file_slot_dropped(event.slot, event.key) is not None:
            self._poisoned += 1

    @staticmethod
    def _make_engine(
        layout: KVLayout, gpu: int, host: int, file: int, file_dir: str | os.PathLike[str] | None, device: str | None
    ) -> TransferEngine:
        if file and file_dir is None:
            raise ValueError("file_blocks needs file_dir (or an engine with a file pool)")
        return TransferEngine(layout, gpu_blocks=gpu, host_blocks=host, device=device,
                              file_dir=file_dir if file else None, file_blocks=file)

    # ------------------------------------------------------------------------------------ lifecycle

    async def __aenter__(self) -> TieredKVCache:
        if self._owns_engine:
            await self.engine.__aenter__()
        if self.remote is not None:
            await self.remote.connect()  # False (logged) if the store is away: the cache runs without it
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Spill (``spill_on_close``), wait for every copy in flight; close the engine if this cache built it.

        Idempotent. The caller's compute must have finished writing the committed blocks.

        Cancellation: the copies still complete; a later ``close()`` finishes the job.
        """
        spill = self._spill_on_close and not self._closed and not self.engine.closing
        self._closed = True
        try:
            if spill:
                from .close_spill import spill_cached_blocks

                self.spilled_on_close = await spill_cached_blocks(self.blocks, self.engine.file_tier, self._copy)
            if self.remote is not None:
                await self.remote.close()  # flushes the pending puts first
            if self._owns_engine:
                await self.engine.close()
            else:
                await self.engine.drain()
        finally:
            if self._integrity is not None:
                self._integrity.close()
            self._detach()

    def _check_open(self) -> None:
        if self._closed:
            raise EngineClosedError("the TieredKVCache is closed")
        if self.engine.closing:
            # checked before any bookkeeping: a decision whose copies cannot be issued must not be made
            raise EngineClosedError("the TieredKVCache's TransferEngine is closed")

    # ------------------------------------------------------------------------------------ sequences

    async def add_sequences(self, requests: Iterable[Request | Sequence[int] | np.ndarray]) -> list[Admission]:
        """Admit a batch of prompts: reuse their longest cached prefixes, allocate the rest on the GPU.

        Two-phase: every reusable block of every request is claimed before any block is
        onboarded or allocated, so onboarding for one request cannot evict blocks another request of the
        same batch was counted on: each request's ``tokens_reused`` equals what :meth:`match` said.

        Args:
            requests: :class:`Request` objects or plain token-id sequences (default priority).

        Returns:
            One :class:`Admission` per request, in order: its sequence id and slot, tokens reused,
            blocks found per tier, blocks allocated, page table. Each is that request's own (equal to
            admitting it alone on the same cache state). The blocks are on the GPU when this returns.

        Raises:
            ValueError, TypeError: bad requests (empty batch or prompt, too long, bad tokens/priority).
            CacheFullError: the batch does not fit after every possible eviction. Nothing changed.
            TransferError: a copy bringing a block failed; the batch's sequences were freed and the bad
                blocks dropped.

        Notes:
            Cancellation: the sequences of the batch are freed (the copies already enqueued still complete
            and keep their fences) and the cancellation propagates.
        """
        return await self._add_sequences(requests, self.blocks.admit)

    async def _add_sequences(
        self, requests: Iterable[Request | Sequence[int] | np.ndarray],
        admit: Callable[[Iterable[object]], tuple[list[Admission], Plan]],
    ) -> list[Admission]:
        """``add_sequences`` with the admission order ``admit`` (the naive baseline passes its own)."""
        self._check_open()
        requests = list(requests)
        for _attempt in range(_INTEGRITY_RETRIES + 1):
            self._sweep()
            admissions, plan = admit(requests)  # with remote fetches for what no local tier holds
            transfers = self._issue(plan)
            admissions, bad = await self._finish(admissions, plan, transfers)
            if not bad:
                return admissions
            self._refuse(admissions, plan, bad)
        raise TransferError(
            f"reused blocks failed their integrity check in {_INTEGRITY_RETRIES + 1} admissions of this batch in a row"
        )

    async def add_sequences_layerwise(
        self, requests: Iterable[Request | Sequence[int] | np.ndarray], group_layers: int = 1
    ) -> tuple[list[Admission], LayerLoad | None]:
        """:meth:`add_sequences`, returning before the reused blocks that come from host memory have landed.

        Those blocks are copied one group of ``group_layers`` layers at a time, in layer order, so the model can
        compute layer ``i`` while later layers land; the last group is split in halves down to one layer
        (:func:`~tiered_kv.layerwise.tapered_groups`), so what is left to compute once the last copy lands is one
        layer. Every other copy of the batch (blocks from the file tier, partial copies, the evictions that made room)
        has landed when this returns, as with ``add_sequences``.

        Returns:
            ``(admissions, load)``: ``load`` follows the layer groups still landing (its rules:
            :class:`~tiered_kv.layerwise.LayerLoad`); ``None`` when nothing comes from host memory (or with a
            remote tier, or one group): the admission is then complete, as from ``add_sequences``.

        Raises:
            ValueError, TypeError: as ``add_sequences``; ``group_layers`` not a positive int.
            CacheFullError, TransferError: as ``add_sequences``.

        Notes:
            Cancellation: as ``add_sequences`` until this returns; afterwards the caller frees the batch.
        """
        self._check_open()
        ranges = tapered_groups(self.layout.num_layers, group_layers)
        requests = list(requests)
        if self.remote is not None or len(ranges) == 1:
            return await self.add_sequences(requests), None
        self._sweep()
        admissions, plan = self.blocks.admit(requests)
        groups, issued = self._issue_plan(plan, ranges)
        landing_groups = [(g, copies) for g, copies in zip(groups, issued, strict=True) if layered(g, ranges)]
        loads = [copies for _, copies in landing_groups]
        if not loads:
            admissions, bad = await self._finish(admissions, plan, [c[-1] for c in issued])
            if not bad:
                return admissions, None
            self._refuse(admissions, plan, bad)
            return await self.add_sequences(requests), None
        landing = {m.dst_slot for g, _ in landing_groups for m in g}
        try:
            for t in (t for copies in loads for t in copies if not self.engine.on_stream(t)):
                await landed(t)  # deferred on the loop (behind file I/O): compute could not wait for it
            await self._settle(
                [a.seq_id for a in admissions], [tuple(s for s in a.page_table if s not in landing) for a in admissions]
            )
        except BaseException:
            self._abandon(admissions, plan)
            raise

        return admissions, self._layer_load(admissions, plan, ranges, loads)

    async def _settle(self, seq_ids: list[int], page_tables: list[tuple[int, ...]]) -> None:
        """Wait for the copies of the batch's GPU slots; a block whose data a failed copy produced fails the batch."""
        slots = sorted({s for pt in page_tables for s in pt})
        await self._settle_slots(slots)
        blocks = [b for sid in seq_ids for b in self.blocks.sequence_blocks(sid)]
        # the batch's copies are few and its blocks many (2,048 per 32k tokens): look at each copy once
        failed = {t for t in set(itertools.chain.from_iterable(b.sources for b in blocks)) if _failed_copy(t)}
        bad = [b for b in blocks if not failed.isdisjoint(b.sources)] if failed else []
        if bad:
            for b in bad:
                self._poison(b)
            raise TransferError(f"{len(bad)} blocks of this batch could not be brought to the GPU (a copy failed)")
        self._sweep()

    async def append_tokens(self, seq_id: int, tokens: Sequence[int] | np.ndarray) -> tuple[int, ...]:
        """Append generated tokens; a new GPU block is allocated each time one fills.

        Returns:
            The sequence's page table.

        Raises:
            ValueError: unknown or freed sequence, too many blocks for one sequence.
            CacheFullError: no GPU block can be made free. Nothing changed.

        Notes:
            Cancellation: the tokens stay appended (the blocks are the sequence's); the copies that made
            room still complete.
        """
        self._check_open()
        self._sweep()
        before = len(self.blocks.page_table(seq_id))
        page_table, plan = self.blocks.append(seq_id, tokens)
        self._issue(plan)
        await self._settle_slots(page_table[before:])
        return page_table

    def commit(self, seq_id: int, num_tokens: int | None = None) -> int:
        """Declare the KV of the first ``num_tokens`` tokens (default: all) written: they become reusable.

        Call it once the compute that writes them has been issued (after prefill, after decode steps).
        Until then a sequence's new blocks are never matched by other requests, so nobody can read KV
        that is not there yet. On CUDA, when blocks fill, the copies the cache issues from then on wait, stream-side,
        for the work queued so far on the current stream (that compute, and the blocks' checksums): a block is never
        offloaded or overwritten before its KV and checksum are taken. Returns the committed token count.

        Raises:
            ValueError: unknown sequence, ``num_tokens`` beyond its tokens.
        """
        tpb = self.layout.tokens_per_block
        before = self.blocks.committed_tokens(seq_id)
        committed = self.blocks.commit(seq_id, num_tokens)
        if committed // tpb > before // tpb:
            full = self.blocks.sequence_blocks(seq_id)[before // tpb : committed // tpb]
            if self._integrity is not None:
                self._integrity.committed(full)
            if self.remote is not None:
                self.remote.committed([b for b in full if b.cached])
            self._after_compute()  # new full blocks may be offloaded from now on
        return committed

    async def flush(self) -> None:
        """Wait until every block queued for the remote store has been put (or failed). No-op without one.

        Cancellation: cancels only this wait; the puts go on.
        """
        if self.remote is not None:
            await self.remote.flush()

    def free(self, seq_id: int) -> None:
        """Release a sequence; its committed blocks become reusable cache, the rest free slots.

        Cached blocks are evicted down the tiers when room is needed; a partly committed last block is
        cached as a partial block (reused later through a partial copy).

        Raises:
            ValueError: unknown sequence id, or it was already freed.
        """
        tail = self._integrity.tail(self.blocks, seq_id) if self._integrity is not None else None
        self.blocks.free(seq_id)
        if tail is not None:
            assert self._integrity is not None
            self._integrity.freed(*tail)
            self._after_compute()

    def _after_compute(self) -> None:
        """On CUDA: copies issued from now on wait (stream-side) for the work queued so far on the current stream."""
        device = self.engine.device
        if device.is_cuda:
            self.engine.sync_with_compute(torch.cuda.current_stream(device.torch_device))

    def set_priority(self, seq_id: int, priority: int) -> None:
        """Retention priority (0..100) of a live sequence's blocks once released."""
        self.blocks.set_priority(seq_id, priority)

    def match(self, tokens: Sequence[int] | np.ndarray) -> tuple[int, dict[str, int]]:
        """How many tokens of ``tokens`` the cache would reuse now, and the blocks per tier (claims nothing)."""
        m = self.blocks.match(tokens)
        return m.tokens_reused, dict(m.by_tier)

    async def evict(self, tier: Tier | str, count: int) -> int:
        """Evict up to ``count`` unused cached blocks of ``tier`` down the cascade; returns how many.

        Cancellation: the copies still complete.
        """
        self._check_open()
        t_ = Tier.coerce(tier)
        self._sweep()  # a block whose producing copy has failed is dropped, not moved down the cascade
        before = self.blocks.free_blocks(t_)
        plan = self.blocks.evict(t_, count)
        transfers = self._issue(plan)
        for t in transfers:
            try:
                await t
            except TransferError:
                pass  # the poisoned block was dropped by the sweep below
        self._sweep()
        return self.blocks.free_blocks(t_) - before

    # ------------------------------------------------------------------------------------ inspection

    def page_table(self, seq_id: int) -> tuple[int, ...]:
        """GPU block indices of a live sequence."""
        return self.blocks.page_table(seq_id)

    def page_tables(self) -> dict[int, tuple[int, ...]]:
        """``seq_id -> page table`` of every live sequence."""
        return {s: self.blocks.page_table(s) for s in self.blocks.live_sequences}

    def sequence_slot(self, seq_id: int) -> int:
        """The page-table row of a live sequence, in ``[0, max_seqs)``."""
        return self.blocks.sequence_slot(seq_id)

    def statistics(self) -> CacheStatistics:
        """A snapshot: hits per tier, evictions, bytes moved per direction, engine and blocks."""
        b = self.blocks.statistics()
        e = self.engine.statistics()
        hits = dict(b.hits)
        if self.remote is not None:
            hits["remote"] = b.fetched
        return CacheStatistics(
            requests=b.requests,
            tokens_requested=b.tokens_requested,
            tokens_reused=b.tokens_reused,
            hit_rate=b.tokens_reused / b.tokens_requested if b.tokens_requested else 0.0,
            hits=hits,
            partial_hits=b.partial_hits,
            evictions=b.evictions,
            bytes_moved=e.bytes_by_direction,
            poisoned=self._poisoned,
            blocks=b,
            engine=e,
            remote=self.remote.statistics() if self.remote is not None else None,
            integrity_errors=self._integrity_errors,
        )

    def __repr__(self) -> str:
        b = self.blocks.statistics()
        used = ", ".join(f"{t}:{b.capacity[t] - b.free[t]}/{b.capacity[t]}" for t in b.capacity if b.capacity[t])
        state = "closed" if self._closed else "open"
        return f"<TieredKVCache [{state}, seqs:{b.live_sequences}, in_flight:{len(self._unchecked)}] used({used})>"


def _failed_copy(t: object) -> bool:
    return isinstance(t, Transfer) and t.done() and t.exception() is not None
