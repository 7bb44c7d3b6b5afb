"""What a copy hands back: the awaitable :class:`Transfer`, its :class:`TransferResult`, and engine statistics.

Primitives:

* :class:`Transfer` -- awaitable; ``done()``; ``result()`` gives a :class:`TransferResult` (bytes, seconds).
* :class:`TransferResult` -- what a completed transfer did.
* :class:`EngineStatistics` -- a snapshot of a :class:`~tiered_kv.TransferEngine`; :data:`LATENCY_BUCKETS`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import time
from collections.abc import Callable, Generator
from typing import Any

from .errors import TransferError
from .fences import FenceStatistics, Marker
from .pools import Tier

__all__ = ["LATENCY_BUCKETS", "EngineStatistics", "Transfer", "TransferResult"]


@dataclasses.dataclass(frozen=True, slots=True)
class TransferResult:
    """What a completed transfer did.

    Attributes:
        src_tier: where the data came from.
        dst_tier: where it went.
        num_blocks: blocks copied.
        nbytes: bytes copied (for a partial copy, only the tokens copied).
        seconds: from ``copy()`` to the device finishing the copy.
    """

    src_tier: Tier
    dst_tier: Tier
    num_blocks: int
    nbytes: int
    seconds: float

    @property
    def gbps(self) -> float:
        """Throughput in GB/s (1e9 bytes)."""
        return self.nbytes / self.seconds / 1e9 if self.seconds > 0 else float("inf")


class Transfer:
    """An enqueued copy. Await it for a :class:`TransferResult`; it raises :class:`TransferError` if it failed.

    Notes:
        Cancellation: cancelling a task that awaits a transfer cancels only that wait. The copy still
        completes, and its fences are released by completion, not by the awaiting task, so later copies
        touching the same blocks still order after it.
    """

    __slots__ = ("_marker", "dst_tier", "nbytes", "num_blocks", "src_tier", "submitted_at")

    def __init__(self, marker: Marker, src_tier: Tier, dst_tier: Tier, num_blocks: int, nbytes: int) -> None:
        self._marker = marker
        self.src_tier = src_tier
        self.dst_tier = dst_tier
        self.num_blocks = num_blocks
        self.nbytes = nbytes
        self.submitted_at = time.perf_counter()

    def done(self) -> bool:
        """True once the copy has completed (or failed)."""
        return self._marker.completed

    @property
    def completed_at(self) -> float | None:
        """``time.perf_counter()`` when the device finished the copy (before the loop heard of it)."""
        return self._marker.done_at if self._marker.completed else None

    def add_done_callback(self, callback: Callable[[Transfer], None]) -> None:
        """Call ``callback(transfer)`` on the event loop once the copy has completed (at once if it has).

        Unlike awaiting, this needs no task: fire-and-forget copies can still be observed. A callback that
        raises is reported through the loop's exception handler; the other callbacks still run.
        """
        self._marker.add_done_callback(functools.partial(callback, self))

    def exception(self) -> BaseException | None:
        """The error the copy failed with, or ``None``.

        Raises:
            asyncio.InvalidStateError: not done yet.
        """
        if not self._marker.completed:
            raise asyncio.InvalidStateError("transfer is not done yet")
        return self._marker.error

    def result(self) -> TransferResult:
        """The result of a completed copy.

        Raises:
            asyncio.InvalidStateError: not done yet.
            TransferError: the copy failed; its destination blocks hold undefined data.
        """
        marker = self._marker
        if not marker.completed:
            raise asyncio.InvalidStateError("transfer is not done yet")
        error = marker.error
        if error is not None:
            if isinstance(error, TransferError):
                raise error
            raise TransferError(
                f"{self.src_tier.value}->{self.dst_tier.value} copy of {self.num_blocks} blocks failed: {error!r}"
            ) from error
        done_at = marker.done_at or self.submitted_at
        return TransferResult(self.src_tier, self.dst_tier, self.num_blocks, self.nbytes, done_at - self.submitted_at)

    def __await__(self) -> Generator[Any, None, TransferResult]:
        marker = self._marker
        if not marker.completed:
            lane = marker.lane
            if lane is not None and marker.event is not None:
                watch = getattr(lane, "watch", None)  # the engine's loop-side poll (tiered_kv streams), if on
                if watch is not None:
                    watch(marker, self)  # may complete it in place
            if not marker.completed:
                yield from marker.wait_steps()
        return self.result()

    def __repr__(self) -> str:
        state = "pending" if not self.done() else ("failed" if self._marker.error else "done")
        direction = f"{self.src_tier.value}->{self.dst_tier.value}"
        return f"<Transfer {direction} blocks={self.num_blocks} bytes={self.nbytes} [{state}]>"


#: Upper bounds (seconds) of the per-direction transfer latency histogram (Prometheus-style buckets).
LATENCY_BUCKETS: tuple[float, ...] = (1e-5, 3e-5, 1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.3, 1.0, 3.0, 10.0)


@dataclasses.dataclass(frozen=True, slots=True)
class EngineStatistics:
    """A snapshot of a :class:`TransferEngine`.

    Attributes:
        device: ``"cuda"`` or ``"emulated"``.
        submitted: transfers accepted by ``copy()``.
        completed: transfers finished (including failed ones).
        failed: transfers that failed.
        in_flight: submitted and not completed.
        deferred: in flight and not yet enqueued (waiting on the loop for an off-stream dependency).
        bytes_by_direction: ``"gpu->host"`` etc. -> bytes completed.
        blocks_by_direction: ``"gpu->host"`` etc. -> blocks completed.
        seconds_by_direction: direction -> summed durations (``copy()`` to device completion) of its copies.
        latency_counts: direction -> copies per latency bucket: ``<= LATENCY_BUCKETS[i]`` seconds, then overflow.
        fences: the fence table.
    """

    device: str
    submitted: int
    completed: int
    failed: int
    in_flight: int
    deferred: int
    bytes_by_direction: dict[str, int]
    blocks_by_direction: dict[str, int]
    seconds_by_direction: dict[str, float]
    latency_counts: dict[str, tuple[int, ...]]
    fences: FenceStatistics
