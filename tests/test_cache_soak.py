"""The cache-level soak (issue 11): a CI-sized run over GPU+host+file with file faults, and proof it catches a
cache that serves wrong KV."""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest
from helpers import disable_fences

from tiered_kv.cache import TieredKVCache
from tiered_kv.tools.cache_soak import CacheSoakConfig, CacheSoakFailure, cache_soak


@pytest.fixture(autouse=True)
def _quiet_injected_faults(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.ERROR, logger="tiered_kv")


async def test_cache_soak_ci_size() -> None:
    """~40 s on 2 cores: thousands of admissions, every reused token verified, faults and cancellations seen."""
    report = await cache_soak(CacheSoakConfig(ops=3_000, seed=2026))
    assert report.wrong_tokens == 0
    assert report.verified_tokens > 30_000
    assert all(report.hits[t] > 0 for t in ("gpu", "host", "file")), report.hits
    assert report.faults > 0 and report.transfer_errors > 0 and report.poisoned > 0
    assert report.cancelled > 0 and report.appended > 0


async def test_cache_soak_catches_a_cache_that_serves_failed_copies(monkeypatch: pytest.MonkeyPatch) -> None:
    """With poisoning and the integrity checks off, blocks whose copy failed are served: the oracle sees wrong KV."""
    import tiered_kv.cache as cache_mod
    from tiered_kv.integrity import IntegrityChecks

    async def nothing_changed(self: IntegrityChecks, *args: object) -> list[object]:
        return []

    monkeypatch.setattr(IntegrityChecks, "check_reuse", nothing_changed)
    monkeypatch.setattr(TieredKVCache, "_poison", lambda self, block: None)
    monkeypatch.setattr(TieredKVCache, "_on_file_slot_dropped", lambda self, event: None)
    monkeypatch.setattr(cache_mod, "_failed_copy", lambda transfer: False)
    with pytest.raises(CacheSoakFailure, match="wrong KV") as info:
        await cache_soak(CacheSoakConfig(ops=3_000, seed=5, fault_rate=0.1, cancel_prob=0.0))
    assert info.value.seed == 5


def test_cli_cache_soak() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "tiered_kv", "soak", "--cache", "--ops", "150", "--device", "cpu", "--quiet"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert "reused tokens verified, 0 wrong" in out.stdout


# ---------------------------------------------------------------------------------------- engine soak + file tier


async def test_engine_soak_with_the_file_tier_all_routes_faults_on() -> None:
    from tiered_kv.tools.soak import SoakConfig, generate_ops, soak

    config = SoakConfig(ops=6_000, seed=2027, file_blocks=24)
    routes = {(op.src, op.dst) for op in generate_ops(config)}
    assert len(routes) == 8, routes  # every pair of GPU, host, file but file -> file
    report = await soak(config)
    assert report.completed + report.refused == 6_000
    assert report.failed > 0, "no injected file fault surfaced"
    # a copy that reads what a failed copy was writing fails whole, so faults take whole batches out of the check
    assert report.checked_blocks > 1_500


async def test_engine_soak_with_the_file_tier_catches_missing_fences(monkeypatch: pytest.MonkeyPatch) -> None:
    from tiered_kv.tools.soak import SoakConfig, SoakFailure, soak

    disable_fences(monkeypatch)
    with pytest.raises(SoakFailure, match="seed=3"):
        await soak(SoakConfig(ops=3_000, seed=3, file_blocks=24, stall_prob=0.2, stall_max=0.003), minimize=False)


def test_cli_engine_soak_with_a_file_tier() -> None:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "tiered_kv",
            "soak",
            "--ops",
            "1500",
            "--file-blocks",
            "16",
            "--device",
            "cpu",
            "--quiet",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert "all 8 routes" in out.stdout and out.stdout.rstrip().splitlines()[-1].startswith("ok: 1500 ops")


@pytest.mark.gpu
async def test_cache_soak_cuda() -> None:
    report = await cache_soak(CacheSoakConfig(ops=2_000, seed=9, device="cuda"))
    assert report.wrong_tokens == 0 and report.verified_tokens > 10_000
    assert report.faults > 0 and all(report.hits[t] > 0 for t in ("gpu", "host", "file"))


@pytest.mark.gpu
async def test_engine_soak_with_the_file_tier_cuda() -> None:
    from tiered_kv.tools.soak import SoakConfig, soak

    report = await soak(SoakConfig(ops=20_000, seed=8, device="cuda", file_blocks=24, stall_max=0.001))
    # a copy that reads a failed copy's product fails too, so about a third of the copies fail with the soak's fault
    # rates and fewer blocks are left to check (7,470 and 8,804 of 20,000 ops in two H200 runs)
    assert report.completed + report.refused == 20_000 and report.checked_blocks > 5_000 and report.failed > 0
