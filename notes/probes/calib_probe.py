"""Sessions j and k probe: how stable the DMA-vs-kernel start-up calibration is on one GPU host.

Runs the engine's own calibration (``copyops._decide_dma_thresholds`` over ``copyops._dma_samples``) several
times in one process and prints, per run, the median DMA/kernel time ratio per size after the first pass
(scattered pieces, and runs of blocks of a layer-major pool), the thresholds that pass alone gives, which sizes
the rule sampled again as close calls, and the thresholds it chose. A ratio <= 0.98 is a DMA win; the threshold is
the smallest size from which DMA wins at every larger size. With ``--by-size``, each run also measures session j's
order (all turns of one size before the next, five turns, no second look) beside it.

Run on a CUDA machine: ``python notes/probes/calib_probe.py [--runs 6] [--by-size]``.
"""

from __future__ import annotations

import argparse
import statistics

from tiered_kv import _ext, copyops

SIZES = copyops._CALIBRATION_PIECES


def medians(samples: dict[int, list[float]]) -> list[float]:
    """Median per calibration size."""
    return [statistics.median(samples[size]) for size in SIZES]


def row(label: str, ratios: list[float], threshold: int) -> str:
    """One printed line."""
    return f"{label:28s} " + " ".join(f"{r:6.3f}" for r in ratios) + f"  -> {threshold >> 10} KiB"


def main() -> None:
    """Run the calibration ``--runs`` times; print the ratios per size and the thresholds."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=6)
    ap.add_argument("--by-size", action="store_true")
    args = ap.parse_args()
    assert _ext.load(), "the CUDA extension did not load"
    print("KiB                          " + " ".join(f"{s >> 10:>6d}" for s in SIZES), flush=True)
    final: list[tuple[int, int]] = []
    first: list[tuple[int, int]] = []
    old: list[tuple[int, int]] = []
    for run in range(args.runs):
        calls: list[tuple[tuple[int, ...], copyops._Samples]] = []

        def sample(sizes: tuple[int, ...], calls: list = calls) -> copyops._Samples:  # type: ignore[type-arg]
            got = copyops._dma_samples(0, sizes)
            calls.append((sizes, {k: {s: list(v) for s, v in by.items()} for k, by in got.items()}))
            return got

        piece, rows_at, (pm, rm) = copyops._decide_dma_thresholds(sample)
        one = {kind: medians(calls[0][1][kind]) for kind in copyops._KINDS}
        first.append((copyops._threshold_of(one["pieces"]) >> 10, copyops._threshold_of(one["rows"]) >> 10))
        final.append((piece >> 10, rows_at >> 10))
        for kind in copyops._KINDS:
            print(row(f"run {run} first pass {kind}", one[kind], copyops._threshold_of(one[kind])), flush=True)
        again = [s >> 10 for sizes, _ in calls[1:] for s in sizes]
        print(row(f"run {run} final pieces", pm, piece), flush=True)
        print(row(f"run {run} final rows", rm, rows_at) + f"   (sampled again: {again} KiB)", flush=True)
        if args.by_size:
            by = [copyops._dma_samples(0, (size,), turns=5) for size in SIZES]
            ratios = {k: [statistics.median(b[k][s]) for b, s in zip(by, SIZES, strict=True)] for k in copyops._KINDS}
            old.append(tuple(copyops._threshold_of(ratios[k]) >> 10 for k in copyops._KINDS))  # type: ignore[arg-type]
            for kind in copyops._KINDS:
                print(row(f"run {run} by-size {kind}", ratios[kind], copyops._threshold_of(ratios[kind])), flush=True)
    print(f"final (pieces KiB, rows KiB) per run: {final}")
    print(f"first pass alone: {first}")
    if old:
        print(f"by-size (session j's order): {old}")


if __name__ == "__main__":
    main()
