"""Cold-call probe (CUDA): where the wall time of one awaited partial GPU->GPU copy goes, right after a synchronize.

Primitives:

* :func:`probe` -- every section below, as rows; :func:`main`.

The kernels bench's partial rows time each awaited copy right after ``torch.cuda.synchronize()``, next to a torch copy
of the same bytes. Two cases: one block, one token (the fixed cost of a call) and 128 blocks, 4 of 16 tokens (the
GPU->GPU row). Every measured call follows one loop round (``asyncio.sleep(0)``), as in a server, so the bookkeeping
the engine queues on the loop runs between calls, not inside the next one.

* ``split``: per step before the call -- ``hot`` (nothing), ``device_sync``, ``stream_sync`` (the current stream),
  ``idle`` (``time.sleep(50 us)``) -- ``returns_us`` (``copy()`` returned), ``seen_us`` (its end seen),
  ``resumed_us`` (the awaiting coroutine resumed), ``in_place`` (the share seen before the coroutine yielded) and
  ``python_us`` (a fixed pure-Python workload after the same step: how fast the host runs there); beside them a
  torch copy of the same bytes, ``launch_us`` and ``synced_us``.
* ``after_return``: from ``copy()``'s return, after a device synchronize, to its event seen done by a Python loop of
  queries, by the event's ``spin``, by the engine's in-place look (``_watch``), and by ``await``: the device's share
  against the host's.
* ``raw``: no engine -- the op and a torch copy on a side stream, an event after each: ``launch_us`` and
  ``launch_to_seen_us``.
* ``copy_profile``: cProfile of ``copy()`` (own time per function).
* ``device``: what runs on the device per call (CUPTI through torch's profiler), the engine's copy and the op alone.
* ``op_device``: the op's device time by kernel and by DMA against one contiguous copy (CUDA events behind a sleep
  kernel), 4, 8 and 12 of 16 tokens.

Run: ``python -m tiered_kv.tools.bench.cold_probe [--calls N] [--json F]`` (CUDA only).
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import functools
import io
import json
import pstats
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from ... import ops
from ...engine import TransferEngine
from ...layout import KVLayout
from ...pools import BlockPool, Tier
from .kernels import _device_seconds

__all__ = ["main", "probe"]

_Case = tuple[np.ndarray, np.ndarray, int]


def _python_work() -> float:
    t0 = time.perf_counter()
    total = 0
    for i in range(300):
        total += i * i
    return time.perf_counter() - t0


def _us(values: list[float]) -> float:
    return statistics.median(values) * 1e6


def _steps() -> dict[str, Callable[[], None]]:
    stream = torch.cuda.current_stream()
    return {
        "hot": lambda: None,
        "device_sync": torch.cuda.synchronize,
        "stream_sync": stream.synchronize,
        "idle": lambda: time.sleep(50e-6),
    }


def _bytes_views(gpu: torch.Tensor, nbytes: int) -> tuple[torch.Tensor, torch.Tensor]:
    flat = gpu.view(-1).view(torch.uint8)
    return flat[:nbytes], flat[nbytes : 2 * nbytes]


async def _split(
    engine: TransferEngine, gpu: torch.Tensor, layout: KVLayout, cases: dict[str, _Case], calls: int
) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for case, (s, d, n) in cases.items():
        a, b = _bytes_views(gpu, len(s) * layout.partial_bytes(n))
        for mode, step in _steps().items():
            for _ in range(10):  # warm-up
                step()
                await engine.copy(Tier.GPU, s, Tier.GPU, d, num_tokens=n)
            rets, seens, ress, pys, launches, synceds = [], [], [], [], [], []
            in_place0 = engine._in_place
            for _ in range(calls):
                await asyncio.sleep(0)
                step()
                pys.append(_python_work())
                step()
                t0 = time.perf_counter()
                t = engine.copy(Tier.GPU, s, Tier.GPU, d, num_tokens=n)
                t1 = time.perf_counter()
                await t
                t2 = time.perf_counter()
                rets.append(t1 - t0)
                seens.append((t.completed_at or t2) - t0)
                ress.append(t2 - t0)
                step()
                t0 = time.perf_counter()
                b.copy_(a, non_blocking=True)
                t1 = time.perf_counter()
                torch.cuda.current_stream().synchronize()
                t2 = time.perf_counter()
                launches.append(t1 - t0)
                synceds.append(t2 - t0)
            row = {
                "section": "split",
                "case": case,
                "mode": mode,
                "returns_us": _us(rets),
                "seen_us": _us(seens),
                "resumed_us": _us(ress),
                "in_place": (engine._in_place - in_place0) / calls,
                "python_us": _us(pys),
                "launch_us": _us(launches),
                "synced_us": _us(synceds),
                "ratio": statistics.median(y / x for x, y in zip(ress, synceds, strict=True)),
            }
            rows.append(row)
            print(
                f"{case:30s} {mode:12s} returns {row['returns_us']:7.1f}  seen {row['seen_us']:7.1f}  resumed "
                f"{row['resumed_us']:7.1f}  in_place {row['in_place']:4.2f}  python {row['python_us']:6.2f}  | torch "
                f"launch {row['launch_us']:6.1f} synced {row['synced_us']:7.1f}  ratio {row['ratio']:.3f}",
                flush=True,
            )
    return rows


async def _after_return(engine: TransferEngine, cases: dict[str, _Case], calls: int) -> list[dict[str, Any]]:
    rows = []
    for case, (s, d, n) in cases.items():
        ways: dict[str, list[float]] = {"query": [], "spin": [], "watch": [], "await": []}
        for i in range(calls + 10):
            for way, got in ways.items():
                await asyncio.sleep(0)
                torch.cuda.synchronize()
                t = engine.copy(Tier.GPU, s, Tier.GPU, d, num_tokens=n)
                t1 = time.perf_counter()
                marker = t._marker
                event: Any = marker.event
                assert event is not None
                if way == "query":
                    while not event.query():
                        pass
                elif way == "spin":
                    event.spin(10_000_000)
                elif way == "watch":
                    engine._watch(marker, t)
                else:
                    await t
                t2 = time.perf_counter()
                await t
                if i >= 10:
                    got.append(t2 - t1)
        row = {"section": "after_return", "case": case, **{f"{k}_us": _us(v) for k, v in ways.items()}}
        rows.append(row)
        print(row, flush=True)
    return rows


def _raw(gpu: torch.Tensor, layout: KVLayout, cases: dict[str, _Case], calls: int) -> list[dict[str, Any]]:
    rows = []
    side = torch.cuda.Stream()
    for case, (s, d, n) in cases.items():
        a, b = _bytes_views(gpu, len(s) * layout.partial_bytes(n))
        si, di = torch.from_numpy(s.copy()), torch.from_numpy(d.copy())
        calls_by_name: dict[str, Callable[[], object]] = {
            "op": functools.partial(ops.copy_blocks, [gpu], [gpu], si, di, num_tokens=n),
            "torch copy_": functools.partial(b.copy_, a, non_blocking=True),
        }
        for name, fn in calls_by_name.items():
            launched, seen = [], []
            for i in range(calls + 10):
                torch.cuda.synchronize()
                event = torch.cuda.Event()
                t0 = time.perf_counter()
                with torch.cuda.stream(side):
                    fn()
                    event.record(side)
                t1 = time.perf_counter()
                while not event.query():
                    pass
                t2 = time.perf_counter()
                if i >= 10:
                    launched.append(t1 - t0)
                    seen.append(t2 - t1)
            row: dict[str, Any] = {"section": "raw", "case": case, "raw": name}
            row.update(launch_us=_us(launched), launch_to_seen_us=_us(seen))
            rows.append(row)
            print(row, flush=True)
    return rows


async def _copy_profile(engine: TransferEngine, cases: dict[str, _Case], calls: int) -> list[dict[str, Any]]:
    rows = []
    for case, (s, d, n) in cases.items():
        prof = cProfile.Profile()
        for _ in range(calls):
            await asyncio.sleep(0)
            torch.cuda.synchronize()
            prof.enable()
            t = engine.copy(Tier.GPU, s, Tier.GPU, d, num_tokens=n)
            prof.disable()
            await t
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(14)
        rows.append({"section": "copy_profile", "case": case, "calls": calls, "text": text.getvalue()})
        print(f"--- copy() after a device synchronize, {case}: {calls} calls", flush=True)
        print("\n".join(line for line in text.getvalue().splitlines() if line.strip()), flush=True)
    return rows


async def _device(engine: TransferEngine, gpu: torch.Tensor, case: _Case) -> list[dict[str, Any]]:
    s, d, n = case
    si, di = torch.from_numpy(s.copy()), torch.from_numpy(d.copy())
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    rows = []
    for name in ("engine", "op"):
        with torch.profiler.profile(activities=activities) as prof:
            for _ in range(20):
                torch.cuda.synchronize()
                if name == "engine":
                    await engine.copy(Tier.GPU, s, Tier.GPU, d, num_tokens=n)
                else:
                    ops.copy_blocks([gpu], [gpu], si, di, num_tokens=n, method=ops.METHOD_KERNEL)
            torch.cuda.synchronize()
        table = prof.key_averages().table(sort_by="device_time_total", row_limit=8)
        rows.append({"section": "device", "of": name, "calls": 20, "text": table})
        print(f"--- device activity, 20 calls, {name}\n{table}", flush=True)
    return rows


def _op_device(gpu: torch.Tensor, layout: KVLayout, half: int) -> list[dict[str, Any]]:
    rows = []
    si, di = torch.arange(half), torch.arange(half, 2 * half)
    for n in (4, 8, 12):
        a, b = _bytes_views(gpu, half * layout.partial_bytes(n))
        dev = {
            name: _device_seconds(
                functools.partial(ops.copy_blocks, [gpu], [gpu], si, di, num_tokens=n, method=method), 9
            )
            for name, method in (("kernel", ops.METHOD_KERNEL), ("dma", ops.METHOD_DMA))
        }
        dev["contiguous"] = _device_seconds(functools.partial(b.copy_, a, non_blocking=True), 9)
        row = {"section": "op_device", "case": f"{half} blocks {n}/16", **{f"{k}_us": v * 1e6 for k, v in dev.items()}}
        rows.append(row)
        print(row, flush=True)
    return rows


async def probe(calls: int = 200) -> dict[str, Any]:
    """Every section (module docstring) on the current CUDA device, ``calls`` calls per measurement."""
    layout = KVLayout(num_layers=32, num_kv_heads=8, head_dim=128, tokens_per_block=16, dtype=torch.bfloat16)
    blocks, half = 256, 128
    rows: list[dict[str, Any]] = []
    async with TransferEngine(layout, gpu_blocks=blocks, host_blocks=half, device="cuda") as engine:
        pool = engine.pool(Tier.GPU)
        assert isinstance(pool, BlockPool)
        gpu = pool.tensor
        idx = np.arange(blocks)
        cases: dict[str, _Case] = {
            "floor gpu->gpu 1 block 1/16": (idx[:1], idx[half : half + 1], 1),
            "gpu->gpu 128 blocks 4/16": (idx[:half], idx[half:], 4),
        }
        rows += await _split(engine, gpu, layout, cases, calls)
        rows += await _after_return(engine, cases, calls)
        rows += _raw(gpu, layout, cases, calls)
        rows += await _copy_profile(engine, cases, calls)
        rows += await _device(engine, gpu, cases["gpu->gpu 128 blocks 4/16"])
        rows += _op_device(gpu, layout, half)
    return {"gpu": torch.cuda.get_device_name(), "rows": rows}


def main(argv: list[str] | None = None) -> None:
    """The command line: print the rows, write them to ``--json``."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--json", default=None)
    parser.add_argument("--calls", type=int, default=200)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("cold_probe needs CUDA")
    result = asyncio.run(probe(args.calls))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
