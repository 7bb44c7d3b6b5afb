"""Session h probe: the awaited wall time of one small copy, by layout and route, with the loop-side poll off / on.

Run on a CUDA machine: ``python notes/probes/floor_probe.py`` (asyncio, then uvloop; medians of 200 copies).
"""

from __future__ import annotations

import asyncio
import statistics
import time

import numpy as np
import torch
import uvloop

from tiered_kv import EngineConfig, KVLayout, Tier, TransferEngine


async def one(layout: KVLayout, blocks: int, spin: int, src: Tier, dst: Tier, n: int | None, reps: int = 200) -> float:
    """Median awaited wall time (us) of one 1-block copy ``src -> dst`` (``n`` tokens), poll window ``spin`` us."""
    cfg = EngineConfig(completion_spin_us=spin)
    async with TransferEngine(layout, gpu_blocks=blocks, host_blocks=blocks, device="cuda", config=cfg) as e:
        idx = np.arange(blocks)
        half = blocks // 2
        await e.copy(Tier.HOST, idx[:half], Tier.GPU, idx[:half])  # the stream learns its rate
        out = []
        for i in range(reps + 20):
            t0 = time.perf_counter()
            await e.copy(src, idx[:1], dst, idx[half : half + 1] if src == dst else idx[:1], num_tokens=n)
            if i >= 20:
                out.append(time.perf_counter() - t0)
    return statistics.median(out) * 1e6


def main() -> None:
    """Every case, route and poll setting, on asyncio then uvloop."""
    big = KVLayout(num_layers=32, num_kv_heads=8, head_dim=128, tokens_per_block=16, dtype=torch.bfloat16)
    small = KVLayout(num_layers=1, num_kv_heads=1, head_dim=8, tokens_per_block=4)
    cases = (("small", small, 8, None), ("big-1tok", big, 64, 1), ("big-whole", big, 64, None))
    routes = ((Tier.HOST, Tier.GPU), (Tier.GPU, Tier.GPU), (Tier.GPU, Tier.HOST))
    for loop in ("asyncio", "uvloop"):
        if loop == "uvloop":
            uvloop.install()
        for name, layout, blocks, n in cases:
            for src, dst in routes:
                for spin in (0, 200):
                    us = asyncio.run(one(layout, blocks, spin, src, dst, n))
                    route = f"{src.value}->{dst.value}"
                    print(f"{loop:8s} {name:10s} {route:9s} spin={spin:3d} median={us:7.1f}us", flush=True)


if __name__ == "__main__":
    main()
