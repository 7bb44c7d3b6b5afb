"""TieredKVFileTier as a vLLM secondary tier, created by vLLM's own SecondaryTierFactory from a tier config.

vLLM's CPU primary tier (``TieringOffloadingSpec``) refuses CPU-only platforms, so the engine cannot run it
here; the tier is driven through vLLM's factory and job types exactly as ``TieringOffloadingManager`` calls it
(store cascades from primary chunks, promotions back into other primary chunks), over a primary region in host
memory, with a corrupted slot and a drain.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from engine_import import require

require("vllm")

from vllm.v1.kv_offload import config as offload_config  # noqa: E402
from vllm.v1.kv_offload.base import LookupResult, ReqContext, make_offload_key  # noqa: E402
from vllm.v1.kv_offload.tiering.base import TransferJob  # noqa: E402
from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory  # noqa: E402

from tiered_kv.integrations.vllm import TieredKVFileTier, TieredKVOffloadingSpec  # noqa: E402

CHUNK, CHUNKS = 8192, 16


def _spec() -> TieredKVOffloadingSpec:
    cfg = offload_config.OffloadingConfig(
        groups=(offload_config.OffloadingGroupConfig(tokens_per_block=32, layer_names=("l0", "l1"), group_id=0),),
        worker_kv_bytes_per_block=CHUNK, enable_kv_cache_events=True, extra_config={"host_blocks": 4},
        engine_id="tier-test", model=offload_config.OffloadingModelConfig(name="tiny", dtype="float32"),
        cache=offload_config.OffloadingCacheConfig(tokens_per_hash=32, blocks_per_chunk=1),
        parallel=offload_config.OffloadingParallelConfig(
            rank=0, world_size=1, tp_size=1, pp_size=1, pcp_size=1, dcp_size=1, data_parallel_index=0,
            data_parallel_size=1, data_parallel_rank_local=None, is_parallelism_agnostic=False))
    return TieredKVOffloadingSpec(cfg)


def _finish(tier: Any) -> list[Any]:
    tier.drain_jobs()
    return list(tier.get_finished_jobs())


def test_short_tier_type_from_the_plugin() -> None:
    from tiered_kv.integrations.vllm import plugin as vllm_plugin

    vllm_plugin.register()
    vllm_plugin.register()  # idempotent
    assert SecondaryTierFactory.get_tier_class({"type": "TieredKVFile"}) is TieredKVFileTier


def test_store_promote_and_corruption_through_vllms_factory(tmp_path: Path) -> None:
    primary = np.random.RandomState(0).randint(0, 256, size=(CHUNKS, CHUNK), dtype=np.uint8)
    tier = SecondaryTierFactory.create_secondary_tier(
        {"type": "TieredKVFileTier", "module_path": "tiered_kv.integrations.vllm", "file_dir": str(tmp_path),
         "file_blocks": 8}, memoryview(primary.data), _spec())
    try:
        assert isinstance(tier, TieredKVFileTier) and tier.block_size_bytes == CHUNK
        ctx = ReqContext(req_id="r")
        keys = [make_offload_key(bytes([i]) * 32, 0) for i in range(4)]
        assert tier.lookup(keys[0], ctx) is LookupResult.MISS
        tier.submit_store(TransferJob(1, keys, np.array([0, 1, 2, 3]), False, ctx))
        [res] = _finish(tier)
        assert res.job_id == 1 and res.success
        assert all(tier.lookup(k, ctx) is LookupResult.HIT for k in keys)
        want = primary[:4].copy()
        slot = tier._file[keys[2]]
        path, size = tier.engine.file_tier.path, tier.engine.file_tier.slot_size
        with open(path, "r+b") as fh:  # corrupt chunk 2's slot
            fh.seek(4096 + slot * size + 4096 + 100)
            b = fh.read(1)
            fh.seek(4096 + slot * size + 4096 + 100)
            fh.write(bytes([b[0] ^ 1]))
        primary[8:12] = 0
        tier.submit_load(TransferJob(2, keys, np.array([8, 9, 10, 11]), True, ctx))
        [res] = _finish(tier)
        assert not res.success and set(res.successful_keys) == {keys[0], keys[1], keys[3]}
        for i in (0, 1, 3):
            assert np.array_equal(primary[8 + i], want[i]), f"chunk {i} not bit-exact"
        # chunk 10's slot holds unverified bytes, but it is not in successful_keys: vLLM frees it unread
        assert tier.lookup(keys[2], ctx) is LookupResult.MISS and tier.counts["verify_failures"] == 1
        events = list(tier.take_events())
        assert any(e.removed and keys[2] in e.keys for e in events) and any(not e.removed for e in events)
    finally:
        tier.shutdown()
