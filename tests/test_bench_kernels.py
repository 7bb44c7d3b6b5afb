"""The kernel benchmark runs unattended: --quick on the emulated device gives every row kind, labelled."""

from __future__ import annotations

import json
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
    assert "kernels / gather on emulated" in capsys.readouterr().out
