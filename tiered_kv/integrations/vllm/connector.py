"""``TieredKVConnector``: vLLM's ``OffloadingConnector`` that reports loads failing verification, for recompute.

Primitives:

* :class:`TieredKVConnector` -- loaded with ``kv_connector="TieredKVConnector"`` (the plugin registers the name) or
  ``"kv_connector_module_path": "tiered_kv.integrations.vllm"``, with ``"kv_load_failure_policy": "recompute"`` and
  the TieredKV spec in ``kv_connector_extra_config``.

Rules (vLLM 0.32's connector API, read in its source):

* Worker side: :class:`~.worker.TieredKVOffloadingWorker` verifies every load on the device. Here it runs with
  ``report_load_errors``: a load that fails (a checksum mismatch, or a copy that raised) is reported *finished*
  (``finished_recving``, so the request is not stuck, and no ``success=False`` reaches the in-tree worker, which
  asserts on it), and its bad GPU blocks are returned by :meth:`get_block_ids_with_load_errors` in the same pass.
  vLLM's ``KVOutputAggregator`` unions every tensor-parallel worker's blocks into ``KVConnectorOutput.
  invalid_block_ids``, and the one scheduler's ``_handle_invalid_blocks`` cuts each affected request back to its
  first invalid block and recomputes from there (``kv_load_failure_policy="recompute"``; vLLM's default ``"fail"``
  ends such a request with an error instead): one decision for every rank.
* Scheduler side: the GPU blocks of each load job are mapped to the host blocks they are loaded from; when vLLM
  reports invalid blocks the manager refuses those keys (:meth:`~.manager.TieredKVOffloadingManager.refuse`), so the
  bytes that failed are never offered again.
* With any other spec the connector behaves as ``OffloadingConnector`` (nothing is verified).
"""

from __future__ import annotations

import logging
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector

from .manager import TieredKVOffloadingManager
from .worker import TieredKVOffloadingWorker

__all__ = ["TieredKVConnector"]

_log = logging.getLogger(__name__)


class TieredKVConnector(OffloadingConnector):
    """vLLM's ``OffloadingConnector`` whose failed loads are reported to vLLM, which recomputes them.

    Args:
        vllm_config / role / kv_cache_config: as vLLM passes them to every v1 connector.
    """

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self._loading: dict[int, int] = {}  # GPU block -> the host block its last load job reads
        if self.connector_scheduler is not None:
            policy = getattr(vllm_config.kv_transfer_config, "kv_load_failure_policy", "recompute")
            if policy != "recompute":
                _log.warning(
                    "tiered_kv: kv_load_failure_policy=%r: a load that fails verification fails its request; set "
                    "kv_load_failure_policy='recompute' to recompute it instead", policy,
                )
            if not isinstance(self.connector_scheduler.manager, TieredKVOffloadingManager):
                _log.warning("tiered_kv: TieredKVConnector without the TieredKV spec: loads are not verified")

    # ---------------------------------------------------------------------------------- worker side

    def _worker(self) -> TieredKVOffloadingWorker | None:
        """The TieredKV worker (made when vLLM registers its KV caches), in load-error reporting mode."""
        cw = self.connector_worker
        w = None if cw is None else cw.worker
        if not isinstance(w, TieredKVOffloadingWorker):
            return None
        w.report_load_errors = True
        return w

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        super().register_kv_caches(kv_caches)
        self._worker()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        self._worker()
        finished: tuple[set[str], set[str]] = super().get_finished(finished_req_ids)
        return finished

    def get_block_ids_with_load_errors(self) -> set[int]:
        """GPU blocks of loads that failed verification (or whose copy failed) since the last call."""
        w = self._worker()
        return set() if w is None else w.take_load_errors()

    # ---------------------------------------------------------------------------------- scheduler side

    def build_connector_meta(self, scheduler_output: Any) -> Any:
        meta = super().build_connector_meta(scheduler_output)
        if not isinstance(self.scheduler.manager, TieredKVOffloadingManager):
            return meta
        for job in meta.load_jobs.values():  # one host block per GPU block (blocks_per_chunk == 1, one group)
            gpu = [int(b) for b in job.dst_spec.block_ids]
            host = [int(b) for b in job.src_spec.block_ids]
            self._loading.update(zip(gpu, host, strict=True))
        return meta

    def update_connector_output(self, connector_output: Any) -> None:
        invalid = connector_output.invalid_block_ids
        manager = self.scheduler.manager
        if invalid and isinstance(manager, TieredKVOffloadingManager):
            # before the jobs' completions unpin the entries (below): refuse only what a load still reads
            manager.refuse({self._loading[b] for b in invalid if b in self._loading})
        super().update_connector_output(connector_output)
