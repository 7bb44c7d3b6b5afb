"""The file tier's ring of pinned staging blocks (GPU <-> file without GPUDirect Storage).

Not to be confused with :class:`tiered_kv.staging.StagingPool` (snapshots of page tables).

Primitives:

* :class:`StagingRing` -- ``count`` pinned host blocks handed out FIFO-fairly by callback
  (:meth:`~StagingRing.acquire`), so nobody blocks waiting for one; also viewed as a block-major host pool
  for the engine's copier (gathering a layer-major GPU block into one staging block). It counts the blocks
  in use and the peak (:attr:`~StagingRing.peak_in_use`): the pipeline depth actually reached.
* :func:`ring_depth` -- the ring size from bandwidth x latency: enough blocks that the disk leg (``io_threads``
  requests in flight) and the host<->device leg overlap at the slower leg's rate.
* :func:`measure_legs` -- one block's time on each leg, measured once per tier (a read of the slab and a
  copy between a staging block and device memory).
"""

from __future__ import annotations

import math
import os
import statistics
import threading
import time
from collections.abc import Callable

import torch

from ..device import Device
from ..layout import KVLayout
from ..pools import BlockPool, Tier

__all__ = ["StagingRing", "measure_legs", "ring_depth"]

MIN_DEPTH = 2
"""The fewest staging blocks: one on each leg."""


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
        self.count = count
        self._free = list(range(count))
        self._waiters: list[Callable[[int], None]] = []
        self._lock = threading.Lock()
        self.peak_in_use = 0
        """The most blocks handed out at once so far (``count`` when the pipeline filled the ring)."""

    @property
    def in_use(self) -> int:
        """Blocks handed out now."""
        with self._lock:
            return self.count - len(self._free)

    def acquire(self, callback: Callable[[int], None]) -> None:
        """Call ``callback(block)`` with a free block: at once if one is free, else when one is released."""
        with self._lock:
            if not self._free:
                self._waiters.append(callback)
                return
            i = self._free.pop()
            self.peak_in_use = max(self.peak_in_use, self.count - len(self._free))
        callback(i)

    def release(self, i: int) -> None:
        """Give block ``i`` back (to the longest waiter, if any)."""
        with self._lock:
            if not self._waiters:
                self._free.append(i)
                return
            callback = self._waiters.pop(0)
        callback(i)


def ring_depth(disk_s: float, link_s: float, io_threads: int, *, limit: int) -> int:
    """Staging blocks that keep both legs of a GPU<->file copy busy: bandwidth x latency, with a margin.

    A block holds its staging slot for one disk request (``disk_s``, of which ``io_threads`` run at once)
    plus one host<->device copy (``link_s``). The pipeline runs at the slower leg's rate, one block per
    ``max(disk_s / io_threads, link_s)``; by Little's law it needs rate x holding time blocks in flight, and
    twice that absorbs jitter on either leg (a late completion must not drain the other leg).

    Args:
        disk_s: seconds of one block's file request (latency included).
        link_s: seconds of one block's host<->device copy (latency included).
        io_threads: file requests in flight at once.
        limit: the most blocks allowed (memory cap).

    Returns:
        The depth, in ``[max(MIN_DEPTH, io_threads + 1), limit]`` (``limit`` wins when smaller).
    """
    if disk_s < 0 or link_s < 0 or io_threads < 1 or limit < 1:
        raise ValueError(f"bad ring_depth arguments: {disk_s=}, {link_s=}, {io_threads=}, {limit=}")
    period = max(disk_s / io_threads, link_s, 1e-9)
    wanted = math.ceil(2 * (disk_s + link_s) / period)
    return max(1, min(limit, max(wanted, MIN_DEPTH, io_threads + 1)))


def measure_legs(device: Device, path: str, offset: int, nbytes: int, repeat: int = 3) -> tuple[float, float]:
    """``(disk_s, link_s)``: median seconds of one ``nbytes`` read of ``path`` and of one device round trip half.

    The disk leg reads ``nbytes`` at ``offset`` with ``O_DIRECT`` where the file system allows it (else through
    the page cache, which under-estimates a cold disk: the depth's lower bound covers that). The link leg
    copies a staging-sized host buffer to device memory (on the emulated device: to another host buffer).
    """
    flags = os.O_RDONLY | getattr(os, "O_DIRECT", 0)
    try:
        fd = os.open(path, flags)
    except OSError:
        fd = os.open(path, os.O_RDONLY)
    buf = _aligned(nbytes)
    disk: list[float] = []
    try:
        for _ in range(repeat):
            t0 = time.perf_counter()
            try:
                os.preadv(fd, [buf], offset)
            except OSError:  # O_DIRECT refused this offset/length: time a buffered read instead
                os.close(fd)
                fd = os.open(path, os.O_RDONLY)
                t0 = time.perf_counter()
                os.preadv(fd, [buf], offset)
            disk.append(time.perf_counter() - t0)
    finally:
        os.close(fd)
    host = device.empty_host((nbytes,), torch.uint8)
    target = torch.empty(nbytes, dtype=torch.uint8, device=device.torch_device)
    # a private stream: synchronizing it waits for this copy only, not for other work on the device
    stream = torch.cuda.Stream(device.torch_device) if device.is_cuda else None
    link: list[float] = []
    for _ in range(repeat + 1):
        t0 = time.perf_counter()
        if stream is not None:
            with torch.cuda.stream(stream):
                target.copy_(host, non_blocking=True)
            stream.synchronize()
        else:
            target.copy_(host)
        link.append(time.perf_counter() - t0)
    return statistics.median(disk), statistics.median(link[1:])  # the first copy pays lazy initialisation


def _aligned(nbytes: int) -> memoryview:
    """A page-aligned writable buffer of ``nbytes`` (``O_DIRECT`` needs aligned memory)."""
    import mmap

    return memoryview(mmap.mmap(-1, max(nbytes, 1)))[:nbytes]
