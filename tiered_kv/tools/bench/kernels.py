"""Kernel benchmark: layer-major offload/onboard, the DMA-vs-kernel choice, partial copies, offset gather.

Primitives:

* :func:`run` -- ``run(quick, device) -> dict`` (rows next to their same-run baselines).
* :func:`main` -- the command line.

Rows, each next to a baseline measured in the same run (engine copies and their contiguous baselines take turns,
:func:`~tiered_kv.tools.bench.common.paired_seconds`: a row's ratio is the median over turns):

* ``layer_major``: engine offload and onboard of 256 blocks of a layer-major pool (32 layers x K/V tensors,
  64 KiB and 8 KiB chunks) next to one contiguous pinned copy of the same bytes, a per-chunk ``copy_`` loop
  in Python and a per-chunk ``cudaMemcpyAsync`` loop in C++ (``copy_chunks`` DMA, no merging possible).
  Targets (H200): >= 0.9x contiguous and >= 5x the per-chunk loop at 64 KiB; >= 0.8x contiguous at 8 KiB.
* ``sweep``: chunk sizes 4 KiB..4 MiB through the engine with the path forced to DMA, forced to the kernel,
  and left to the engine's choice (``EngineConfig.dma_min_chunk_bytes``), the three taking turns copy by copy;
  ``choice_vs_best`` is the median over turns of the better forced path's time over the choice's time measured
  beside it (``medians_vs_best``: the same from the three medians). Target: the choice within 5% of the better
  path at every size.
* ``partial``: ``num_tokens`` = 1/4, 1/2, 3/4 of a block, GPU->GPU (fraction of a contiguous device copy of
  the same bytes; target >= 0.8) and host->GPU (fraction of a contiguous pinned H2D; target >= 0.9). Beside
  it, what the row can reach: ``floor_us`` (the fixed cost of one awaited ``engine.copy`` on the same route:
  one block, one token), ``bound_fraction`` = contiguous / (op device time + floor) and ``vs_bound`` =
  fraction / bound_fraction; ``loop_floor_us`` (the same bytes with no engine: a torch copy, an event and the loop
  polling it into an awaited future) and ``loop_bound_fraction`` = contiguous / (op device time + loop floor),
  what any awaited API could reach with this op, and ``vs_loop_bound`` = the engine's time against that bound;
  ``op_wall_fraction`` = contiguous / the op alone synchronized (what a blocking call with this op reaches). The
  engine copy, the contiguous copy, both floors and the op alone take turns; every ratio is the median of its per-turn
  values (a host's speed drifts between turns). With 40-160 us of GPU->GPU device work against tens of microseconds per
  awaited call, the GPU->GPU rows cannot reach their target; the bounds say how close they are.
* ``layouts``: every GPU pool kind of :mod:`tiered_kv.pool_kinds` (engine layouts) at 64 KiB pieces, offload
  and onboard, next to one contiguous copy; bit-exact round trip per row (:mod:`tiered_kv.tools.bench.layouts`).
  Target: >= 0.85x contiguous.
* ``gather``: block-offset gather for 512 sequences x 2 pools x 256 blocks from a pinned table: host time
  per call, device time, end to end, next to index_select + non_blocking copy + torch arithmetic.
  Target: >= 3x faster end to end.

With ``--quick`` on a machine without CUDA every row runs the CPU reference on the emulated device, with
small sizes, and is labelled ``emulated``: it proves the program runs, not how fast a GPU is.

Run: ``python -m tiered_kv.tools.bench.kernels [--quick] [--device cpu|cuda] [--json F]``.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import statistics
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import numpy as np
import torch

from ... import _ext, ops
from ...config import EngineConfig
from ...engine import TransferEngine
from ...layer_major import LayerMajorPool
from ...layout import KVLayout
from ...pools import BlockPool, Tier
from ...testing import fill_random
from . import layouts
from .common import (
    awaited_seconds,
    bench_main,
    in_turns,
    machine_info,
    median_seconds,
    offload_onboard_seconds,
    sync,
    synced_seconds,
)

__all__ = ["main", "run"]


def _block_pool(engine: TransferEngine, tier: Tier) -> BlockPool:
    pool = engine.pool(tier)
    assert isinstance(pool, BlockPool)
    return pool


def _device_seconds(fn: Callable[[], object], repeat: int) -> float:
    """Median device seconds of ``fn``'s work on the current stream (CUDA events), host issue time excluded.

    A sleep kernel queued first keeps the stream busy while ``fn`` is issued, so the events bracket the
    GPU's execution only (with an idle stream they would also time the host's launch path).
    """
    times = []
    for i in range(repeat + 1):
        torch.cuda.synchronize()
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(2_000_000)  # ~1 ms at H100/H200 clocks: longer than any issue path below
        e0.record()
        fn()
        e1.record()
        e1.synchronize()
        if i:
            times.append(e0.elapsed_time(e1) / 1e3)
    return float(statistics.median(times))


async def _loop_floor_once(dst: torch.Tensor, src: torch.Tensor, stream: torch.cuda.Stream) -> float:
    """What any awaited copy pays on this loop, with no engine (wall seconds of one call).

    ``dst.copy_(src)`` on a side stream, an event, and the loop polling the event once per round into a future it
    awaits.

    The floor of every awaited API, whatever does its bookkeeping: a launch, the device's end, the loop seeing it.
    """
    loop = asyncio.get_running_loop()
    t0 = time.perf_counter()
    with torch.cuda.stream(stream):
        dst.copy_(src, non_blocking=True)
    event = torch.cuda.Event()
    event.record(stream)
    future = loop.create_future()

    def check() -> None:
        if event.query():
            future.set_result(None)
        else:
            loop.call_soon(check)

    loop.call_soon(check)
    await future
    return time.perf_counter() - t0


def _layout_for_chunk(chunk: int, layers: int) -> KVLayout:
    """bf16, 16 tokens x 128 head_dim per head (4 KiB): heads = chunk / 4 KiB; fp32 halves for 2 KiB."""
    if chunk < 4096:
        return KVLayout(
            num_layers=layers, num_kv_heads=1, head_dim=chunk // 64, tokens_per_block=16, dtype=torch.float32
        )
    return KVLayout(
        num_layers=layers, num_kv_heads=chunk // 4096, head_dim=128, tokens_per_block=16, dtype=torch.bfloat16
    )


def _fill(pool: LayerMajorPool, random: bool) -> None:
    # content does not change bandwidth; random bits only where it is cheap (CPU-sized runs)
    for t in pool.tensors:
        if random:
            fill_random(t)
        else:
            t.zero_()


# ------------------------------------------------------------------------------------------ layer-major


async def _layer_major(
    device: str, chunk: int, layers: int, blocks: int, repeat: int, loop_repeat: int
) -> list[dict[str, Any]]:
    cuda = device.startswith("cuda")
    layout = _layout_for_chunk(chunk, layers)
    pool = LayerMajorPool.allocate(layout, blocks, device if cuda else "cpu", split_kv=True)
    _fill(pool, not cuda)
    idx = np.arange(blocks)
    rows = []
    async with TransferEngine(layout, gpu_pool=pool, host_blocks=blocks, device=device) as engine:
        host = _block_pool(engine, Tier.HOST).tensor
        nbytes = blocks * layout.bytes_per_block
        # each engine copy next to one contiguous pinned copy of the same bytes, taking turns
        timed = await offload_onboard_seconds(engine, idx, pool.device, repeat, cuda)
        (off, contig_d2h, ratio_off), (on, contig_h2d, ratio_on) = timed["offload"], timed["onboard"]
        path = next(iter(engine.copier.statistics().calls))

        # per-chunk loops: every (block, layer, kv) chunk its own copy
        chunks = layout.num_layers * layout.kv_factor
        host_chunks = host.view(blocks, chunks, -1)

        def python_loop_d2h() -> None:
            for b in range(blocks):
                for c, t in enumerate(pool.tensors):
                    host_chunks[b, c].copy_(t[b].view(-1), non_blocking=True)

        loop_d2h = median_seconds(python_loop_d2h, loop_repeat, cuda)
        table = torch.tensor(
            [[c, b * chunk, 0, (b * chunks + c) * chunk, chunk] for b in range(blocks) for c in range(chunks)],
            dtype=torch.int64,
        )
        cxx_loop = float("nan")
        if cuda and engine.copier.kernels:
            cxx_loop = median_seconds(
                lambda: ops.copy_chunks([host], pool.tensors, table, method=ops.METHOD_DMA), repeat, cuda
            )
    for direction, ours, base, ratio in (
        ("offload", off, contig_d2h, ratio_off),
        ("onboard", on, contig_h2d, ratio_on),
    ):
        rows.append(
            {
                "bench": "layer_major",
                "device": "cuda" if cuda else "emulated",
                "chunk_KiB": chunk / 1024,
                "chunks": blocks * chunks,
                "direction": direction,
                "path": path,
                "engine_GBps": nbytes / ours / 1e9,
                "contiguous_GBps": nbytes / base / 1e9,
                "vs_contiguous": ratio,
                "py_loop_GBps": nbytes / loop_d2h / 1e9 if direction == "offload" else float("nan"),
                "cxx_loop_GBps": nbytes / cxx_loop / 1e9 if direction == "offload" else float("nan"),
                "vs_py_loop": loop_d2h / ours if direction == "offload" else float("nan"),
                "target": ">=0.9x contig, >=5x loop" if chunk >= 65536 else ">=0.8x contig",
            }
        )
    return rows


# ------------------------------------------------------------------------------------------ sweep


async def _sweep(device: str, sizes: Sequence[int], total: int, repeat: int) -> list[dict[str, Any]]:
    cuda = device.startswith("cuda")
    rows = []
    for chunk in sizes:
        layers = 4
        layout = _layout_for_chunk(chunk, layers)
        blocks = max(2, total // layout.bytes_per_block)
        pool = LayerMajorPool.allocate(layout, blocks, device if cuda else "cpu", split_kv=True)
        _fill(pool, not cuda)
        rng = np.random.default_rng(chunk)
        s, d = rng.permutation(blocks), rng.permutation(blocks)  # scattered on both sides
        modes = ("dma", "kernel", "auto")
        times: dict[str, list[float]] = {mode: [] for mode in modes}
        async with contextlib.AsyncExitStack() as stack:
            engines = {
                mode: await stack.enter_async_context(
                    TransferEngine(
                        layout,
                        gpu_pool=pool,
                        host_blocks=blocks,
                        device=device,
                        config=EngineConfig.from_env(copy_path=mode),
                    )
                )
                for mode in modes
            }
            for i in range(repeat + 1):  # the modes take turns, so that a drifting host moves all three alike
                for mode in modes[i % 3 :] + modes[: i % 3]:
                    t0 = time.perf_counter()
                    await engines[mode].copy(Tier.GPU, s, Tier.HOST, d)
                    if i:
                        times[mode].append(time.perf_counter() - t0)
            chosen = next(iter(engines["auto"].copier.statistics().calls))
        result = {mode: statistics.median(t) for mode, t in times.items()}
        nbytes = blocks * layout.bytes_per_block
        best = min(result["dma"], result["kernel"])
        # per turn: the better forced path next to the choice measured beside it; the median of those
        per_turn = statistics.median(
            min(a, b) / c for a, b, c in zip(times["dma"], times["kernel"], times["auto"], strict=True)
        )
        rows.append(
            {
                "bench": "sweep",
                "device": "cuda" if cuda else "emulated",
                "chunk_KiB": chunk / 1024,
                "MiB": nbytes / 2**20,
                "dma_GBps": nbytes / result["dma"] / 1e9,
                "kernel_GBps": nbytes / result["kernel"] / 1e9,
                "choice_GBps": nbytes / result["auto"] / 1e9,
                "choice": chosen,
                "choice_vs_best": per_turn,
                "medians_vs_best": best / result["auto"],
                "target": ">=0.95",
            }
        )
        del pool
    return rows


# ------------------------------------------------------------------------------------------ partial


async def _partial(device: str, blocks: int, repeat: int) -> list[dict[str, Any]]:
    cuda = device.startswith("cuda")
    layout = KVLayout(
        num_layers=32 if cuda else 2, num_kv_heads=8, head_dim=128, tokens_per_block=16, dtype=torch.bfloat16
    )
    rows = []
    idx = np.arange(blocks)
    half = blocks // 2
    turns = max(repeat, 20)
    async with TransferEngine(layout, gpu_blocks=blocks, host_blocks=half, device=device) as engine:
        gpu = _block_pool(engine, Tier.GPU).tensor
        host = _block_pool(engine, Tier.HOST).tensor
        side = torch.cuda.Stream(device=gpu.device) if cuda else None
        for frac in (0.25, 0.5, 0.75):
            n = int(layout.tokens_per_block * frac)
            nbytes = half * layout.partial_bytes(n)
            a = gpu.view(-1).view(torch.uint8)[:nbytes]
            b = gpu.view(-1).view(torch.uint8)[nbytes : 2 * nbytes]
            h = host.view(-1).view(torch.uint8)[:nbytes]
            one = layout.partial_bytes(1)
            # per direction: the engine copy, one contiguous copy of the same bytes, and the two floors
            cases = {
                "gpu->gpu": (
                    (Tier.GPU, idx[:half], Tier.GPU, idx[half:]),
                    functools.partial(b.copy_, a, non_blocking=True),
                    (Tier.GPU, idx[:1], Tier.GPU, idx[half : half + 1]),
                    (b[:one], a[:one]),
                ),
                "host->gpu": (
                    (Tier.HOST, idx[:half], Tier.GPU, idx[:half]),
                    functools.partial(a.copy_, h, non_blocking=True),
                    (Tier.HOST, idx[:1], Tier.GPU, idx[:1]),
                    (a[:one], h[:one]),
                ),
            }
            for direction, (route, base, single, bare) in cases.items():
                path = engine.copier.plan(engine.pool(route[0]), route[1], engine.pool(route[2]), route[3], n).path
                # the op alone (no engine: no fences, waiter thread or loop wake-up)
                op_call: Callable[[], object] | None = None
                if cuda:
                    src_i, dst_i = (torch.from_numpy(np.asarray(x).copy()) for x in (route[1], route[3]))
                    src_t = [gpu] if route[0] is Tier.GPU else [host]
                    method = ops.METHOD_DMA if path == "dma" else ops.METHOD_KERNEL
                    # the registered op itself, as the engine launches it (the public wrapper ops.copy_blocks adds
                    # index checks in Python that no engine call makes)
                    op_call = functools.partial(torch.ops.tiered_kv.copy_blocks, [gpu], src_t, src_i, dst_i, n, method)
                # Taking turns, so that a turn's ratios survive a host whose speed drifts: the engine copy; the
                # contiguous copy, the GPU synchronized before and after; the fixed cost of an awaited call on the
                # same route (one block, one token: next to no device work); then, on CUDA, the same one-token bytes
                # with no engine at all (a torch copy, an event, the loop polling it), and the op alone with the GPU
                # synchronized before and after (no awaited call at all)
                calls: list[Callable[[], Awaitable[float]]] = [
                    functools.partial(awaited_seconds, functools.partial(engine.copy, *route, num_tokens=n), cuda),
                    functools.partial(synced_seconds, base, cuda),
                    functools.partial(awaited_seconds, functools.partial(engine.copy, *single, num_tokens=1), cuda),
                ]
                if side is not None and op_call is not None:
                    calls.append(functools.partial(_loop_floor_once, *bare, side))
                    calls.append(functools.partial(synced_seconds, op_call, cuda))
                measured = await in_turns(calls, turns)
                ours, theirs, floor = measured[:3]
                nan = [float("nan")] * turns
                loop_floor, op_wall = measured[3:5] if len(measured) == 5 else (nan, nan)
                # the op's device time next to the baseline's device time: what the kernel itself achieves (NaN on
                # the emulated device)
                op_dev = base_dev = float("nan")
                if op_call is not None:
                    op_dev = _device_seconds(op_call, repeat)
                    base_dev = _device_seconds(base, repeat)
                turn = list(zip(ours, theirs, floor, loop_floor, strict=True))
                # what the row can reach: the op's device time plus one awaited call's fixed cost; what any awaited
                # API can reach with this op: its device time plus the bare loop floor (each per turn)
                rows.append(
                    {
                        "bench": "partial",
                        "device": "cuda" if cuda else "emulated",
                        "tokens": f"{n}/{layout.tokens_per_block}",
                        "direction": direction,
                        "engine_path": path,
                        "MiB_moved": nbytes / 2**20,
                        "engine_GBps": nbytes / statistics.median(ours) / 1e9,
                        "contiguous_GBps": nbytes / statistics.median(theirs) / 1e9,
                        "fraction": statistics.median(t / o for o, t, _f, _l in turn),
                        "floor_us": statistics.median(floor) * 1e6,
                        "bound_fraction": statistics.median(t / (op_dev + f) for _o, t, f, _l in turn),
                        "vs_bound": statistics.median((op_dev + f) / o for o, _t, f, _l in turn),
                        "loop_floor_us": statistics.median(loop_floor) * 1e6,
                        "loop_bound_fraction": statistics.median(t / (op_dev + lf) for _o, t, _f, lf in turn),
                        "vs_loop_bound": statistics.median((op_dev + lf) / o for o, _t, _f, lf in turn),
                        "op_wall_fraction": statistics.median(t / w for t, w in zip(theirs, op_wall, strict=True)),
                        "op_dev_GBps": nbytes / op_dev / 1e9,
                        "base_dev_GBps": nbytes / base_dev / 1e9,
                        "op_dev_fraction": base_dev / op_dev,
                    }
                )
    return rows


# ------------------------------------------------------------------------------------------ gather


def _gather(device: str, seqs: int, pools: int, max_blocks: int, repeat: int) -> list[dict[str, Any]]:
    cuda = device.startswith("cuda")
    dev = torch.device(device if cuda else "cpu")
    kv = 2
    rows_total = seqs * 2
    src = torch.randint(-1, 1 << 20, (pools, rows_total, kv, max_blocks), dtype=torch.int32, pin_memory=cuda)
    idx = torch.randperm(rows_total, dtype=torch.int64)[:seqs].to(torch.int32)
    idx = idx.pin_memory() if cuda else idx
    scale = torch.full((pools,), 2, dtype=torch.int32, pin_memory=cuda)
    v_off = torch.ones(pools, dtype=torch.int32, pin_memory=cuda)
    scale_dev, v_dev = scale.to(dev), v_off.to(dev)
    dst = torch.empty(pools, seqs, kv, max_blocks, dtype=torch.int32, device=dev)
    dst_ref = torch.empty_like(dst)

    def ours() -> None:
        ops.gather_block_offsets(dst, src, idx, scale=scale, v_offset=v_off, max_blocks=max_blocks, sentinel=-1)

    def plain() -> None:
        rows = src.index_select(1, idx.long())  # CPU gather
        staged = rows.pin_memory() if cuda else rows
        on_dev = staged.to(dev, non_blocking=True)
        out = on_dev * scale_dev.view(-1, 1, 1, 1)
        out[:, :, 1] += v_dev.view(-1, 1, 1)
        dst_ref.copy_(torch.where(on_dev == -1, on_dev, out))

    result = []
    for name, fn in (("tiered_kv.gather_block_offsets", ours), ("index_select + non_blocking copy", plain)):
        host_times, dev_times = [], []
        end_to_end = median_seconds(fn, repeat, cuda)
        for _ in range(repeat):
            sync(cuda)
            if cuda:
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                e0.record()
            t0 = time.perf_counter()
            fn()
            host_times.append(time.perf_counter() - t0)
            if cuda:
                e1.record()
                e1.synchronize()
                dev_times.append(e0.elapsed_time(e1) / 1e3)
        result.append(
            (
                name,
                statistics.median(host_times),
                statistics.median(dev_times) if dev_times else float("nan"),
                end_to_end,
            )
        )
    sync(cuda)
    assert torch.equal(dst.cpu(), dst_ref.cpu()), "gather result differs from the plain torch path"
    base_e2e = result[1][3]
    return [
        {
            "bench": "gather",
            "device": "cuda" if cuda else "emulated",
            "shape": f"{pools}x{seqs}x{kv}x{max_blocks}",
            "path": name,
            "host_us": h * 1e6,
            "device_us": d * 1e6,
            "end_to_end_us": e * 1e6,
            "speedup": base_e2e / e,
            "target": ">=3x" if name.startswith("tiered") else "",
        }
        for name, h, d, e in result
    ]


# ------------------------------------------------------------------------------------------ entry


def _calibration_note(device: torch.device) -> str:
    """The DMA-vs-kernel choice this run's engines made (the start-up calibration), with the ratios it measured."""
    from ... import copyops

    config = EngineConfig.from_env()
    if config.copy_path != "auto":
        return f"calibration: not run; copy path forced to {config.copy_path}"
    if config.dma_min_chunk_bytes is not None:
        return f"calibration: not run; DMA from {config.dma_min_chunk_bytes} byte pieces and rows (configured)"
    piece, row = copyops.calibrated_dma_threshold(device), copyops.calibrated_dma_row_threshold(device)
    strided = copyops.calibrated_dma_strided_threshold(device)
    text = f"calibration: DMA from {piece >> 10} KiB pieces and {row >> 10} KiB rows"
    text += ", partial rows host<->GPU " + ("never" if strided >= copyops.NEVER else f"from {strided} B")
    ratios = copyops.measured_dma_ratios(device)
    if ratios is None:  # the measurement failed (see the log): the default
        return text + " (not measured)"
    for kind, by_size in ratios.items():
        text += f"; {kind} DMA/kernel time " + " ".join(
            f"{f'{size >> 10}K' if size >= 1024 else f'{size}B'}:{r:.3f}" for size, r in by_size.items()
        )
    return text


