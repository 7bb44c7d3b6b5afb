"""The host work of one gather-mode ``copy_batch_block_offsets`` call (issue 14): torch calls and bytecodes.

Counted on the emulated device with the op run at submit, as CUDA runs it, by
:func:`tiered_kv.tools.bench.pagetables.host_work`; the counts are the same on any machine, so a noisy one
cannot hide a regression. Before issue 14 a gather call made 51 torch calls (staging-buffer slices and
copies of the row numbers and coefficients, then the checked op wrapper: shapes, devices, two reductions over
the row numbers) and ran 1,805 bytecodes (CPython 3.11); the racy in-place path 47 / 1,304. After: 11 / 1,344.
The budgets leave room for another interpreter version, not for new per-call work: that needs a measurement
and a new budget.
"""

from __future__ import annotations

from tiered_kv.tools.bench.pagetables import host_work


def test_gather_call_torch_calls_and_bytecodes_stay_within_budget() -> None:
    work = host_work(seqs=64, calls=30)
    staged, racy = work["staged"], work["racy"]
    # the op, dst's checks (dtype, device, dim, shape), numel, is_contiguous: nothing per staging buffer
    assert staged["torch_calls"] <= 12, staged["torch_by_name"]
    assert staged["torch_calls"] * 3 <= racy["torch_calls"], (staged["torch_by_name"], racy["torch_by_name"])
    assert staged["bytecodes"] <= 1500, staged["bytecodes_by_function"]
    assert staged["torch_by_name"].get("gather_block_offsets.default") == 1  # the unchecked op, once


def test_gather_call_work_does_not_grow_with_the_batch() -> None:
    """Per-sequence work is numpy's (one take into the staging buffer), never a Python loop or a torch call."""
    small, large = host_work(seqs=16, calls=10)["staged"], host_work(seqs=512, calls=10)["staged"]
    assert large["torch_calls"] == small["torch_calls"]
    assert large["bytecodes"] <= small["bytecodes"] + 20, large["bytecodes_by_function"]
