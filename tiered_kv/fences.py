"""Per-block read/write fences, keyed by (pool, memory-pool block index).

Primitives:

* :class:`FenceTable` -- ``dependencies(reads, writes)``, ``register``, ``fence`` (both at once), ``release`` (or
  ``release_later``), ``pending``.
* :class:`Marker` -- the completion of one enqueued op (awaitable, callbacks, lane and event).
* :class:`FenceStatistics` -- a snapshot.

The hazard rules of the seed transfer manager (TensorRT-LLM ``kvCacheTransferManager``):

* before an op *reads* block b: wait for b's pending write (keep it);
* before an op *writes* block b: wait for b's pending reads and pending write (then drop them);
* after enqueueing: add a read on each source, set the write on each destination.

The pool is part of the key, so GPU block 0 and host block 0 never alias. A fence entry is a
:class:`Marker`, the completion of one enqueued op. Entries are released when the op *completes*
(on the event loop, from the device's completion callback), never by the coroutine awaiting it: a
cancelled ``await`` does not cancel work already enqueued, so the fence must stay until it is done.

The engine wakes a completed op's awaiters first and drops its entries right after (``release_later``, then
``release_done`` from a loop callback queued behind the wake-ups): the awaiting coroutine resumes sooner. The
entries of a completed marker already order nothing (``dependencies`` and ``fence`` skip completed markers, and
``release`` of an entry that a later op overwrote is a no-op), and every query (``pending``, ``statistics``,
``len``, ``bool``) drops them first, so no reader sees them.

The table is the only owner of fence state: entries are written when an op is registered and dropped when it is
released, by this module's code alone, on every device.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable, Generator, Iterable
from typing import Any

from .device import Event, Stream

__all__ = ["FenceStatistics", "FenceTable", "Marker"]

log = logging.getLogger(__name__)


class Marker:
    """The completion of one enqueued op.

    Attributes:
        lane: the stream the op runs on, or ``None`` for work completed off-stream (host threads, file I/O).
        event: recorded on ``lane`` after the op once it is enqueued; later stream ops wait on it
            stream-side. ``None`` while the op is not yet enqueued, and always for off-stream ops.
        completed: set on the event loop once the op has finished (failed or not).
        error: the exception the op failed with, if any.
        done_at: ``time.perf_counter()`` when the device (or worker) finished the op.
        job: the job that runs the op once it is enqueued (``None`` before): whether its completion may be taken
            from its event (the engine's loop-side poll asks it, see ``Job.ok_at_event``).
        entries: whether this op's per-block entries are in a :class:`FenceTable` (from its registration to its
            release).

    Notes:
        Each awaiter gets a future of its own, so cancelling one awaiting task cancels only that task's
        future, never the completion that the fence table (and other awaiters) rely on.
    """

    __slots__ = (
        "_callbacks",
        "_waiters",
        "after",
        "completed",
        "done_at",
        "entries",
        "error",
        "event",
        "job",
        "lane",
        "reads",
        "sources",
        "writes",
    )

    def __init__(self, lane: Stream | None) -> None:
        self.lane = lane
        self.event: Event | None = None
        self.completed = False
        self.error: BaseException | None = None
        self.done_at: float | None = None
        self.job: Any = None
        self.reads: list[tuple[str, list[int]]] = []  # (pool, block indices) this op reads
        self.writes: list[tuple[str, list[int]]] = []  # (pool, block indices) this op writes
        self.entries = False  # its per-block entries are in a fence table
        self.after: list[Marker] = []  # ops this one waited for stream-side: done on the device before it
        self.sources: list[Marker] | tuple[()] = ()  # the pending writers of what it reads, when it was issued
        self._waiters: list[asyncio.Future[None]] = []
        self._callbacks: list[Callable[[], None]] = []

    def add_done_callback(self, callback: Callable[[], None]) -> None:
        """Call ``callback()`` on the loop once the op has completed (at once if it has).

        A callback that raises is reported through the running loop's exception handler (as asyncio does
        for a future's callbacks); the other callbacks still run and completion is never interrupted.
        """
        if self.completed:
            _run_callback(callback)
        else:
            self._callbacks.append(callback)

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

    def wait_steps(self) -> Generator[Any, None, None]:
        """:meth:`wait` as a plain generator, for ``yield from`` in an ``__await__``.

        One coroutine frame less on the wake-up path of every awaited transfer; the same cancellation
        semantics as :meth:`wait` (a cancelled wait forgets its waiter; the op and its fences are unaffected).
        """
        if self.completed:
            return
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            yield from waiter
        finally:
            if not self.completed:
                self._waiters.remove(waiter)

    def complete(self) -> None:
        """Mark completed and wake every awaiter (event-loop thread only)."""
        self.completed = True
        if self.done_at is None:
            self.done_at = time.perf_counter()
        waiters = self._waiters
        if waiters:
            self._waiters = []
            for waiter in waiters:
                try:  # no done() check first: this runs before every awaiting coroutine can resume
                    waiter.set_result(None)
                except asyncio.InvalidStateError:  # a cancelled wait whose task has not yet forgotten it
                    pass
                except RuntimeError:  # its loop is closed (completion taken over by close() on a new loop)
                    pass
        callbacks = self._callbacks
        if callbacks:
            self._callbacks = []
            for callback in callbacks:
                _run_callback(callback)

    def __repr__(self) -> str:
        if self.completed:
            state = "failed" if self.error is not None else "done"
        else:
            state = "enqueued" if self.event is not None or self.lane is None else "deferred"
        return f"<Marker {state} lane={getattr(self.lane, 'name', 'host')} waiters:{len(self._waiters)}>"


def _run_callback(callback: Callable[[], None]) -> None:
    """Run a done-callback; an exception goes to the loop's exception handler, never to the completion path."""
    try:
        callback()
    except Exception as exc:  # reported like asyncio reports a failing future callback
        context = {"message": f"Exception in transfer done-callback {callback!r}", "exception": exc}
        try:
            asyncio.get_running_loop().call_exception_handler(context)
        except RuntimeError:  # no running loop (a completion delivered off the loop): log it
            log.error("Exception in transfer done-callback %r", callback, exc_info=exc)


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
    """Pending reads and writes per (pool, block index).

    Attributes:
        release_later: ``release_later(marker)`` drops a completed marker's entries at the next
            :meth:`release_done` or query (see the module docstring).

    Notes:
        Per pool, two dicts: block -> pending write marker, and block -> pending reader(s) (a marker, or an
        insertion-ordered dict of markers when several copies read the block at once, so adding or dropping
        one of many pending readers is O(1), not O(readers)). Registration and lookups use C-level dict and
        set operations over the index lists, so the Python-level work is proportional to the blocks that
        are actually fenced, not to the blocks of the call.
    """

    def __init__(self) -> None:
        self._writes: dict[str, dict[int, Marker]] = {}  # pool -> block index -> pending write
        # pool -> block index -> pending read(s): one marker, or several as an ordered set (dict keys)
        self._reads: dict[str, dict[int, Marker | dict[Marker, None]]] = {}
        self.stream_waits = 0
        self.loop_waits = 0
        self._done: list[Marker] = []  # completed markers whose entries are still to be dropped (release_later)
        # release_later(marker): the list's own append, so the engine's completion path runs no Python frame for it
        self.release_later: Callable[[Marker], None] = self._done.append
        # pool -> the markers holding entries there, in registration order, until released: a pool none of whose
        # holders is still running has nothing to wait for, whatever its size (live(); the engine then skips the
        # lookups, and the index lists, before a launch)
        self._holders: dict[str, dict[Marker, None]] = {}

    def live(self, pool: str) -> bool:
        """True while an op that has not completed holds entries in ``pool`` (False: nothing to wait for there).

        Completed ops whose entries are still to be dropped (``release_later``) do not count; the scan stops at the
        first running op, and released ops leave the scan.
        """
        holders = self._holders.get(pool)
        if holders:
            for marker in holders:
                if not marker.completed:
                    return True
        return False

    def _hold(self, marker: Marker, pools: Iterable[str]) -> None:
        holders = self._holders
        for pool in pools:
            held = holders.get(pool)
            if held is None:
                held = holders[pool] = {}
            held[marker] = None

    def dependencies(
        self,
        reads: Iterable[tuple[str, list[int]]],
        writes: Iterable[tuple[str, list[int]]],
        sources: set[Marker] | None = None,
    ) -> set[Marker]:
        """Markers an op must wait for before it reads ``reads`` and writes ``writes``.

        ``sources``, if given, also receives the pending writers of ``reads``: the ops whose bytes the op reads.
        Completed ops whose entries are still to be dropped (``release_later``) are dropped first: a lookup then
        looks only at ops that may still run (a pool whose last holder completed is cleared whole).
        """
        if self._done:
            self.release_done()
        deps: set[Marker] = set()
        for pool, indices in reads:
            wt = self._writes.get(pool)
            if wt:
                deps.update(wt[i] for i in wt.keys() & indices)
        if sources is not None:
            sources.update(m for m in deps if not m.completed)
        for pool, indices in writes:
            wt = self._writes.get(pool)
            if wt:
                deps.update(wt[i] for i in wt.keys() & indices)
            rt = self._reads.get(pool)
            if rt:
                for i in rt.keys() & indices:
                    readers = rt[i]
                    if isinstance(readers, dict):
                        deps.update(readers)
                    else:
                        deps.add(readers)
        return {m for m in deps if not m.completed}

    def register(self, marker: Marker, reads: list[tuple[str, list[int]]], writes: list[tuple[str, list[int]]]) -> None:
        """Record ``marker`` as a pending read of ``reads`` and the pending write of ``writes``.

        Completed ops whose entries are still to be dropped (``release_later``) are dropped first: a copy of the
        same blocks as the one just completed would otherwise turn every block's lone reader into a reader set
        (per-block Python, here and in the release).
        """
        if self._done:
            self.release_done()
        marker.reads = reads
        marker.writes = writes
        self._hold(marker, {pool for pool, _ in (*reads, *writes)})
        self._register_blocks(marker, reads, writes)
        marker.entries = True

    def _register_blocks(
        self, marker: Marker, reads: list[tuple[str, list[int]]], writes: list[tuple[str, list[int]]]
    ) -> None:
        """:meth:`register`'s per-block entries."""
        for pool, indices in reads:
            rt = self._reads.get(pool)
            if not rt:  # no pending reader in the pool: the entries go in as they are
                self._reads[pool] = dict.fromkeys(indices, marker)
                continue
            shared = rt.keys() & indices
            old = {i: rt[i] for i in shared}
            rt.update(dict.fromkeys(indices, marker))
            for i, readers in old.items():
                if isinstance(readers, dict):
                    readers[marker] = None
                    rt[i] = readers
                else:
                    rt[i] = {readers: None, marker: None}
        for pool, indices in writes:
            pending_reads = self._reads.get(pool)
            if pending_reads:
                for i in pending_reads.keys() & indices:  # the new write waits for them; ordering is transitive
                    del pending_reads[i]
            wt = self._writes.get(pool)
            if wt:
                wt.update(dict.fromkeys(indices, marker))
            else:
                self._writes[pool] = dict.fromkeys(indices, marker)

    def fence(self, marker: Marker, src_pool: str, s: list[int], dst_pool: str, d: list[int]) -> list[Marker]:
        """:meth:`dependencies` then :meth:`register`: a copy of blocks ``s`` of ``src_pool`` to ``d`` of ``dst_pool``.

        Sets ``marker.sources`` (the pending writers of ``s``).

        The per-call path of small copies: one pair is handled with plain dict operations (no sets, no
        generator). ``d`` holds no duplicates and, within one pool, no block of ``s`` (the engine checked).
        Returns the pending markers to wait for, each once.
        """
        if self._done:
            self.release_done()
        if len(s) != 1:
            reads, writes = [(src_pool, s)], [(dst_pool, d)]
            sources: set[Marker] = set()
            deps = self.dependencies(reads, writes, sources)
            if sources:
                marker.sources = list(sources)
            self.register(marker, reads, writes)
            return list(deps)
        x, y = s[0], d[0]
        out: list[Marker] = []
        wt = self._writes.get(src_pool)
        if wt:
            dep = wt.get(x)
            if dep is not None and not dep.completed:
                out.append(dep)
                marker.sources = [dep]
        wt = self._writes.get(dst_pool)
        if wt is None:
            wt = self._writes[dst_pool] = {}
        dep = wt.get(y)
        if dep is not None and not dep.completed and dep not in out:
            out.append(dep)
        rt = self._reads.get(dst_pool)
        if rt:
            readers = rt.pop(y, None)  # the new write waits for them; ordering is transitive
            if readers is not None:
                for dep in readers if isinstance(readers, dict) else (readers,):
                    if not dep.completed and dep not in out:
                        out.append(dep)
        wt[y] = marker
        rt = self._reads.get(src_pool)
        if rt is None:
            rt = self._reads[src_pool] = {}
        readers = rt.get(x)
        if readers is None:
            rt[x] = marker
        elif isinstance(readers, dict):
            readers[marker] = None
        elif readers.completed:  # its entries are still to be dropped (release_later): no need to keep it
            rt[x] = marker
        else:
            rt[x] = {readers: None, marker: None}
        marker.reads = [(src_pool, s)]
        marker.writes = [(dst_pool, d)]
        marker.entries = True
        self._hold(marker, (src_pool,) if src_pool == dst_pool else (src_pool, dst_pool))
        return out

    def release(self, marker: Marker) -> None:
        """Drop ``marker``'s entries (called once the op has completed)."""
        written = marker.entries
        marker.entries = False
        holders = self._holders
        cleared: list[str] = []
        for pool, _ in (*marker.reads, *marker.writes):  # a pool on both sides: the second pop finds nothing
            held = holders.get(pool)
            if held is not None and held.pop(marker, 0) is None and not held:
                # the last holder of the pool: every entry there, if any, is this marker's (an op's entries come and
                # go with its place among the holders), so the pool's tables are cleared whole, without a per-block loop
                for table in (self._reads.get(pool), self._writes.get(pool)):
                    if table:
                        table.clear()
                cleared.append(pool)
        if not written:
            return
        for pool, indices in marker.reads:
            if pool in cleared:
                continue
            rt = self._reads[pool]
            rget = rt.get
            for i in indices:
                readers = rget(i)
                if readers is marker:
                    del rt[i]
                elif isinstance(readers, dict) and readers.pop(marker, False) is None:
                    if len(readers) == 1:
                        rt[i] = next(iter(readers))
        for pool, indices in marker.writes:
            if pool in cleared:
                continue
            wt = self._writes[pool]
            get = wt.get
            for i in indices:
                if get(i) is marker:
                    del wt[i]

    def release_done(self) -> None:
        """Drop the entries of the completed markers given to ``release_later(marker)`` so far."""
        done = self._done
        if done:
            markers = done.copy()
            done.clear()  # in place: release_later is bound to this list
            for marker in markers:
                self.release(marker)

    def pending(self, pool: str, index: int) -> tuple[Marker | None, tuple[Marker, ...]]:
        """``(pending write, pending reads)`` of one block."""
        self.release_done()
        write = self._writes.get(pool, {}).get(index)
        readers = self._reads.get(pool, {}).get(index)
        if readers is None:
            return write, ()
        return write, tuple(readers) if isinstance(readers, dict) else (readers,)

    def statistics(self) -> FenceStatistics:
        """A snapshot: fenced blocks, pending reads and writes, waits so far."""
        self.release_done()
        fenced: set[tuple[str, int]] = set()
        reads = writes = 0
        for pool, wt in self._writes.items():
            writes += len(wt)
            fenced.update((pool, i) for i in wt)
        for pool, rt in self._reads.items():
            for i, readers in rt.items():
                reads += len(readers) if isinstance(readers, dict) else 1
                fenced.add((pool, i))
        return FenceStatistics(len(fenced), reads, writes, self.stream_waits, self.loop_waits)

    def __len__(self) -> int:
        return self.statistics().fenced_blocks

    def __bool__(self) -> bool:
        self.release_done()
        return any(self._writes.values()) or any(self._reads.values())

    def __repr__(self) -> str:
        s = self.statistics()
        return f"<FenceTable [blocks:{s.fenced_blocks}, reads:{s.pending_reads}, writes:{s.pending_writes}]>"
