"""``RemoteTier``: fenced, batched, verified copies between an engine's pools and a distributed store.

Primitives:

* :class:`RemoteTier` -- over a :class:`~tiered_kv.TransferEngine` and a store client
  (:mod:`tiered_kv.remote.stores`): ``put(src_tier, slots, keys)`` and ``get(keys, dst_tier, slots)``, each
  returning at once a :class:`RemoteTransfer` (an engine :class:`~tiered_kv.Transfer`, awaitable, with the
  engine's per-block fences on the pool side), ``connect()``, ``statistics()``, ``close()``.
* :class:`RemoteTransfer` -- a transfer with ``found``: per block, whether a verified object was copied.
* :class:`RemoteStatistics`.

Data path: every object goes through a pinned staging area registered with the store (zero-copy for
Mooncake). ``put`` reads the pool blocks under read fences (GPU blocks on the engine's offload stream, so
after compute the engine was told about), releases the fences as soon as the bytes are staged, writes the
slot header (:mod:`tiered_kv.remote.objects`) and stores the batch in one round trip. ``get`` reads the batch
in one round trip into staging, verifies every object (header, layout fingerprint, rank, name, length,
xxh3-128 checksum) and only then copies verified payloads into the destination blocks under write fences
(GPU blocks on the onboard stream). A batch larger than half the staging area is split into chunks that run
concurrently (the network round trip of one chunk overlaps the staging copies of the next).

Failure model: a missing object, one that fails verification or a lease that expired mid-read is a *miss*
(``found[i] = False``; the destination block is left untouched). A store error or timeout fails the whole
transfer with :class:`~tiered_kv.errors.RemoteStoreError` (destination blocks untouched). After a failure the
tier stays away from the store for ``backoff`` seconds (gets answer "miss" at once, puts are dropped), then
tries again: requests are never stalled behind a dead or hung store for more than one timeout.
"""

from __future__ import annotations

import asyncio
import bisect
import concurrent.futures
import dataclasses
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np
import torch

from ..engine import LATENCY_BUCKETS, Transfer, TransferEngine
from ..errors import EngineClosedError, RemoteStoreError
from ..fences import Marker
from ..pools import BlockPool, Tier, as_indices
from ..slab import HEADER_SIZE
from .objects import encode_object, object_name, object_size, verify_object
from .stores import MISSING, RemoteStore, StoreTimeout, open_store
from .url import StoreURL

__all__ = ["RemoteStatistics", "RemoteTier", "RemoteTransfer"]

log = logging.getLogger(__name__)


class RemoteTransfer(Transfer):
    """A :class:`~tiered_kv.Transfer` to or from the store; ``found[i]``: block ``i`` was copied (verified)."""

    __slots__ = ("found",)

    def __init__(self, marker: Marker, src_tier: Tier, dst_tier: Tier, num_blocks: int, nbytes: int) -> None:
        super().__init__(marker, src_tier, dst_tier, num_blocks, nbytes)
        self.found: list[bool] = [False] * num_blocks


@dataclasses.dataclass(frozen=True, slots=True)
class RemoteStatistics:
    """A snapshot of a :class:`RemoteTier`.

    Attributes:
        url: the store (no password). kind: ``"redis"`` or ``"mooncake"``.
        available: connected and not backing off after a failure.
        batches: ``"get"``/``"put"`` -> store round trips.
        blocks: ``"get"`` (verified objects copied), ``"miss"`` (absent), ``"bad"`` (failed verification),
            ``"put"`` (stored or already present), ``"put_dropped"`` (not stored: store away, error, full).
        bytes: ``"get"``/``"put"`` -> object bytes moved.
        errors: store errors and timeouts; ``timeouts`` of them timeouts.
        seconds: ``"get"``/``"put"`` -> summed batch latency; ``latency_counts`` per :data:`LATENCY_BUCKETS`.
        bad_reasons: verification failure reason -> count.
    """

    url: str
    kind: str
    available: bool
    batches: dict[str, int]
    blocks: dict[str, int]
    bytes: dict[str, int]
    errors: int
    timeouts: int
    seconds: dict[str, float]
    latency_counts: dict[str, tuple[int, ...]]
    bad_reasons: dict[str, int]


