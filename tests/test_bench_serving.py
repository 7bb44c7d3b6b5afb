"""The serving benchmark's logic at tiny size on CPU: decode with and without checksums, a mixed batch, memory."""

from __future__ import annotations

import math

import pytest

pytest.importorskip("transformers")

from tiered_kv.tools.bench import serving, targets


def test_quick_run_measures_decode_batch_and_memory_and_judges_the_rows_with_targets() -> None:
    result = targets.finalize(serving.run(quick=True, device="cpu"))
    rows = {(r["bench"], r["path"] if "path" in r else ""): r for r in result["rows"]}
    assert set(rows) == {
        ("decode", "plain"),
        ("decode", "cache"),
        ("decode", "no_integrity"),
        ("decode", "inline"),
        ("batch", ""),
        ("memory", "plain"),
        ("memory", "host"),
    }
    for path in ("plain", "cache", "no_integrity", "inline"):
        r = rows["decode", path]
        assert r["tokens_per_s"] > 0 and r["vs_plain"] > 0 and r["new_tokens"] == 24
        assert r["ms_per_step"] == pytest.approx(1e3 / r["tokens_per_s"])
        assert 0 < r["model_ms_per_step"] and r["outside_model_ms"] == pytest.approx(
            r["ms_per_step"] - r["model_ms_per_step"]
        )
    assert rows["decode", "inline"]["target"] == "" and rows["decode", "inline"]["met"] is None
    assert rows["decode", "plain"]["outside_model_ms"] == pytest.approx(0.0, abs=1e-9)
    assert rows["decode", "plain"]["vs_plain"] == 1.0 and set(rows["decode", "plain"]["vs_plain_turns"]) == {1.0}
    cache = rows["decode", "cache"]  # the median of per-turn ratios against the same turn's plain request
    assert len(cache["vs_plain_turns"]) == 2 and cache["vs_plain"] == pytest.approx(
        sum(cache["vs_plain_turns"]) / 2, abs=1e-3
    )
    assert rows["decode", "cache"]["target"] == "vs_plain >= 0.95" and isinstance(rows["decode", "cache"]["met"], bool)
    off = rows["decode", "no_integrity"]
    assert off["target"] == "integrity_cost <= 0.02" and isinstance(off["met"], bool)
    # 1 - the median over turns of the cache's rate over integrity-off's, each turn's pair against one plain request
    per_turn = [c / o for c, o in zip(cache["vs_plain_turns"], off["vs_plain_turns"], strict=True)]
    assert off["integrity_cost"] == pytest.approx(1 - sum(per_turn) / 2, abs=5e-3)
    batch = rows["batch", ""]
    assert 0 < batch["ttft_p50_ms"] <= batch["ttft_p99_ms"] and 0 < batch["plain_p50_ms"] <= batch["plain_p99_ms"]
    assert batch["target"] == "" and batch["met"] is None
    host = rows["memory", "host"]
    assert host["kv_MB"] > 0 and math.isnan(host["beyond_kv"])  # no GPU memory figures on the emulated device
    assert host["target"] == "beyond_kv <= 0.1" and host["met"] is None
    assert any("not comparable" in n for n in result["notes"])
