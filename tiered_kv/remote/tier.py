"""``RemoteTier``: fenced, batched, verified copies between an engine's pools and a distributed store.

Primitives:

* :class:`RemoteTier` -- over a :class:`~tiered_kv.TransferEngine` and a store client
  (:mod:`tiered_kv.remote.stores`): ``put(src_tier, slots, keys)`` and ``get(keys, dst_tier, slots)``, each
  returning at once a :class:`RemoteTransfer` (an engine :class:`~tiered_kv.Transfer`, awaitable, with the
  engine's per-block fences on the pool side), ``connect()``, ``statistics()``, ``close()``.
* :class:`RemoteTransfer` -- a transfer with ``found``: per block, whether a verified object was copied.
* :class:`RemoteStatistics` (re-exported from :mod:`tiered_kv.remote.counters`).

The staging area and its copies are :mod:`tiered_kv.remote.staging`; the counters :mod:`tiered_kv.remote.counters`.

Data path: every object goes through a pinned staging area registered with the store (zero-copy for
Mooncake). ``put`` reads the pool blocks under read fences (GPU blocks on the engine's offload stream, so
after compute the engine was told about), releases the fences as soon as the bytes are staged, writes the
slot header (:mod:`tiered_kv.remote.objects`) and stores the batch in one round trip. ``get`` reads the batch
in one round trip into staging, verifies every object (header, layout fingerprint, rank, name, length,
xxh3-128 checksum) and only then copies verified payloads into the destination blocks under write fences
(GPU blocks on the onboard stream). A batch larger than half the staging area is split into chunks that run
concurrently (the network round trip of one chunk overlaps the staging copies of the next).

Failure model: a missing object, one that fails verification or a lease that expired mid-read is a *miss*
(``found[i] = False``; the destination block is left untouched). An object that failed verification is
remembered (:mod:`tiered_kv.remote.repair`): the next put of its name replaces it (counted in
``blocks["replaced_corrupt"]``), so one node that recomputes the block heals it for every node.

A store error or timeout fails the whole transfer with :class:`~tiered_kv.errors.RemoteStoreError`
(destination blocks untouched). After a failure the tier stays away from the store for ``backoff`` seconds
(gets answer "miss" at once, puts are dropped), then tries again: requests are never stalled behind a dead or
hung store for more than one timeout.

Size: a little over 500 lines: the tier's put / get / drain life cycle and its lease rules (staging and
counters are modules of their own).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any, TypeVar

import numpy as np

from ..engine import Transfer, TransferEngine
from ..errors import EngineClosedError, RemoteStoreError
from ..fences import Marker
from ..pools import BlockPool, Tier, as_indices
from .counters import RemoteCounters, RemoteStatistics
from .objects import object_name, object_size, verify_object
from .repair import CorruptObjects, digest
from .staging import Lease, StagingArea
from .stores import MISSING, REPLACED, RemoteStore, StoreTimeout, open_store
from .url import StoreURL

__all__ = ["RemoteStatistics", "RemoteTier", "RemoteTransfer"]

log = logging.getLogger(__name__)

_R = TypeVar("_R")


class RemoteTransfer(Transfer):
    """A :class:`~tiered_kv.Transfer` to or from the store; ``found[i]``: block ``i`` was copied (verified)."""

    __slots__ = ("found",)

    def __init__(self, marker: Marker, src_tier: Tier, dst_tier: Tier, num_blocks: int, nbytes: int) -> None:
        super().__init__(marker, src_tier, dst_tier, num_blocks, nbytes)
        self.found: list[bool] = [False] * num_blocks


class RemoteTier:
    """The fourth tier: content-keyed immutable objects in a distributed store (Redis/Valkey or Mooncake).

    Args:
        engine: the engine whose pools (``Tier.GPU``, ``Tier.HOST``) are copied from and into; its fence table
            orders these copies with every engine copy of the same blocks.
        store: a store URL (``"redis://127.0.0.1:6379/0"``, ``"mooncake://127.0.0.1:50051"``, see
            :mod:`tiered_kv.remote.url`) or a store client.
        rank: the tensor-parallel rank whose KV shard this process holds (part of every object name).
        staging_blocks: objects the staging area holds (two chunks in flight at once).
        backoff: seconds to leave the store alone after an error or timeout.
        route: add the engine routes ``gpu/host <-> remote`` (:mod:`tiered_kv.remote.handler`), so that
            ``engine.copy(..., Tier.REMOTE, ..., keys=...)`` works too. One tier per engine can.

    Raises:
        TypeError, ValueError: bad arguments (a bad URL, a non-positive ``staging_blocks``).
        BackendUnavailable: the store's client package is not installed.

    Notes:
        All calls must come from the engine's event loop. ``await tier.connect()`` before use; a store that
        cannot be reached leaves the tier unavailable (every get misses, puts are dropped) and it is retried
        after ``backoff`` seconds.
    """

    def __init__(self, engine: TransferEngine, store: str | StoreURL | RemoteStore, *, rank: int = 0,
                 staging_blocks: int = 64, backoff: float = 2.0, route: bool = True) -> None:
        if not isinstance(engine, TransferEngine):
            raise TypeError(f"engine must be a TransferEngine, got {type(engine).__name__}")
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
            raise ValueError(f"rank must be a non-negative int, got {rank!r}")
        if isinstance(staging_blocks, bool) or not isinstance(staging_blocks, int) or staging_blocks < 1:
            raise ValueError(f"staging_blocks must be a positive int, got {staging_blocks!r}")
        if not isinstance(backoff, (int, float)) or backoff < 0:
            raise ValueError(f"backoff must be a non-negative number of seconds, got {backoff!r}")
        self.engine = engine
        self.store: RemoteStore = open_store(store) if isinstance(store, (str, StoreURL)) else store
        self.rank = rank
        self.layout = engine.layout
        self.object_size = object_size(self.layout)
        self._fingerprint = bytes.fromhex(self.layout.fingerprint)
        self._staging = StagingArea(engine, staging_blocks, self.object_size, self._fingerprint, rank)
        self.store.register(self._staging.array)
        self._chunk = max(1, staging_blocks // 2)
        self._backoff = float(backoff)
        self._connected = False
        self._down_until = 0.0
        self._reconnecting: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._closed = False
        self._counts = RemoteCounters()
        self._corrupt = CorruptObjects()
        if route:
            from .handler import RemoteHandler

            engine.add_handler(RemoteHandler(self))

    # ------------------------------------------------------------------------------------ lifecycle

    async def connect(self) -> bool:
        """Connect to the store; ``False`` (logged, retried later) if it cannot be reached.

        Cancellation: propagates; the tier stays unconnected.
        """
        try:
            await self.store.connect()
        except RemoteStoreError as exc:
            log.warning("remote tier unavailable (retrying every %.1f s): %s", self._backoff, exc)
            self._connected = False
            self._down_until = time.monotonic() + self._backoff
            return False
        self._connected = True
        self._down_until = 0.0
        return True

    @property
    def available(self) -> bool:
        """Connected and not backing off after a failure."""
        return self._connected and time.monotonic() >= self._down_until

    def _usable(self) -> bool:
        """Whether to talk to the store now (starting a reconnect in the background once the back-off is over)."""
        if self._closed:
            return False
        if self.available:
            return True
        if not self._connected and time.monotonic() >= self._down_until and self._reconnecting is None:
            async def reconnect() -> None:
                try:
                    await self.connect()
                finally:
                    self._reconnecting = None

            self._reconnecting = self._spawn(reconnect())
        return False

    def _failed(self, exc: BaseException) -> None:
        self._counts.error(exc)
        self._down_until = time.monotonic() + self._backoff
        log.warning("remote store error (backing off %.1f s): %s", self._backoff, exc)

    async def drain(self) -> None:
        """Wait for every put and get in flight. Cancellation: cancels only this wait.

        A task that has finished may stay in the set until its done callback runs on a later loop iteration;
        only unfinished tasks are waited for: from Python 3.12 on, ``gather`` of finished tasks completes
        without yielding to the loop, so waiting for the set to empty would spin forever.
        """
        while any(not task.done() for task in self._tasks):
            await asyncio.gather(*list(self._tasks), return_exceptions=True)

    async def close(self) -> None:
        """Wait for the copies in flight, then close the store client. Idempotent.

        Cancellation: the copies still complete; a later ``close()`` finishes the job.
        """
        await self.drain()
        if not self._closed:
            self._closed = True
            await self.store.close()

    # ------------------------------------------------------------------------------------ copies

    def put(self, src_tier: Tier | str, slots: Iterable[int] | np.ndarray, keys: Sequence[bytes]) -> RemoteTransfer:
        """Store blocks ``slots`` of ``src_tier`` as the objects of content keys ``keys``; returns at once.

        Objects are immutable: a key already in the store keeps its first value (same content key, same
        tokens, same KV), unless this tier found that value corrupted: then it is replaced.
        ``found[i]`` is ``True`` once block ``i`` is stored or was already there.

        Raises:
            ValueError, TypeError: unknown tier, indices out of range, keys not pairing up with slots.
            EngineClosedError: the tier or the engine is closed.

        Notes:
            The transfer fails with :class:`RemoteStoreError` when the store fails or times out; the blocks
            are then simply not in the store. Cancellation: cancelling an ``await`` of it cancels only the wait.
        """
        tier, pool, s, names = self._validate(src_tier, slots, keys)
        fence = Marker(None)
        done = Marker(None)
        transfer = RemoteTransfer(done, tier, Tier.REMOTE, len(names), len(names) * self.object_size)
        if not names:
            fence.complete()
            done.complete()
            return transfer
        if not self._usable():
            self._counts.blocks["put_dropped"] += len(names)
            done.error = RemoteStoreError(f"the remote store {self.store.url} is unavailable")
            done.complete()
            return transfer
        reads = [(pool.name, s)]
        deps = self.engine.fences.dependencies(reads, [])
        self.engine.fences.register(fence, reads, [])
        self._spawn(self._run_put(transfer, fence, deps, tier, pool, s, names))
        return transfer

    def get(self, keys: Sequence[bytes], dst_tier: Tier | str, slots: Iterable[int] | np.ndarray) -> RemoteTransfer:
        """Read the objects of ``keys`` into blocks ``slots`` of ``dst_tier``, verified; returns at once.

        ``found[i]`` tells whether block ``i`` was copied; a block not found (or not valid) is left untouched.

        Raises:
            ValueError, TypeError: unknown tier, indices out of range or duplicated, keys not pairing up.
            EngineClosedError: the tier or the engine is closed.

        Notes:
            The transfer fails with :class:`RemoteStoreError` when the store fails or times out (nothing was
            written). Cancellation: cancelling an ``await`` of it cancels only the wait.
        """
        tier, pool, d, names = self._validate(dst_tier, slots, keys)
        if len(set(d)) != len(d):
            raise ValueError("destination indices contain duplicates")
        if tier is not Tier.HOST and not isinstance(pool, BlockPool):
            raise ValueError("remote reads into a layer-major GPU pool are not supported; read into the host tier")
        done = Marker(None)
        transfer = RemoteTransfer(done, Tier.REMOTE, tier, len(names), len(names) * self.object_size)
        if not names:
            done.complete()
            return transfer
        if not self._usable():
            self._counts.blocks["miss"] += len(names)
            done.complete()  # a store that is away is a miss, not an error: the caller computes instead
            return transfer
        fence = Marker(None)
        writes = [(pool.name, d)]
        deps = self.engine.fences.dependencies([], writes)
        self.engine.fences.register(fence, [], writes)
        self._spawn(self._run_get(transfer, fence, deps, tier, pool, d, names))
        return transfer

    def _validate(
        self, tier_: Tier | str, slots: Iterable[int] | np.ndarray, keys: Sequence[bytes]
    ) -> tuple[Tier, Any, list[int], list[str]]:
        if self._closed:
            raise EngineClosedError("the remote tier is closed")
        if self.engine.closed:
            raise EngineClosedError("the remote tier's TransferEngine is closed")
        tier = Tier.coerce(tier_)
        if tier not in (Tier.GPU, Tier.HOST):
            raise ValueError(f"the remote tier copies to and from the gpu and host tiers, not {tier.value}")
        pool = self.engine.pool(tier)
        idx = as_indices(slots, "block indices")
        pool.check(idx, "block indices")
        if isinstance(keys, (bytes, str)):
            raise TypeError("keys must be a sequence of content keys (bytes), one per block")
        keys = list(keys)
        if len(keys) != idx.size:
            raise ValueError(f"got {idx.size} blocks and {len(keys)} keys; they must pair up")
        for k in keys:
            if not isinstance(k, (bytes, bytearray)) or not k:
                raise TypeError(f"a content key must be non-empty bytes, got {type(k).__name__}")
        return tier, pool, idx.tolist(), [object_name(self.rank, bytes(k)) for k in keys]

    # ------------------------------------------------------------------------------------ internals

    def _spawn(self, coro: Any) -> asyncio.Task[Any]:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def _finish(self, marker: Marker, error: BaseException | None = None) -> None:
        if error is not None and marker.error is None:
            marker.error = error
        marker.complete()

    def _release_fence(self, fence: Marker) -> None:
        if not fence.completed:
            self.engine.fences.release(fence)
            fence.complete()

    async def _run_put(
        self,
        transfer: RemoteTransfer,
        fence: Marker,
        deps: set[Marker],
        tier: Tier,
        pool: Any,
        slots: list[int],
        names: list[str],
    ) -> None:
        failure: BaseException | None = None
        try:
            for dep in deps:
                await dep.wait()
            await self._put_blocks(tier, pool, slots, names, transfer.found, lambda: self._release_fence(fence))
        except BaseException as exc:
            failure = exc
        self._release_fence(fence)
        self._finish(transfer._marker, failure)

    async def _put_blocks(
        self,
        tier: Tier,
        pool: Any,
        slots: list[int],
        names: list[str],
        found: list[bool],
        staged_all: Callable[[], None] | None = None,
    ) -> None:
        """Stage ``slots`` chunk by chunk and put each chunk (a round trip overlapping the next chunk's staging).

        ``staged_all()`` is called once every block is staged (or abandoned): the pool blocks are free again.
        Raises the first chunk's failure after every chunk has finished; ``found`` says what was stored.
        """
        puts: list[asyncio.Task[None]] = []
        staged = 0
        error: BaseException | None = None
        try:
            for start in range(0, len(names), self._chunk):
                chunk = slots[start : start + self._chunk]
                lease = await self._staging.acquire(len(chunk))
                try:
                    await self._staging.stage_out(tier, pool, chunk, lease.slots, names[start : start + len(chunk)])
                except BaseException:
                    self._staging.release(lease)
                    raise
                puts.append(self._spawn(self._put_chunk(found, names, start, lease)))
                staged += len(chunk)
        except BaseException as exc:
            error = exc
        finally:
            if staged_all is not None:
                staged_all()
        results = await asyncio.gather(*puts, return_exceptions=True)
        if error is not None:
            self._counts.blocks["put_dropped"] += len(names) - staged
        failure = error or next((r for r in results if isinstance(r, BaseException)), None)
        if failure is not None:
            raise failure

    async def _round_trip(self, what: str, lease: Lease, call: Callable[[], Awaitable[_R]]) -> _R:
        """One store call for the chunk staged in ``lease``: timed, counted, a failure backs the tier off.

        A timed-out call may still be using the staging slots: ``lease.pending`` keeps it, so that the slots
        go back only once it returns.
        """
        t0 = time.perf_counter()
        try:
            result = await call()
        except StoreTimeout as exc:
            lease.pending = exc.pending
            self._failed(exc)
            raise
        except RemoteStoreError as exc:
            self._failed(exc)
            raise
        self._counts.round_trip(what, time.perf_counter() - t0)
        return result

    async def _put_chunk(self, found: list[bool], names: list[str], start: int, lease: Lease) -> None:
        staging = lease.slots
        chunk_names = names[start : start + len(staging)]
        objs = [self._staging.array[i] for i in staging]
        try:
            if not self._usable():
                raise RemoteStoreError(f"the remote store {self.store.url} is unavailable")
            fix = [j for j, name in enumerate(chunk_names) if name in self._corrupt]
            ok: list[bool] = [False] * len(chunk_names)
            if len(fix) < len(chunk_names):
                keep = [j for j in range(len(chunk_names)) if j not in set(fix)]
                put = await self._round_trip(
                    "put", lease, lambda: self.store.put([chunk_names[j] for j in keep], [objs[j] for j in keep])
                )
                for j, good in zip(keep, put, strict=True):
                    ok[j] = good
            if fix:
                fix_names = [chunk_names[j] for j in fix]
                outcomes = await self._round_trip(
                    "put",
                    lease,
                    lambda: self.store.replace(
                        fix_names, [objs[j] for j in fix], [self._corrupt.expected(n) for n in fix_names]
                    ),
                )
                for j, outcome in zip(fix, outcomes, strict=True):
                    ok[j] = outcome is not None
                    self._counts.blocks["replaced_corrupt"] += outcome == REPLACED
            for j, good in enumerate(ok):
                found[start + j] = good
                if good:
                    self._corrupt.forget(chunk_names[j])
            stored = sum(ok)
            self._counts.blocks["put"] += stored
            self._counts.blocks["put_dropped"] += len(ok) - stored
            self._counts.bytes["put"] += stored * self.object_size
        except BaseException:
            self._counts.blocks["put_dropped"] += sum(1 for j in range(len(staging)) if not found[start + j])
            raise
        finally:
            self._staging.release_later(lease)

    async def _run_get(
        self,
        transfer: RemoteTransfer,
        fence: Marker,
        deps: set[Marker],
        tier: Tier,
        pool: BlockPool,
        slots: list[int],
        names: list[str],
    ) -> None:
        failure: BaseException | None = None
        try:
            await self._get_blocks(tier, pool, slots, names, transfer.found, deps)
        except BaseException as exc:
            failure = exc
            transfer.found = [False] * len(names)  # a failed transfer serves nothing, even chunks that landed
        self._release_fence(fence)
        self._finish(transfer._marker, failure)

    async def _get_blocks(
        self,
        tier: Tier,
        pool: BlockPool,
        slots: list[int],
        names: list[str],
        found: list[bool],
        deps: Iterable[Marker] = (),
    ) -> None:
        """Read, verify and copy in every chunk concurrently (after ``deps``); raises the first failure."""
        deps = list(deps)
        results = await asyncio.gather(
            *(
                self._get_chunk(found, deps, tier, pool, slots, names, start)
                for start in range(0, len(names), self._chunk)
            ),
            return_exceptions=True,
        )
        failure = next((r for r in results if isinstance(r, BaseException)), None)
        if failure is not None:
            raise failure

    async def _get_chunk(
        self,
        found: list[bool],
        deps: list[Marker],
        tier: Tier,
        pool: BlockPool,
        slots: list[int],
        names: list[str],
        start: int,
    ) -> None:
        chunk_names = names[start : start + self._chunk]
        lease = await self._staging.acquire(len(chunk_names))
        staging = lease.slots
        try:
            if not self._usable():
                self._counts.blocks["miss"] += len(chunk_names)
                return
            objs = [self._staging.array[i] for i in staging]
            sizes = await self._round_trip("get", lease, lambda: self.store.get(chunk_names, objs))
            length = self.layout.bytes_per_block
            codes = sorted({size for size in sizes if size < 0 and size != MISSING})
            if codes:  # a store that answers with error codes is failing: a miss now, and back off
                self._failed(RemoteStoreError(f"{self.store.url} answered error codes {codes} for a get"))

            digests: dict[str, str | None] = {}  # the corrupted objects' SHA-1 (None: not of an object's size)

            def verify_all() -> list[str | None]:  # a worker thread: checksums off the event loop
                out: list[str | None] = []
                for name, size, i in zip(chunk_names, sizes, staging, strict=True):
                    if size < 0:
                        out.append(None)
                        continue
                    v = verify_object(
                        self._staging.array[i][:size] if size <= self.object_size else b"",
                        self._fingerprint,
                        self.rank,
                        name,
                        length,
                    )
                    out.append(v if isinstance(v, str) else "")
                    if isinstance(v, str):
                        digests[name] = digest(self._staging.array[i]) if size == self.object_size else None
                return out

            verdicts = await asyncio.get_running_loop().run_in_executor(None, verify_all)
            good_staging: list[int] = []
            good_slots: list[int] = []
            for j, (name, verdict, i) in enumerate(zip(chunk_names, verdicts, staging, strict=True)):
                if verdict is None:
                    self._counts.blocks["miss"] += 1
                    continue
                if verdict:
                    self._counts.blocks["bad"] += 1
                    self._counts.bad[verdict] = self._counts.bad.get(verdict, 0) + 1
                    self._corrupt.found(name, digests[name], verdict)
                    continue
                self._corrupt.forget(name)
                good_staging.append(i)
                good_slots.append(slots[start + j])
                found[start + j] = True
            for dep in deps:
                await dep.wait()
            if good_slots:
                await self._staging.stage_in(tier, pool, good_slots, good_staging)
            self._counts.blocks["get"] += len(good_slots)
            self._counts.bytes["get"] += len(good_slots) * self.object_size
        finally:
            self._staging.release_later(lease)

    # ------------------------------------------------------------------------------------ inspection

    def statistics(self) -> RemoteStatistics:
        """A snapshot of the counters (see :class:`RemoteStatistics`)."""
        return self._counts.snapshot(str(self.store.url), self.store.kind, self.available)

    def __repr__(self) -> str:
        state = "closed" if self._closed else ("available" if self.available else "unavailable")
        return f"<RemoteTier {self.store.url} rank={self.rank} [{state}, in_flight:{len(self._tasks)}]>"
