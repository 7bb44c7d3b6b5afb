"""Session j probe: how stable the DMA-vs-kernel start-up calibration is on one GPU host.

Runs the engine's own calibration (``copyops._measure_dma_threshold``) several times in one process and prints,
per run, the median DMA/kernel time ratio it saw at each size (scattered pieces, and runs of blocks of a
layer-major pool) and the thresholds it chose. A ratio <= 0.98 is a DMA win in the calibration's rule.

Run on a CUDA machine: ``python notes/probes/calib_probe.py [--runs 5]``.
"""

from __future__ import annotations

import argparse
import statistics
import types

from tiered_kv import _ext, copyops


def main() -> None:
    """Run the calibration ``--runs`` times; print the ratios per size and the thresholds."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args()
    assert _ext.load(), "the CUDA extension did not load"
    seen: list[float] = []

    def median(values):  # type: ignore[no-untyped-def]
        m = statistics.median(values)
        seen.append(m)
        return m

    copyops.statistics = types.SimpleNamespace(median=median)  # type: ignore[attr-defined]
    sizes = [p >> 10 for p in copyops._CALIBRATION_PIECES]
    print("KiB      " + " ".join(f"{s:>6d}" for s in sizes), flush=True)
    for run in range(args.runs):
        seen.clear()
        piece, row = copyops._measure_dma_threshold(0)
        pieces, rows = seen[0::2], seen[1::2]
        print(f"run {run} pieces " + " ".join(f"{r:6.3f}" for r in pieces) + f"  -> {piece >> 10} KiB", flush=True)
        print(f"run {run} rows   " + " ".join(f"{r:6.3f}" for r in rows) + f"  -> {row >> 10} KiB", flush=True)


if __name__ == "__main__":
    main()
