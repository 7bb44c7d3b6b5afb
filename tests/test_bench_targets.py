"""Benchmark verdicts: each row's target and whether it is met, stable row ids, and comparing two runs."""

from __future__ import annotations

import math
from typing import Any

from tiered_kv.tools.bench.targets import SCHEMA, Target, compare, finalize, row_id, target_for, unmatched


def _payload(ratio: float, wake: float) -> dict[str, Any]:
    engine = {
        "name": "engine",
        "rows": [
            {"bench": "bandwidth", "device": "cuda", "block_MiB": 2.0, "blocks": 256, "indices": "contiguous",
             "direction": "offload", "engine_GBps": 50.0, "ratio": ratio, "target_ratio": 0.95},
            {"bench": "wakeup", "device": "cuda", "loop": "uvloop", "p50_ratio": wake, "target_ratio": 2.0},
            {"bench": "schedule", "device": "cuda", "blocks": 64, "indices": "scattered", "loop_cpu_us_per_block": 9.0},
        ],
    }
    return {"schema": SCHEMA, "benchmarks": [finalize(engine)]}


def test_finalize_judges_each_row_by_its_target() -> None:
    rows = _payload(0.96, 1.3)["benchmarks"][0]["rows"]
    assert [r["target"] for r in rows] == ["ratio >= 0.95", "p50_ratio <= 1.2", ""]
    assert [r["met"] for r in rows] == [True, False, None]
    assert "target_ratio" not in rows[0]  # the module's own target field is replaced by the judged one
    assert rows[0]["id"] == "bandwidth/block_MiB=2/blocks=256/indices=contiguous/direction=offload"


def test_row_id_ignores_measurements() -> None:
    a = {"bench": "call", "loop": "asyncio", "copy_returns_us": 12.0, "hits": 3, "met": True}
    b = {"bench": "call", "loop": "asyncio", "copy_returns_us": 99.0, "hits": 7, "met": False}
    assert row_id(a) == row_id(b) == "call/loop=asyncio"


def test_target_met_is_none_for_missing_or_nan() -> None:
    t = Target("ratio", ">=", 0.9)
    assert t.met({"ratio": float("nan")}) is None and t.met({}) is None and t.met({"ratio": 0.9}) is True
    assert Target("x", "<=", 1.0).met({"x": 1.5}) is False
    assert target_for("kernels", {"bench": "layer_major", "chunk_KiB": 8.0}) == Target("vs_contiguous", ">=", 0.9)
    assert target_for("nope", {"bench": "x"}) is None


def test_compare_pairs_rows_by_id() -> None:
    old, new = _payload(0.90, 1.5), _payload(0.99, 1.1)
    rows = compare(old, new)
    assert [(r["id"], r["met_old"], r["met_new"]) for r in rows] == [
        ("bandwidth/block_MiB=2/blocks=256/indices=contiguous/direction=offload", False, True),
        ("wakeup/loop=uvloop", False, True),
    ]
    assert math.isclose(rows[0]["new/old"], 0.99 / 0.90)
    new["benchmarks"][0]["rows"][0]["indices"] = "scattered"
    new["benchmarks"][0]["rows"][0]["id"] = row_id(new["benchmarks"][0]["rows"][0])
    assert [r["id"] for r in compare(old, new)] == ["wakeup/loop=uvloop"]
    # the row whose label changed is not compared: it is named under both ids
    assert unmatched(old, new) == (
        ["engine: bandwidth/block_MiB=2/blocks=256/indices=scattered/direction=offload"],
        ["engine: bandwidth/block_MiB=2/blocks=256/indices=contiguous/direction=offload"],
    )
    assert unmatched(old, old) == ([], [])


def test_overlap_rows_must_also_compute_the_same_output() -> None:
    t = target_for("overlap", {"bench": "overlap", "vs_bound": 1.0})
    assert t is not None and str(t) == "vs_bound <= 1.15 and same_output"
    assert t.met({"vs_bound": 1.0, "same_output": True}) is True
    assert t.met({"vs_bound": 1.0, "same_output": False}) is False


def test_rows_judged_by_their_own_module_keep_the_verdict_and_ids_stay_unique() -> None:
    result = finalize({"name": "custom", "rows": [  # a benchmark with no rule in bench.targets
        {"bench": "ttft", "prefix_tokens": 512, "path": "host", "ttft_ms": 3.0, "tokens_reused": 496,
         "target": ">= 2x", "met": True},
        {"bench": "ttft", "prefix_tokens": 2048, "path": "host", "ttft_ms": 9.0, "tokens_reused": 2032,
         "target": ">= 2x", "met": False},
        {"bench": "ttft", "prefix_tokens": 2048, "path": "gpu", "ttft_ms": 1.0, "tokens_reused": 2032},
    ]})
    rows = result["rows"]
    assert [r["id"] for r in rows] == ["ttft/prefix_tokens=512/path=host", "ttft/prefix_tokens=2048/path=host",
                                       "ttft/prefix_tokens=2048/path=gpu"]
    assert [(r["target"], r["met"]) for r in rows] == [(">= 2x", True), (">= 2x", False), ("", None)]
