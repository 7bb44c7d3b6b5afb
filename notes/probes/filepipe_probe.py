"""Session j probe: where a GPU->file copy of 1 MiB blocks loses against raw ``pwritev`` on the same disk.

Times every file write of one copy (submitted, started on its I/O thread, header filled, written) and every
group's host<->device op (issued, landed), for GPU->file and host->file through the engine and for raw
``os.pwritev`` of the same block count on the same threads, back to back, several rounds.

Run on a CUDA machine (or ``--device cpu`` for the emulated device):
``python notes/probes/filepipe_probe.py [--device cuda] [--dir D] [--rounds 3] [--gds off|compat]``.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import json
import os
import statistics
import tempfile
import threading
import time
from typing import Any

import torch
from tiered_kv.backends.posix import aligned_empty

from tiered_kv import KVLayout, Tier, TransferEngine
from tiered_kv.file import FileTierConfig, pipeline

MiB = 1 << 20
now = time.perf_counter


class Trace:
    """Per-write and per-group timestamps of one copy."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.writes: list[list[float]] = []  # [submitted, started, filled, ended]
        self.groups: list[list[float]] = []  # [issued, landed]
        self.reads: list[list[float]] = []  # [submitted, read, checked, ended]

    def reset(self) -> None:
        """Forget what was recorded."""
        with self.lock:
            self.writes, self.groups, self.reads = [], [], []


TRACE = Trace()


def instrument(backend: Any) -> None:
    """Record every ``pwrite`` / ``pread`` of ``backend`` in :data:`TRACE`."""
    real = backend.pwrite

    def pwrite(buffers, offset, *, before=None):  # type: ignore[no-untyped-def]
        rec = [now(), 0.0, 0.0, 0.0]

        def hook() -> None:
            rec[1] = now()
            if before is not None:
                before()
            rec[2] = now()

        fut = real(buffers, offset, before=hook)

        def ended(_: object) -> None:
            rec[3] = now()
            with TRACE.lock:
                TRACE.writes.append(rec)

        fut.add_done_callback(ended)
        return fut

    backend.pwrite = pwrite
    real_read = backend.pread

    def pread(buffers, offset, *, after=None):  # type: ignore[no-untyped-def]
        rec = [now(), 0.0, 0.0, 0.0]  # submitted, read done (I/O thread), after-hook done, future done

        def hook(n):  # type: ignore[no-untyped-def]
            rec[1] = now()
            if after is not None:
                after(n)
            rec[2] = now()

        fut = real_read(buffers, offset, after=hook)

        def ended(_: object) -> None:
            rec[3] = now()
            with TRACE.lock:
                TRACE.reads.append(rec)

        fut.add_done_callback(ended)
        return fut

    backend.pread = pread


_real_link = pipeline.FileCopy._link


def _link(self, js, bufs, *, to_staging, then):  # type: ignore[no-untyped-def]
    rec = [now(), 0.0]

    def landed(js2, bufs2):  # type: ignore[no-untyped-def]
        rec[1] = now()
        with TRACE.lock:
            TRACE.groups.append(rec)
        then(js2, bufs2)

    return _real_link(self, js, bufs, to_staging=to_staging, then=landed)


pipeline.FileCopy._link = _link  # type: ignore[method-assign]


def _write_group_worker_hash(self, js, bufs):  # type: ignore[no-untyped-def]
    """Variant: the group's checksums on a tier worker, each pwrite submitted with its header filled."""
    ring = self.io.ring()

    def run() -> None:
        for j, buf in zip(js, bufs, strict=True):
            self._step(j, buf, step=lambda j, buf: self._write(j, buf, ring.array[buf], ring.array[buf], prehash=True))

    self.io.workers.submit(run)


def use_variant(name: str) -> None:
    """Switch to a variant of the pipeline (``base``: the build as it is)."""
    if name == "worker-hash":
        pipeline.FileCopy._write_group = _write_group_worker_hash  # type: ignore[method-assign]
    elif name == "kvikio-direct-read":
        import kvikio.defaults

        kvikio.defaults.set("auto_direct_io_read", True)
    elif name != "base":
        raise SystemExit(f"unknown variant {name}")


