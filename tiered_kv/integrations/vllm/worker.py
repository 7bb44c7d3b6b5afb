"""The worker side of the vLLM integration: :class:`TieredKVOffloadingWorker`.

Primitives:

* :class:`TieredKVOffloadingWorker` -- vLLM's canonical ``(num_blocks, page_bytes)`` int8 views become one
  :func:`tiered_kv.pool_kinds.pages` GPU pool of a :class:`~tiered_kv.TransferEngine` whose host pool is the
  rank's shared host region; each job (all layers of its blocks) is one batched engine copy.
"""

from __future__ import annotations

import concurrent.futures
import time
from typing import Any

import numpy as np
import torch

from ... import pool_kinds
from ...engine import TransferEngine
from ...pools import Tier
from ..loop import LoopThread
from ._compat import ConfigFields, base
from .shared import Settings, block_layout, host_path, map_host

__all__ = ["TieredKVOffloadingWorker"]


class TieredKVOffloadingWorker(base.OffloadingWorker):
    """The worker side: GPU <-> shared host region copies of whole jobs, one engine copy per job.

    Args:
        fields / settings: as the manager's.
        kv_caches: vLLM's ``CanonicalKVCaches``.

    Raises:
        ValueError: the canonical pages do not add up to vLLM's ``worker_kv_bytes_per_block``.
    """

    def __init__(self, fields: ConfigFields, settings: Settings, kv_caches: Any) -> None:
        tensors = [t.tensor for t in kv_caches.tensors]
        self.layout = block_layout(fields.bytes_per_block)
        self.pool = pool_kinds.pages(tensors, layout=self.layout)
        host = map_host(host_path(settings, fields, fields.rank), settings.host_blocks, self.layout)
        device = "cuda" if tensors[0].is_cuda else "cpu"
        if device == "cuda":
            torch.cuda.cudart().cudaHostRegister(host.data_ptr(), host.numel(), 0)  # type: ignore[no-untyped-call]
        self.engine = TransferEngine(self.layout, gpu_pool=self.pool, host_pool=host, device=device)
        self._loop = LoopThread("tiered_kv-vllm-worker")
        self._jobs: dict[int, tuple[concurrent.futures.Future[Any], float]] = {}
        self._cuda = device == "cuda"

    def submit_store(self, job_id: int, src_spec: Any, dst_spec: Any) -> bool:
        return self._submit(job_id, Tier.GPU, src_spec.block_ids, Tier.HOST, dst_spec.block_ids)

    def submit_load(self, job_id: int, src_spec: Any, dst_spec: Any, expedited: bool = False, **_: Any) -> bool:
        return self._submit(job_id, Tier.HOST, src_spec.block_ids, Tier.GPU, dst_spec.block_ids)

    def _submit(self, job_id: int, src: Tier, s: np.ndarray, dst: Tier, d: np.ndarray) -> bool:
        s64, d64 = np.asarray(s, dtype=np.int64), np.asarray(d, dtype=np.int64)
        if s64.size != d64.size:
            raise ValueError(f"job {job_id}: {s64.size} source blocks and {d64.size} destination blocks")
        stream = torch.cuda.current_stream() if self._cuda else None

        async def go() -> Any:
            if stream is not None:
                self.engine.sync_with_compute(stream)  # the copy reads / overwrites what the forward wrote
            result = await self.engine.copy(src, s64, dst, d64)
            if stream is not None and dst is Tier.GPU:
                self.engine.sync_transfers(stream)
            return result

        self._jobs[job_id] = (self._loop.submit(go()), time.perf_counter())
        return True

    def get_finished(self) -> list[Any]:
        out = []
        for job_id, (fut, started) in list(self._jobs.items()):
            if not fut.done():
                continue
            del self._jobs[job_id]
            ok = fut.exception() is None
            size = fut.result().nbytes if ok else 0
            out.append(
                base.TransferResult(
                    job_id=job_id, success=ok, transfer_size=size, transfer_time=time.perf_counter() - started
                )
            )
        return out

    def wait(self, job_ids: set[int]) -> None:
        futs = [self._jobs[j][0] for j in job_ids if j in self._jobs]
        concurrent.futures.wait(futs)

    def shutdown(self) -> None:
        concurrent.futures.wait([f for f, _ in self._jobs.values()], timeout=30)
        self._loop.run(self.engine.close())
        self._loop.close()
