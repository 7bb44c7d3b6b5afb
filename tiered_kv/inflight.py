"""Copies in flight: each one issued behind its dependencies, completed on the event loop, then settled.

Primitives:

* :class:`InFlightCopies` -- the base of :class:`~tiered_kv.engine.TransferEngine` that owns a copy from the moment
  ``copy()`` has planned it (a :class:`~tiered_kv.fences.Marker` and its handler's :class:`~tiered_kv.handlers.Job`)
  until its bookkeeping is done: the in-flight set, the deferred enqueues, the fence table's releases, the counts
  and the per-direction statistics.
* :data:`ORPHAN_TIMEOUT` -- how long ``close()`` from a new event loop waits for copies the ended loop left.

Issue: a dependency on another stream is waited for stream-side (``wait_event``: no CPU block, no GPU bubble), one
on the same stream is ordered by the stream itself, one without an event (off-stream work, or not enqueued yet) is
awaited on the loop by a deferred task the engine owns (``close()`` waits for every one to end).

Completion reaches the loop in one of three ways, whichever sees it first (the others then find the marker completed
and do nothing):

* the op's thread (a stream's waiter, or the handler's callback) calls ``done``, which posts the marker to a
  :class:`~tiered_kv.completions.CompletionInbox` (``call_soon_threadsafe``; completions that arrive together wake
  the loop once; the loop never polls for these);
* the loop polls an awaited copy's event from shortly before its expected end
  (:class:`~tiered_kv.completions.EventPoller`, ``EngineConfig.completion_spin_us``);
* the awaiting coroutine polls the event in place before it yields (``EngineConfig.await_spin_us``).

Completing a marker wakes its awaiters at once; the bookkeeping (fence release, in-flight set, statistics) runs
later, from a callback queued behind the wake-ups, and every reader of that state settles it first.

Order and failures: a copy is never completed before one it waited for stream-side (those are completed first). A
copy that reads blocks an op was writing when it was issued fails when that op fails, and so does every copy that
reads what it wrote; an op it waited for only because it overwrites what that op read or wrote is not its source.
"""

from __future__ import annotations

import asyncio
import bisect
import functools
import logging
import time
from collections.abc import Iterable

from .completions import CompletionInbox, EventPoller
from .config import EngineConfig
from .cuda_stream import CudaStream, expected_end
from .device import Stream
from .errors import EngineClosedError, TransferError
from .fences import FenceTable, Marker
from .handlers import Job
from .transfer import LATENCY_BUCKETS, Transfer

__all__ = ["ORPHAN_TIMEOUT", "InFlightCopies"]

#: the engine's logger: a copy's failure is the engine's message
log = logging.getLogger("tiered_kv.engine")

#: Seconds ``close()`` from a new event loop waits for copies the engine's ended loop left in flight.
ORPHAN_TIMEOUT = 30.0

#: ``EngineConfig.completion_spin_us`` on CUDA when not set: the loop polls an awaited copy from 0.4 ms before its
#: expected end to 0.2 ms after it.
_DEFAULT_SPIN_US = 200

#: ``EngineConfig.await_spin_us`` on CUDA when not set: an awaited copy expected to end within 150 us is waited for
#: in place by the awaiting coroutine (a 12-of-16-token partial copy of 128 blocks runs ~150 us on an H100).
_DEFAULT_AWAIT_SPIN_US = 150

#: An awaited copy expected to end more than this many seconds from now lets the in-place poll first do the
#: bookkeeping of the copies completed before it (``_settle``), so that it is the oldest copy in flight when it ends.
_SETTLE_AHEAD = 20e-6


class _DirectionTotals:
    """What the copies of one direction did so far (mutable: updated in place on every completion)."""

    __slots__ = ("blocks", "counts", "nbytes", "seconds")

    def __init__(self) -> None:
        self.nbytes = 0
        self.blocks = 0
        self.seconds = 0.0
        self.counts = [0] * (len(LATENCY_BUCKETS) + 1)


def _ok_at_event(marker: Marker) -> bool:
    """Whether reaching ``marker``'s event is its whole completion (its job's ``ok_at_event``; no job: no)."""
    ok_at_event = getattr(marker.job, "ok_at_event", None)
    return ok_at_event is not None and bool(ok_at_event())


def _launch_error(marker: Marker) -> BaseException | None:
    """The error a stream op whose event was reached will report, if its job says so (``Job.error_at_event``)."""
    if _ok_at_event(marker):
        return None
    error_at_event = getattr(marker.job, "error_at_event", None)
    return error_at_event() if error_at_event is not None else None


