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
from collections.abc import Callable
from typing import Generic, TypeVar

__all__ = ["CompletionInbox"]

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
