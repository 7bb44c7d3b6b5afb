"""A one-line progress report for the command-line tools (no dependency).

Primitives:

* :class:`Progress` -- ``desc: done/total unit`` on stderr, rewritten in place on a terminal and printed at most
  every ``interval`` seconds (and once at the end) otherwise; a context manager.
"""

from __future__ import annotations

import sys
import time
from types import TracebackType
from typing import TextIO

__all__ = ["Progress"]


class Progress:
    """Progress of ``desc`` in ``unit``: :meth:`update` adds to the count, :meth:`update_to` sets it.

    Args:
        desc: what is counted, printed first.
        unit: the unit of the count (``"op"``, ``"turn"``, ...).
        total: the count at the end, if known (may be set later through :meth:`update_to`).
        disable: print nothing.
        stream: where to print (default ``sys.stderr``).
        interval: the least time between two prints, in seconds (the last count is always printed).
    """

    def __init__(
        self,
        desc: str,
        unit: str,
        total: int | None = None,
        *,
        disable: bool = False,
        stream: TextIO | None = None,
        interval: float = 0.5,
    ):
        self.desc = desc
        self.unit = unit
        self.total = total
        self.n = 0
        self.disable = disable
        self.stream = stream if stream is not None else sys.stderr
        self.interval = interval
        self._t0 = time.monotonic()
        self._last = float("-inf")
        self._printed = False
        self._printed_n: int | None = None
        self._tty = bool(getattr(self.stream, "isatty", lambda: False)())

    def update(self, n: int = 1) -> None:
        """Add ``n`` to the count."""
        self.update_to(self.n + n)

    def update_to(self, n: int, total: int | None = None) -> None:
        """Set the count to ``n`` (and the total, if given)."""
        self.n = n
        if total is not None:
            self.total = total
        now = time.monotonic()
        if now - self._last >= self.interval:
            self._print(now)

    def close(self) -> None:
        """Print the last count (and end the line on a terminal)."""
        if self.disable:
            return
        if self._printed_n != self.n:
            self._print(time.monotonic())
        if self._tty and self._printed:
            self.stream.write("\n")
            self.stream.flush()
        self.disable = True

    def _print(self, now: float) -> None:
        self._last = now
        if self.disable:
            return
        count = f"{self.n}/{self.total}" if self.total is not None else f"{self.n}"
        line = f"{self.desc}: {count} {self.unit} ({now - self._t0:.1f} s)"
        self.stream.write(f"\r{line}" if self._tty else f"{line}\n")
        self.stream.flush()
        self._printed = True
        self._printed_n = self.n

    def __enter__(self) -> Progress:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
