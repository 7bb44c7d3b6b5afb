"""Per-block read/write fences, keyed by (pool, memory-pool block index).

The hazard rules of the seed transfer manager (TensorRT-LLM ``kvCacheTransferManager``):

* before an op *reads* block b: wait for b's pending write (keep it);
* before an op *writes* block b: wait for b's pending reads and pending write (then drop them);
* after enqueueing: add a read on each source, set the write on each destination.

The pool is part of the key, so GPU block 0 and host block 0 never alias. A fence entry is a
:class:`Marker`, the completion of one enqueued op. Entries are released when the op *completes*
(on the event loop, from the device's completion callback), never by the coroutine awaiting it: a
cancelled ``await`` does not cancel work already enqueued, so the fence must stay until it is done.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Iterable

from .device import Event, Stream

__all__ = ["FenceStatistics", "FenceTable", "Marker"]


class Marker:
    """The completion of one enqueued op.

    Attributes:
        lane: the stream the op runs on, or ``None`` for work completed off-stream (host threads, file I/O).
        event: recorded on ``lane`` after the op once it is enqueued; later stream ops wait on it
            stream-side. ``None`` while the op is not yet enqueued, and always for off-stream ops.
        completed: set on the event loop once the op has finished (failed or not).
        error: the exception the op failed with, if any.
        done_at: ``time.perf_counter()`` when the device (or worker) finished the op.

    Notes:
        Each awaiter gets a future of its own, so cancelling one awaiting task cancels only that task's
        future, never the completion that the fence table (and other awaiters) rely on.
    """

    __slots__ = ("_waiters", "completed", "done_at", "error", "event", "lane", "reads", "writes")

    def __init__(self, lane: Stream | None) -> None:
        self.lane = lane
        self.event: Event | None = None
        self.completed = False
        self.error: BaseException | None = None
        self.done_at: float | None = None
        self.reads: list[tuple[str, list[int]]] = []  # (pool, block indices) this op reads
        self.writes: list[tuple[str, list[int]]] = []  # (pool, block indices) this op writes
        self._waiters: list[asyncio.Future[None]] = []

    async def wait(self) -> None:
        """Wait until the op has completed.

        Cancellation: cancels only this wait; the op and its fences are unaffected.
        """
        if self.completed:
            return
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            await waiter
        finally:
            if not self.completed:
                # Cancelled: forget this waiter (completion will not need to skip it).
                self._waiters.remove(waiter)

    def complete(self) -> None:
        """Mark completed and wake every awaiter (event-loop thread only)."""
        self.completed = True
        if self.done_at is None:
            self.done_at = time.perf_counter()
        waiters, self._waiters = self._waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)

    def __repr__(self) -> str:
        if self.completed:
            state = "failed" if self.error is not None else "done"
        else:
            state = "enqueued" if self.event is not None or self.lane is None else "deferred"
        return f"<Marker {state} lane={getattr(self.lane, 'name', 'host')} waiters:{len(self._waiters)}>"


class _BlockFence:
    __slots__ = ("reads", "write")

    def __init__(self) -> None:
        self.write: Marker | None = None
        self.reads: list[Marker] = []


@dataclasses.dataclass(frozen=True, slots=True)
class FenceStatistics:
    """A snapshot of a :class:`FenceTable`.

    Attributes:
        fenced_blocks: blocks with any pending read or write.
        pending_reads: pending (block, read) pairs.
        pending_writes: blocks with a pending write.
        stream_waits: dependencies satisfied by a stream-side wait so far.
        loop_waits: dependencies satisfied by awaiting on the loop so far.
    """

    fenced_blocks: int
    pending_reads: int
    pending_writes: int
    stream_waits: int
    loop_waits: int


class FenceTable:
    """Pending reads and writes per (pool, block index)."""

    def __init__(self) -> None:
        self._pools: dict[str, dict[int, _BlockFence]] = {}  # pool -> block index -> fence
        self.stream_waits = 0
        self.loop_waits = 0

    def _table(self, pool: str) -> dict[int, _BlockFence]:
        table = self._pools.get(pool)
        if table is None:
            table = self._pools[pool] = {}
        return table

    def dependencies(self, reads: Iterable[tuple[str, list[int]]], writes: Iterable[tuple[str, list[int]]]) -> set[Marker]:
        """Markers an op must wait for before it reads ``reads`` and writes ``writes``."""
        deps: set[Marker] = set()
        for pool, indices in reads:
            table = self._pools.get(pool)
            if not table:
                continue
            for i in indices:
                fence = table.get(i)
                if fence is not None and fence.write is not None:
                    deps.add(fence.write)
        for pool, indices in writes:
            table = self._pools.get(pool)
            if not table:
                continue
            for i in indices:
                fence = table.get(i)
                if fence is not None:
                    if fence.write is not None:
                        deps.add(fence.write)
                    deps.update(fence.reads)
        return {m for m in deps if not m.completed}

    def register(self, marker: Marker, reads: list[tuple[str, list[int]]], writes: list[tuple[str, list[int]]]) -> None:
        """Record ``marker`` as a pending read of ``reads`` and the pending write of ``writes``."""
        marker.reads = reads
        marker.writes = writes
        for pool, indices in reads:
            table = self._table(pool)
            for i in indices:
                fence = table.get(i)
                if fence is None:
                    fence = table[i] = _BlockFence()
                fence.reads.append(marker)
        for pool, indices in writes:
            table = self._table(pool)
            for i in indices:
                fence = table.get(i)
                if fence is None:
                    fence = table[i] = _BlockFence()
                else:
                    fence.reads.clear()  # the new write waits for them; ordering is transitive
                fence.write = marker

    def release(self, marker: Marker) -> None:
        """Drop ``marker``'s entries (called once the op has completed)."""
        for pool, indices in marker.reads:
            table = self._pools[pool]
            for i in indices:
                fence = table.get(i)
                if fence is None:
                    continue
                if marker in fence.reads:
                    fence.reads.remove(marker)
                if fence.write is None and not fence.reads:
                    del table[i]
        for pool, indices in marker.writes:
            table = self._pools[pool]
            for i in indices:
                fence = table.get(i)
                if fence is None or fence.write is not marker:
                    continue
                fence.write = None
                if not fence.reads:
                    del table[i]

    def pending(self, pool: str, index: int) -> tuple[Marker | None, tuple[Marker, ...]]:
        """``(pending write, pending reads)`` of one block."""
        fence = self._pools.get(pool, {}).get(index)
        if fence is None:
            return None, ()
        return fence.write, tuple(fence.reads)

    def statistics(self) -> FenceStatistics:
        fenced = reads = writes = 0
        for table in self._pools.values():
            fenced += len(table)
            for fence in table.values():
                reads += len(fence.reads)
                writes += fence.write is not None
        return FenceStatistics(fenced, reads, writes, self.stream_waits, self.loop_waits)

    def __len__(self) -> int:
        return sum(len(t) for t in self._pools.values())

    def __repr__(self) -> str:
        s = self.statistics()
        return f"<FenceTable [blocks:{s.fenced_blocks}, reads:{s.pending_reads}, writes:{s.pending_writes}]>"