def summarize(
    name: str, t0: float, t1: float, writes: list[list[float]], groups: list[list[float]], block: int, threads: int
) -> dict[str, Any]:
    """Throughput, thread occupancy and per-write phases of one write copy."""
    wall = t1 - t0
    n = len(writes)
    queue = [w[1] - w[0] for w in writes]
    fill = [w[2] - w[1] for w in writes]
    io = [w[3] - w[2] for w in writes]
    busy = sum(w[3] - w[1] for w in writes) / (threads * wall)
    first = min(w[1] for w in writes) - t0
    last = t1 - max(w[3] for w in writes)
    # time with fewer than `threads` writes in progress, between the first start and the last end
    ev = sorted([(w[1], 1) for w in writes] + [(w[3], -1) for w in writes])
    inflight, prev, starved = 0, ev[0][0], 0.0
    for t, d in ev:
        if inflight < threads:
            starved += t - prev
        inflight += d
        prev = t
    out = {
        "name": name,
        "GB/s": n * block / wall / 1e9,
        "wall ms": wall * 1e3,
        "writes": n,
        "busy": busy,
        "starved ms": starved * 1e3,
        "first start ms": first * 1e3,
        "after last ms": last * 1e3,
        "queue us p50": statistics.median(queue) * 1e6,
        "fill us p50": statistics.median(fill) * 1e6,
        "fill us mean": statistics.mean(fill) * 1e6,
        "write us p50": statistics.median(io) * 1e6,
        "write us mean": statistics.mean(io) * 1e6,
    }
    if groups:
        lat = [g[1] - g[0] for g in groups]
        out.update(
            {"groups": len(groups), "group us p50": statistics.median(lat) * 1e6, "group us max": max(lat) * 1e6}
        )
    return out


def summarize_reads(name: str, t0: float, t1: float, reads: list[list[float]], block: int) -> dict[str, Any]:
    """Throughput and per-read phases of one read copy."""
    wall = t1 - t0
    n = len(reads)
    out: dict[str, Any] = {"name": name, "GB/s": n * block / wall / 1e9, "wall ms": wall * 1e3, "reads": n}
    if n and reads[0][1]:
        out.update(
            {
                "read us p50 (submit->read)": statistics.median(r[1] - r[0] for r in reads) * 1e6,
                "hook us p50": statistics.median(r[2] - r[1] for r in reads) * 1e6,
                "first read ms": (min(r[1] for r in reads) - t0) * 1e3,
                "after last read ms": (t1 - max(r[3] for r in reads)) * 1e3,
            }
        )
    return out


def raw_read_round(
    fd: int, views: list[memoryview], ex: concurrent.futures.ThreadPoolExecutor, slot: int
) -> tuple[float, float]:
    """One raw ``preadv`` per block on ``ex``: (start, end)."""
    t0 = now()
    futs = [ex.submit(os.preadv, fd, [v], i * slot) for i, v in enumerate(views)]
    for f in futs:
        f.result()
    return t0, now()


def raw_round(
    fd: int, views: list[memoryview], block: int, ex: concurrent.futures.ThreadPoolExecutor, slot: int
) -> tuple[float, float, list[list[float]]]:
    """One raw ``pwritev`` per block on ``ex``: (start, end, per-write records)."""
    recs: list[list[float]] = []

    def one(i: int) -> int:
        rec = [sub[i], now(), 0.0, 0.0]
        rec[2] = rec[1]
        k = os.pwritev(fd, [views[i]], i * slot)
        rec[3] = now()
        recs.append(rec)
        return k

    sub: list[float] = [0.0] * len(views)
    t0 = now()
    futs = []
    for i in range(len(views)):
        sub[i] = now()
        futs.append(ex.submit(one, i))
    for f in futs:
        f.result()
    return t0, now(), recs


