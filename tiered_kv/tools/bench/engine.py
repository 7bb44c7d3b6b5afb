"""Engine benchmark: scheduling overhead, completion wake-up latency, and GPU<->host bandwidth.

Primitives:

* :func:`run` -- ``run(quick, device) -> dict`` (rows next to their same-run baselines).
* :func:`main` -- the command line.

Rows, each next to a baseline measured in the same run:

* ``schedule``: loop-thread CPU per block for one ``copy()`` of 1, 64 and 4096 blocks (contiguous and
  scattered indices), including the completion bookkeeping, next to a bare ``call_soon_threadsafe`` round
  trip. Target: <= 2 us per block at 4096 blocks.
* ``call``: one awaited 1-block copy at a time (asyncio and uvloop): ``copy()`` returning, the device finishing
  (as the waiter saw it), the coroutine resuming, and the loop thread's CPU (``copy()`` + completion
  bookkeeping). Target: ``copy()`` returns in <= 20 us.
* ``wakeup``: from the device finishing a copy to the awaiting coroutine resuming (p50/p99), next to a bare
  ``loop.call_soon_threadsafe`` round trip from an idle thread; asyncio and uvloop, the two sides sampled in
  alternating rounds (:data:`WAKEUP_ROUNDS`). Target: p50 <= 1.2x bare.
* ``bandwidth``: offload and onboard of 256 block-major blocks of 2 MiB and 4 MiB (contiguous and scattered
  indices), and both directions at once, next to one contiguous pinned copy of the same bytes (and two at
  once). Targets on an H200/H100: >= 0.95x each direction, >= 0.9x both at once.

Run: ``python -m tiered_kv.tools.bench.engine [--quick] [--device cpu|cuda] [--json F]``.
"""

from __future__ import annotations

import asyncio
import functools
import queue
import statistics
import threading
import time
from collections.abc import Awaitable, Sequence
from typing import Any

import numpy as np
import torch

from ...engine import TransferEngine
from ...layout import KVLayout
from ...pools import Tier
from .common import bench_main, machine_info, paired_seconds, percentile

try:
    import uvloop
except ImportError:  # pragma: no cover - uvloop is a dependency on every supported platform
    uvloop = None  # type: ignore[assignment]


def _loops() -> list[tuple[str, Any]]:
    loops: list[tuple[str, Any]] = [("asyncio", asyncio.new_event_loop)]
    if uvloop is not None:
        loops.append(("uvloop", uvloop.new_event_loop))
    return loops


def _run(factory: Any, coro: Any) -> Any:
    loop = factory()
    try:
        return loop.run_until_complete(coro)
    finally:
        loop.close()


# ------------------------------------------------------------------------------------------ schedule


async def _schedule(device: str, sizes: Sequence[int], repeat: int) -> list[dict[str, Any]]:
    layout = KVLayout(num_layers=1, num_kv_heads=1, head_dim=8, tokens_per_block=4)  # tiny: measure the CPU side
    n_max = max(sizes)
    rows = []
    rng = np.random.default_rng(0)
    async with TransferEngine(layout, gpu_blocks=n_max, host_blocks=n_max, device=device) as engine:
        for n in sizes:
            for pattern in ("contiguous", "scattered"):
                src = np.arange(n) if pattern == "contiguous" else rng.permutation(n_max)[:n]
                dst = np.arange(n) if pattern == "contiguous" else rng.permutation(n_max)[:n]
                submit, total = [], []
                for _ in range(repeat):
                    c0 = time.thread_time()
                    w0 = time.perf_counter()
                    t = engine.copy(Tier.GPU, src, Tier.HOST, dst)
                    submit.append(time.perf_counter() - w0)
                    c1 = time.thread_time()
                    await t
                    # loop-thread CPU of copy() plus the completion bookkeeping, not the idle wait
                    total.append((c1 - c0) + _last_complete_cpu(engine))
                rows.append(
                    {
                        "bench": "schedule",
                        "device": engine.device.kind,
                        "blocks": n,
                        "indices": pattern,
                        "submit_us_per_block": statistics.median(submit) / n * 1e6,
                        "loop_cpu_us_per_block": statistics.median(total) / n * 1e6,
                    }
                )
    return rows


