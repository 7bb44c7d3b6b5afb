"""A deadline on every file I/O call: a call that hangs (a stalled disk, a hung NFS mount) fails in bounded time.

Primitives:

* :class:`FileTimeout` -- a :class:`~tiered_kv.errors.TransferError`: a call did not return within the tier's
  ``timeout``. ``pending`` is the call, still running, whose buffers must not be reused until it is done (the
  file tier's twin of :class:`~tiered_kv.remote.StoreTimeout`).
* :class:`DeadlineBackend` -- wraps the tier's :class:`~tiered_kv.backends.FileBackend`: at most ``limit`` calls
  in the backend at once (so a call's clock starts when it reaches the I/O threads, not in a queue behind a
  large batch), each failed with :class:`FileTimeout` once it has run ``timeout`` seconds; ``settle(seconds)``
  waits for calls that outlived their deadline.
* :func:`after_io` -- run a release once the I/O behind an error has really returned.
* :class:`BouncePool` -- aligned host buffers that reads land in before the verified bytes are copied to a pool
  block: a read past its deadline keeps writing into its bounce buffer, never into a block handed out since.

Rules:

* A thread stuck in a system call cannot be stopped: a late call keeps its buffers and its I/O slot until it
  returns. Its caller holds every buffer the call may still write or read (:func:`after_io`); a write to a slot
  that a late write still targets fails at once (no two writes of one slot in flight).
* When every I/O slot is held by a late call the backend is *wedged*: queued and new calls fail at once with
  :class:`FileTimeout` (a miss for the cache), until a late call returns.
* ``sync`` has the same deadline (it holds no buffer).
"""

from __future__ import annotations

import collections
import concurrent.futures
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from ..backends import Completion, FileBackend
from ..backends.posix import aligned_empty
from ..errors import TransferError

__all__ = ["DEFAULT_TIMEOUT", "BouncePool", "DeadlineBackend", "FileTimeout", "after_io"]

DEFAULT_TIMEOUT = 5.0
"""Seconds one file I/O call may take (the remote tier's per-batch default, ``?timeout=5``)."""

Buffer = Any  # torch.Tensor | np.ndarray, as the backends take them


class FileTimeout(TransferError):
    """A file I/O call did not return within the file tier's ``timeout``.

    Attributes:
        pending: the backend call still running (its buffers must not be reused until it is done); ``None``
            when the call never reached the backend (it was refused because every I/O slot was held).
    """

    def __init__(self, message: str, pending: concurrent.futures.Future[Any] | None = None) -> None:
        super().__init__(message)
        self.pending = pending


def after_io(exc: BaseException | None, release: Callable[[], object]) -> None:
    """Run ``release()`` now, or, when ``exc`` is a :class:`FileTimeout` whose call still runs, once it returns."""
    pending = exc.pending if isinstance(exc, FileTimeout) else None
    if pending is None or pending.done():
        release()
    else:
        pending.add_done_callback(lambda _: release())


#: Seconds stop() waits for the watchdog thread: it only fails the calls it found expired, then returns.
_STOP_WAIT = 5.0


class _Call:
    __slots__ = ("args", "deadline", "expired", "offset", "outer", "pending", "returned", "write")

    def __init__(self, write: bool, offset: int, args: tuple[Any, ...]) -> None:
        self.write = write
        self.offset = offset
        self.args = args
        self.outer: concurrent.futures.Future[int] = concurrent.futures.Future()  # what the caller awaits
        self.pending: concurrent.futures.Future[None] = concurrent.futures.Future()  # done when inner returned
        self.deadline = 0.0
        self.returned = False
        self.expired = False


