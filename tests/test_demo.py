"""The demo's sizes per device, its per-tier TTFT table, and (on a GPU) a speed-up on its defaults."""

from __future__ import annotations

import dataclasses

import pytest
import torch

pytest.importorskip("transformers")

from tiered_kv.tools.demo import (
    CPU_SIZES,
    GPU_SIZES,
    KV_TOLERANCE,
    DemoConfig,
    kv_difference,
    run_demo,
    ttft_by_source,
)


def test_sizes_left_unset_take_the_devices_defaults() -> None:
    assert DemoConfig().sizes(cuda=False) == CPU_SIZES
    assert DemoConfig().sizes(cuda=True) == GPU_SIZES
    chosen = DemoConfig(gpu_blocks=7, hidden=128).sizes(cuda=True)
    assert chosen == dataclasses.replace(GPU_SIZES, gpu_blocks=7, hidden=128)
    # on a GPU a reused prefix is most of a prompt: system prompts much longer than a user's turn (16..96 tokens)
    assert GPU_SIZES.system_tokens >= 16 * 96 and GPU_SIZES.hidden > CPU_SIZES.hidden


def _sample(reused: int, blocks_from: dict[str, int], with_s: float, without_s: float) -> dict[str, object]:
    return {"tokens_reused": reused, "blocks_from": blocks_from, "ttft_with": with_s, "ttft_without": without_s}


def test_ttft_by_source_groups_turns_by_the_slowest_tier_that_supplied_blocks() -> None:
    samples = [
        _sample(0, {"gpu": 0, "host": 0, "file": 0}, 0.010, 0.009),
        _sample(64, {"gpu": 4, "host": 0, "file": 0}, 0.002, 0.010),
        _sample(64, {"gpu": 2, "host": 2, "file": 0}, 0.004, 0.010),
        _sample(64, {"gpu": 1, "host": 1, "file": 2}, 0.008, 0.010),
        _sample(8, {"gpu": 0, "host": 0, "file": 0}, 0.005, 0.010),  # a partly matching block only: from the GPU
    ]
    rows = {r["prefix from"]: r for r in ttft_by_source(samples)}
    assert list(rows) == ["none", "gpu", "host", "file"]
    assert rows["none"]["turns"] == 1 and rows["none"]["speed_up"] == pytest.approx(0.9)
    assert rows["gpu"]["turns"] == 2 and rows["gpu"]["with_ms"] == pytest.approx(3.5)
    assert rows["host"]["speed_up"] == pytest.approx(2.5) and rows["file"]["speed_up"] == pytest.approx(1.25)


@pytest.mark.gpu
async def test_on_a_gpu_the_default_sizes_make_reuse_pay() -> None:
    report = await run_demo(DemoConfig(device="cuda", conversations=12))
    assert report.mismatched_tokens == 0 and report.first_token_agree == report.turns
    rows = {r["prefix from"]: r for r in ttft_by_source(report.samples)}
    assert any(rows[t]["turns"] for t in ("gpu", "host") if t in rows)
    hits = [d for d in report.samples if d["tokens_reused"]]
    with_s = sorted(d["ttft_with"] for d in hits)[len(hits) // 2]
    without_s = sorted(d["ttft_without"] for d in hits)[len(hits) // 2]
    assert without_s / with_s > 1.0, rows


def test_a_recompute_s_rounding_passes_and_kv_of_another_position_does_not() -> None:
    g = torch.Generator().manual_seed(0)
    want = torch.randn(4, 64, 32, generator=g) * 3  # largest magnitude ~10, as the GPU model's keys
    # rounding measured on an H200 between two plain forwards of the GPU model (2,048 vs 2,168 tokens): up to
    # 2.5e-3 on values up to ~10 in its last layer, above an absolute 1e-3
    rounded = want + (torch.rand(want.shape, generator=g) - 0.5) * 5e-3
    assert (kv_difference(rounded, want) <= KV_TOLERANCE).all()
    shifted = torch.roll(want, 1, dims=1)  # every position holding its neighbour's KV
    assert (kv_difference(shifted, want) > KV_TOLERANCE).all()


async def test_the_demo_counts_kv_read_from_the_wrong_positions(monkeypatch: pytest.MonkeyPatch) -> None:
    from tiered_kv.integrations.hf import kv

    gather = kv.gather_past

    def shifted(view: torch.Tensor, index: torch.Tensor, rows: int, length: int) -> torch.Tensor:
        past = gather(view, index, rows, length)
        return torch.roll(past, 1, dims=2)  # each position reads its neighbour's KV

    monkeypatch.setattr(kv, "gather_past", shifted)
    report = await run_demo(DemoConfig(device="cpu", conversations=3, system_tokens=64, layers=2, hidden=128))
    assert report.verified_tokens > 0 and report.mismatched_tokens > 0
