"""tiered_kv: awaitable, fenced transfers of LLM KV-cache blocks between GPU, pinned host DRAM and NVMe files."""

import os as _os

# `backends/` sits beside this package in the repository and is installed as tiered_kv.backends. When the
# package is imported straight from a checkout (PYTHONPATH=., or `python -m tiered_kv` in the repo root)
# nothing maps it, so let the package path reach the repository root for that one subpackage.
_root = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
if not _os.path.isdir(_os.path.join(__path__[0], "backends")) and _os.path.isfile(_os.path.join(_root, "backends", "__init__.py")):
    __path__.append(_root)

from .blocks import Admission, BlockManager, CacheFullError, Request
from .cache import CacheStatistics, TieredKVCache
from .config import EngineConfig
from .device import Device, resolve_device
from .engine import EngineStatistics, Transfer, TransferEngine, TransferResult
from .errors import BackendUnavailable, EngineClosedError, IntegrityError, LayoutMismatchError, OwnedEngineError, SlabInUseError, TieredKVError, TransferError
from .fences import FenceStatistics, FenceTable
from .filetier import Durability, FileTier, FileTierConfig, FileTierStatistics, OpenReport
from .keys import KeyHasher
from .layer_major import LayerMajorPool
from .layout import FORMAT_VERSION, KVLayout
from .pools import BlockPool, Tier
from .staging import NO_BLOCK, BlockOffsetTable, StagingPool, copy_batch_block_offsets

__all__ = [
    "FORMAT_VERSION",
    "NO_BLOCK",
    "Admission",
    "BackendUnavailable",
    "BlockManager",
    "BlockOffsetTable",
    "BlockPool",
    "CacheFullError",
    "CacheStatistics",
    "Device",
    "Durability",
    "EngineClosedError",
    "EngineConfig",
    "EngineStatistics",
    "FenceStatistics",
    "FenceTable",
    "FileTier",
    "FileTierConfig",
    "FileTierStatistics",
    "IntegrityError",
    "KVLayout",
    "KeyHasher",
    "LayerMajorPool",
    "LayoutMismatchError",
    "OpenReport",
    "OwnedEngineError",
    "Request",
    "SlabInUseError",
    "StagingPool",
    "Tier",
    "TieredKVCache",
    "TieredKVError",
    "Transfer",
    "TransferEngine",
    "TransferError",
    "TransferResult",
    "copy_batch_block_offsets",
    "resolve_device",
]

__version__ = "0.1.0"
