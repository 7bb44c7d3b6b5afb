"""What every benchmark shares: machine facts, timing, a printed table and a JSON file.

Primitives:

* :func:`machine_info`, :func:`timeit`, :func:`median_seconds`, :func:`sync`, :func:`percentile` -- measuring.
* :func:`paired_seconds` -- ours and its baseline taking turns: the ratio of a row, robust to a drifting host;
  :func:`in_turns` -- any number of measurements taking turns (:func:`awaited_seconds`, :func:`synced_seconds`);
  :func:`offload_onboard_seconds` -- an engine's offload and onboard of some blocks, each so.
* :func:`print_table`, :func:`print_grouped`, :func:`write_json`, :func:`bench_main` -- reporting.

Convention: each benchmark module ``tiered_kv.tools.bench.<name>`` has ``run(quick: bool, device: str) -> dict``
returning ``{"name", "machine", "rows": [...], "notes": [...]}`` (rows are flat dicts; every row that is a
measurement of ours carries its same-run baseline and the ratio), and ``main(argv)`` that runs it, prints
the table and writes the JSON. ``tiered-kv bench`` runs them all into one table and one file.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import statistics
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import torch

__all__ = [
    "awaited_seconds",
    "bench_main",
    "in_turns",
    "machine_info",
    "median_seconds",
    "offload_onboard_seconds",
    "paired_seconds",
    "percentile",
    "print_grouped",
    "print_table",
    "sync",
    "synced_seconds",
    "timeit",
    "write_json",
]


def machine_info(device: str = "auto") -> dict[str, Any]:
    """Where a figure came from: host, CPU count, torch, and the GPU name when CUDA is used."""
    info: dict[str, Any] = {
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "device": "emulated (CPU)",
    }
    if device != "cpu" and torch.cuda.is_available():
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        info["device"] = props.name
        info["gpu_memory_gib"] = round(props.total_memory / 2**30, 1)
        info["cuda"] = torch.version.cuda
    return info


def timeit(fn: Callable[[], object], repeat: int, warmup: int = 1) -> list[float]:
    """Seconds per call of ``fn`` (``fn`` must finish its own work, e.g. synchronize)."""
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def sync(cuda: bool) -> None:
    """Wait for the GPU's queued work when ``cuda`` (a no-op on the emulated device)."""
    if cuda:
        torch.cuda.synchronize()


async def awaited_seconds(fn: Callable[[], Awaitable[object]], cuda: bool) -> float:
    """Wall seconds of ``await fn()`` (the call to the awaiting coroutine resuming), the GPU synchronized first."""
    sync(cuda)
    t0 = time.perf_counter()
    await fn()
    return time.perf_counter() - t0


async def synced_seconds(fn: Callable[[], object], cuda: bool) -> float:
    """Wall seconds of ``fn()`` with the GPU synchronized before and after (a same-run baseline)."""
    sync(cuda)
    t0 = time.perf_counter()
    fn()
    sync(cuda)
    return time.perf_counter() - t0


async def in_turns(calls: Sequence[Callable[[], Awaitable[float]]], turns: int) -> list[list[float]]:
    """Each of ``calls`` (each returns the seconds it measured) once per turn, ``turns`` times after a warm-up turn.

    The order rotates from turn to turn (with two calls: alternating which goes first), so no call always follows
    the same one. Returns the seconds per call, per turn: the ratios of one turn's measurements survive a host whose
    speed drifts between turns.
    """
    out: list[list[float]] = [[] for _ in calls]
    for turn in range(turns + 1):
        for k in range(len(calls)):
            j = (turn + k) % len(calls)
            seconds = await calls[j]()
            if turn:
                out[j].append(seconds)
    return out


async def paired_seconds(
    ours: Callable[[], Awaitable[object]], base: Callable[[], object], repeat: int, cuda: bool
) -> tuple[float, float, float]:
    """Ours and its baseline taking turns, ``repeat`` times after one warm-up of each (alternating which goes first).

    ``ours`` is awaited (:func:`awaited_seconds`); ``base`` is timed with the GPU synchronized before and after
    (:func:`synced_seconds`). Returns ``(ours median, base median, median over turns of base_i / ours_i)``: a
    host whose speed drifts during the run (other tenants, clocks) moves both sides of a turn alike, so the ratio
    survives what two separate medians measured seconds apart do not.
    """
    theirs, mine = await in_turns(
        [functools.partial(synced_seconds, base, cuda), functools.partial(awaited_seconds, ours, cuda)], repeat
    )
    ratio = statistics.median(b / o for b, o in zip(theirs, mine, strict=True))
    return statistics.median(mine), statistics.median(theirs), ratio


