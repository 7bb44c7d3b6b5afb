"""The cache-level soak (issue 11): a CI-sized run over GPU+host+file with file faults, and proof it catches a
cache that serves wrong KV."""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest

from tiered_kv.cache import TieredKVCache
from tiered_kv.testing import CacheSoakConfig, CacheSoakFailure, cache_soak


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
    """With poisoning switched off, blocks whose copy failed stay in the lookup: the oracle sees wrong KV."""
    import tiered_kv.cache as cache_mod

    monkeypatch.setattr(TieredKVCache, "_poison", lambda self, block: None)
    monkeypatch.setattr(TieredKVCache, "_on_file_slot_dropped", lambda self, event: None)
    monkeypatch.setattr(cache_mod, "_failed", lambda sources: False)
    with pytest.raises(CacheSoakFailure, match="wrong KV") as info:
        await cache_soak(CacheSoakConfig(ops=3_000, seed=5, fault_rate=0.1, cancel_prob=0.0))
    assert info.value.seed == 5


def test_cli_cache_soak() -> None:
    out = subprocess.run([sys.executable, "-m", "tiered_kv", "soak", "--cache", "--ops", "150", "--device", "cpu", "--quiet"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "reused tokens verified, 0 wrong" in out.stdout
