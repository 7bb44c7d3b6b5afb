"""The prefix cache's side of the remote tier: the reads admission plans, background puts.

Primitives: :class:`RemoteLink` (what :class:`~tiered_kv.TieredKVCache` holds as ``cache.remote``) and
:data:`POLICIES`.

* **Reads** (:mod:`tiered_kv.remote.fetch`): admission plans a ``"fetch"`` move for every new full block of a
  prompt beyond its longest local prefix (GPU, host, file); the cache issues them with the rest of the plan
  (:meth:`RemoteLink.fetch`), straight into the sequence's GPU blocks through the tier's staging ring (or through
  a ring of host slots for a GPU pool the tier cannot write). The blocks that landed verified, in a row, are
  reused (:meth:`RemoteLink.landed`) and count as ``hits["remote"]``; a prefix of any length is reused.
* **Puts** (``remote_policy``): ``"commit"`` -- every committed full block is put in the background, in
  batches, read from wherever it lives then (GPU or host) under the engine's fences; ``"evict"`` -- a block
  is put when it leaves the host tier (spilled or dropped), read before its slot is reused; ``"off"`` --
  read only. Back-pressure: one batch in flight; blocks queued beyond ``max_pending`` are not put (counted
  in ``put_skipped``). ``flush()`` waits for everything queued.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Sequence
from typing import Any, Protocol

from ..blocks import Admission, Block, BlockManager, Move, Plan
from ..engine import TransferEngine
from ..errors import TransferError
from ..keys import ContentKey
from ..pools import BlockPool, Tier
from ..transfer import Transfer
from .fetch import RemoteFetch, fetched_prefixes, issue_fetch
from .tier import RemoteStatistics, RemoteTier
from .url import StoreURL


class CacheSide(Protocol):
    """What the link uses of a :class:`~tiered_kv.TieredKVCache` (a protocol: the cache imports this module)."""

    blocks: BlockManager
    engine: TransferEngine

__all__ = ["POLICIES", "RemoteLink"]

log = logging.getLogger(__name__)

#: Values of ``TieredKVCache(remote_policy=...)``.
POLICIES = ("commit", "evict", "off")
_REMEMBERED = 1 << 20  # content keys known to be in the store (not put again), most recent


class RemoteLink:
    """Connects a :class:`~tiered_kv.TieredKVCache` to a :class:`RemoteTier`.

    Args:
        cache: the cache (its engine must have a host pool).
        remote: a store URL or a :class:`RemoteTier` over the cache's engine.
        policy: ``"commit"``, ``"evict"`` or ``"off"`` (see the module docstring).
        rank: tensor-parallel rank (part of every object name).
        max_pending: blocks queued for puts at most; more are skipped.

    Raises:
        ValueError: a bad policy or URL, a cache without a host tier.
    """

    def __init__(self, cache: CacheSide, remote: str | StoreURL | RemoteTier, *, policy: str = "commit",
                 rank: int = 0, max_pending: int = 4096) -> None:
        if policy not in POLICIES:
            raise ValueError(f"remote_policy must be one of {', '.join(map(repr, POLICIES))}, got {policy!r}")
        if cache.blocks.capacity[Tier.HOST] == 0:
            raise ValueError("a remote tier needs a host tier (host_blocks > 0): remote blocks arrive in host memory")
        if isinstance(max_pending, bool) or not isinstance(max_pending, int) or max_pending < 1:
            raise ValueError(f"max_pending must be a positive int, got {max_pending!r}")
        self.cache = cache
        self.tier = remote if isinstance(remote, RemoteTier) else RemoteTier(cache.engine, remote, rank=rank)
        if self.tier.engine is not cache.engine:
            raise ValueError("the RemoteTier must be built over the cache's engine")
        self.policy = policy
        self.max_pending = max_pending
        self._queue: collections.OrderedDict[ContentKey, Block] = collections.OrderedDict()  # commit policy
        self._evicted: list[tuple[int, bytes]] = []  # evict policy: (host slot, key) of the decision's victims
        self._known: collections.OrderedDict[ContentKey, None] = collections.OrderedDict()  # in the store
        self._putter: asyncio.Task[None] | None = None
        self.put_skipped = 0
        if policy == "evict":
            cache.blocks.on_evict = self._on_evict
        # the tier writes block-major GPU pools; any other GPU pool gets its blocks through host ring slots
        gpu_pool = cache.engine.pool(Tier.GPU)
        cache.blocks.fetch_tier = Tier.GPU if isinstance(gpu_pool, BlockPool) else Tier.HOST

    # ------------------------------------------------------------------------------------ lifecycle

    async def connect(self) -> bool:
        """Connect the store; ``False`` if it cannot be reached (the cache runs without it; retried later).

        Cancellation: propagates.
        """
        return await self.tier.connect()

    async def flush(self) -> None:
        """Wait until every queued put has been tried. Cancellation: cancels only this wait."""
        self._before_issue()
        while self._putter is not None and not self._putter.done():
            await asyncio.shield(self._putter)
        await self.tier.drain()

    async def close(self) -> None:
        """Flush, then close the store client. Cancellation: a later ``close()`` finishes the job."""
        await self.flush()
        await self.tier.close()

    # ------------------------------------------------------------------------------------ reads

    def fetch(self, group: list[Move]) -> RemoteFetch:
        """Issue one group of the plan's fetch moves (see :func:`~tiered_kv.remote.fetch.issue_fetch`)."""
        return issue_fetch(self.tier, group)

    async def landed(self, admissions: list[Admission], transfers: Sequence[Transfer]) -> tuple[list[Admission],
                                                                                               list[Block]]:
        """Reuse the blocks the batch's fetches brought (:func:`~tiered_kv.remote.fetch.fetched_prefixes`).

        Their keys are known to be in the store: they are not put again. Cancellation: nothing is reused.
        """
        admissions, reused = await fetched_prefixes(self.cache.blocks, admissions, transfers)
        for b in reused:
            if b.key is not None:
                self._remember(b.key)
        return admissions, reused

    # ------------------------------------------------------------------------------------ puts

    def _remember(self, key: ContentKey) -> None:
        self._known[key] = None
        self._known.move_to_end(key)
        if len(self._known) > _REMEMBERED:
            self._known.popitem(last=False)

    def committed(self, blocks: Sequence[Block]) -> None:
        """Queue newly committed full blocks for a background put (commit policy)."""
        if self.policy != "commit":
            return
        for b in blocks:
            if b.key is None or b.key in self._known or b.key in self._queue:
                continue
            if len(self._queue) >= self.max_pending:
                self.put_skipped += 1
                continue
            self._queue[b.key] = b
        if self._queue and (self._putter is None or self._putter.done()):
            self._putter = asyncio.get_running_loop().create_task(self._drain_queue())

    def _on_evict(self, block: Block, plan: Plan) -> None:
        if block.tier is not Tier.HOST or block.key is None or block.key in self._known:
            return
        if not _delivered(block.sources):
            # its data is still arriving by a copy that may fail (or did): a put would store undefined bytes
            self.put_skipped += 1
            return
        slot = block.slot
        if any(m.dst_tier is Tier.HOST and m.dst_slot == slot for m in plan.moves):
            # its data arrives by a copy of this very plan, not issued yet: a read fenced now would not wait
            # for it (and would read the slot's old bytes), so this block is not put
            self.put_skipped += 1
            return
        self._evicted.append((slot, block.key))  # the slot now: by the time the plan is issued the block has moved

    def _before_issue(self) -> None:
        """Evict policy: put the host victims of the decision just made, before the plan's copies reuse their slots."""
        if not self._evicted:
            return
        victims, self._evicted = self._evicted, []
        slots = [slot for slot, _ in victims]
        keys = [key for _, key in victims]
        for k in keys:
            self._remember(k)
        self.tier.put(Tier.HOST, slots, keys)  # fenced now; runs in the background, counted in the tier

    async def _drain_queue(self) -> None:
        """Commit policy: put queued blocks, one batch in flight at a time (back-pressure)."""
        blocks = self.cache.blocks
        batch_size = self.tier._chunk * 2
        while self._queue:
            picked = [self._queue.popitem(last=False) for _ in range(min(batch_size, len(self._queue)))]
            # A block's data may still be arriving by a copy (a move between tiers, a load from the file tier)
            # that can fail. A put fenced behind such a copy would read its undefined bytes when it fails and
            # store them under a valid checksum: wait for the copies, then put only data they delivered.
            arriving = [t for _, b in picked for t in b.sources if isinstance(t, Transfer) and not t.done()]
            if arriving:
                await asyncio.gather(*arriving, return_exceptions=True)
            by_tier: dict[Tier, tuple[list[int], list[bytes]]] = {}
            for key, block in picked:
                # only a block that is still the cached one for its key, in memory, with its data there
                if blocks.lookup(key) is not block or block.tier not in (Tier.GPU, Tier.HOST):
                    continue
                if not _delivered(block.sources):
                    if not _failed(block.sources) and len(self._queue) < self.max_pending:
                        self._queue[key] = block  # moved again meanwhile: tried again after that copy
                    continue
                slots, keys = by_tier.setdefault(block.tier, ([], []))
                slots.append(block.slot)
                keys.append(key)
            transfers: list[Any] = []
            for tier, (slots, keys) in by_tier.items():
                transfers.append(self.tier.put(tier, slots, keys))  # fenced now, in this step of the loop
            for t in transfers:
                try:
                    await t
                except TransferError:
                    continue  # the store is away or failed: counted by the tier; these blocks stay local
                for key, ok in zip(by_tier[t.src_tier][1], t.found, strict=True):
                    if ok:
                        self._remember(key)

    # ------------------------------------------------------------------------------------ inspection

    def statistics(self) -> RemoteStatistics:
        """The remote tier's snapshot."""
        return self.tier.statistics()

    def __repr__(self) -> str:
        return f"<RemoteLink {self.tier!r} policy={self.policy} queued={len(self._queue)}>"


def _failed(sources: list[object]) -> bool:
    return any(isinstance(t, Transfer) and t.done() and t.exception() is not None for t in sources)


def _delivered(sources: list[object]) -> bool:
    """Every copy that produced the block's data finished and succeeded (its bytes are defined)."""
    return all(not isinstance(t, Transfer) or (t.done() and t.exception() is None) for t in sources)
