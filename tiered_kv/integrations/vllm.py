"""tiered_kv as a vLLM ``OffloadingSpec`` (behind vLLM's in-tree ``OffloadingConnector``).

Primitives:

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

Content keys are vLLM's offload keys (block hash + group) salted with the model, KV dtype, KV cache layout,
bytes per block and the parallel layout including the rank: a TP rank never reads another rank's shard.

Not supported (``ValueError`` at start-up): more than one KV cache group (hybrid / HMA models) and
``blocks_per_chunk != 1`` (offloaded blocks larger than vLLM's blocks).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import dataclasses
import hashlib
import os
import threading
import time
from collections.abc import Collection, Iterable, Mapping
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch

from .. import pool_kinds
from ..engine import TransferEngine
from ..layout import KVLayout
from ..pools import Tier
from ._vllm_compat import ConfigFields, base, config_fields, make_event
from .loop import LoopThread

__all__ = [
    "MANAGERS",
    "TieredKVFileTier",
    "TieredKVLoadStoreSpec",
    "TieredKVOffloadingManager",
    "TieredKVOffloadingSpec",
    "TieredKVOffloadingWorker",
    "VLLMStatistics",
]

LookupResult = base.LookupResult


def _tiering_base() -> Any:
    """``vllm.v1.kv_offload.tiering.base`` (the secondary-tier API)."""
    from vllm.v1.kv_offload.tiering import base as tiering

    return tiering

#: Managers alive in this process, newest last (tests and servers read their statistics).
MANAGERS: list[TieredKVOffloadingManager] = []


class TieredKVLoadStoreSpec(base.BlockIDsLoadStoreSpec):
    """Host block indices (the same index in every rank's shared host region)."""

    @staticmethod
    def medium() -> str:
        return "CPU"


@dataclasses.dataclass(frozen=True, slots=True)
class Settings:
    """The spec's own keys of ``kv_connector_extra_config``."""

    host_blocks: int
    file_dir: str | None
    file_blocks: int
    shm_dir: str

    @classmethod
    def parse(cls, extra: Mapping[str, Any]) -> Settings:
        """Validate the extra config (``ValueError`` with a sentence on a bad value)."""
        def integer(name: str, default: int | None) -> int:
            value = extra.get(name, default)
            if value is None or isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"kv_connector_extra_config[{name!r}] must be a non-negative int, got {value!r}")
            return value

        host = integer("host_blocks", None)
        if host < 1:
            raise ValueError("kv_connector_extra_config['host_blocks'] must be >= 1")
        file_dir = extra.get("file_dir")
        file_blocks = integer("file_blocks", 0)
        if (file_dir is None) != (file_blocks == 0):
            raise ValueError("give both 'file_dir' and 'file_blocks' for a file tier (or neither)")
        return cls(host, None if file_dir is None else str(file_dir), file_blocks, str(extra.get("shm_dir", "/dev/shm")))


def _layout(bytes_per_block: int) -> KVLayout:
    """One vLLM block (all layers of one worker) as opaque bytes."""
    return KVLayout(num_layers=1, num_kv_heads=1, head_dim=bytes_per_block, tokens_per_block=1, dtype=torch.uint8,
                    kv_factor=1)


def _salt(f: ConfigFields, rank: int) -> bytes:
    text = (f"tiered_kv-vllm|model={f.model}|dtype={f.dtype}|layout={f.kv_cache_layout}|bytes={f.bytes_per_block}"
            f"|tokens={f.tokens_per_block}|tp={f.tp_size}|pp={f.pp_size}|world={f.world_size}|rank={rank}")
    return text.encode()


def content_key(salt: bytes, key: bytes) -> bytes:
    """The file tier's content key of one vLLM offload key for one rank."""
    return hashlib.blake2b(salt + b"|" + bytes(key), digest_size=16).digest()