async def offload_onboard_seconds(
    engine: Any, idx: Any, device_memory: torch.device, repeat: int, cuda: bool
) -> dict[str, tuple[float, float, float]]:
    """Blocks ``idx`` offloaded and onboarded, each next to one contiguous copy of the same bytes, taking turns.

    The baseline copies between the engine's host pool memory and a scratch buffer on ``device_memory``
    (:func:`paired_seconds`). Returns ``{"offload": (ours, base, ratio), "onboard": (...)}``.
    """
    from ...pools import Tier  # the bench tools sit above the package

    host = engine.pool(Tier.HOST).tensor.view(-1).view(torch.uint8)
    flat = torch.empty(len(idx) * engine.layout.bytes_per_block, dtype=torch.uint8, device=device_memory)
    host = host[: flat.numel()]
    offload = await paired_seconds(
        lambda: engine.copy(Tier.GPU, idx, Tier.HOST, idx), lambda: host.copy_(flat, non_blocking=True), repeat, cuda
    )
    onboard = await paired_seconds(
        lambda: engine.copy(Tier.HOST, idx, Tier.GPU, idx), lambda: flat.copy_(host, non_blocking=True), repeat, cuda
    )
    return {"offload": offload, "onboard": onboard}


def median_seconds(fn: Callable[[], object], repeat: int, cuda: bool) -> float:
    """Median wall seconds of ``fn`` (synchronized before and after), after one warm-up call."""
    times = []
    for i in range(repeat + 1):
        sync(cuda)
        t0 = time.perf_counter()
        fn()
        sync(cuda)
        if i:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) by linear interpolation."""
    if not values:
        return float("nan")
    if len(values) == 1:
        return float(values[0])
    return (
        float(statistics.quantiles(values, n=100, method="inclusive")[max(0, min(98, round(q) - 1))])
        if 0 < q < 100
        else (float(min(values)) if q <= 0 else float(max(values)))
    )


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        if value != value:  # NaN
            return "-"
        if abs(value) >= 100:
            return f"{value:,.0f}"
        if abs(value) >= 1:
            return f"{value:.2f}"
        return f"{value:.3g}"
    return str(value)


def print_table(rows: Sequence[dict[str, Any]], title: str = "") -> str:
    """Render rows as an aligned text table (columns are the union of keys, in first-seen order)."""
    if not rows:
        return ""
    cols: list[str] = []
    for row in rows:
        for key in row:
            if key not in cols:
                cols.append(key)
    cells = [[_fmt(row.get(c, "")) for c in cols] for row in rows]
    widths = [max(len(c), *(len(r[i]) for r in cells)) for i, c in enumerate(cols)]
    lines = []
    if title:
        lines.append(title)
    lines.append("  ".join(c.ljust(w) for c, w in zip(cols, widths, strict=True)))
    lines.append("  ".join("-" * w for w in widths))
    lines.extend("  ".join(v.rjust(w) for v, w in zip(r, widths, strict=True)) for r in cells)
    text = "\n".join(lines)
    print(text, flush=True)
    return text


def print_grouped(result: dict[str, Any]) -> None:
    """Print a benchmark result as one table per ``bench`` kind (rows of a kind share their columns)."""
    groups: dict[str, list[dict[str, Any]]] = {}
    for row in result["rows"]:
        groups.setdefault(str(row.get("bench", result["name"])), []).append(row)
    for kind, rows in groups.items():
        print_table(
            [{k: v for k, v in r.items() if k not in ("bench", "id")} for r in rows],
            f"\n{result['name']} / {kind} on {result['machine']['device']}",
        )


def write_json(path: str, payload: dict[str, Any]) -> None:
    """Write ``payload`` as indented JSON to ``path``."""
    with open(path, "w") as f:
        json.dump(payload, f, indent=2, default=str)


def bench_main(name: str, run: Callable[[bool, str], dict[str, Any]], argv: Sequence[str] | None = None) -> int:
    """Standard command line of one benchmark module: ``--quick``, ``--device``, ``--json``."""
    parser = argparse.ArgumentParser(
        prog=f"python -m tiered_kv.tools.bench.{name}", description=f"tiered_kv {name} benchmark"
    )
    parser.add_argument("--quick", action="store_true", help="CPU-sized run (seconds, not minutes)")
    parser.add_argument("--device", default="auto", help="auto | cpu | cuda[:N] (default: auto)")
    parser.add_argument("--json", default=f"bench-{name}.json", help="where to write the JSON (default: %(default)s)")
    args = parser.parse_args(argv)
    from .targets import SCHEMA, finalize

    result = finalize(run(args.quick, args.device))
    result["schema"] = SCHEMA
    print_grouped(result)
    for note in result.get("notes", []):
        print(f"  note: {note}")
    write_json(args.json, result)
    print(f"wrote {args.json}")
    return 0
