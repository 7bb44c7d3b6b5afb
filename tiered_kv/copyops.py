"""Copy ops for the engine: the path choice (DMA or kernel) and the op that moves a batch of blocks.

Primitives:

* :class:`Copier` -- ``build(src_pool, s, dst_pool, d, num_tokens) -> op``: a callable the engine submits to a
  stream (or host thread) that copies every block pair in one batch; ``plan(...)`` says which path it takes.
* :class:`CopyPlan` -- the chosen path and the contiguous piece size it was chosen by.
* :class:`CopierStatistics` -- calls and bytes per path.

Paths:

* ``"kernel"`` -- CUDA, extension loaded: one launch of the ``copy_blocks`` kernel (any layout, partial or
  full, pinned host memory read/written through unified addressing). A call of at most
  ``SMALL_CALL_BLOCKS`` pairs made with its stream takes the *native submission path* (:class:`NativeCopy`,
  ``kernels/fast_path.cpp``): one call into C++ that checks the int-list indices, launches with bases + indices
  in the kernel's parameters when they fit (no H2D of metadata), records a pooled event and enqueues the
  completion signal -- no torch dispatcher, tensor or event per call. Without it (``TIERED_KV_NATIVE=0``, an
  extension built without it) the same call goes through the ``copy_blocks_list`` op.
* ``"dma"`` -- CUDA, extension loaded: ``cudaMemcpyAsync`` / ``cudaMemcpy2DAsync`` per run of blocks
  contiguous on both sides (and per layer group), issued in C++.
* ``"reference"`` -- the emulated device and host-to-host copies: the vectorized CPU reference op.
* ``"torch"`` -- CUDA without the extension (no toolkit, build failed): ``copy_`` per run and per group, with
  a GPU scratch buffer where a host side would otherwise be strided. Correct, not fast; logged once.

The choice: a copy that is one contiguous piece on both sides (one run of whole blocks of block-major pools,
e.g. a one-block copy) goes to DMA whatever its size: one ``cudaMemcpyAsync`` moves it at the copy engine's
rate, leaves the SMs to compute, and costs less host time than a kernel launch (measured on an H100 through
the torch ops: 9.3 vs 13.8 us on one host, 25.9 vs 32.6 us on a slower one). Otherwise, a copy whose
contiguous pieces (one (layer, kv) chunk for layer-major pools, a run of whole blocks for block-major ones,
``num_tokens * head_dim`` elements for partial copies) are at least the DMA piece size goes to DMA (batched
calls), smaller ones to the kernel. That size is ``EngineConfig.dma_min_chunk_bytes`` when set, else measured on
the GPU once per process (:func:`calibrated_dma_threshold`): the kernel is up to 10x faster than DMA for
4-16 KiB pieces, and where batched DMA catches up differs by card and host (64 KiB on an H100 host in
``tiered-kv bench``'s sweep). A layer-major copy whose blocks come in runs of consecutive blocks (on average at
least :data:`MIN_RUN_BLOCKS`) is one 2-D DMA call per run and group, a row per block: it is chosen by the row size
from which such calls match the kernel, measured the same way (:func:`calibrated_dma_row_threshold`; 32 KiB rows
against 64-128 KiB pieces on an H100 host). A partial copy between pinned host memory and the GPU whose rows go on
from block to block (dense block-major pools) is, in runs of consecutive blocks, one 2-D DMA call per run and group
too: it takes DMA when its rows are at least the width from which such a call beats the kernel
(:func:`calibrated_dma_strided_threshold`; a probe on an H100 and an H200: one call beats the kernel from 512 B
rows every 4 KiB, where the kernel stops at ~0.93 of PCIe) and its calls move at least what the row calibration's
calls moved at that threshold (the copy engine's cost is per call). ``EngineConfig.copy_path`` forces one path.

Layer-by-layer copies (``copy(..., layers=)``, :mod:`tiered_kv.layerwise`) count a run of consecutive blocks
as one piece too: DMA moves it in one ``cudaMemcpy2DAsync`` (a row per block), and a load that is meant to
overlap compute must not take the SMs (measured on an H100: with the kernel, per-layer loads of a 32-layer
prefill did not overlap the compute at all, 1.02-1.05x the serial time).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import math
import os
import statistics
import threading
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from . import opdefs, ops, pool_kinds
from .config import EngineConfig
from .device import CudaStream, Device, Event, Stream, scratch_on
from .layer_major import LayerMajorPool, LayerSlice
from .pools import SMALL_CALL_BLOCKS, BlockPool, merge_runs

__all__ = [
    "Copier",
    "CopierStatistics",
    "CopyPlan",
    "NativeCopy",
    "Side",
    "calibrated_dma_row_threshold",
    "calibrated_dma_threshold",
    "choose_path",
    "pool_tensors",
]

log = logging.getLogger(__name__)

Op = Callable[[], None]
Pool = BlockPool | LayerMajorPool
Side = BlockPool | LayerMajorPool | LayerSlice  # what a copy reads or writes: a pool, or layers of one


def pool_tensors(pool: Side) -> list[torch.Tensor]:
    """The tensors of a pool (or of a :class:`~tiered_kv.layer_major.LayerSlice`) as ``copy_blocks`` takes them."""
    if isinstance(pool, (LayerMajorPool, LayerSlice)):
        return list(pool.tensors)
    return [pool.tensor]


@dataclasses.dataclass(frozen=True, slots=True)
class CopyPlan:
    """How one batch is copied.

    Attributes:
        path: ``"kernel"``, ``"dma"``, ``"reference"`` or ``"torch"``.
        piece_bytes: the contiguous piece size the choice was made by.
        groups: layer groups per block (1 for block-major on both sides).
        runs: runs of blocks contiguous on both sides.
    """

    path: str
    piece_bytes: int
    groups: int
    runs: int


@dataclasses.dataclass(frozen=True, slots=True)
class _PairInfo:
    src_pool: Side  # kept so that a recycled id() is detected
    dst_pool: Side
    src_t: list[torch.Tensor]
    dst_t: list[torch.Tensor]
    groups: int
    rows: int
    width_bytes: int
    dense: bool
    on_cuda: bool
    layered: bool  # a side is a LayerSlice (layer-by-layer copy)
    block_bytes: int  # bytes one block pair moves (num_tokens of every row)
    # a partial copy between pinned host memory and the GPU whose rows go on from one block into the next on both
    # sides (one group per tensor, dense), rows STRIDED_PITCH bytes apart: a run of consecutive blocks is one 2-D
    # DMA call per group
    strided_runs: bool


@dataclasses.dataclass(frozen=True)
class _ChunkPair:
    """What a copy between a chunked pool and another pool keeps between calls (:meth:`Copier._chunk_pair`)."""

    src: Any
    dst: Any
    table: torch.Tensor  # int64 [chunks, 7] on the CPU (pool_kinds.block_table)
    on_device: torch.Tensor | None  # its copy on the GPU, read by the kernel (None without CUDA kernels)
    piece: int  # the smallest (merged) chunk: the piece size the path is chosen by
    on_cuda: bool


@dataclasses.dataclass(frozen=True, slots=True)
class CopierStatistics:
    """Calls and bytes per path since the copier was made (``path -> count``)."""

    calls: dict[str, int]
    bytes: dict[str, int]


class Copier:
    """Builds the copy op of one engine call and picks its path.

    Args:
        device: the engine's device.
        config: thresholds (``dma_min_chunk_bytes``, ``copy_path``).

    Notes:
        On CUDA the extension is loaded (built on first use, possibly tens of seconds) when the copier is
        made, not inside a copy; ``tiered-kv build-ext`` builds it ahead of time.
    """

    def __init__(self, device: Device, config: EngineConfig) -> None:
        self.device = device
        self._config = config  # the attributes behind the `config` and `kernels` properties: no shapes decided yet
        self._kernels = False
        if device.is_cuda:
            from . import _ext  # lazy: keeps `python -m tiered_kv._ext` from importing itself twice

            self._kernels = _ext.load()
        #: the piece size from which the auto path takes DMA (configured, or measured on this GPU once)
        self.dma_min_chunk_bytes: int = (
            config.dma_min_chunk_bytes if config.dma_min_chunk_bytes is not None else DEFAULT_DMA_MIN_CHUNK
        )
        #: the row size from which a layer-major copy in runs of consecutive blocks (2-D DMA calls) takes DMA
        self.dma_min_row_bytes: int = self.dma_min_chunk_bytes
        #: the row width from which a partial host<->GPU copy in runs of blocks may take 2-D DMA calls (measured;
        #: else never: partial rows are far below the default piece size)
        self.dma_min_strided_row_bytes: int = self.dma_min_chunk_bytes
        if config.dma_min_chunk_bytes is None and self.kernels and config.copy_path == "auto":
            self.dma_min_chunk_bytes = calibrated_dma_threshold(device.torch_device)
            self.dma_min_row_bytes = calibrated_dma_row_threshold(device.torch_device)
            self.dma_min_strided_row_bytes = calibrated_dma_strided_threshold(device.torch_device)
        self._lock = threading.Lock()
        self._calls: dict[str, int] = {}
        self._bytes: dict[str, int] = {}
        self._pairs: dict[tuple[int, int, int], _PairInfo] = {}  # (id(src pool), id(dst pool), n) -> geometry
        self._slices: dict[tuple[int, int, int], LayerSlice] = {}  # (id(pool), start, stop) -> layer range view
        # (id(pair info), pairs, runs, kernels) -> (pair info, config, plan) of a small call
        self._plans: dict[tuple[int, int, int, bool], tuple[_PairInfo, EngineConfig, CopyPlan]] = {}
        # the native submission path (kernels/fast_path.cpp): its module, and (id(pair info), method) -> plan
        self._native: Any = None
        if self.kernels and os.environ.get("TIERED_KV_NATIVE", "1") != "0":
            from . import _ext

            self._native = _ext.native()
        self._native_plans: dict[tuple[int, int], tuple[_PairInfo, int]] = {}
        # (id(src pool), id(dst pool)) -> the pools, their fixed chunk table (CPU, device copy), its piece size
        self._chunk_tables: dict[tuple[int, int], _ChunkPair] = {}
        self._finalizer = weakref.finalize(self, _free_native_plans, self._native_plans)

    @property
    def config(self) -> EngineConfig:
        """The thresholds and forced path the copier decides by; setting it forgets the decided shapes."""
        return self._config

    @config.setter
    def config(self, config: EngineConfig) -> None:
        self._config = config
        self.forget_plans()

    @property
    def kernels(self) -> bool:
        """Whether the CUDA kernels are loaded; setting it forgets the decided shapes."""
        return self._kernels

    @kernels.setter
    def kernels(self, kernels: bool) -> None:
        self._kernels = kernels
        self.forget_plans()

    def forget_plans(self) -> None:
        """Forget the decided small-call shapes: their next calls decide again (the path choice changed)."""
        self._plans.clear()

    def _pair(self, src_pool: Side, dst_pool: Side, n: int) -> _PairInfo:
        """What does not change between calls for one (source pool, destination pool, num_tokens)."""
        key = (id(src_pool), id(dst_pool), n)
        info = self._pairs.get(key)
        if info is None or info.src_pool is not src_pool or info.dst_pool is not dst_pool:
            src_t, dst_t = pool_tensors(src_pool), pool_tensors(dst_pool)
            groups, rows, row, width = opdefs.block_geometry(dst_t, src_t, n)
            dense = all(t.stride(0) == math.prod(t.shape[1:]) for t in (src_t[0], dst_t[0]))
            on_cuda = src_t[0].is_cuda or dst_t[0].is_cuda
            via_host = on_cuda and not (src_t[0].is_cuda and dst_t[0].is_cuda)
            rows_go_on = rows > 1 and all(t.stride(0) == rows * row for t in (src_t[0], dst_t[0]))
            measured_pitch = row * src_pool.layout.itemsize == STRIDED_PITCH
            layered = isinstance(src_pool, LayerSlice) or isinstance(dst_pool, LayerSlice)
            info = _PairInfo(
                src_pool,
                dst_pool,
                src_t,
                dst_t,
                groups,
                rows,
                width * src_pool.layout.itemsize,
                dense,
                on_cuda,
                layered,
                src_pool.layout.bytes_per_block // src_pool.layout.tokens_per_block * n,
                via_host and rows_go_on and measured_pitch,
            )
            self._pairs[key] = info
        return info

    def _native_plan(self, info: _PairInfo, n: int, method: int) -> int:
        """The native copy plan of a pair of pools and a method, made once (``tiered_kv::copy_plan``)."""
        key = (id(info), method)
        entry = self._native_plans.get(key)
        if entry is None or entry[0] is not info:
            if entry is not None:
                torch.ops.tiered_kv.copy_plan_free(entry[1])
            plan = int(torch.ops.tiered_kv.copy_plan(info.dst_t, info.src_t, n, method))
            entry = self._native_plans[key] = (info, plan)
        return entry[1]

    def _account(self, path: str, nbytes: int) -> None:
        with self._lock:
            self._calls[path] = self._calls.get(path, 0) + 1
            self._bytes[path] = self._bytes.get(path, 0) + nbytes

    @property
    def native(self) -> bool:
        """Whether small calls take the native submission path (CUDA, extension built with it)."""
        return self._native is not None

    def close(self) -> None:
        """Free the native copy plans (the engine is closing). Idempotent."""
        self._finalizer()

    def layer_slice(self, pool: BlockPool | LayerMajorPool, start: int, stop: int) -> LayerSlice:
        """Layers ``[start, stop)`` of ``pool``, made once per range (so its geometry is cached like a pool's).

        Raises:
            ValueError: a chunked pool (engine layouts: a layer is not one region), or a bad range.
        """
        if isinstance(pool, pool_kinds.ChunkedPool):
            raise ValueError(
                "layer-wise copies (layers=) are not supported for chunked GPU pools (engine layouts); "
                "copy whole blocks"
            )
        key = (id(pool), start, stop)
        view = self._slices.get(key)
        if view is None or view.pool is not pool:
            view = self._slices[key] = LayerSlice(pool, start, stop)
        return view

    def plan(self, src_pool: Side, s: np.ndarray, dst_pool: Side, d: np.ndarray, num_tokens: int | None) -> CopyPlan:
        """The path :meth:`build` takes for these arguments."""
        if isinstance(src_pool, pool_kinds.ChunkedPool) or isinstance(dst_pool, pool_kinds.ChunkedPool):
            assert not isinstance(src_pool, LayerSlice) and not isinstance(dst_pool, LayerSlice)  # refused by validate
            return self._chunked_plan(src_pool, s, dst_pool, d)
        return self._plan(
            self._pair(src_pool, dst_pool, src_pool.layout.tokens_per_block if num_tokens is None else num_tokens), s, d
        )

    def _plan(
        self, info: _PairInfo, s: np.ndarray | list[int], d: np.ndarray | list[int], runs: int | None = None
    ) -> CopyPlan:
        """The copy plan of ``s`` -> ``d`` (``runs``: the runs of consecutive pairs when the caller counted them)."""
        size = len(s)
        small = isinstance(s, list)
        if runs is not None:
            pass
        elif size <= 1:
            runs = size
        elif small:  # the engine's small calls: a Python scan beats three numpy calls (and map/operator chains)
            runs = 1
            for i in range(1, size):
                if s[i] != s[i - 1] + 1 or d[i] != d[i - 1] + 1:
                    runs += 1
        else:
            runs = int(np.count_nonzero((np.diff(s) != 1) | (np.diff(d) != 1))) + 1
        if small:  # few (pairs, runs) shapes: decide each once per pair of pools, kernels flag and config
            key = (id(info), size, runs, self._kernels)  # the attributes, not the properties: this runs per call
            entry = self._plans.get(key)
            if entry is None or entry[0] is not info or entry[1] is not self._config:  # ids may be recycled
                entry = self._plans[key] = (info, self._config, self._choose(info, size, runs))
            return entry[2]
        return self._choose(info, size, runs)

    def _choose(self, info: _PairInfo, size: int, runs: int) -> CopyPlan:
        piece = info.width_bytes
        threshold = self.dma_min_chunk_bytes
        if info.rows == 1 and info.groups == 1 and (info.dense or info.layered) and runs:
            # a run of whole blocks is one contiguous piece; a run of one layer range of consecutive blocks is
            # one 2-D DMA call (rows = blocks), which leaves the SMs to the compute a layer-by-layer load overlaps
            piece *= max(1, size // runs)
        elif info.rows == 1 and runs and size >= MIN_RUN_BLOCKS * runs:
            # layer-major groups in long runs of consecutive blocks: one 2-D DMA call per run and group, whose cost is
            # per row of `piece` bytes (measured apart from scattered pieces)
            threshold = self.dma_min_row_bytes
        elif info.strided_runs and runs and piece >= self.dma_min_strided_row_bytes:
            # partial blocks host<->GPU, rows wide enough for the copy engine: one 2-D DMA call per run and group,
            # whose cost is mostly per call; it must move at least what the row calibration's calls moved where
            # DMA caught up with the kernel
            piece = info.block_bytes * size // (runs * info.groups)
            threshold = 2 * MIN_RUN_BLOCKS * self.dma_min_row_bytes
        path = choose_path(piece, self.config, on_cuda=info.on_cuda, kernels=self.kernels, threshold=threshold)
        one_piece = runs == 1 and info.rows == 1 and info.groups == 1 and info.dense
        if path == "kernel" and one_piece and self.config.copy_path == "auto":
            path = "dma"  # one contiguous piece on both sides: one DMA call (see the module docstring)
        return CopyPlan(path, piece, info.groups, runs)

    def build(
        self,
        src_pool: Side,
        s: np.ndarray | list[int],
        dst_pool: Side,
        d: np.ndarray | list[int],
        num_tokens: int | None,
        *,
        stream: Stream | None = None,
    ) -> Op:
        """One op copying blocks ``s`` of ``src_pool`` to blocks ``d`` of ``dst_pool`` (validated by the caller).

        The op enqueues work on the current CUDA stream (the engine runs it under its copy stream), or runs
        the CPU reference when it is called (emulated device, host threads). Never a per-chunk Python loop.

        Args:
            src_pool: the source pool.
            s: source block indices (an int64 array, or a list of ints for the engine's small calls).
            dst_pool: the destination pool.
            d: destination block indices, as ``s``.
            num_tokens: tokens per block to copy, ``None`` for whole blocks.
            stream: the CUDA stream the op will run on. With it, a kernel or DMA copy of at most
                :data:`~tiered_kv.pools.SMALL_CALL_BLOCKS` pairs is one ``copy_blocks_list`` call naming the
                stream by its handle (no index tensors, no current-stream switch; the op carries
                ``explicit_stream = True`` for :meth:`~tiered_kv.device.Stream.submit`).
        """
        if isinstance(src_pool, pool_kinds.ChunkedPool) or isinstance(dst_pool, pool_kinds.ChunkedPool):
            assert not isinstance(src_pool, LayerSlice) and not isinstance(dst_pool, LayerSlice)  # refused by validate
            return self._chunked_op(
                src_pool, np.asarray(s, dtype=np.int64), dst_pool, np.asarray(d, dtype=np.int64), num_tokens
            )
        layout = src_pool.layout
        n = layout.tokens_per_block if num_tokens is None else num_tokens
        info = self._pair(src_pool, dst_pool, n)
        plan = self._plan(info, s, d)
        size = len(s)
        nbytes = size * info.block_bytes
        self._account(plan.path, nbytes)
        src_t, dst_t = info.src_t, info.dst_t
        if plan.path in ("kernel", "dma") and isinstance(stream, CudaStream) and size <= SMALL_CALL_BLOCKS:
            s_l = s if isinstance(s, list) else s.tolist()
            d_l = d if isinstance(d, list) else d.tolist()
            method = ops.METHOD_DMA if plan.path == "dma" else ops.METHOD_KERNEL
            if self._native is not None:  # one call into C++: no dispatcher, no torch event (NativeCopy)
                return NativeCopy(stream, self._native.submit, self._native_plan(info, n, method), s_l, d_l, nbytes)
            handle = stream.torch_stream.cuda_stream
            list_op = torch.ops.tiered_kv.copy_blocks_list.default

            def run_small() -> None:
                list_op(dst_t, src_t, s_l, d_l, n, method, handle)

            run_small.explicit_stream = True  # type: ignore[attr-defined]
            run_small.nbytes = nbytes  # type: ignore[attr-defined]
            return run_small
        if isinstance(s, list):
            s = np.asarray(s, dtype=np.int64)
        if isinstance(d, list):
            d = np.asarray(d, dtype=np.int64)
        # from_numpy shares memory and warns on read-only arrays; the engine never changes them afterwards
        s_t = torch.from_numpy(s if s.flags.writeable else s.copy())
        d_t = torch.from_numpy(d if d.flags.writeable else d.copy())
        if plan.path in ("kernel", "dma", "reference"):
            method = ops.METHOD_DMA if plan.path == "dma" else ops.METHOD_KERNEL
            op = torch.ops.tiered_kv.copy_blocks

            def run() -> None:
                op(dst_t, src_t, s_t, d_t, n, method)

            run.nbytes = nbytes  # type: ignore[attr-defined]
            return run
        return _torch_op(src_t, s, dst_t, d, n)

    def _chunk_pair(self, src_pool: Side, dst_pool: Side) -> _ChunkPair:
        """The fixed chunk table of a pair of pools involving a chunked pool (made once, kept on the device)."""
        key = (id(src_pool), id(dst_pool))
        entry = self._chunk_tables.get(key)
        if entry is None or entry.src is not src_pool or entry.dst is not dst_pool:  # ids may be recycled
            pool_kinds.check_compatible(src_pool, dst_pool)
            table = pool_kinds.block_table(src_pool, dst_pool)
            tensors = (*pool_kinds.chunk_tensors(src_pool), *pool_kinds.chunk_tensors(dst_pool))
            cuda = next((t.device for t in tensors if t.is_cuda), None)
            table_t = torch.from_numpy(table)
            on_device = table_t.to(cuda) if cuda is not None and self.kernels else None
            piece = int(table[:, 6].min()) if table.size else 0
            entry = self._chunk_tables[key] = _ChunkPair(
                src_pool, dst_pool, table_t, on_device, piece, cuda is not None
            )
        return entry

    def _chunked_plan(self, src_pool: Side, s: np.ndarray, dst_pool: Side, d: np.ndarray) -> CopyPlan:
        pair = self._chunk_pair(src_pool, dst_pool)
        path = choose_path(
            pair.piece, self.config, on_cuda=pair.on_cuda, kernels=self.kernels, threshold=self.dma_min_chunk_bytes
        )
        return CopyPlan(path, pair.piece, int(pair.table.size(0)), int(s.size))

    def _chunked_op(self, src_pool: Side, s: np.ndarray, dst_pool: Side, d: np.ndarray, num_tokens: int | None) -> Op:
        """A copy involving a :class:`~tiered_kv.pool_kinds.ChunkedPool`: one ``copy_chunk_blocks`` call."""
        if num_tokens is not None and num_tokens != src_pool.layout.tokens_per_block:
            raise ValueError("partial copies (num_tokens) are not supported for chunked GPU pools; copy whole blocks")
        pair = self._chunk_pair(src_pool, dst_pool)
        plan = self._chunked_plan(src_pool, s, dst_pool, d)
        nbytes = int(s.size) * src_pool.layout.bytes_per_block
        self._account(plan.path, nbytes)
        src_t, dst_t = pool_kinds.chunk_tensors(src_pool), pool_kinds.chunk_tensors(dst_pool)
        s_l, d_l = s.tolist(), d.tolist()
        method = ops.METHOD_DMA if plan.path == "dma" else ops.METHOD_KERNEL
        table, on_device = pair.table, pair.on_device
        if plan.path == "torch":  # CUDA without the extension: the reference op runs on CUDA tensors too

            def run_ref() -> None:
                opdefs.copy_chunk_blocks_ref(dst_t, src_t, table, None, s_l, d_l, method)

            return run_ref
        op = torch.ops.tiered_kv.copy_chunk_blocks.default

        def run() -> None:
            op(dst_t, src_t, table, on_device, s_l, d_l, method)

        run.nbytes = nbytes  # type: ignore[attr-defined]
        return run

    def statistics(self) -> CopierStatistics:
        """Calls and bytes per path so far."""
        with self._lock:
            calls, nbytes = dict(self._calls), dict(self._bytes)
        return CopierStatistics(calls, nbytes)

    def __repr__(self) -> str:
        kernels = "kernels" if self.kernels else ("no kernels" if self.device.is_cuda else "emulated")
        cfg = self.config
        return f"<Copier {kernels} dma>={self.dma_min_chunk_bytes}B path={cfg.copy_path} calls={self._calls}>"


class NativeCopy:
    """A small copy on a CUDA stream through the native submission path: one call into C++ per copy.

    A :class:`~tiered_kv.handlers.Job` of its own: ``start(done)`` issues the DMA or the kernel, records a pooled
    event and enqueues the completion signal in that one call (:meth:`~tiered_kv.device.CudaStream.notify_native`).
    Calling it (``op()``, as other ops are called under :meth:`~tiered_kv.device.Stream.submit`) issues the copy on
    its stream without a completion. ``beside``: signal the completion from the stream's side stream (the batch's
    ``more_follows``, see :meth:`~tiered_kv.device.CudaStream.notify`).
    """

    __slots__ = ("_issue", "beside", "error", "failed", "lane", "nbytes", "stream")
    explicit_stream = True

    def __init__(
        self, stream: CudaStream, submit: Callable[..., Event], plan: int, s: list[int], d: list[int], nbytes: int = 0
    ):
        self.stream = stream
        self.lane: CudaStream = stream  # the stream it runs on (Job.lane)
        self.nbytes = nbytes  # what the copy moves (the stream expects its end from it)
        self.beside = False
        self.failed = False  # the call into C++ raised: the error reaches done() at the event
        self.error: BaseException | None = None  # that error
        self._issue: Callable[[int, int, int], Event] = functools.partial(submit, plan, s, d)

    def __call__(self) -> None:
        """Issue the copy on its stream, without a completion (an op under ``Stream.submit``)."""
        self._issue(self.stream.torch_stream.cuda_stream, 0, 0)

    def start(self, done: Callable[[BaseException | None], None]) -> Event:
        """Issue the copy and its completion: ``done(None)`` from the stream's waiter once it has run.

        An error of the call itself (nothing enqueued) reaches ``done`` in stream order, like an op's error.
        """
        try:
            return self.stream.notify_native(self._issue, lambda: done(None), beside=self.beside, nbytes=self.nbytes)
        except (RuntimeError, ValueError, IndexError, TypeError) as exc:
            if self.stream.closed:
                raise
            error = exc  # `exc` is unbound after the except block; the callback runs later
            self.failed = True
            self.error = error
            return self.stream.notify(lambda: done(error))

    def ok_at_event(self) -> bool:
        """True when the copy was issued: reaching its event is its whole completion (``Job.ok_at_event``)."""
        return not self.failed

    def error_at_event(self) -> BaseException | None:
        """The error ``done`` will report, known once the event is reached (``Job.error_at_event``)."""
        return self.error


def _free_native_plans(plans: dict[tuple[int, int], tuple[_PairInfo, int]]) -> None:
    for _info, plan in plans.values():
        with contextlib.suppress(Exception):  # at interpreter exit the op may already be gone
            torch.ops.tiered_kv.copy_plan_free(plan)
    plans.clear()


def choose_path(
    piece_bytes: int, config: EngineConfig, *, on_cuda: bool, kernels: bool, threshold: int | None = None
) -> str:
    """The path for a copy whose contiguous pieces are ``piece_bytes`` (see the module docstring).

    ``threshold``: the DMA piece size in use (a copier's measured one); default the config's, else
    :data:`DEFAULT_DMA_MIN_CHUNK`.
    """
    if not on_cuda:
        return "reference"
    if not kernels:
        return "torch"
    if config.copy_path != "auto":
        return config.copy_path
    if threshold is None:
        threshold = config.dma_min_chunk_bytes if config.dma_min_chunk_bytes is not None else DEFAULT_DMA_MIN_CHUNK
    return "dma" if piece_bytes >= threshold else "kernel"


#: The DMA piece size where none is configured or measured (no kernels, a forced path).
DEFAULT_DMA_MIN_CHUNK = 2 << 20

#: Piece sizes the calibration compares, and the bytes it moves per size and direction.
_CALIBRATION_PIECES = tuple(16 << (10 + i) for i in range(8))  # 16 KiB .. 2 MiB
_CALIBRATION_BYTES = 32 << 20
_CALIBRATION_TURNS = 9  # per size and kind: the kernel and DMA each copy both ways this many times, taking turns
_CALIBRATION_GROUPS = 8  # layer-major groups (tensors) of the row calibration
_DMA_WINS = 0.98  # a size's median DMA/kernel time ratio at most this: DMA wins there
_CLOSE_CALL = 1.06  # a losing size's median ratio at most this, just below the threshold: sampled again
_KINDS = ("pieces", "rows")
_calibrated: dict[int, tuple[int, int]] = {}  # device index -> (piece threshold, row threshold)
_measured_ratios: dict[int, tuple[list[float], list[float]]] = {}  # device index -> (piece ratios, row ratios)
_calibration_lock = threading.Lock()

#: Row widths the strided calibration compares (partial-block rows: ``num_tokens * head_dim`` elements), and what it
#: keeps per device: the threshold (:data:`NEVER` if DMA won at none) and the median ratio per width.
_STRIDED_WIDTHS = (256, 512, 1024, 2048)
#: The row pitch the strided calibration measures at (16 tokens of 128 16-bit elements: the common block row). The
#: copy engine's rate depends on it (an H200: rows of 1 KiB every 4 KiB at the rate of a contiguous copy; every
#: 16 KiB, 1.1x the kernel's time); partial copies of pools with another pitch keep the kernel.
STRIDED_PITCH = 4096
_SLEEP_AHEAD_CYCLES = 1 << 18  # ~130 µs at 2 GHz: longer than issuing the op takes
_STRIDED_BYTES = 64 << 20  # scratch per side: 32 blocks of 512 rows every STRIDED_PITCH bytes
_calibrated_strided: dict[int, tuple[int, list[float]]] = {}

#: A threshold no piece or row reaches (a path that is never taken).
NEVER = 1 << 62

#: A layer-major copy whose runs of consecutive blocks average at least this many blocks moves each group's run as
#: one 2-D DMA call (a row per block): the DMA row size applies (:func:`calibrated_dma_row_threshold`). The
#: calibration measures runs of twice that.
MIN_RUN_BLOCKS = 32


def calibrated_dma_threshold(device: torch.device) -> int:
    """The smallest piece size from which batched DMA copies are as fast as the copy kernel on this GPU.

    Measured once per process and device, on scratch memory (32 MiB pinned and on the device, freed after):
    for each piece size from 16 KiB to 2 MiB, scattered pieces copied both ways by each path, the two paths taking
    nine turns, every size measured once per turn (wall times, host issue included; the median of the per-turn
    ratios; :func:`measured_dma_ratios` gives them). The threshold is the smallest
    size from which DMA beats the kernel by at least 2 % at every larger size (a noisy host must not send small
    pieces to DMA, which is up to 10x slower there); ``4 MiB`` if the kernel leads even at 2 MiB. A close call
    (DMA losing the size just below the threshold by at most 6 %) is measured again, nine more turns, and that
    second look decides it (:func:`_decide_dma_thresholds`). Env
    ``TIERED_KV_DMA_MIN_CHUNK`` or ``EngineConfig(dma_min_chunk_bytes=...)`` skip it.
    """
    return _calibration(device)[0]


def calibrated_dma_row_threshold(device: torch.device) -> int:
    """The smallest row size from which 2-D DMA copies of runs of blocks are as fast as the copy kernel on this GPU.

    A layer-major pool's run of consecutive blocks is one ``cudaMemcpy2DAsync`` per group (a row per block, the
    host side strided): the copy engine's cost is per row, not per call, and it reaches the kernel at smaller rows
    than scattered pieces do (an H100 host: 32 KiB rows against 64-128 KiB pieces). Measured with
    :func:`calibrated_dma_threshold` (same scratch, same rule), on eight layer-major groups copied in runs of
    ``2 * MIN_RUN_BLOCKS`` blocks.
    """
    return _calibration(device)[1]


def calibrated_dma_strided_threshold(device: torch.device) -> int:
    """The smallest partial-block row width from which one 2-D DMA call beats the copy kernel, host<->GPU.

    A partial copy (tokens ``[0, n)`` of every row) between pinned host memory and the GPU, in runs of consecutive
    blocks whose rows go on from block to block, is one ``cudaMemcpy2DAsync`` per run and group, a row of
    ``n * head_dim`` elements each, for pools whose rows are :data:`STRIDED_PITCH` bytes apart. There the copy
    engine moved rows of 512 B and more at the rate of one contiguous copy, rows of 256 B at ~0.85 of it, while the
    kernel's accesses to pinned memory stop at ~0.93 (an H100 and an H200, ``kernels/probes/partial_probe.cu
    host``). Each call costs ~2.5 µs of its own, which the row calibration measures (:meth:`Copier.plan` asks for
    calls as large as that calibration's at its threshold).

    Measured once per process and device like :func:`calibrated_dma_threshold`: per width in
    :data:`_STRIDED_WIDTHS`, rows of that width every :data:`STRIDED_PITCH` bytes (512 rows per block, 32 blocks),
    copied each way in one call by each path, nine turns; the median of the per-turn ratios of device times. The
    threshold is the smallest width from which DMA wins by at least 2 % at every larger width; :data:`NEVER` if it
    wins at none, or if the measurement failed.
    """
    index = device.index if device.index is not None else torch.cuda.current_device()
    with _calibration_lock:
        found = _calibrated_strided.get(index)
        if found is None:
            try:
                medians = [statistics.median(r) for r in _strided_samples(index).values()]
                found = (_strided_threshold_of(medians), medians)
                log.info("tiered_kv: 2-D DMA of partial rows from %d bytes on cuda:%d (measured)", found[0], index)
            except (RuntimeError, torch.cuda.OutOfMemoryError) as exc:
                found = (NEVER, [])
                log.warning("tiered_kv: could not measure partial rows by DMA (%s); the kernel copies them", exc)
            _calibrated_strided[index] = found
    return found[0]


def _strided_threshold_of(medians: list[float]) -> int:
    """The threshold the median DMA/kernel ratios of :data:`_STRIDED_WIDTHS` lead to (:data:`NEVER` if none won)."""
    threshold = NEVER
    for width, ratio in zip(reversed(_STRIDED_WIDTHS), reversed(medians), strict=True):
        if not ratio <= _DMA_WINS:  # NaN loses too
            break
        threshold = width
    return threshold


def _strided_samples(index: int, turns: int = _CALIBRATION_TURNS) -> dict[int, list[float]]:
    """Per-turn DMA/kernel device-time ratios per width of :data:`_STRIDED_WIDTHS`: one 2-D call each way per path.

    The geometry of a partial copy: blocks of 512 rows of :data:`STRIDED_PITCH` bytes, the first ``width`` bytes of
    each copied (4-32 MiB per copy). Device time: CUDA events around the op, issued behind a sleep kernel, so that no
    host gap between them is counted. Both paths are one call each; their host time is not what differs here.
    """
    with torch.cuda.device(index):
        host = torch.empty(_STRIDED_BYTES, dtype=torch.uint8, pin_memory=True)
        stream = torch.cuda.Stream()
        gpu = scratch_on(stream, _STRIDED_BYTES, f"cuda:{index}")
        op = torch.ops.tiered_kv.copy_blocks
        cases = []
        for width in _STRIDED_WIDTHS:
            blocks = _STRIDED_BYTES // (512 * STRIDED_PITCH)  # blocks of 512 rows of STRIDED_PITCH bytes
            idx = torch.arange(blocks)
            shape = (blocks, 512, STRIDED_PITCH // width, width)
            cases.append((width, [host.view(shape)], [gpu.view(shape)], idx))
        out: dict[int, list[float]] = {width: [] for width in _STRIDED_WIDTHS}
        for turn in range(turns + 1):
            order = (ops.METHOD_KERNEL, ops.METHOD_DMA) if turn % 2 else (ops.METHOD_DMA, ops.METHOD_KERNEL)
            for width, host_side, gpu_side, idx in cases:
                t = dict.fromkeys(order, 0.0)
                for method in order:
                    for dst, src in ((gpu_side, host_side), (host_side, gpu_side)):
                        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                        stream.synchronize()
                        with torch.cuda.stream(stream):
                            torch.cuda._sleep(_SLEEP_AHEAD_CYCLES)  # busy while the host issues: device time only
                            start.record(stream)
                            op(dst, src, idx, idx, 1, method)  # token 0: rows of `width` bytes every STRIDED_PITCH
                            end.record(stream)
                        end.synchronize()
                        t[method] += start.elapsed_time(end)
                if turn:
                    out[width].append(t[ops.METHOD_DMA] / t[ops.METHOD_KERNEL])
        del host, gpu, cases
    return out


def _calibration(device: torch.device) -> tuple[int, int]:
    index = device.index if device.index is not None else torch.cuda.current_device()
    with _calibration_lock:
        found = _calibrated.get(index)
        if found is None:
            try:
                found = _measure_dma_threshold(index)
                log.info(
                    "tiered_kv: DMA from %d KiB pieces, %d KiB rows of block runs on cuda:%d (measured)",
                    found[0] >> 10,
                    found[1] >> 10,
                    index,
                )
            except (RuntimeError, torch.cuda.OutOfMemoryError) as exc:  # no scratch memory, a CUDA error
                found = (DEFAULT_DMA_MIN_CHUNK, DEFAULT_DMA_MIN_CHUNK)
                log.warning("tiered_kv: could not measure the DMA piece size (%s); using %d bytes", exc, found[0])
            _calibrated[index] = found
    return found


def _measure_dma_threshold(index: int) -> tuple[int, int]:
    """(piece threshold, row threshold): see :func:`calibrated_dma_threshold`, :func:`calibrated_dma_row_threshold`."""
    piece, row, medians = _decide_dma_thresholds(functools.partial(_dma_samples, index))
    _measured_ratios[index] = medians
    return piece, row


#: Calibration samples: per kind (``"pieces"``, ``"rows"``) and size, the per-turn DMA/kernel time ratios.
_Samples = dict[str, dict[int, list[float]]]


def _decide_dma_thresholds(
    sample: Callable[[tuple[int, ...]], _Samples],
) -> tuple[int, int, tuple[list[float], list[float]]]:
    """The rule of the calibration, given ``sample(sizes) -> {"pieces"|"rows": {size: [per-turn ratios]}}``.

    Every size is sampled once. Then the size just below each kind's threshold, where the decision is close (its
    median ratio at most :data:`_CLOSE_CALL`: DMA loses by a few percent or less), is sampled again and that second
    look decides it, until no close call is left that has not been looked at twice. A burst of host noise that made
    DMA lose one size by a few percent (two H100 hosts: 64 KiB pieces at 1.02-1.04 in 3 of 18 runs, against
    0.93-0.96 in the rest) is undone; a size where the kernel leads by more is not sampled again (16 KiB pieces:
    DMA 1.4-2.6x slower), and a size is never sampled again because DMA won it. Returns (piece threshold, row
    threshold, (piece medians, row medians)).
    """
    samples = sample(_CALIBRATION_PIECES)
    looked_again: set[tuple[str, int]] = set()
    while True:
        close: dict[int, list[str]] = {}
        for kind, by_size in samples.items():
            medians = [statistics.median(by_size[size]) for size in _CALIBRATION_PIECES]
            below = [size for size in _CALIBRATION_PIECES if size < _threshold_of(medians)]
            if below and medians[len(below) - 1] <= _CLOSE_CALL and (kind, below[-1]) not in looked_again:
                close.setdefault(below[-1], []).append(kind)
        if not close:
            break
        second = sample(tuple(sorted(close)))
        for size, kinds in close.items():
            for kind in kinds:
                samples[kind][size] = second[kind][size]
                looked_again.add((kind, size))
    pieces, rows = ([statistics.median(samples[kind][size]) for size in _CALIBRATION_PIECES] for kind in _KINDS)
    return _threshold_of(pieces), _threshold_of(rows), (pieces, rows)


def _dma_samples(index: int, sizes: tuple[int, ...], turns: int = _CALIBRATION_TURNS) -> _Samples:
    """Per-turn DMA/kernel time ratios per size in ``sizes``, for scattered pieces and runs of layer-major rows.

    Every turn measures every size and kind once, the two paths back to back (alternating which goes first), so
    that a burst of host noise (another tenant, a thread starting) spreads over all sizes instead of deciding
    one. One warm-up turn first (lazy driver state, the first batch call of each path), not counted.
    """
    import time

    with torch.cuda.device(index):
        host = torch.empty(_CALIBRATION_BYTES, dtype=torch.uint8, pin_memory=True)
        stream = torch.cuda.Stream()
        gpu = scratch_on(stream, _CALIBRATION_BYTES, f"cuda:{index}")
        op = torch.ops.tiered_kv.copy_blocks

        def seconds(method: int, host_side: list[torch.Tensor], gpu_side: list[torch.Tensor], s: torch.Tensor) -> float:
            d = torch.arange(s.numel())
            total = 0.0
            for dst, src in ((gpu_side, host_side), (host_side, gpu_side)):
                stream.synchronize()
                t0 = time.perf_counter()
                with torch.cuda.stream(stream):
                    op(dst, src, s, d, 1, method)
                stream.synchronize()
                total += time.perf_counter() - t0
            return total

        # per size: (scattered whole blocks of `piece` bytes, [blocks, 1, tokens, bytes]) and (layer-major groups
        # of `piece` bytes per block, blocks in runs: a 2-D DMA call per run and group)
        cases: list[tuple[str, int, list[torch.Tensor], list[torch.Tensor], torch.Tensor]] = []
        for piece in sizes:
            n = _CALIBRATION_BYTES // piece
            rng = np.random.default_rng(piece)
            scattered = torch.from_numpy(rng.permutation(n))
            cases.append(("pieces", piece, [host.view(n, 1, 1, piece)], [gpu.view(n, 1, 1, piece)], scattered))
            blocks = n // _CALIBRATION_GROUPS
            run = min(2 * MIN_RUN_BLOCKS, blocks)  # the largest pieces fill fewer blocks than one run: one run then
            starts = rng.permutation(blocks // run) * run
            in_runs = torch.from_numpy((starts[:, None] + np.arange(run)[None, :]).reshape(-1))
            layered = list(gpu.view(_CALIBRATION_GROUPS, blocks, 1, 1, piece).unbind(0))
            cases.append(("rows", piece, [host.view(blocks, _CALIBRATION_GROUPS, 1, piece)], layered, in_runs))
        out: _Samples = {kind: {size: [] for size in sizes} for kind in _KINDS}
        for turn in range(turns + 1):
            order = (ops.METHOD_KERNEL, ops.METHOD_DMA) if turn % 2 else (ops.METHOD_DMA, ops.METHOD_KERNEL)
            for kind, size, host_side, gpu_side, s in cases:
                t = {method: seconds(method, host_side, gpu_side, s) for method in order}
                if turn:  # the first turn warms up
                    out[kind][size].append(t[ops.METHOD_DMA] / t[ops.METHOD_KERNEL])
        del host, gpu, cases
    return out


def measured_dma_ratios(device: torch.device) -> dict[str, dict[int, float]] | None:
    """The calibration's median DMA/kernel time ratio per size on ``device`` (``None`` if it has not run there).

    ``{"pieces": {size: ratio}, "rows": {size: ratio}}``, and ``"strided": {width: ratio}`` once
    :func:`calibrated_dma_strided_threshold` has measured; a ratio at most 0.98 is a DMA win. For reports (the
    kernels benchmark prints it next to the thresholds it led to).
    """
    index = device.index if device.index is not None else torch.cuda.current_device()
    found = _measured_ratios.get(index)
    if found is None:
        return None
    pieces, rows = found
    sizes = _CALIBRATION_PIECES
    out = {"pieces": dict(zip(sizes, pieces, strict=True)), "rows": dict(zip(sizes, rows, strict=True))}
    strided = _calibrated_strided.get(index)
    if strided is not None and strided[1]:
        out["strided"] = dict(zip(_STRIDED_WIDTHS, strided[1], strict=True))
    return out


def _threshold_of(medians: list[float]) -> int:
    """The threshold the median DMA/kernel ratios of :data:`_CALIBRATION_PIECES` lead to (a win: at most 0.98)."""
    return _smallest_from_which([r <= _DMA_WINS for r in medians])


def _smallest_from_which(dma_ok: list[bool]) -> int:
    """The smallest calibration size from which DMA won at every larger size (twice the largest if none)."""
    threshold = 2 * _CALIBRATION_PIECES[-1]
    for piece, ok in zip(reversed(_CALIBRATION_PIECES), reversed(dma_ok), strict=True):
        if not ok:
            break
        threshold = piece
    return threshold


def _torch_op(src_t: list[torch.Tensor], s: np.ndarray, dst_t: list[torch.Tensor], d: np.ndarray, n: int) -> Op:
    """CUDA without the extension: ``copy_`` per run and per group, all enqueued on the current stream.

    A strided host read would run on the CPU at enqueue time (torch makes it contiguous first), racing
    pending writes; so a host side is always moved as whole contiguous blocks and sliced on the GPU (host
    pools are block-major; only GPU pools are layer-major).
    """
    tokens = src_t[0].shape[-2]
    groups, rows, _row, width = opdefs.block_geometry(dst_t, src_t, n)
    runs = merge_runs(s, d)
    src0, dst0 = src_t[0], dst_t[0]
    whole = n == tokens and groups == 1 and src0.is_contiguous() and dst0.is_contiguous()

    def groups_of(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        return opdefs.normalize_groups(tensors, groups, rows)

    if whole or src0.device == dst0.device:

        def same_or_whole() -> None:
            if whole:
                for a, b, k in runs:
                    dst0[b : b + k].copy_(src0[a : a + k], non_blocking=True)
                return
            sg, dg = groups_of(src_t), groups_of(dst_t)
            for a, b, k in runs:
                for x, y in zip(sg, dg, strict=True):
                    y[b : b + k, :, :width].copy_(x[a : a + k, :, :width], non_blocking=True)

        return same_or_whole
    if dst0.is_cuda:

        def h2d() -> None:
            dg = groups_of(dst_t)
            for a, b, k in runs:
                scratch = src0[a : a + k].to(dst0.device, non_blocking=True)
                for x, y in zip(groups_of([scratch]), dg, strict=True):
                    y[b : b + k, :, :width].copy_(x[:, :, :width])

        return h2d

    def d2h() -> None:
        # read-modify-write through GPU scratch, so tokens [n, T) of the host block are written back unchanged
        sg = groups_of(src_t)
        for a, b, k in runs:
            if n == tokens:
                scratch = torch.empty(dst0[b : b + k].shape, dtype=dst0.dtype, device=src0.device)
            else:
                scratch = dst0[b : b + k].to(src0.device, non_blocking=True)
            for x, y in zip(sg, groups_of([scratch]), strict=True):
                y[:, :, :width].copy_(x[a : a + k, :, :width])
            dst0[b : b + k].copy_(scratch, non_blocking=True)

    return d2h