def _host_path(s: Settings, f: ConfigFields, rank: int) -> Path:
    safe = "".join(ch if ch.isalnum() or ch in "-_" else "_" for ch in f.engine_id)
    return Path(s.shm_dir) / f"tiered_kv-{safe}-rank{rank}.host"


def _map_host(path: Path, blocks: int, layout: KVLayout) -> torch.Tensor:
    """The shared host region of one rank (created, or opened if the other side made it first)."""
    size = blocks * layout.bytes_per_block
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        if os.fstat(fd).st_size < size:
            os.ftruncate(fd, size)
    finally:
        os.close(fd)
    flat = torch.from_file(str(path), shared=True, size=size, dtype=torch.uint8)
    return flat.view(blocks, *layout.block_shape)


@dataclasses.dataclass(frozen=True, slots=True)
class VLLMStatistics:
    """What the manager did since it started.

    Attributes:
        stores / store_failures: blocks stored into host memory / stores vLLM reported failed.
        host_hits: lookups answered HIT from blocks stored into host memory.
        file_hits: lookups answered HIT from blocks staged from the file tier and verified.
        loads: blocks handed to vLLM to load (``prepare_load``).
        staged / verify_failures: file blocks staged into host memory and verified / that failed
            verification (answered MISS; vLLM recomputes them).
        spills / spill_failures: blocks written through to the file tier / whose write failed.
        host_evictions / file_evictions: blocks that left each tier to make room.
        host_blocks / file_blocks: blocks held now.
    """

    stores: int
    store_failures: int
    host_hits: int
    file_hits: int
    loads: int
    staged: int
    verify_failures: int
    spills: int
    spill_failures: int
    host_evictions: int
    file_evictions: int
    host_blocks: int
    file_blocks: int


@dataclasses.dataclass(slots=True)
class _Entry:
    block: int
    state: str  # "storing" | "staging" | "ready"
    from_file: bool = False
    pins: int = 0
    spilling: bool = False


