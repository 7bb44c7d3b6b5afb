"""The scheduler side of the vLLM integration: :class:`TieredKVOffloadingManager`.

Primitives:

* :class:`TieredKVOffloadingManager` -- a host tier of ``host_blocks`` slots in a shared memory region per
  worker rank (LRU), written through to a verified file tier per rank; ``lookup`` answers ``HIT`` only for
  blocks verified in host memory (a block found only in the file tier is staged and verified first).
* :class:`VLLMStatistics` -- what a manager did since it started.
* :data:`MANAGERS` -- the managers alive in this process.

This module is one concept: vLLM's ``OffloadingManager`` contract (lookup, prepare_load / prepare_store,
completion, events, shutdown) over one host LRU and its file write-through; it stays whole because every
method edits the same entry table under the same single-threaded rules.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import threading
from collections.abc import Collection, Iterable
from pathlib import Path
from typing import Any, cast

from ..engine import TransferEngine
from ..pools import Tier
from ._vllm_compat import ConfigFields, base, make_event
from .loop import LoopThread
from .vllm_shared import (
    LookupResult,
    Settings,
    TieredKVLoadStoreSpec,
    await_all,
    block_layout,
    content_key,
    host_path,
    map_host,
    rank_salt,
)

__all__ = ["MANAGERS", "TieredKVOffloadingManager", "VLLMStatistics"]

#: Managers alive in this process, newest last (tests and servers read their statistics).
MANAGERS: list[TieredKVOffloadingManager] = []


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
        self.layout = block_layout(fields.bytes_per_block)
        self._salts = [rank_salt(fields, r) for r in range(fields.world_size)]
        self._paths = [host_path(settings, fields, r) for r in range(fields.world_size)]
        self._loop = LoopThread("tiered_kv-vllm-manager")
        self._engines: list[TransferEngine] = []
        for r in range(fields.world_size):
            file_dir = None
            if settings.file_dir is not None:
                file_dir = Path(settings.file_dir) / f"{fields.engine_id}-rank{r}"
                file_dir.mkdir(parents=True, exist_ok=True)
            self._engines.append(
                TransferEngine(
                    self.layout,
                    host_pool=map_host(self._paths[r], settings.host_blocks, self.layout),
                    device="cpu",
                    file_config=settings.file_config(file_dir) if file_dir is not None else None,
                )
            )
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
        out: Any = base.PrepareStoreOutput(
            keys_to_store=cast(Any, todo), store_spec=TieredKVLoadStoreSpec(blocks), evicted_keys=cast(Any, evicted)
        )
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
        return VLLMStatistics(
            c["stores"],
            c["store_failures"],
            c["host_hits"],
            c["file_hits"],
            c["loads"],
            c["staged"],
            c["verify_failures"],
            c["spills"],
            c["spill_failures"],
            c["host_evictions"],
            c["file_evictions"],
            len(self._host),
            len(self._file),
        )

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
        ts = [
            e.copy(Tier.HOST, [block], Tier.FILE, [slot], keys=[content_key(s, key)])
            for e, s in zip(self._engines, self._salts, strict=True)
        ]
        await await_all(ts)

    async def _stage(self, key: bytes, slot: int, block: int) -> None:
        ts = [
            e.copy(Tier.FILE, [slot], Tier.HOST, [block], keys=[content_key(s, key)])
            for e, s in zip(self._engines, self._salts, strict=True)
        ]
        await await_all(ts)

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
