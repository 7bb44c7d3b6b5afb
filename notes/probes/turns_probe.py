"""Session l probe: why the bare loop floor measured in turns beside engine copies is 4-10x the one measured alone.

The kernels bench's partial rows measure, taking turns: an awaited engine copy (128 blocks, n of 16 tokens), one
contiguous copy of the same bytes (synchronized), an awaited engine copy of one block and one token, and a bare
torch copy of those bytes polled by the loop (``_loop_floor_once``). Variants (medians of 20 turns, microseconds):

* ``as bench``: the four in turns, back to back;
* ``pause``: the same with a 2 ms ``asyncio.sleep`` before each measurement (threads catch up, nothing pending);
* ``no engine``: only the contiguous copy and the bare loop floor in turns;
* ``no waiter``: as bench, but the engine's stream waiters drop their items (the loop's poll completes the copies).

Run on a CUDA machine: ``python notes/probes/turns_probe.py``.
"""

from __future__ import annotations

import asyncio
import functools
import statistics

import numpy as np
import torch
from phase_probe import _Drop  # run from notes/probes/, as phase_probe is

from tiered_kv import EngineConfig, KVLayout, Tier, TransferEngine
from tiered_kv.tools.bench.common import awaited_seconds, in_turns, synced_seconds
from tiered_kv.tools.bench.kernels import _loop_floor_once


async def turns(calls, n: int, pause: float) -> list[float]:  # type: ignore[no-untyped-def]
    """Median microseconds per call, taking turns (the bench's ``in_turns``), ``pause`` s of sleep before each."""

    async def paused(call):  # type: ignore[no-untyped-def]
        await asyncio.sleep(pause)
        return await call()

    if pause:
        calls = [functools.partial(paused, call) for call in calls]
    return [statistics.median(x) * 1e6 for x in await in_turns(calls, n)]


async def main() -> None:
    """Every variant, 4 and 12 tokens of 16."""
    layout = KVLayout(num_layers=32, num_kv_heads=8, head_dim=128, tokens_per_block=16, dtype=torch.bfloat16)
    idx = np.arange(256)
    for variant in ("as bench", "pause", "no engine", "no waiter", "as bench"):
        # no waiter: the loop's poll never gives up (as phase_probe does)
        cfg = EngineConfig(completion_spin_us=20_000 if variant == "no waiter" else None)
        async with TransferEngine(layout, gpu_blocks=256, host_blocks=128, device="cuda", config=cfg) as engine:
            await engine.copy(Tier.GPU, idx[:1], Tier.GPU, idx[1:2])  # the waiters are started
            if variant == "no waiter":
                for st in engine._streams.values():
                    if hasattr(st, "_waits"):
                        st._waits = _Drop(st._waits)  # type: ignore[attr-defined]
            gpu = engine.pool(Tier.GPU).tensor  # type: ignore[union-attr]
            side = torch.cuda.Stream()
            for n in (4, 12):
                nbytes = 128 * layout.partial_bytes(n)
                a = gpu.view(-1).view(torch.uint8)[:nbytes]
                b = gpu.view(-1).view(torch.uint8)[nbytes : 2 * nbytes]
                one = layout.partial_bytes(1)
                route = (Tier.GPU, idx[:128], Tier.GPU, idx[128:])
                single = (Tier.GPU, idx[:1], Tier.GPU, idx[128:129])
                eng = functools.partial(awaited_seconds, functools.partial(engine.copy, *route, num_tokens=n), True)
                base = functools.partial(synced_seconds, functools.partial(b.copy_, a, non_blocking=True), True)
                floor = functools.partial(awaited_seconds, functools.partial(engine.copy, *single, num_tokens=1), True)
                loopf = functools.partial(_loop_floor_once, b[:one], a[:one], side)
                if variant == "no engine":
                    r = await turns([base, loopf], 20, 0.0)
                    cells = f"engine=   -   base={r[0]:6.1f} floor=   -   loop_floor={r[1]:6.1f}"
                else:
                    r = await turns([eng, base, floor, loopf], 20, 0.002 if variant == "pause" else 0.0)
                    cells = f"engine={r[0]:6.1f} base={r[1]:6.1f} floor={r[2]:6.1f} loop_floor={r[3]:6.1f}"
                print(f"{variant:10s} {n:2d}/16 gpu->gpu {cells}", flush=True)


if __name__ == "__main__":
    torch.cuda.init()
    asyncio.run(main())
