"""The transfer engine: ``await engine.copy(...)`` between GPU, pinned host and file tiers.

Primitives:

* :class:`TransferEngine` -- owns the memory pools, the copy streams, the fence table and the routing table
  of transfer handlers; ``copy()`` returns a :class:`~tiered_kv.transfer.Transfer` at once (the copy is
  enqueued, or deferred until a loop-side dependency completes).
* :class:`~tiered_kv.transfer.Transfer`, :class:`~tiered_kv.transfer.TransferResult`,
  :class:`~tiered_kv.transfer.EngineStatistics` -- re-exported from :mod:`tiered_kv.transfer`.

What the engine does for every copy, whatever the media: validation of the public arguments, fences
(:mod:`tiered_kv.fences`), completion markers, statistics, cancellation semantics. What moves the bytes is
the handler routed to ``(source tier, destination tier)`` (:mod:`tiered_kv.handlers`, which documents the
protocol): :class:`~tiered_kv.stream_copier.StreamCopier` for the memory pairs (GPU->HOST on the *offload*
stream, HOST->GPU on the *onboard* stream, GPU->GPU on the *local* stream, HOST->HOST on host threads) and
:class:`~tiered_kv.file.FileHandler` for anything with FILE (its GPU legs on offload/onboard). Every op
first waits for its fences: stream-side (``wait_event``, no CPU block, no GPU bubble) when the dependency
is a stream op already enqueued, otherwise on the loop. Completion reaches the loop through a waiter
thread per stream (or the handler's callback) and ``call_soon_threadsafe`` (the loop never polls), batched by
:class:`~tiered_kv.completions.CompletionInbox`: completions that arrive together wake the loop once.

The per-call fast path: a copy between memory pools of at most ``SMALL_CALL_BLOCKS`` pairs given as int
lists or small integer arrays is validated on plain lists (:func:`~tiered_kv.pools.small_pairs`, no numpy)
and becomes one ``copy_blocks_list`` call on its stream (:mod:`tiered_kv.copyops`).

Size: about 800 lines (formatted at 120 columns), much of it the public API's documentation and the lifecycle
rules (ownership by a cache, close from another loop, release on failed construction); the copy path itself
(validate, route, fence, start, complete) is kept in one class so the fence and marker life cycle reads in one
place.
"""

from __future__ import annotations

import asyncio
import bisect
import functools
import logging
import os
import time
import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import NoReturn

import numpy as np
import torch

from .completions import CompletionInbox, EventPoller
from .config import EngineConfig
from .copyops import Copier
from .device import CudaStream, Device, Stream, expected_end, resolve_device
from .errors import EngineClosedError, OwnedEngineError, TransferError
from .fences import FenceTable, Marker
from .file import FileHandler, FileTier, FileTierConfig
from .handlers import Batch, Job, Medium, Routes, TransferHandler
from .layer_major import LayerMajorPool
from .layout import KVLayout
from .pool_kinds import as_gpu_pool
from .pools import BlockPool, Tier, as_indices, small_pairs
from .stream_copier import StreamCopier
from .transfer import LATENCY_BUCKETS, EngineStatistics, Transfer, TransferResult

__all__ = ["LATENCY_BUCKETS", "EngineStatistics", "Transfer", "TransferEngine", "TransferResult"]

log = logging.getLogger(__name__)

# a resolved pair: source and destination tier and medium, its handler, whether it is a memory pair, "src->dst"
_Route = tuple[Tier, Tier, Medium, Medium, TransferHandler, bool, str]


class _DirectionTotals:
    """What the copies of one direction did so far (mutable: updated in place on every completion)."""

    __slots__ = ("blocks", "counts", "nbytes", "seconds")

    def __init__(self) -> None:
        self.nbytes = 0
        self.blocks = 0
        self.seconds = 0.0
        self.counts = [0] * (len(LATENCY_BUCKETS) + 1)


#: Seconds ``close()`` from a new event loop waits for copies the engine's ended loop left in flight.
ORPHAN_TIMEOUT = 30.0

#: ``EngineConfig.completion_spin_us`` on CUDA when not set: the loop polls an awaited copy from 0.4 ms before its
#: expected end to 0.2 ms after it.
_DEFAULT_SPIN_US = 200

#: ``EngineConfig.await_spin_us`` on CUDA when not set: an awaited copy expected to end within 150 us is waited for
#: in place by the awaiting coroutine (a 12-of-16-token partial copy of 128 blocks runs ~150 us on an H100).
_DEFAULT_AWAIT_SPIN_US = 150

#: An awaited copy expected to end more than this many seconds from now lets the in-place poll first do the
#: bookkeeping of the copies completed before it (``_settle``), so that it is the oldest copy in flight when it ends.
_SETTLE_AHEAD = 20e-6

Indices = Iterable[int] | np.ndarray | torch.Tensor


def _ok_at_event(marker: Marker) -> bool:
    """Whether reaching ``marker``'s event is its whole completion (its job's ``ok_at_event``; no job: no)."""
    ok_at_event = getattr(marker.job, "ok_at_event", None)
    return ok_at_event is not None and bool(ok_at_event())


def _launch_error(marker: Marker) -> BaseException | None:
    """The error a stream op whose event was reached will report, if its job says so (``Job.error_at_event``)."""
    if _ok_at_event(marker):
        return None
    error_at_event = getattr(marker.job, "error_at_event", None)
    return error_at_event() if error_at_event is not None else None


def _failed_source(marker: Marker) -> BaseException | None:
    """The error for ``marker`` if an op that was writing a block it reads, when it was issued, failed.

    Such a copy reads bytes that never arrived: it fails too, and so does every copy that reads what it wrote. An op
    it waited for only because it writes what that op read or wrote is not its source: that one's failure is not its.
    """
    for source in marker.sources:
        error = source.error
        if error is not None and source.completed:
            failed = TransferError(f"a copy this one reads from failed: {error}")
            failed.__cause__ = error
            return failed
    return None


