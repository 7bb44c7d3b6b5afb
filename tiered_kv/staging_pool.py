"""Staging pool: pinned host snapshot buffers, never reused while an op may still read them.

An asynchronous copy, or a kernel that reads pinned host memory, reads its host inputs when the stream
*executes* it, not when it is enqueued. A buffer handed out by :meth:`StagingPool.acquire` is not read by any
pending op; :meth:`StagingPool.retire` keeps it, FIFO, until an event recorded after the consuming op has
completed. At most ``depth`` buffers are in flight (back-pressure beyond that), so memory is bounded by the
overlap depth. :class:`~tiered_kv.staging.BlockOffsetTable` ships its page-table snapshots through one.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
from typing import Final

import numpy as np
import torch

from .device import Device, Event, resolve_device

__all__ = ["StagingPool", "StagingStatistics"]

_MIN_CAPACITY: Final = 1024  # elements; smaller requests share one size class


@dataclasses.dataclass(frozen=True, slots=True)
class StagingStatistics:
    """A snapshot of a :class:`StagingPool`.

    Attributes:
        depth: the most buffers allowed in flight (the overlap depth).
        live: buffers allocated now (in flight + free + held by a caller between acquire and retire).
        in_flight: retired buffers whose guarding event has not been seen complete yet.
        free: buffers ready for reuse.
        peak_live: the most buffers ever allocated at once.
        peak_in_flight: the most buffers ever in flight at once.
        acquired: calls of ``acquire``.
        allocated: fresh allocations (the rest were reuses).
        waited: acquisitions that blocked on the oldest in-flight event (back-pressure at ``depth``).
        live_bytes: bytes held by live buffers.
    """

    depth: int
    live: int
    in_flight: int
    free: int
    peak_live: int
    peak_in_flight: int
    acquired: int
    allocated: int
    waited: int
    live_bytes: int


class StagingPool:
    """Host snapshot buffers that are never reused while an op may still read them.

    Args:
        device: decides the memory: pinned on CUDA (so copies and kernels read it asynchronously), plain
            memory on the emulated device.
        depth: the most buffers in flight at once. ``acquire`` blocks on the oldest op beyond that, which
            bounds memory to ``depth`` buffers; use the scheduler's overlap depth plus a margin.
        dtype: element type of the buffers.

    Notes:
        Ordering contract: ``retire(buf, event)`` must be given an event recorded *after* every op that
        reads ``buf`` was enqueued. Events of one stream complete in order, so the in-flight FIFO is
        reclaimed from its head and stops at the first pending event. Buffers retired on several streams
        are still safe (a buffer is reused only once its own event and those before it completed), just
        reclaimed later.

        Thread safety: the pool is guarded by a lock, but it is meant for one scheduler thread.
    """

    def __init__(self, device: Device | str = "auto", *, depth: int = 4, dtype: torch.dtype = torch.int32) -> None:
        if isinstance(depth, bool) or not isinstance(depth, int) or depth < 1:
            raise ValueError(f"depth must be a positive int, got {depth!r}")
        self.device = device if isinstance(device, Device) else resolve_device(device)
        self.depth = depth
        self.dtype = dtype
        self._lock = threading.Lock()
        # FIFO of (buffer, guard event, objects kept alive with it)
        self._in_flight: collections.deque[tuple[torch.Tensor, Event, object]] = collections.deque()
        self._free: list[torch.Tensor] = []
        self._views: dict[int, np.ndarray] = {}  # id(buffer) -> its numpy view (which keeps the buffer alive)
        self._held = 0  # acquired, not yet retired or released
        self._peak_live = self._peak_in_flight = 0
        self._acquired = self._allocated = self._waited = 0

    def acquire(self, numel: int) -> torch.Tensor:
        """A 1-D buffer of at least ``numel`` elements that no pending op reads.

        Blocks (on the oldest in-flight event) only when ``depth`` buffers are already in flight.
        Give it back with :meth:`retire` (after enqueueing the op that reads it) or :meth:`release`.
        """
        if numel < 0:
            raise ValueError(f"numel must be >= 0, got {numel}")
        with self._lock:
            self._acquired += 1
            self._reclaim_locked()
            while len(self._in_flight) >= self.depth:
                # Back-pressure: the CPU is `depth` calls ahead of the device; wait for the oldest op.
                self._waited += 1
                self._in_flight[0][1].synchronize()
                self._reclaim_locked()
            buf = self._take_free_locked(numel)
            if buf is None:
                capacity = max(_MIN_CAPACITY, 1 << max(0, numel - 1).bit_length())
                buf = self.device.empty_host((capacity,), self.dtype)
                self._allocated += 1
            self._held += 1
            self._peak_live = max(self._peak_live, self._live_locked())
            return buf

    def host_view(self, buffer: torch.Tensor) -> np.ndarray:
        """A numpy view of a buffer from :meth:`acquire`, made once per buffer (numpy writes cost no torch call)."""
        view = self._views.get(id(buffer))
        if view is None:
            with self._lock:
                view = self._views[id(buffer)] = buffer.numpy()
        return view

    def retire(self, buffer: torch.Tensor, event: Event, keep: object = None) -> None:
        """Keep ``buffer`` (and ``keep``, e.g. the op's device output) until ``event`` has completed.

        ``event`` must be recorded after the op that reads ``buffer``.
        """
        with self._lock:
            self._held -= 1
            self._in_flight.append((buffer, event, keep))
            self._peak_in_flight = max(self._peak_in_flight, len(self._in_flight))

    def release(self, buffer: torch.Tensor) -> None:
        """Return a buffer that no op was enqueued to read (e.g. the call failed before enqueueing)."""
        with self._lock:
            self._held -= 1
            self._free.append(buffer)

    def reclaim(self) -> int:
        """Move buffers whose events completed to the free list; returns how many are still in flight."""
        with self._lock:
            self._reclaim_locked()
            return len(self._in_flight)

    def drain(self) -> None:
        """Wait for every in-flight op, then reclaim all buffers."""
        with self._lock:
            pending = [entry[1] for entry in self._in_flight]
        for event in pending:
            event.synchronize()
        with self._lock:
            self._reclaim_all_done_locked()

    def clear(self) -> None:
        """Drain, then drop every free buffer (memory goes back to the allocator)."""
        self.drain()
        with self._lock:
            for buf in self._free:
                self._views.pop(id(buf), None)
            self._free.clear()

    def statistics(self) -> StagingStatistics:
        """A snapshot: buffers in flight and free, bytes held."""
        with self._lock:
            buffers = [entry[0] for entry in self._in_flight] + self._free
            return StagingStatistics(
                depth=self.depth,
                live=self._live_locked(),
                in_flight=len(self._in_flight),
                free=len(self._free),
                peak_live=self._peak_live,
                peak_in_flight=self._peak_in_flight,
                acquired=self._acquired,
                allocated=self._allocated,
                waited=self._waited,
                live_bytes=sum(b.numel() * b.element_size() for b in buffers),
            )

    def __repr__(self) -> str:
        with self._lock:
            return (
                f"<StagingPool {self.device.kind} [in_flight:{len(self._in_flight)}/{self.depth} "
                f"free:{len(self._free)} "
                f"held:{self._held}]>"
            )

    # ------------------------------------------------------------------ internals (lock held)

    def _live_locked(self) -> int:
        return len(self._in_flight) + len(self._free) + self._held

    def _reclaim_locked(self) -> None:
        while self._in_flight and self._in_flight[0][1].query():
            self._free.append(self._in_flight.popleft()[0])

    def _reclaim_all_done_locked(self) -> None:
        kept: collections.deque[tuple[torch.Tensor, Event, object]] = collections.deque()
        for entry in self._in_flight:
            if entry[1].query():
                self._free.append(entry[0])
            else:
                kept.append(entry)
        self._in_flight = kept

    def _take_free_locked(self, numel: int) -> torch.Tensor | None:
        if not self._free:
            return None
        if len(self._free) == 1 and self._free[0].numel() >= numel:  # the steady state of one call in flight
            return self._free.pop()
        fitting = [i for i, b in enumerate(self._free) if b.numel() >= numel]
        if fitting:
            best = min(fitting, key=lambda i: self._free[i].numel())  # best fit keeps big buffers for big calls
            return self._free.pop(best)
        # Nothing big enough: drop the largest free buffer so the count (and memory bound) stays put.
        dropped = self._free.pop(max(range(len(self._free)), key=lambda i: self._free[i].numel()))
        self._views.pop(id(dropped), None)
        return None