def run(quick: bool = False, device: str = "auto") -> dict[str, Any]:
    """Run every row; return ``{"name", "machine", "rows", "notes"}``."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    cuda = device.startswith("cuda")
    kernels = _ext.load() if cuda else False
    rows: list[dict[str, Any]] = []
    loop = asyncio.new_event_loop()
    errors: list[str] = []

    def section(name: str, make: Callable[[], Any]) -> None:
        # one failing section (say, out of memory) must not lose the others' rows in an unattended run
        try:
            result = make()
            rows.extend(loop.run_until_complete(result) if asyncio.iscoroutine(result) else result)
        except Exception as exc:
            errors.append(f"{name} failed: {type(exc).__name__}: {exc}")

    try:
        if cuda:
            for chunk in (64 << 10, 8 << 10):
                make = functools.partial(_layer_major, device, chunk, 32, 256, 3 if quick else 10, 1 if quick else 3)
                section(f"layer_major {chunk}", make)
            sizes = [4 << 10 << k for k in range(0, 11, 2 if quick else 1)]
            section("sweep", lambda: _sweep(device, sizes, (64 if quick else 256) << 20, 3 if quick else 10))
            section("partial", lambda: _partial(device, 256, 3 if quick else 10))
            section("gather", lambda: _gather(device, 512, 2, 256, 20 if quick else 100))
            section(
                "layouts",
                lambda: layouts.rows(device, 64 << 10, 8 if quick else 32, 64 if quick else 128, 3 if quick else 10),
            )
        else:
            section("layer_major", lambda: _layer_major(device, 4096, 4, 8, 5, 1))
            section("sweep", lambda: _sweep(device, [4 << 10, 64 << 10, 1 << 20], 2 << 20, 3))
            section("partial", lambda: _partial(device, 8, 2))
            section("gather", lambda: _gather(device, 64, 2, 32, 5))
            section("layouts", lambda: layouts.rows(device, 4 << 10, 2, 4, 2))
    finally:
        loop.close()
    notes = [
        "layer_major: engine = copy() to awaiting coroutine resumed; contiguous = one copy_ of the same bytes; "
        "py_loop = one torch copy_ per chunk; cxx_loop = one cudaMemcpyAsync per chunk issued from C++",
        "sweep: GPU->host of a layer-major (split K/V) pool, scattered block indices on both sides; "
        "the path is forced per column, 'choice' is EngineConfig.dma_min_chunk_bytes at work",
        "partial: block-major pools, tokens [0, n) of every (layer, kv, head); "
        "fraction = contiguous time / engine time; "
        "op_dev = the copy_blocks op alone, device time (CUDA events behind a sleep kernel, host issue excluded), "
        "base_dev = the contiguous copy's device time measured the same way; "
        "floor_us = median wall time of an awaited engine.copy of one block, num_tokens=1, on the same route "
        "(the fixed cost of a call); bound_fraction = contiguous time / (op_dev time + floor), what the row can "
        "reach; vs_bound = fraction / bound_fraction; loop_floor_us = the same bytes with no engine (a torch copy, "
        "an event, the loop polling it into an awaited future): the floor of any awaited call; loop_bound_fraction "
        "= contiguous time / (op_dev time + loop floor), what any awaited API can reach with this op; vs_loop_bound = "
        "(op_dev time + loop floor) / engine time; op_wall_fraction = contiguous time / the op alone, the GPU "
        "synchronized before and after (no awaited call): what a blocking call with this op reaches; the five are "
        "measured taking turns, each ratio the median over turns (the bounds, vs_bound and op_wall_fraction are NaN "
        "on the emulated device, which has no device time)",
        "layouts: one row per GPU pool kind (tiered_kv.pool_kinds) and direction, all blocks in one engine call, "
        "vs one contiguous copy of the same bytes; bit_exact = a random-content round trip through the host tier",
        "gather: host_us = CPU time to issue one call; device_us = CUDA events around it; "
        "end_to_end = issue to synchronize",
    ]
    notes += errors
    if cuda and kernels:
        notes.append(_calibration_note(torch.device(device)))
    if not cuda:
        notes.append("emulated: CPU reference ops on the emulated device with small sizes; not GPU figures")
    elif not kernels:
        notes.append(f"CUDA kernels unavailable ({_ext.status()['error']}); rows show the pure-torch fallback")
    return {"name": "kernels", "machine": machine_info(device), "rows": rows, "notes": notes}


def main(argv: Sequence[str] | None = None) -> int:
    """Command line entry point."""
    return bench_main("kernels", run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
