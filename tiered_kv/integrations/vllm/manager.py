"""The scheduler side of the vLLM integration: :class:`TieredKVOffloadingManager`.

Primitives:

* :class:`TieredKVOffloadingManager` -- a host tier of ``host_blocks`` slots in a shared memory region per
  worker rank (LRU), written through to a verified file tier per rank; ``lookup`` answers ``HIT`` only for
  blocks verified in host memory (a block found only in the file tier is staged and verified first).
* :class:`VLLMStatistics` -- what a manager did since it started.
* :data:`MANAGERS` -- the managers alive in this process.

Rules (with a host tier of any size the engine makes progress; the slot rules are :mod:`.host`'s):

* A key whose load failed verification on the device (``TieredKVConnector`` reports the GPU blocks, and
  :meth:`TieredKVOffloadingManager.refuse` finds the host blocks they were loaded from) is never answered ``HIT``
  again: it leaves host memory (once no load reads it) and the file tier (its copy there may have been written from
  the same bytes), and is stored anew when vLLM recomputes it (``load_refusals``).
* A block that cannot be staged now is a ``MISS`` (vLLM recomputes it): ``RETRY`` and ``HIT_PENDING`` are
  answered only while a file job of this manager is in flight, and each ends within the file tier's deadline.
* A store takes the host blocks it can get now, waiting (at most the file tier's deadline per block) for a
  write-through in flight to free one. vLLM's store job must fit in host memory at once, so the keys beyond
  what the host tier can take are not offloaded (``store_drops``; with none taken, ``prepare_store`` answers
  ``None`` and vLLM offers the keys again next step, ``store_deferrals``): size ``host_blocks`` to at least the
  blocks one scheduler step offloads. Every block vLLM stores is written through to the file tier unless every
  file slot is busy at that moment (``spill_skips``) or the write fails (``spill_failures``).

This module is one concept: vLLM's ``OffloadingManager`` contract (lookup, prepare_load / prepare_store,
completion, events, shutdown) over one host LRU and its file write-through.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import logging
import threading
from collections.abc import Collection, Hashable, Iterable
from pathlib import Path
from typing import Any, cast

from ...engine import TransferEngine
from ...pools import Tier
from ..loop import LoopThread
from ._compat import ConfigFields, base, make_event
from .host import HostEntry, HostTable
from .shared import (
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

_log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, slots=True)
class VLLMStatistics:
    """What the manager did since it started.

    Attributes:
        stores / store_failures: blocks stored into host memory / stores vLLM reported failed.
        store_drops: keys of a ``prepare_store`` the host tier had no block for (not offloaded).
        store_deferrals: ``prepare_store`` calls answered ``None`` (no host block now; vLLM offers the keys
            again next step while the request runs).
        host_hits: lookups answered HIT from blocks stored into host memory.
        file_hits: lookups answered HIT from blocks staged from the file tier and verified.
        loads: blocks handed to vLLM to load (``prepare_load``).
        staged / verify_failures: file blocks staged into host memory and verified / that failed
            verification (answered MISS; vLLM recomputes them).
        stage_misses: lookups of a file block answered ``MISS`` because no host block was free to stage it.
        spills / spill_failures: blocks written through to the file tier / whose write failed.
        spill_skips: stored blocks not written through because every file slot was busy (host memory only).
        host_evictions / file_evictions: blocks that left each tier to make room.
        host_blocks / file_blocks: blocks held now.
        load_refusals: keys dropped because a load of them failed verification on the device (reported by
            ``TieredKVConnector``; vLLM recomputed them).
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
    store_drops: int = 0
    store_deferrals: int = 0
    stage_misses: int = 0
    spill_skips: int = 0
    load_refusals: int = 0


#: How long a store waits for one write-through when the file tier has no deadline (``file_timeout=None``).
SPILL_WAIT_WITHOUT_DEADLINE = 30.0