class TieredKVOffloadingManager(base.OffloadingManager):
    """The scheduler side (see the module docstring). Single-threaded, like every vLLM manager.

    Args:
        fields: what the spec read from vLLM's ``OffloadingConfig``.
        settings: the spec's extra config.
    """

    def __init__(self, fields: ConfigFields, settings: Settings) -> None:
        self.fields = fields
        self.settings = settings
        self.layout = _layout(fields.bytes_per_block)
        self._salts = [_salt(fields, r) for r in range(fields.world_size)]
        self._paths = [_host_path(settings, fields, r) for r in range(fields.world_size)]
        self._loop = LoopThread("tiered_kv-vllm-manager")
        self._engines: list[TransferEngine] = []
        for r in range(fields.world_size):
            file_dir = None
            if settings.file_dir is not None:
                file_dir = Path(settings.file_dir) / f"{fields.engine_id}-rank{r}"
                file_dir.mkdir(parents=True, exist_ok=True)
            self._engines.append(TransferEngine(
                self.layout, host_pool=_map_host(self._paths[r], settings.host_blocks, self.layout), device="cpu",
                file_dir=file_dir, file_blocks=settings.file_blocks if file_dir is not None else 0))
        self._host: collections.OrderedDict[bytes, _Entry] = collections.OrderedDict()  # LRU: oldest first
        self._free = list(range(settings.host_blocks - 1, -1, -1))
        self._file: collections.OrderedDict[bytes, int] = collections.OrderedDict()  # key -> slot, LRU
        self._file_free = list(range(settings.file_blocks - 1, -1, -1))
        self._file_busy: set[int] = set()  # slots being written or read
        self._jobs: list[tuple[str, bytes, int, concurrent.futures.Future[None]]] = []
        self._events: list[Any] = []
        self._counts: collections.Counter[str] = collections.Counter()
        self._lock = threading.Lock()
        MANAGERS.append(self)

    # ---------------------------------------------------------------------------------- vLLM API

    def lookup(self, key: bytes, req_context: Any = None) -> Any:
        """Whether ``key`` can be loaded.

        ``HIT`` (verified in host memory), ``HIT_PENDING`` (being stored or staged), ``RETRY`` (no host slot
        free to stage into yet) or ``MISS``.
        """
        self._poll()
        key = bytes(key)
        e = self._host.get(key)
        if e is not None:
            if e.state == "ready":
                self._counts["file_hits" if e.from_file else "host_hits"] += 1
                return LookupResult.HIT
            return LookupResult.HIT_PENDING if e.state == "staging" else LookupResult.MISS
        slot = self._file.get(key)
        if slot is None or slot in self._file_busy:
            return LookupResult.MISS if slot is None else LookupResult.RETRY
        block = self._alloc()
        if block is None:
            return LookupResult.RETRY
        self._host[key] = _Entry(block, "staging", from_file=True)
        self._file_busy.add(slot)
        self._jobs.append(("stage", key, slot, self._loop.submit(self._stage(key, slot, block))))
        return LookupResult.HIT_PENDING

    def prepare_load(self, keys: Collection[bytes], req_context: Any = None) -> TieredKVLoadStoreSpec:
        blocks = []
        for k in keys:
            e = self._host[bytes(k)]
            assert e.state == "ready", "prepare_load of a block lookup did not answer HIT for"
            e.pins += 1
            self._host.move_to_end(bytes(k))
            blocks.append(e.block)
        self._counts["loads"] += len(blocks)
        return TieredKVLoadStoreSpec(blocks)

    def touch(self, keys: Collection[bytes], req_context: Any = None) -> None:
        for k in keys:
            if bytes(k) in self._host:
                self._host.move_to_end(bytes(k))

    def complete_load(self, keys: Collection[bytes], req_context: Any = None) -> None:
        for k in keys:
            e = self._host.get(bytes(k))
            if e is not None and e.pins:
                e.pins -= 1

    def prepare_store(self, keys: Collection[bytes], req_context: Any = None) -> Any:
        self._poll()
        todo = [bytes(k) for k in keys if bytes(k) not in self._host]
        evicted: list[bytes] = []
        blocks: list[int] = []
        for _k in todo:
            block = self._alloc(evicted)
            if block is None:
                break
            blocks.append(block)
        if todo and not blocks:
            return None
        todo = todo[: len(blocks)]
        for k, b in zip(todo, blocks, strict=True):
            self._host[k] = _Entry(b, "storing")
        out: Any = base.PrepareStoreOutput(keys_to_store=cast(Any, todo), store_spec=TieredKVLoadStoreSpec(blocks),
                                           evicted_keys=cast(Any, evicted))
        return out

    def complete_store(self, keys: Collection[bytes], req_context: Any = None, success: bool = True) -> None:
        """Stored blocks become loadable (and are written through to the file tier).

        With ``success=False`` blocks still being stored are dropped and never served.
        """
        stored: list[bytes] = []
        for k in map(bytes, keys):
            e = self._host.get(k)
            if e is None or e.state != "storing":
                continue
            if success:
                e.state = "ready"
                stored.append(k)
                self._spill(k, e)
            else:
                del self._host[k]
                self._free.append(e.block)
                self._counts["store_failures"] += 1
        self._counts["stores"] += len(stored)
        if stored:
            self._events.append(make_event(stored, "CPU", False))

    def on_new_request(self, req_context: Any) -> Any:
        return base.RequestOffloadingContext()

    def take_events(self) -> Iterable[Any]:
        self._poll()
        events, self._events = self._events, []
        yield from events

    def has_pending_work(self) -> bool:
        self._poll()
        return bool(self._jobs)

    def on_schedule_end(self, context: Any) -> None:
        self._poll()

    def reset_cache(self) -> None:
        """Forget the host tier's blocks (not pinned, not in flight); the file tier keeps its verified blocks."""
        self._poll()
        gone = [k for k, e in self._host.items() if e.state == "ready" and not e.pins and not e.spilling]
        for k in gone:
            self._free.append(self._host.pop(k).block)
        if gone:
            self._events.append(make_event(gone, "CPU", True))

    def shutdown(self) -> None:
        if self in MANAGERS:
            MANAGERS.remove(self)
        for f in [j[3] for j in self._jobs]:
            concurrent.futures.wait([f], timeout=30)
        for engine in self._engines:
            self._loop.run(engine.close())
        self._loop.close()
        for p in self._paths:
            p.unlink(missing_ok=True)

    # ---------------------------------------------------------------------------------- ours

    def statistics(self) -> VLLMStatistics:
        """Counters since start-up (see :class:`VLLMStatistics`)."""
        self._poll()
        c = self._counts
        return VLLMStatistics(c["stores"], c["store_failures"], c["host_hits"], c["file_hits"], c["loads"], c["staged"],
                              c["verify_failures"], c["spills"], c["spill_failures"], c["host_evictions"],
                              c["file_evictions"], len(self._host), len(self._file))

    def file_slots(self) -> dict[bytes, int]:
        """Offload key -> file slot of every block in the file tier (every rank uses the same slot)."""
        return dict(self._file)

    @property
    def engines(self) -> list[TransferEngine]:
        """One engine per rank: the rank's shared host region and file tier."""
        return list(self._engines)

    def _alloc(self, evicted: list[bytes] | None = None) -> int | None:
        if self._free:
            return self._free.pop()
        for k, e in self._host.items():  # least recently used first
            if e.state == "ready" and not e.pins and not e.spilling:
                del self._host[k]
                self._counts["host_evictions"] += 1
                self._events.append(make_event([k], "CPU", True))
                if evicted is not None:
                    evicted.append(k)
                return e.block
        return None

    def _spill(self, key: bytes, e: _Entry) -> None:
        if not self._engines or self.settings.file_blocks == 0 or key in self._file:
            return
        slot = self._file_slot()
        if slot is None:
            return
        e.spilling = True
        self._file_busy.add(slot)
        self._jobs.append(("spill", key, slot, self._loop.submit(self._write(key, e.block, slot))))

    def _file_slot(self) -> int | None:
        if self._file_free:
            return self._file_free.pop()
        for k, slot in self._file.items():
            if slot not in self._file_busy:
                del self._file[k]
                self._counts["file_evictions"] += 1
                self._events.append(make_event([k], "STORAGE", True))
                return slot
        return None

    async def _write(self, key: bytes, block: int, slot: int) -> None:
        ts = [e.copy(Tier.HOST, [block], Tier.FILE, [slot], keys=[content_key(s, key)])
              for e, s in zip(self._engines, self._salts, strict=True)]
        await _all(ts)

    async def _stage(self, key: bytes, slot: int, block: int) -> None:
        ts = [e.copy(Tier.FILE, [slot], Tier.HOST, [block], keys=[content_key(s, key)])
              for e, s in zip(self._engines, self._salts, strict=True)]
        await _all(ts)

    def _poll(self) -> None:
        """Harvest finished spills and stagings (scheduler thread only)."""
        if not self._jobs:
            return
        left = []
        for kind, key, slot, fut in self._jobs:
            if not fut.done():
                left.append((kind, key, slot, fut))
                continue
            self._file_busy.discard(slot)
            ok = fut.exception() is None
            e = self._host.get(key)
            if kind == "spill":
                if e is not None:
                    e.spilling = False
                if ok:
                    self._file[key] = slot
                    self._counts["spills"] += 1
                    self._events.append(make_event([key], "STORAGE", False))
                else:
                    self._file_free.append(slot)
                    self._counts["spill_failures"] += 1
            else:  # stage
                self._file.move_to_end(key) if key in self._file else None
                if ok and e is not None:
                    e.state = "ready"
                    self._counts["staged"] += 1
                    self._events.append(make_event([key], "CPU", False))
                elif e is not None:  # verification failed: never served; vLLM recomputes the block
                    del self._host[key]
                    self._free.append(e.block)
                    self._counts["verify_failures"] += 1
                    if self._file.pop(key, None) is not None:
                        self._file_free.append(slot)
                        self._events.append(make_event([key], "STORAGE", True))
        self._jobs = left