def _last_complete_cpu(engine: TransferEngine) -> float:
    """Loop-thread CPU of the last completion: its wake-up (``_complete``) and its bookkeeping (``_settle``).

    The bookkeeping runs from a callback queued behind the wake-up, so it may not have run yet when the awaiting
    coroutine resumed: settle it here (timed) so that it is counted either way.
    """
    engine._settle()
    cpu = getattr(engine, "_bench_complete_cpu", 0.0) + getattr(engine, "_bench_settle_cpu", 0.0)
    engine._bench_settle_cpu = 0.0  # type: ignore[attr-defined]
    return cpu


def _instrument(engine_cls: type[TransferEngine]) -> None:
    """Time ``_complete`` and ``_settle`` (the loop-side completion work) for the schedule and call rows."""
    original = engine_cls._complete
    if getattr(original, "_bench_wrapped", False):
        return
    settle = engine_cls._settle

    def timed(self: TransferEngine, marker: Any) -> None:
        c0 = time.thread_time()
        original(self, marker)
        self._bench_complete_cpu = time.thread_time() - c0  # type: ignore[attr-defined]

    def timed_settle(self: TransferEngine) -> None:
        c0 = time.thread_time()
        settle(self)
        spent = time.thread_time() - c0
        self._bench_settle_cpu = getattr(self, "_bench_settle_cpu", 0.0) + spent  # type: ignore[attr-defined]

    timed._bench_wrapped = True  # type: ignore[attr-defined]
    engine_cls._complete = timed  # type: ignore[method-assign]
    engine_cls._settle = timed_settle  # type: ignore[method-assign]


# ------------------------------------------------------------------------------------------ wake-up


async def _bare_roundtrip(samples: int) -> list[float]:
    """An idle thread wakes, stamps t0 and hands a result to the loop; the coroutine stamps t1."""
    loop = asyncio.get_running_loop()
    requests: queue.SimpleQueue[asyncio.Future[float] | None] = queue.SimpleQueue()

    def worker() -> None:
        while (fut := requests.get()) is not None:
            time.sleep(0.0002)  # let the loop go idle in select/epoll, as it is when a copy completes
            loop.call_soon_threadsafe(fut.set_result, time.perf_counter())

    thread = threading.Thread(target=worker, daemon=True)
    thread.start()
    out = []
    for _ in range(samples):
        fut: asyncio.Future[float] = loop.create_future()
        requests.put(fut)
        t0 = await fut
        out.append(time.perf_counter() - t0)
    requests.put(None)
    thread.join()
    return out


async def _engine_wakeup(device: str, samples: int) -> list[float]:
    layout = KVLayout(num_layers=1, num_kv_heads=1, head_dim=8, tokens_per_block=4)
    out = []
    async with TransferEngine(layout, gpu_blocks=2, host_blocks=2, device=device) as engine:
        for _ in range(samples):
            t = engine.copy(Tier.GPU, [0], Tier.HOST, [1])
            await t
            resumed = time.perf_counter()
            assert t.completed_at is not None
            out.append(resumed - t.completed_at)
    return out


