"""The spec vLLM loads: :class:`TieredKVOffloadingSpec` (re-exported by :mod:`tiered_kv.integrations.vllm`).

Primitives:

* :class:`TieredKVOffloadingSpec` -- ``get_manager()`` (scheduler process) and ``get_worker(kv_caches)`` (each
  worker), over vLLM's ``OffloadingSpec``.
"""

from __future__ import annotations

from typing import Any

from ._compat import base, config_fields
from .manager import TieredKVOffloadingManager
from .shared import Settings
from .worker import TieredKVOffloadingWorker

__all__ = ["TieredKVOffloadingSpec"]


class TieredKVOffloadingSpec(base.OffloadingSpec):
    """The spec vLLM instantiates in the scheduler and in each worker (see :mod:`tiered_kv.integrations.vllm`).

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
