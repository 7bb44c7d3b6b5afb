"""Session r probe: where an awaited partial copy's wall time goes, in the bench's own turns.

The H200 bench of session r had the 128-block partial GPU->GPU rows at 0.60-0.79 of a contiguous copy (floor 60 us,
against 45 on the H100). This probe repeats the bench's partial rows (same engine, pools, calls and turn order:
``tiered_kv.tools.bench.kernels._partial``) with the engine call instrumented: per turn the time from the call to
the native launch returning, to ``copy()`` returning, to the awaiting coroutine resuming, and whether the await
completed in place. Variants: the default engine, the in-place await budget raised to 400 us, the default again.
Then a torch-profiler
trace of 12 turns of the 4-of-16 GPU->GPU row (engine copy and contiguous copy, in record_function ranges), written
to ``$OUT/partial-trace.json`` for the host/device timeline. Run on a CUDA machine:
``python partial_turn_probe.py [OUT]``.
"""

from __future__ import annotations

import asyncio
import functools
import json
import os
import statistics
import sys
import time
from typing import Any

import numpy as np
import torch

from tiered_kv import KVLayout, Tier, TransferEngine
from tiered_kv.tools.bench.common import awaited_seconds, in_turns
from tiered_kv.tools.bench.kernels import _loop_floor_once

OUT = sys.argv[1] if len(sys.argv) > 1 else os.environ.get("OUT", "/tmp")


def med(xs: list[float]) -> float:
    """Median in microseconds."""
    return round(statistics.median(xs) * 1e6, 1)


async def rows(engine: TransferEngine, variant: str) -> list[dict[str, Any]]:
    """The three rows of one variant."""
    side = torch.cuda.Stream()
    return [
        await one_row(engine, variant, n, d, side) for n, d in ((4, "gpu->gpu"), (12, "gpu->gpu"), (4, "host->gpu"))
    ]


async def one_row(
    engine: TransferEngine, variant: str, n: int, direction: str, side: torch.cuda.Stream
) -> dict[str, Any]:
    """One row, in the bench's turns, the engine call instrumented."""
    layout = engine.layout
    gpu = engine.pool(Tier.GPU).tensor
    host = engine.pool(Tier.HOST).tensor
    idx = np.arange(256)
    half = 128
    nbytes = half * layout.partial_bytes(n)
    a = gpu.view(-1).view(torch.uint8)[:nbytes]
    b = gpu.view(-1).view(torch.uint8)[nbytes : 2 * nbytes]
    h = host.view(-1).view(torch.uint8)[:nbytes]
    one = layout.partial_bytes(1)
    if direction == "gpu->gpu":
        route = (Tier.GPU, idx[:half], Tier.GPU, idx[half:])
        base = functools.partial(b.copy_, a, non_blocking=True)
        single = (Tier.GPU, idx[:1], Tier.GPU, idx[half : half + 1])
        bare = (b[:one], a[:one])
    else:
        route = (Tier.HOST, idx[:half], Tier.GPU, idx[:half])
        base = functools.partial(a.copy_, h, non_blocking=True)
        single = (Tier.HOST, idx[:1], Tier.GPU, idx[:1])
        bare = (a[:one], h[:one])
    native = engine._resolve_route(route[0], route[2])[-1]
    assert native is not None
    inner = native.launch
    stamps: dict[str, list[float]] = {"launch": [], "returned": [], "awaited": [], "in_place": [], "base_launch": []}
    last: list[float] = [0.0]

    def timed_launch(*args: Any) -> Any:
        got = inner(*args)
        last[0] = time.perf_counter()
        return got

    native.launch = timed_launch

    async def engine_call() -> float:
        torch.cuda.synchronize()
        before = engine._in_place
        last[0] = float("nan")
        t0 = time.perf_counter()
        t = engine.copy(*route, num_tokens=n)
        t1 = time.perf_counter()
        await t
        t2 = time.perf_counter()
        stamps["launch"].append(last[0] - t0)
        stamps["returned"].append(t1 - t0)
        stamps["awaited"].append(t2 - t0)
        stamps["in_place"].append(float(engine._in_place - before))
        return t2 - t0

    async def contiguous_call() -> float:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        base()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        stamps["base_launch"].append(t1 - t0)
        return t2 - t0

    calls = [
        engine_call,
        contiguous_call,
        functools.partial(awaited_seconds, functools.partial(engine.copy, *single, num_tokens=1), True),
        functools.partial(_loop_floor_once, *bare, side),
    ]
    ours, theirs, floor, loop_floor = await in_turns(calls, 40)
    native.launch = inner
    k = len(ours)
    row = {
        "variant": variant,
        "tokens": f"{n}/16",
        "direction": direction,
        "fraction": round(statistics.median(t / o for o, t in zip(ours, theirs, strict=True)), 3),
        "engine_us": med(ours),
        "contiguous_us": med(theirs),
        "floor_us": med(floor),
        "loop_floor_us": med(loop_floor),
        "launch_returned_us": med(stamps["launch"][-k:]),
        "copy_returned_us": med(stamps["returned"][-k:]),
        "awaited_us": med(stamps["awaited"][-k:]),
        "contiguous_launch_us": med(stamps["base_launch"][-k:]),
        "in_place": int(sum(stamps["in_place"][-k:])),
        "turns": k,
    }
    print(json.dumps(row), flush=True)
    return row


async def trace(engine: TransferEngine) -> None:
    """The profiler trace of the 4-of-16 GPU->GPU row."""
    from torch.profiler import ProfilerActivity, profile, record_function

    layout = engine.layout
    gpu = engine.pool(Tier.GPU).tensor
    idx = np.arange(256)
    half = 128
    nbytes = half * layout.partial_bytes(4)
    a = gpu.view(-1).view(torch.uint8)[:nbytes]
    b = gpu.view(-1).view(torch.uint8)[nbytes : 2 * nbytes]
    for _ in range(5):
        await engine.copy(Tier.GPU, idx[:half], Tier.GPU, idx[half:], num_tokens=4)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(12):
            torch.cuda.synchronize()
            with record_function("engine copy"):
                with record_function("copy() call"):
                    t = engine.copy(Tier.GPU, idx[:half], Tier.GPU, idx[half:], num_tokens=4)
                await t
            torch.cuda.synchronize()
            with record_function("contiguous"):
                b.copy_(a, non_blocking=True)
                torch.cuda.synchronize()
    prof.export_chrome_trace(os.path.join(OUT, "partial-trace.json"))


async def main_async() -> list[dict[str, Any]]:
    """Every row, then the trace."""
    layout = KVLayout(num_layers=32, num_kv_heads=8, head_dim=128, tokens_per_block=16, dtype=torch.bfloat16)
    result = []
    async with TransferEngine(layout, gpu_blocks=256, host_blocks=128, device="cuda") as engine:
        result += await rows(engine, "default")
        spin = engine._await_spin
        engine._await_spin = 400e-6
        result += await rows(engine, "await spin 400 us")
        engine._await_spin = spin
        result += await rows(engine, "default again")
        await trace(engine)
    return result


if __name__ == "__main__":
    # PROBE_LOOP=uvloop runs it on uvloop; PROBE_GC=off turns the cyclic garbage collector off for the run
    if os.environ.get("PROBE_GC") == "off":
        import gc

        gc.disable()
    if os.environ.get("PROBE_LOOP") == "uvloop":
        import uvloop

        got = uvloop.run(main_async())
    else:
        got = asyncio.run(main_async())
    with open(os.path.join(OUT, "partial-turns.json"), "w") as f:
        json.dump(got, f, indent=1)
