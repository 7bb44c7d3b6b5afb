"""What an engine holds and has done, looked up and reported: media, routes, streams, fences, statistics.

Primitives:

* :class:`EngineInspection` -- the base of :class:`~tiered_kv.engine.TransferEngine` that answers for its tables:
  the media (its memory pools, and the media handlers own, such as the file tier), the routing table (which handler
  copies each pair of tiers; :meth:`~EngineInspection.add_handler` extends it), the copy streams, the fence table
  and the statistics.

A route is resolved once per pair as the caller names it (:meth:`~EngineInspection._resolve_route`, used by the copy
path on a miss of ``_resolved``), and every change to the routing table forgets the resolved pairs. Reading the
fence table, the statistics or the ``repr`` settles the completed copies first, so none of them shows a copy that
has ended as still in flight.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

import torch

from .device import Device, Stream
from .errors import EngineClosedError
from .fences import FenceTable, Marker
from .file import FileTier
from .handlers import Medium, Routes, TransferHandler
from .layer_major import LayerMajorPool
from .pools import BlockPool, Tier
from .stream_copier import StreamCopier
from .transfer import EngineStatistics, Transfer

if TYPE_CHECKING:
    from .inflight import _DirectionTotals

__all__ = ["EngineInspection"]

#: A resolved pair: source and destination tier and medium, its handler, whether it is a memory pair, "src->dst".
_Route = tuple[Tier, Tier, Medium, Medium, TransferHandler, bool, str]


class EngineInspection:
    """The lookups and reports of an engine's media, routes, streams, fences and statistics.

    The engine builds the tables (``_pools``, ``_media``, ``_routes``, ``_streams``) and the in-flight state this
    reads; ``_settle`` (:class:`~tiered_kv.inflight.InFlightCopies`) brings that state up to date before a report.
    """

    device: Device
    _pools: dict[Tier, BlockPool | LayerMajorPool]
    _media: dict[Tier, Medium]
    _routes: Routes
    _resolved: dict[tuple[Tier | str, Tier | str], _Route]
    _streams: dict[str, Stream]
    _closing: bool
    _closed: bool
    _fences: FenceTable
    _inflight: dict[Marker, tuple[str, Transfer]]
    _deferred: set[asyncio.Task[None]]
    _submitted: int
    _completed: int
    _failed: int
    _by_direction: dict[str, _DirectionTotals]

    if TYPE_CHECKING:  # InFlightCopies' bookkeeping step, which the engine's other base provides

        def _settle(self) -> None: ...

    def pool(self, tier: Tier | str) -> BlockPool | LayerMajorPool:
        """The memory pool of ``tier`` (GPU or host).

        Raises:
            ValueError: unknown tier, or the engine has no pool for it.
            TypeError: the tier is not in memory (the file tier: see :meth:`medium` and :attr:`file_tier`).
        """
        t = Tier.coerce(tier)
        pool = self._pools.get(t)
        if pool is None:
            if t in self._media:
                raise TypeError(
                    f"{t.value} blocks have no in-memory view; copy the block to the host tier to inspect it"
                )
            raise ValueError(f"this engine has no {t.value} pool (give it {t.value}_blocks)")
        return pool

    def medium(self, tier: Tier | str) -> Medium:
        """The medium of ``tier``: a memory pool, or the medium a handler owns (the file tier).

        Raises:
            ValueError: unknown tier, or the engine has no medium for it.
        """
        t = Tier.coerce(tier)
        medium = self._media.get(t)
        if medium is None:
            raise ValueError(f"this engine has no {t.value} pool (give it {t.value}_blocks)")
        return medium

    def add_handler(self, handler: TransferHandler) -> None:
        """Route ``handler.routes`` to ``handler`` and add the media it owns (a new tier is one handler).

        Use it for a handler that needs the engine's pools or streams; one that does not can be passed as
        ``TransferEngine(..., handlers=[...])``. The engine closes it in :meth:`close`.

        Raises:
            ValueError: a pair already routed or a medium already owned (nothing is changed).
            EngineClosedError: the engine is closed.
        """
        if self._closing:
            raise EngineClosedError("the TransferEngine is closed")
        self._routes.add(handler)
        self._media.update(handler.media)
        self._resolved.clear()

    def route(self, src_tier: Tier | str, dst_tier: Tier | str) -> TransferHandler:
        """The handler that copies from ``src_tier`` to ``dst_tier``.

        Raises:
            ValueError: unknown tier, or no handler for the pair.
        """
        src_t, dst_t = Tier.coerce(src_tier), Tier.coerce(dst_tier)
        handler = self._routes.get(src_t, dst_t)
        if handler is None:
            raise ValueError(f"copies from {src_t.value} to {dst_t.value} are not supported by this engine")
        return handler

    def _resolve_route(self, src_tier: Tier | str, dst_tier: Tier | str) -> _Route:
        """Tiers, media and handler of a pair, checked (the errors of :meth:`medium` and :meth:`route`).

        Kept per pair as the caller names it (a :class:`Tier` or its name), so that a copy does not coerce and
        look up the same things again; :meth:`add_handler` forgets them.
        """
        src_t, dst_t = Tier.coerce(src_tier), Tier.coerce(dst_tier)
        src_pool, dst_pool = self.medium(src_t), self.medium(dst_t)
        handler = self.route(src_t, dst_t)
        memory = isinstance(handler, StreamCopier)
        route = (src_t, dst_t, src_pool, dst_pool, handler, memory, f"{src_t.value}->{dst_t.value}")
        if type(src_tier) in (Tier, str) and type(dst_tier) in (Tier, str):
            self._resolved[src_tier, dst_tier] = route
        return route

    def block(self, tier: Tier | str, index: int) -> torch.Tensor:
        """A view of one block, for inspection and for filling in tests.

        Notes:
            The view is live memory: await the copies that touch the block (or :meth:`drain`) first.
            A layer-major GPU pool returns a block-major *copy* (write through ``pool(...).layer(i)``).
        """
        return self.pool(tier).block(index)

    def stream(self, name: str) -> Stream:
        """One of the engine's copy streams: ``"offload"``, ``"onboard"`` or ``"local"``."""
        try:
            return self._streams[name]
        except KeyError:
            raise ValueError(f"unknown stream {name!r}; use one of {', '.join(self._streams)}") from None

    @property
    def file_tier(self) -> FileTier:
        """The file tier: its index (content key -> slot) and statistics.

        Raises:
            ValueError: the engine has no file tier.
        """
        tier = self._media.get(Tier.FILE)
        if not isinstance(tier, FileTier):
            raise ValueError("this engine has no file tier (give it file_dir and file_blocks)")
        return tier

    @property
    def fences(self) -> FenceTable:
        """The per-block fence table (pending reads and write of each block)."""
        self._settle()
        return self._fences

    def statistics(self) -> EngineStatistics:
        """A snapshot: transfers, bytes and latencies per direction, fences."""
        self._settle()
        return EngineStatistics(
            device=self.device.kind,
            submitted=self._submitted,
            completed=self._completed,
            failed=self._failed,
            in_flight=len(self._inflight),
            deferred=len(self._deferred),
            bytes_by_direction={d: t.nbytes for d, t in self._by_direction.items()},
            blocks_by_direction={d: t.blocks for d, t in self._by_direction.items()},
            seconds_by_direction={d: t.seconds for d, t in self._by_direction.items()},
            latency_counts={d: tuple(t.counts) for d, t in self._by_direction.items()},
            fences=self._fences.statistics(),
        )

    def __repr__(self) -> str:
        self._settle()
        state = "closed" if self._closed else ("closing" if self._closing else "open")
        pools = ", ".join(f"{p.name}:{p.num_blocks}" for p in self._media.values())
        return (
            f"<TransferEngine {self.device.kind} [{state}, in_flight:{len(self._inflight)}, "
            f"deferred:{len(self._deferred)}, fenced:{len(self._fences)}] pools({pools})>"
        )
