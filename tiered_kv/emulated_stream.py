"""The emulated device's streams, for machines without a GPU: each stream a FIFO worker thread.

Primitives:

* :class:`EmulatedStream` -- the emulated implementation of :class:`tiered_kv.device.Stream`: ``fn`` runs when the
  stream's worker thread reaches it, *not* when it is submitted. That is what makes the races of the seeds
  reproducible on a CPU: a host buffer read by a queued op is read at execution time.
* :class:`EmulatedEvent` -- set when the stream that recorded it reaches the record point.
"""

from __future__ import annotations

import logging
import queue
import threading
import weakref
from collections.abc import Callable
from typing import Any

__all__ = ["EmulatedEvent", "EmulatedStream"]

log = logging.getLogger(__name__)

Callback = Callable[[], object]  # the return value, if any, is ignored


class EmulatedEvent:
    """Set when the stream that recorded it reaches the record point."""

    __slots__ = ("_flag",)

    def __init__(self) -> None:
        self._flag = threading.Event()

    def query(self) -> bool:
        """True once the work before the event has finished."""
        return self._flag.is_set()

    def synchronize(self) -> None:
        """Block until the work before the event has finished."""
        self._flag.wait()

    def spin(self, budget_ns: int) -> int:
        """Wait at most ``budget_ns`` for the event: 1 once reached, else 0 (the native ``DeviceEvent.spin``).

        The GIL is released while it waits: the emulated stream's work runs on a Python thread.
        """
        return 1 if self._flag.wait(budget_ns / 1e9) else 0

    def __repr__(self) -> str:
        return f"<EmulatedEvent {'done' if self._flag.is_set() else 'pending'}>"


_STOP = object()


def _emulated_worker(work: queue.SimpleQueue[object], name: str) -> None:
    """An emulated stream's worker thread: run queued work in order until ``_STOP``."""
    while True:
        fn = work.get()
        if fn is _STOP:
            return
        try:
            fn()  # type: ignore[operator]
        except BaseException:
            log.exception("emulated stream %s: submitted work raised", name)
        del fn  # hold no finished work (nor what it refers to) while waiting for the next


class EmulatedStream:
    """A FIFO worker thread: work runs when the worker reaches it, not when it is submitted.

    Exceptions raised by submitted work are logged and do not stop the worker; callers that need a
    per-op error (the engine does) catch inside ``fn``.
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self._queue: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._closed = False
        #: set by the engine that owns the stream: ``watch(marker, transfer)`` from a coroutine about to await work
        #: on this stream (the loop polls it near its end, see ``EngineConfig.completion_spin_us``)
        self.watch: Callable[[Any, Any], None] | None = None
        # The worker holds the queue and the name, not the stream: a stream (and the engine that owns it) dropped
        # without close() is collected, and its finalizer stops the worker (no thread left running).
        self._thread = threading.Thread(
            target=_emulated_worker, args=(self._queue, name), name=f"tiered_kv-emu-{name}", daemon=True
        )
        self._thread.start()
        self._finalizer = weakref.finalize(self, self._queue.put, _STOP)
        self._finalizer.atexit = False  # at exit the daemon worker just ends with the process

    def submit(self, fn: Callback, *, explicit: bool = False) -> None:
        """Queue ``fn`` on the stream's worker thread (``explicit`` changes nothing here)."""
        if self._closed:
            raise RuntimeError(f"stream {self.name} is closed")
        self._queue.put(fn)

    def record(self) -> EmulatedEvent:
        """An event set once the work queued so far has run."""
        event = EmulatedEvent()
        self.submit(event._flag.set)
        return event

    def wait(self, event: object) -> None:
        """Make work queued from now on wait for ``event``."""
        if not isinstance(event, EmulatedEvent):
            raise TypeError(f"an emulated stream can only wait on an EmulatedEvent, got {type(event).__name__}")
        if not event.query():
            flag = event._flag

            def wait_flag() -> None:
                flag.wait()

            self.submit(wait_flag)

    def notify(self, callback: Callback, *, beside: bool = False, nbytes: int = 0) -> EmulatedEvent:
        """Call ``callback()`` once the work queued so far has run; its event (``beside``, ``nbytes``: unused here)."""
        event = EmulatedEvent()

        def fire() -> None:
            event._flag.set()
            callback()

        self.submit(fire)
        return event

    def synchronize(self) -> None:
        """Block until the work queued so far has run."""
        self.record().synchronize()

    def close(self) -> None:
        """Run what is queued, then stop the worker thread."""
        if self._closed:
            return
        self._closed = True
        self._finalizer.detach()
        self._queue.put(_STOP)
        if threading.current_thread() is not self._thread:
            self._thread.join()

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"queued:{self._queue.qsize()}"
        return f"<EmulatedStream {self.name} [{state}]>"
