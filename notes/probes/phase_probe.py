"""Session i probe: where the wall time of one awaited small copy goes, phase by phase, next to bare floors.

Phases of ``await engine.copy(...)`` (1 block, the loop-side poll on), median microseconds from the call:
``returned`` (copy() returned), ``first_poll`` (the poller's first look at it), ``seen`` (the first poll whose
event query said done), ``resumed`` (the awaiting coroutine runs again); ``polls`` = loop rounds that polled it.

Floors in the same process: ``bare_spin`` (a torch copy of the same bytes, an event, a tight ``query()`` loop:
launch to completion as the host can see it), ``bare_loop`` (the same, but polled once per loop round by
``call_soon`` and resolved through a future, as the engine does).

Run on a CUDA machine: ``python notes/probes/phase_probe.py``.
"""

from __future__ import annotations

import asyncio
import statistics
import time

import numpy as np
import torch
import uvloop

from tiered_kv import EngineConfig, KVLayout, Tier, TransferEngine
from tiered_kv.completions import EventPoller
from tiered_kv.tools.bench.kernels import _loop_floor_once

DEV = "cuda"


def med(xs: list[float]) -> float:
    """Median of seconds, in microseconds."""
    return statistics.median(xs) * 1e6 if xs else float("nan")


class _Drop:
    """A stream's waiter queue that drops completions (the loop-side poll completes them) but forwards the stop."""

    def __init__(self, q):  # type: ignore[no-untyped-def]
        self.q = q

    def put(self, item):  # type: ignore[no-untyped-def]
        if not isinstance(item, tuple):
            self.q.put(item)

    def get(self):  # type: ignore[no-untyped-def]
        return self.q.get()


async def engine_phases(
    layout: KVLayout,
    blocks: int,
    src: Tier,
    dst: Tier,
    reps: int = 300,
    waiter: bool = True,
    count: int = 1,
    tokens: int | None = None,
) -> dict[str, float]:
    """Median time from the call to each phase of one awaited 1-block copy (microseconds)."""
    cfg = EngineConfig(completion_spin_us=200 if waiter else 20_000)  # no waiter: the poll never gives up
    async with TransferEngine(layout, gpu_blocks=blocks, host_blocks=blocks, device=DEV, config=cfg) as e:
        idx = np.arange(blocks)
        half = blocks // 2
        await e.copy(Tier.HOST, idx[:half], Tier.GPU, idx[:half])
        if not waiter:  # the waiter thread never wakes: what its GIL share costs the loop
            for st in e._streams.values():
                if hasattr(st, "_waits"):
                    st._waits = _Drop(st._waits)
        poller = e._poller
        assert poller is not None
        real = poller._poll
        rec: dict[str, float] = {}

        def poll(marker):  # type: ignore[no-untyped-def]
            now = time.perf_counter()
            rec.setdefault("first_poll", now)
            rec["polls"] = rec.get("polls", 0) + 1
            if "seen" not in rec and marker.event is not None and marker.event.query():
                rec["seen"] = time.perf_counter()
            return real(marker)

        poller._poll = poll
        real_check, real_after = EventPoller._check, poller._after

        def check(self):  # type: ignore[no-untyped-def]
            rec.setdefault("check", time.perf_counter())
            real_check(self)

        def after():  # type: ignore[no-untyped-def]
            rec.setdefault("settle", time.perf_counter())
            real_after()
            rec.setdefault("settled", time.perf_counter())

        EventPoller._check = check  # type: ignore[method-assign]
        poller._after = after
        for st in e._streams.values():
            if getattr(st, "watch", None) is not None:
                real_watch = st.watch

                def watch(m, t, real_watch=real_watch):  # type: ignore[no-untyped-def]
                    rec.setdefault("watch", time.perf_counter())
                    real_watch(m, t)

                st.watch = watch
        keys = ("returned", "watch", "settle", "settled", "check", "first_poll", "seen", "resumed", "polls")
        out: dict[str, list[float]] = {k: [] for k in keys}
        for i in range(reps + 30):
            rec.clear()
            t0 = time.perf_counter()
            d = idx[half : half + count] if src == dst else idx[:count]
            tr = e.copy(src, idx[:count], dst, d, num_tokens=tokens)
            t1 = time.perf_counter()
            await tr
            t2 = time.perf_counter()
            if i < 30:
                continue
            out["returned"].append(t1 - t0)
            out["resumed"].append(t2 - t0)
            for k in ("watch", "settle", "settled", "check", "first_poll", "seen"):
                if k in rec:
                    out[k].append(rec[k] - t0)
            out["polls"].append(rec.get("polls", 0) / 1e6)
        EventPoller._check = real_check  # type: ignore[method-assign]
        res = {k: med(v) for k, v in out.items()}
        res["polled_copies"] = len(out["seen"])
        return res


