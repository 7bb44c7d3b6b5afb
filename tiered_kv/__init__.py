"""tiered_kv: awaitable, fenced transfers of LLM KV-cache blocks between GPU, pinned host DRAM and NVMe files."""

from .config import EngineConfig
from .device import Device, resolve_device
from .engine import EngineStatistics, Transfer, TransferEngine, TransferResult
from .errors import BackendUnavailable, EngineClosedError, IntegrityError, TieredKVError, TransferError
from .fences import FenceStatistics, FenceTable
from .layer_major import LayerMajorPool
from .layout import FORMAT_VERSION, KVLayout
from .pools import BlockPool, Tier

__all__ = [
    "FORMAT_VERSION",
    "BackendUnavailable",
    "BlockPool",
    "Device",
    "EngineClosedError",
    "EngineConfig",
    "EngineStatistics",
    "FenceStatistics",
    "FenceTable",
    "IntegrityError",
    "KVLayout",
    "LayerMajorPool",
    "Tier",
    "TieredKVError",
    "Transfer",
    "TransferEngine",
    "TransferError",
    "TransferResult",
    "resolve_device",
]

__version__ = "0.1.0"
