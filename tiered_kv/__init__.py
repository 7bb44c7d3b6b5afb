"""tiered_kv: awaitable, fenced transfers of LLM KV-cache blocks between GPU, pinned host DRAM and NVMe files."""

import importlib
import os as _os
from typing import TYPE_CHECKING, Any

# `backends/` sits beside this package in the repository and is installed as tiered_kv.backends. When the
# package is imported straight from a checkout (PYTHONPATH=., or `python -m tiered_kv` in the repo root)
# nothing maps it, so let the package path reach the repository root for that one subpackage.
_root = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
if not _os.path.isdir(_os.path.join(__path__[0], "backends")) and _os.path.isfile(_os.path.join(_root, "backends", "__init__.py")):
    __path__.append(_root)

if TYPE_CHECKING:
    from .blocks import Admission, BlockManager, CacheFullError, Request
    from .cache import CacheStatistics, TieredKVCache
    from .config import EngineConfig
    from .device import Device, resolve_device
    from .engine import EngineStatistics, Transfer, TransferEngine, TransferResult
    from .errors import (
        BackendUnavailable,
        EngineClosedError,
        IntegrityError,
        LayoutMismatchError,
        OwnedEngineError,
        SlabInUseError,
        StorageError,
        TieredKVError,
        TransferError,
    )
    from .fences import FenceStatistics, FenceTable
    from .file import Durability, FileTier, FileTierConfig, FileTierStatistics, OpenReport
    from .keys import KeyHasher
    from .layer_major import LayerMajorPool
    from .layerwise import LayerwiseTransfer, copy_layerwise
    from .layout import FORMAT_VERSION, KVLayout
    from .pools import BlockPool, Tier
    from .staging import NO_BLOCK, BlockOffsetTable, StagingPool, copy_batch_block_offsets

# Names resolve on first use (PEP 562), so that `import tiered_kv` -- and `tiered-kv --help` -- does not load torch.
_EXPORTS: dict[str, str] = {
    "Admission": "blocks",
    "BackendUnavailable": "errors",
    "BlockManager": "blocks",
    "BlockOffsetTable": "staging",
    "BlockPool": "pools",
    "CacheFullError": "blocks",
    "CacheStatistics": "cache",
    "Device": "device",
    "Durability": "file",
    "EngineClosedError": "errors",
    "EngineConfig": "config",
    "EngineStatistics": "engine",
    "FORMAT_VERSION": "layout",
    "FenceStatistics": "fences",
    "FenceTable": "fences",
    "FileTier": "file",
    "FileTierConfig": "file",
    "FileTierStatistics": "file",
    "IntegrityError": "errors",
    "KVLayout": "layout",
    "KeyHasher": "keys",
    "LayerMajorPool": "layer_major",
    "LayerwiseTransfer": "layerwise",
    "LayoutMismatchError": "errors",
    "NO_BLOCK": "staging",
    "OpenReport": "file",
    "OwnedEngineError": "errors",
    "Request": "blocks",
    "SlabInUseError": "errors",
    "StorageError": "errors",
    "StagingPool": "staging",
    "Tier": "pools",
    "TieredKVCache": "cache",
    "TieredKVError": "errors",
    "Transfer": "engine",
    "TransferEngine": "engine",
    "TransferError": "errors",
    "TransferResult": "engine",
    "copy_batch_block_offsets": "staging",
    "copy_layerwise": "layerwise",
    "resolve_device": "device",
}

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
    "LayerwiseTransfer",
    "LayoutMismatchError",
    "OpenReport",
    "OwnedEngineError",
    "Request",
    "SlabInUseError",
    "StagingPool",
    "StorageError",
    "Tier",
    "TieredKVCache",
    "TieredKVError",
    "Transfer",
    "TransferEngine",
    "TransferError",
    "TransferResult",
    "copy_batch_block_offsets",
    "copy_layerwise",
    "resolve_device",
]

__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'tiered_kv' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