class _Staging:
    """A pinned (on CUDA) uint8 area of ``n`` object-sized slots, registered with the store; slots are leased."""

    def __init__(self, n: int, size: int, pinned: bool) -> None:
        self.tensor = torch.empty((n, size), dtype=torch.uint8, pin_memory=pinned)
        self.array = self.tensor.numpy()
        self.free = list(range(n - 1, -1, -1))
        self.n = n
        self._cond: asyncio.Condition | None = None

    async def acquire(self, k: int) -> list[int]:
        if self._cond is None:
            self._cond = asyncio.Condition()
        async with self._cond:
            await self._cond.wait_for(lambda: len(self.free) >= k)
            return [self.free.pop() for _ in range(k)]

    def release(self, slots: list[int]) -> None:
        """Give slots back (event-loop thread only)."""
        self.free.extend(slots)
        cond = self._cond
        if cond is not None:
            async def wake() -> None:
                async with cond:
                    cond.notify_all()

            asyncio.get_running_loop().create_task(wake())


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
        self._staging = _Staging(staging_blocks, self.object_size, engine.device.is_cuda)
        self.store.register(self._staging.array)
        self._chunk = max(1, staging_blocks // 2)
        self._backoff = float(backoff)
        self._connected = False
        self._down_until = 0.0
        self._reconnecting: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._closed = False
        self._batches = {"get": 0, "put": 0}
        self._blocks = {"get": 0, "miss": 0, "bad": 0, "put": 0, "put_dropped": 0}
        self._bytes = {"get": 0, "put": 0}
        self._seconds = {"get": 0.0, "put": 0.0}
        self._latency = {"get": [0] * (len(LATENCY_BUCKETS) + 1), "put": [0] * (len(LATENCY_BUCKETS) + 1)}
        self._bad: dict[str, int] = {}
        self._errors = self._timeouts = 0
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
        self._errors += 1
        if isinstance(exc, StoreTimeout):
            self._timeouts += 1
        self._down_until = time.monotonic() + self._backoff
        log.warning("remote store error (backing off %.1f s): %s", self._backoff, exc)

    async def drain(self) -> None:
        """Wait for every put and get in flight. Cancellation: cancels only this wait."""
        while self._tasks:
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
        tokens, same KV). ``found[i]`` is ``True`` once block ``i`` is stored or was already there.

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
            self._blocks["put_dropped"] += len(names)
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
            self._blocks["miss"] += len(names)
            done.complete()  # a store that is away is a miss, not an error: the caller computes instead
            return transfer
        fence = Marker(None)
        writes = [(pool.name, d)]
        deps = self.engine.fences.dependencies([], writes)
        self.engine.fences.register(fence, [], writes)
        self._spawn(self._run_get(transfer, fence, deps, tier, pool, d, names))
        return transfer

    def _validate(self, tier_: Tier | str, slots: Iterable[int] | np.ndarray, keys: Sequence[bytes]) -> tuple[Tier, Any, list[int], list[str]]:
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

    def _payload(self, i: int) -> torch.Tensor:
        """Staging slot ``i``'s payload as a block-shaped tensor."""
        return self._staging.tensor[i, HEADER_SIZE:].view(self.layout.dtype).view(self.layout.block_shape)

    async def _on_lane(self, lane_name: str, fn: Callable[[], None]) -> None:
        """Run ``fn`` on an engine stream (after the work queued there) and wait for it without blocking the loop."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()
        error: list[BaseException] = []

        def run() -> None:
            try:
                fn()
            except BaseException as exc:
                error.append(exc)

        def resolve() -> None:
            if not fut.done():
                fut.set_result(None)

        def finished() -> None:
            loop.call_soon_threadsafe(resolve)

        lane = self.engine.stream(lane_name)
        lane.submit(run)
        lane.notify(finished)
        await fut
        if error:
            raise error[0]

    def _encode(self, staging: list[int], names: list[str]) -> None:
        """Write the headers (payload checksums) of staged objects (a worker thread: off the event loop)."""
        for i, name in zip(staging, names, strict=True):
            obj = self._staging.array[i]
            encode_object(obj, self._fingerprint, self.rank, name, obj[HEADER_SIZE:])

    async def _stage_out(self, tier: Tier, pool: Any, slots: list[int], staging: list[int], names: list[str]) -> None:
        """Copy pool blocks into staging and write their headers (GPU: copy on the offload stream; host: a worker)."""
        loop = asyncio.get_running_loop()
        if tier is Tier.GPU:
            def copy() -> None:
                for src, i in zip(slots, staging, strict=True):
                    block = pool.tensor[src] if isinstance(pool, BlockPool) else pool.block(src)
                    self._payload(i).copy_(block, non_blocking=True)

            await self._on_lane("offload", copy)
            await loop.run_in_executor(None, self._encode, staging, names)
        else:
            def host_copy() -> None:
                for src, i in zip(slots, staging, strict=True):
                    self._payload(i).copy_(pool.tensor[src])
                self._encode(staging, names)

            await loop.run_in_executor(None, host_copy)

    async def _stage_in(self, tier: Tier, pool: BlockPool, slots: list[int], staging: list[int]) -> None:
        """Copy verified staging payloads into pool blocks (GPU: on the onboard stream)."""
        def copy() -> None:
            for dst, i in zip(slots, staging, strict=True):
                pool.tensor[dst].copy_(self._payload(i), non_blocking=tier is Tier.GPU)

        if tier is Tier.GPU:
            await self._on_lane("onboard", copy)
        else:
            await asyncio.get_running_loop().run_in_executor(None, copy)

    def _finish(self, marker: Marker, error: BaseException | None = None) -> None:
        if error is not None and marker.error is None:
            marker.error = error
        marker.complete()

    def _release_fence(self, fence: Marker) -> None:
        if not fence.completed:
            self.engine.fences.release(fence)
            fence.complete()

    def _count_latency(self, what: str, seconds: float) -> None:
        self._batches[what] += 1
        self._seconds[what] += seconds
        self._latency[what][bisect.bisect_left(LATENCY_BUCKETS, seconds)] += 1

    def _release_later(self, staging: list[int], pending: concurrent.futures.Future[Any] | None) -> None:
        """Give staging slots back, or -- when a timed-out store call still uses them -- once it returns."""
        if pending is None or pending.done():
            self._staging.release(staging)
            return
        loop = asyncio.get_running_loop()
        pending.add_done_callback(lambda _: loop.call_soon_threadsafe(self._staging.release, staging))

    async def _run_put(self, transfer: RemoteTransfer, fence: Marker, deps: set[Marker], tier: Tier, pool: Any,
                       slots: list[int], names: list[str]) -> None:
        failure: BaseException | None = None
        try:
            for dep in deps:
                await dep.wait()
            await self._put_blocks(tier, pool, slots, names, transfer.found, lambda: self._release_fence(fence))
        except BaseException as exc:
            failure = exc
        self._release_fence(fence)
        self._finish(transfer._marker, failure)

    async def _put_blocks(self, tier: Tier, pool: Any, slots: list[int], names: list[str], found: list[bool],
                          staged_all: Callable[[], None] | None = None) -> None:
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
                staging = await self._staging.acquire(len(chunk))
                try:
                    await self._stage_out(tier, pool, chunk, staging, names[start : start + len(chunk)])
                except BaseException:
                    self._staging.release(staging)
                    raise
                puts.append(self._spawn(self._put_chunk(found, names, start, staging)))
                staged += len(chunk)
        except BaseException as exc:
            error = exc
        finally:
            if staged_all is not None:
                staged_all()
        results = await asyncio.gather(*puts, return_exceptions=True)
        if error is not None:
            self._blocks["put_dropped"] += len(names) - staged
        failure = error or next((r for r in results if isinstance(r, BaseException)), None)
        if failure is not None:
            raise failure

    async def _put_chunk(self, found: list[bool], names: list[str], start: int, staging: list[int]) -> None:
        chunk_names = names[start : start + len(staging)]
        objs = [self._staging.array[i] for i in staging]
        pending = None
        try:
            if not self._usable():
                raise RemoteStoreError(f"the remote store {self.store.url} is unavailable")
            t0 = time.perf_counter()
            try:
                ok = await self.store.put(chunk_names, objs)
            except StoreTimeout as exc:
                pending = exc.pending
                self._failed(exc)
                raise
            except RemoteStoreError as exc:
                self._failed(exc)
                raise
            self._count_latency("put", time.perf_counter() - t0)
            for j, good in enumerate(ok):
                found[start + j] = good
            stored = sum(ok)
            self._blocks["put"] += stored
            self._blocks["put_dropped"] += len(ok) - stored
            self._bytes["put"] += stored * self.object_size
        except BaseException:
            self._blocks["put_dropped"] += sum(1 for j in range(len(staging)) if not found[start + j])
            raise
        finally:
            self._release_later(staging, pending)

    async def _run_get(self, transfer: RemoteTransfer, fence: Marker, deps: set[Marker], tier: Tier, pool: BlockPool,
                       slots: list[int], names: list[str]) -> None:
        failure: BaseException | None = None
        try:
            await self._get_blocks(tier, pool, slots, names, transfer.found, deps)
        except BaseException as exc:
            failure = exc
            transfer.found = [False] * len(names)  # a failed transfer serves nothing, even chunks that landed
        self._release_fence(fence)
        self._finish(transfer._marker, failure)

    async def _get_blocks(self, tier: Tier, pool: BlockPool, slots: list[int], names: list[str], found: list[bool],
                          deps: Iterable[Marker] = ()) -> None:
        """Read, verify and copy in every chunk concurrently (after ``deps``); raises the first failure."""
        deps = list(deps)
        results = await asyncio.gather(*(self._get_chunk(found, deps, tier, pool, slots, names, start)
                                         for start in range(0, len(names), self._chunk)), return_exceptions=True)
        failure = next((r for r in results if isinstance(r, BaseException)), None)
        if failure is not None:
            raise failure

    async def _get_chunk(self, found: list[bool], deps: list[Marker], tier: Tier, pool: BlockPool, slots: list[int],
                         names: list[str], start: int) -> None:
        chunk_names = names[start : start + self._chunk]
        staging = await self._staging.acquire(len(chunk_names))
        pending = None
        try:
            if not self._usable():
                self._blocks["miss"] += len(chunk_names)
                return
            objs = [self._staging.array[i] for i in staging]
            t0 = time.perf_counter()
            try:
                sizes = await self.store.get(chunk_names, objs)
            except StoreTimeout as exc:
                pending = exc.pending
                self._failed(exc)
                raise
            except RemoteStoreError as exc:
                self._failed(exc)
                raise
            self._count_latency("get", time.perf_counter() - t0)
            length = self.layout.bytes_per_block
            codes = sorted({size for size in sizes if size < 0 and size != MISSING})
            if codes:  # a store that answers with error codes is failing: a miss now, and back off
                self._failed(RemoteStoreError(f"{self.store.url} answered error codes {codes} for a get"))

            def verify_all() -> list[str | None]:  # a worker thread: checksums off the event loop
                out: list[str | None] = []
                for name, size, i in zip(chunk_names, sizes, staging, strict=True):
                    if size < 0:
                        out.append(None)
                        continue
                    v = verify_object(self._staging.array[i][:size] if size <= self.object_size else b"",
                                      self._fingerprint, self.rank, name, length)
                    out.append(v if isinstance(v, str) else "")
                return out

            verdicts = await asyncio.get_running_loop().run_in_executor(None, verify_all)
            good_staging: list[int] = []
            good_slots: list[int] = []
            for j, (name, verdict, i) in enumerate(zip(chunk_names, verdicts, staging, strict=True)):
                if verdict is None:
                    self._blocks["miss"] += 1
                    continue
                if verdict:
                    self._blocks["bad"] += 1
                    self._bad[verdict] = self._bad.get(verdict, 0) + 1
                    log.warning("remote object %s failed verification (%s): treated as a miss", name, verdict)
                    continue
                good_staging.append(i)
                good_slots.append(slots[start + j])
                found[start + j] = True
            for dep in deps:
                await dep.wait()
            if good_slots:
                await self._stage_in(tier, pool, good_slots, good_staging)
            self._blocks["get"] += len(good_slots)
            self._bytes["get"] += len(good_slots) * self.object_size
        finally:
            self._release_later(staging, pending)

    # ------------------------------------------------------------------------------------ inspection

    def statistics(self) -> RemoteStatistics:
        """A snapshot of the counters (see :class:`RemoteStatistics`)."""
        url = self.store.url
        return RemoteStatistics(
            url=str(url), kind=self.store.kind, available=self.available, batches=dict(self._batches),
            blocks=dict(self._blocks), bytes=dict(self._bytes), errors=self._errors, timeouts=self._timeouts,
            seconds=dict(self._seconds), latency_counts={k: tuple(v) for k, v in self._latency.items()},
            bad_reasons=dict(self._bad),
        )

    def __repr__(self) -> str:
        state = "closed" if self._closed else ("available" if self.available else "unavailable")
        return f"<RemoteTier {self.store.url} rank={self.rank} [{state}, in_flight:{len(self._tasks)}]>"

