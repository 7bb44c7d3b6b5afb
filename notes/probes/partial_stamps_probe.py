"""Session s probe: where the 4-of-16 partial GPU->GPU copy's wall time goes, stamped through thin wrappers.

The bench's row (128 blocks, tokens [0, 4) of every (layer, kv, head), 64 MiB) in the bench's turns: the GPU
synchronized, then the awaited engine copy, then the contiguous copy of the same bytes (synchronized before and
after). The engine's entry points are wrapped, not copied, so the same probe runs on any build that has them:
``native.launch`` (the one-call launch), ``FenceTable.register``, ``engine._watch`` (the in-place await) and
``engine._poll`` (the completion; in-place, it runs when the end is seen). Prints per build the median microseconds
after the call of each step, and the row's fraction in this process. Run on a CUDA machine:
``python partial_stamps_probe.py [TURNS]``.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

import tiered_kv
from tiered_kv import KVLayout, Tier, TransferEngine

TURNS = int(sys.argv[1]) if len(sys.argv) > 1 else 40


def stamped(stamps: dict[str, float], name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` with its entry and exit times written to ``stamps`` (the first call of a turn only)."""

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if name + " in" not in stamps:
            stamps[name + " in"] = time.perf_counter()
        out = fn(*args, **kwargs)
        if name + " out" not in stamps:
            stamps[name + " out"] = time.perf_counter()
        return out

    return wrapper


async def main() -> dict[str, Any]:
    """The row in turns, stamped."""
    layout = KVLayout(num_layers=32, num_kv_heads=8, head_dim=128, tokens_per_block=16, dtype=torch.bfloat16)
    idx = np.arange(256)
    n = 4
    out: dict[str, Any] = {"package": tiered_kv.__file__}
    async with TransferEngine(layout, gpu_blocks=256, host_blocks=128, device="cuda") as engine:
        gpu = engine.pool(Tier.GPU).tensor  # type: ignore[union-attr]
        nbytes = 128 * layout.partial_bytes(n)
        a = gpu.view(-1).view(torch.uint8)[:nbytes]
        b = gpu.view(-1).view(torch.uint8)[nbytes : 2 * nbytes]
        route = (Tier.GPU, idx[:128], Tier.GPU, idx[128:])
        for _ in range(3):  # warm up: shapes decided, the stream's rate learned
            await engine.copy(*route, num_tokens=n)
        torch.cuda.synchronize()
        stamps: dict[str, float] = {}
        resolved = engine._resolve_route(Tier.GPU, Tier.GPU)
        native = resolved[-1]
        if native is not None and native.launch is not None:
            native.launch = stamped(stamps, "launch", native.launch)
        fences = engine._fences
        fences.register = stamped(stamps, "register", fences.register)  # type: ignore[method-assign]
        engine._watch = stamped(stamps, "watch", engine._watch)  # type: ignore[method-assign]
        engine._poll = stamped(stamps, "poll", engine._poll)  # type: ignore[method-assign]
        for stream in engine._streams.values():  # the streams hold the bound _watch: rebind
            if getattr(stream, "watch", None) is not None:
                stream.watch = engine._watch  # type: ignore[attr-defined]
        rows: list[dict[str, float]] = []
        fractions = []
        for turn in range(TURNS + 1):
            order = ("engine", "contiguous") if turn % 2 else ("contiguous", "engine")
            row: dict[str, float] = {}
            for what in order:
                torch.cuda.synchronize()
                if what == "engine":
                    stamps.clear()
                    t0 = time.perf_counter()
                    transfer = engine.copy(*route, num_tokens=n)
                    t_copy = time.perf_counter()
                    await transfer
                    t1 = time.perf_counter()
                    row.update({k: (v - t0) * 1e6 for k, v in stamps.items()})
                    row["copy() returned"] = (t_copy - t0) * 1e6
                    row["resumed"] = (t1 - t0) * 1e6
                else:
                    t0 = time.perf_counter()
                    b.copy_(a, non_blocking=True)
                    t_copy = time.perf_counter()
                    torch.cuda.synchronize()
                    t1 = time.perf_counter()
                    row["contiguous copy_ returned"] = (t_copy - t0) * 1e6
                    row["contiguous synchronized"] = (t1 - t0) * 1e6
            if turn:
                rows.append(row)
                fractions.append(row["contiguous synchronized"] / row["resumed"])
        keys = sorted({k for r in rows for k in r}, key=lambda k: statistics.median(r[k] for r in rows if k in r))
        out["median_us"] = {k: round(statistics.median(r[k] for r in rows if k in r), 1) for k in keys}
        out["seen"] = {k: sum(1 for r in rows if k in r) for k in keys}
        out["fraction"] = round(statistics.median(fractions), 3)
        out["in_place"] = engine._in_place
    return out


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main())), flush=True)
