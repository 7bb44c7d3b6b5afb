"""Timeline probe (CUDA): where the wall time of one large engine copy goes.

Primitives:

* :func:`timeline` -- one case's split; :func:`main`.

For each case, a few awaited copies run under torch's profiler (CPU and CUDA activity); per call the trace
gives the host time before the first device activity starts (``before_device_us``), the device's busy span
(``device_us``), and the time from the last device activity to the awaiting coroutine resuming
(``after_device_us``), next to the time ``copy()`` itself took to return. Run on a GPU::

    python -m tiered_kv.tools.bench.timeline_probe --json timeline.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from ...config import EngineConfig
from ...engine import TransferEngine
from ...layer_major import LayerMajorPool
from ...layout import KVLayout
from ...pools import Tier

__all__ = ["main", "timeline"]

_DEVICE_CATS = {"kernel", "gpu_memcpy", "gpu_memset"}


async def _profiled_calls(
    engine: TransferEngine, src: Tier, s: np.ndarray, dst: Tier, d: np.ndarray, calls: int, tokens: int | None
) -> Any:
    for _ in range(3):  # warm-up: plans, staging, lazy init
        await engine.copy(src, s, dst, d, num_tokens=tokens)
    torch.cuda.synchronize()
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    returns: list[float] = []
    with torch.profiler.profile(activities=activities) as prof:
        for i in range(calls):
            torch.cuda.synchronize()
            with torch.profiler.record_function(f"tkv_call_{i}"):
                t0 = time.perf_counter()
                transfer = engine.copy(src, s, dst, d, num_tokens=tokens)
                returns.append(time.perf_counter() - t0)
                await transfer
    return prof, returns


async def _plain_calls(
    engine: TransferEngine, src: Tier, s: np.ndarray, dst: Tier, d: np.ndarray, calls: int, tokens: int | None
) -> dict[str, float]:
    """The same calls without the profiler: host clock only (``done_at`` is when the completion signal fired)."""
    keys = ("returns_us", "signal_us", "signal_to_resume_us", "total_us")
    out: dict[str, list[float]] = {k: [] for k in keys}
    for _ in range(calls):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        transfer = engine.copy(src, s, dst, d, num_tokens=tokens)
        t1 = time.perf_counter()
        await transfer
        t2 = time.perf_counter()
        done = transfer.completed_at or t2
        for k, v in zip(keys, (t1 - t0, done - t0, t2 - done, t2 - t0), strict=True):
            out[k].append(v * 1e6)
    return {k: statistics.median(v) for k, v in out.items()}


async def _host_profile(
    engine: TransferEngine, src: Tier, s: np.ndarray, dst: Tier, d: np.ndarray, tokens: int | None
) -> str:
    """A profile (cProfile) of the loop thread over one call: ``copy()`` itself, then the wait and the completion."""
    import cProfile
    import io
    import pstats

    torch.cuda.synchronize()
    submit, wait = cProfile.Profile(), cProfile.Profile()
    submit.enable()
    transfer = engine.copy(src, s, dst, d, num_tokens=tokens)
    submit.disable()
    wait.enable()
    await transfer
    wait.disable()
    out = io.StringIO()
    for title, prof in (("copy()", submit), ("await", wait)):
        out.write(f"--- {title}: calls, own us, cumulative us, function\n")
        stats = pstats.Stats(prof).stats  # type: ignore[attr-defined]
        rows = sorted(stats.items(), key=lambda kv: -kv[1][2])[:18]
        for (file, line, name), (_, calls, own, cum, _) in rows:
            where = f"{os.path.basename(file)}:{line}({name})" if line else name
            out.write(f"{calls:6d} {own * 1e6:10.1f} {cum * 1e6:10.1f}  {where}\n")
    return out.getvalue()


def _split(prof: Any, calls: int) -> list[dict[str, float]]:
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    ranges = {}
    device = []
    for e in events:
        if e.get("ph") != "X":
            continue
        name, cat = e.get("name", ""), e.get("cat", "")
        if cat == "user_annotation" and name.startswith("tkv_call_"):
            ranges[int(name.rsplit("_", 1)[1])] = (float(e["ts"]), float(e["ts"]) + float(e["dur"]))
        elif cat in _DEVICE_CATS:
            device.append((float(e["ts"]), float(e["ts"]) + float(e["dur"]), name))
    out = []
    for i in range(calls):
        if i not in ranges:
            continue
        c0, c1 = ranges[i]
        mine = [(a, b, n) for a, b, n in device if c0 <= a <= c1]
        if not mine:
            continue
        g0, g1 = min(a for a, _, _ in mine), max(b for _, b, _ in mine)
        busy = sum(b - a for a, b, _ in mine)
        out.append(
            {
                "call_us": c1 - c0,
                "before_device_us": g0 - c0,
                "device_us": g1 - g0,
                "device_busy_us": busy,
                "after_device_us": c1 - g1,
                "device_ops": len(mine),
            }
        )
    return out


async def timeline(
    name: str,
    layout: KVLayout,
    blocks: int,
    mode: str,
    layer_major: bool,
    calls: int = 5,
    tokens: int | None = None,
    *,
    scattered: bool = True,
    d2d: bool = False,
    pool_kind: str | None = None,
) -> dict[str, Any]:
    """Median split of ``calls`` awaited GPU->host and host->GPU copies of ``blocks`` blocks.

    Blocks are scattered, or in order; with ``d2d`` also a GPU->GPU copy of the first half of the GPU pool onto
    the second half.
    """
    cfg = EngineConfig.from_env(copy_path=mode)
    kwargs: dict[str, Any] = {}
    if pool_kind is not None:  # an engine layout (the layouts bench's pools): 64 KiB pieces, the given layers
        from .layouts import kind_pool

        pool, _tensors = kind_pool(pool_kind, 64 << 10, layout.num_layers, blocks, "cuda")
        layout, kwargs["gpu_pool"] = pool.layout, pool
    elif layer_major:
        kwargs["gpu_pool"] = LayerMajorPool.allocate(layout, blocks, "cuda", split_kv=True)
    else:
        kwargs["gpu_blocks"] = blocks
    rng = np.random.default_rng(1)
    s, d = (rng.permutation(blocks), rng.permutation(blocks)) if scattered else (np.arange(blocks),) * 2
    row: dict[str, Any] = {"case": name, "blocks": blocks, "mode": mode, "MiB": blocks * layout.bytes_per_block / 2**20}
    routes = {"offload": (Tier.GPU, s, Tier.HOST, d), "onboard": (Tier.HOST, s, Tier.GPU, d)}
    if d2d:
        half = blocks // 2
        routes["gpu->gpu"] = (Tier.GPU, np.arange(half), Tier.GPU, np.arange(half, 2 * half))
    async with TransferEngine(layout, host_blocks=blocks, device="cuda", config=cfg, **kwargs) as engine:
        for direction, (st, s, dt, d) in routes.items():
            prof, returns = await _profiled_calls(engine, st, s, dt, d, calls, tokens)
            parts = _split(prof, calls)
            med: dict[str, Any] = {k: statistics.median(p[k] for p in parts) for k in parts[0]} if parts else {}
            med["profiled_copy_returns_us"] = statistics.median(returns) * 1e6
            med.update(await _plain_calls(engine, st, s, dt, d, calls, tokens))
            row.setdefault("host_profile", {})[direction] = await _host_profile(engine, st, s, dt, d, tokens)
            med["path"] = next(iter(engine.copier.statistics().calls), "")
            row[direction] = med
    return row


async def _all() -> list[dict[str, Any]]:
    bm2 = KVLayout(num_layers=32, num_kv_heads=8, head_dim=128, tokens_per_block=16, dtype=torch.float16)
    lm4 = KVLayout(num_layers=4, num_kv_heads=1, head_dim=128, tokens_per_block=16, dtype=torch.bfloat16)
    lm8 = KVLayout(num_layers=32, num_kv_heads=2, head_dim=128, tokens_per_block=16, dtype=torch.bfloat16)
    lm64 = KVLayout(num_layers=4, num_kv_heads=16, head_dim=128, tokens_per_block=16, dtype=torch.bfloat16)
    rows = [
        await timeline("block-major 2 MiB", bm2, 256, "auto", False),
        await timeline("layer-major 4 KiB chunks", lm4, 8192, "kernel", True),
        await timeline("layer-major 8 KiB x 32 layers", lm8, 256, "kernel", True),
        await timeline("layer-major 64 KiB chunks", lm64, 512, "kernel", True),
        await timeline("block-major 2 MiB, 4 of 16 tokens", bm2, 128, "auto", False, tokens=4),
        # the layouts bench's rows: 128 blocks in order of a FlashAttention pool (64 KiB pieces, 32 layers), and
        # of canonical pages (each block one dense run: one DMA)
        await timeline("flash_attn 64 KiB pieces", lm8, 128, "auto", False, scattered=False, pool_kind="flash_attn"),
        await timeline("pages 64 KiB pieces", lm8, 128, "auto", False, scattered=False, pool_kind="pages"),
        # the kernels bench's partial rows: 128 blocks in order, host->GPU and GPU->GPU
        await timeline("partial 4 of 16, in order", bm2, 128, "auto", False, tokens=4, scattered=False, d2d=True),
    ]
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    """Command line entry point."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args(argv)
    rows = asyncio.run(_all())
    for r in rows:
        for direction in ("offload", "onboard", "gpu->gpu"):
            if direction not in r:
                continue
            m = r[direction]
            print(
                f"{r['case']:28} {r['mode']:6} {direction:8} blocks={r['blocks']:5} MiB={r['MiB']:6.0f}"
                + f" path={m.get('path')!s:8}"
                + "".join(f" {k}={v:.0f}" for k, v in m.items() if isinstance(v, float))
            )
    for r in rows:
        for direction, text in r.get("host_profile", {}).items():
            print(f"==== {r['case']} {r['mode']} {direction}\n{text}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