def _allocate(
    empty: Callable[[tuple[int, ...], torch.dtype], torch.Tensor], what: str, blocks: int, layout: KVLayout
) -> torch.Tensor:
    nbytes = blocks * layout.bytes_per_block
    if nbytes >= 2**62:
        raise ValueError(f"{what} pool of {blocks} blocks ({nbytes} bytes) is larger than any machine's memory")
    try:
        return empty((blocks, *layout.block_shape), layout.dtype)
    except (RuntimeError, MemoryError) as exc:  # torch reports allocation failures as RuntimeError
        raise MemoryError(
            f"cannot allocate the {what} pool: {blocks} blocks x {layout.bytes_per_block} bytes = "
            f"{nbytes / 2**30:.1f} GiB ({exc})"
        ) from exc


class TransferEngine:
    """Schedules fenced copies between GPU and host pools (and the file tier, where configured).

    Args:
        layout: block geometry shared by every pool.
        gpu_blocks: blocks in the GPU pool (ignored if ``gpu_pool`` is given).
        host_blocks: blocks in the host pool (pinned on CUDA).
        gpu_pool: an existing GPU pool to use in place: a block-major tensor ``[blocks, *layout.block_shape]``,
            a :class:`~tiered_kv.LayerMajorPool` (or a :mod:`~tiered_kv.pool_kinds` pool), or a list of per-layer
            tensors as engines keep them (see :func:`tiered_kv.pool_kinds.as_gpu_pool`).
        device: ``"auto"``, ``"cpu"`` (emulated), ``"cuda[:N]"``; overrides ``config.device``.
        config: engine knobs; default :meth:`EngineConfig.from_env`.
        host_pool: an existing host pool tensor ``[blocks, *layout.block_shape]`` to use in place of
            ``host_blocks`` (e.g. a shared-memory mapping; it must be pinned when the device is CUDA).
        file_dir: directory of the file tier's slab (with ``file_blocks``; knobs from the environment).
        file_blocks: slots in the file tier.
        file_config: the file tier's full configuration (instead of ``file_dir``/``file_blocks``).
        handlers: more transfer handlers (:mod:`tiered_kv.handlers`), each with the media it owns and the
            pairs it routes: a new tier is one handler. A pair or medium claimed twice is a ``ValueError``.

    Use it as an async context manager (``async with TransferEngine(...) as engine``) or call
    :meth:`close`. All copies must be made from one event loop (the first one that uses it).

    Example::

        async with TransferEngine(layout, gpu_blocks=64, host_blocks=256) as engine:
            await engine.copy(Tier.GPU, [0, 1], Tier.HOST, [10, 11])   # offload
            await engine.copy(Tier.HOST, [10], Tier.GPU, [5])          # onboard
    """

    def __init__(
        self,
        layout: KVLayout,
        *,
        gpu_blocks: int = 0,
        host_blocks: int = 0,
        gpu_pool: torch.Tensor | LayerMajorPool | list[torch.Tensor] | tuple[torch.Tensor, ...] | None = None,
        device: str | torch.device | None = None,
        config: EngineConfig | None = None,
        file_dir: str | os.PathLike[str] | None = None,
        file_blocks: int = 0,
        file_config: FileTierConfig | None = None,
        handlers: Sequence[TransferHandler] = (),
        host_pool: torch.Tensor | None = None,
    ) -> None:
        if not isinstance(layout, KVLayout):
            raise TypeError(f"layout must be a KVLayout, got {type(layout).__name__}")
        for name, value in (("gpu_blocks", gpu_blocks), ("host_blocks", host_blocks)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name} must be an int, got {type(value).__name__}")
            if value < 0:
                raise ValueError(f"{name} must be >= 0, got {value}")
        self.config = config if config is not None else EngineConfig.from_env()
        self.device: Device = resolve_device(device if device is not None else self.config.device)
        self.layout = layout

        self._pools: dict[Tier, BlockPool | LayerMajorPool] = {}
        if gpu_pool is not None:
            if isinstance(gpu_pool, (list, tuple)):
                gpu_pool = as_gpu_pool(layout, gpu_pool)  # classic layer-major, or an engine's layout kind
            if not isinstance(gpu_pool, (torch.Tensor, LayerMajorPool)):
                raise TypeError(
                    "gpu_pool must be a torch.Tensor, a LayerMajorPool or a list of tensors, "
                    f"got {type(gpu_pool).__name__}"
                )
            if gpu_pool.device.type != self.device.torch_device.type:
                raise ValueError(
                    f"gpu_pool is on {gpu_pool.device}, but the engine's device is {self.device.torch_device}"
                )
            if isinstance(gpu_pool, LayerMajorPool):
                if gpu_pool.layout != layout or gpu_pool.tier is not Tier.GPU:
                    raise ValueError("the LayerMajorPool must be a GPU pool with the engine's layout")
                self._pools[Tier.GPU] = gpu_pool
            else:
                self._pools[Tier.GPU] = BlockPool(Tier.GPU, layout, gpu_pool)
        elif gpu_blocks:
            self._pools[Tier.GPU] = BlockPool(Tier.GPU, layout, _allocate(self.device.empty, "GPU", gpu_blocks, layout))
        if host_pool is not None:  # caller's memory (e.g. shared with another process); pinned on CUDA
            self._pools[Tier.HOST] = BlockPool(Tier.HOST, layout, host_pool)
        elif host_blocks:
            self._pools[Tier.HOST] = BlockPool(
                Tier.HOST, layout, _allocate(self.device.empty_host, "host", host_blocks, layout)
            )

        if file_config is None and file_dir is not None and file_blocks:
            file_config = FileTierConfig.from_env(file_dir, file_blocks)
        elif file_config is None and (file_dir is not None or file_blocks):
            raise ValueError("give both file_dir and file_blocks (or file_config) to have a file tier")
        file_tier = FileTier(layout, file_config, device=self.device) if file_config is not None else None

        self._streams: dict[str, Stream] = {}
        try:
            self.copier = Copier(self.device, self.config)  # DMA-or-kernel choice per call (tiered_kv.copyops)
            for name in ("offload", "onboard", "local"):
                self._streams[name] = self.device.new_stream(name)
        except BaseException:
            # a failed constructor leaves no thread, fd or slab lock behind
            for stream in self._streams.values():
                stream.close()
            if file_tier is not None:
                file_tier.close()
            raise
        # The routing table: every (source tier, destination tier) pair has exactly one handler.
        self._routes = Routes(owned=self._pools)
        builtin: list[TransferHandler] = [
            StreamCopier(self._pools, self._streams, self.copier, self.config.host_threads)
        ]
        if file_tier is not None:
            builtin.append(FileHandler(file_tier, self._pools, self._streams, self.copier))
        try:
            for handler in (*builtin, *handlers):
                self._routes.add(handler)
        except BaseException:
            for handler in builtin:
                handler.close()
            for stream in self._streams.values():
                stream.close()
            raise
        self._media: dict[Tier, Medium] = {**self._pools, **self._routes.media}
        self._resolved: dict[tuple[Tier | str, Tier | str], _Route] = {}  # see _resolve_route
        self._block_bytes = layout.bytes_per_block
        self._tokens_per_block = layout.tokens_per_block
        self._fences = FenceTable()
        # in-flight marker -> ("src->dst" direction, its transfer): one dict for the in-flight set and the statistics
        self._inflight: dict[Marker, tuple[str, Transfer]] = {}
        # The engine owns its deferred enqueues (copies waiting on the loop for an off-lane dependency): each
        # task leaves this set when it ends, and close() waits for the set to empty before stopping anything.
        self._deferred: set[asyncio.Task[None]] = set()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._inbox: CompletionInbox[Marker] | None = None
        self._poller: EventPoller[Marker] | None = None  # the loop-side poll of awaited copies about to end
        self._await_spin = 0.0  # seconds an awaiting coroutine polls in place (EngineConfig.await_spin_us)
        self._in_place = 0  # awaits that found their copy done before yielding (one look, or the in-place poll)
        self._settle_queued = False  # a _settle is queued on the loop (the in-place poll queues one per round)
        self._closing = False
        self._closed = False
        self._owner: str | None = None  # who the blocks belong to (claim): copy() is theirs alone
        self._submitted = self._completed = self._failed = 0
        self._settling: list[Marker] = []  # completed, awaiters woken, bookkeeping still to do (_settle)
        # direction -> [bytes, blocks, summed copy durations, counts per LATENCY_BUCKETS bucket (+ overflow)]:
        # one lookup per completion
        self._by_direction: dict[str, _DirectionTotals] = {}

    # ------------------------------------------------------------------------------------ lifecycle

    async def __aenter__(self) -> TransferEngine:
        self._bind_loop()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def drain(self) -> None:
        """Wait until every copy submitted so far has completed.

        Cancellation: cancels only the wait; the copies still complete.
        """
        self._settle()
        while self._inflight:
            await next(iter(self._inflight)).wait()
            self._settle()

    async def close(self) -> None:
        """Wait for every queued copy, then stop the streams' threads and the host threads.

        Idempotent. After it returns no thread, stream callback or fence of this engine is left.

        Cancellation: if cancelled while waiting, the engine stays closing (no new copies) and a later
        ``close()`` finishes the job.
        """
        if self._closed:
            return
        self._closing = True
        loop = asyncio.get_running_loop()
        if self._loop is not None and self._loop is not loop:
            if self._loop.is_running():
                raise RuntimeError(
                    "this TransferEngine is bound to an event loop that is still running in another "
                    "thread; close it from that loop (run_coroutine_threadsafe(engine.close(), loop))"
                )
            await self._take_over_completions()  # its loop ended: nobody else will hear of these copies
        else:
            await self.drain()
            if self._deferred:  # ended once their markers completed; wait for their last step too
                await asyncio.wait(set(self._deferred))
        self._settle()
        self._release_resources()
        assert not self._fences, "fences left after every op completed"

    async def _take_over_completions(self) -> None:
        """close() from a new loop after the engine's loop ended with copies in flight.

        A copy that finished on its thread posted its completion to the dead loop, where it never ran: complete
        it here (dependencies first, as always). A copy that never finished within ``ORPHAN_TIMEOUT`` seconds
        (deferred on the dead loop, never enqueued) is completed with :class:`EngineClosedError`.
        """
        deadline = time.monotonic() + ORPHAN_TIMEOUT
        while self._inflight:
            for marker in [m for m in self._inflight if m.done_at is not None]:
                self._complete(marker)
            self._settle()  # here, not from the ended loop's callbacks
            if not self._inflight:
                break
            if time.monotonic() > deadline:
                for marker in list(self._inflight):
                    if not marker.completed:
                        marker.error = EngineClosedError("the copy's event loop ended before it could be enqueued")
                        self._complete(marker)
                self._settle()
                break
            await asyncio.sleep(0.005)

    def _release_resources(self) -> None:
        """Stop the streams' threads and close every handler (the file tier: its fds and slab lock). Idempotent.

        Synchronous, and only for an engine with nothing in flight: :meth:`close` after draining, a cache
        constructor that failed after building its engine, an engine collected unclosed (:meth:`__del__`).
        """
        self._closing = self._closed = True
        for stream in getattr(self, "_streams", {}).values():
            stream.close()
        routes = getattr(self, "_routes", None)
        for handler in routes.handlers if routes is not None else ():
            handler.close()

    def __del__(self) -> None:
        if getattr(self, "_closed", True):
            return
        warnings.warn(
            f"unclosed {self!r}: use 'async with' or await close(); releasing its threads and slab lock",
            ResourceWarning,
            stacklevel=2,
        )
        try:
            self._release_resources()
        except Exception:  # interpreter shutdown: nothing more can be done
            pass

    @property
    def closed(self) -> bool:
        """``close()`` has finished."""
        return self._closed

    @property
    def closing(self) -> bool:
        """``close()`` has begun (or finished): no new copies are accepted."""
        return self._closing

    def _bind_loop(self) -> asyncio.AbstractEventLoop:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            raise RuntimeError("TransferEngine must be used from a coroutine running on an event loop") from None
        if self._loop is None:
            self._loop = loop
            # completions arriving together: one wake-up; their bookkeeping runs after the awaiters resumed
            self._inbox = CompletionInbox(loop, self._complete, self._settle)
            spin = self.config.completion_spin_us
            if spin is None:
                spin = _DEFAULT_SPIN_US if self.device.is_cuda else 0
            if spin > 0:  # awaited copies about to end: the loop polls their events (EngineConfig.completion_spin_us)
                self._poller = EventPoller(loop, self._poll, self._settle, spin / 1e6)
            in_place = self.config.await_spin_us
            if in_place is None:
                in_place = _DEFAULT_AWAIT_SPIN_US if self.device.is_cuda else 0
            self._await_spin = in_place / 1e6
            for stream in self._streams.values():
                if self._poller is not None or self._await_spin > 0:
                    stream.watch = self._watch  # type: ignore[attr-defined]  # our streams have it
                if isinstance(stream, CudaStream):  # woken shortly before a long copy's expected end
                    stream.near_end = self._poller.wake if self._poller is not None else self._inbox.poke
            for handler in self._routes.handlers:  # SLOT STATE HOOK: handlers that apply state changes on the loop
                bind = getattr(handler, "bind_loop", None)
                if bind is not None:
                    bind(loop)
        elif self._loop is not loop:
            raise RuntimeError("TransferEngine is bound to another event loop; use one engine per loop")
        return loop

    def _check_open(self) -> asyncio.AbstractEventLoop:
        if self._closing:
            raise EngineClosedError("the TransferEngine is closed")
        return self._bind_loop()

    # ------------------------------------------------------------------------------------ inspection

    def pool(self, tier: Tier | str) -> BlockPool | LayerMajorPool:
        """The memory pool of ``tier`` (GPU or host).

        Raises:
            ValueError: unknown tier, or the engine has no pool for it.
            TypeError: the tier is not in memory (the file tier: see :meth:`medium` and :attr:`file_tier`).
        """
        t = Tier.coerce(tier)
        pool = self._pools.get(t)
        if pool is None:
            if t in self._media:
                raise TypeError(
                    f"{t.value} blocks have no in-memory view; copy the block to the host tier to inspect it"
                )
            raise ValueError(f"this engine has no {t.value} pool (give it {t.value}_blocks)")
        return pool

    def medium(self, tier: Tier | str) -> Medium:
        """The medium of ``tier``: a memory pool, or the medium a handler owns (the file tier).

        Raises:
            ValueError: unknown tier, or the engine has no medium for it.
        """
        t = Tier.coerce(tier)
        medium = self._media.get(t)
        if medium is None:
            raise ValueError(f"this engine has no {t.value} pool (give it {t.value}_blocks)")
        return medium

    def add_handler(self, handler: TransferHandler) -> None:
        """Route ``handler.routes`` to ``handler`` and add the media it owns (a new tier is one handler).

        Use it for a handler that needs the engine's pools or streams; one that does not can be passed as
        ``TransferEngine(..., handlers=[...])``. The engine closes it in :meth:`close`.

        Raises:
            ValueError: a pair already routed or a medium already owned (nothing is changed).
            EngineClosedError: the engine is closed.
        """
        if self._closing:
            raise EngineClosedError("the TransferEngine is closed")
        self._routes.add(handler)
        self._media.update(handler.media)
        self._resolved.clear()

    def route(self, src_tier: Tier | str, dst_tier: Tier | str) -> TransferHandler:
        """The handler that copies from ``src_tier`` to ``dst_tier``.

        Raises:
            ValueError: unknown tier, or no handler for the pair.
        """
        src_t, dst_t = Tier.coerce(src_tier), Tier.coerce(dst_tier)
        handler = self._routes.get(src_t, dst_t)
        if handler is None:
            raise ValueError(f"copies from {src_t.value} to {dst_t.value} are not supported by this engine")
        return handler

    def _resolve_route(self, src_tier: Tier | str, dst_tier: Tier | str) -> _Route:
        """Tiers, media and handler of a pair, checked (the errors of :meth:`medium` and :meth:`route`).

        Kept per pair as the caller names it (a :class:`Tier` or its name), so that a copy does not coerce and
        look up the same things again; :meth:`add_handler` forgets them.
        """
        src_t, dst_t = Tier.coerce(src_tier), Tier.coerce(dst_tier)
        src_pool, dst_pool = self.medium(src_t), self.medium(dst_t)
        handler = self.route(src_t, dst_t)
        memory = isinstance(handler, StreamCopier)
        route = (src_t, dst_t, src_pool, dst_pool, handler, memory, f"{src_t.value}->{dst_t.value}")
        if type(src_tier) in (Tier, str) and type(dst_tier) in (Tier, str):
            self._resolved[src_tier, dst_tier] = route
        return route

    def block(self, tier: Tier | str, index: int) -> torch.Tensor:
        """A view of one block, for inspection and for filling in tests.

        Notes:
            The view is live memory: await the copies that touch the block (or :meth:`drain`) first.
            A layer-major GPU pool returns a block-major *copy* (write through ``pool(...).layer(i)``).
        """
        return self.pool(tier).block(index)

    def stream(self, name: str) -> Stream:
        """One of the engine's copy streams: ``"offload"``, ``"onboard"`` or ``"local"``."""
        try:
            return self._streams[name]
        except KeyError:
            raise ValueError(f"unknown stream {name!r}; use one of {', '.join(self._streams)}") from None

    @property
    def file_tier(self) -> FileTier:
        """The file tier: its index (content key -> slot) and statistics.

        Raises:
            ValueError: the engine has no file tier.
        """
        tier = self._media.get(Tier.FILE)
        if not isinstance(tier, FileTier):
            raise ValueError("this engine has no file tier (give it file_dir and file_blocks)")
        return tier

    @property
    def fences(self) -> FenceTable:
        """The per-block fence table (pending reads and write of each block)."""
        self._settle()
        return self._fences

    def statistics(self) -> EngineStatistics:
        """A snapshot: transfers, bytes and latencies per direction, fences."""
        self._settle()
        return EngineStatistics(
            device=self.device.kind,
            submitted=self._submitted,
            completed=self._completed,
            failed=self._failed,
            in_flight=len(self._inflight),
            deferred=len(self._deferred),
            bytes_by_direction={d: t.nbytes for d, t in self._by_direction.items()},
            blocks_by_direction={d: t.blocks for d, t in self._by_direction.items()},
            seconds_by_direction={d: t.seconds for d, t in self._by_direction.items()},
            latency_counts={d: tuple(t.counts) for d, t in self._by_direction.items()},
            fences=self._fences.statistics(),
        )

    def __repr__(self) -> str:
        self._settle()
        state = "closed" if self._closed else ("closing" if self._closing else "open")
        pools = ", ".join(f"{p.name}:{p.num_blocks}" for p in self._media.values())
        return (
            f"<TransferEngine {self.device.kind} [{state}, in_flight:{len(self._inflight)}, "
            f"deferred:{len(self._deferred)}, fenced:{len(self._fences)}] pools({pools})>"
        )

    # ------------------------------------------------------------------------------------ copies

    def copy(
        self,
        src_tier: Tier | str,
        src_indices: Indices,
        dst_tier: Tier | str,
        dst_indices: Indices,
        *,
        num_tokens: int | None = None,
        keys: Iterable[object] | None = None,
        layers: tuple[int, int] | None = None,
    ) -> Transfer:
        """Copy blocks ``src_indices`` of ``src_tier`` to blocks ``dst_indices`` of ``dst_tier``.

        Returns at once with an awaitable :class:`Transfer`. The copy waits for the fences of its blocks:
        it reads a source only after that block's pending write has landed and overwrites a destination
        only after that block's pending reads and write have finished.

        Args:
            src_tier: ``Tier.GPU``, ``Tier.HOST`` or ``Tier.FILE`` (or their names).
            src_indices: source block indices.
            dst_tier: destination tier.
            dst_indices: destination block indices, one per source, no duplicates.
            num_tokens: copy only tokens ``[0, num_tokens)`` of every (layer, kv, head); the rest of each
                destination block is left untouched. ``None`` copies whole blocks. Not with the file tier.
            keys: content keys (bytes, str or int), one per block. Required for copies into ``Tier.FILE``:
                each is written into its slot's header and indexed (``engine.file_tier.lookup(key)``, also
                after a restart). Optional for copies out of ``Tier.FILE``: checked against the index.
            layers: copy only layers ``[start, stop)`` of each block (layer-by-layer loads and stores, see
                :mod:`tiered_kv.layerwise`); ``None`` copies every layer. Only between GPU and host pools.
                Fences stay per block.

        Raises:
            ValueError: unknown tier or missing pool, an index out of range or negative, duplicate
                destinations, a block that is both source and destination, length mismatch, or
                ``num_tokens`` outside ``1..tokens_per_block``. Nothing is enqueued.
            TypeError: indices that are not integers, ``num_tokens`` that is not an int.
            EngineClosedError: the engine is closed.
            OwnedEngineError: the engine's blocks belong to a :class:`~tiered_kv.TieredKVCache` (see :meth:`claim`).

        Notes:
            Cancellation: cancelling the task awaiting the returned transfer does not cancel the copy;
            its fences are released when it completes.
        """
        if self._owner is not None:
            self._refuse_owned()
        return self._copy(src_tier, src_indices, dst_tier, dst_indices, num_tokens=num_tokens, keys=keys, layers=layers)

    def copy_layer_groups(
        self,
        src_tier: Tier | str,
        src_indices: Indices,
        dst_tier: Tier | str,
        dst_indices: Indices,
        groups: Sequence[tuple[int, int]],
        *,
        num_tokens: int | None = None,
    ) -> list[Transfer]:
        """One copy issued as one transfer per layer group, in order (:func:`tiered_kv.layerwise.copy_layerwise`).

        The same as ``[copy(..., layers=g) for g in groups]``, with the per-call work done once: the indices are
        checked once, every group is planned before any is enqueued (a bad group enqueues nothing), and the fence
        table is consulted once and holds one entry per block for the whole copy (its last group: the groups run
        in order on one copy stream, so the last one done means all are).

        Raises:
            ValueError / TypeError: as :meth:`copy`, or ``groups`` empty. Nothing is enqueued.
        """
        if self._owner is not None:
            self._refuse_owned()
        loop = self._check_open()
        try:
            route = self._resolved[src_tier, dst_tier]
        except (KeyError, TypeError):
            route = self._resolve_route(src_tier, dst_tier)
        src_t, dst_t, src_pool, dst_pool, handler, memory, direction = route
        if not groups:
            raise ValueError("groups must name at least one (start, stop) layer range")
        spans: list[tuple[int, int]] = []
        for g in groups:
            span = self._check_layers(g, memory)
            assert span is not None
            spans.append(span)
        small = small_pairs(src_indices, dst_indices, src_pool.num_blocks, dst_pool.num_blocks, src_pool is dst_pool)
        s, d = small if small is not None else self._check_indices(src_pool, src_indices, dst_pool, dst_indices)
        n = self._check_tokens(num_tokens)
        tokens = None if num_tokens is None else int(num_tokens)
        # every group but the last has more of the copy right behind it on the lane: its completion signal must
        # not hold that up (a CUDA host function on the copy stream would stall the next group until it has run)
        last = len(spans) - 1
        jobs = [
            handler.prepare(handler.validate(Batch(src_t, s, dst_t, d, tokens, None, span, more_follows=i < last)))
            for i, span in enumerate(spans)
        ]
        lane = jobs[0].lane
        count = len(s)
        if lane is None or count == 0 or any(job.lane is not lane for job in jobs):
            # off-stream groups (host threads) run side by side, not in order: each is its own copy
            return [self._copy(src_t, s, dst_t, d, num_tokens=num_tokens, layers=g) for g in groups]
        layout = self.layout
        per_layer = (self._block_bytes if n is None else layout.partial_bytes(n)) // layout.num_layers
        fences = self._fences
        src_name, dst_name = src_pool.name, dst_pool.name
        reads: list[tuple[str, list[int]]] = [(src_name, s if isinstance(s, list) else s.tolist())]
        writes: list[tuple[str, list[int]]] = [(dst_name, d if isinstance(d, list) else d.tolist())]
        sources: set[Marker] = set()
        live = fences.live(src_name) or fences.live(dst_name)
        deps = list(fences.dependencies(reads, writes, sources)) if live else []
        transfers = []
        for (start, stop), job in zip(spans, jobs, strict=True):
            marker = Marker(lane)
            if sources:
                marker.sources = list(sources)
            transfer = Transfer(marker, src_t, dst_t, count, count * per_layer * (stop - start))
            self._submitted += 1
            self._start(loop, marker, job, deps)  # the same dependencies for each: on one lane they cost nothing
            self._inflight[marker] = (direction, transfer)
            transfers.append(transfer)
        fences.register(transfers[-1]._marker, reads, writes)
        return transfers

    def _refuse_owned(self) -> NoReturn:
        raise OwnedEngineError(
            f"this TransferEngine's blocks belong to {self._owner}: a copy through it would change KV the cache "
            "serves behind its back. Use the cache's API (add_sequences, append_tokens, evict), or an engine of "
            "your own for copies of your own."
        )

    def claim(self, owner: str) -> Callable[..., Transfer]:
        """Give every block of this engine to ``owner`` (a cache's block manager decides what each holds).

        From now on :meth:`copy` raises :class:`~tiered_kv.errors.OwnedEngineError`; the owner copies through the
        function returned (same signature as :meth:`copy`). Reading state (``statistics``, ``pool``, ``block``,
        ``fences``, ``drain``) stays open to everyone.

        Raises:
            ValueError: the engine already has an owner (one cache per engine).
        """
        if self._owner is not None:
            raise ValueError(
                f"this TransferEngine already belongs to {self._owner}; give each cache an engine of its own"
            )
        self._owner = owner
        return self._copy

    def release(self, owner: str) -> None:
        """End ``owner``'s claim (:meth:`claim`): :meth:`copy` is open again. A no-op for anyone else."""
        if self._owner == owner:
            self._owner = None

    def _copy(
        self,
        src_tier: Tier | str,
        src_indices: Indices,
        dst_tier: Tier | str,
        dst_indices: Indices,
        *,
        num_tokens: int | None = None,
        keys: Iterable[object] | None = None,
        layers: tuple[int, int] | None = None,
    ) -> Transfer:
        """The copy itself (see :meth:`copy`): validate, fence, enqueue."""
        if self._closing:
            raise EngineClosedError("the TransferEngine is closed")
        loop = self._loop
        if loop is None or loop is not asyncio._get_running_loop():  # _check_open() inline: no frames per call
            loop = self._bind_loop()
        try:  # the route of a (src, dst) pair as the caller names it, resolved once (see _resolve_route)
            route = self._resolved[src_tier, dst_tier]
        except (KeyError, TypeError):
            route = self._resolve_route(src_tier, dst_tier)
        src_t, dst_t, src_pool, dst_pool, handler, memory, direction = route
        small = (
            small_pairs(src_indices, dst_indices, src_pool.num_blocks, dst_pool.num_blocks, src_pool is dst_pool)
            if memory
            else None
        )
        s: np.ndarray | list[int]
        d: np.ndarray | list[int]
        if small is not None:  # the per-call fast path: valid small int lists, no numpy
            s, d = small
        else:
            s, d = self._check_indices(src_pool, src_indices, dst_pool, dst_indices)
        n = self._check_tokens(num_tokens)
        span = self._check_layers(layers, memory)
        # num_tokens goes to the handler as given (validated): the file tier refuses it even when it is whole
        batch = handler.validate(Batch(src_t, s, dst_t, d, None if num_tokens is None else int(num_tokens), keys, span))

        per_block = self._block_bytes if n is None else self.layout.partial_bytes(n)
        if span is not None:
            per_block = per_block // self.layout.num_layers * (span[1] - span[0])
        self._submitted += 1
        count = len(s)
        if count == 0:
            marker = Marker(None)
            marker.complete()
            self._completed += 1
            return Transfer(marker, src_t, dst_t, 0, 0)

        job = handler.prepare(batch)
        marker = Marker(job.lane)
        transfer = Transfer(marker, src_t, dst_t, count, count * per_block)
        # Fences: dependencies before the launch, the new entries after it (nothing else runs on the loop in
        # between), so that a large call's per-block bookkeeping overlaps its copy instead of delaying it. A pool
        # with no live entry has nothing to wait for: then not even the index lists are made before the launch.
        fences = self._fences
        src_name, dst_name = src_pool.name, dst_pool.name
        if small is not None:  # int lists already: dependencies and entries in one pass
            self._start(loop, marker, job, fences.fence(marker, src_name, small[0], dst_name, small[1]))
        else:
            assert isinstance(s, np.ndarray) and isinstance(d, np.ndarray)
            if fences.live(src_name) or fences.live(dst_name):
                reads, writes = [(src_name, s.tolist())], [(dst_name, d.tolist())]
                read_from: set[Marker] = set()
                waits = fences.dependencies(reads, writes, read_from)
                if read_from:
                    marker.sources = list(read_from)
                self._start(loop, marker, job, waits)
            else:  # nothing pending in either pool: launch first, make the lists while the device copies
                self._start(loop, marker, job, ())
                reads, writes = [(src_name, s.tolist())], [(dst_name, d.tolist())]
            fences.register(marker, reads, writes)
        self._inflight[marker] = (direction, transfer)
        return transfer

    @staticmethod
    def _check_indices(
        src_pool: Medium, src_indices: Indices, dst_pool: Medium, dst_indices: Indices
    ) -> tuple[np.ndarray, np.ndarray]:
        """The general index checks (any iterable, numpy or CPU tensor), with the descriptive errors.

        Vectorized (a sort, no Python-level loop or set): a call of thousands of blocks is checked in tens of us.
        """
        s = as_indices(src_indices, "source indices")
        d = as_indices(dst_indices, "destination indices")
        if s.size != d.size:
            raise ValueError(f"got {s.size} source indices and {d.size} destination indices; they must pair up")
        src_pool.check(s, "source indices")
        dst_pool.check(d, "destination indices")
        if d.size > 1:
            # a count per block where the pool is not much larger than the call, else a sort
            n = dst_pool.num_blocks
            if n <= 8 * d.size:
                repeated = bool(np.bincount(d, minlength=n).max() > 1)
            else:
                ordered = np.sort(d)
                repeated = bool((ordered[1:] == ordered[:-1]).any())
            if repeated:
                values, counts = np.unique(d, return_counts=True)
                raise ValueError(f"destination indices contain duplicates: {values[counts > 1][:8].tolist()}")
        if src_pool is dst_pool and s.size:
            both = np.intersect1d(s, d)
            if both.size:
                raise ValueError(f"blocks {both[:8].tolist()} are both a source and a destination of one copy")
        return s, d

    def _check_layers(self, layers: object, memory: bool) -> tuple[int, int] | None:
        if layers is None:
            return None
        if not memory:
            raise ValueError("layers= is only supported between GPU and host pools (a file slot is one whole block)")
        if (
            not isinstance(layers, tuple)
            or len(layers) != 2
            or not all(isinstance(x, (int, np.integer)) and not isinstance(x, bool) for x in layers)
        ):
            raise TypeError(f"layers must be a (start, stop) tuple of ints, got {layers!r}")
        start, stop = int(layers[0]), int(layers[1])
        if not 0 <= start < stop <= self.layout.num_layers:
            raise ValueError(
                f"layers must be a range (start, stop) with 0 <= start < stop <= {self.layout.num_layers}, got {layers}"
            )
        return start, stop

    def _check_tokens(self, num_tokens: int | None) -> int | None:
        if num_tokens is None:
            return None
        if isinstance(num_tokens, bool) or not isinstance(num_tokens, (int, np.integer)):
            raise TypeError(f"num_tokens must be an int or None, got {type(num_tokens).__name__}")
        tpb = self.layout.tokens_per_block
        if not 1 <= num_tokens <= tpb:
            raise ValueError(f"num_tokens must be in 1..{tpb} (tokens_per_block), got {num_tokens}")
        return None if num_tokens == tpb else int(num_tokens)

    # ------------------------------------------------------------------------------------ internals

    def _start(self, loop: asyncio.AbstractEventLoop, marker: Marker, job: Job, deps: Iterable[Marker]) -> None:
        """Enqueue ``job`` now behind its stream-side dependencies, or from a task once its loop-side ones are done.

        A dependency on another stream is waited for stream-side; one on the same stream is ordered by the stream
        itself; one without an event (off-stream work, or not enqueued yet) is awaited on the loop.
        """
        lane = marker.lane
        stream_deps: list[Marker] = []
        loop_deps: list[Marker] = []
        for dep in deps:
            if lane is not None and dep.lane is not None and dep.event is not None:
                if dep.lane is not lane:  # same stream: FIFO already orders it
                    stream_deps.append(dep)
            else:
                loop_deps.append(dep)
        if loop_deps:
            task = loop.create_task(self._enqueue_after(marker, job, stream_deps, loop_deps))
            self._deferred.add(task)
            task.add_done_callback(self._deferred.discard)
        else:
            self._enqueue(marker, job, stream_deps)

    @staticmethod
    def _finished(inbox: CompletionInbox[Marker], marker: Marker, error: BaseException | None) -> None:
        """The end of ``marker``'s op, from whichever thread saw it; completes it on the loop.

        Bound per copy by ``functools.partial``, which costs no Python call.
        """
        if marker.completed:  # the loop completed it from its event already (_poll): nothing left to do
            return
        if error is not None:
            marker.error = error
        marker.done_at = time.perf_counter()
        inbox.post(marker)

    def _enqueue(self, marker: Marker, job: Job, stream_deps: list[Marker]) -> None:
        """Start ``job`` behind ``stream_deps`` (waited for on its lane); its completion calls :meth:`_complete`."""
        assert self._inbox is not None
        done = functools.partial(self._finished, self._inbox, marker)
        lane = marker.lane
        if lane is not None and stream_deps:
            for dep in stream_deps:
                assert dep.event is not None
                lane.wait(dep.event)
            marker.after = stream_deps
            self._fences.stream_waits += len(stream_deps)
        try:
            marker.event = job.start(done)
            marker.job = job
        except BaseException as exc:  # reported to whoever awaits the transfer
            done(exc)

    async def _enqueue_after(
        self, marker: Marker, job: Job, stream_deps: list[Marker], loop_deps: list[Marker]
    ) -> None:
        """Wait on the loop for off-stream dependencies, then enqueue.

        Cancellation: only happens when the loop shuts down under a live engine; the marker is then
        completed with the error so that nothing waits on it forever.
        """
        try:
            for dep in loop_deps:
                await dep.wait()
            self._fences.loop_waits += len(loop_deps)
            failed = _failed_source(marker)
            abort = getattr(job, "abort", None)
            if failed is not None and abort is not None:  # not started: it would copy bytes that never arrived
                abort(failed)
                marker.error = failed
                self._complete(marker)
                self._settle()
                return
            self._enqueue(marker, job, stream_deps)  # a failed source without abort(): failed at its completion
        except BaseException as exc:
            marker.error = exc
            self._complete(marker)
            self._settle()  # not a delivery of the inbox: no callback settles it
            if isinstance(exc, asyncio.CancelledError):
                raise

    def _complete(self, marker: Marker) -> None:
        """Complete ``marker`` on the loop: wake its awaiters now, do the bookkeeping later (:meth:`_settle`).

        An awaiting coroutine resumes in the loop's next round of callbacks, behind whatever the current callback
        still does; so only the wake-up runs here. The fence release and statistics run from the completion inbox's
        callback queued behind the wake-ups, and every reader of that state settles it first (``statistics``,
        ``fences``, ``drain``, ``close``): nobody sees it stale.
        """
        if marker.completed:
            return
        # Ops this one waited for stream-side finished on the device before it did; their own completion
        # callbacks come from other waiter threads and may arrive later. Complete them first, so that
        # done() respects the order the fences imposed (a transfer is never done before one it waited for).
        after = marker.after
        if after:
            for dep in after:
                if not dep.completed:
                    if dep.done_at is None:
                        dep.done_at = marker.done_at
                    if dep.error is None and not _ok_at_event(dep):
                        # its copy failed at launch: its own done() would bring the error, and finds it completed
                        dep.error = _launch_error(dep) or TransferError("a copy this one waited for failed")
                    self._complete(dep)
            marker.after = []
        sources = marker.sources
        if sources:
            for source in sources:  # on this op's stream, done before it: a launch that failed is known by now
                if not source.completed and source.error is None and source.event is not None:
                    source.error = _launch_error(source)
                    if source.error is not None:
                        self._complete(source)
            if marker.error is None:
                marker.error = _failed_source(marker)
            marker.sources = ()
        # queued before complete(): a done-callback that reads the statistics or the fences settles them first
        self._fences.release_later(marker)
        self._settling.append(marker)
        marker.complete()

    def _watch(self, marker: Marker, transfer: Transfer) -> None:
        """A coroutine is about to await ``transfer`` (on a stream): wait in place, or have the loop poll it.

        Expected end: submitted plus its bytes at the stream's measured rate (a first guess before any). Due within
        ``EngineConfig.await_spin_us``: the awaiting coroutine polls the event here, without yielding to the loop,
        for at most that long (done: it goes on as after a done future, no loop round to see the event nor one to
        resume it). Otherwise, or not done by then: the loop polls it from near its expected end
        (:class:`EventPoller`); a copy queued behind others ends later than expected and is polled until the poller
        gives up on it, then completed by its thread as without the poller.
        """
        # the stream waiter's own estimate (device.expected_end), in perf_counter seconds; no bytes: due at once.
        # A long copy is polled up to a quarter of its span late (a partial copy runs below the stream's best rate)
        _wake, due_ns = expected_end(0, transfer.nbytes, getattr(marker.lane, "rate", 0.0))
        span = max(due_ns, 0) / 1e9
        due = transfer.submitted_at + span
        now = time.perf_counter()
        spin = self._await_spin
        if due <= now + spin:
            # due now or within the in-place budget: look until it is done or the budget is spent. Done (or left to
            # its thread: a failed op): the awaiting coroutine then finds it completed and goes on without yielding;
            # the bookkeeping runs behind it, as after the poller's rounds. Its _settle is queued first, while the
            # device still copies (one per loop round; a queued _settle with nothing to do returns at once)
            if not self._settle_queued:
                loop = self._loop
                assert loop is not None
                self._settle_queued = True
                loop.call_soon(self._settle)
            event = marker.event
            look = getattr(event, "spin", None)
            if look is not None:  # the native and the emulated events: look until done or the budget is spent
                if self._settling and due > now + _SETTLE_AHEAD:  # the earlier copies' bookkeeping, while this one runs
                    self._settle()
                seen = look(int(spin * 1e9))  # 1 done, 0 not yet, -1 CUDA error (raised by _poll's query)
                done = seen != 0 and self._poll(marker)
            else:  # a torch event (CUDA without the extension)
                until = now + spin
                while not (done := self._poll(marker)):
                    if time.perf_counter() >= until:
                        break
                    time.sleep(0)
            if done:
                self._in_place += 1  # seen before the coroutine yielded (tests, probes)
                if self._poller is not None:
                    self._poller.finished += 1  # seen by the loop, as a poll would
                return
        poller = self._poller
        if poller is not None:
            poller.watch(marker, due, span / 4)

    def _poll(self, marker: Marker) -> bool:
        """One loop-side poll of ``marker`` (:class:`EventPoller`): True once it needs no more polls.

        Its event reached and its job's completion nothing more than that (``ok_at_event``): complete it now, as
        its thread's ``done`` would (which then finds it completed and does nothing). Copies enqueued before it on
        its stream ended before it: they are completed first, as the stream's thread completes them in order; if
        one of them failed (its error comes with its ``done``), all are left to the thread.
        """
        if marker.completed:
            return True
        event = marker.event
        if event is None or not event.query():
            return False
        if not _ok_at_event(marker):
            return True
        lane = marker.lane
        earlier = []
        for other in self._inflight:  # copy() order; what was enqueued before it on its stream has ended too
            if other is marker:
                break
            if other.lane is lane and not other.completed and other.event is not None and other.event.query():
                if not _ok_at_event(other):
                    return True
                earlier.append(other)
        now = time.perf_counter()
        for other in earlier:
            other.done_at = now
            self._complete(other)
        marker.done_at = now
        self._complete(marker)
        return True

    def _settle(self) -> None:
        """The bookkeeping of the copies completed so far: fence release, in-flight set, statistics."""
        self._settle_queued = False
        self._fences.release_done()
        markers = self._settling
        if not markers:
            return
        self._settling = []
        for marker in markers:
            direction, transfer = self._inflight.pop(marker)
            self._completed += 1
            if marker.error is not None:
                self._failed += 1
                # one message per failure: the error reaches whoever awaits the transfer (or its done-callback)
                log.debug("%s transfer of %d blocks failed: %r", direction, transfer.num_blocks, marker.error)
                continue
            seconds = (marker.done_at or time.perf_counter()) - transfer.submitted_at
            totals = self._by_direction.get(direction)
            if totals is None:
                totals = self._by_direction[direction] = _DirectionTotals()
            totals.nbytes += transfer.nbytes
            totals.blocks += transfer.num_blocks
            totals.seconds += seconds
            totals.counts[bisect.bisect_left(LATENCY_BUCKETS, seconds)] += 1

    # ------------------------------------------------------------------------------------ compute sync

    def sync_with_compute(self, stream: object) -> None:
        """Make copies enqueued from now on wait for the work already queued on ``stream``.

        Use it before offloading blocks that the compute stream is still writing. Stream-side: neither
        the CPU nor the event loop blocks.

        Args:
            stream: the compute stream (``torch.cuda.Stream`` or a tiered_kv stream).
        """
        self._check_open()
        compute = self.device.wrap_stream(stream)
        event = compute.record()
        for copy_stream in self._streams.values():
            copy_stream.wait(event)

    def sync_transfer(self, transfer: Transfer, stream: object) -> None:
        """Make work queued on ``stream`` from now on wait for one transfer. Stream-side: nothing blocks.

        Use it before compute reads what one transfer brought in (e.g. one layer group of
        :func:`tiered_kv.layerwise.copy_layerwise`) while later transfers are still running.

        Raises:
            ValueError: the transfer is still deferred on the loop (waiting for a file-tier dependency) or
                runs off-stream (host-to-host, file): await it instead.
        """
        self._check_open()
        marker = transfer._marker
        if marker.completed:
            return
        if marker.event is None:
            raise ValueError("this transfer is not on a copy stream yet (deferred or off-stream): await it instead")
        self.device.wrap_stream(stream).wait(marker.event)

    def sync_transfers(self, stream: object) -> None:
        """Make work queued on ``stream`` from now on wait for every copy enqueued on the copy streams.

        Use it before compute reads blocks that were just onboarded. Stream-side: nothing blocks.

        Notes:
            Copies still deferred (waiting on the loop for an off-stream dependency such as file I/O) and
            host-to-host copies are not covered: await those transfers first.
        """
        self._check_open()
        compute = self.device.wrap_stream(stream)
        for copy_stream in self._streams.values():
            compute.wait(copy_stream.record())
