"""The file tier: NVMe slab files of self-verifying slots behind one transfer handler.

Modules, bottom up (each imports only those above it, and nothing outside imports below the package):

* :mod:`~tiered_kv.file.config` -- :class:`Durability`, :class:`FileTierConfig`, :class:`SlabGeometry`.
* :mod:`~tiered_kv.file.index` -- :class:`SlotIndex` and :class:`SlotState`: the one place where a slot
  becomes valid or is dropped (what the block manager's warm restart looks keys up in).
* :mod:`~tiered_kv.file.recovery` -- the writer lock, creating or reopening the slab, the scan that rebuilds
  the index; :class:`OpenReport`.
* :mod:`~tiered_kv.file.deadline` -- :class:`FileTimeout` and the deadline on every backend call, bounce buffers.
* :mod:`~tiered_kv.file.ring` -- :class:`StagingRing`, pinned staging blocks of the GPU<->file legs.
* :mod:`~tiered_kv.file.pipeline` -- :class:`FileCopy`: one batch of writes or verified reads, through the
  narrow :class:`SlabIO` interface.
* :mod:`~tiered_kv.file.tier` -- :class:`FileTier`: opens the slab, owns backend, threads and ring; the
  index questions users ask.
* :mod:`~tiered_kv.file.handler` -- :class:`FileHandler`: the tier as the engine's transfer handler.
"""

from .config import Durability, FileTierConfig, SlabGeometry
from .deadline import FileTimeout
from .handler import FILE_ROUTES, FileHandler
from .index import SlotIndex, SlotState
from .pipeline import FileCopy, SlabIO
from .recovery import OpenReport
from .ring import StagingRing
from .tier import FileTier, FileTierStatistics

__all__ = [
    "FILE_ROUTES",
    "Durability",
    "FileCopy",
    "FileHandler",
    "FileTier",
    "FileTierConfig",
    "FileTierStatistics",
    "FileTimeout",
    "OpenReport",
    "SlabGeometry",
    "SlabIO",
    "SlotIndex",
    "SlotState",
    "StagingRing",
]
