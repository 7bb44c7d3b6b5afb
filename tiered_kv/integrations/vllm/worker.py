"""The worker side of the vLLM integration: :class:`TieredKVOffloadingWorker`.

Primitives:

* :class:`TieredKVOffloadingWorker` -- vLLM's canonical ``(num_blocks, page_bytes)`` int8 views become one
  :func:`tiered_kv.pool_kinds.pages` GPU pool of a :class:`~tiered_kv.TransferEngine` whose host pool is the
  rank's shared host region; each job (all layers of its blocks) is one batched engine copy. Every load is
  verified on the device before it is reported done (:mod:`.verify`).
* :data:`WORKERS` -- the workers alive in this process.

Rules:

* A store checksums its GPU blocks on the current (compute) stream when it is submitted, after the compute that
  wrote them; the checksum each host block must hold is kept on the device, indexed by host block.
* A load's destination blocks are checksummed once its copy has landed (one checksum call per job, on a stream of
  the worker's own, in submission order) and compared with the source host blocks' checksums; the job is reported
  done only when that result is in (an event the next :meth:`~TieredKVOffloadingWorker.get_finished` polls), so
  vLLM's compute never reads a load that was not checked.
* A mismatch: one error line per block. With ``TieredKVConnector`` (``report_load_errors``) the job is reported
  done and its bad GPU blocks become load errors (:meth:`~TieredKVOffloadingWorker.take_load_errors`): vLLM
  recomputes them. Behind the plain ``OffloadingConnector``, which asserts that every load succeeds, a mismatch
  cannot be reported: it is logged and counted, and the bytes are served.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
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
from .verify import LoadCheck, LoadVerification, PageChecksums

__all__ = ["WORKERS", "TieredKVOffloadingWorker"]

#: Workers alive in this process, newest last (tests read their :meth:`~TieredKVOffloadingWorker.statistics`).
WORKERS: list[TieredKVOffloadingWorker] = []

_log = logging.getLogger(__name__)


@dataclasses.dataclass(slots=True)
class _Job:
    future: concurrent.futures.Future[tuple[Any, LoadCheck | None]]
    started: float
    load: bool
    host: np.ndarray
    gpu: np.ndarray


class TieredKVOffloadingWorker(base.OffloadingWorker):
    """The worker side: GPU <-> shared host region copies of whole jobs, one engine copy per job; loads verified.

    Args:
        fields / settings: as the manager's.
        kv_caches: vLLM's ``CanonicalKVCaches``.

    Attributes:
        report_load_errors: set by ``TieredKVConnector``: a failed load is reported done, its blocks as load
            errors (vLLM recomputes them). ``False`` (the plain ``OffloadingConnector``): a mismatch is logged,
            counted and served; a failed copy is reported as a failed job.

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
        self.checksums = PageChecksums(tensors, settings.host_blocks)
        self.report_load_errors = False
        self.rank = fields.rank
        self._loop = LoopThread("tiered_kv-vllm-worker")
        self._jobs: dict[int, _Job] = {}
        self._cuda = device == "cuda"
        self._verify_stream = torch.cuda.Stream(tensors[0].device) if self._cuda else None
        self._turn: asyncio.Future[None] | None = None  # the last load's check launch (loop thread only)
        self._load_errors: set[int] = set()
        self._counts = {"verified_blocks": 0, "mismatches": 0, "adopted_blocks": 0, "failed_loads": 0,
                        "reported_blocks": 0}
        WORKERS.append(self)

    def submit_store(self, job_id: int, src_spec: Any, dst_spec: Any) -> bool:
        gpu, host = self._pairs(job_id, src_spec.block_ids, dst_spec.block_ids)
        # on the current (compute) stream, after the compute that wrote the blocks
        self.checksums.record(host, gpu, getattr(dst_spec, "generations", None))
        return self._submit(job_id, Tier.GPU, gpu, Tier.HOST, host, load=False)

    def submit_load(self, job_id: int, src_spec: Any, dst_spec: Any, expedited: bool = False, **_: Any) -> bool:
        host, gpu = self._pairs(job_id, src_spec.block_ids, dst_spec.block_ids)
        compare = self.checksums.plan(host, getattr(src_spec, "generations", None))
        return self._submit(job_id, Tier.HOST, host, Tier.GPU, gpu, load=True, compare=compare)

    @staticmethod
    def _pairs(job_id: int, s: np.ndarray, d: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        s64, d64 = np.asarray(s, dtype=np.int64), np.asarray(d, dtype=np.int64)
        if s64.size != d64.size:
            raise ValueError(f"job {job_id}: {s64.size} source blocks and {d64.size} destination blocks")
        return s64, d64

    def _submit(
        self, job_id: int, src: Tier, s: np.ndarray, dst: Tier, d: np.ndarray, *, load: bool,
        compare: np.ndarray | None = None,
    ) -> bool:
        stream = torch.cuda.current_stream() if self._cuda else None
        ready = None
        if load and stream is not None:  # the check reads the checksums stores enqueued on this stream so far
            ready = torch.cuda.Event()
            ready.record(stream)

        async def go() -> tuple[Any, LoadCheck | None]:
            turn = mine = None
            if load:  # checks launch in submission order (an adopted checksum is written before it is compared)
                turn, mine = self._turn, asyncio.get_running_loop().create_future()
                self._turn = mine
            try:
                if stream is not None:
                    self.engine.sync_with_compute(stream)  # the copy reads / overwrites what the forward wrote
                result = await self.engine.copy(src, s, dst, d)
                if stream is not None and dst is Tier.GPU:
                    self.engine.sync_transfers(stream)
                if not load:
                    return result, None
                if turn is not None:
                    await turn
                assert compare is not None
                return result, self._check(d, s, compare, ready)
            finally:
                if mine is not None:
                    if turn is None or turn.done():
                        mine.set_result(None)
                    else:
                        turn.add_done_callback(lambda _f: mine.set_result(None))

        self._jobs[job_id] = _Job(self._loop.submit(go()), time.perf_counter(), load, s if load else d,
                                  d if load else s)
        return True

    def _check(self, gpu: np.ndarray, host: np.ndarray, compare: np.ndarray, ready: Any) -> LoadCheck:
        """Launch one load's check (its copy has landed): on the worker's stream on CUDA, at once on the CPU."""
        compared = int(compare.sum())
        if self._verify_stream is None:
            return self.checksums.finish(self.checksums.check(gpu, host, compare), compared)
        with torch.cuda.stream(self._verify_stream):
            self._verify_stream.wait_event(ready)
            return self.checksums.finish(self.checksums.check(gpu, host, compare), compared)

    def get_finished(self) -> list[Any]:
        out = []
        for job_id, job in list(self._jobs.items()):
            fut = job.future
            if not fut.done():
                continue
            error = fut.exception()
            check = None if error is not None else fut.result()[1]
            if check is not None and not check.done():
                continue  # the check is still running: compute must not read these blocks yet
            del self._jobs[job_id]
            ok = error is None
            size = fut.result()[0].nbytes if ok else 0
            if job.load:
                ok = self._load_outcome(job_id, job, error, check)
            out.append(
                base.TransferResult(
                    job_id=job_id, success=ok, transfer_size=size, transfer_time=time.perf_counter() - job.started
                )
            )
        return out

    def _load_outcome(self, job_id: int, job: _Job, error: BaseException | None, check: LoadCheck | None) -> bool:
        """Count, log and report one finished load; whether vLLM is told it succeeded."""
        c = self._counts
        if error is not None:
            c["failed_loads"] += 1
            if not self.report_load_errors:
                return False  # the plain OffloadingConnector asserts on it, as before
            _log.error("tiered_kv: vLLM load job %d failed (%s): its %d blocks are reported as load errors; vLLM "
                       "recomputes them", job_id, error, job.gpu.size)
            self._report(job.gpu.tolist())
            return True
        assert check is not None
        c["verified_blocks"] += check.compared
        c["adopted_blocks"] += check.adopted
        bad = check.mismatched()
        if not bad:
            return True
        c["mismatches"] += len(bad)
        for i in bad:
            if self.report_load_errors:
                _log.error("tiered_kv: rank %d host block %d loaded into GPU block %d does not match the checksum "
                           "taken when it was stored: not served, vLLM recomputes it (load job %d)",
                           self.rank, int(job.host[i]), int(job.gpu[i]), job_id)
            else:
                _log.error("tiered_kv: rank %d host block %d loaded into GPU block %d does not match the checksum "
                           "taken when it was stored, and is SERVED: vLLM's OffloadingConnector cannot report a "
                           "failed load (configure kv_connector='TieredKVConnector') (load job %d)",
                           self.rank, int(job.host[i]), int(job.gpu[i]), job_id)
        if self.report_load_errors:
            self._report([int(job.gpu[i]) for i in bad])
        return True

    def _report(self, gpu_blocks: list[int]) -> None:
        self._load_errors.update(gpu_blocks)
        self._counts["reported_blocks"] += len(gpu_blocks)

    def take_load_errors(self) -> set[int]:
        """GPU blocks of loads that failed since the last call (``TieredKVConnector`` reports them to vLLM)."""
        errors, self._load_errors = self._load_errors, set()
        return errors

    def statistics(self) -> LoadVerification:
        """Load verification counters since start-up (see :class:`~.verify.LoadVerification`)."""
        return LoadVerification(**self._counts)

    def wait(self, job_ids: set[int]) -> None:
        jobs = [self._jobs[j] for j in job_ids if j in self._jobs]
        concurrent.futures.wait([j.future for j in jobs])
        for j in jobs:
            if j.future.exception() is None:
                check = j.future.result()[1]
                if check is not None:
                    check.wait()

    def shutdown(self) -> None:
        if self in WORKERS:
            WORKERS.remove(self)
        concurrent.futures.wait([j.future for j in self._jobs.values()], timeout=30)
        self._loop.run(self.engine.close())
        self._loop.close()
