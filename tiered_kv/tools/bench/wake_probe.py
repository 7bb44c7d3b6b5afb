# ruff: noqa: B023 -- each closure runs before the loop variables it reads change
"""Wake-up probe (CUDA): how late the host learns that a copy finished, by each way of waiting.

Primitives:

* :func:`device_waits` -- the waiter-thread side; :func:`loop_waits` -- the event-loop side; :func:`main`.

A host→GPU copy of 4, 64 and 512 MiB runs on a side stream; each way of waiting stamps the host clock when it
learns the copy is done, and the figure reported is how much later that is than a thread that spins on
``cudaEventQuery`` (the earliest the host can know). Ways: a CUDA host function posting a semaphore that a
thread waits on (the engine's default), a blocking-sync event, and a thread that sleeps until shortly before
the copy's expected end and then polls the event at a short period. The loop side: how long a coroutine takes
to resume after a thread hands it the result (``call_soon_threadsafe``) when the loop has been idle that long,
with and without short timers kept armed near the expected end. Run on a GPU::

    python -m tiered_kv.tools.bench.wake_probe --json wake.json
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import ctypes.util
import functools
import json
import os
import queue
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

__all__ = ["device_waits", "loop_waits", "main"]

_SIZES_MIB = (4, 64, 512)


@functools.cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


def _timer_slack(ns: int) -> None:
    """Set this thread's timer slack (``prctl(PR_SET_TIMERSLACK)``): how late a short sleep may wake."""
    _libc().prctl(29, ctypes.c_ulong(ns), 0, 0, 0)


class _Copy:
    def __init__(self, mib: int) -> None:
        n = mib << 20
        self.src = torch.empty(n, dtype=torch.uint8, pin_memory=True)
        self.dst = torch.empty(n, dtype=torch.uint8, device="cuda")
        self.stream = torch.cuda.Stream()

    def issue(self) -> torch.cuda.Event:
        with torch.cuda.stream(self.stream):
            self.dst.copy_(self.src, non_blocking=True)
        event = torch.cuda.Event()
        event.record(self.stream)
        return event


def _waited(copy: _Copy, wait: Callable[[torch.cuda.Event, float], float], reps: int) -> list[float]:
    """Seconds from issue to when ``wait(event, t0)`` says the host learned of the end, per repetition."""
    out = []
    for _ in range(reps):
        torch.cuda.synchronize()
        time.sleep(0.002)
        t0 = time.perf_counter()
        event = copy.issue()
        out.append(wait(event, t0) - t0)
    return out


def device_waits(reps: int) -> list[dict[str, Any]]:
    """Per size and way of waiting: median / p90 lateness against spinning on the event, microseconds."""
    from ...device import _HostFuncSignal

    rows: list[dict[str, Any]] = []
    for mib in _SIZES_MIB:
        cp = _Copy(mib)
        cp.issue().synchronize()

        def spin(event: torch.cuda.Event, t0: float) -> float:
            while not event.query():
                pass
            return time.perf_counter()

        base = _waited(cp, spin, reps)
        expected = statistics.median(base)
        signal = _HostFuncSignal()
        stamps: queue.SimpleQueue[float] = queue.SimpleQueue()

        def waiter(n: int = reps) -> None:
            for _ in range(n):
                signal.wait()
                stamps.put(time.perf_counter())

        thread = threading.Thread(target=waiter, daemon=True)
        thread.start()

        def hostfunc(event: torch.cuda.Event, t0: float) -> float:
            signal.enqueue(cp.stream)
            return stamps.get()

        ways: dict[str, list[float]] = {"spin": base, "hostfunc+sem": _waited(cp, hostfunc, reps)}
        thread.join()

        def blocking(event: torch.cuda.Event, t0: float) -> float:
            ev = torch.cuda.Event(blocking=True)
            ev.record(cp.stream)
            ev.synchronize()
            return time.perf_counter()

        ways["blocking event"] = _waited(cp, blocking, reps)
        for lead_us, period_us in ((300, 20), (300, 50), (150, 10)):

            def poll(event: torch.cuda.Event, t0: float, lead: float = lead_us, per: float = period_us) -> float:
                _timer_slack(1000)
                until = t0 + expected - lead * 1e-6
                while (now := time.perf_counter()) < until:
                    time.sleep(min(until - now, 0.001))
                while not event.query():
                    time.sleep(per * 1e-6)
                return time.perf_counter()

            ways[f"poll lead {lead_us}us every {period_us}us"] = _waited(cp, poll, reps)

        def sleep_poll(event: torch.cuda.Event, t0: float) -> float:  # poll every 50 us from the start
            _timer_slack(1000)
            while not event.query():
                time.sleep(50e-6)
            return time.perf_counter()

        ways["poll every 50us from issue"] = _waited(cp, sleep_poll, reps)
        signal.destroy()
        for name, times in ways.items():
            late = [t - expected for t in times]
            rows.append(
                {
                    "side": "device",
                    "MiB": mib,
                    "way": name,
                    "copy_us": expected * 1e6,
                    "late_p50_us": statistics.median(late) * 1e6,
                    "late_p90_us": sorted(late)[int(0.9 * (len(late) - 1))] * 1e6,
                }
            )
        torch.cuda.empty_cache()
    return rows


