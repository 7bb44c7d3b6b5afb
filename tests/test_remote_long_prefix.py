"""A remote prefix of any length is reused: two processes share prefixes longer than the host tier through Redis.

The cold process streams each prefix from the store into its own GPU blocks (through the remote tier's staging
ring), however many blocks it has: none of it is cut to fit the host tier. Every reused token is checked against
the oracle of :mod:`tiered_kv.tools.workload`.
"""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys
import time
from typing import Any

import pytest
from remote_servers import redis_server, store_url  # noqa: F401

from tiered_kv.remote.servers import LocalServer

HERE = pathlib.Path(__file__).resolve().parent
TPB = 16


def _peer(url: str, role: str, model: str, host_blocks: int, sizes: list[int]) -> Any:
    cmd = [sys.executable, str(HERE / "remote_long_peer.py"), url, role, model, str(host_blocks), *map(str, sizes)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.timeout(400)
def test_two_processes_share_a_12_and_a_64_block_prefix_with_a_16_block_host_tier(
    redis_server: LocalServer,  # noqa: F811
) -> None:
    url = store_url(redis_server)
    model = f"long-{time.time_ns()}"
    sizes = [12, 64]  # 64 blocks: four times the host tier
    warm = _peer(url, "warm", model, 16, sizes)
    assert [p["reused"] for p in warm["prompts"]] == [0, 0]
    assert warm["remote"]["put"] == sum(sizes)
    cold = _peer(url, "cold", model, 16, sizes)
    for p, n in zip(cold["prompts"], sizes, strict=True):
        assert p["wrong"] == 0
        assert p["reused"] == n * TPB, p  # every block of the prefix, not host_blocks // 2 of it
        assert p["from"]["remote"] == n, p
    assert cold["hits"]["remote"] == sum(sizes)
    assert cold["remote"]["bad"] == 0 and cold["remote"]["get"] >= sum(sizes)


@pytest.mark.timeout(400)
def test_a_host_tier_of_eight_blocks_reuses_all_six(redis_server: LocalServer) -> None:  # noqa: F811
    url = store_url(redis_server)
    model = f"six-{time.time_ns()}"
    _peer(url, "warm", model, 8, [6])
    cold = _peer(url, "cold", model, 8, [6])
    [p] = cold["prompts"]
    assert p["wrong"] == 0 and p["reused"] == 6 * TPB and p["from"]["remote"] == 6
