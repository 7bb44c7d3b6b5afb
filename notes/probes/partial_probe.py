"""Session k probe: where the wall time of the kernels bench's partial GPU->GPU rows goes.

The bench's case: a block-major pool of 256 blocks (32 layers x K/V x 8 heads x 16 tokens x 128, bf16), blocks
[0, 128) copied to [128, 256), tokens [0, n) of every (layer, kv, head), on asyncio. Per n, medians of many
calls, the cases taking turns call by call (a drifting host moves them alike), in microseconds:

* ``contig``: one ``copy_`` of the same bytes, synchronized (the row's baseline): ``launch`` (the call returned),
  ``wall`` (launch to the host seeing its end).
* ``op``: the ``copy_blocks_list`` op alone on the current stream (the engine's kernel, no engine), the same two.
* ``op_idle``: CUDA events around the op on an idle stream (host issue + launch latency + device);
  ``op_dev``: the same behind a sleep kernel (device only); ``contig_dev`` likewise.
* ``engine``: ``await engine.copy(...)``: ``returned`` (copy() returned) and ``wall``.
* ``launch_by_pairs``: the op's host launch time and synchronized wall for 1..256 pairs of one token (next to no
  device work): what the launch itself costs as the kernel's parameters grow.

Run on a CUDA machine: ``python notes/probes/partial_probe.py``.
"""

from __future__ import annotations

import asyncio
import statistics
import time

import numpy as np
import torch

from tiered_kv import KVLayout, Tier, TransferEngine, _ext, ops


def us(xs: list[float]) -> float:
    """Median of seconds, in microseconds."""
    return statistics.median(xs) * 1e6


def events(fn, behind_sleep: bool) -> float:  # type: ignore[no-untyped-def]
    """Seconds between CUDA events around ``fn`` on the current stream (behind a sleep kernel: device time only)."""
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    if behind_sleep:
        torch.cuda._sleep(2_000_000)
    e0.record()
    fn()
    e1.record()
    e1.synchronize()
    return e0.elapsed_time(e1) / 1e3


async def main_async() -> None:
    """Every case per n, then the launch cost by pairs."""
    layout = KVLayout(num_layers=32, num_kv_heads=8, head_dim=128, tokens_per_block=16, dtype=torch.bfloat16)
    blocks, half, reps = 256, 128, 60
    idx = np.arange(blocks)
    async with TransferEngine(layout, gpu_blocks=blocks, host_blocks=half, device="cuda") as engine:
        gpu = engine.pool(Tier.GPU).tensor
        flat = gpu.view(-1).view(torch.uint8)
        op = torch.ops.tiered_kv.copy_blocks_list
        s_list, d_list = list(range(half)), list(range(half, blocks))
        for n in (4, 8, 12):
            nbytes = half * layout.partial_bytes(n)
            a, b = flat[:nbytes], flat[nbytes : 2 * nbytes]
            path = engine.copier.plan(engine.pool(Tier.GPU), idx[:half], engine.pool(Tier.GPU), idx[half:], n).path
            method = ops.METHOD_DMA if path == "dma" else ops.METHOD_KERNEL
            rec: dict[str, list[float]] = {}

            def put(key: str, value: float, rec: dict[str, list[float]] = rec) -> None:
                rec.setdefault(key, []).append(value)

            def run_op(n: int = n, method: int = method) -> None:
                op([gpu], [gpu], s_list, d_list, n, method, 0)

            def run_contig(a: torch.Tensor = a, b: torch.Tensor = b) -> None:
                b.copy_(a, non_blocking=True)

            for i in range(reps + 3):
                keep = i >= 3
                for name, fn in (("contig", run_contig), ("op", run_op)):
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    fn()
                    t1 = time.perf_counter()
                    torch.cuda.synchronize()
                    t2 = time.perf_counter()
                    if keep:
                        put(f"{name}_launch", t1 - t0)
                        put(f"{name}_wall", t2 - t0)
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                transfer = engine.copy(Tier.GPU, idx[:half], Tier.GPU, idx[half:], num_tokens=n)
                t1 = time.perf_counter()
                await transfer
                t2 = time.perf_counter()
                if keep:
                    put("engine_returned", t1 - t0)
                    put("engine_wall", t2 - t0)
                    put("op_idle", events(run_op, False))
                    put("op_dev", events(run_op, True))
                    put("contig_idle", events(run_contig, False))
                    put("contig_dev", events(run_contig, True))
            cells = " ".join(f"{k}={us(v):7.1f}" for k, v in rec.items())
            print(f"partial gpu->gpu {n}/16 path={path} MiB={nbytes / 2**20:.0f} {cells}", flush=True)
        # the launch alone as the kernel's parameters grow: one token, so next to no device work
        for method in (ops.METHOD_KERNEL, ops.METHOD_DMA):
            for pairs in (1, 8, 32, 64, 128):
                src, dst = list(range(pairs)), list(range(128, 128 + pairs))
                launch, wall = [], []
                for i in range(reps + 3):
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    op([gpu], [gpu], src, dst, 1, method, 0)
                    t1 = time.perf_counter()
                    torch.cuda.synchronize()
                    t2 = time.perf_counter()
                    if i >= 3:
                        launch.append(t1 - t0)
                        wall.append(t2 - t0)
                print(
                    f"launch_by_pairs method={method} pairs={pairs:3d} launch={us(launch):7.1f} wall={us(wall):7.1f}",
                    flush=True,
                )


def main() -> None:
    """Load the extension, run on asyncio."""
    assert _ext.load(), "the CUDA extension did not load"
    asyncio.run(main_async())


if __name__ == "__main__":
    main()
