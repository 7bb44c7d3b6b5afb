"""Crash consistency of the file tier (issue 8 item 3): SIGKILL a spilling child, reopen, verify every block."""

from __future__ import annotations

import pytest

from tiered_kv.crash import CRASH_LAYOUT, _Log, block_content, crash_once, run_crash_test
from tiered_kv.filetier import _FileOp


def test_killed_spills_are_recovered_and_torn_slots_never_served(tmp_path):
    # 6 seeds: every durability policy, both open-scan modes; 2 promised slots torn after each kill
    report = run_crash_test(tmp_path, range(6), tear=2)
    print(report)
    assert report.ok, str(report)
    t = report.totals()
    assert t["completed"] > 0 and t["promised"] > 0
    assert t["served"] >= t["promised"]
    assert t["mismatched"] == 0 and t["unknown"] == 0 and t["missing"] == 0
    assert t["torn"] > 0 and t["bad_at_open"] + t["bad_on_read"] >= t["torn"]
    assert {r.durability for r in report.runs} == {"none", "flush", "fsync"}
    assert {r.verify_on_open for r in report.runs} == {"header", "full"}


def test_pure_sigkill_loses_nothing_completed(tmp_path):
    run = crash_once(tmp_path, 11, durability="none", tear=0, max_kill_after=6)
    assert run.ok, run
    assert run.bad_at_open == 0 and run.bad_on_read == 0
    assert run.served >= run.promised


def test_harness_fails_when_reads_are_not_verified(tmp_path, monkeypatch):
    # The check of the check: with payload verification off, a torn payload is served and the run fails.
    monkeypatch.setattr(_FileOp, "_verify", lambda self, j, hdr, payload: None)
    runs = [crash_once(tmp_path / f"r{s}", s, tear=6, verify_on_open="header", max_kill_after=8) for s in (0, 2)]
    assert any(r.mismatched > 0 for r in runs), runs
    assert not all(r.ok for r in runs)


def test_log_promises_only_the_last_completed_spill_of_a_slot():
    log = _Log()
    for line in ("BEGIN 0 1:a 2:b", "DONE 0", "BEGIN 0 1:c", "BEGIN 1 3:d", "DONE 1"):
        log.feed(line)
    assert log.begun == {"a", "b", "c", "d"}
    assert log.completed == {"a", "b", "d"}
    assert log.promised() == {"b", "d"}  # a's slot was claimed by c (in flight at the kill)


def test_block_content_is_a_function_of_the_key():
    a, b = block_content(CRASH_LAYOUT, "k0-1"), block_content(CRASH_LAYOUT, "k0-2")
    assert a.size == CRASH_LAYOUT.bytes_per_block
    assert (a == block_content(CRASH_LAYOUT, "k0-1")).all() and not (a == b).all()


def test_bad_arguments():
    with pytest.raises(ValueError):
        run_crash_test("/nonexistent-never-used", [0], durabilities=())


def test_slab_whose_creation_was_killed_before_the_superblock_opens_as_new(tmp_path):
    # A kill between preallocating the slab and writing its superblock leaves a file of zeros. It used to be
    # refused as "not a tiered_kv slab" (LayoutMismatchError) until discarded by hand.
    from tiered_kv.filetier import FileTier, FileTierConfig

    (tmp_path / "kv.slab").write_bytes(bytes(4096 * 12))
    tier = FileTier(CRASH_LAYOUT, FileTierConfig(tmp_path, 4))
    try:
        assert tier.open_report.created and tier.open_report.recovered == 0
    finally:
        tier.close()
    tier = FileTier(CRASH_LAYOUT, FileTierConfig(tmp_path, 4))  # and it is a slab now
    try:
        assert not tier.open_report.created
    finally:
        tier.close()
