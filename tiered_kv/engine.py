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
:class:`~tiered_kv.file.FileHandler` for anything with FILE (its GPU legs on offload/onboard).

This module is the facade and the copy path: construction, lifecycle (ownership by a cache, close from another
loop, release on failed construction), and ``copy()``: route, validate, plan, fence, start. The parts it is built
from, one concept each:

* :mod:`tiered_kv.engine_pools` -- the GPU and host pools, adopted from the caller or allocated;
* :mod:`tiered_kv.engine_inspection` -- the lookups and reports of what the engine holds and has done: its media,
  the routing table (``route``, ``add_handler``), the copy streams, the fence table, the statistics;
* :mod:`tiered_kv.copy_checks` -- the argument checks of a copy (indices, ``num_tokens``, ``layers``);
* :mod:`tiered_kv.engine_sync` -- ordering compute after copies and copies after compute, stream-side;
* :mod:`tiered_kv.inflight` -- a copy once planned: its start behind its dependencies (stream-side, or on the
  loop), its completion on the loop (thread callbacks batched by :class:`~tiered_kv.completions.CompletionInbox`,
  the loop-side poll, the in-place await), the bookkeeping after it (fence release, statistics), failure
  propagation, and the copies an ended loop left behind.

The constants and helpers of those parts are importable from this module too (the ``import X as X`` lines).

