"""Where the host time of one awaited 1-block ``copy()`` goes: timings, cProfile, torch profiler, pieces.

Run: ``python -m tiered_kv.tools.bench.percall_probe [--device cuda|cpu] [--out DIR]``. Writes ONE file,
``percall-<device>.json`` under ``--out`` (timings, pieces, and the cProfile and torch-profiler tables as text:
a GPU machine that returns few files returns it whole), and prints the timings and pieces.
Each "piece" is timed alone in a loop of N calls (median of 5 loops, per call), so the pieces add up
only approximately to the whole. ``host_work`` counts the Python bytecodes and Python-level calls one
``copy()`` executes (per function): the same on every machine, so two trees compare on a noisy one.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import io
import json
import os
import pstats
import statistics
import sys
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from tiered_kv.config import EngineConfig
from tiered_kv.copyops import NativeCopy
from tiered_kv.engine import TransferEngine
from tiered_kv.fences import FenceTable, Marker
from tiered_kv.layout import KVLayout
from tiered_kv.pools import Tier, as_indices
from tiered_kv.stream_copier import StreamCopier


def per_call(fn: Callable[[], object], n: int = 2000, loops: int = 5, sync: Callable[[], None] | None = None) -> float:
    """Median over ``loops`` of the mean seconds per call of ``fn`` (``sync`` every 200 calls, outside the clock)."""
    out = []
    for _ in range(loops):
        total = 0.0
        done = 0
        while done < n:
            k = min(200, n - done)
            if sync is not None:
                sync()
            t0 = time.perf_counter()
            for _ in range(k):
                fn()
            total += time.perf_counter() - t0
            done += k
        out.append(total / n)
    return statistics.median(out)


async def awaited_copies(engine: TransferEngine, n: int) -> dict[str, float]:
    """Medians of ``n`` awaited 1-block GPU->host copies, one at a time (microseconds)."""
    sub, seen, res = [], [], []
    for _ in range(n):
        t0 = time.perf_counter()
        t = engine.copy(Tier.GPU, [0], Tier.HOST, [1])
        t1 = time.perf_counter()
        await t
        t2 = time.perf_counter()
        sub.append(t1 - t0)
        seen.append((t.completed_at or t2) - t0)
        res.append(t2 - t0)
    return {
        k: statistics.median(v) * 1e6
        for k, v in (("copy_returns_us", sub), ("device_done_seen_us", seen), ("resumed_us", res))
    }


def host_work(engine: TransferEngine, n: int = 100) -> dict[str, Any]:
    """Python bytecodes and calls executed by ``n`` 1-block ``copy()`` calls (to distinct blocks), per call."""
    opcodes: Counter[str] = Counter()
    calls: Counter[str] = Counter()

    def tracer(frame: Any, event: str, arg: object) -> Any:
        name = frame.f_code.co_qualname
        if event == "call":
            calls[name] += 1
            frame.f_trace_opcodes = True
        elif event == "opcode":
            opcodes[name] += 1
        return tracer

    transfers = []
    for i in range(n):
        sys.settrace(tracer)
        try:
            transfers.append(engine.copy(Tier.GPU, [i % 32], Tier.HOST, [32 + i % 32]))
        finally:
            sys.settrace(None)
    return {
        "bytecodes_per_copy": sum(opcodes.values()) / n,
        "python_calls_per_copy": sum(calls.values()) / n,
        "by_function": {k: [v / n, calls[k] / n] for k, v in opcodes.most_common(30)},
        "_transfers": transfers,
    }


async def probe(device: str, out: str) -> dict[str, Any]:
    """Time, profile and take apart the per-call path on ``device``."""
    layout = KVLayout(num_layers=1, num_kv_heads=1, head_dim=8, tokens_per_block=4)
    result: dict[str, Any] = {"device": device}
    cuda = device.startswith("cuda")
    if cuda:
        result["gpu"] = torch.cuda.get_device_name()
    sync = torch.cuda.synchronize if cuda else None
    async with TransferEngine(layout, gpu_blocks=64, host_blocks=64, device=device) as engine:
        await awaited_copies(engine, 300)
        work = host_work(engine)
        await asyncio.gather(*work.pop("_transfers"))
        result["host_work"] = work
        result["awaited_1block"] = await awaited_copies(engine, 2000)
        result["copier_path"] = engine.copier.plan(
            engine.pool(Tier.GPU), np.array([0]), engine.pool(Tier.HOST), np.array([1]), None
        ).path

        # submit-only rate: copies to distinct blocks, awaited in bulk
        async def burst() -> float:
            t0 = time.perf_counter()
            ts = [engine.copy(Tier.GPU, [i], Tier.HOST, [i]) for i in range(64)]
            t1 = time.perf_counter()
            await asyncio.gather(*ts)
            return (t1 - t0) / 64

        await burst()
        result["burst64_copy_returns_us"] = statistics.median([await burst() for _ in range(30)]) * 1e6
        result["native"] = engine.copier.native
    if cuda:  # the same copies through the torch-op path (EngineConfig.native_submit off), in the same run
        op_config = EngineConfig.from_env(native_submit=False)
        async with TransferEngine(layout, gpu_blocks=64, host_blocks=64, device=device, config=op_config) as op_engine:
            await awaited_copies(op_engine, 300)
            result["awaited_1block_op_path"] = await awaited_copies(op_engine, 2000)
            op_work = host_work(op_engine)
            await asyncio.gather(*op_work.pop("_transfers"))
            result["host_work_op_path"] = {k: op_work[k] for k in ("bytecodes_per_copy", "python_calls_per_copy")}
    async with TransferEngine(layout, gpu_blocks=64, host_blocks=64, device=device) as engine:
        await awaited_copies(engine, 100)

        pr = cProfile.Profile()
        pr.enable()
        for _ in range(2000):
            await engine.copy(Tier.GPU, [0], Tier.HOST, [1])
        pr.disable()
        s = io.StringIO()
        pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(40)
        pstats.Stats(pr, stream=s).sort_stats("cumulative").print_stats(40)
        result["cprofile"] = s.getvalue()

        if cuda:
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for _ in range(200):
                    await engine.copy(Tier.GPU, [0], Tier.HOST, [1])
            result["torch_profiler"] = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=40)

        # ---- pieces
        pieces: dict[str, float] = {}
        gpu_pool, host_pool = engine.pool(Tier.GPU), engine.pool(Tier.HOST)
        pieces["Tier.coerce x2"] = per_call(lambda: (Tier.coerce(Tier.GPU), Tier.coerce(Tier.HOST)))
        pieces["as_indices(list) x2"] = per_call(lambda: (as_indices([0], "s"), as_indices([1], "d")))
        s_arr, d_arr = as_indices([0], "s"), as_indices([1], "d")
        pieces["pool.check x2"] = per_call(lambda: (gpu_pool.check(s_arr, "s"), host_pool.check(d_arr, "d")))

        def dupcheck() -> bool:
            _s_list, d_list = s_arr.tolist(), d_arr.tolist()
            return len(set(d_list)) != len(d_list)

        pieces["tolist + dup set"] = per_call(dupcheck)
        table = FenceTable()

        def fences() -> None:
            m = Marker(None)
            reads, writes = [("gpu", [0])], [("host", [1])]
            table.dependencies(reads, writes)
            table.register(m, reads, writes)
            table.release(m)

        pieces["Marker + fence deps/register/release"] = per_call(fences)
        pieces["copier.build"] = per_call(lambda: engine.copier.build(gpu_pool, s_arr, host_pool, d_arr, None))
        op = engine.copier.build(gpu_pool, s_arr, host_pool, d_arr, None)
        lane = engine.stream("offload")
        # the op exactly as copy() builds and submits it (the list op on an explicit stream where it exists)
        copier_handler = engine.route(Tier.GPU, Tier.HOST)
        assert isinstance(copier_handler, StreamCopier)
        engine_op = copier_handler.build_op(gpu_pool, [0], host_pool, [1], None)  # the fast path's int lists
        submit_kw = {"explicit": True} if getattr(engine_op, "explicit_stream", False) else {}
        pieces["engine op: lane.submit(op) as copy() does"] = per_call(
            lambda: lane.submit(engine_op, **submit_kw), sync=sync
        )
        result["engine_op_kind"] = (
            "native submit (copy + pooled event, no completion signal)"
            if isinstance(engine_op, NativeCopy)
            else "copy_blocks_list (explicit stream)"
            if submit_kw
            else "copy_blocks (tensor indices)"
        )
        if cuda:
            ts = lane.torch_stream  # type: ignore[attr-defined]

            def ctx_only() -> None:
                with torch.cuda.stream(ts):
                    pass

            pieces["torch.cuda.stream ctx (empty)"] = per_call(ctx_only)
            with torch.cuda.stream(ts):
                pieces["op() (torch.ops copy_blocks, cpu idx)"] = per_call(op, sync=sync)
                gt, ht = gpu_pool.tensor, host_pool.tensor
                sd, dd = torch.tensor([0], device="cuda"), torch.tensor([1], device="cuda")
                sc, dc = torch.tensor([0]), torch.tensor([1])
                k = torch.ops.tiered_kv.copy_blocks
                pieces["copy_blocks kernel, gpu idx (no H2D of meta)"] = per_call(
                    lambda: k([ht], [gt], sd, dd, 4, 0), sync=sync
                )
                pieces["copy_blocks kernel, cpu idx"] = per_call(lambda: k([ht], [gt], sc, dc, 4, 0), sync=sync)
                pieces["copy_blocks dma, cpu idx"] = per_call(lambda: k([ht], [gt], sc, dc, 4, 1), sync=sync)
                x = torch.zeros(16, device="cuda")
                pieces["x.add_(1) (dispatcher + launch)"] = per_call(lambda: x.add_(1), sync=sync)
                pieces["pinned empty(8) + to(cuda, non_blocking)"] = per_call(
                    lambda: torch.empty(8, dtype=torch.int64, pin_memory=True).to("cuda", non_blocking=True), sync=sync
                )
            pieces["torch.cuda.Event(blocking) + record"] = per_call(
                lambda: torch.cuda.Event(blocking=True).record(ts), sync=sync
            )
            from tiered_kv.device import _HostFuncSignal

            sig = _HostFuncSignal()
            pieces["cudaLaunchHostFunc(sem_post) via ctypes"] = per_call(
                lambda: sig.enqueue(ts), n=400, loops=3, sync=sync
            )
            torch.cuda.synchronize()
            # drain posts
            import ctypes

            trywait = ctypes.CDLL("libc.so.6").sem_trywait
            trywait.argtypes = [ctypes.c_void_p]
            while trywait(sig._address) == 0:
                pass
            ev = torch.cuda.Event()
            ev.record(ts)
            pieces["stream.wait_event"] = per_call(lambda: ts.wait_event(ev))
        else:
            pieces["op() (reference)"] = per_call(op)
        loop = asyncio.get_running_loop()
        pieces["loop.call_soon_threadsafe (caller side)"] = per_call(
            lambda: loop.call_soon_threadsafe(int), n=1000, loops=3
        )
        await asyncio.sleep(0.01)
        pieces["np.diff run count (plan)"] = per_call(
            lambda: np.count_nonzero((np.diff(s_arr) != 1) | (np.diff(d_arr) != 1))
        )
        pieces["torch.from_numpy x2"] = per_call(lambda: (torch.from_numpy(s_arr), torch.from_numpy(d_arr)))
        result["pieces_us"] = {k: v * 1e6 for k, v in pieces.items()}
    return result


def main() -> None:
    """Command line (see the module docstring)."""
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", default=".")
    p.add_argument("--loop", default="uvloop")
    a = p.parse_args()
    os.makedirs(a.out, exist_ok=True)
    if a.loop == "uvloop":
        import uvloop

        res = uvloop.run(probe(a.device, a.out))
    else:
        res = asyncio.run(probe(a.device, a.out))
    with open(os.path.join(a.out, f"percall-{a.device.split(':')[0]}.json"), "w") as f:
        json.dump(res, f, indent=2)
    print(json.dumps({k: v for k, v in res.items() if k not in ("cprofile", "torch_profiler")}, indent=2))


if __name__ == "__main__":
    main()
