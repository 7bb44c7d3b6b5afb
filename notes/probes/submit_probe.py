"""Session m probe: where the host time of ``copy()`` goes before and after the launch, on the native path.

The turn-phase probe found the engine's 128-block partial copy launched ~65 us after the call and ``copy()``
returning ~110 us after it (the 1-block 1-token copy: launched at ~37 us). Here each step of the native path is
wrapped with a timestamp (median microseconds from the call, tight loop, GPU synchronized before each call):

``pairs`` (small_pairs done), ``job`` (NativeRoute.job done), ``issue0`` / ``issue1`` (the C++ submit entered /
returned: the launch is inside), ``put`` (the waiter's queue put done), ``ret`` (copy() returned).

Run on a CUDA machine from notes/probes/: ``python submit_probe.py``.
"""

from __future__ import annotations

import asyncio
import statistics
import time

import numpy as np
import torch

import tiered_kv.engine as engine_mod
from tiered_kv import KVLayout, Tier, TransferEngine
from tiered_kv.copyops import NativeRoute
from tiered_kv.device import CudaStream

stamps: dict[str, int] = {}


def _stamp(name: str) -> None:
    stamps.setdefault(name, time.perf_counter_ns())


def instrument() -> None:
    """Wrap the native path's steps with timestamps."""
    real_pairs = engine_mod.small_pairs

    def pairs(*a, **k):  # type: ignore[no-untyped-def]
        r = real_pairs(*a, **k)
        _stamp("pairs")
        return r

    engine_mod.small_pairs = pairs  # type: ignore[assignment]
    real_job = NativeRoute.job

    def job(self, *a, **k):  # type: ignore[no-untyped-def]
        r = real_job(self, *a, **k)
        _stamp("job")
        return r

    NativeRoute.job = job  # type: ignore[method-assign]
    real_native = CudaStream.notify_native

    def notify_native(self, issue, callback, **k):  # type: ignore[no-untyped-def]
        _stamp("notify")

        def timed_issue(*a):  # type: ignore[no-untyped-def]
            _stamp("issue0")
            r = issue(*a)
            _stamp("issue1")
            return r

        r = real_native(self, timed_issue, callback, **k)
        _stamp("put")
        return r

    CudaStream.notify_native = notify_native  # type: ignore[method-assign]


async def measure(
    engine: TransferEngine, route: tuple, n: int | None, reps: int = 200, sync: bool = True
) -> dict[str, float]:
    """Median microseconds from the call to each stamp (``sync``: the GPU synchronized before each call)."""
    out: dict[str, list[float]] = {}
    for i in range(reps + 20):
        if sync:
            torch.cuda.synchronize()
        stamps.clear()
        t0 = time.perf_counter_ns()
        tr = engine.copy(*route, num_tokens=n)
        t1 = time.perf_counter_ns()
        await tr
        t2 = time.perf_counter_ns()
        if i < 20:
            continue
        for k, v in stamps.items():
            out.setdefault(k, []).append((v - t0) / 1e3)
        out.setdefault("ret", []).append((t1 - t0) / 1e3)
        out.setdefault("end", []).append((t2 - t0) / 1e3)
    return {k: statistics.median(v) for k, v in out.items()}


async def submit_costs(layout: KVLayout, idx: np.ndarray) -> None:
    """The C++ submit alone (median us of the call), next to a torch event record and a tiny torch kernel."""
    from tiered_kv import _ext, ops

    module = _ext.native()
    async with TransferEngine(layout, gpu_blocks=256, host_blocks=128, device="cuda") as engine:
        copier = engine.route(Tier.GPU, Tier.GPU).copier  # type: ignore[attr-defined]
        gpu = engine.pool(Tier.GPU)
        stream = torch.cuda.Stream()
        handle = stream.cuda_stream

        def timed(fn, reps: int = 400) -> float:  # type: ignore[no-untyped-def]
            out = []
            for i in range(reps):
                if i % 50 == 0:
                    torch.cuda.synchronize()
                t0 = time.perf_counter_ns()
                fn()
                out.append((time.perf_counter_ns() - t0) / 1e3)
            return statistics.median(out)

        for tokens in (16, 4):
            info = copier._pair(gpu, gpu, tokens)
            for method, label in ((ops.METHOD_KERNEL, "kernel"), (ops.METHOD_DMA, "dma")):
                plan = copier._native_plan(info, tokens, method)
                for k in (0, 1, 16, 128):
                    s_, d_ = idx[:k].tolist(), idx[128 : 128 + k].tolist()
                    us = timed(lambda plan=plan, s_=s_, d_=d_: module.submit(plan, s_, d_, handle, 0))
                    print(f"submit {label:6s} tokens={tokens:2d} pairs={k:3d}: {us:6.2f} us", flush=True)
        ev = torch.cuda.Event()
        print(f"torch event record: {timed(lambda: ev.record(stream)):6.2f} us")
        x = torch.zeros(16, device="cuda")
        print(f"torch tiny kernel (x.add_(1)): {timed(lambda: x.add_(1)):6.2f} us")
        c = module.check_pairs if hasattr(module, "check_pairs") else None
        if c is not None:
            a, b = idx[:128], idx[128:]
            print(f"check_pairs 128 ndarray: {timed(lambda: c(256, 256, True, a, b)):6.2f} us")
        torch.cuda.synchronize()


