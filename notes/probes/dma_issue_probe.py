"""Session r probe: is a 64 KiB DMA copy of many pieces bound by the host's issue cost?

Three H100 runs each had one layout row by DMA at 64 KiB pieces fall to 0.37-0.83 of a contiguous copy, where
repeats gave 0.87-0.93. Hypothesis: the batch DMA issue costs the host ~1 us per piece, a 64 KiB piece takes
~1.2 us on the link, so a slow spell of the host makes the copy host-bound.

Per piece size (32 KiB .. 512 KiB) and direction, 256 MiB in scattered pieces (the bench's layout rows move
128 blocks x 32 layers of 64 KiB), the extension's op by DMA and by the kernel, and one contiguous copy of the same
bytes, taking turns, 40 turns; for each: the time until the op returns (issue) and until the stream is done (wall).
Host states before each turn: back to back, after a 2 ms sleep. Prints per (size, dir, path, state) the median and
p90 of issue and wall in us, the median of issue/wall, GB/s, and the ratio contiguous / path per turn (median, min).
Run on a CUDA machine: ``python dma_issue_probe.py``.
"""

from __future__ import annotations

import json
import statistics
import sys
import time

import numpy as np
import torch

from tiered_kv import _ext, ops

TOTAL = 256 << 20


def main() -> None:
    """Every line of the probe."""
    assert _ext.load(), "the extension did not load"
    host = torch.empty(TOTAL, dtype=torch.uint8, pin_memory=True)
    gpu = torch.empty(TOTAL, dtype=torch.uint8, device="cuda")
    stream = torch.cuda.Stream()
    op = torch.ops.tiered_kv.copy_blocks
    rows = []
    for piece in (32 << 10, 64 << 10, 128 << 10, 512 << 10):
        n = TOTAL // piece
        s = torch.from_numpy(np.random.default_rng(piece).permutation(n))
        d = torch.arange(n)
        hv, gv = [host.view(n, 1, 1, piece)], [gpu.view(n, 1, 1, piece)]
        for direction, dst, src, cd, cs in (("h2d", gv, hv, gpu, host), ("d2h", hv, gv, host, gpu)):
            for state in ("back to back", "sleep 2 ms"):
                got: dict[str, list[tuple[float, float]]] = {"dma": [], "kernel": [], "contiguous": []}
                for turn in range(41):
                    for path in ("dma", "kernel", "contiguous") if turn % 2 else ("contiguous", "kernel", "dma"):
                        stream.synchronize()
                        if state == "sleep 2 ms":
                            time.sleep(0.002)
                        t0 = time.perf_counter()
                        with torch.cuda.stream(stream):
                            if path == "contiguous":
                                cd.copy_(cs, non_blocking=True)
                            else:
                                op(dst, src, s, d, 1, ops.METHOD_DMA if path == "dma" else ops.METHOD_KERNEL)
                        t1 = time.perf_counter()
                        stream.synchronize()
                        t2 = time.perf_counter()
                        if turn:
                            got[path].append((t1 - t0, t2 - t0))
                for path in ("dma", "kernel"):
                    issue = [a for a, _ in got[path]]
                    wall = [b for _, b in got[path]]
                    vs = [c[1] / w for c, w in zip(got["contiguous"], wall, strict=True)]
                    row = {
                        "piece_KiB": piece >> 10,
                        "dir": direction,
                        "path": path,
                        "state": state,
                        "issue_us_p50": round(statistics.median(issue) * 1e6, 1),
                        "issue_us_p90": round(sorted(issue)[int(0.9 * len(issue))] * 1e6, 1),
                        "wall_us_p50": round(statistics.median(wall) * 1e6, 1),
                        "wall_us_p90": round(sorted(wall)[int(0.9 * len(wall))] * 1e6, 1),
                        "issue_over_wall_p50": round(statistics.median(a / b for a, b in got[path]), 3),
                        "issue_us_per_piece_p50": round(statistics.median(issue) * 1e6 / n, 3),
                        "GBps": round(TOTAL / statistics.median(wall) / 1e9, 2),
                        "vs_contiguous_p50": round(statistics.median(vs), 3),
                        "vs_contiguous_min": round(min(vs), 3),
                    }
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    json.dump(rows, sys.stdout if len(sys.argv) < 2 else open(sys.argv[1], "w"), indent=1)


if __name__ == "__main__":
    main()
