"""The kernel benchmark runs unattended: --quick on the emulated device gives every row kind, labelled."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from tiered_kv.tools.bench import kernels


@pytest.mark.timeout(300)
def test_quick_run_on_cpu_has_every_row_kind(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "k.json"
    assert kernels.main(["--quick", "--device", "cpu", "--json", str(out)]) == 0
    payload = json.loads(out.read_text())
    kinds = {row["bench"] for row in payload["rows"]}
    assert kinds == {"layer_major", "sweep", "partial", "gather", "layouts"}
    assert all(row["device"] == "emulated" for row in payload["rows"])
    assert any("emulated" in note for note in payload["notes"])
    assert not [note for note in payload["notes"] if "failed" in note]
    sweep = [r for r in payload["rows"] if r["bench"] == "sweep"]
    assert [r["chunk_KiB"] for r in sweep] == [4, 64, 1024]
    printed = capsys.readouterr().out
    assert "kernels / gather on emulated" in printed
    # partial rows carry what they can reach: the fixed cost of an awaited call is measured on every device;
    # the bound needs the op's device time, which the emulated device does not have (NaN, written as NaN)
    partial = [r for r in payload["rows"] if r["bench"] == "partial"]
    assert len(partial) == 6 and {r["direction"] for r in partial} == {"gpu->gpu", "host->gpu"}
    for row in partial:
        assert {"fraction", "floor_us", "bound_fraction", "vs_bound", "vs_loop_bound", "target", "met"} <= row.keys()
        assert math.isfinite(row["floor_us"]) and row["floor_us"] > 0
        assert math.isfinite(row["fraction"]) and row["fraction"] > 0
        assert math.isnan(row["bound_fraction"]) and math.isnan(row["vs_bound"]) and math.isnan(row["vs_loop_bound"])
        assert math.isnan(row["op_wall_fraction"])
        assert row["target"] == f"fraction >= {0.8 if row['direction'] == 'gpu->gpu' else 0.9:g}"
        # the path each direction took is reported, and is no part of the row's id (ids stay when a choice changes)
        assert row["engine_path"] == "reference", row
        assert row["id"] == f"partial/tokens={row['tokens']}/direction={row['direction']}", row["id"]
    assert any("floor_us" in note and "NaN on the emulated device" in note for note in payload["notes"])
    assert "floor_us" in printed and "bound_fraction" in printed and "vs_bound" in printed
