"""The file tier's I/O interface: what a :class:`~tiered_kv.file.pipeline.FileCopy` may use of the tier.

* :class:`SlabIO` -- the slab's geometry and backend, the worker threads, the staging ring, padding buffers,
  durability, the slot index and the I/O counters; nothing else of the tier reaches the pipeline.
* :class:`IoCounters` -- blocks and bytes moved, failures (thread-safe).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import threading
from collections.abc import Callable

import numpy as np

from ..backends import FileBackend
from ..device import Device
from .config import Durability, SlabGeometry
from .deadline import BouncePool
from .index import SlotIndex
from .ring import StagingRing

__all__ = ["IoCounters", "SlabIO"]


class IoCounters:
    """Blocks and bytes moved and failures, per direction (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts = {"bw": 0, "br": 0, "nw": 0, "nr": 0, "wf": 0, "rf": 0, "if": 0}

    def add(self, **inc: int) -> None:
        """Add to counters: ``nw``/``nr`` blocks, ``bw``/``br`` bytes, ``wf``/``rf``/``if`` failures."""
        with self._lock:
            for k, v in inc.items():
                self._counts[k] += v

    def snapshot(self) -> dict[str, int]:
        """A copy of the counters."""
        with self._lock:
            return dict(self._counts)


@dataclasses.dataclass(frozen=True, slots=True)
class SlabIO:
    """What the pipeline may use of the tier (and nothing else).

    Attributes:
        geometry: slot size, payload size, fingerprint, offsets.
        backend: positional I/O on the slab.
        workers: checksum / launch threads.
        ring: the staging ring, made on first use.
        durability: when a write counts as complete.
        device: the engine's device (CUDA legs run under it).
        index: the slot index (writes finish through it, failed verification drops through it).
        counters: I/O statistics.
        zero_pad / trash_pad: padding written after a payload / read and discarded (``None``: no padding).
        reads_in_flight: host-pool reads a batch keeps started at once (a few per I/O thread, so a thread that
            finishes one always finds the next queued; not the whole batch, see ``FileCopy._pump``).
        bounce: the buffers host-pool reads land in when calls have a deadline (``None``: straight into the pool).
    """

    geometry: SlabGeometry
    backend: FileBackend
    workers: concurrent.futures.ThreadPoolExecutor
    ring: Callable[[], StagingRing]
    durability: Durability
    device: Device
    index: SlotIndex
    counters: IoCounters
    zero_pad: np.ndarray | None
    trash_pad: np.ndarray | None
    reads_in_flight: int = 16
    bounce: BouncePool | None = None
