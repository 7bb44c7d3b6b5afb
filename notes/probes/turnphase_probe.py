"""Session m probe: where the wall time of the partial rows' calls goes when they take turns, phase by phase.

The kernels bench's partial rows take turns between: the engine's awaited partial copy (128 blocks, n of 16 tokens),
one contiguous copy of the same bytes (GPU synchronized before and after), the engine's awaited 1-block 1-token copy
(``floor``) and a bare torch copy polled by the loop (``loop_floor``). Each is slower in turns than in a tight loop.

Every call here is bracketed by two timing events on the stream it runs on (``ev_a`` recorded just before the call,
``ev_b`` just after it returned), so per call (median microseconds from the call's start ``t0``):

* ``ret``: the call returned (launch issued);
* ``dev``: ``ev_a`` -> ``ev_b`` on the device: the gap before the op started (host submit) plus the op itself;
* ``seen``: when the host saw the end (the engine: the marker's ``done_at``; others: ``end``);
* ``end``: the awaiting coroutine resumed (or synchronize returned);
* ``slack`` = ``end - dev``: wall time not covered by the device's own span (doorbell + detection + resume);
* ``doorbell``: a separate call type, an event recorded on an idle stream and spun on with ``query()``: the host
  seeing the GPU reach an empty event (the least any call pays after the launch).

Modes: ``tight`` (one call type repeated), ``turns`` (the bench's rotation), ``turns+spin`` (turns, but the loop
spins a busy ``call_soon`` chain for 200 us before each call: the core is awake when the call starts).

Run on a CUDA machine from notes/probes/: ``python turnphase_probe.py``.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Awaitable, Callable

import numpy as np
import torch

from tiered_kv import KVLayout, Tier, TransferEngine

Rec = dict[str, float]


def _sync() -> None:
    torch.cuda.synchronize()


def _ev() -> torch.cuda.Event:
    return torch.cuda.Event(enable_timing=True)


async def _busy(seconds: float) -> None:
    """Keep the loop thread busy (call_soon rounds) for ``seconds``."""
    loop = asyncio.get_running_loop()
    fut = loop.create_future()
    end = time.perf_counter() + seconds

    def spin() -> None:
        if time.perf_counter() >= end:
            fut.set_result(None)
        else:
            loop.call_soon(spin)

    loop.call_soon(spin)
    await fut


def engine_call(
    engine: TransferEngine, route: tuple, n: int, stream: torch.cuda.Stream
) -> Callable[[], Awaitable[Rec]]:
    """An awaited engine copy on ``route``, bracketed by timing events on its lane ``stream``."""

    async def call() -> Rec:
        _sync()
        ev_a, ev_b = _ev(), _ev()
        poller = engine._poller
        looks0 = poller.finished if poller is not None else 0
        deliveries0 = engine._inbox.deliveries if engine._inbox is not None else 0
        t0 = time.perf_counter()
        ev_a.record(stream)
        tr = engine.copy(*route, num_tokens=n)
        t_ret = time.perf_counter()
        ev_b.record(stream)
        await tr
        t_end = time.perf_counter()
        ev_b.synchronize()
        seen = tr._marker.done_at or t_end
        return {
            "ret": t_ret - t0,
            "dev": ev_a.elapsed_time(ev_b) / 1e3,
            "seen": seen - t0,
            "end": t_end - t0,
            "by_loop": float(poller is not None and poller.finished > looks0),
            "by_thread": float(engine._inbox is not None and engine._inbox.deliveries > deliveries0),
        }

    return call


def synced_call(dst: torch.Tensor, src: torch.Tensor) -> Callable[[], Awaitable[Rec]]:
    """One contiguous copy, the GPU synchronized before and after (the bench's baseline)."""

    async def call() -> Rec:
        _sync()
        stream = torch.cuda.current_stream()
        ev_a, ev_b = _ev(), _ev()
        t0 = time.perf_counter()
        ev_a.record(stream)
        dst.copy_(src, non_blocking=True)
        t_ret = time.perf_counter()
        ev_b.record(stream)
        _sync()
        t_end = time.perf_counter()
        return {"ret": t_ret - t0, "dev": ev_a.elapsed_time(ev_b) / 1e3, "seen": t_end - t0, "end": t_end - t0}

    return call


def loop_floor_call(dst: torch.Tensor, src: torch.Tensor, side: torch.cuda.Stream) -> Callable[[], Awaitable[Rec]]:
    """A bare torch copy polled by the loop into an awaited future (the bench's loop floor)."""

    async def call() -> Rec:
        loop = asyncio.get_running_loop()
        ev_a, ev_b = _ev(), _ev()
        t0 = time.perf_counter()
        ev_a.record(side)
        with torch.cuda.stream(side):
            dst.copy_(src, non_blocking=True)
        t_ret = time.perf_counter()
        ev_b.record(side)
        fut = loop.create_future()
        seen: list[float] = []

        def check() -> None:
            if ev_b.query():
                seen.append(time.perf_counter())
                fut.set_result(None)
            else:
                loop.call_soon(check)

        loop.call_soon(check)
        await fut
        t_end = time.perf_counter()
        return {"ret": t_ret - t0, "dev": ev_a.elapsed_time(ev_b) / 1e3, "seen": seen[0] - t0, "end": t_end - t0}

    return call


def doorbell_call(side: torch.cuda.Stream) -> Callable[[], Awaitable[Rec]]:
    """An event recorded on an idle stream, spun on with ``query()``."""

    async def call() -> Rec:
        ev = torch.cuda.Event()
        t0 = time.perf_counter()
        ev.record(side)
        t_ret = time.perf_counter()
        while not ev.query():
            pass
        t_end = time.perf_counter()
        return {"ret": t_ret - t0, "dev": 0.0, "seen": t_end - t0, "end": t_end - t0}

    return call


async def run_mode(calls: dict[str, Callable[[], Awaitable[Rec]]], mode: str, turns: int) -> dict[str, Rec]:
    """Median of every field per call type, in ``mode`` (tight, turns, turns+spin)."""
    names = list(calls)
    out: dict[str, list[Rec]] = {k: [] for k in names}
    if mode == "tight":
        for name in names:
            for i in range(turns + 3):
                r = await calls[name]()
                if i >= 3:
                    out[name].append(r)
    else:
        for turn in range(turns + 1):
            for k in range(len(names)):
                name = names[(turn + k) % len(names)]
                if mode == "turns+spin":
                    await _busy(200e-6)
                r = await calls[name]()
                if turn:
                    out[name].append(r)
    return {name: {key: statistics.median(r[key] for r in recs) for key in recs[0]} for name, recs in out.items()}


def fmt(name: str, r: Rec) -> str:
    """One line of a call type's medians."""
    us = {k: v * 1e6 for k, v in r.items() if k not in ("by_loop", "by_thread")}
    cells = " ".join(f"{k}={v:6.1f}" for k, v in us.items())
    cells += f" slack={(r['end'] - r['dev']) * 1e6:6.1f}"
    if "by_loop" in r:
        cells += f" by_loop={r['by_loop']:.0%} by_thread={r['by_thread']:.0%}"
    return f"{name:10s} {cells}"


async def main() -> None:
    """Both directions, 4 and 12 tokens of 16, every mode."""
    layout = KVLayout(num_layers=32, num_kv_heads=8, head_dim=128, tokens_per_block=16, dtype=torch.bfloat16)
    idx = np.arange(256)
    print(f"# turnphase_probe on {torch.cuda.get_device_name()}, {asyncio.get_event_loop_policy().__class__.__name__}")
    import sys

    from tiered_kv import EngineConfig

    no_waiter = "no-waiter" in sys.argv  # the stream waiters drop their items: the loop's poll completes every copy
    cfg = EngineConfig.from_env(completion_spin_us=20_000 if no_waiter else None)
    print(f"# await_spin_us={cfg.await_spin_us}")
    print(f"# no_waiter={no_waiter}")
    async with TransferEngine(layout, gpu_blocks=256, host_blocks=128, device="cuda", config=cfg) as engine:
        if no_waiter:
            from phase_probe import _Drop

            await engine.copy(Tier.GPU, idx[:1], Tier.GPU, idx[1:2])  # the waiters are started
            for st in engine._streams.values():
                if hasattr(st, "_waits"):
                    st._waits = _Drop(st._waits)  # type: ignore[attr-defined]
        gpu = engine.pool(Tier.GPU).tensor  # type: ignore[union-attr]
        host = engine.pool(Tier.HOST).tensor  # type: ignore[union-attr]
        side = torch.cuda.Stream()
        for direction in ("gpu->gpu", "host->gpu"):
            src_tier = Tier.GPU if direction == "gpu->gpu" else Tier.HOST
            route_of = {
                "gpu->gpu": lambda k: (Tier.GPU, idx[:k], Tier.GPU, idx[128 : 128 + k]),
                "host->gpu": lambda k: (Tier.HOST, idx[:k], Tier.GPU, idx[:k]),
            }[direction]
            # the lane the route runs on
            tr = engine.copy(*route_of(1), num_tokens=1)
            await tr
            lane = tr._marker.lane.torch_stream  # type: ignore[union-attr]
            if "yield-gil" in sys.argv:  # session n: the in-place await gives the GIL up between looks, as emulated
                engine._spin_yields_gil = True
            print(f"# in-place await yields the GIL: {engine._spin_yields_gil}")
            for n in (4, 12):
                nbytes = 128 * layout.partial_bytes(n)
                a = gpu.view(-1).view(torch.uint8)[:nbytes]
                b = gpu.view(-1).view(torch.uint8)[nbytes : 2 * nbytes]
                src = a if src_tier is Tier.GPU else host.view(-1).view(torch.uint8)[:nbytes]
                dst = b if src_tier is Tier.GPU else a
                one = layout.partial_bytes(1)
                calls = {
                    "engine": engine_call(engine, route_of(128), n, lane),
                    "base": synced_call(dst, src),
                    "floor": engine_call(engine, route_of(1), 1, lane),
                    "loop_floor": loop_floor_call(dst[:one], src[:one], side),
                    "doorbell": doorbell_call(side),
                }
                for mode in ("tight", "turns", "turns+spin"):
                    res = await run_mode(calls, mode, 30)
                    print(f"## {direction} {n}/16 {mode}")
                    for name, r in res.items():
                        print(fmt(name, r), flush=True)
                    e, b_ = res["engine"], res["base"]
                    print(f"   ratio base/engine = {b_['end'] / e['end']:.3f}", flush=True)


if __name__ == "__main__":
    import sys

    torch.cuda.init()
    if "uvloop" in sys.argv:
        import uvloop

        uvloop.install()
    asyncio.run(main())
