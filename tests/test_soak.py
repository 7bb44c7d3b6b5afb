"""The soak harness: a CI-sized run, and proof that it catches a broken engine (with a reproducer)."""

from __future__ import annotations

import pytest
from helpers import disable_fences

from tiered_kv.tools.soak import SoakConfig, SoakFailure, generate_ops, soak


async def test_soak_20k_ops_emulated():
    report = await soak(SoakConfig(ops=20_000, seed=2024))
    assert report.ops == report.completed == 20_000
    assert report.cancelled > 0 and report.forgotten > 0 and report.stalls > 0
    assert report.checked_blocks > 10_000
    assert report.close_seconds < 1


@pytest.mark.gpu
async def test_soak_cuda():
    report = await soak(SoakConfig(ops=100_000, seed=7, device="cuda", stall_max=0.001))
    assert report.completed == 100_000


def test_op_sequence_is_a_function_of_the_seed():
    a = [str(op) for op in generate_ops(SoakConfig(ops=200, seed=5))]
    assert a == [str(op) for op in generate_ops(SoakConfig(ops=200, seed=5))]
    assert a != [str(op) for op in generate_ops(SoakConfig(ops=200, seed=6))]


async def test_soak_catches_missing_fences_and_prints_a_reproducer(monkeypatch):
    disable_fences(monkeypatch)
    with pytest.raises(SoakFailure) as info:
        await soak(SoakConfig(ops=3_000, seed=3, stall_prob=0.2, stall_max=0.003))
    failure = info.value
    assert failure.seed == 3
    assert 0 < len(failure.op_log) <= 3_000
    assert "seed=3" in str(failure) and "copy(" in str(failure)


async def test_ten_thousand_tasks_awaiting_at_once():
    from tiered_kv.tools.soak import load

    report = await load(10_000)
    print(report)
    assert report.tasks == 10_000
    # Nothing starves: the first tenth of the copies issued all resume within the first half of the
    # resume order (a LIFO wake-up, or a lane letting later work overtake, would fail this).
    assert report.first_tenth_last_rank < 0.5
    assert report.peak_traced_mib < 200  # bounded: tens of MiB for 10k in-flight copies