async def _call(device: str, samples: int) -> dict[str, Any]:
    """One awaited 1-block GPU->host copy at a time: where its host time goes (medians, microseconds)."""
    layout = KVLayout(num_layers=1, num_kv_heads=1, head_dim=8, tokens_per_block=4)
    returns, seen, resumed, cpu = [], [], [], []
    async with TransferEngine(layout, gpu_blocks=2, host_blocks=2, device=device) as engine:
        for i in range(samples + samples // 10):
            c0 = time.thread_time()
            t0 = time.perf_counter()
            t = engine.copy(Tier.GPU, [0], Tier.HOST, [1])
            t1 = time.perf_counter()
            c1 = time.thread_time()
            await t
            t2 = time.perf_counter()
            if i < samples // 10:
                continue  # warm-up
            returns.append(t1 - t0)
            seen.append((t.completed_at or t2) - t0)
            resumed.append(t2 - t0)
            cpu.append((c1 - c0) + _last_complete_cpu(engine))
        kind = engine.device.kind
    return {
        "bench": "call",
        "device": kind,
        "copy_returns_us": percentile(returns, 50) * 1e6,
        "device_done_seen_us": percentile(seen, 50) * 1e6,
        "resumed_us": percentile(resumed, 50) * 1e6,
        "loop_cpu_us": percentile(cpu, 50) * 1e6,
    }


def _call_rows(device: str, samples: int) -> list[dict[str, Any]]:
    rows = []
    for name, factory in _loops():
        row = _run(factory, _call(device, samples))
        rows.append({"bench": row.pop("bench"), "device": row.pop("device"), "loop": name, **row})
    return rows


#: The wake-up rows alternate this many rounds of bare and engine samples, so that a host's drift during the run
#: (other tenants, frequency) falls on both sides of the ratio alike.
WAKEUP_ROUNDS = 8
_WARMUP = 20  # samples dropped at the start of each round (a fresh loop, engine and threads)


def _wakeup_rows(device: str, samples: int) -> list[dict[str, Any]]:
    rows = []
    per_round = max(1, samples // WAKEUP_ROUNDS)
    for name, factory in _loops():
        bare: list[float] = []
        eng: list[float] = []
        for _ in range(WAKEUP_ROUNDS):
            bare += _run(factory, _bare_roundtrip(per_round + _WARMUP))[_WARMUP:]
            eng += _run(factory, _engine_wakeup(device, per_round + _WARMUP))[_WARMUP:]
        rows.append(
            {
                "bench": "wakeup",
                "device": device,
                "loop": name,
                "engine_p50_us": percentile(eng, 50) * 1e6,
                "engine_p99_us": percentile(eng, 99) * 1e6,
                "bare_p50_us": percentile(bare, 50) * 1e6,
                "bare_p99_us": percentile(bare, 99) * 1e6,
                "p50_ratio": percentile(eng, 50) / percentile(bare, 50),
            }
        )
    return rows


# ------------------------------------------------------------------------------------------ bandwidth


def _contiguous(dst: torch.Tensor, src: torch.Tensor, stream: torch.cuda.Stream | None) -> None:
    """The baseline: one contiguous copy of the same bytes, on a stream of its own (CUDA) or at once (emulated)."""
    if stream is None:
        dst.copy_(src)
        return
    with torch.cuda.stream(stream):
        dst.copy_(src, non_blocking=True)
    stream.synchronize()


def _contiguous_both(
    a: tuple[torch.Tensor, torch.Tensor],
    b: tuple[torch.Tensor, torch.Tensor],
    streams: tuple[torch.cuda.Stream, torch.cuda.Stream] | None,
) -> None:
    """The baseline of both directions: two contiguous copies at once on two streams (CUDA), or back to back."""
    if streams is None:
        a[0].copy_(a[1])
        b[0].copy_(b[1])
        return
    for (dst, src), s in zip((a, b), streams, strict=True):
        with torch.cuda.stream(s):
            dst.copy_(src, non_blocking=True)
    for s in streams:
        s.synchronize()


async def _bandwidth(device: str, block_mib: Sequence[int], blocks: int, repeat: int) -> list[dict[str, Any]]:
    rows = []
    rng = np.random.default_rng(1)
    for mib in block_mib:
        tokens = 16 * mib // 2 if mib >= 2 else 8
        layout = KVLayout(num_layers=32, num_kv_heads=8, head_dim=128, tokens_per_block=tokens, dtype=torch.float16)
        if mib < 2:  # quick CPU-sized run
            layout = KVLayout(
                num_layers=4, num_kv_heads=4, head_dim=128, tokens_per_block=64 * mib, dtype=torch.float16
            )
        async with TransferEngine(layout, gpu_blocks=2 * blocks, host_blocks=2 * blocks, device=device) as engine:
            gpu, host = engine.pool(Tier.GPU).tensor, engine.pool(Tier.HOST).tensor
            gpu.view(torch.uint8).fill_(7)
            host.view(torch.uint8).fill_(3)
            nbytes = blocks * layout.bytes_per_block
            half = slice(0, blocks)
            other = slice(blocks, 2 * blocks)
            cuda = device.startswith("cuda")
            copier = torch.cuda.Stream() if cuda else None
            pair = (torch.cuda.Stream(), torch.cuda.Stream()) if cuda else None
            for pattern in ("contiguous", "scattered"):
                a = np.arange(blocks) if pattern == "contiguous" else rng.permutation(blocks)
                b = np.arange(blocks) if pattern == "contiguous" else rng.permutation(blocks)
                for direction, (st, dt) in {"offload": (Tier.GPU, Tier.HOST), "onboard": (Tier.HOST, Tier.GPU)}.items():
                    src_t = gpu[half] if st is Tier.GPU else host[half]
                    dst_t = host[half] if dt is Tier.HOST else gpu[half]
                    ours, base, ratio = await paired_seconds(
                        functools.partial(engine.copy, st, a, dt, b),
                        functools.partial(_contiguous, dst_t, src_t, copier),
                        repeat,
                        cuda,
                    )
                    rows.append(_bw_row(engine, mib, blocks, pattern, direction, nbytes, ours, base, ratio))

                def both_ways(a: np.ndarray = a, b: np.ndarray = b) -> Awaitable[object]:
                    return asyncio.gather(
                        engine.copy(Tier.GPU, a, Tier.HOST, b),
                        engine.copy(Tier.HOST, b + blocks, Tier.GPU, a + blocks),
                    )

                ours, base, ratio = await paired_seconds(
                    both_ways,
                    functools.partial(_contiguous_both, (host[half], gpu[half]), (gpu[other], host[other]), pair),
                    repeat,
                    cuda,
                )
                rows.append(_bw_row(engine, mib, blocks, pattern, "both", 2 * nbytes, ours, base, ratio))
    return rows


def _bw_row(
    engine: TransferEngine,
    mib: int,
    blocks: int,
    pattern: str,
    direction: str,
    nbytes: int,
    ours: float,
    base: float,
    ratio: float,
) -> dict[str, Any]:
    return {
        "bench": "bandwidth",
        "device": engine.device.kind,
        "block_MiB": round(engine.layout.bytes_per_block / 2**20, 3),
        "blocks": blocks,
        "indices": pattern,
        "direction": direction,
        "engine_GBps": nbytes / ours / 1e9,
        "contiguous_GBps": nbytes / base / 1e9,
        "ratio": ratio,
    }


# ------------------------------------------------------------------------------------------ entry


def run(quick: bool = False, device: str = "auto") -> dict[str, Any]:
    """Run every row; return ``{"name", "machine", "rows", "notes"}``."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    _instrument(TransferEngine)
    rows: list[dict[str, Any]] = []
    factory = uvloop.new_event_loop if uvloop is not None else asyncio.new_event_loop
    rows += _run(factory, _schedule(device, (1, 64, 4096), 5 if quick else 20))
    rows += _call_rows(device, 200 if quick else 2000)
    rows += _wakeup_rows(device, 200 if quick else 2000)
    if device.startswith("cuda"):
        rows += _run(factory, _bandwidth(device, (2, 4), 256, 3 if quick else 10))
    else:
        rows += _run(factory, _bandwidth(device, (1,), 64, 3))
    notes = [
        "schedule: loop-thread CPU time of copy() + completion bookkeeping, per block (uvloop)",
        "call: medians of one awaited 1-block copy at a time; loop_cpu = thread CPU of copy() + completion bookkeeping",
        "wakeup: device done -> awaiting coroutine resumed; bare = idle thread -> call_soon_threadsafe -> coroutine",
        "bandwidth: wall time from copy() to the awaiting coroutine resuming; "
        "baseline = one contiguous copy_ of the same bytes; the two take turns, ratio = median over turns of "
        "baseline / engine (GB/s columns: medians)",
    ]
    if not device.startswith("cuda"):
        notes.append("emulated device: bandwidth rows are CPU memcpy, not PCIe; GPU figures come only from a CUDA run")
    return {"name": "engine", "machine": machine_info(device), "rows": rows, "notes": notes}


def main(argv: Sequence[str] | None = None) -> int:
    """Command line entry point."""
    return bench_main("engine", run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
