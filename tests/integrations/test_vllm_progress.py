"""The vLLM manager makes progress with a 2-block host tier, driven through vLLM's own API as its scheduler calls it.

No engine runs: lookups are scanned the way vLLM's ``_maximal_prefix_lookup`` scans them (every key until a
``MISS``; ``None``, "ask again next step", while any answer is ``HIT_PENDING`` or ``RETRY``), the worker's
copies are left out (the test checks which host blocks the manager hands out, not their bytes).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from engine_import import require
from hung_disk import hang_file_reads

require("vllm")

from vllm.v1.kv_offload import config as offload_config  # noqa: E402
from vllm.v1.kv_offload.base import LookupResult, ReqContext, make_offload_key  # noqa: E402

from tiered_kv.integrations.vllm import TieredKVOffloadingManager, TieredKVOffloadingSpec  # noqa: E402

BYTES = 8192
ROUNDS = 200  # scheduler steps a lookup may defer before the test calls it a stall


def _spec(tmp_path: Path, host_blocks: int, **extra: Any) -> TieredKVOffloadingSpec:
    cfg = offload_config.OffloadingConfig(
        groups=(offload_config.OffloadingGroupConfig(tokens_per_block=32, layer_names=("l0",), group_id=0),),
        worker_kv_bytes_per_block=BYTES, enable_kv_cache_events=True,
        extra_config={"host_blocks": host_blocks, "file_dir": str(tmp_path / "kv"), "file_blocks": 64,
                      "shm_dir": str(tmp_path), **extra},
        engine_id=f"progress-{tmp_path.name}", model=offload_config.OffloadingModelConfig(name="tiny", dtype="float32"),
        cache=offload_config.OffloadingCacheConfig(tokens_per_hash=32, blocks_per_chunk=1),
        parallel=offload_config.OffloadingParallelConfig(
            rank=0, world_size=1, tp_size=1, pp_size=1, pcp_size=1, dcp_size=1, data_parallel_index=0,
            data_parallel_size=1, data_parallel_rank_local=None, is_parallelism_agnostic=False))
    return TieredKVOffloadingSpec(cfg)


@pytest.fixture
def mgr(tmp_path: Path) -> Iterator[TieredKVOffloadingManager]:
    m = _spec(tmp_path, host_blocks=2).get_manager()
    yield m
    m.shutdown()


def _keys(tag: int, n: int) -> list[bytes]:
    return [make_offload_key(bytes([tag, i]) * 16, 0) for i in range(n)]


def _settle(m: TieredKVOffloadingManager) -> None:
    deadline = time.monotonic() + 30
    while m.has_pending_work():
        assert time.monotonic() < deadline, "file jobs did not finish"
        time.sleep(0.005)


def _scan(m: TieredKVOffloadingManager, keys: list[bytes], ctx: ReqContext) -> int | None:
    """vLLM's prefix lookup: the hit count, or ``None`` to ask again next step."""
    hits, defer = 0, False
    for k in keys:
        r = m.lookup(k, ctx)
        if r is LookupResult.MISS:
            break
        hits += r is not LookupResult.RETRY
        defer |= r is not LookupResult.HIT
    return None if defer else hits


def _lookup_until_answered(m: TieredKVOffloadingManager, keys: list[bytes], ctx: ReqContext) -> int:
    for _ in range(ROUNDS):
        hits = _scan(m, keys, ctx)
        if hits is not None:
            return hits
        m.on_schedule_end(None)
        time.sleep(0.005)
    raise AssertionError(f"the lookup of {len(keys)} keys was deferred for {ROUNDS} steps: the engine stalls")


def _store(m: TieredKVOffloadingManager, keys: list[bytes], ctx: ReqContext) -> list[bytes]:
    out: Any = m.prepare_store(keys, ctx)
    if out is None:
        return []
    m.complete_store(out.keys_to_store, ctx)
    return list(out.keys_to_store)


def _through_file(m: TieredKVOffloadingManager, keys: list[bytes]) -> None:
    """Store ``keys`` two at a time (the host tier's size), each pair written through before the next."""
    ctx = ReqContext(req_id="writer")
    for i in range(0, len(keys), 2):
        assert _store(m, keys[i : i + 2], ctx) == keys[i : i + 2]
        _settle(m)
    assert set(keys) <= set(m.file_slots())


