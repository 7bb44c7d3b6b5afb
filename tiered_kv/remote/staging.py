"""The remote tier's staging area: pinned object-sized slots between the engine's pools and the store.

Primitives:

* :class:`StagingArea` -- a uint8 area of ``n`` object-sized slots (pinned on CUDA) that the store registers
  (zero-copy for Mooncake); slots are leased (:meth:`~StagingArea.acquire`) and given back
  (:meth:`~StagingArea.release`, or :meth:`~StagingArea.release_later` while a timed-out store call still
  uses them). :meth:`~StagingArea.stage_out` copies pool blocks in and writes the object headers;
  :meth:`~StagingArea.stage_in` copies verified payloads out into pool blocks (GPU blocks on the engine's
  offload / onboard stream, host blocks on a worker thread).
* :class:`Lease` -- the slots of one chunk, and the store call that may still be using them.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from ..engine import TransferEngine
from ..pools import BlockPool, Tier
from ..slab import HEADER_SIZE
from .objects import encode_object

__all__ = ["Lease", "StagingArea"]


@dataclasses.dataclass(slots=True)
class Lease:
    """Staging slots leased to one chunk; ``pending``: a timed-out store call that may still read or write them."""

    slots: list[int]
    pending: concurrent.futures.Future[Any] | None = None


class StagingArea:
    """``n`` slots of ``size`` bytes (pinned when the engine is on CUDA); see the module docstring.

    Args:
        engine: the engine whose pools and streams the staging copies use.
        n: slots.
        size: bytes per slot (one object: header and payload).
        fingerprint: the layout fingerprint written into every header.
        rank: the rank written into every header.
    """

    def __init__(self, engine: TransferEngine, n: int, size: int, fingerprint: bytes, rank: int) -> None:
        self.engine = engine
        self.layout = engine.layout
        self.tensor = torch.empty((n, size), dtype=torch.uint8, pin_memory=engine.device.is_cuda)
        self.array = self.tensor.numpy()
        self.free = list(range(n - 1, -1, -1))
        self.n = n
        self._fingerprint = fingerprint
        self._rank = rank
        self._cond: asyncio.Condition | None = None

    # ------------------------------------------------------------------------------------ leases

    async def acquire(self, k: int) -> Lease:
        """Lease ``k`` slots, waiting until that many are free. Cancellation: nothing is leased."""
        if self._cond is None:
            self._cond = asyncio.Condition()
        async with self._cond:
            await self._cond.wait_for(lambda: len(self.free) >= k)
            return Lease([self.free.pop() for _ in range(k)])

    def release(self, lease: Lease) -> None:
        """Give the slots back (event-loop thread only)."""
        self.free.extend(lease.slots)
        cond = self._cond
        if cond is not None:

            async def wake() -> None:
                async with cond:
                    cond.notify_all()

            asyncio.get_running_loop().create_task(wake())

    def release_later(self, lease: Lease) -> None:
        """Give the slots back, or -- when a timed-out store call still uses them -- once it returns."""
        pending = lease.pending
        if pending is None or pending.done():
            self.release(lease)
            return
        loop = asyncio.get_running_loop()
        pending.add_done_callback(lambda _: loop.call_soon_threadsafe(self.release, lease))

    # ------------------------------------------------------------------------------------ copies

    def payload(self, i: int) -> torch.Tensor:
        """Slot ``i``'s payload as a block-shaped tensor."""
        return self.tensor[i, HEADER_SIZE:].view(self.layout.dtype).view(self.layout.block_shape)

    def encode(self, staging: list[int], names: list[str]) -> None:
        """Write the headers (payload checksums) of staged objects (a worker thread: off the event loop)."""
        for i, name in zip(staging, names, strict=True):
            obj = self.array[i]
            encode_object(obj, self._fingerprint, self._rank, name, obj[HEADER_SIZE:])

    async def stage_out(self, tier: Tier, pool: Any, slots: list[int], staging: list[int], names: list[str]) -> None:
        """Copy pool blocks into staging and write their headers (GPU: copy on the offload stream; host: a worker).

        Cancellation: the copy already queued still runs; the caller gives the slots back.
        """
        loop = asyncio.get_running_loop()
        if tier is Tier.GPU:

            def copy() -> None:
                for src, i in zip(slots, staging, strict=True):
                    block = pool.tensor[src] if isinstance(pool, BlockPool) else pool.block(src)
                    self.payload(i).copy_(block, non_blocking=True)

            await self._on_lane("offload", copy)
            await loop.run_in_executor(None, self.encode, staging, names)
        else:

            def host_copy() -> None:
                for src, i in zip(slots, staging, strict=True):
                    self.payload(i).copy_(pool.tensor[src])
                self.encode(staging, names)

            await loop.run_in_executor(None, host_copy)

    async def stage_in(self, tier: Tier, pool: BlockPool, slots: list[int], staging: list[int]) -> None:
        """Copy verified staging payloads into pool blocks (GPU: on the onboard stream).

        Cancellation: the copy already queued still runs.
        """

        def copy() -> None:
            for dst, i in zip(slots, staging, strict=True):
                pool.tensor[dst].copy_(self.payload(i), non_blocking=tier is Tier.GPU)

        if tier is Tier.GPU:
            await self._on_lane("onboard", copy)
        else:
            await asyncio.get_running_loop().run_in_executor(None, copy)

    async def _on_lane(self, lane_name: str, fn: Callable[[], None]) -> None:
        """Run ``fn`` on an engine stream (after the work queued there) and wait for it without blocking the loop."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()
        error: list[BaseException] = []

        def run() -> None:
            try:
                fn()
            except BaseException as exc:
                error.append(exc)

        def resolve() -> None:
            if not fut.done():
                fut.set_result(None)

        def finished() -> None:
            loop.call_soon_threadsafe(resolve)

        lane = self.engine.stream(lane_name)
        lane.submit(run)
        lane.notify(finished)
        await fut
        if error:
            raise error[0]
