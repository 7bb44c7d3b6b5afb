"""Session o probe: why does the overlap bench's compute slow down beside a load (``contention`` 1.3-1.7)?

The overlap bench's model (32 layers, 8k-token prefix, 512 new tokens) computed on a compute stream, timed on
the device (CUDA events around the 32 layers) and on the host (the enqueue of the 32 layers), in turns:

* ``alone``: the compute alone;
* ``torch h2d``: beside one plain torch ``copy_`` of the 1 GiB prefix host->GPU on a side stream (no engine);
* ``engine g1`` / ``engine g4``: beside the engine's layer-group load (copy_layerwise, as the bench);
* ``engine g1, compute first``: the compute enqueued first, then the load issued (the host's launches cannot be
  held up by the load's issue).

Run on a CUDA machine from notes/probes/: ``python contention_probe.py``.
"""

from __future__ import annotations

import asyncio
import statistics
import time

import numpy as np
import torch

from tiered_kv import EngineConfig, KVLayout, Tier, TransferEngine
from tiered_kv.layerwise import copy_layerwise
from tiered_kv.pools import BlockPool
from tiered_kv.testing import fill_random
from tiered_kv.tools.bench.overlap import _Model


async def main() -> None:
    """Each way of running the compute, in turns; the median device time of the 32 layers per way."""
    layers, prefix, new = 32, 8192, 512
    layout = KVLayout(num_layers=layers, num_kv_heads=8, head_dim=128, tokens_per_block=16, dtype=torch.bfloat16)
    blocks = prefix // 16
    print(f"# contention_probe on {torch.cuda.get_device_name()}")
    async with TransferEngine(
        layout, gpu_blocks=blocks, host_blocks=blocks, device="cuda", config=EngineConfig.from_env()
    ) as engine:
        gpu_pool, host_pool = engine.pool(Tier.GPU), engine.pool(Tier.HOST)
        assert isinstance(gpu_pool, BlockPool) and isinstance(host_pool, BlockPool)
        gpu, host = gpu_pool.tensor, host_pool.tensor
        fill_random(host)
        host.view(torch.int16).bitwise_and_(0x3FFF)
        gpu.copy_(host)
        model = _Model(layout, 4096, 14336, 32, new, gpu.device)
        compute = torch.cuda.Stream()
        side = torch.cuda.Stream()
        order = np.arange(blocks)

        def enqueue_compute() -> tuple[torch.cuda.Event, torch.cuda.Event, float]:
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            t0 = time.perf_counter()
            with torch.cuda.stream(compute):
                e0.record()
                x = model.x0
                for i in range(layers):
                    x = model.layer(x, gpu, i)
                e1.record()
            return e0, e1, time.perf_counter() - t0

        async def alone() -> tuple[float, float]:
            e0, e1, host_s = enqueue_compute()
            e1.synchronize()
            return e0.elapsed_time(e1), host_s * 1e3

        async def torch_h2d() -> tuple[float, float]:
            with torch.cuda.stream(side):
                gpu.copy_(host, non_blocking=True)
            e0, e1, host_s = enqueue_compute()
            e1.synchronize()
            side.synchronize()
            return e0.elapsed_time(e1), host_s * 1e3

        def engine_load(g: int, compute_first: bool = False):  # type: ignore[no-untyped-def]
            async def run() -> tuple[float, float]:
                if compute_first:
                    e0, e1, host_s = enqueue_compute()
                    lw = copy_layerwise(engine, Tier.HOST, order, Tier.GPU, order, group_layers=g)
                else:
                    lw = copy_layerwise(engine, Tier.HOST, order, Tier.GPU, order, group_layers=g)
                    e0, e1, host_s = enqueue_compute()
                await asyncio.to_thread(e1.synchronize)
                await lw
                return e0.elapsed_time(e1), host_s * 1e3

            return run

        async def engine_whole() -> tuple[float, float]:
            t = engine.copy(Tier.HOST, order, Tier.GPU, order)
            e0, e1, host_s = enqueue_compute()
            await asyncio.to_thread(e1.synchronize)
            await t
            return e0.elapsed_time(e1), host_s * 1e3

        calls = {
            "alone": alone,
            "torch h2d": torch_h2d,
            "engine whole": engine_whole,
            "engine g1": engine_load(1),
            "engine g4": engine_load(4),
            "engine g1, compute first": engine_load(1, True),
        }
        res: dict[str, list[tuple[float, float]]] = {k: [] for k in calls}
        for turn in range(7):
            for name, fn in calls.items():
                torch.cuda.synchronize()
                r = await fn()
                if turn:
                    res[name].append(r)
        base = statistics.median(d for d, _ in res["alone"])
        for name, rs in res.items():
            dev = statistics.median(d for d, _ in rs)
            hst = statistics.median(h for _, h in rs)
            print(
                f"{name:26s} compute device {dev:7.2f} ms  x alone {dev / base:5.2f}  enqueue (host) {hst:6.2f} ms",
                flush=True,
            )


if __name__ == "__main__":
    torch.cuda.init()
    asyncio.run(main())
