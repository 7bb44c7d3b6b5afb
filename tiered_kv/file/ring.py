"""The file tier's ring of pinned staging blocks (GPU <-> file without GPUDirect Storage).

Not to be confused with :class:`tiered_kv.staging.StagingPool` (snapshots of page tables).

Primitives:

* :class:`StagingRing` -- ``count`` pinned host blocks handed out FIFO-fairly by callback
  (:meth:`~StagingRing.acquire`), so nobody blocks waiting for one; also viewed as a block-major host pool
  for the engine's copier (gathering a layer-major GPU block into one staging block).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch

from ..device import Device
from ..layout import KVLayout
from ..pools import BlockPool, Tier

__all__ = ["StagingRing"]


class StagingRing:
    """A FIFO-fair ring of pinned staging blocks handed out by callback.

    Args:
        device: pinned memory on CUDA, plain host memory on the emulated device.
        layout: block geometry.
        count: blocks in the ring (the pipeline depth).
    """

    def __init__(self, device: Device, layout: KVLayout, count: int) -> None:
        self.tensor = device.empty_host((count, layout.bytes_per_block), torch.uint8)
        # the same memory as a block-major host pool, for the engine's copier (layer-major GPU pools)
        self.pool = BlockPool(Tier.HOST, layout, self.tensor.view(layout.dtype).view(count, *layout.block_shape))
        self._free = list(range(count))
        self._waiters: list[Callable[[int], None]] = []
        self._lock = threading.Lock()

    def acquire(self, callback: Callable[[int], None]) -> None:
        """Call ``callback(block)`` with a free block: at once if one is free, else when one is released."""
        with self._lock:
            if not self._free:
                self._waiters.append(callback)
                return
            i = self._free.pop()
        callback(i)

    def release(self, i: int) -> None:
        """Give block ``i`` back (to the longest waiter, if any)."""
        with self._lock:
            if not self._waiters:
                self._free.append(i)
                return
            callback = self._waiters.pop(0)
        callback(i)
