"""tiered_kv's verified file tier as a vLLM secondary tier: :class:`TieredKVFileTier`.

Primitives:

* :class:`TieredKVFileTier` -- a ``SecondaryTierManager`` behind vLLM's own CPU tier
  (``TieringOffloadingSpec``): whole primary-tier chunks move between vLLM's CPU region and the file tier, one
  verified slot per chunk. Importing this module needs a vLLM with secondary tiers.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
from collections.abc import Collection, Iterable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ...engine import TransferEngine
from ...file import FileTierConfig
from ...pools import Tier
from ..loop import LoopThread
from ._compat import base, config_fields, make_event
from .shared import LookupResult, block_layout, content_key, rank_salt, tiering_base

__all__ = ["TieredKVFileTier"]


class TieredKVFileTier(tiering_base().SecondaryTierManager):  # type: ignore[misc]
    """tiered_kv's verified file tier behind vLLM's own CPU tier (``TieringOffloadingSpec``).

    Configured as ``"secondary_tiers": [{"type": "TieredKVFileTier", "module_path": "tiered_kv.integrations.vllm",
    "file_dir": DIR, "file_blocks": N}]``. Runs in the scheduler process and moves whole primary-tier chunks
    between vLLM's CPU region (``primary_kv_view``) and the file tier, one verified slot per chunk. A promotion
    (``submit_load``) reports only the chunks that passed verification in ``successful_keys``; a chunk that
    failed is dropped from the tier and answered ``MISS`` from then on.

    Args:
        offloading_spec: vLLM's spec (its ``config`` salts the content keys).
        primary_kv_view: vLLM's CPU tier; chunk ``c`` is ``strides[0]`` bytes at ``c * strides[0]``.
        tier_type: the registered type name.
        backpressure_detector: vLLM's optional detector (kept, unused).
        file_dir / file_blocks: the file tier's directory and slots.
        file_timeout: seconds one file I/O call may take (``FileTierConfig.timeout``; default the tier's): a hung
            disk makes a promotion fail (its chunks are not in ``successful_keys``) within that time.
    """

    medium = base.Medium.STORAGE if hasattr(base, "Medium") else None

    def __init__(
        self,
        offloading_spec: Any,
        primary_kv_view: memoryview,
        tier_type: str,
        backpressure_detector: Any = None,
        *,
        file_dir: str | None = None,
        file_blocks: int = 0,
        file_timeout: float | None = None,
        **_ignored: Any,
    ) -> None:
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        if file_dir is None or isinstance(file_blocks, bool) or not isinstance(file_blocks, int) or file_blocks < 1:
            raise ValueError("the TieredKVFile tier needs 'file_dir' and a positive int 'file_blocks'")
        fields = config_fields(offloading_spec.config)
        self._salt = rank_salt(fields, -1)  # the primary region holds every rank's bytes of a chunk
        chunk = self.block_size_bytes
        flat = torch.frombuffer(
            primary_kv_view.cast("B")
            if primary_kv_view.ndim != 1 or primary_kv_view.format != "B"
            else primary_kv_view,
            dtype=torch.uint8,
        )
        self.layout = block_layout(chunk)
        primary = flat[: flat.numel() // chunk * chunk].view(-1, *self.layout.block_shape)
        directory = Path(file_dir) / f"{fields.engine_id}-tier"
        directory.mkdir(parents=True, exist_ok=True)
        self._loop = LoopThread("tiered_kv-vllm-tier")
        timeout = {} if file_timeout is None else {"timeout": float(file_timeout)}
        self.engine = TransferEngine(
            self.layout, host_pool=primary, device="cpu",
            file_config=FileTierConfig.from_env(directory, file_blocks, **timeout),
        )
        self._file: collections.OrderedDict[bytes, int] = collections.OrderedDict()
        self._free = list(range(file_blocks - 1, -1, -1))
        self._busy: dict[bytes, int] = {}  # key -> slot being written
        self._jobs: list[tuple[Any, concurrent.futures.Future[list[bool]], list[tuple[bytes, int]]]] = []
        self._done: list[Any] = []
        self._events: list[Any] = []
        self.counts: collections.Counter[str] = collections.Counter()

    def lookup(self, key: bytes, req_context: Any = None) -> Any:
        key = bytes(key)
        if key in self._file:
            return LookupResult.HIT
        return LookupResult.RETRY if key in self._busy else LookupResult.MISS

    def touch(self, keys: Collection[bytes], req_context: Any = None) -> None:
        for k in map(bytes, keys):
            if k in self._file:
                self._file.move_to_end(k)

    def _slot(self) -> int | None:
        if self._free:
            return self._free.pop()
        if self._file:
            k, slot = self._file.popitem(last=False)
            self._events.append(make_event([k], "STORAGE", True))
            self.counts["evictions"] += 1
            return slot
        return None

    def submit_store(self, job_metadata: Any) -> None:
        todo: list[tuple[bytes, int, int]] = []
        for k, chunk in zip(map(bytes, job_metadata.keys), np.asarray(job_metadata.chunk_ids).tolist(), strict=True):
            if k in self._file or k in self._busy:
                continue
            slot = self._slot()
            if slot is None:
                break
            self._busy[k] = slot
            todo.append((k, int(chunk), slot))
        fut = self._loop.submit(self._copies([(Tier.HOST, c, Tier.FILE, s, k) for k, c, s in todo]))
        self._jobs.append((job_metadata, fut, [(k, s) for k, _c, s in todo]))

    def submit_load(self, job_metadata: Any) -> None:
        todo = [
            (Tier.FILE, self._file[k], Tier.HOST, int(c), k)
            for k, c in zip(map(bytes, job_metadata.keys), np.asarray(job_metadata.chunk_ids).tolist(), strict=True)
            if k in self._file
        ]
        fut = self._loop.submit(self._copies(todo))
        self._jobs.append((job_metadata, fut, [(t[4], -1) for t in todo]))

    async def _copies(self, todo: list[tuple[Tier, int, Tier, int, bytes]]) -> list[bool]:
        ts = [self.engine.copy(src, [a], dst, [b], keys=[content_key(self._salt, k)]) for src, a, dst, b, k in todo]
        res = await asyncio.gather(*ts, return_exceptions=True)
        return [not isinstance(r, BaseException) for r in res]

    def _harvest(self, block: bool) -> None:
        left = []
        for job, fut, items in self._jobs:
            if block:
                concurrent.futures.wait([fut])
            if not fut.done():
                left.append((job, fut, items))
                continue
            oks = fut.result()
            wanted = [bytes(k) for k in job.keys]
            good: list[bytes] = []
            for (k, slot), ok in zip(items, oks, strict=True):
                if job.is_promotion:
                    if ok:
                        good.append(k)
                        self.counts["loads"] += 1
                    elif k in self._file:  # failed verification: the slot was dropped; never served again
                        self._free.append(self._file.pop(k))
                        self.counts["verify_failures"] += 1
                        self._events.append(make_event([k], "STORAGE", True))
                else:
                    self._busy.pop(k, None)
                    if ok:
                        self._file[k] = slot
                        good.append(k)
                        self.counts["stores"] += 1
                    else:
                        self._free.append(slot)
                        self.counts["store_failures"] += 1
            if not job.is_promotion and good:
                self._events.append(make_event(good, "STORAGE", False))
            success = len(good) == len(wanted) if job.is_promotion else all(oks)
            self._done.append(
                tiering_base().JobResult(
                    job_id=job.job_id, success=success, successful_keys=good if job.is_promotion else None
                )
            )
        self._jobs = left

    def get_finished_jobs(self) -> Iterable[Any]:
        self._harvest(block=False)
        done, self._done = self._done, []
        return done

    def has_pending_work(self) -> bool:
        return bool(self._jobs)

    def take_events(self) -> Iterable[Any]:
        events, self._events = self._events, []
        return events

    def on_new_request(self, req_context: Any) -> Any:
        return base.RequestOffloadingContext()

    def drain_jobs(self) -> None:
        self._harvest(block=True)

    def shutdown(self) -> None:
        self._harvest(block=True)
        self._loop.run(self.engine.close())
        self._loop.close()
