"""The remote tier as an engine route: ``engine.copy(Tier.HOST, slots, Tier.REMOTE, ids, keys=keys)``.

Primitives: :class:`RemoteHandler` (a :class:`~tiered_kv.handlers.TransferHandler` over a
:class:`~tiered_kv.remote.RemoteTier`, added by the tier to its engine) and :class:`RemoteMedium`.

Routes: ``gpu->remote``, ``host->remote``, ``remote->host``, ``remote->gpu`` (those whose pool the engine has).
The remote side is named by ``keys`` (content keys, one per block); its indices only pair blocks up within
one call (any distinct numbers, e.g. ``range(n)``) and are fenced like any medium's, so two calls in flight
with the same remote indices are ordered one after the other: give concurrent calls distinct indices, or use
:meth:`RemoteTier.put` / :meth:`RemoteTier.get`, which fence the pool side only and report misses per block.

Through the engine a read either copies every block, verified, or fails: a block that is missing, fails
verification, or a store that is away or failing fails the transfer (``IntegrityError`` /
``RemoteStoreError``), and the engine's rule holds -- the destination blocks of a failed transfer hold
undefined data.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Protocol

import numpy as np

from ..device import Event, Stream
from ..engine import TransferEngine
from ..errors import IntegrityError, RemoteStoreError
from ..fences import Marker
from ..handlers import Batch, Done, Medium
from ..layout import KVLayout
from ..pools import BlockPool, Tier, check_indices
from .counters import RemoteCounters
from .objects import object_name
from .stores import RemoteStore


class TierSide(Protocol):
    """What the handler uses of its :class:`~tiered_kv.remote.RemoteTier` (a protocol: the tier imports this module)."""

    engine: TransferEngine
    store: RemoteStore
    rank: int
    layout: KVLayout
    _tasks: set[asyncio.Task[Any]]
    _counts: RemoteCounters

    def _usable(self) -> bool: ...

    async def _put_blocks(self, tier: Tier, pool: Any, slots: list[int], names: list[str], found: list[bool],
                          staged_all: Callable[[], None] | None = None) -> None: ...

    async def _get_blocks(self, tier: Tier, pool: BlockPool, slots: list[int], names: list[str], found: list[bool],
                          deps: Iterable[Marker] = ()) -> None: ...

__all__ = ["RemoteHandler", "RemoteMedium"]

#: The remote "medium" has no slots; its indices only pair blocks with keys within one call.
REMOTE_INDICES = 1 << 40


class RemoteMedium:
    """The store as a medium: fence-table name ``"remote"``, any index below 2**40."""

    name = Tier.REMOTE.value
    num_blocks = REMOTE_INDICES

    def check(self, indices: np.ndarray, what: str) -> None:
        """Raise ``ValueError`` unless every index is in ``[0, 2**40)``."""
        check_indices(indices, REMOTE_INDICES, what, "the remote tier")


class _RemoteJob:
    lane: Stream | None = None

    def __init__(self, handler: RemoteHandler, batch: Batch) -> None:
        self.handler = handler
        self.batch = batch

    def start(self, done: Done) -> Event | None:
        task = asyncio.get_running_loop().create_task(self._run(done))
        self.handler.tier._tasks.add(task)
        task.add_done_callback(self.handler.tier._tasks.discard)
        return None

    async def _run(self, done: Done) -> None:
        tier, b = self.handler.tier, self.batch
        keys: Sequence[bytes] = b.keys  # type: ignore[assignment]  # normalized by validate
        names = [object_name(tier.rank, k) for k in keys]
        found = [False] * b.size
        try:
            if b.dst_tier is Tier.REMOTE:
                if not tier._usable():
                    tier._counts.blocks["put_dropped"] += b.size
                    raise RemoteStoreError(f"the remote store {tier.store.url} is unavailable")
                pool = tier.engine.pool(b.src_tier)
                await tier._put_blocks(b.src_tier, pool, [int(i) for i in b.src], names, found)
            else:
                pool = tier.engine.pool(b.dst_tier)
                await tier._get_blocks(b.dst_tier, pool, [int(i) for i in b.dst], names, found)  # type: ignore[arg-type]
                if not all(found):
                    raise IntegrityError(f"{found.count(False)} of {b.size} blocks were not served by the remote store "
                                         "(missing, failed verification, or the store is unavailable)")
        except BaseException as exc:
            done(exc)
            if isinstance(exc, asyncio.CancelledError):
                raise
            return
        done(None)


class RemoteHandler:
    """Routes copies between the engine's pools and the store to a :class:`RemoteTier`."""

    def __init__(self, tier: TierSide) -> None:
        self.tier = tier
        self._medium = RemoteMedium()
        pools = [t for t in (Tier.GPU, Tier.HOST) if _has_pool(tier, t)]
        self._routes = tuple(pair for t in pools for pair in ((t, Tier.REMOTE), (Tier.REMOTE, t)))

    @property
    def routes(self) -> Sequence[tuple[Tier, Tier]]:
        """``gpu/host -> remote`` and back, for the pools the engine has."""
        return self._routes

    @property
    def media(self) -> Mapping[Tier, Medium]:
        """The remote medium (this handler owns it)."""
        return {Tier.REMOTE: self._medium}

    def validate(self, batch: Batch) -> Batch:
        """Keys (non-empty bytes, one per block) are required; whole blocks only; GPU reads need a block-major pool."""
        if batch.num_tokens is not None and batch.num_tokens != self.tier.layout.tokens_per_block:
            raise ValueError("copies to or from the remote tier move whole blocks (num_tokens=None)")
        if batch.keys is None:
            raise ValueError("copies to or from the remote tier need keys=[content key per block]")
        if isinstance(batch.keys, (bytes, str)):
            raise TypeError("keys must be a sequence of content keys (bytes), one per block")
        keys = tuple(batch.keys)
        if len(keys) != batch.size:
            raise ValueError(f"got {batch.size} blocks and {len(keys)} keys; they must pair up")
        for k in keys:
            if not isinstance(k, (bytes, bytearray)) or not k:
                raise TypeError(f"a content key must be non-empty bytes, got {type(k).__name__}")
        if batch.dst_tier is Tier.GPU and not isinstance(self.tier.engine.pool(Tier.GPU), BlockPool):
            raise ValueError("remote reads into a layer-major GPU pool are not supported; read into the host tier")
        return dataclasses.replace(
            batch, keys=tuple(bytes(k) for k in keys if isinstance(k, (bytes, bytearray))), num_tokens=None
        )

    def prepare(self, batch: Batch) -> _RemoteJob:
        """A job that puts or gets the batch on the event loop when the engine starts it."""
        return _RemoteJob(self, batch)

    def close(self) -> None:
        """Nothing to release here: the :class:`RemoteTier` is closed by its owner."""

    def __repr__(self) -> str:
        return f"<RemoteHandler {self.tier.store.url}>"


def _has_pool(tier: TierSide, t: Tier) -> bool:
    try:
        tier.engine.pool(t)
    except ValueError:
        return False
    return True
