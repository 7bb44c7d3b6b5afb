"""The file tier's ring of pinned staging blocks (GPU <-> file without GPUDirect Storage).

Not to be confused with :class:`tiered_kv.staging.StagingPool` (snapshots of page tables).

Primitives:

* :class:`StagingRing` -- ``count`` pinned host blocks handed out FIFO-fairly by callback, one
  (:meth:`~StagingRing.acquire`) or a group at once (:meth:`~StagingRing.acquire_group`: the pipeline moves
  a group of blocks between the GPU and staging in one stream op), so nobody blocks waiting for one; also
  viewed as a block-major host pool for the engine's copier (one copy of many block pairs) and as numpy rows
  (the file I/O buffers: no torch call per block). It counts the blocks in use and the peak
  (:attr:`~StagingRing.peak_in_use`): the pipeline depth actually reached. A block that a file I/O call past its
  deadline may still use is *held* (:meth:`~StagingRing.release_after`) until the call returns; a group the
  blocks not held cannot make is answered at once with no blocks, never left waiting.
* :func:`group_size` -- blocks per host<->device stream op: enough that the op's fixed host cost (a launch, a
  completion, a thread hop: tens to hundreds of microseconds on a slow host) is small per block.
* :func:`ring_depth` -- the ring size from bandwidth x latency: enough blocks that the disk leg (``io_threads``
  requests in flight) and the host<->device leg overlap at the slower leg's rate, plus the blocks a group
  holds while it fills and while it is on the link.
* :func:`measure_legs` -- one block's time on each leg, measured once per tier (a read of the slab and a
  copy between a staging block and device memory).
"""

from __future__ import annotations

import concurrent.futures
import math
import os
import statistics
import threading
import time
from collections.abc import Callable

import numpy as np
import torch

from ..device import Device, scratch_on
from ..layout import KVLayout
from ..pools import BlockPool, Tier

__all__ = ["StagingRing", "group_size", "measure_legs", "ring_depth"]

MIN_DEPTH = 2
"""The fewest staging blocks: one on each leg."""

GROUP_BYTES = 16 << 20
"""Bytes one host<->device stream op of the pipeline aims to move (a group of staging blocks)."""

GROUP_MAX = 64
"""The most blocks in one group (well under the copier's one-call limit of 256 pairs)."""


class StagingRing:
    """A FIFO-fair ring of pinned staging blocks handed out by callback.

    Args:
        device: pinned memory on CUDA, plain host memory on the emulated device.
        layout: block geometry.
        count: blocks in the ring (the pipeline depth).
        group: blocks the pipeline moves between the GPU and staging in one stream op (at most ``count``).
    """

    def __init__(self, device: Device, layout: KVLayout, count: int, group: int = 1) -> None:
        if not 1 <= group <= count:
            raise ValueError(f"a staging group must hold 1..{count} blocks, got {group}")
        self.tensor = device.empty_host((count, layout.bytes_per_block), torch.uint8)
        # the same memory as a block-major host pool, for the engine's copier (one op for a group of blocks)
        self.pool = BlockPool(Tier.HOST, layout, self.tensor.view(layout.dtype).view(count, *layout.block_shape))
        # and as numpy rows: a row is a few hundred ns, a torch index a few (to tens of) microseconds
        self.array: np.ndarray = self.tensor.numpy()
        self.count = count
        self.group = group
        self._free = list(range(count - 1, -1, -1))  # popped from the end: blocks 0, 1, 2, ... first
        self._waiters: list[tuple[int, Callable[[list[int]], None]]] = []
        self._lock = threading.Lock()
        self.held = 0
        """Blocks given back by copies but still used by a file I/O call past its deadline."""
        self.peak_in_use = 0
        """The most blocks handed out at once so far (``count`` when the pipeline filled the ring)."""

    @property
    def in_use(self) -> int:
        """Blocks handed out now."""
        with self._lock:
            return self.count - len(self._free)

    def acquire(self, callback: Callable[[int], None]) -> None:
        """Call ``callback(block)`` with a free block: at once if one is free, else when one is released."""
        self.acquire_group(1, lambda blocks: callback(blocks[0]))

    def acquire_group(self, n: int, callback: Callable[[list[int]], None]) -> None:
        """Call ``callback(blocks)`` with ``n`` free blocks at once, as soon as ``n`` are free (FIFO-fair).

        All or nothing: a waiter holds no block while it waits, so waiters of at most ``count`` blocks each
        never deadlock (blocks in use are released by work that needs no further block). While held blocks
        leave fewer than ``n`` for everyone else, ``callback([])`` is called at once (also for a waiter, when
        a block becomes held).

        Raises:
            ValueError: ``n`` is not in ``[1, count]``.
        """
        if not 1 <= n <= self.count:
            raise ValueError(f"a staging group must hold 1..{self.count} blocks, got {n}")
        with self._lock:
            if n > self.count - self.held:
                blocks = []
            elif self._waiters or len(self._free) < n:
                self._waiters.append((n, callback))
                return
            else:
                blocks = self._take(n)
        callback(blocks)

    def release_after(self, i: int, exc: BaseException | None) -> None:
        """Give block ``i`` back now, or once the file I/O call past its deadline that ``exc`` names returns.

        The block is held meanwhile (see :meth:`acquire_group`).
        """
        pending = getattr(exc, "pending", None)
        if not isinstance(pending, concurrent.futures.Future) or pending.done():
            self.release(i)
            return
        with self._lock:
            self.held += 1
            room = self.count - self.held
            starved = [cb for n, cb in self._waiters if n > room]
            self._waiters = [(n, cb) for n, cb in self._waiters if n <= room]
            ready = self._ready()
        for callback in starved:
            callback([])
        for callback, blocks in ready:
            callback(blocks)
        pending.add_done_callback(lambda _: self._unhold(i))

    def _unhold(self, i: int) -> None:
        with self._lock:
            self.held -= 1
        self.release(i)

    def release(self, i: int) -> None:
        """Give block ``i`` back (to the longest waiter, once it has all the blocks it asked for)."""
        with self._lock:
            self._free.append(i)
            ready = self._ready()
        for callback, blocks in ready:
            callback(blocks)

    def _ready(self) -> list[tuple[Callable[[list[int]], None], list[int]]]:
        """(Under the lock.) The waiters at the head that now have their blocks, with them."""
        ready: list[tuple[Callable[[list[int]], None], list[int]]] = []
        while self._waiters and len(self._free) >= self._waiters[0][0]:
            n, callback = self._waiters.pop(0)
            ready.append((callback, self._take(n)))
        return ready

    def _take(self, n: int) -> list[int]:
        """(Under the lock.) ``n`` free blocks, lowest first when the ring is fresh."""
        blocks = self._free[-n:][::-1]
        del self._free[-n:]
        self.peak_in_use = max(self.peak_in_use, self.count - len(self._free))
        return blocks


