"""File-tier benchmark: spill/fill bandwidth next to raw O_DIRECT I/O, GPU<->file end to end, reopen time.

Primitives:

* :func:`run` -- ``run(quick, device) -> dict`` (rows next to their same-run baselines).
* :func:`main` -- the command line.

Rows, each next to a baseline measured in the same run, on the same directory:

* ``host->file`` / ``file->host``: one ``engine.copy()`` of N blocks (headers, checksums, verification
  included), next to raw ``os.pwritev`` / ``os.preadv`` of the same block size and count with the same thread
  count (O_DIRECT when the directory allows it, page-aligned buffers), into a separate file in the same
  directory. Target >= 0.9x both ways, for every backend available (posix; gds where kvikio and a CUDA
  driver exist).
* ``gpu->file`` / ``file->gpu`` (CUDA only): end to end, next to min(pinned PCIe copy of the same bytes, the
  raw disk figure of the same direction). Target >= 0.85x.
* ``reopen``: opening a file tier of 65,536 slots (4 KiB blocks) and rebuilding its index from the slot
  headers, next to a bare sequential read of the same file (what the scan cannot beat).

Run: ``python -m tiered_kv.tools.bench.filetier [--quick] [--device cpu|cuda] [--dir D] [--json F]``.
The directory defaults to ``TIERED_KV_BENCH_DIR`` or a new temporary directory (removed afterwards). Disk
figures vary run to run; only the same-run ratios mean something.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Sequence
from typing import Any

import torch

from ...backends.posix import DIRECT_ALIGN, aligned_empty, direct_io_supported
from ...engine import TransferEngine
from ...file import FileTier, FileTierConfig
from ...layout import KVLayout
from ...pools import Tier
from .common import bench_main, machine_info

THREADS = 4


def _layout(block_bytes: int) -> KVLayout:
    # layers * kv * heads * tokens * head_dim * 2 bytes = block_bytes, with 32 tokens and head_dim 128
    heads = max(1, block_bytes // (2 * 32 * 128 * 2))
    return KVLayout(num_layers=1, num_kv_heads=heads, head_dim=128, tokens_per_block=32, dtype=torch.float16)


class _Raw:
    """Raw ``os.pwritev`` / ``os.preadv``, one call per block, on ``threads`` threads, page-aligned buffers."""

    def __init__(self, directory: str, block_bytes: int, nblocks: int, threads: int) -> None:
        self.direct = direct_io_supported(directory)
        self.path = os.path.join(directory, "raw-baseline.bin")
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | (os.O_DIRECT if self.direct else 0), 0o600)
        os.posix_fallocate(self.fd, 0, block_bytes * nblocks)
        self.buf = aligned_empty(block_bytes * nblocks)
        self.buf.random_(0, 255)
        self.block_bytes = block_bytes
        self.views = [
            memoryview(self.buf[i * block_bytes : (i + 1) * block_bytes].numpy().data) for i in range(nblocks)
        ]
        self.ex = concurrent.futures.ThreadPoolExecutor(threads)

    def gbps(self, write: bool) -> float:
        op = os.pwritev if write else os.preadv
        b = self.block_bytes
        t0 = time.perf_counter()
        futs = [self.ex.submit(op, self.fd, [v], i * b) for i, v in enumerate(self.views)]
        for f in futs:
            assert f.result() == b
        return b * len(self.views) / (time.perf_counter() - t0) / 1e9

    def close(self) -> None:
        self.ex.shutdown()
        os.close(self.fd)
        os.unlink(self.path)


async def _measure(
    directory: str,
    device: str,
    gds: str,
    block_bytes: int,
    nblocks: int,
    repeat: int,
    gpu: bool,
    raw: _Raw | None,
    staging: int | None = None,
) -> dict[str, Any]:
    """Best-of-``repeat`` GB/s of ours (and of raw, interleaved with ours so both see the same disk weather)."""
    layout = _layout(block_bytes)
    cfg = FileTierConfig(
        directory,
        nblocks,
        name=f"bench-{gds}",
        gds=gds,
        io_threads=THREADS,
        staging_blocks=staging,  # None: sized from bandwidth x latency (the default)
        discard_mismatch=True,
    )
    n = nblocks
    out: dict[str, Any] = {"write": 0.0, "read": 0.0, "raw_write": 0.0, "raw_read": 0.0}
    async with TransferEngine(layout, host_blocks=n, gpu_blocks=n if gpu else 0, device=device, file_config=cfg) as eng:
        ft = eng.file_tier
        out["backend"] = ft.backend.name + ("+direct" if ft.direct else "")
        keys = [i.to_bytes(8, "little") for i in range(n)]
        eng.pool(Tier.HOST).tensor.view(torch.uint8).random_(0, 255)
        src_tier = Tier.GPU if gpu else Tier.HOST
        if gpu:
            eng.pool(Tier.GPU).tensor.view(torch.uint8).random_(0, 255)
        await eng.copy(src_tier, range(n), Tier.FILE, range(n), keys=keys)  # warm up threads and staging
        for _ in range(repeat):
            if raw is not None:
                out["raw_write"] = max(out["raw_write"], raw.gbps(True))
            t = await eng.copy(src_tier, range(n), Tier.FILE, range(n), keys=keys)
            out["write"] = max(out["write"], t.gbps)
            if raw is not None:
                out["raw_read"] = max(out["raw_read"], raw.gbps(False))
            t = await eng.copy(Tier.FILE, range(n), src_tier, range(n))
            out["read"] = max(out["read"], t.gbps)
        out["integrity_failures"] = ft.statistics().integrity_failures
        out["staging"] = ft.staging_depth if gpu else 0
        path = ft.path
    os.unlink(path)
    return out


def _pcie(nbytes: int, device: str) -> tuple[float, float]:
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    res = []
    for d2h in (True, False):
        best = 0.0
        for _ in range(3):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            (host.copy_(dev, non_blocking=True) if d2h else dev.copy_(host, non_blocking=True))
            torch.cuda.synchronize()
            best = max(best, nbytes / (time.perf_counter() - t0) / 1e9)
        res.append(best)
    return res[0], res[1]


def _reopen(directory: str, slots: int, populate: int) -> dict[str, Any]:
    layout = KVLayout(num_layers=1, num_kv_heads=1, head_dim=64, tokens_per_block=16, dtype=torch.float16)  # 4 KiB
    cfg = FileTierConfig(directory, slots, name="bench-reopen", gds="off", io_threads=THREADS, discard_mismatch=True)

    async def fill() -> str:
        async with TransferEngine(layout, host_blocks=4096, device="cpu", file_config=cfg) as eng:
            eng.pool(Tier.HOST).tensor.view(torch.uint8).random_(0, 255)
            for first in range(0, populate, 4096):
                k = min(4096, populate - first)
                await eng.copy(
                    Tier.HOST,
                    range(k),
                    Tier.FILE,
                    range(first, first + k),
                    keys=[(first + i).to_bytes(8, "little") for i in range(k)],
                )
            return eng.file_tier.path

    path = asyncio.run(fill())
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        ft = FileTier(layout, cfg)
        times.append(time.perf_counter() - t0)
        report = ft.open_report
        ft.close()
    size = os.path.getsize(path)
    t0 = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        while f.read(8 << 20):
            pass
    bare = time.perf_counter() - t0
    os.unlink(path)
    return {
        "row": "reopen",
        "slots": slots,
        "populated": populate,
        "recovered": report.recovered,
        "seconds": statistics.median(times),
        "baseline": "sequential read of the slab",
        "baseline seconds": bare,
        "file MiB": size >> 20,
    }


def run(quick: bool = False, device: str = "auto", directory: str | None = None) -> dict[str, Any]:
    """Every row; ``{"name", "machine", "rows", "notes"}``."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    cuda = device.startswith("cuda")
    directory = directory or os.environ.get("TIERED_KV_BENCH_DIR")
    tmp = None
    if directory is None:
        tmp = directory = tempfile.mkdtemp(prefix="tiered_kv-bench-")
    os.makedirs(directory, exist_ok=True)
    rows: list[dict[str, Any]] = []
    notes: list[str] = []
    try:
        from ...backends.gds import select_backend

        backends = ["off"]
        kind, probe = select_backend("auto")
        if kind == "gds":
            backends.append("auto")
        else:
            notes.append(f"gds backend not measured: {probe.reason if probe else 'off'}")
        sizes = [1 << 20] if quick else [1 << 20, 4 << 20]
        total = (64 << 20) if quick else (1 << 30)
        repeat = 3
        for block in sizes:
            n = max(8, total // block)
            raw = _Raw(directory, block, n, THREADS)
            direct = raw.direct
            try:
                for gds in backends:
                    ours = asyncio.run(_measure(directory, device, gds, block, n, repeat, False, raw))
                    for direction, mine, base, name in (
                        ("host->file", ours["write"], ours["raw_write"], "pwritev"),
                        ("file->host", ours["read"], ours["raw_read"], "preadv"),
                    ):
                        rows.append(
                            {
                                "row": direction,
                                "backend": ours["backend"],
                                "block MiB": block / 2**20,
                                "blocks": n,
                                "threads": THREADS,
                                "GB/s": mine,
                                "baseline": f"raw {'O_DIRECT ' if direct else ''}{name}",
                                "baseline GB/s": base,
                                "ratio": mine / base,
                                "target": 0.9,
                            }
                        )
                    # the ring sized from bandwidth x latency (the default), then the fixed 32-block ring of before
                    for fixed in (None, 32) if cuda else ():
                        g = asyncio.run(_measure(directory, device, gds, block, n, repeat, True, None, fixed))
                        d2h, h2d = _pcie(block * n, device)
                        for direction, mine, pcie, disk in (
                            ("gpu->file", g["write"], d2h, ours["raw_write"]),
                            ("file->gpu", g["read"], h2d, ours["raw_read"]),
                        ):
                            bound = min(pcie, disk)
                            label = {} if fixed is None else {"ring": f"fixed {fixed}"}
                            rows.append(
                                {
                                    "row": direction,
                                    **label,
                                    "staging": g["staging"],
                                    "backend": g["backend"],
                                    "block MiB": block / 2**20,
                                    "blocks": n,
                                    "threads": THREADS,
                                    "GB/s": mine,
                                    "baseline": f"min(PCIe {pcie:.1f}, raw disk {disk:.2f})",
                                    "baseline GB/s": bound,
                                    "ratio": mine / bound,
                                    "target": 0.85,
                                }
                            )
            finally:
                raw.close()
        rows.append(_reopen(directory, 65536, 8192 if quick else 65536))
        notes += [
            f"directory {directory}; O_DIRECT {'on' if direct_io_supported(directory) else 'off'}; "
            f"{THREADS} threads on both sides",
            "ours: wall time from copy() to the awaiting coroutine resuming "
            "(headers, xxh3-128 checksums and verification included)",
            f"raw: one pwritev/preadv per block, page-aligned buffers, {DIRECT_ALIGN}-aligned offsets, "
            "same thread count",
        ]
        if not cuda:
            notes.append("no CUDA: gpu<->file rows come only from a CUDA run")
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    return {"name": "filetier", "machine": machine_info(device), "rows": rows, "notes": notes}


def main(argv: Sequence[str] | None = None) -> int:
    """Command line entry point."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--dir", default=None)
    args, rest = parser.parse_known_args(argv)
    return bench_main("filetier", lambda quick, device: run(quick, device, args.dir), rest)


if __name__ == "__main__":
    raise SystemExit(main())
