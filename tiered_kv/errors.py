"""Runtime errors of tiered_kv.

Bad arguments raise ``ValueError``/``TypeError`` before anything is enqueued; the classes here are for
failures that happen while work runs (or for using an engine that is closed).
"""

from __future__ import annotations

__all__ = [
    "BackendUnavailable",
    "EngineClosedError",
    "IntegrityError",
    "LayoutMismatchError",
    "OwnedEngineError",
    "RemoteStoreError",
    "SlabInUseError",
    "StorageError",
    "TieredKVError",
    "TransferError",
]


class TieredKVError(Exception):
    """Base class of every runtime error raised by tiered_kv."""


class TransferError(TieredKVError):
    """A transfer failed while it ran; its destination blocks hold undefined data."""


class IntegrityError(TransferError):
    """Data read back failed verification (header, checksum or layout fingerprint); it was not served."""


class LayoutMismatchError(TieredKVError, ValueError):
    """A persisted file tier was written for another block layout (or is not a tiered_kv slab)."""


class SlabInUseError(TieredKVError):
    """A file tier's slab is already open (in this process or another): one tier per slab at a time."""


class BackendUnavailable(TieredKVError):
    """A requested backend (CUDA, kvikio/cuFile, the compiled extension) cannot be used here."""


class EngineClosedError(TieredKVError, RuntimeError):
    """The engine was used after ``close()`` (or before it was opened)."""


class OwnedEngineError(TieredKVError, ValueError):
    """A copy through an engine whose blocks belong to a cache: only the cache may change them (nothing was enqueued)."""


class StorageError(TieredKVError, OSError):
    """The file tier's directory or slab cannot be used: the message names the path, the size asked and what to do.

    Raised before anything is left behind (no lock file, no half-created slab). An ``OSError`` too (``errno``).
    """


class RemoteStoreError(TransferError):
    """A remote store (Redis, Mooncake) failed, timed out or cannot be reached; no data was served from it."""
