"""Session i probe: what a GPU->GPU stream's waiter sees for its first large copies (wake, due, stop, return).

Run on a CUDA machine: ``python notes/probes/rate_probe.py``.
"""

from __future__ import annotations

import asyncio
import time

import torch

from tiered_kv import KVLayout, Tier, TransferEngine, device

calls: list[tuple] = []
_real = device._native_wait


def _wrapped():  # type: ignore[no-untyped-def]
    """The extension's wait, recording each call in monotonic ns."""
    real = _real()
    if real is None:
        return None

    def wait_done(handle, dev, sem, wake, due, owed, stop=-1):  # type: ignore[no-untyped-def]
        t0 = time.monotonic_ns()
        out = real(handle, dev, sem, wake, due, owed, stop)
        calls.append((t0, wake, due, stop, sem, time.monotonic_ns(), out))
        return out

    return wait_done


device._native_wait = _wrapped


async def main() -> None:
    """Three 64 MiB GPU->GPU copies, then what the waiter saw."""
    layout = KVLayout(num_layers=32, num_kv_heads=8, head_dim=128, tokens_per_block=16, dtype=torch.bfloat16)
    async with TransferEngine(layout, gpu_blocks=64, host_blocks=1, device="cuda") as engine:
        local = engine._streams["local"]
        for _ in range(4):
            t0 = time.monotonic_ns()
            await engine.copy(Tier.GPU, list(range(32)), Tier.GPU, list(range(32, 64)))
            t1 = time.monotonic_ns()
            await asyncio.sleep(0.005)
            print(f"awaited {(t1 - t0) / 1e3:.0f} us; rate {local.rate:.0f} known {local.rate_known}", flush=True)
    for t0, wake, due, stop, sem, t1, out in calls:
        print(f"call at {t0}: wake {(wake - t0) / 1e3:+.0f} due {(due - t0) / 1e3:+.0f} "
              f"stop {(stop - t0) / 1e3 if stop >= 0 else -1:+.0f} sem {sem} -> {(t1 - t0) / 1e3:.0f} us {out}")


asyncio.run(main())
