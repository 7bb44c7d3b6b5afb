"""What the cache's integrity checks cost, against bringing the same bytes from pinned host memory in the same run.

Run: ``python -m tiered_kv.tools.bench.integrity --device cuda --json integrity.json``. One row per (layout, blocks):
the median time of :func:`~tiered_kv.integrity.token_checksums` over the blocks, the median time of a pinned
host-to-device copy of the same bytes, and their ratio against the target (checksumming costs at most 3% of the
load). On CUDA the checksums are the extension's kernel (kernels/checksum.cu), built or loaded before the first row;
without it they are its torch-ops reference, and the table's title says so. On the emulated device the baseline is
a host memory copy (the figures say only how the CPU fares).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable, Sequence

import torch

from ... import _ext
from ...integrity import token_checksums
from ...layout import KVLayout

__all__ = ["main", "measure"]

TARGET = 0.03

LAYOUTS = {
    "8B-shaped bf16 (32 layers, 8 KV heads x 128, 16 tokens)": KVLayout(
        num_layers=32, num_kv_heads=8, head_dim=128, tokens_per_block=16, dtype=torch.bfloat16
    ),
    "stress fp32 (3 layers, 2 KV heads x 8, 4 tokens)": KVLayout(
        num_layers=3, num_kv_heads=2, head_dim=8, tokens_per_block=4, dtype=torch.float32
    ),
}


def _median_seconds(fn: Callable[[], object], device: torch.device, repeat: int = 7) -> float:
    times = []
    for i in range(repeat + 1):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i:  # the first call pays lazy initialisation
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure(layout: KVLayout, blocks: int, device: torch.device) -> dict[str, object]:
    """One row: checksum and load seconds of ``blocks`` blocks of ``layout`` on ``device``."""
    pool = torch.empty((blocks, *layout.block_shape), dtype=layout.dtype, device=device)
    pool.view(torch.uint8).random_(0, 256)
    host = torch.empty_like(pool, device="cpu", pin_memory=device.type == "cuda")
    slots = list(range(blocks))
    checksum_s = _median_seconds(lambda: token_checksums(pool, slots), device)
    load_s = _median_seconds(lambda: pool.copy_(host, non_blocking=True), device)
    ratio = checksum_s / load_s
    nbytes = blocks * layout.bytes_per_block
    return {
        "layout": next(name for name, lay in LAYOUTS.items() if lay == layout),
        "blocks": blocks,
        "MiB": round(nbytes / 2**20, 1),
        "checksum_ms": round(checksum_s * 1e3, 3),
        "load_ms": round(load_s * 1e3, 3),
        "ratio": round(ratio, 4),
        "target": f"ratio <= {TARGET}",
        "met": ratio <= TARGET,
    }


def main(argv: Sequence[str] | None = None) -> int:
    """Print the table; write the rows as JSON with ``--json``."""
    p = argparse.ArgumentParser(prog="python -m tiered_kv.tools.bench.integrity", description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--json")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (emulated device)"
    # what token_checksums runs here: the kernel when the extension loads (built now, not inside a timed call)
    path = "CUDA kernel" if device.type == "cuda" and _ext.load() else "torch-ops reference"
    sizes = {"8B-shaped bf16 (32 layers, 8 KV heads x 128, 16 tokens)": (32, 512),
             "stress fp32 (3 layers, 2 KV heads x 8, 4 tokens)": (64, 4096)}
    if device.type != "cuda":
        sizes = {k: (v[0], v[0] * 2) for k, v in sizes.items()}
    rows = [measure(LAYOUTS[k], n, device) for k, ns in sizes.items() for n in ns]
    print(f"integrity checksums ({path}) against the load of the same bytes, on {name}")
    print(f"{'layout':<58} {'blocks':>6} {'MiB':>8} {'checksum ms':>11} {'load ms':>9} {'ratio':>7}  target      met")
    for r in rows:
        print(f"{r['layout']:<58} {r['blocks']:>6} {r['MiB']:>8} {r['checksum_ms']:>11} {r['load_ms']:>9} "
              f"{r['ratio']:>7}  {r['target']}  {r['met']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": name, "checksums": path, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
