# ruff: noqa: B023 -- every lambda below runs before its loop variables change
"""Kernel probe (CUDA): the copy_blocks op alone against a plain copy, and an engine copy's time split.

Primitives:

* :func:`child` -- op alone vs plain copy; :func:`engine_breakdown` -- an engine copy's time split; :func:`main`.

Device time of the op against a plain copy of the same bytes (host issue excluded), and where an engine
partial copy's wall time goes. Run on a GPU after the extension is built (``tiered-kv build-ext``)::

    python -m tiered_kv.tools.bench.kperf_probe
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import numpy as np
import torch


def dev_seconds(fn: Callable[[], object], repeat: int = 10) -> float:
    """Median device seconds of ``fn``'s launches, each behind a sleep kernel (host issue excluded)."""
    times: list[float] = []
    for i in range(repeat + 1):
        torch.cuda.synchronize()
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(2_000_000)
        e0.record()
        fn()
        e1.record()
        e1.synchronize()
        if i:
            times.append(e0.elapsed_time(e1) / 1e3)
    return float(statistics.median(times))


def child() -> dict[str, float]:
    """Plain copy / op device time, per layer-major chunk size and partial-copy token count."""
    from tiered_kv import _ext, ops
    from tiered_kv.layer_major import LayerMajorPool
    from tiered_kv.layout import KVLayout

    assert _ext.load()
    out: dict[str, float] = {}
    blocks = 256

    def layer_major(chunk: int) -> None:  # a function, so its pools are freed before the next size
        layout = KVLayout(
            num_layers=32, num_kv_heads=chunk // 4096, head_dim=128, tokens_per_block=16, dtype=torch.bfloat16
        )
        pool = LayerMajorPool.allocate(layout, blocks, "cuda", split_kv=True)
        host = torch.empty((blocks, *layout.block_shape), dtype=layout.dtype, pin_memory=True)
        idx = torch.arange(blocks)
        g, h = list(pool.tensors), [host]
        nbytes = blocks * layout.bytes_per_block
        off = dev_seconds(lambda: ops.copy_blocks(h, g, idx, idx))
        on = dev_seconds(lambda: ops.copy_blocks(g, h, idx, idx))
        flat = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        hb = host.view(-1).view(torch.uint8)
        base_off = dev_seconds(lambda: hb.copy_(flat, non_blocking=True))
        base_on = dev_seconds(lambda: flat.copy_(hb, non_blocking=True))
        out[f"lm{chunk >> 10}K_offload"] = base_off / off
        out[f"lm{chunk >> 10}K_onboard"] = base_on / on

    for chunk in (8 << 10, 64 << 10):
        layer_major(chunk)
    layout = KVLayout(num_layers=32, num_kv_heads=8, head_dim=128, tokens_per_block=16, dtype=torch.bfloat16)
    gpu = torch.empty((256, *layout.block_shape), dtype=layout.dtype, device="cuda")
    host = torch.empty((128, *layout.block_shape), dtype=layout.dtype, pin_memory=True)
    a_i, b_i = torch.arange(128), torch.arange(128, 256)
    for n in (4, 12):
        nbytes = 128 * layout.partial_bytes(n)
        d2d = dev_seconds(lambda: ops.copy_blocks([gpu], [gpu], a_i, b_i, num_tokens=n))
        h2d = dev_seconds(lambda: ops.copy_blocks([gpu], [host], a_i, a_i, num_tokens=n))
        fa = gpu.view(-1).view(torch.uint8)[:nbytes]
        fb = gpu.view(-1).view(torch.uint8)[nbytes : 2 * nbytes]
        fh = host.view(-1).view(torch.uint8)[:nbytes]
        out[f"partial{n}_d2d"] = dev_seconds(lambda: fb.copy_(fa, non_blocking=True)) / d2d
        out[f"partial{n}_h2d"] = dev_seconds(lambda: fa.copy_(fh, non_blocking=True)) / h2d
    return out


async def engine_breakdown() -> dict[str, dict[str, float]]:
    """Where an awaited partial GPU->GPU copy's wall time goes (median microseconds)."""
    from tiered_kv import Tier, TransferEngine
    from tiered_kv.layout import KVLayout

    layout = KVLayout(num_layers=32, num_kv_heads=8, head_dim=128, tokens_per_block=16, dtype=torch.bfloat16)
    res: dict[str, dict[str, float]] = {}
    async with TransferEngine(layout, gpu_blocks=256, host_blocks=128, device="cuda") as engine:
        s, d = np.arange(128), np.arange(128, 256)
        for label, blocks in (("128blk", 128), ("1blk", 1)):
            sub: list[float] = []
            dev_done: list[float] = []
            resumed: list[float] = []
            for i in range(21):
                t0 = time.perf_counter()
                tr = engine.copy(Tier.GPU, s[:blocks], Tier.GPU, d[:blocks], num_tokens=4)
                t1 = time.perf_counter()
                await tr
                t2 = time.perf_counter()
                done_at = tr.completed_at or t2
                if i:
                    sub.append(t1 - t0)
                    dev_done.append(done_at - t0)
                    resumed.append(t2 - t0)

            def med(x: list[float]) -> float:
                return round(statistics.median(x) * 1e6, 1)

            res[label] = {"copy()_returns_us": med(sub), "waiter_fired_us": med(dev_done), "resumed_us": med(resumed)}
    return res


def main() -> None:
    """Print both measurements."""
    print("op alone, plain copy / op device time:", {k: round(x, 3) for k, x in child().items()}, flush=True)
    import uvloop

    print("engine partial 4/16 gpu->gpu (uvloop):", uvloop.run(engine_breakdown()), flush=True)


if __name__ == "__main__":
    main()