def _holder(req_context: Any) -> Hashable:
    """Who a lookup answered: the request (``None`` where vLLM passes no context)."""
    return getattr(req_context, "req_id", None)


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
        self._host = HostTable(settings.host_blocks)
        self._file: collections.OrderedDict[bytes, int] = collections.OrderedDict()  # key -> slot, LRU
        self._file_free = list(range(settings.file_blocks - 1, -1, -1))
        self._file_busy: set[int] = set()  # slots being written or read
        self._jobs: list[tuple[str, bytes, int, concurrent.futures.Future[None]]] = []
        self._events: list[Any] = []
        self._counts: collections.Counter[str] = collections.Counter()
        self._lock = threading.Lock()
        self._spill_wait = SPILL_WAIT_WITHOUT_DEADLINE
        if settings.file_dir is not None and self._engines:
            timeout = self._engines[0].file_tier.config.timeout
            if timeout is not None:
                self._spill_wait = float(timeout) + 1.0
        self._warned_drop = False
        self._generation = 0  # the last generation given to a host entry
        MANAGERS.append(self)

    # ---------------------------------------------------------------------------------- vLLM API

    def lookup(self, key: bytes, req_context: Any = None) -> Any:
        """Whether ``key`` can be loaded.

        ``HIT`` (verified in host memory), ``HIT_PENDING`` (being staged from the file tier), ``RETRY`` (its file
        slot is being written) or ``MISS`` (absent, being stored, or no host block to stage it into now). A
        ``HIT`` or ``HIT_PENDING`` holds the block for the request until its ``prepare_load`` or its end.
        """
        self._poll()
        key = bytes(key)
        holder = _holder(req_context)
        e = self._host.get(key)
        if e is not None and e.refused:
            self._drop_refused(key, e)
            return LookupResult.MISS
        if e is not None:
            if e.state == "storing":
                return LookupResult.MISS
            self._host.hold(key, holder)
            if e.state == "staging":
                return LookupResult.HIT_PENDING
            self._counts["file_hits" if e.from_file else "host_hits"] += 1
            return LookupResult.HIT
        slot = self._file.get(key)
        if slot is None:
            return LookupResult.MISS
        if slot in self._file_busy:
            return LookupResult.RETRY
        evicted: list[bytes] = []
        block = self._host.block_for_read(evicted)
        self._evicted(evicted)
        if block is None:
            self._counts["stage_misses"] += 1
            return LookupResult.MISS
        self._host.add(key, block, "staging", from_file=True, generation=self._next_generation())
        self._host.hold(key, holder)
        self._file_busy.add(slot)
        self._jobs.append(("stage", key, slot, self._loop.submit(self._stage(key, slot, block))))
        return LookupResult.HIT_PENDING

    def prepare_load(self, keys: Collection[bytes], req_context: Any = None) -> TieredKVLoadStoreSpec:
        blocks, generations = [], []
        for k in map(bytes, keys):
            e = self._host.get(k)
            assert e is not None and e.state == "ready", "prepare_load of a block lookup did not answer HIT for"
            e.pins += 1
            self._host.touch(k)
            blocks.append(e.block)
            generations.append(e.generation)
        self._host.release(_holder(req_context))
        self._counts["loads"] += len(blocks)
        return TieredKVLoadStoreSpec(blocks, generations)

    def touch(self, keys: Collection[bytes], req_context: Any = None) -> None:
        for k in keys:
            self._host.touch(bytes(k))

    def complete_load(self, keys: Collection[bytes], req_context: Any = None) -> None:
        for k in map(bytes, keys):
            e = self._host.get(k)
            if e is not None and e.pins:
                e.pins -= 1
                if e.refused:
                    self._drop_refused(k, e)

    def prepare_store(self, keys: Collection[bytes], req_context: Any = None) -> Any:
        """Host blocks for vLLM's worker to store ``keys`` into: as many as the host tier can give now.

        Keys beyond that are not offloaded (``store_drops``); with no block at all the answer is ``None``, and
        vLLM offers the keys again next step while the request runs (``store_deferrals``).
        """
        self._poll()
        todo = [k for k in map(bytes, keys) if k not in self._host]
        evicted: list[bytes] = []
        blocks: list[int] = []
        for _k in todo:
            block = self._block_for_store(evicted)
            if block is None:
                break
            blocks.append(block)
        self._evicted(evicted)
        if todo and not blocks:
            self._counts["store_deferrals"] += 1
            return None
        if len(blocks) < len(todo):
            self._counts["store_drops"] += len(todo) - len(blocks)
            if not self._warned_drop:
                self._warned_drop = True
                _log.warning(
                    "tiered_kv: a vLLM store of %d blocks found %d host blocks to take; the rest are not offloaded "
                    "(counted in store_drops): give host_blocks at least the blocks one scheduler step offloads",
                    len(todo), len(blocks),
                )
        todo = todo[: len(blocks)]
        generations = [self._next_generation() for _ in todo]
        for k, b, g in zip(todo, blocks, generations, strict=True):
            self._host.add(k, b, "storing", generation=g)
        out: Any = base.PrepareStoreOutput(
            keys_to_store=cast(Any, todo), store_spec=TieredKVLoadStoreSpec(blocks, generations),
            evicted_keys=cast(Any, evicted),
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
                self._host.remove(k)
                self._counts["store_failures"] += 1
        self._counts["stores"] += len(stored)
        if stored:
            self._events.append(make_event(stored, "CPU", False))

    def on_new_request(self, req_context: Any) -> Any:
        return base.RequestOffloadingContext()

    def on_request_finished(self, req_context: Any) -> None:
        """The request's holds end (see :meth:`lookup`)."""
        self._host.release(_holder(req_context))

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
        """Forget the host blocks but those this manager's own file jobs use; the file tier keeps its blocks.

        vLLM drops its in-flight jobs at a reset without completing them: their blocks are reused only as store
        destinations until then (:meth:`.host.HostTable.reset`).
        """
        self._poll()
        gone = self._host.reset()
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
        names = [f.name for f in dataclasses.fields(VLLMStatistics)]
        values = {n: c[n] for n in names if n not in ("host_blocks", "file_blocks")}
        return VLLMStatistics(**values, host_blocks=len(self._host), file_blocks=len(self._file))

    def refuse(self, host_blocks: Iterable[int]) -> int:
        """Loads from these host blocks failed verification on the device: never serve their keys again.

        Only entries a load is reading now (pinned) are refused: the block of a failed load's source. Each leaves
        host memory once no load reads it and nothing holds it, and its file copy is dropped (it may have been
        written from the same bytes). Returns how many keys were refused now.
        """
        self._poll()
        refused = 0
        for k in self._host.loading({int(b) for b in host_blocks}):
            e = self._host.get(k)
            assert e is not None
            if e.refused:
                continue
            e.refused = True
            refused += 1
            _log.warning("tiered_kv: offload key %s (host block %d) failed verification on load: dropped from "
                         "the host and file tiers", k.hex()[:16], e.block)
            slot = self._file.get(k)
            if slot is not None and slot not in self._file_busy:
                del self._file[k]
                self._file_free.append(slot)
                self._events.append(make_event([k], "STORAGE", True))
            self._drop_refused(k, e)
        self._counts["load_refusals"] += refused
        return refused

    def host_slots(self) -> dict[bytes, int]:
        """Offload key -> host block of every loadable block in host memory, least recently used first."""
        return {k: e.block for k, e in self._host.entries.items() if e.state == "ready" and not e.refused}

    def file_slots(self) -> dict[bytes, int]:
        """Offload key -> file slot of every block in the file tier (every rank uses the same slot)."""
        return dict(self._file)

    @property
    def engines(self) -> list[TransferEngine]:
        """One engine per rank: the rank's shared host region and file tier."""
        return list(self._engines)

    def _next_generation(self) -> int:
        self._generation += 1
        return self._generation

    def _drop_refused(self, key: bytes, e: HostEntry) -> None:
        """Forget a refused entry once nothing loads, holds or writes it through."""
        if e.evictable:
            self._host.remove(key)
            self._events.append(make_event([key], "CPU", True))

    def _evicted(self, keys: list[bytes]) -> None:
        if keys:
            self._counts["host_evictions"] += len(keys)
            self._events.append(make_event(list(keys), "CPU", True))

    def _block_for_store(self, evicted: list[bytes]) -> int | None:
        """A host block to store into; when only write-throughs hold them, wait for the oldest (bounded)."""
        while True:
            block = self._host.block_for_store(evicted)
            if block is not None:
                return block
            key = self._host.oldest_spilling()
            fut = next((j[3] for j in self._jobs if j[0] == "spill" and j[1] == key), None)
            if key is None or fut is None:
                return None
            concurrent.futures.wait([fut], timeout=self._spill_wait)
            if not fut.done():
                return None
            self._poll()

    def _spill(self, key: bytes, e: HostEntry) -> None:
        if not self._engines or self.settings.file_blocks == 0 or key in self._file:
            return
        slot = self._file_slot()
        if slot is None:
            self._counts["spill_skips"] += 1
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
                if ok and e is not None and e.refused:  # written from bytes a load found changed: not kept
                    self._file_free.append(slot)
                    self._drop_refused(key, e)
                elif ok:
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
                    self._host.remove(key)
                    self._counts["verify_failures"] += 1
                    if self._file.pop(key, None) is not None:
                        self._file_free.append(slot)
                        self._events.append(make_event([key], "STORAGE", True))
        self._jobs = left