def bare_tensors(layout: KVLayout, src: Tier, dst: Tier) -> tuple[torch.Tensor, torch.Tensor]:
    """A 1-block source and destination on the route, no engine."""
    n = layout.bytes_per_block
    a = torch.empty(n, dtype=torch.uint8, device=DEV if src == Tier.GPU else "cpu", pin_memory=src != Tier.GPU)
    b = torch.empty(n, dtype=torch.uint8, device=DEV if dst == Tier.GPU else "cpu", pin_memory=dst != Tier.GPU)
    return a, b


def bare_spin(layout: KVLayout, src: Tier, dst: Tier, reps: int = 300) -> float:
    """Median: torch copy, event, tight query loop (microseconds)."""
    a, b = bare_tensors(layout, src, dst)
    s = torch.cuda.Stream()
    out = []
    for i in range(reps + 30):
        t0 = time.perf_counter()
        with torch.cuda.stream(s):
            b.copy_(a, non_blocking=True)
        ev = torch.cuda.Event()
        ev.record(s)
        while not ev.query():
            pass
        if i >= 30:
            out.append(time.perf_counter() - t0)
    return med(out)


async def bare_loop(layout: KVLayout, src: Tier, dst: Tier, reps: int = 300) -> float:
    """Median: torch copy, event, the loop polling it into an awaited future (microseconds; the bench's floor)."""
    a, b = bare_tensors(layout, src, dst)
    side = torch.cuda.Stream()
    times = [await _loop_floor_once(b, a, side) for _ in range(reps + 1)][1:]
    return med(times)


def main_partial() -> None:
    """The kernels bench's partial GPU->GPU row (64 blocks of 2 MiB, 4 of 16 tokens), with and without the waiter."""
    big = KVLayout(num_layers=32, num_kv_heads=8, head_dim=128, tokens_per_block=16, dtype=torch.bfloat16)
    for loop_name in ("asyncio", "uvloop"):
        if loop_name == "uvloop":
            uvloop.install()
        for src in (Tier.GPU, Tier.HOST):
            for tokens in (4, 12):
                for waiter in (True, False):
                    ph = asyncio.run(engine_phases(big, 128, src, Tier.GPU, 40, waiter, 64, tokens))
                    cells = " ".join(f"{k}={v:7.1f}" for k, v in ph.items())
                    route = f"{src.value}->gpu"
                    print(f"{loop_name:8s} partial {route} {tokens}/16 waiter={waiter!s:5s} {cells}", flush=True)
                print(f"{loop_name:8s} partial {route} {tokens}/16 op alone: {op_alone(big, src, tokens):.1f} us")


def op_alone(layout: KVLayout, src: Tier, tokens: int) -> float:
    """Median wall time (us) of the copy_blocks op alone, synchronized: launch to the host seeing its end."""
    from tiered_kv import _ext, ops

    _ext.load()
    gpu = torch.empty((128, *layout.block_shape), dtype=layout.dtype, device="cuda")
    host = torch.empty((128, *layout.block_shape), dtype=layout.dtype, pin_memory=True)
    s = torch.arange(64)
    d = torch.arange(64, 128) if src == Tier.GPU else torch.arange(64)
    src_t = [gpu] if src == Tier.GPU else [host]
    out = []
    for i in range(30):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        ops.copy_blocks([gpu], src_t, s, d, num_tokens=tokens, method=ops.METHOD_KERNEL)
        torch.cuda.synchronize()
        if i >= 5:
            out.append(time.perf_counter() - t0)
    return med(out)


def main() -> None:
    """Every loop, layout and route."""
    small = KVLayout(num_layers=1, num_kv_heads=1, head_dim=8, tokens_per_block=4)
    big = KVLayout(num_layers=32, num_kv_heads=8, head_dim=128, tokens_per_block=16, dtype=torch.bfloat16)
    routes = ((Tier.HOST, Tier.GPU), (Tier.GPU, Tier.GPU), (Tier.GPU, Tier.HOST))
    for loop_name in ("asyncio", "uvloop"):
        if loop_name == "uvloop":
            uvloop.install()
        for name, layout, blocks in (("small", small, 8), ("big", big, 16)):
            for src, dst in routes:
                route = f"{src.value}->{dst.value}"
                ph = asyncio.run(engine_phases(layout, blocks, src, dst))
                nw = asyncio.run(engine_phases(layout, blocks, src, dst, waiter=False))
                spin = bare_spin(layout, src, dst)
                loopf = asyncio.run(bare_loop(layout, src, dst))
                cells = " ".join(f"{k}={v:7.1f}" for k, v in ph.items())
                print(f"{loop_name:8s} {name:6s} {route:9s} {cells} | bare_spin={spin:6.1f} bare_loop={loopf:6.1f}",
                      flush=True)
                cells = " ".join(f"{k}={v:7.1f}" for k, v in nw.items())
                print(f"{loop_name:8s} {name:6s} {route:9s} {cells} | no waiter", flush=True)


if __name__ == "__main__":
    import sys

    main_partial() if "partial" in sys.argv[1:] else main()
