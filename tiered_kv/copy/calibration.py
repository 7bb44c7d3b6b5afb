"""The DMA calibration: from which piece, row and partial-row sizes DMA copies as fast as the copy kernel.

Primitives:

* :func:`calibrated_dma_threshold` -- the piece size from which batched DMA matches the kernel (scattered
  pieces), measured once per process and GPU.
* :func:`calibrated_dma_row_threshold` -- the row size from which 2-D DMA calls over runs of blocks match it
  (layer-major pools), measured with the piece size.
* :func:`calibrated_dma_strided_threshold` -- the partial-block row width from which one 2-D DMA call beats it
  between pinned host memory and the GPU.
* :func:`measured_dma_ratios` -- the median DMA/kernel time ratios those thresholds came from (for reports).
* :data:`DEFAULT_DMA_MIN_CHUNK`, :data:`MIN_RUN_BLOCKS`, :data:`STRIDED_PITCH`, :data:`NEVER` -- the sizes the
  copier's path choice (:mod:`tiered_kv.copy.copier`) and these measurements share.

Each measurement runs on scratch memory (pinned host memory, and device memory taken on the calibration's own
stream, :func:`~tiered_kv.device.scratch_on`), freed after; a failed measurement falls back to a threshold that
keeps the kernel.
"""

from __future__ import annotations

import functools
import logging
import statistics
import threading
from collections.abc import Callable

import numpy as np
import torch

from .. import ops
from ..device import scratch_on

__all__ = [
    "DEFAULT_DMA_MIN_CHUNK",
    "MIN_RUN_BLOCKS",
    "NEVER",
    "STRIDED_PITCH",
    "calibrated_dma_row_threshold",
    "calibrated_dma_strided_threshold",
    "calibrated_dma_threshold",
    "measured_dma_ratios",
]

log = logging.getLogger(__name__)


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
    host``). Each call costs ~2.5 µs of its own, which the row calibration measures
    (:meth:`~tiered_kv.copy.copier.Copier.plan` asks for calls as large as that calibration's at its threshold).

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