async def _resume(idle: float, reps: int, warm: bool) -> list[float]:
    """Seconds from a thread's ``call_soon_threadsafe`` to the coroutine resuming, after ``idle`` seconds.

    One hand-off thread for all repetitions: it sleeps (GIL released) until the time, hands the stamp over and
    goes back to waiting on its queue, so nothing holds the GIL while the loop wakes.
    """
    loop = asyncio.get_running_loop()
    requests: queue.SimpleQueue[tuple[asyncio.Future[float], float] | None] = queue.SimpleQueue()

    def hand() -> None:
        _timer_slack(1000)
        while (req := requests.get()) is not None:
            f, until = req
            while (left := until - time.perf_counter()) > 0:
                time.sleep(left)
            loop.call_soon_threadsafe(f.set_result, time.perf_counter())

    thread = threading.Thread(target=hand, daemon=True)
    thread.start()
    out = []
    for _ in range(reps):
        fut: asyncio.Future[float] = loop.create_future()
        handles: list[asyncio.TimerHandle] = []
        if warm:  # keep short timers armed from 300 us before the expected end

            def tick(f: asyncio.Future[float] = fut) -> None:
                if not f.done():
                    handles.append(loop.call_later(50e-6, tick))

            handles.append(loop.call_at(loop.time() + max(0.0, idle - 300e-6), tick))
        requests.put((fut, time.perf_counter() + idle))
        stamp = await asyncio.wait_for(fut, 5.0)
        out.append(time.perf_counter() - stamp)
        for h in handles:
            h.cancel()
        await asyncio.sleep(0.001)
    requests.put(None)
    thread.join()
    return out


def loop_waits(reps: int) -> list[dict[str, Any]]:
    """Resume latency of a coroutine after idle spans of 0.2, 2 and 10 ms, asyncio and uvloop, timers or not."""
    loops: list[tuple[str, Callable[[], asyncio.AbstractEventLoop]]] = [("asyncio", asyncio.new_event_loop)]
    try:
        import uvloop

        loops.append(("uvloop", uvloop.new_event_loop))
    except ImportError:
        pass
    rows: list[dict[str, Any]] = []
    for name, factory in loops:
        for idle in (0.0002, 0.002, 0.010):
            for warm in (False, True):
                loop = factory()
                try:
                    times = loop.run_until_complete(_resume(idle, reps, warm))
                finally:
                    loop.close()
                rows.append(
                    {
                        "side": "loop",
                        "loop": name,
                        "idle_us": idle * 1e6,
                        "timers": warm,
                        "resume_p50_us": statistics.median(times) * 1e6,
                        "resume_p90_us": sorted(times)[int(0.9 * (len(times) - 1))] * 1e6,
                    }
                )
    return rows


def _host() -> dict[str, Any]:
    states = []
    base = "/sys/devices/system/cpu/cpu0/cpuidle"
    if os.path.isdir(base):
        for d in sorted(os.listdir(base)):
            try:
                with open(f"{base}/{d}/name") as f, open(f"{base}/{d}/latency") as g:
                    states.append(f"{f.read().strip()}:{g.read().strip()}us")
            except OSError:
                pass
    governor = ""
    for name in ("current_governor_ro", "current_governor"):
        path = f"/sys/devices/system/cpu/cpuidle/{name}"
        if os.path.exists(path):
            with open(path) as f:
                governor = f.read().strip()
    return {"cpuidle_states": states, "cpuidle_governor": governor, "uid": os.getuid(), "cpus": os.cpu_count()}


def main(argv: Sequence[str] | None = None) -> int:
    """Run both sides, print one JSON line per row, write them all to ``--json``."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--reps", type=int, default=25)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    _libc()  # looked up before any timing (find_library may run a subprocess)
    out: dict[str, Any] = {"host": _host()}
    print(json.dumps(out["host"]))
    out["loop"] = loop_waits(args.reps * 2)
    for row in out["loop"]:
        print(json.dumps(row))
    if torch.cuda.is_available():
        out["device"] = device_waits(args.reps)
        for row in out["device"]:
            print(json.dumps(row))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