async def variants() -> None:
    """1 block whole and 128 blocks of 4 tokens, GPU->GPU, with and without a synchronize before each call.

    With and without the stream waiter (``_Drop``: its items dropped, the loop's poll completes every copy).
    """
    from phase_probe import _Drop

    from tiered_kv import EngineConfig

    layout = KVLayout(num_layers=32, num_kv_heads=8, head_dim=128, tokens_per_block=16, dtype=torch.bfloat16)
    idx = np.arange(256)
    a = torch.empty(1 << 17, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    for sync in (True, False):
        times = []
        for _ in range(300):
            if sync:
                torch.cuda.synchronize()
            t0 = time.perf_counter_ns()
            b.copy_(a)
            times.append((time.perf_counter_ns() - t0) / 1e3)
        print(f"torch copy_ 128 KiB d2d returns: sync={sync!s:5s} {statistics.median(times):6.1f} us", flush=True)
    await submit_costs(layout, idx)
    for waiter in (True, False):
        cfg = EngineConfig(completion_spin_us=200 if waiter else 20_000)
        async with TransferEngine(layout, gpu_blocks=256, host_blocks=128, device="cuda", config=cfg) as engine:
            await engine.copy(Tier.GPU, idx[:1], Tier.GPU, idx[1:2])
            if not waiter:
                for st in engine._streams.values():
                    if hasattr(st, "_waits"):
                        st._waits = _Drop(st._waits)  # type: ignore[attr-defined]
            for blocks, n in ((1, None), (128, 4)):
                route = (Tier.GPU, idx[:blocks].tolist(), Tier.GPU, idx[128 : 128 + blocks].tolist())
                for sync in (True, False):
                    r = await measure(engine, route, n, 300, sync)
                    cells = " ".join(f"{k}={v:6.1f}" for k, v in r.items())
                    head = f"waiter={waiter!s:5s} sync={sync!s:5s} blocks={blocks:3d} tokens={n!s:4s}"
                    print(f"{head} {cells}", flush=True)


async def main() -> None:
    """Every shape, then the cProfile of the 128-block partial call."""
    layout = KVLayout(num_layers=32, num_kv_heads=8, head_dim=128, tokens_per_block=16, dtype=torch.bfloat16)
    idx = np.arange(256)
    print(f"# submit_probe on {torch.cuda.get_device_name()}")
    async with TransferEngine(layout, gpu_blocks=256, host_blocks=128, device="cuda") as engine:
        for name, route_of in (
            ("gpu->gpu", lambda k: (Tier.GPU, idx[:k], Tier.GPU, idx[128 : 128 + k])),
            ("host->gpu", lambda k: (Tier.HOST, idx[:k], Tier.GPU, idx[:k])),
        ):
            for blocks, n in ((1, None), (1, 1), (1, 4), (16, 4), (128, 4), (128, None)):
                for kind in ("ndarray", "list"):
                    route = route_of(blocks)
                    if kind == "list":
                        route = (route[0], route[1].tolist(), route[2], route[3].tolist())
                    r = await measure(engine, route, n)
                    cells = " ".join(f"{k}={v:6.1f}" for k, v in r.items())
                    print(f"{name:9s} blocks={blocks:3d} tokens={n!s:4s} {kind:7s} {cells}", flush=True)
        # the functions of the 128-block partial call (cProfile, tottime)
        import cProfile
        import pstats

        route = (Tier.GPU, idx[:128], Tier.GPU, idx[128:256])
        prof = cProfile.Profile()
        for i in range(320):
            torch.cuda.synchronize()
            if i == 20:
                prof.enable()
            await engine.copy(*route, num_tokens=4)
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    torch.cuda.init()
    import sys

    instrument()
    asyncio.run(variants() if "variants" in sys.argv else main())