async def _all(transfers: list[Any]) -> None:
    """Await every transfer (all of them, even after one fails); raise the first failure."""
    error: BaseException | None = None
    for t in transfers:
        try:
            await t
        except Exception as exc:
            error = error or exc
    if error is not None:
        raise error


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
        self.layout = _layout(fields.bytes_per_block)
        self.pool = pool_kinds.pages(tensors, layout=self.layout)
        host = _map_host(_host_path(settings, fields, fields.rank), settings.host_blocks, self.layout)
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
            out.append(base.TransferResult(job_id=job_id, success=ok, transfer_size=size,
                                           transfer_time=time.perf_counter() - started))
        return out

    def wait(self, job_ids: set[int]) -> None:
        futs = [self._jobs[j][0] for j in job_ids if j in self._jobs]
        concurrent.futures.wait(futs)

    def shutdown(self) -> None:
        concurrent.futures.wait([f for f, _ in self._jobs.values()], timeout=30)
        self._loop.run(self.engine.close())
        self._loop.close()


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
            raise ValueError("TieredKVOffloadingSpec needs blocks_per_chunk == 1 (offload block size = vLLM block size)")
        self._manager: TieredKVOffloadingManager | None = None

    def get_manager(self) -> TieredKVOffloadingManager:
        if self._manager is None:
            self._manager = TieredKVOffloadingManager(self.fields, self.settings)
        return self._manager

    def get_worker(self, kv_caches: Any) -> TieredKVOffloadingWorker:
        return TieredKVOffloadingWorker(self.fields, self.settings, kv_caches)


