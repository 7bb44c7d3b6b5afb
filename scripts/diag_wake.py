"""Diagnostic: where does the constant overhead of an awaited copy go on CUDA?"""
import asyncio, time, statistics, threading
import torch, uvloop
from tiered_kv import KVLayout, Tier, TransferEngine

def med(x): return statistics.median(x) * 1e6

def event_wake(blocking, n=200):
    s = torch.cuda.Stream()
    lat = []
    for _ in range(n):
        with torch.cuda.stream(s):
            torch.cuda._sleep(200000)
        ev = torch.cuda.Event(blocking=blocking, enable_timing=False)
        ev.record(s)
        ev.synchronize()
        t_done = time.perf_counter()
        # measure: how long after the device finished did synchronize return? use a second probe
        lat.append(0)
    # direct: time from kernel end to synchronize return using host-side spin reference
    res = []
    for _ in range(n):
        with torch.cuda.stream(s):
            torch.cuda._sleep(2_000_000)
        ev_b = torch.cuda.Event(blocking=blocking); ev_b.record(s)
        ev_s = torch.cuda.Event(); ev_s.record(s)
        done = [None]
        def spin():
            while not ev_s.query():
                pass
            done[0] = time.perf_counter()
        th = threading.Thread(target=spin); th.start()
        ev_b.synchronize(); t = time.perf_counter(); th.join()
        res.append(t - done[0])
    return med(res)

async def main():
    print("blocking-sync wake after spin detection (us, median):", event_wake(True))
    print("spin-sync wake after spin detection (us, median):", event_wake(False))
    layout = KVLayout(32, 8, 128, 16, torch.float16)
    async with TransferEngine(layout, gpu_blocks=256, host_blocks=256, device="cuda") as e:
        sub, dev, wall, resume = [], [], [], []
        for _ in range(12):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            t = e.copy(Tier.GPU, range(256), Tier.HOST, range(256))
            t1 = time.perf_counter()
            await t
            t2 = time.perf_counter()
            sub.append(t1 - t0); dev.append(t.completed_at - t0); wall.append(t2 - t0); resume.append(t2 - t.completed_at)
        print("submit us", med(sub), "to done_at us", med(dev), "wall us", med(wall), "resume us", med(resume))
        s = torch.cuda.Stream(); g = e.pool("gpu").tensor; h = e.pool("host").tensor
        base = []
        for _ in range(12):
            torch.cuda.synchronize(); t0 = time.perf_counter()
            with torch.cuda.stream(s): h.copy_(g, non_blocking=True)
            s.synchronize(); base.append(time.perf_counter() - t0)
        print("baseline wall us", med(base))
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(s):
            a.record(s); h.copy_(g, non_blocking=True); b.record(s)
        b.synchronize(); print("device-timed copy us", a.elapsed_time(b) * 1e3)
uvloop.run(main())