def test_a_prefix_longer_than_the_host_tier_is_a_shorter_hit_not_a_stall(mgr: TieredKVOffloadingManager) -> None:
    prefix = _keys(1, 4)
    _through_file(mgr, prefix)
    _through_file(mgr, _keys(2, 2))  # the host tier holds none of the prefix
    ctx = ReqContext(req_id="r")
    assert _lookup_until_answered(mgr, prefix, ctx) == 2  # two fit in host; the rest is a miss, recomputed
    spec = mgr.prepare_load(prefix[:2], ctx)
    assert sorted(spec.block_ids.tolist()) == [0, 1]
    mgr.complete_load(prefix[:2], ctx)
    s = mgr.statistics()
    assert s.staged == 2 and s.stage_misses >= 1 and s.verify_failures == 0


def test_a_lookup_of_another_request_misses_instead_of_evicting_what_was_answered(
    mgr: TieredKVOffloadingManager,
) -> None:
    a, b = _keys(1, 2), _keys(2, 2)
    _through_file(mgr, a + b)
    ra, rb = ReqContext(req_id="a"), ReqContext(req_id="b")
    assert _lookup_until_answered(mgr, a, ra) == 2
    assert _lookup_until_answered(mgr, b, rb) == 0  # a's blocks are held for a: b recomputes
    mgr.prepare_load(a, ra)  # still there: held until a's load
    mgr.complete_load(a, ra)
    assert _lookup_until_answered(mgr, b, rb) == 2  # a's load is done: its blocks may go


def test_a_finished_request_lets_go_of_what_its_lookup_held(mgr: TieredKVOffloadingManager) -> None:
    a, b = _keys(1, 2), _keys(2, 2)
    _through_file(mgr, a + b)
    ra = ReqContext(req_id="a")
    assert _lookup_until_answered(mgr, a, ra) == 2
    mgr.on_request_finished(ra)  # never scheduled (aborted): its holds end
    assert _lookup_until_answered(mgr, b, ReqContext(req_id="b")) == 2


def test_a_store_waits_for_write_throughs_instead_of_refusing(mgr: TieredKVOffloadingManager) -> None:
    ctx = ReqContext(req_id="w")
    for tag in range(8):  # each pair is stored while the previous pair is still being written to file
        keys = _keys(tag, 2)
        assert _store(mgr, keys, ctx) == keys
    _settle(mgr)
    s = mgr.statistics()
    assert s.stores == 16 and s.spills == 16 and len(mgr.file_slots()) == 16
    assert s.store_drops == 0 and s.store_deferrals == 0 and s.spill_skips == 0


def test_a_store_larger_than_the_host_tier_is_cut_and_counted(mgr: TieredKVOffloadingManager) -> None:
    keys = _keys(1, 5)
    assert _store(mgr, keys, ReqContext(req_id="w")) == keys[:2]  # a prefix's first blocks are kept
    assert mgr.statistics().store_drops == 3


def test_after_a_reset_with_jobs_in_flight_lookups_answer_and_stores_proceed(mgr: TieredKVOffloadingManager) -> None:
    prefix = _keys(1, 2)
    _through_file(mgr, prefix)
    ctx = ReqContext(req_id="w")
    out: Any = mgr.prepare_store(_keys(2, 2), ctx)  # vLLM's worker is writing these when the reset comes
    assert len(out.keys_to_store) == 2
    mgr.reset_cache()  # vLLM drops the job: complete_store never comes
    r = ReqContext(req_id="r")
    assert _lookup_until_answered(mgr, prefix, r) == 0  # no block is safe to read into yet: a miss
    assert _store(mgr, _keys(3, 2), ctx) == _keys(3, 2)  # the dropped job's blocks take the next store
    _settle(mgr)
    assert _lookup_until_answered(mgr, prefix, r) == 2  # and serve the file tier again


def test_a_hung_file_read_is_a_miss_within_the_deadline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With ``file_timeout``, a stalled disk ends a staging read within the deadline: the lookup is answered (a miss,
    the block recomputed), never deferred without end."""
    hang, faulty = hang_file_reads(monkeypatch)
    m = _spec(tmp_path, host_blocks=2, file_timeout=0.5).get_manager()
    try:
        prefix = _keys(1, 2)
        _through_file(m, prefix)
        _through_file(m, _keys(2, 2))  # the host tier holds none of the prefix: a lookup stages it from file
        hang.on = True
        ctx, t0 = ReqContext(req_id="r"), time.monotonic()
        while (hits := _scan(m, prefix, ctx)) is None:
            assert time.monotonic() - t0 < 10, "a hung read kept the lookup deferred"
            m.on_schedule_end(None)
            time.sleep(0.01)
        assert hits == 0 and time.monotonic() - t0 < 5
        assert m.statistics().verify_failures >= 1  # the failed staging: never served
    finally:
        hang.on = False
        for f in faulty:
            f.release()
        m.shutdown()
