"""tiered_kv as a vLLM ``OffloadingSpec`` (behind vLLM's in-tree ``OffloadingConnector``).

Primitives (each in its own module, re-exported from here):

* :class:`TieredKVOffloadingSpec` -- ``get_manager()`` (scheduler process) and ``get_worker(kv_caches)`` (each
  worker). Loaded with ``kv_connector="OffloadingConnector"`` and ``kv_connector_extra_config={"spec_name":
  "TieredKVOffloadingSpec", "spec_module_path": "tiered_kv.integrations.vllm", "host_blocks": N, "file_dir":
  DIR, "file_blocks": M}``, or ``"spec_name": "TieredKV"`` once the ``vllm.general_plugins`` entry point ran.
* :class:`TieredKVConnector` -- vLLM's ``OffloadingConnector`` whose loads that fail verification on the device
  are reported through vLLM's load-error API (``get_block_ids_with_load_errors``) and recomputed:
  ``kv_connector="TieredKVConnector"`` (or ``"kv_connector_module_path": "tiered_kv.integrations.vllm"``) with
  ``"kv_load_failure_policy": "recompute"`` and the spec's extra config as above.
* :class:`TieredKVOffloadingManager` -- the scheduler side: a host tier of ``host_blocks`` slots in a shared
  memory region per worker rank (LRU), written through to a verified file tier per rank; ``lookup`` answers
  ``HIT`` only for blocks verified in host memory: a block found only in the file tier is staged into host
  memory and verified first (``HIT_PENDING`` while it stages, ``MISS`` if verification fails), because vLLM's
  connector worker asserts that every load succeeds (a failed load would end the engine).
* :class:`TieredKVOffloadingWorker` -- the worker side: vLLM's canonical ``(num_blocks, page_bytes)`` int8
  views become one :func:`tiered_kv.pool_kinds.pages` GPU pool of a :class:`~tiered_kv.TransferEngine`
  whose host pool is the shared region; each job (all layers of its blocks) is one batched engine copy. A store
  checksums its blocks on the device; a load is checked on the device against them before it is reported done
  (:class:`LoadVerification`, :meth:`TieredKVOffloadingWorker.statistics`).
* :class:`TieredKVFileTier` -- a ``SecondaryTierManager``: the verified file tier behind vLLM's own CPU tier.
* :data:`MANAGERS` / :data:`WORKERS` -- the managers / workers alive in this process (their ``statistics()``).

Modules: :mod:`.spec` (the spec), :mod:`.connector` (the connector), :mod:`.manager` (scheduler side,
:class:`VLLMStatistics`), :mod:`.host` (the manager's host slot table), :mod:`.worker` (worker side),
:mod:`.verify` (the device checksums of loads), :mod:`.file` (the secondary tier), :mod:`.shared`
(settings, shared host region, content keys), :mod:`.plugin` (the ``vllm.general_plugins`` entry point),
:mod:`.versions` (the vLLM versions claimed) and :mod:`._compat` (vLLM's API differences).

Importing this package imports no vLLM (nor do :mod:`.host`, :mod:`.verify`, :mod:`.versions` and :mod:`.plugin`):
each name above is imported on first use, which imports vLLM and checks its version (``ImportError`` for a version
refused).

Content keys are vLLM's offload keys (block hash + group) salted with the model, KV dtype, KV cache layout,
bytes per block and the parallel layout including the rank: a TP rank never reads another rank's shard.

Not supported (``ValueError`` at start-up): more than one KV cache group (hybrid / HMA models) and
``blocks_per_chunk != 1`` (offloaded blocks larger than vLLM's blocks).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .connector import TieredKVConnector
    from .file import TieredKVFileTier
    from .manager import MANAGERS, TieredKVOffloadingManager, VLLMStatistics
    from .shared import TieredKVLoadStoreSpec, content_key
    from .spec import TieredKVOffloadingSpec
    from .verify import LoadVerification
    from .worker import WORKERS, TieredKVOffloadingWorker

__all__ = [
    "MANAGERS",
    "WORKERS",
    "LoadVerification",
    "TieredKVConnector",
    "TieredKVFileTier",
    "TieredKVLoadStoreSpec",
    "TieredKVOffloadingManager",
    "TieredKVOffloadingSpec",
    "TieredKVOffloadingWorker",
    "VLLMStatistics",
    "content_key",
]

#: Where each public name lives (its module imports vLLM, so it is imported on first use).
_WHERE = {
    "MANAGERS": "manager",
    "WORKERS": "worker",
    "LoadVerification": "verify",
    "TieredKVConnector": "connector",
    "TieredKVFileTier": "file",
    "TieredKVLoadStoreSpec": "shared",
    "TieredKVOffloadingManager": "manager",
    "TieredKVOffloadingSpec": "spec",
    "TieredKVOffloadingWorker": "worker",
    "VLLMStatistics": "manager",
    "content_key": "shared",
}


def __getattr__(name: str) -> Any:
    where = _WHERE.get(name)
    if where is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{where}"), name)
    globals()[name] = value  # the next lookup finds it directly
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
