"""The copier: the path choice (DMA or kernel) and the op that moves a batch of blocks.

Primitives:

* :class:`Copier` -- ``build(src_pool, s, dst_pool, d, num_tokens) -> op``: a callable the engine submits to a
  stream (or host thread) that copies every block pair in one batch; ``plan(...)`` says which path it takes.
* :class:`CopyPlan` -- the chosen path and the contiguous piece size it was chosen by.
* :class:`CopierStatistics` -- calls and bytes per path.
* :func:`choose_path` -- the path of a piece size; :func:`pool_tensors` -- the tensors a copy reads or writes.

Paths:

* ``"kernel"`` -- CUDA, extension loaded: one launch of the ``copy_blocks`` kernel (any layout, partial or full,
  pinned host memory read/written through unified addressing). A call of at most ``SMALL_CALL_BLOCKS`` pairs made
  with its stream takes the *native submission path* (:class:`~tiered_kv.copy.native.NativeCopy`,
  ``kernels/fast_path.cpp``): one call into C++ that checks the int-list indices, launches with bases + indices in
  the kernel's parameters when they fit (no H2D of metadata), records a pooled event and enqueues the completion
  signal -- no torch dispatcher, tensor or event per call. Without it (``EngineConfig.native_submit`` off, an
  extension built without it) the same call goes through the ``copy_blocks_list`` op.
* ``"dma"`` -- CUDA, extension loaded: ``cudaMemcpyAsync`` / ``cudaMemcpy2DAsync`` per run of blocks contiguous on
  both sides (and per layer group), issued in C++.
* ``"reference"`` -- the emulated device and host-to-host copies: the vectorized CPU reference op.
* ``"torch"`` -- CUDA without the extension (no toolkit, build failed): ``copy_`` per run and per group
  (:mod:`tiered_kv.copy.torch_fallback`), with a GPU scratch buffer where a host side would otherwise be strided.
  Correct, not fast; logged once.

The choice: a copy that is one contiguous piece on both sides (one run of whole blocks of block-major pools, e.g. a
one-block copy) goes to DMA whatever its size: one ``cudaMemcpyAsync`` moves it at the copy engine's rate, leaves
the SMs to compute, and costs less host time than a kernel launch (measured on an H100 through the torch ops: 9.3 vs
13.8 us on one host, 25.9 vs 32.6 us on a slower one). Otherwise, a copy whose contiguous pieces (one (layer, kv)
chunk for layer-major pools, a run of whole blocks for block-major ones, ``num_tokens * head_dim`` elements for
partial copies) are at least the DMA piece size goes to DMA (batched calls), smaller ones to the kernel. That size
is ``EngineConfig.dma_min_chunk_bytes`` when set, else measured on the GPU once per process
(:func:`~tiered_kv.copy.calibration.calibrated_dma_threshold`): the kernel is up to 10x faster than DMA for 4-16 KiB
pieces, and where batched DMA catches up differs by card and host (64 KiB on an H100 host in ``tiered-kv bench``'s
sweep). A layer-major copy whose blocks come in runs of consecutive blocks (on average at least
:data:`~tiered_kv.copy.calibration.MIN_RUN_BLOCKS`) is one 2-D DMA call per run and group, a row per block: it is
chosen by the row size from which such calls match the kernel, measured the same way
(:func:`~tiered_kv.copy.calibration.calibrated_dma_row_threshold`; 32 KiB rows against 64-128 KiB pieces on an H100
host). A partial copy between pinned host memory and the GPU whose rows go on from block to block (dense block-major
pools) is, in runs of consecutive blocks, one 2-D DMA call per run and group too: it takes DMA when its rows are at
least the width from which such a call beats the kernel
(:func:`~tiered_kv.copy.calibration.calibrated_dma_strided_threshold`; a probe on an H100 and an H200: one call
beats the kernel from 512 B rows every 4 KiB, where the kernel stops at ~0.93 of PCIe) and its calls move at least
what the row calibration's calls moved at that threshold (the copy engine's cost is per call).
``EngineConfig.copy_path`` forces one path.

Layer-by-layer copies (``copy(..., layers=)``, :mod:`tiered_kv.layerwise`) count a run of consecutive blocks as one
piece too: DMA moves it in one ``cudaMemcpy2DAsync`` (a row per block), and a load that is meant to overlap compute
must not take the SMs (measured on an H100: with the kernel, per-layer loads of a 32-layer prefill did not overlap
the compute at all, 1.02-1.05x the serial time).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import threading
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from .. import opdefs, ops, pool_kinds
from ..config import EngineConfig
from ..device import CudaStream, Device, Stream
from ..layer_major import LayerMajorPool, LayerSlice
from ..pools import SMALL_CALL_BLOCKS, BlockPool
from .calibration import (
    DEFAULT_DMA_MIN_CHUNK,
    MIN_RUN_BLOCKS,
    STRIDED_PITCH,
    calibrated_dma_row_threshold,
    calibrated_dma_strided_threshold,
    calibrated_dma_threshold,
)
from .native import NativeCopy
from .torch_fallback import torch_op

__all__ = ["Copier", "CopierStatistics", "CopyPlan", "Op", "Pool", "Side", "choose_path", "pool_tensors"]

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
        config: thresholds and paths (``dma_min_chunk_bytes``, ``copy_path``, ``native_submit``).

    Notes:
        On CUDA the extension is loaded (built on first use, possibly tens of seconds) when the copier is
        made, not inside a copy; ``tiered-kv build-ext`` builds it ahead of time.
    """

    def __init__(self, device: Device, config: EngineConfig) -> None:
        self.device = device
        self._config = config  # the attributes behind the `config` and `kernels` properties: no shapes decided yet
        self._kernels = False
        if device.is_cuda:
            from .. import _ext  # lazy: keeps `python -m tiered_kv._ext` from importing itself twice

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
        # the native submission path (kernels/fast_path.cpp): the extension's module of it (None: no such module),
        # the module small calls take (None also when the config's native_submit is off), and
        # (id(pair info), method) -> plan
        self._native_module: Any = None
        if self.kernels:
            from .. import _ext

            self._native_module = _ext.native()
        self._native: Any = self._native_module if config.native_submit else None
        self._native_plans: dict[tuple[int, int], tuple[_PairInfo, int]] = {}
        # (id(src pool), id(dst pool)) -> the pools, their fixed chunk table (CPU, device copy), its piece size
        self._chunk_tables: dict[tuple[int, int], _ChunkPair] = {}
        self._finalizer = weakref.finalize(self, _free_native_plans, self._native_plans)

    @property
    def config(self) -> EngineConfig:
        """What the copier decides by (thresholds, forced path, native submission); setting it forgets the shapes.

        The native submission path follows the config: a config set here with ``native_submit`` off sends the next
        small calls through the torch ops, one with it on through the native path (where the extension has it).
        The DMA piece sizes stay those found at construction (configured or measured).
        """
        return self._config

    @config.setter
    def config(self, config: EngineConfig) -> None:
        self._config = config
        self._native = self._native_module if config.native_submit else None
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
        """Whether small calls take the native submission path (CUDA, extension built with it, ``native_submit``)."""
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
        runs: int | None = None,
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
            runs: the runs of pairs consecutive on both sides, when the caller counted them (else counted here).
        """
        if isinstance(src_pool, pool_kinds.ChunkedPool) or isinstance(dst_pool, pool_kinds.ChunkedPool):
            assert not isinstance(src_pool, LayerSlice) and not isinstance(dst_pool, LayerSlice)  # refused by validate
            return self._chunked_op(
                src_pool, np.asarray(s, dtype=np.int64), dst_pool, np.asarray(d, dtype=np.int64), num_tokens
            )
        layout = src_pool.layout
        n = layout.tokens_per_block if num_tokens is None else num_tokens
        info = self._pair(src_pool, dst_pool, n)
        plan = self._plan(info, s, d, runs)
        size = len(s)
        nbytes = size * info.block_bytes
        self._account(plan.path, nbytes)
        src_t, dst_t = info.src_t, info.dst_t
        on_stream = isinstance(stream, CudaStream)
        if size <= SMALL_CALL_BLOCKS and (plan.path == "reference" or (plan.path in ("kernel", "dma") and on_stream)):
            # a small call on any device: int-list indices, read when the op is issued (the emulated device and
            # host threads run the list op's CPU reference, CUDA the native submission or the list op)
            s_l = s if isinstance(s, list) else s.tolist()
            d_l = d if isinstance(d, list) else d.tolist()
            method = ops.METHOD_DMA if plan.path == "dma" else ops.METHOD_KERNEL
            if isinstance(stream, CudaStream) and plan.path != "reference" and self._native is not None:
                # one call into C++: no dispatcher, no torch event (NativeCopy)
                return NativeCopy(stream, self._native.submit, self._native_plan(info, n, method), s_l, d_l, nbytes)
            handle = stream.torch_stream.cuda_stream if isinstance(stream, CudaStream) else 0
            list_op = torch.ops.tiered_kv.copy_blocks_list.default

            def run_small() -> None:
                list_op(dst_t, src_t, s_l, d_l, n, method, handle)

            if on_stream:
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
        return torch_op(src_t, s, dst_t, d, n)

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
