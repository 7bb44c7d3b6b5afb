"""Session q probe: where the wall time of the bench's 4-of-16-token GPU->GPU partial copy goes.

The bench's partial row setup (32 layers, 8 KV heads x 128, 16 tokens per block, bf16; 128 blocks of 256 copied
GPU->GPU, tokens [0, 4)). Per variant, medians over 40 calls, each after the GPU is synchronized (as the bench does):

* ``awaited``: ``await engine.copy(...)`` (the bench's engine column), with the time ``copy()`` took to return, the
  share of awaits completed in place (``EngineConfig.await_spin_us``) and the local stream's learned rate;
* ``synced``: ``engine.copy(...)`` then ``torch.cuda.synchronize()``, never awaited (the same launch, no completion
  path);
* ``op``: the ``copy_blocks`` op alone, synchronized; ``contiguous``: one ``copy_`` of the same bytes, synchronized;
* the device time of the engine's copy on its stream (timing events recorded on the local stream around it).

Variants: the default spin budget, none, and 1 ms. Run on a CUDA machine: ``python partial_wall_probe.py``.
"""

from __future__ import annotations

import asyncio
import statistics
import time

import numpy as np
import torch

from tiered_kv import EngineConfig, KVLayout, Tier, TransferEngine, ops


def med(xs: list[float]) -> float:
    """Median, in microseconds."""
    return statistics.median(xs) * 1e6


async def run(spin: int | None, tokens: int) -> None:
    """One variant's line: ``spin`` the await spin budget in us (None: the default), ``tokens`` of 16."""
    layout = KVLayout(num_layers=32, num_kv_heads=8, head_dim=128, tokens_per_block=16, dtype=torch.bfloat16)
    cfg = EngineConfig() if spin is None else EngineConfig(await_spin_us=spin)
    blocks, half = 256, 128
    idx = np.arange(blocks)
    async with TransferEngine(layout, gpu_blocks=blocks, host_blocks=half, device="cuda", config=cfg) as engine:
        gpu = engine.pool(Tier.GPU).tensor
        nbytes = half * layout.partial_bytes(tokens)
        a = gpu.view(-1).view(torch.uint8)[:nbytes]
        b = gpu.view(-1).view(torch.uint8)[nbytes : 2 * nbytes]
        local = engine.stream("local")
        ts = local.torch_stream  # type: ignore[attr-defined]
        src_i = torch.from_numpy(idx[:half].copy())
        dst_i = torch.from_numpy(idx[half:].copy())
        awaited, returned, synced, op, contiguous, dev = [], [], [], [], [], []
        in_place0 = engine._in_place
        for i in range(50):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            t = engine.copy(Tier.GPU, idx[:half], Tier.GPU, idx[half:], num_tokens=tokens)
            t1 = time.perf_counter()
            await t
            t2 = time.perf_counter()
            torch.cuda.synchronize()
            t3 = time.perf_counter()
            engine.copy(Tier.GPU, idx[:half], Tier.GPU, idx[half:], num_tokens=tokens)
            torch.cuda.synchronize()
            t4 = time.perf_counter()
            await asyncio.sleep(0)  # its completion
            torch.cuda.synchronize()
            t5 = time.perf_counter()
            ops.copy_blocks([gpu], [gpu], src_i, dst_i, num_tokens=tokens, method=ops.METHOD_KERNEL)
            torch.cuda.synchronize()
            t6 = time.perf_counter()
            b.copy_(a, non_blocking=True)
            torch.cuda.synchronize()
            t7 = time.perf_counter()
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record(ts)
            t = engine.copy(Tier.GPU, idx[:half], Tier.GPU, idx[half:], num_tokens=tokens)
            e1.record(ts)
            await t
            torch.cuda.synchronize()
            if i >= 10:
                returned.append(t1 - t0)
                awaited.append(t2 - t0)
                synced.append(t4 - t3)
                op.append(t6 - t5)
                contiguous.append(t7 - t6)
                dev.append(e0.elapsed_time(e1) / 1e3)
        in_place = engine._in_place - in_place0
        c = med(contiguous)
        print(
            f"tokens={tokens}/16 spin={spin if spin is not None else 'default'} rate={local.rate:.0f}B/ns "  # type: ignore[attr-defined]
            f"known={local.rate_known} in_place={in_place}/150 | "  # type: ignore[attr-defined]
            f"returned={med(returned):.1f} awaited={med(awaited):.1f} synced={med(synced):.1f} "
            f"op={med(op):.1f} contiguous={c:.1f} engine_dev={med(dev):.1f} us | "
            f"fraction awaited={c / med(awaited):.3f} synced={c / med(synced):.3f} op={c / med(op):.3f}",
            flush=True,
        )


def main() -> None:
    """4 and 12 of 16 tokens, each spin budget."""
    for tokens in (4, 12):
        for spin in (None, 0, 1000):
            asyncio.run(run(spin, tokens))


if __name__ == "__main__":
    main()
