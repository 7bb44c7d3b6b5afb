"""What the engine soak (:mod:`.soak`) and the cache soak (:mod:`.cache_soak`) share: faults in, leftovers out.

Primitives:

* :func:`faulty_file_config` -- a file tier whose POSIX backends fail a seeded share of their I/O calls.
* :func:`threads_now` / :func:`leaked_threads` -- tiered_kv worker threads started since a point and still
  alive (after an optional grace period).
* :func:`left_in_flight` -- the engine's statistics if anything is still in flight, deferred or fenced.
"""

from __future__ import annotations

import asyncio
import threading
import time

from ..backends.posix import PosixBackend
from ..engine import TransferEngine
from ..faults import FaultyBackend, random_faults
from ..file import FileTierConfig
from ..transfer import EngineStatistics

__all__ = ["faulty_file_config", "leaked_threads", "left_in_flight", "threads_now"]


def faulty_file_config(
    directory: str, slots: int, seed: int, fault_rate: float, backends: list[FaultyBackend] | None = None
) -> FileTierConfig:
    """A :class:`~tiered_kv.file.FileTierConfig` of ``slots`` slots under ``directory`` with random faults.

    Args:
        directory: the file tier's directory.
        slots: its slots.
        seed: seeds which I/O calls fail.
        fault_rate: share of I/O calls that fail (EIO, ENOSPC, short reads and writes).
        backends: if given, every backend made is appended (to count its faults afterwards).
    """

    def factory(path: str) -> FaultyBackend:
        backend = random_faults(PosixBackend(path, direct=False), seed, fault_rate)
        if backends is not None:
            backends.append(backend)
        return backend

    return FileTierConfig(directory, slots, backend_factory=factory, io_threads=2)


def threads_now() -> set[int | None]:
    """The idents of the threads alive now (the baseline of :func:`leaked_threads`)."""
    return {t.ident for t in threading.enumerate()}


async def leaked_threads(before: set[int | None], grace: float = 0.0) -> list[str]:
    """Names of tiered_kv threads alive now that were not in ``before``, waiting up to ``grace`` seconds for them.

    Cancellation: cancels only the wait.
    """

    def leaked() -> list[str]:
        return [t.name for t in threading.enumerate() if t.ident not in before and t.name.startswith("tiered_kv")]

    names = leaked()
    deadline = time.monotonic() + grace
    while names and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
        names = leaked()
    return names


def left_in_flight(engine: TransferEngine) -> EngineStatistics | None:
    """``engine``'s statistics if a copy is in flight or deferred or a block is fenced; else ``None``."""
    stats = engine.statistics()
    return stats if stats.in_flight or stats.deferred or stats.fences.fenced_blocks else None