The per-call fast path: a copy between memory pools of at most ``SMALL_CALL_BLOCKS`` pairs given as int
lists or small integer arrays is validated on plain lists (:func:`~tiered_kv.pools.small_pairs`, no numpy)
and becomes one ``copy_blocks_list`` call on its stream (:mod:`tiered_kv.copyops`).
"""

from __future__ import annotations

import asyncio
import os
import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, NoReturn

import numpy as np
import torch

from .config import EngineConfig
from .copy_checks import CopyChecks, Indices
from .copyops import Copier
from .device import Device, Stream, resolve_device
from .engine_inspection import EngineInspection, _Route
from .engine_pools import _allocate as _allocate
from .engine_pools import make_pools
from .engine_sync import ComputeSync
from .errors import EngineClosedError, OwnedEngineError
from .fences import Marker
from .file import FileHandler, FileTier, FileTierConfig
from .handlers import Batch, Medium, Routes, TransferHandler
from .inflight import _DEFAULT_AWAIT_SPIN_US as _DEFAULT_AWAIT_SPIN_US
from .inflight import _DEFAULT_SPIN_US as _DEFAULT_SPIN_US
from .inflight import _SETTLE_AHEAD as _SETTLE_AHEAD
from .inflight import ORPHAN_TIMEOUT as ORPHAN_TIMEOUT
from .inflight import InFlightCopies
from .inflight import _DirectionTotals as _DirectionTotals
from .inflight import _failed_source as _failed_source
from .inflight import _launch_error as _launch_error
from .inflight import _ok_at_event as _ok_at_event
from .layer_major import LayerMajorPool
from .layout import KVLayout
from .pools import Tier, small_pairs
from .stream_copier import StreamCopier
from .transfer import LATENCY_BUCKETS, EngineStatistics, Transfer, TransferResult

__all__ = ["LATENCY_BUCKETS", "EngineStatistics", "Transfer", "TransferEngine", "TransferResult"]


class TransferEngine(CopyChecks, EngineInspection, ComputeSync, InFlightCopies):
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

        self._pools = make_pools(layout, self.device, gpu_blocks, host_blocks, gpu_pool, host_pool)

        if file_config is None and file_dir is not None and file_blocks:
            file_config = FileTierConfig.from_env(file_dir, file_blocks)
        elif file_config is None and (file_dir is not None or file_blocks):
            raise ValueError("give both file_dir and file_blocks (or file_config) to have a file tier")
        file_tier = FileTier(layout, file_config, device=self.device) if file_config is not None else None

        self._streams: dict[str, Stream] = {}
        try:
            self.copier = Copier(self.device, self.config)  # DMA-or-kernel choice per call (tiered_kv.copyops)
            for name in ("offload", "onboard", "local"):
                self._streams[name] = self.device.new_stream(
                    name, completion=self.config.completion, poll=self.config.completion_poll
                )
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
        super().__init__()  # the fence table, the in-flight set, the completion machinery (InFlightCopies)
        self._closing = False
        self._closed = False
        self._owner: str | None = None  # who the blocks belong to (claim): copy() is theirs alone

    if TYPE_CHECKING:  # InFlightCopies' completion steps, typed as this class's: a replacement on it takes an engine

        def _complete(self, marker: Marker) -> None: ...
        def _settle(self) -> None: ...

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
            self._bind_completions(loop, self.config, self.device.is_cuda, self._streams.values())
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
        return self._copy_layer_groups(src_tier, src_indices, dst_tier, dst_indices, groups, num_tokens=num_tokens)

    def claimed_layer_groups(self, owner: str) -> Callable[..., list[Transfer]]:
        """For the owner of a :meth:`claim`: :meth:`copy_layer_groups` (same signature) through its claim.

        Raises:
            ValueError: ``owner`` does not hold the claim.
        """
        if self._owner != owner:
            raise ValueError(f"{owner} does not hold this TransferEngine's claim")
        return self._copy_layer_groups

    def _copy_layer_groups(
        self,
        src_tier: Tier | str,
        src_indices: Indices,
        dst_tier: Tier | str,
        dst_indices: Indices,
        groups: Sequence[tuple[int, int]],
        *,
        num_tokens: int | None = None,
    ) -> list[Transfer]:
        """The layer-group copy itself (see :meth:`copy_layer_groups`)."""
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
        s: np.ndarray | list[int]
        d: np.ndarray | list[int]
        runs = None
        if small is not None:
            s, d, runs = small
        else:
            s, d = self._check_indices(src_pool, src_indices, dst_pool, dst_indices)
        n = self._check_tokens(num_tokens)
        tokens = None if num_tokens is None else int(num_tokens)
        # every group but the last has more of the copy right behind it on the lane: its completion signal must
        # not hold that up (a CUDA host function on the copy stream would stall the next group until it has run)
        last = len(spans) - 1
        jobs = [
            handler.prepare(handler.validate(Batch(src_t, s, dst_t, d, tokens, None, span, i < last, runs)))
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
        runs = None
        if small is not None:  # the per-call fast path: valid small int lists, no numpy
            s, d, runs = small
        else:
            s, d = self._check_indices(src_pool, src_indices, dst_pool, dst_indices)
        n = self._check_tokens(num_tokens)
        span = self._check_layers(layers, memory)
        # num_tokens goes to the handler as given (validated): the file tier refuses it even when it is whole
        tokens = None if num_tokens is None else int(num_tokens)
        batch = handler.validate(Batch(src_t, s, dst_t, d, tokens, keys, span, False, runs))

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
        if count == 1 and small is not None:  # one pair: dependencies and entries in one pass of dict operations
            self._start(loop, marker, job, fences.fence(marker, src_name, small[0], dst_name, small[1]))
        else:
            if fences.live(src_name) or fences.live(dst_name):
                reads, writes = [(src_name, _as_list(s))], [(dst_name, _as_list(d))]
                read_from: set[Marker] = set()
                waits = fences.dependencies(reads, writes, read_from)
                if read_from:
                    marker.sources = list(read_from)
                self._start(loop, marker, job, waits)
            else:  # nothing pending in either pool: launch first, make the entries while the device copies
                self._start(loop, marker, job, ())
                reads, writes = [(src_name, _as_list(s))], [(dst_name, _as_list(d))]
            fences.register(marker, reads, writes)
        self._inflight[marker] = (direction, transfer)
        return transfer


def _as_list(indices: np.ndarray | list[int]) -> list[int]:
    """Block indices as the fence table keys them: a list of ints."""
    return indices if isinstance(indices, list) else indices.tolist()
