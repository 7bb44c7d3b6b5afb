"""Benchmark: shipping block-offset tables to the device, staged (race-free) next to the racy in-place path.

Primitives:

* :func:`run` -- ``run(quick, device) -> dict`` (rows next to their same-run baselines).
* :func:`host_work` -- the torch calls and Python bytecodes of one gather-mode call, staged and racy, counted
  on the emulated device with the op run at submit as on CUDA (the same counts on any machine).
* :func:`main` -- the command line.

For 64, 256 and 1,024 sequences, in copy mode and gather mode, it measures per call:

* host time: how long ``copy_batch_block_offsets`` takes to return (snapshot + enqueue), median;
* device time: how long the stream spends on the op (CUDA events; on the emulated device, the worker's
  time inside the op), median;

for the staged path and, in the same run, the seed's racy in-place path (one persistent host buffer /
index buffer reused by every call), plus a bare device-to-device copy of the same bytes. Targets: staged
host time <= 1.2x the racy path's; gather mode's device time within 2x of the device-to-device copy.

Run: ``python -m tiered_kv.tools.bench.pagetables [--quick] [--device cpu|cuda] [--json F]``.
"""

from __future__ import annotations

import statistics
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from torch.overrides import TorchFunctionMode

from ... import _ext
from ...device import CudaStream, Device, EmulatedStream, Stream, resolve_device
from ...staging import BlockOffsetTable, Mode
from ..baselines import InplaceShipper
from .common import bench_main, machine_info

__all__ = ["host_work", "main", "run"]

NAME = "pagetables"

_SLEEP_CYCLES = 4_000_000  # ~2 ms at H100/H200 clocks: longer than one call's host path (~0.1-0.4 ms)


def void(_: object) -> None:
    """Stream ops return nothing."""


def _gate_op(gate: threading.Event) -> Callable[[], None]:
    """A stream op that holds the (emulated) stream until ``gate`` is set."""
    return lambda: void(gate.wait())


def _device_time(dev: Device, stream: Stream, fn: Callable[[], object]) -> Callable[[], float]:
    """Run ``fn`` (which enqueues on ``stream``) bracketed by timing marks; returns a getter of the seconds."""
    if dev.is_cuda:
        assert isinstance(stream, CudaStream)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        # A sleep kernel first keeps the stream busy while fn() runs on the host: otherwise the idle stream
        # reaches `start` at once and the events time the host's snapshot and launch path, not the device.
        with torch.cuda.stream(stream.torch_stream):
            torch.cuda._sleep(_SLEEP_CYCLES)
        start.record(stream.torch_stream)
        fn()
        end.record(stream.torch_stream)
        return lambda: start.elapsed_time(end) / 1e3
    marks: list[float] = []
    stream.submit(lambda: marks.append(time.perf_counter()))
    fn()
    stream.submit(lambda: marks.append(time.perf_counter()))
    return lambda: marks[1] - marks[0]


def _measure(
    dev: Device, stream: Stream, calls: Sequence[Callable[[], object]], iters: int, refill: Callable[[], None]
) -> list[tuple[float, float]]:
    """Median (host, device) seconds per call of each of ``calls``, interleaved so they share the machine's noise.

    Host iterations time the call alone; on the emulated device the stream is held by a gate meanwhile, so
    the worker thread does not compete with the caller for the GIL (an emulation artefact: a GPU runs
    beside the CPU). Device iterations bracket the call with timing marks. The host table is refilled
    between calls (untimed) and one call is in flight at a time, so no figure includes back-pressure.
    """
    host: list[list[float]] = [[] for _ in calls]
    device: list[list[float]] = [[] for _ in calls]
    warmup = 3
    for i in range(iters + warmup):
        order = list(range(len(calls))) if i % 2 else list(range(len(calls)))[::-1]
        for k in order:
            refill()
            gate = None
            if not dev.is_cuda:
                gate = threading.Event()
                stream.submit(_gate_op(gate))
            t0 = time.perf_counter()
            calls[k]()
            elapsed = time.perf_counter() - t0
            if gate is not None:
                gate.set()
            stream.synchronize()
            refill()
            getter = _device_time(dev, stream, calls[k])
            stream.synchronize()
            if i >= warmup:  # warm-up: first allocations, kernel build/load
                host[k].append(elapsed)
                device[k].append(getter())
    return [(statistics.median(h), statistics.median(d)) for h, d in zip(host, device, strict=True)]