def _failed_source(marker: Marker) -> BaseException | None:
    """The error for ``marker`` if an op that was writing a block it reads, when it was issued, failed.

    Such a copy reads bytes that never arrived: it fails too, and so does every copy that reads what it wrote. An op
    it waited for only because it writes what that op read or wrote is not its source: that one's failure is not its.
    """
    for source in marker.sources:
        error = source.error
        if error is not None and source.completed:
            failed = TransferError(f"a copy this one reads from failed: {error}")
            failed.__cause__ = error
            return failed
    return None


class InFlightCopies:
    """The copies an engine has issued and not yet settled, and the loop-side machinery that completes them.

    The base of :class:`~tiered_kv.engine.TransferEngine`: the engine validates and plans a copy, then hands its
    marker and job to :meth:`_start` and enters it in ``_inflight``; everything after that is here. State read by
    the engine's inspection (``statistics``, ``fences``, ``drain``, ``close``) is settled first (:meth:`_settle`).
    All of it runs on the engine's event loop, except ``done`` (:meth:`_finished`), which any thread may call.
    """

    def __init__(self) -> None:
        self._fences = FenceTable()
        # in-flight marker -> ("src->dst" direction, its transfer): one dict for the in-flight set and the statistics
        self._inflight: dict[Marker, tuple[str, Transfer]] = {}
        # The engine owns its deferred enqueues (copies waiting on the loop for an off-lane dependency): each
        # task leaves this set when it ends, and close() waits for the set to empty before stopping anything.
        self._deferred: set[asyncio.Task[None]] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._inbox: CompletionInbox[Marker] | None = None
        self._poller: EventPoller[Marker] | None = None  # the loop-side poll of awaited copies about to end
        self._await_spin = 0.0  # seconds an awaiting coroutine polls in place (EngineConfig.await_spin_us)
        self._in_place = 0  # awaits that found their copy done before yielding (one look, or the in-place poll)
        self._settle_queued = False  # a _settle is queued on the loop (the in-place poll queues one per round)
        self._submitted = self._completed = self._failed = 0
        self._settling: list[Marker] = []  # completed, awaiters woken, bookkeeping still to do (_settle)
        # direction -> what its copies did so far: one lookup per completion
        self._by_direction: dict[str, _DirectionTotals] = {}

    def _bind_completions(
        self, loop: asyncio.AbstractEventLoop, config: EngineConfig, is_cuda: bool, streams: Iterable[Stream]
    ) -> None:
        """Deliver completions on ``loop`` (the engine's, bound once): the inbox, the poller, the streams' hooks."""
        # completions arriving together: one wake-up; their bookkeeping runs after the awaiters resumed
        self._inbox = CompletionInbox(loop, self._complete, self._settle)
        spin = config.completion_spin_us
        if spin is None:
            spin = _DEFAULT_SPIN_US if is_cuda else 0
        if spin > 0:  # awaited copies about to end: the loop polls their events (EngineConfig.completion_spin_us)
            self._poller = EventPoller(loop, self._poll, self._settle, spin / 1e6)
        in_place = config.await_spin_us
        if in_place is None:
            in_place = _DEFAULT_AWAIT_SPIN_US if is_cuda else 0
        self._await_spin = in_place / 1e6
        for stream in streams:
            if self._poller is not None or self._await_spin > 0:
                stream.watch = self._watch  # type: ignore[attr-defined]  # our streams have it
            if isinstance(stream, CudaStream):  # woken shortly before a long copy's expected end
                stream.near_end = self._poller.wake if self._poller is not None else self._inbox.poke

    # ------------------------------------------------------------------------------------ issue

    def _start(self, loop: asyncio.AbstractEventLoop, marker: Marker, job: Job, deps: Iterable[Marker]) -> None:
        """Enqueue ``job`` now behind its stream-side dependencies, or from a task once its loop-side ones are done.

        A dependency on another stream is waited for stream-side; one on the same stream is ordered by the stream
        itself; one without an event (off-stream work, or not enqueued yet) is awaited on the loop.
        """
        lane = marker.lane
        stream_deps: list[Marker] = []
        loop_deps: list[Marker] = []
        for dep in deps:
            if lane is not None and dep.lane is not None and dep.event is not None:
                if dep.lane is not lane:  # same stream: FIFO already orders it
                    stream_deps.append(dep)
            else:
                loop_deps.append(dep)
        if loop_deps:
            task = loop.create_task(self._enqueue_after(marker, job, stream_deps, loop_deps))
            self._deferred.add(task)
            task.add_done_callback(self._deferred.discard)
        else:
            self._enqueue(marker, job, stream_deps)

    @staticmethod
    def _finished(inbox: CompletionInbox[Marker], marker: Marker, error: BaseException | None) -> None:
        """The end of ``marker``'s op, from whichever thread saw it; completes it on the loop.

        Bound per copy by ``functools.partial``, which costs no Python call.
        """
        if marker.completed:  # the loop completed it from its event already (_poll): nothing left to do
            return
        if error is not None:
            marker.error = error
        marker.done_at = time.perf_counter()
        inbox.post(marker)

    def _enqueue(self, marker: Marker, job: Job, stream_deps: list[Marker]) -> None:
        """Start ``job`` behind ``stream_deps`` (waited for on its lane); its completion calls :meth:`_complete`."""
        assert self._inbox is not None
        done = functools.partial(self._finished, self._inbox, marker)
        lane = marker.lane
        if lane is not None and stream_deps:
            for dep in stream_deps:
                assert dep.event is not None
                lane.wait(dep.event)
            marker.after = stream_deps
            self._fences.stream_waits += len(stream_deps)
        try:
            marker.event = job.start(done)
            marker.job = job
        except BaseException as exc:  # reported to whoever awaits the transfer
            done(exc)

    async def _enqueue_after(
        self, marker: Marker, job: Job, stream_deps: list[Marker], loop_deps: list[Marker]
    ) -> None:
        """Wait on the loop for off-stream dependencies, then enqueue.

        Cancellation: only happens when the loop shuts down under a live engine; the marker is then
        completed with the error so that nothing waits on it forever.
        """
        try:
            for dep in loop_deps:
                await dep.wait()
            self._fences.loop_waits += len(loop_deps)
            failed = _failed_source(marker)
            abort = getattr(job, "abort", None)
            if failed is not None and abort is not None:  # not started: it would copy bytes that never arrived
                abort(failed)
                marker.error = failed
                self._complete(marker)
                self._settle()
                return
            self._enqueue(marker, job, stream_deps)  # a failed source without abort(): failed at its completion
        except BaseException as exc:
            marker.error = exc
            self._complete(marker)
            self._settle()  # not a delivery of the inbox: no callback settles it
            if isinstance(exc, asyncio.CancelledError):
                raise

    # ------------------------------------------------------------------------------------ completion

    def _complete(self, marker: Marker) -> None:
        """Complete ``marker`` on the loop: wake its awaiters now, do the bookkeeping later (:meth:`_settle`).

        An awaiting coroutine resumes in the loop's next round of callbacks, behind whatever the current callback
        still does; so only the wake-up runs here. The fence release and statistics run from the completion inbox's
        callback queued behind the wake-ups, and every reader of that state settles it first (``statistics``,
        ``fences``, ``drain``, ``close``): nobody sees it stale.
        """
        if marker.completed:
            return
        # Ops this one waited for stream-side finished on the device before it did; their own completion
        # callbacks come from other waiter threads and may arrive later. Complete them first, so that
        # done() respects the order the fences imposed (a transfer is never done before one it waited for).
        after = marker.after
        if after:
            for dep in after:
                if not dep.completed:
                    if dep.done_at is None:
                        dep.done_at = marker.done_at
                    if dep.error is None and not _ok_at_event(dep):
                        # its copy failed at launch: its own done() would bring the error, and finds it completed
                        dep.error = _launch_error(dep) or TransferError("a copy this one waited for failed")
                    self._complete(dep)
            marker.after = []
        sources = marker.sources
        if sources:
            for source in sources:  # on this op's stream, done before it: a launch that failed is known by now
                if not source.completed and source.error is None and source.event is not None:
                    source.error = _launch_error(source)
                    if source.error is not None:
                        self._complete(source)
            if marker.error is None:
                marker.error = _failed_source(marker)
            marker.sources = ()
        # queued before complete(): a done-callback that reads the statistics or the fences settles them first
        self._fences.release_later(marker)
        self._settling.append(marker)
        marker.complete()

    def _watch(self, marker: Marker, transfer: Transfer) -> None:
        """A coroutine is about to await ``transfer`` (on a stream): wait in place, or have the loop poll it.

        Expected end: submitted plus its bytes at the stream's measured rate (a first guess before any). Due within
        ``EngineConfig.await_spin_us``: the awaiting coroutine polls the event here, without yielding to the loop,
        for at most that long (done: it goes on as after a done future, no loop round to see the event nor one to
        resume it). Otherwise, or not done by then: the loop polls it from near its expected end
        (:class:`EventPoller`); a copy queued behind others ends later than expected and is polled until the poller
        gives up on it, then completed by its thread as without the poller.
        """
        # the stream waiter's own estimate (device.expected_end), in perf_counter seconds; no bytes: due at once.
        # A long copy is polled up to a quarter of its span late (a partial copy runs below the stream's best rate)
        _wake, due_ns = expected_end(0, transfer.nbytes, getattr(marker.lane, "rate", 0.0))
        span = max(due_ns, 0) / 1e9
        due = transfer.submitted_at + span
        now = time.perf_counter()
        spin = self._await_spin
        if due <= now + spin:
            # due now or within the in-place budget: look until it is done or the budget is spent. Done (or left to
            # its thread: a failed op): the awaiting coroutine then finds it completed and goes on without yielding;
            # the bookkeeping runs behind it, as after the poller's rounds. Its _settle is queued first, while the
            # device still copies (one per loop round; a queued _settle with nothing to do returns at once)
            if not self._settle_queued:
                loop = self._loop
                assert loop is not None
                self._settle_queued = True
                loop.call_soon(self._settle)
            event = marker.event
            look = getattr(event, "spin", None)
            if look is not None:  # the native and the emulated events: look until done or the budget is spent
                if self._settling and due > now + _SETTLE_AHEAD:  # the earlier copies' bookkeeping, while this one runs
                    self._settle()
                seen = look(int(spin * 1e9))  # 1 done, 0 not yet, -1 CUDA error (raised by _poll's query)
                done = seen != 0 and self._poll(marker)
            else:  # a torch event (CUDA without the extension)
                until = now + spin
                while not (done := self._poll(marker)):
                    if time.perf_counter() >= until:
                        break
                    time.sleep(0)
            if done:
                self._in_place += 1  # seen before the coroutine yielded (tests, probes)
                if self._poller is not None:
                    self._poller.finished += 1  # seen by the loop, as a poll would
                return
        poller = self._poller
        if poller is not None:
            poller.watch(marker, due, span / 4)

    def _poll(self, marker: Marker) -> bool:
        """One loop-side poll of ``marker`` (:class:`EventPoller`): True once it needs no more polls.

        Its event reached and its job's completion nothing more than that (``ok_at_event``): complete it now, as
        its thread's ``done`` would (which then finds it completed and does nothing). Copies enqueued before it on
        its stream ended before it: they are completed first, as the stream's thread completes them in order; if
        one of them failed (its error comes with its ``done``), all are left to the thread.
        """
        if marker.completed:
            return True
        event = marker.event
        if event is None or not event.query():
            return False
        if not _ok_at_event(marker):
            return True
        lane = marker.lane
        earlier = []
        for other in self._inflight:  # copy() order; what was enqueued before it on its stream has ended too
            if other is marker:
                break
            if other.lane is lane and not other.completed and other.event is not None and other.event.query():
                if not _ok_at_event(other):
                    return True
                earlier.append(other)
        now = time.perf_counter()
        for other in earlier:
            other.done_at = now
            self._complete(other)
        marker.done_at = now
        self._complete(marker)
        return True

    def _settle(self) -> None:
        """The bookkeeping of the copies completed so far: fence release, in-flight set, statistics."""
        self._settle_queued = False
        self._fences.release_done()
        markers = self._settling
        if not markers:
            return
        self._settling = []
        for marker in markers:
            direction, transfer = self._inflight.pop(marker)
            self._completed += 1
            if marker.error is not None:
                self._failed += 1
                # one message per failure: the error reaches whoever awaits the transfer (or its done-callback)
                log.debug("%s transfer of %d blocks failed: %r", direction, transfer.num_blocks, marker.error)
                continue
            seconds = (marker.done_at or time.perf_counter()) - transfer.submitted_at
            totals = self._by_direction.get(direction)
            if totals is None:
                totals = self._by_direction[direction] = _DirectionTotals()
            totals.nbytes += transfer.nbytes
            totals.blocks += transfer.num_blocks
            totals.seconds += seconds
            totals.counts[bisect.bisect_left(LATENCY_BUCKETS, seconds)] += 1

    # ------------------------------------------------------------------------------------ orphans

    async def _take_over_completions(self) -> None:
        """close() from a new loop after the engine's loop ended with copies in flight.

        A copy that finished on its thread posted its completion to the dead loop, where it never ran: complete
        it here (dependencies first, as always). A copy that never finished within ``ORPHAN_TIMEOUT`` seconds
        (deferred on the dead loop, never enqueued) is completed with :class:`EngineClosedError`.
        """
        deadline = time.monotonic() + ORPHAN_TIMEOUT
        while self._inflight:
            for marker in [m for m in self._inflight if m.done_at is not None]:
                self._complete(marker)
            self._settle()  # here, not from the ended loop's callbacks
            if not self._inflight:
                break
            if time.monotonic() > deadline:
                for marker in list(self._inflight):
                    if not marker.completed:
                        marker.error = EngineClosedError("the copy's event loop ended before it could be enqueued")
                        self._complete(marker)
                self._settle()
                break
            await asyncio.sleep(0.005)
