"""Completion delivery: device and worker threads hand finished ops to the event loop, batched.

Primitives:

* :class:`CompletionInbox` -- ``post(item)`` from any thread; the loop runs ``handler(item)`` for every posted
  item, in posting order. Items posted while a delivery is already scheduled ride along with it: a burst of
  completions that arrive together costs one ``call_soon_threadsafe`` (one loop wake-up), not one each.
  ``after()``, if given, runs once per delivery in a loop callback of its own, queued behind whatever the
  handlers scheduled: the handlers wake the awaiting coroutines, and the work that need not delay them
  (bookkeeping) runs after those have resumed.

The rule that keeps nothing stranded: a poster appends first and schedules a delivery only if none is
pending; the delivery clears the pending flag *before* it takes the items, under the same lock. An item
appended after the take finds the flag clear and schedules the next delivery.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from typing import Generic, TypeVar

__all__ = ["CompletionInbox", "EventPoller"]

log = logging.getLogger(__name__)

T = TypeVar("T")


class CompletionInbox(Generic[T]):
    """Posts from any thread, delivered on ``loop`` in batches.

    Args:
        loop: the event loop that runs ``handler``.
        handler: called on the loop once per posted item, in posting order. An exception it raises is
            logged and does not stop the rest of the batch.
        after: called on the loop once per delivery, from a callback queued (``call_soon``) after the
            delivery's handlers ran: behind the wake-ups they scheduled.

    Attributes:
        deliveries: loop callbacks run so far (fewer than ``posted`` when completions were batched).
        posted: items posted so far.
    """

    __slots__ = ("_after", "_handler", "_items", "_lock", "_loop", "_pending", "deliveries", "posted")

    def __init__(
        self, loop: asyncio.AbstractEventLoop, handler: Callable[[T], None], after: Callable[[], None] | None = None
    ) -> None:
        self._loop = loop
        self._handler = handler
        self._after = after
        self._lock = threading.Lock()
        self._items: list[T] = []
        self._pending = False
        self.deliveries = 0
        self.posted = 0

    def post(self, item: T) -> None:
        """Hand ``item`` to the loop (any thread). A closed loop drops it with a debug log: nobody is left."""
        with self._lock:
            self._items.append(item)
            self.posted += 1
            if self._pending:
                return
            self._pending = True
        try:
            self._loop.call_soon_threadsafe(self._deliver)
        except RuntimeError:  # the loop is closed
            log.debug("completion posted after its event loop closed")

    def poke(self) -> None:
        """Wake the loop now without an item (any thread): a completion is expected within a fraction of a ms.

        A loop woken just before a completion answers the completion's own wake-up faster than one asleep for
        milliseconds. Nothing is queued when a delivery is already pending.
        """
        if self._pending:
            return
        try:
            self._loop.call_soon_threadsafe(_nothing)
        except RuntimeError:  # the loop is closed
            pass

    def _deliver(self) -> None:
        with self._lock:
            items, self._items = self._items, []
            self._pending = False
        self.deliveries += 1
        handler = self._handler
        for item in items:
            try:
                handler(item)
            except Exception:
                log.exception("completion handler raised")
        if self._after is not None:
            self._loop.call_soon(self._after)

    def __repr__(self) -> str:
        return f"<CompletionInbox posted:{self.posted} deliveries:{self.deliveries} queued:{len(self._items)}>"


def _nothing() -> None:
    """The callback of :meth:`CompletionInbox.poke`: the wake-up is the point."""


class EventPoller(Generic[T]):
    """The loop polls items expected to finish within ``lead`` seconds, every round, until they do.

    Args:
        loop: the event loop that polls.
        poll: ``poll(item) -> bool`` on the loop: True once the item needs no more polling (it finished, and
            ``poll`` handled it, or it is left to its thread), False to poll it again next round.
        after: called on the loop (``call_soon``) after a round in which an item stopped needing polls.
        window: seconds an item is polled past its expected end before the poller gives up on it (its thread
            still completes it, as without the poller).

    ``watch(item, due)`` (on the loop) polls at once when ``due`` (``time.perf_counter()`` seconds) is at most
    ``lead = 2 * window`` away, else keeps the item until :meth:`near_end` (a thread expecting an end soon wakes the
    loop with :meth:`wake`). While anything is watched the loop never sleeps: each round runs a ``call_soon``
    callback, so the loop's selector is polled with a zero timeout and other callbacks and tasks run as usual. The
    cost is one busy core for at most ``lead + max(window, slack)`` per watched item.

    Attributes:
        polls: loop rounds that polled (statistics).
        finished: items that stopped needing polls within their window (the engine adds the copies it completed from
            one look at their event when their await began).
    """

    __slots__ = ("_after", "_armed", "_loop", "_poll", "_soon", "_watched", "finished", "lead", "polls", "window")

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        poll: Callable[[T], bool],
        after: Callable[[], None] | None,
        window: float,
    ) -> None:
        if not window > 0:
            raise ValueError(f"window must be > 0 seconds, got {window!r}")
        self._loop = loop
        self._poll = poll
        self._after = after
        self.window = window
        self.lead = 2 * window
        self._watched: list[tuple[T, float]] = []  # (item, give up at)
        self._soon: list[tuple[T, float, float]] = []  # (item, expected end, slack): too far away to poll yet
        self._armed = False
        self.polls = 0
        self.finished = 0

    def watch(self, item: T, due: float, slack: float = 0.0) -> None:
        """Poll ``item`` from now (``due`` within :attr:`lead`) or from the next :meth:`near_end` (loop only).

        It is polled until ``max(window, slack)`` seconds past ``due`` (``slack``: how late a long item may run
        against its estimate, e.g. a quarter of its expected span).
        """
        now = time.perf_counter()
        if slack < self.window:
            slack = self.window
        if due - now > self.lead:
            soon = self._soon
            if len(soon) >= 64:  # nobody woke the loop for these (a stream without pre-wake): forget the stale ones
                self._soon = soon = [(i, d, s) for i, d, s in soon if d + s > now]
            soon.append((item, due, slack))
            return
        self._watched.append((item, max(due, now) + slack))
        if not self._armed:
            self._armed = True
            self._loop.call_soon(self._check)

    def near_end(self) -> None:
        """Start polling the kept items now within :attr:`lead` of their expected end (loop only)."""
        soon = self._soon
        if not soon:
            return
        now = time.perf_counter()
        keep = []
        for item, due, slack in soon:
            if due - now <= self.lead:
                self._watched.append((item, max(due, now) + slack))
            elif due + slack > now:
                keep.append((item, due, slack))
        self._soon = keep
        if self._watched and not self._armed:
            self._armed = True
            self._loop.call_soon(self._check)

    def wake(self) -> None:
        """:meth:`near_end` on the loop, from any thread (a stream's waiter shortly before a long copy's end)."""
        try:
            self._loop.call_soon_threadsafe(self.near_end)
        except RuntimeError:  # the loop is closed
            pass

    def _check(self) -> None:
        self.polls += 1
        now = time.perf_counter()
        poll = self._poll
        keep = []
        ended = False
        for entry in self._watched:
            if poll(entry[0]):
                ended = True
                self.finished += 1
            elif now < entry[1]:
                keep.append(entry)
        self._watched = keep
        if ended and self._after is not None:
            self._loop.call_soon(self._after)
        if keep:
            self._loop.call_soon(self._check)
        else:
            self._armed = False

    def __repr__(self) -> str:
        return f"<EventPoller window:{self.window * 1e6:.0f}us watched:{len(self._watched)} kept:{len(self._soon)}>"
