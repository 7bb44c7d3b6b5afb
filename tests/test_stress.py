"""The cache stress (tiny pools, file faults, timeouts, appends, an evictor) at CI size on the emulated device, and
proof that its oracle sees wrong KV."""

from __future__ import annotations

import json
import logging
import subprocess
import sys

import pytest

import tiered_kv.cache as cache_mod
from tiered_kv.cache import TieredKVCache
from tiered_kv.tools.stress import StressConfig, stress


@pytest.fixture(autouse=True)
def _quiet_injected_faults(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.CRITICAL, logger="tiered_kv")


async def test_stress_ci_size() -> None:
    """~10 s: every element of the scenario is exercised and no reused token is wrong."""
    report = await stress(StressConfig(seed=2026, seconds=8.0))
    assert report.wrong_tokens == 0, report.failures
    assert report.verified_tokens > 5_000
    assert all(report.hits[t] > 0 for t in ("gpu", "host", "file")), report.hits
    assert report.partial_hits > 0 and report.appended > 0 and report.evicted > 0
    assert report.timeouts > 0 and report.faults > 0 and report.transfer_errors > 0
    assert report.layerwise > 0  # admissions whose host blocks landed layer by layer, read after each wait


def _serve_failed_copies(monkeypatch: pytest.MonkeyPatch) -> None:
    """A cache that keeps blocks whose copy failed (no poisoning): their slots hold stale bytes."""
    monkeypatch.setattr(TieredKVCache, "_poison", lambda self, block: None)
    monkeypatch.setattr(cache_mod, "_failed_copy", lambda transfer: False)


async def test_stress_oracle_sees_a_cache_that_serves_stale_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    _serve_failed_copies(monkeypatch)
    report = await stress(StressConfig(seed=7, seconds=4.0, read_faults=0.0, write_faults=0.3, integrity=False))
    assert report.wrong_tokens > 0


def test_stress_command_runs_seeds_side_by_side(tmp_path: object) -> None:
    out = tmp_path / "stress.json"  # type: ignore[operator]
    done = subprocess.run(
        [sys.executable, "-m", "tiered_kv", "stress", "--runs", "2", "--procs", "2", "--seconds", "2",
         "--json", str(out)],
        capture_output=True, text=True, timeout=300, check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "2 runs of 2 s on cpu" in done.stdout and "0 wrong" in done.stdout
    record = json.loads(out.read_text())
    assert record["failed_runs"] == 0 and len(record["runs"]) == 2


@pytest.mark.gpu
async def test_stress_cuda() -> None:
    report = await stress(StressConfig(seed=1, seconds=10.0, device="cuda"))
    assert report.wrong_tokens == 0, report.failures


async def test_stress_oracle_sees_a_layer_read_before_it_landed(monkeypatch: pytest.MonkeyPatch) -> None:
    """Waits that order nothing: a layer read right after admission may not be there yet, and the oracle sees it."""
    from tiered_kv.layerwise import LayerLoad

    monkeypatch.setattr(LayerLoad, "wait_layer", lambda self, layer, stream: None)
    wrong = 0
    for seed in range(4):
        report = await stress(StressConfig(seed=seed, seconds=4, layerwise_prob=1.0))
        wrong += report.wrong_tokens
        if wrong:
            break
    assert wrong > 0
