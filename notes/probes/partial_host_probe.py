"""Session q probe: the host time of ``copy()`` for the bench's 4-of-16-token GPU->GPU partial copy (128 blocks).

``partial_wall_probe.py`` found ``copy()`` taking 58-93 us to return for that call after a synchronize, against
12 us for a 1-block copy back to back. Medians over 200 calls (after 20 warm-up calls) of the time ``copy()`` takes
to return, per state of the host before the call: back to back (awaited, no synchronize), after
``torch.cuda.synchronize()`` (as the bench), after a 2 ms sleep; the same for a 1-block call and for a torch
``copy_`` launch of the same bytes; whether the one-call launch took them (``NativeRoute.launched``); then a
cProfile of 200 synchronized calls. Run on a CUDA machine: ``python partial_host_probe.py``.
"""

from __future__ import annotations

import asyncio
import cProfile
import io
import pstats
import statistics
import time

import numpy as np
import torch

from tiered_kv import KVLayout, Tier, TransferEngine


async def main_async() -> None:
    """Every line of the probe."""
    layout = KVLayout(num_layers=32, num_kv_heads=8, head_dim=128, tokens_per_block=16, dtype=torch.bfloat16)
    blocks, half = 256, 128
    idx = np.arange(blocks)
    async with TransferEngine(layout, gpu_blocks=blocks, host_blocks=half, device="cuda") as engine:
        gpu = engine.pool(Tier.GPU).tensor
        nbytes = half * layout.partial_bytes(4)
        a = gpu.view(-1).view(torch.uint8)[:nbytes]
        b = gpu.view(-1).view(torch.uint8)[nbytes : 2 * nbytes]
        native = engine._resolve_route(Tier.GPU, Tier.GPU)[-1]

        async def engine_call(n: int) -> float:
            t0 = time.perf_counter()
            t = engine.copy(Tier.GPU, idx[:n], Tier.GPU, idx[half : half + n], num_tokens=4)
            dt = time.perf_counter() - t0
            await t
            return dt

        async def torch_call(n: int) -> float:
            t0 = time.perf_counter()
            b[: n * layout.partial_bytes(4)].copy_(a[: n * layout.partial_bytes(4)], non_blocking=True)
            dt = time.perf_counter() - t0
            torch.cuda.synchronize()
            return dt

        for name, call in (("engine", engine_call), ("torch copy_", torch_call)):
            for n in (half, 1):
                for state in ("back to back", "synchronized", "sleep 2 ms"):
                    out = []
                    before = native.launched if native is not None else 0
                    for i in range(220):
                        if state == "synchronized":
                            torch.cuda.synchronize()
                        elif state == "sleep 2 ms":
                            torch.cuda.synchronize()
                            time.sleep(0.002)  # noqa: ASYNC251 (the host idle, on purpose)
                        dt = await call(n)
                        if i >= 20:
                            out.append(dt)
                    launched = (native.launched - before) if native is not None and name == "engine" else "-"
                    print(
                        f"{name:12s} blocks={n:4d} {state:13s} returns median={statistics.median(out) * 1e6:7.1f} us "
                        f"p10={np.percentile(out, 10) * 1e6:7.1f} p90={np.percentile(out, 90) * 1e6:7.1f} "
                        f"launched={launched}/220",
                        flush=True,
                    )
        prof = cProfile.Profile()
        for _ in range(200):
            torch.cuda.synchronize()
            prof.enable()
            t = engine.copy(Tier.GPU, idx[:half], Tier.GPU, idx[half:], num_tokens=4)
            prof.disable()
            await t
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(18)
        print(s.getvalue())


if __name__ == "__main__":
    asyncio.run(main_async())
