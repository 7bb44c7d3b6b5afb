"""Diagnostic (CUDA): where the fixed time of one awaited engine copy goes."""
import asyncio
import statistics
import threading
import time

import torch
import uvloop

from tiered_kv import KVLayout, Tier, TransferEngine


def med(xs):
    return statistics.median(xs) * 1e6


def micro():
    s = torch.cuda.Stream()
    a = torch.empty(1024, device="cuda"); b = torch.empty(1024, pin_memory=True)
    n = 200
    t = []
    for _ in range(n):
        t0 = time.perf_counter()
        with torch.cuda.stream(s):
            pass
        t.append(time.perf_counter() - t0)
    print(f"stream context enter/exit: {med(t):.1f} us")
    t = []
    for _ in range(n):
        t0 = time.perf_counter(); e = torch.cuda.Event(blocking=True); e.record(s); t.append(time.perf_counter() - t0)
    print(f"Event(blocking) + record: {med(t):.1f} us")
    t = []
    for _ in range(n):
        t0 = time.perf_counter()
        with torch.cuda.stream(s):
            b.copy_(a, non_blocking=True)
        t.append(time.perf_counter() - t0)
    print(f"tiny D2H copy_ enqueue: {med(t):.1f} us")
    for blocking in (True, False):
        lat = []
        for _ in range(100):
            s.synchronize()
            e = torch.cuda.Event(blocking=blocking)
            with torch.cuda.stream(s):
                b.copy_(a, non_blocking=True)
            e.record(s)
            t0 = time.perf_counter()
            e.synchronize()
            lat.append(time.perf_counter() - t0)
        print(f"tiny copy record->synchronize returns (blocking={blocking}): {med(lat):.1f} us")
    # waiter thread wake: thread blocks in synchronize on a stalled stream; measure stall end -> wake
    for blocking in (True, False):
        lat = []
        for _ in range(50):
            with torch.cuda.stream(s):
                torch.cuda._sleep(2_000_000)  # ~1 ms
            e = torch.cuda.Event(blocking=blocking, enable_timing=False); e.record(s)
            out = {}
            th = threading.Thread(target=lambda: (e.synchronize(), out.__setitem__("t", time.perf_counter())))
            th.start()
            while not e.query():
                pass
            seen = time.perf_counter()
            th.join()
            lat.append(out["t"] - seen)
        print(f"waiter thread wake after completion (blocking={blocking}), vs a spinning observer: {med(lat):.1f} us")


async def engine_phases():
    layout = KVLayout(1, 1, 64, 16, torch.float16)
    async with TransferEngine(layout, gpu_blocks=256, host_blocks=256, device="cuda") as e:
        for path in ("gpu->host", "host->gpu", "gpu->gpu"):
            src, dst = path.split("->")
            sub, dev, res = [], [], []
            for _ in range(300):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                t = e.copy(src, [1], dst, [2])
                t1 = time.perf_counter()
                await t
                t2 = time.perf_counter()
                sub.append(t1 - t0); dev.append(t.completed_at - t1); res.append(t2 - t.completed_at)
            print(f"engine {path} 1 block: submit {med(sub):.1f} us, submit->waiter saw done {med(dev):.1f} us, done->resumed {med(res):.1f} us")
        print(e.copier.statistics())


import os

micro()
for mode in ("hostfunc", "event"):
    os.environ["TIERED_KV_COMPLETION"] = mode
    print(f"--- completion={mode}")
    uvloop.run(engine_phases())