async def main() -> None:
    """Parse arguments, run the rounds, print and save the rows."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dir", default=os.environ.get("TIERED_KV_BENCH_DIR"))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--blocks", type=int, default=1024)
    ap.add_argument("--block-mib", type=float, default=1.0)
    ap.add_argument("--gds", default="off")
    ap.add_argument("--staging", type=int, default=None)
    ap.add_argument("--json", default=None)
    ap.add_argument("--variant", default="base")
    ap.add_argument("--read", action="store_true", help="time reads (raw preadv, file->host, file->gpu)")
    args = ap.parse_args()
    use_variant(args.variant)
    block = int(args.block_mib * MiB)
    n = args.blocks
    threads = 4
    directory = args.dir or tempfile.mkdtemp(prefix="tkv-fp-")
    heads = max(1, block // (2 * 32 * 128 * 2))
    layout = KVLayout(num_layers=1, num_kv_heads=heads, head_dim=128, tokens_per_block=32, dtype=torch.float16)
    cfg = FileTierConfig(
        directory, n, name="probe", gds=args.gds, io_threads=threads, staging_blocks=args.staging, discard_mismatch=True
    )
    gpu = True  # the emulated device has a GPU pool too
    results: list[dict[str, Any]] = []
    # raw baseline: own file, slot-sized stride like the slab (header + payload)
    slot = block + 4096
    raw_path = os.path.join(directory, "raw.bin")
    fd = os.open(raw_path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o600)
    os.posix_fallocate(fd, 0, slot * n)
    buf = aligned_empty(block * n)
    buf.random_(0, 255)
    views = [memoryview(buf[i * block : (i + 1) * block].numpy().data) for i in range(n)]
    ex = concurrent.futures.ThreadPoolExecutor(threads)
    raw_round(fd, views, block, ex, slot)
    async with TransferEngine(
        layout, host_blocks=n, gpu_blocks=n if gpu else 0, device=args.device, file_config=cfg
    ) as eng:
        ft = eng.file_tier
        instrument(ft.backend)
        keys = [i.to_bytes(8, "little") for i in range(n)]
        eng.pool(Tier.HOST).tensor.view(torch.uint8).random_(0, 255)
        eng.pool(Tier.GPU).tensor.view(torch.uint8).random_(0, 255)
        await eng.copy(Tier.GPU, range(n), Tier.FILE, range(n), keys=keys)  # warm-up
        print(
            f"backend {ft.backend.name} direct {ft.direct} staging {ft.staging_depth} group {ft.staging_group}",
            flush=True,
        )
        for r in range(args.rounds if args.read else 0):
            for name, dst in (("raw read", None), ("file->host", Tier.HOST), ("file->gpu", Tier.GPU)):
                TRACE.reset()
                if dst is None:
                    t0, t1 = raw_read_round(fd, views, ex, slot)
                    row = {"round": r, "name": name, "GB/s": n * block / (t1 - t0) / 1e9, "wall ms": (t1 - t0) * 1e3}
                else:
                    t0 = now()
                    await eng.copy(Tier.FILE, range(n), dst, range(n))
                    t1 = now()
                    with TRACE.lock:
                        rd = list(TRACE.reads)
                    row = {"round": r, **summarize_reads(name, t0, t1, rd, block)}
                results.append(row)
                print(
                    " ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()), flush=True
                )
        for r in range(0 if args.read else args.rounds):
            for name, src in (("raw", None), ("gpu->file", Tier.GPU), ("host->file", Tier.HOST)):
                TRACE.reset()
                if src is None:
                    t0, t1, recs = raw_round(fd, views, block, ex, slot)
                    results.append({"round": r, **summarize(name, t0, t1, recs, [], block, threads)})
                else:
                    t0 = now()
                    await eng.copy(src, range(n), Tier.FILE, range(n), keys=keys)
                    t1 = now()
                    with TRACE.lock:
                        w, g = list(TRACE.writes), list(TRACE.groups)
                    results.append({"round": r, **summarize(name, t0, t1, w, g, block, threads)})
                row = results[-1]
                print(
                    " ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()), flush=True
                )
            # a group timeline for the last gpu->file round
        TRACE.reset()
        t0 = now()
        await eng.copy(Tier.GPU, range(n), Tier.FILE, range(n), keys=keys)
        t1 = now()
        w, g = sorted(TRACE.writes), sorted(TRACE.groups)
        g = [] if args.read else g
        print("group timeline (ms from copy start): issued -> landed; writes of the copy started by then")
        for gi, (a, b) in enumerate(g[:12]):
            started = sum(1 for x in w if x[1] <= b)
            ended = sum(1 for x in w if x[3] <= b)
            print(f"  group {gi}: {1e3 * (a - t0):.2f} -> {1e3 * (b - t0):.2f}  started {started} ended {ended}")
    os.close(fd)
    os.unlink(raw_path)
    ex.shutdown()
    if args.json:
        await asyncio.to_thread(_save, args.json, results)


def _save(path: str, results: list[dict[str, Any]]) -> None:
    with open(path, "w") as f:
        json.dump(results, f, indent=1)


asyncio.run(main())