def group_size(block_bytes: int, limit: int) -> int:
    """Blocks per host<->device stream op: about :data:`GROUP_BYTES`, at most :data:`GROUP_MAX`.

    Args:
        block_bytes: bytes of one block.
        limit: the most blocks a ring may hold (a group is at most half of it, so two groups overlap).
    """
    if block_bytes < 1 or limit < 1:
        raise ValueError(f"bad group_size arguments: {block_bytes=}, {limit=}")
    return max(1, min(GROUP_MAX, -(-GROUP_BYTES // block_bytes), limit // 2))


def ring_depth(disk_s: float, link_s: float, io_threads: int, *, limit: int, group: int = 1) -> int:
    """Staging blocks that keep both legs of a GPU<->file copy busy: bandwidth x latency, with a margin.

    A block holds its staging slot for one disk request (``disk_s``, of which ``io_threads`` run at once)
    plus one host<->device copy (``link_s``). The pipeline runs at the slower leg's rate, one block per
    ``max(disk_s / io_threads, link_s)``; by Little's law it needs rate x holding time blocks in flight, and
    twice that absorbs jitter on either leg (a late completion must not drain the other leg).

    Batching: the link leg moves ``group`` blocks per stream op. A group is taken whole (its slots wait until
    ``group`` are free) and crosses the link whole (a read group waits for its last block), so up to
    ``group - 1`` slots wait for their group on each side of the link; the depth adds ``2 * (group - 1)``.

    Args:
        disk_s: seconds of one block's file request (latency included).
        link_s: seconds of one block's host<->device copy (latency included).
        io_threads: file requests in flight at once.
        limit: the most blocks allowed (memory cap).
        group: blocks per host<->device stream op (:func:`group_size`).

    Returns:
        The depth, in ``[max(MIN_DEPTH, io_threads + 1) + 2 * (group - 1), limit]`` (``limit`` wins when smaller).
    """
    if disk_s < 0 or link_s < 0 or io_threads < 1 or limit < 1 or group < 1:
        raise ValueError(f"bad ring_depth arguments: {disk_s=}, {link_s=}, {io_threads=}, {limit=}, {group=}")
    period = max(disk_s / io_threads, link_s, 1e-9)
    wanted = math.ceil(2 * (disk_s + link_s) / period)
    return max(1, min(limit, max(wanted, MIN_DEPTH, io_threads + 1) + 2 * (group - 1)))


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
    # a private stream: synchronizing it waits for this copy only, not for other work on the device
    stream = torch.cuda.Stream(device.torch_device) if device.is_cuda else None
    target = scratch_on(stream, nbytes, device.torch_device)
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
