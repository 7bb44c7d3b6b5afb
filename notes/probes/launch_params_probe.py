"""Session s probe: the host time of the native launch per call size, after a synchronize (as the bench calls it).

``native.submit`` of a one-token partial copy (next to no device work) of n consecutive blocks, the GPU synchronized
before each call, for n across the kernel parameter sizes the launch uses: up to 47 pairs the indices ride in a 784-byte
parameter block, from 48 pairs in a 5 KiB one. Also a torch ``copy_`` of 64 MiB (the bench's contiguous baseline) in
the same turns. Prints median microseconds per call. Run on a CUDA machine: ``python launch_params_probe.py``.
"""

from __future__ import annotations

import json
import statistics
import time

import torch

from tiered_kv import KVLayout, Tier, TransferEngine, _ext


async def main() -> dict[str, float]:
    """Median host microseconds of one submit per size."""
    native = _ext.native()
    layout = KVLayout(num_layers=32, num_kv_heads=8, head_dim=128, tokens_per_block=16, dtype=torch.bfloat16)
    out: dict[str, float] = {}
    async with TransferEngine(layout, gpu_blocks=256, host_blocks=8, device="cuda") as engine:
        gpu = engine.pool(Tier.GPU)
        copier = engine.route(Tier.GPU, Tier.GPU).copier  # type: ignore[attr-defined]
        plan = copier._native_plan(copier._pair(gpu, gpu, 1), 1, 0)
        handle = engine.stream("offload").torch_stream.cuda_stream  # type: ignore[attr-defined]
        t = gpu.tensor.view(-1).view(torch.uint8)
        a, b = t[: 64 << 20], t[64 << 20 : 128 << 20]
        sizes = (1, 8, 32, 47, 48, 64, 128)
        times: dict[str, list[float]] = {f"submit {n} pairs": [] for n in sizes}
        times["torch copy_ 64 MiB"] = []
        for turn in range(41):
            for n in sizes:
                s, d = list(range(n)), list(range(128, 128 + n))
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                event = native.submit(plan, s, d, handle, 0)
                t1 = time.perf_counter()
                event.synchronize()
                if turn:
                    times[f"submit {n} pairs"].append(t1 - t0)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            b.copy_(a, non_blocking=True)
            t1 = time.perf_counter()
            if turn:
                times["torch copy_ 64 MiB"].append(t1 - t0)
        torch.cuda.synchronize()
        for k, v in times.items():
            out[k] = round(statistics.median(v) * 1e6, 1)
        # hot: back to back, no synchronize in between
        for n in (47, 48, 128):
            s, d = list(range(n)), list(range(128, 128 + n))
            hot = []
            for _ in range(200):
                t0 = time.perf_counter()
                native.submit(plan, s, d, handle, 0)
                hot.append(time.perf_counter() - t0)
            torch.cuda.synchronize()
            out[f"hot submit {n} pairs"] = round(statistics.median(hot) * 1e6, 1)
    return out


if __name__ == "__main__":
    import asyncio

    print(json.dumps(asyncio.run(main())), flush=True)
