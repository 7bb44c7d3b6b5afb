"""Slot-state changes of the file tier, applied and announced on the event loop, in order.

Primitives:

* :class:`SlotEvent` -- one slot given up by the file tier: ``(slot, key, generation, reason)``.
* :class:`SlotEvents` -- the ordered channel: I/O threads :meth:`~SlotEvents.post` index changes, the
  loop applies them one at a time (FIFO) and hands every resulting :class:`SlotEvent` to the listeners
  (the block manager) in the same loop step.

Why. A file write that fails, or a read that fails verification, is detected on an
I/O thread. If the tier's index changed right there, a planner on the loop could see a slot as "holds no
block" in the middle of issuing a plan it made a moment before from the old state -- a plan issued by
halves. Here the index a planner validates against changes only on the loop, between two of its steps,
and in the same step the listeners learn of it; a copy's completion is posted after its slot changes, so
a listener always hears of a dropped slot no later than of the failed copy that dropped it. Data-path
truth (the tombstone that makes a read of a failed write fail verification) is still set on the I/O
thread at once: it is what the bytes are checked against, and it only ever makes reads fail.

Without a bound loop (a tier used on its own, or after the loop closed) changes apply at once on the
posting thread, under the tier's lock, and listeners are called there.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import threading
from collections.abc import Callable

__all__ = ["SlotEvent", "SlotEvents", "SlotListener"]

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, slots=True)
class SlotEvent:
    """A slot the file tier no longer holds a block in.

    Attributes:
        slot: the file slot.
        key: the content key it held (or was being written with).
        generation: the generation of that content.
        reason: ``"write failed"``, ``"verification failed"`` or ``"discarded"``.
    """

    slot: int
    key: bytes | str | int
    generation: int
    reason: str


SlotListener = Callable[[SlotEvent], None]
#: An index change to apply; returns the slots it gave up (possibly none).
Change = Callable[[], "list[SlotEvent]"]


class SlotEvents:
    """The ordered channel from the file tier's I/O threads to the event loop and its listeners."""

    def __init__(self) -> None:
        self._pending: collections.deque[Change] = collections.deque()
        self._listeners: list[SlotListener] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._lock = threading.Lock()  # serializes applying: the loop's drain, or a thread's direct apply

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        """Apply changes on ``loop`` from now on (the engine binds its loop here)."""
        self._loop = loop

    def subscribe(self, listener: SlotListener) -> None:
        """Call ``listener(event)`` for every slot given up from now on (on the loop when one is bound)."""
        self._listeners.append(listener)

    def unsubscribe(self, listener: SlotListener) -> None:
        """Stop calling ``listener`` (no-op if it is not subscribed)."""
        if listener in self._listeners:
            self._listeners.remove(listener)

    def post(self, change: Change) -> None:
        """Queue ``change`` for the loop (any thread); applied at once when no loop is bound or it is closed."""
        loop = self._loop
        with self._lock:
            self._pending.append(change)
        if loop is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(self.deliver)
                return
            except RuntimeError:  # closed between the check and the call
                pass
        self.deliver()

    def deliver(self) -> None:
        """Apply every queued change in order and announce what each gave up (idempotent; called by the loop)."""
        while True:
            with self._lock:
                if not self._pending:
                    return
                change = self._pending.popleft()
                events = change()
            for event in events:
                self.emit(event)

    def emit(self, event: SlotEvent) -> None:
        """Announce ``event`` to every listener now (an exception in one is logged; the others still run)."""
        for listener in list(self._listeners):
            try:
                listener(event)
            except Exception:  # a listener's bug must not stop the tier's bookkeeping
                log.exception("a file slot listener failed on %s", event)

    def __len__(self) -> int:
        return len(self._pending)
