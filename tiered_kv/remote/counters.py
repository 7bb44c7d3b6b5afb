"""What a :class:`~tiered_kv.remote.RemoteTier` counts, and the snapshot it hands out.

Primitives:

* :class:`RemoteStatistics` -- a snapshot: round trips, blocks by outcome, bytes, errors, latency histogram.
* :class:`RemoteCounters` -- the live counters behind it (event-loop thread only).
"""

from __future__ import annotations

import bisect
import dataclasses

from ..transfer import LATENCY_BUCKETS
from .stores import StoreTimeout

__all__ = ["RemoteCounters", "RemoteStatistics"]


@dataclasses.dataclass(frozen=True, slots=True)
class RemoteStatistics:
    """A snapshot of a :class:`~tiered_kv.remote.RemoteTier`.

    Attributes:
        url: the store (no password). kind: ``"redis"`` or ``"mooncake"``.
        available: connected and not backing off after a failure.
        batches: ``"get"``/``"put"`` -> store round trips.
        blocks: ``"get"`` (verified objects copied), ``"miss"`` (absent), ``"bad"`` (failed verification),
            ``"put"`` (stored or already present), ``"put_dropped"`` (not stored: store away, error, full),
            ``"replaced_corrupt"`` (puts, counted in ``"put"`` too, that replaced an object this tier had found
            corrupted).
        bytes: ``"get"``/``"put"`` -> object bytes moved.
        errors: store errors and timeouts; ``timeouts`` of them timeouts.
        seconds: ``"get"``/``"put"`` -> summed batch latency; ``latency_counts`` per :data:`LATENCY_BUCKETS`.
        bad_reasons: verification failure reason -> count.
    """

    url: str
    kind: str
    available: bool
    batches: dict[str, int]
    blocks: dict[str, int]
    bytes: dict[str, int]
    errors: int
    timeouts: int
    seconds: dict[str, float]
    latency_counts: dict[str, tuple[int, ...]]
    bad_reasons: dict[str, int]


class RemoteCounters:
    """The counters of one tier; ``blocks``, ``bytes`` and ``bad`` are counted into directly."""

    __slots__ = ("bad", "batches", "blocks", "bytes", "errors", "latency", "seconds", "timeouts")

    def __init__(self) -> None:
        self.batches = {"get": 0, "put": 0}
        self.blocks = {"get": 0, "miss": 0, "bad": 0, "put": 0, "put_dropped": 0, "replaced_corrupt": 0}
        self.bytes = {"get": 0, "put": 0}
        self.seconds = {"get": 0.0, "put": 0.0}
        self.latency = {"get": [0] * (len(LATENCY_BUCKETS) + 1), "put": [0] * (len(LATENCY_BUCKETS) + 1)}
        self.bad: dict[str, int] = {}
        self.errors = self.timeouts = 0

    def round_trip(self, what: str, seconds: float) -> None:
        """One ``"get"`` or ``"put"`` round trip that took ``seconds``."""
        self.batches[what] += 1
        self.seconds[what] += seconds
        self.latency[what][bisect.bisect_left(LATENCY_BUCKETS, seconds)] += 1

    def error(self, exc: BaseException) -> None:
        """One store error (a :class:`~tiered_kv.remote.StoreTimeout` counts as a timeout too)."""
        self.errors += 1
        if isinstance(exc, StoreTimeout):
            self.timeouts += 1

    def snapshot(self, url: str, kind: str, available: bool) -> RemoteStatistics:
        """The counters now, as a :class:`RemoteStatistics`."""
        return RemoteStatistics(
            url=url,
            kind=kind,
            available=available,
            batches=dict(self.batches),
            blocks=dict(self.blocks),
            bytes=dict(self.bytes),
            errors=self.errors,
            timeouts=self.timeouts,
            seconds=dict(self.seconds),
            latency_counts={k: tuple(v) for k, v in self.latency.items()},
            bad_reasons=dict(self.bad),
        )