def _d2d_time(dev: Device, stream: Stream, shape: Sequence[int], iters: int) -> float:
    src = torch.randint(0, 1000, tuple(shape), dtype=torch.int32, device=dev.torch_device)
    dst = torch.empty_like(src)
    if dev.is_cuda:
        torch.cuda.synchronize()  # made on the default stream; copied on ours

    def copy() -> None:
        stream.submit(lambda: void(dst.copy_(src, non_blocking=True)))

    times = []
    for i in range(iters + 3):
        getter = _device_time(dev, stream, copy)
        stream.synchronize()
        if i >= 3:
            times.append(getter())
    return statistics.median(times)


class _InlineStream(EmulatedStream):
    """An emulated stream that runs submitted work at once, on the caller's thread, as CUDA's ``submit`` does."""

    def submit(self, fn: Callable[[], object], *, explicit: bool = False) -> None:
        """Run ``fn`` now."""
        fn()


class _TorchCalls(TorchFunctionMode):
    """Counts the torch calls made at the top level (not those inside another torch call), by name."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: Counter[str] = Counter()

    def __torch_function__(
        self, func: Any, types: Any, args: Sequence[Any] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        owner = getattr(func, "__self__", None)  # a property's getter: name the property (shape, dtype, ...)
        name = getattr(owner, "__name__", None) if type(owner).__name__ == "getset_descriptor" else None
        self.calls[name or getattr(func, "__name__", None) or str(func)] += 1
        tracer = sys.gettrace()
        sys.settrace(None)  # what runs inside a torch call (the CPU reference of an op) is not the caller's work
        try:
            return func(*args, **(kwargs or {}))
        finally:
            sys.settrace(tracer)


_COUNTER_CODE = _TorchCalls.__torch_function__.__code__


def host_work(seqs: int = 64, calls: int = 50) -> dict[str, dict[str, Any]]:
    """Per gather-mode call of ``seqs`` sequences: torch calls and Python bytecodes, staged and racy.

    Counted on the emulated device through a stream that runs the op at submit (so the op's own Python path,
    which CUDA runs at submit too, is counted; the op itself is one torch call). Between calls (uncounted)
    one slot of the batch is refilled, as a scheduler does, so every staged call refreshes one row. Torch
    calls are those a ``TorchFunctionMode`` sees (tensor methods, properties, ops; ``torch.from_numpy`` and
    CUDA events are not among them); bytecodes are counted with ``sys.settrace``.
    """
    pools, max_blocks = 2, 16
    table = BlockOffsetTable(pools, 4 * seqs, max_blocks, device="cpu", depth=4)
    rng = np.random.default_rng(0)
    for slot in range(4 * seqs):
        for p in range(pools):
            table.set_row(slot, p, rng.integers(0, 1 << 20, size=max_blocks))
    slots = np.sort(rng.choice(4 * seqs, size=seqs, replace=False))
    dst = torch.zeros(table.device_shape(seqs), dtype=torch.int32)
    stream = _InlineStream("host-work")
    naive = InplaceShipper(table)
    kw: dict[str, Any] = {"stream": stream, "mode": "gather", "max_blocks": max_blocks, "scale": [2, 2]}
    paths: dict[str, Callable[[], object]] = {
        "staged": lambda: table.copy_batch_block_offsets(dst, slots, v_offset=[1, 1], **kw),
        "racy": lambda: naive.ship(dst, slots, v_offset=[1, 1], **kw),
    }
    out: dict[str, dict[str, Any]] = {}
    try:
        for name, call in paths.items():
            for _ in range(3):  # warm-up: the row versions, the coefficient cache, the staging buffer
                call()
            opcodes: Counter[str] = Counter()

            def tracer(frame: Any, event: str, arg: object, opcodes: Counter[str] = opcodes) -> Any:
                if event == "call":
                    if frame.f_code is _COUNTER_CODE:
                        return None  # the counter's own bytecodes
                    frame.f_trace_opcodes = True
                elif event == "opcode":
                    opcodes[frame.f_code.co_qualname] += 1
                return tracer

            counter = _TorchCalls()
            for i in range(calls):
                table.set_row(int(slots[i % seqs]), 0, rng.integers(0, 1 << 20, size=max_blocks))
                with counter:
                    sys.settrace(tracer)
                    try:
                        call()
                    finally:
                        sys.settrace(None)
            out[name] = {
                "torch_calls": counter.calls.total() / calls,
                "bytecodes": sum(opcodes.values()) / calls,
                "torch_by_name": {k: v / calls for k, v in counter.calls.most_common()},
                "bytecodes_by_function": {k: v / calls for k, v in opcodes.most_common(12)},
            }
    finally:
        table.synchronize()
        stream.close()
    return out


def run(quick: bool, device: str) -> dict[str, Any]:
    """Run the page-table benchmarks; the JSON payload."""
    dev = resolve_device(device)
    pools, kv = 2, 2
    max_blocks = 32 if quick else 128
    sizes = (64, 256, 1024)
    iters = 20 if quick else 200
    table = BlockOffsetTable(pools, max(sizes), max_blocks, kv_factor=kv, device=dev, depth=4)
    naive = InplaceShipper(table)  # the racy baseline: buffers refilled in place
    stream = dev.new_stream("compute")
    rng = np.random.default_rng(0)
    full = rng.integers(0, 1 << 20, size=(pools, max(sizes), max_blocks))
    for slot in range(max(sizes)):
        for p in range(pools):
            table.set_row(slot, p, full[p, slot])
    scale, v_offset = [2, 2], [1, 1]
    if dev.is_cuda:
        _ext.load()  # the extension loads on first use; load it before asking what is registered
    gather_impl = (
        "tiered_kv.ops CUDA kernel"
        if _ext.cuda_kernels_registered().get("gather_block_offsets")
        else "tiered_kv.ops reference (no CUDA kernel)"
    )

    def refill() -> None:  # the scheduler refilling one slot per step, as the block manager does
        slot = int(rng.integers(0, max(sizes)))
        table.set_row(slot, 0, full[0, slot])

    rows: list[dict[str, Any]] = []
    try:
        for n in sizes:
            slots = np.sort(rng.choice(max(sizes), size=n, replace=False))
            nbytes = pools * n * kv * max_blocks * 4
            # Exactly the batch's shape, so the table is contiguous: the extension's gather writes a contiguous
            # dst (a batch smaller than a bigger device table costs one more device copy; see the notes).
            dst = torch.zeros(table.device_shape(n), dtype=torch.int32, device=dev.torch_device)
            if dev.is_cuda:
                torch.cuda.synchronize()  # allocated/filled on the default stream; used on ours
            d2d = _d2d_time(dev, stream, (pools, n, kv, max_blocks), iters)
            modes: tuple[Mode, ...] = ("copy", "gather")
            for mode in modes:
                kw: dict[str, Any] = {"scale": scale, "v_offset": v_offset} if mode == "gather" else {}

                def staged(
                    mode: Mode = mode, kw: dict[str, Any] = kw, slots: np.ndarray = slots, dst: torch.Tensor = dst
                ) -> None:
                    table.copy_batch_block_offsets(dst, slots, stream=stream, mode=mode, max_blocks=max_blocks, **kw)

                def racy(
                    mode: Mode = mode, kw: dict[str, Any] = kw, slots: np.ndarray = slots, dst: torch.Tensor = dst
                ) -> None:
                    naive.ship(dst, slots, stream=stream, mode=mode, max_blocks=max_blocks, **kw)

                (host_ours, dev_ours), (host_racy, dev_racy) = _measure(dev, stream, [staged, racy], iters, refill)
                rows.append(
                    {
                        "seqs": n,
                        "mode": mode,
                        "KiB": nbytes / 1024,
                        "host_us": host_ours * 1e6,
                        "host_us_racy": host_racy * 1e6,
                        "host_x_racy": host_ours / host_racy,
                        "dev_us": dev_ours * 1e6,
                        "dev_us_racy": dev_racy * 1e6,
                        "dev_us_d2d": d2d * 1e6,
                        "dev_x_d2d": dev_ours / d2d,
                    }
                )
    finally:
        table.synchronize()
        stream.close()
    stats = table.staging.statistics()
    work = host_work()
    return {
        "name": NAME,
        "machine": machine_info(device if dev.is_cuda else "cpu"),
        "rows": rows,
        "notes": [
            f"pools={pools} kv={kv} max_blocks_per_seq={max_blocks}, int32; medians of {iters} calls; "
            "host time = copy_batch_block_offsets returning (snapshot + enqueue), device time = the stream's time "
            "on the op (CUDA events behind a sleep kernel, so host issue time is excluded); "
            "one call in flight at a time",
            "racy = the seed's in-place path (persistent host buffer / index buffer reused every call), same run",
            f"gather implementation: {gather_impl}",
            "targets: host_x_racy <= 1.2; gather dev_x_d2d <= 2 (d2d = a bare device-to-device copy of the same bytes)",
            f"staging after the run: peak_live={stats.peak_live} allocated={stats.allocated} acquired={stats.acquired}",
            "host work per gather call (64 seqs, counted on the emulated device, op run at submit as on CUDA): "
            + ", ".join(
                f"{k} {v['torch_calls']:.0f} torch calls / {v['bytecodes']:.0f} bytecodes" for k, v in work.items()
            ),
        ],
    }


def main(argv: Sequence[str] | None = None) -> int:
    """Command line entry point."""
    return bench_main(NAME, run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