class TieredKVFileTier(_tiering_base().SecondaryTierManager):  # type: ignore[misc]
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
    """

    medium = base.Medium.STORAGE if hasattr(base, "Medium") else None

    def __init__(self, offloading_spec: Any, primary_kv_view: memoryview, tier_type: str,
                 backpressure_detector: Any = None, *, file_dir: str | None = None, file_blocks: int = 0,
                 **_ignored: Any) -> None:
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        if file_dir is None or isinstance(file_blocks, bool) or not isinstance(file_blocks, int) or file_blocks < 1:
            raise ValueError("the TieredKVFile tier needs 'file_dir' and a positive int 'file_blocks'")
        fields = config_fields(offloading_spec.config)
        self._salt = _salt(fields, -1)  # the primary region holds every rank's bytes of a chunk
        chunk = self.block_size_bytes
        flat = torch.frombuffer(primary_kv_view.cast("B") if primary_kv_view.ndim != 1 or primary_kv_view.format != "B"
                                else primary_kv_view, dtype=torch.uint8)
        self.layout = _layout(chunk)
        primary = flat[: flat.numel() // chunk * chunk].view(-1, *self.layout.block_shape)
        directory = Path(file_dir) / f"{fields.engine_id}-tier"
        directory.mkdir(parents=True, exist_ok=True)
        self._loop = LoopThread("tiered_kv-vllm-tier")
        self.engine = TransferEngine(self.layout, host_pool=primary, device="cpu", file_dir=directory,
                                     file_blocks=file_blocks)
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
        todo = [(Tier.FILE, self._file[k], Tier.HOST, int(c), k)
                for k, c in zip(map(bytes, job_metadata.keys), np.asarray(job_metadata.chunk_ids).tolist(), strict=True)
                if k in self._file]
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
            self._done.append(_tiering_base().JobResult(job_id=job.job_id, success=success,
                                                        successful_keys=good if job.is_promotion else None))
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
