"""tiered_kv as a vLLM ``OffloadingSpec`` (behind vLLM's in-tree ``OffloadingConnector``).

Primitives (the spec here; its parts in their own modules, re-exported from here):

* :class:`TieredKVOffloadingSpec` -- ``get_manager()`` (scheduler process) and ``get_worker(kv_caches)`` (each
  worker). Loaded with ``kv_connector="OffloadingConnector"`` and ``kv_connector_extra_config={"spec_name":
  "TieredKVOffloadingSpec", "spec_module_path": "tiered_kv.integrations.vllm", "host_blocks": N, "file_dir":
  DIR, "file_blocks": M}``, or ``"spec_name": "TieredKV"`` once the ``vllm.general_plugins`` entry point ran.
* :class:`TieredKVOffloadingManager` -- the scheduler side: a host tier of ``host_blocks`` slots in a shared
  memory region per worker rank (LRU), written through to a verified file tier per rank; ``lookup`` answers
  ``HIT`` only for blocks verified in host memory: a block found only in the file tier is staged into host
  memory and verified first (``HIT_PENDING`` while it stages, ``MISS`` if verification fails), because vLLM's
  connector worker asserts that every load succeeds (a failed load would end the engine).
* :class:`TieredKVOffloadingWorker` -- the worker side: vLLM's canonical ``(num_blocks, page_bytes)`` int8
  views become one :func:`tiered_kv.pool_kinds.pages` GPU pool of a :class:`~tiered_kv.TransferEngine`
  whose host pool is the shared region; each job (all layers of its blocks) is one batched engine copy.
* :class:`TieredKVFileTier` -- a ``SecondaryTierManager``: the verified file tier behind vLLM's own CPU tier.
* :data:`MANAGERS` -- the managers alive in this process (their :meth:`~TieredKVOffloadingManager.statistics`).

Modules: :mod:`.vllm_manager` (scheduler side, :class:`VLLMStatistics`), :mod:`.vllm_worker` (worker side),
:mod:`.vllm_file` (the secondary tier), :mod:`.vllm_shared` (settings, shared host region, content keys).

Content keys are vLLM's offload keys (block hash + group) salted with the model, KV dtype, KV cache layout,
bytes per block and the parallel layout including the rank: a TP rank never reads another rank's shard.

Not supported (``ValueError`` at start-up): more than one KV cache group (hybrid / HMA models) and
``blocks_per_chunk != 1`` (offloaded blocks larger than vLLM's blocks).
"""

from __future__ import annotations

from typing import Any

from ._vllm_compat import base, config_fields
from .vllm_file import TieredKVFileTier
from .vllm_manager import MANAGERS, TieredKVOffloadingManager, VLLMStatistics
from .vllm_shared import Settings, TieredKVLoadStoreSpec, content_key
from .vllm_worker import TieredKVOffloadingWorker

__all__ = [
    "MANAGERS",
    "TieredKVFileTier",
    "TieredKVLoadStoreSpec",
    "TieredKVOffloadingManager",
    "TieredKVOffloadingSpec",
    "TieredKVOffloadingWorker",
    "VLLMStatistics",
    "content_key",
]


class TieredKVOffloadingSpec(base.OffloadingSpec):
    """The spec vLLM instantiates in the scheduler and in each worker (see the module docstring).

    Raises:
        ValueError: a bad extra-config value, more than one KV cache group, or ``blocks_per_chunk != 1``.
    """

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        self.fields = config_fields(config)
        self.settings = Settings.parse(self.extra_config)
        if len(self.fields.tokens_per_block) != 1:
            raise ValueError("TieredKVOffloadingSpec supports one KV cache group (no hybrid / HMA models)")
        if self.fields.blocks_per_chunk != 1:
            raise ValueError(
                "TieredKVOffloadingSpec needs blocks_per_chunk == 1 (offload block size = vLLM block size)"
            )
        self._manager: TieredKVOffloadingManager | None = None

    def get_manager(self) -> TieredKVOffloadingManager:
        if self._manager is None:
            self._manager = TieredKVOffloadingManager(self.fields, self.settings)
        return self._manager

    def get_worker(self, kv_caches: Any) -> TieredKVOffloadingWorker:
        return TieredKVOffloadingWorker(self.fields, self.settings, kv_caches)
