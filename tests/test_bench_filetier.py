"""The file-tier benchmark: ratios are medians of back-to-back pairs, the GPU rows' disk bound is their own."""

from __future__ import annotations

import asyncio
import math
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from tiered_kv import Tier, TransferEngine
from tiered_kv.tools.bench import filetier, targets


def test_median_ratio_is_the_median_of_the_pair_ratios() -> None:
    # a disk drifting 3.0 -> 1.7 -> 2.4 GB/s with ours at 0.9x of each: best-of ours / best-of raw would also
    # say 0.9 here, but only because both bests came from the same pair; the median of pairs does not need that
    assert filetier.median_ratio([2.7, 1.53, 2.16], [3.0, 1.7, 2.4]) == pytest.approx(0.9)
    assert filetier.median_ratio([1.0, 2.0, 3.0], [2.0, 2.0, 2.0]) == pytest.approx(1.0)
    assert filetier.median_ratio([1.0, 3.0], [1.0, 1.0]) == pytest.approx(2.0)  # even count: the middle two
    # one outlier pair (the disk stalled during ours) moves the median by nothing
    assert filetier.median_ratio([0.1, 0.9, 0.95], [1.0, 1.0, 1.0]) == pytest.approx(0.9)
    with pytest.raises(ValueError):
        filetier.median_ratio([1.0, 2.0], [1.0])
    with pytest.raises(ValueError):
        filetier.median_ratio([], [])


class _FakeRaw(filetier._Raw):
    """A raw baseline with scripted figures (a drifting disk); logs each call next to the engine's copies."""

    def __init__(self, log: list[tuple[str, bool]], write: Sequence[float], read: Sequence[float]) -> None:
        self.log = log
        self.figures = {True: list(write), False: list(read)}

    def gbps(self, write: bool) -> float:
        self.log.append(("raw", write))
        return self.figures[write].pop(0)


@pytest.mark.timeout(120)
def test_gpu_rows_use_the_raw_disk_figure_interleaved_with_their_own_copies(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    log: list[tuple[str, bool]] = []
    copy = TransferEngine.copy

    def logged_copy(self: TransferEngine, src: Tier, *args: Any, **kwargs: Any) -> Any:
        log.append(("ours", src is not Tier.FILE))
        return copy(self, src, *args, **kwargs)

    monkeypatch.setattr(TransferEngine, "copy", logged_copy)
    raw_write, raw_read = [3.0, 1.7, 2.4], [2.9, 1.8, 2.2]
    raw = _FakeRaw(log, raw_write, raw_read)
    # the GPU measurement on the emulated device: the same code path as on CUDA, GPU pool in host memory
    g = asyncio.run(filetier._measure(str(tmp_path), "cpu", "off", 256 << 10, 8, 3, True, raw, 4))
    assert g["integrity_failures"] == 0 and g["staging"] == 4
    # warm-up, then per repetition raw and ours back to back, raw first in even repetitions and last in odd ones
    w, r = ("raw", True), ("raw", False)
    ow, orr = ("ours", True), ("ours", False)
    assert log == [ow, w, ow, r, orr, ow, w, orr, r, w, ow, r, orr]
    samples = g["samples"]
    assert samples["raw_write"] == raw_write and samples["raw_read"] == raw_read
    assert len(samples["write"]) == len(samples["read"]) == 3
    assert g["raw_write"] == statistics.median(raw_write) and g["write"] == statistics.median(samples["write"])

    # PCIe far above the disk for writes, far below it for reads: each direction's bound is the smaller one
    rows = filetier._gpu_rows(g, 1e9, 1e-3, 256 << 10, 8, None)
    by_row = {row["row"]: row for row in rows}
    write, read = by_row["gpu->file"], by_row["file->gpu"]
    assert write["ratio"] == pytest.approx(filetier.median_ratio(samples["write"], raw_write))
    assert write["baseline GB/s"] == statistics.median(raw_write)
    assert write["raw disk GB/s"] == statistics.median(raw_write) and write["PCIe GB/s"] == 1e9
    # the row's identity holds no measured figure: the same row of another run, with other figures, has the same id
    other = {**write, "raw disk GB/s": 1.5, "PCIe GB/s": 50.0, "baseline GB/s": 1.5, "GB/s": 1.2, "ratio": 0.8}
    assert targets.row_id(write) == targets.row_id(other)
    assert read["ratio"] == pytest.approx(statistics.median(samples["read"]) / 1e-3)
    assert read["baseline GB/s"] == 1e-3
    for row in rows:
        assert row["ratio min"] <= row["ratio"] <= row["ratio max"]
        assert "ring" not in row and row["staging"] == 4
    assert all(row["ring"] == "fixed 32" for row in filetier._gpu_rows(g, 1e9, 1e9, 256 << 10, 8, 32))


@pytest.mark.timeout(300)
def test_quick_run_on_cpu_has_pair_ratios(tmp_path: Path) -> None:
    result = filetier.run(True, "cpu", str(tmp_path))
    rows = {row["row"]: row for row in result["rows"]}
    assert {"host->file", "file->host", "reopen"} <= rows.keys()
    for name in ("host->file", "file->host"):
        row = rows[name]
        assert {"GB/s", "baseline GB/s", "ratio", "ratio min", "ratio max", "target"} <= row.keys()
        assert all(math.isfinite(row[k]) and row[k] > 0 for k in ("GB/s", "baseline GB/s", "ratio"))
        assert row["ratio min"] <= row["ratio"] <= row["ratio max"]
    assert any("median over repetitions" in note for note in result["notes"])
    # the raw baseline's file and every slab are removed (a tier's lock file stays)
    assert [p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")] == []