class DeadlineBackend:
    """``inner`` with a deadline on every call (see the module docstring).

    Args:
        inner: the backend that does the I/O.
        timeout: seconds a call may run in ``inner`` before it fails with :class:`FileTimeout`.
        limit: calls in ``inner`` at once (a few per I/O thread); further calls wait here, off the clock.

    Attributes:
        timeouts: calls failed by their deadline so far, and calls refused while every I/O slot was held.
    """

    def __init__(self, inner: FileBackend, timeout: float, limit: int) -> None:
        if not timeout > 0 or limit < 1:
            raise ValueError(f"bad DeadlineBackend arguments: {timeout=}, {limit=}")
        self.inner = inner
        self.name = inner.name
        self.device_io = inner.device_io
        self.path = getattr(inner, "path", None) or getattr(getattr(inner, "inner", None), "path", None)
        self.timeout = float(timeout)
        self.limit = limit
        self.timeouts = 0
        self._cv = threading.Condition(threading.Lock())
        self._running = 0  # calls in inner, late ones included
        self._late: set[_Call] = set()  # calls in inner past their deadline
        self._late_writes: collections.Counter[int] = collections.Counter()  # offset -> late writes to it
        self._queue: collections.deque[_Call] = collections.deque()
        self._clock: collections.deque[_Call] = collections.deque()  # calls in inner, by deadline (one timeout)
        self._stopped = False
        self._watchdog: threading.Thread | None = None

    # -------------------------------------------------------------------------------- FileBackend

    def pwrite(
        self, buffers: Sequence[Buffer], offset: int, *, before: Callable[[], object] | None = None
    ) -> concurrent.futures.Future[int]:
        """Write through ``inner``; fails with :class:`FileTimeout` past the deadline."""
        return self._submit(_Call(True, offset, (tuple(buffers), before)))

    def pread(
        self, buffers: Sequence[Buffer], offset: int, *, after: Callable[[int], object] | None = None
    ) -> concurrent.futures.Future[int]:
        """Read through ``inner``; fails with :class:`FileTimeout` past the deadline."""
        return self._submit(_Call(False, offset, (tuple(buffers), after)))

    def sync(self, data_only: bool) -> Completion:
        """Sync ``inner``; fails with :class:`FileTimeout` past the deadline (it takes no I/O slot)."""
        inner = self.inner.sync(data_only)
        outer: concurrent.futures.Future[int] = concurrent.futures.Future()
        timer = threading.Timer(self.timeout, self._expire_sync, (inner, outer))
        timer.daemon = True
        timer.start()

        def returned(f: Any) -> None:
            timer.cancel()
            _forward(f, outer)

        inner.add_done_callback(returned)
        return outer

    def close(self) -> None:
        """Stop the watchdog and close ``inner`` (only once no late call runs: see :meth:`settle`)."""
        self.stop()
        self.inner.close()

    # -------------------------------------------------------------------------------- life cycle

    @property
    def late(self) -> int:
        """Calls past their deadline that have not returned yet."""
        with self._cv:
            return len(self._late)

    def settle(self, seconds: float) -> bool:
        """Wait up to ``seconds`` for every call past its deadline to return; ``True`` if none runs any more."""
        with self._cv:
            pending = [c.pending for c in self._late]
        if pending:
            concurrent.futures.wait(pending, timeout=seconds)
        return self.late == 0

    def stop(self) -> None:
        """Stop the watchdog thread and wait for it to end (idempotent); calls still queued fail."""
        with self._cv:
            self._stopped = True
            queued = list(self._queue)
            self._queue.clear()
            self._cv.notify_all()
            watchdog = self._watchdog
        for c in queued:
            c.pending.set_result(None)
            _fail(c.outer, TransferError("the file tier closed before this I/O call started"))
        if watchdog is not None and watchdog is not threading.current_thread():
            watchdog.join(_STOP_WAIT)

    # -------------------------------------------------------------------------------- calls

    def _submit(self, call: _Call) -> concurrent.futures.Future[int]:
        refused: BaseException | None = None
        with self._cv:
            if self._stopped:
                refused = TransferError("the file tier is closed")
            elif call.write and self._late_writes[call.offset]:
                refused = TransferError(
                    f"a write at byte {call.offset} of the slab outlived its deadline and still runs: "
                    "the slot is not written again until it returns"
                )
            elif self._running >= self.limit and len(self._late) == self._running:
                self.timeouts += 1
                refused = self._wedged()
            elif self._running >= self.limit:
                self._queue.append(call)
                return call.outer
            else:
                self._admit_locked(call)
        if refused is not None:
            call.pending.set_result(None)
            _fail(call.outer, refused)
            return call.outer
        self._start(call)
        return call.outer

    def _wedged(self) -> FileTimeout:
        return FileTimeout(
            f"all {self.limit} file I/O slots are held by calls that outlived the {self.timeout:g} s deadline "
            "(a stalled disk or a hung mount?)"
        )

    def _admit_locked(self, call: _Call) -> None:
        self._running += 1
        call.deadline = time.monotonic() + self.timeout
        self._clock.append(call)
        if self._watchdog is None:
            self._watchdog = threading.Thread(target=self._watch, name="tiered_kv-file-deadline", daemon=True)
            self._watchdog.start()
        elif len(self._clock) == 1:
            self._cv.notify()

    def _start(self, call: _Call) -> None:
        buffers, hook = call.args
        call.args = ()  # the clock keeps a returned call until its deadline: not its buffers
        try:
            if call.write:
                inner = self.inner.pwrite(buffers, call.offset, before=hook)
            else:
                inner = self.inner.pread(buffers, call.offset, after=hook)
        except BaseException as exc:  # reported through the call's future
            failed: concurrent.futures.Future[int] = concurrent.futures.Future()
            failed.set_exception(exc)
            inner = failed
        inner.add_done_callback(lambda f: self._returned(call, f))

    def _returned(self, call: _Call, fut: Any) -> None:
        start: list[_Call] = []
        with self._cv:
            self._running -= 1
            call.returned = True
            if call.expired:
                self._late.discard(call)
                if call.write:
                    self._late_writes[call.offset] -= 1
                    if not self._late_writes[call.offset]:
                        del self._late_writes[call.offset]
            while self._queue and self._running < self.limit:
                nxt = self._queue.popleft()
                self._admit_locked(nxt)
                start.append(nxt)
        if not call.expired:
            _forward(fut, call.outer)
        call.pending.set_result(None)  # what waited for the late call's buffers runs now
        for nxt in start:
            self._start(nxt)

    def _watch(self) -> None:
        while True:
            expired: list[_Call] = []
            refused: list[_Call] = []
            with self._cv:
                while not self._stopped and not self._clock:
                    self._cv.wait()
                if self._stopped:
                    return
                now = time.monotonic()
                while self._clock and (self._clock[0].returned or self._clock[0].deadline <= now):
                    c = self._clock.popleft()
                    if c.returned:
                        continue
                    c.expired = True
                    self._late.add(c)
                    self.timeouts += 1
                    if c.write:
                        self._late_writes[c.offset] += 1
                    expired.append(c)
                if self._running >= self.limit and len(self._late) == self._running:
                    refused = list(self._queue)
                    self._queue.clear()
                    self.timeouts += len(refused)
                if not expired and self._clock:
                    self._cv.wait(max(0.0, self._clock[0].deadline - now))
            for c in expired:
                what = "write" if c.write else "read"
                _fail(c.outer, FileTimeout(
                    f"a file {what} at byte {c.offset} of the slab took longer than {self.timeout:g} s "
                    "(a stalled disk or a hung mount?)",
                    pending=c.pending,
                ))
            for c in refused:
                c.pending.set_result(None)
                _fail(c.outer, self._wedged())

    def _expire_sync(self, inner: concurrent.futures.Future[Any], outer: concurrent.futures.Future[int]) -> None:
        if not inner.done():
            with self._cv:
                self.timeouts += 1
            _fail(outer, FileTimeout(f"a file sync took longer than {self.timeout:g} s", pending=inner))

    def __repr__(self) -> str:
        return f"<DeadlineBackend {self.timeout:g} s running:{self._running} late:{len(self._late)} {self.inner!r}>"


def _forward(src: Any, dst: concurrent.futures.Future[int]) -> None:
    exc = src.exception()
    if exc is not None:
        _fail(dst, exc)
        return
    try:
        dst.set_result(src.result())
    except concurrent.futures.InvalidStateError:  # failed by its deadline first
        pass


def _fail(fut: concurrent.futures.Future[int], exc: BaseException) -> None:
    try:
        fut.set_exception(exc)
    except concurrent.futures.InvalidStateError:  # decided already
        pass


class BouncePool:
    """Aligned host buffers of one block's payload, reused (made on demand, never more than were in use at once).

    Args:
        nbytes: bytes of one buffer.
    """

    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes
        self._free: list[np.ndarray] = []
        self._lock = threading.Lock()
        self.made = 0

    def take(self) -> np.ndarray:
        """A buffer of ``nbytes`` (uint8, 4096-aligned)."""
        with self._lock:
            if self._free:
                return self._free.pop()
            self.made += 1
        return aligned_empty(self.nbytes).numpy()

    def give(self, buf: np.ndarray) -> None:
        """Return a buffer (no I/O may still write into it)."""
        with self._lock:
            self._free.append(buf)
