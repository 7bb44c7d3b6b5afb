"""Remote tier from the command line and in metrics: ``demo --remote``, ``doctor --remote``, Prometheus."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from remote_servers import mooncake_server, redis_server, store_url  # noqa: F401

from tiered_kv import KVLayout, TieredKVCache
from tiered_kv.remote.doctor import remote_checks
from tiered_kv.remote.servers import free_port, start_mooncake_client, start_mooncake_master
from tiered_kv.tools.workload import ChatWorkload, replay

ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")])}


def _demo(url: str) -> str:
    p = subprocess.run([sys.executable, "-m", "tiered_kv", "demo", "--device", "cpu", "--conversations", "3", "--quiet",
                        "--max-new-tokens", "4", "--file-blocks", "0", "--seed", "11", "--remote", url],
                       capture_output=True, text=True, env=ENV, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    return p.stdout


def _remote_hits(out: str) -> int:
    line = next(line for line in out.splitlines() if line.startswith("remote tier "))
    assert "0 objects failed verification" in line and "tokens, 0 wrong" in out  # reused KV == a recompute
    return int(line.split("): ")[1].split(" block hits")[0])


@pytest.mark.timeout(600)  # two real-model demo runs
@pytest.mark.parametrize("store", ["redis", "mooncake"])
def test_demo_run_twice_the_second_process_reuses_the_first_ones_prefixes(store, request):
    srv = request.getfixturevalue(f"{store}_server")
    if store == "redis":
        url = store_url(srv)
        first, second = _demo(url), _demo(url)
    else:  # the objects must outlive the first process: a standalone mooncake_client lends the memory
        with start_mooncake_client(srv, "128MB"):
            url = store_url(srv) + "&segment=0"
            first, second = _demo(url), _demo(url)
    assert _remote_hits(first) == 0
    assert _remote_hits(second) > 0


async def test_doctor_remote_reports_reachability_round_trip_and_bandwidth(redis_server):  # noqa: F811
    # a fresh master: one whose segment holder just went away fails puts until the holder's TTL (the doctor says so)
    with start_mooncake_master() as mooncake:
        for srv in (redis_server, mooncake):
            rows = await remote_checks(store_url(srv), object_bytes=256 * 1024, batch=4, pings=5)
            assert [r[0] for r in rows] == ["remote store", "remote round trip", "remote bandwidth"]
            assert all(r[1] for r in rows), rows
            assert "MiB/s" in rows[2][2]
    down = await remote_checks(f"redis://127.0.0.1:{free_port()}/0")
    assert len(down) == 1 and not down[0][1] and "unreachable" in down[0][2] and "local tiers only" in down[0][3]
    bad = await remote_checks("memcached://x:1")
    assert not bad[0][1]


def test_doctor_cli_says_when_the_store_is_down():
    p = subprocess.run([sys.executable, "-m", "tiered_kv", "doctor", "--remote", f"redis://127.0.0.1:{free_port()}/0"],
                       capture_output=True, text=True, env=ENV, timeout=120)
    assert p.returncode == 1  # a probe asked for and failed fails the doctor (issue 41, item 5)
    assert "remote store" in p.stdout and "unreachable" in p.stdout


async def test_prometheus_exports_remote_hits_bytes_and_latency(redis_server):  # noqa: F811
    from prometheus_client import CollectorRegistry, generate_latest

    from tiered_kv.metrics import register_prometheus

    layout = KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, tokens_per_block=16, dtype=torch.float16)
    model = f"prom-{os.getpid()}-{id(layout)}"
    wl = lambda: ChatWorkload(seed=5, conversations=4, system_tokens=96, turns=(1, 2))  # noqa: E731
    async with TieredKVCache(
        layout, gpu_blocks=64, host_blocks=32, device="cpu", model_id=model, remote=store_url(redis_server)
    ) as a:
        await replay(a, wl())
        await a.flush()
    async with TieredKVCache(
        layout, gpu_blocks=64, host_blocks=32, device="cpu", model_id=model, remote=store_url(redis_server)
    ) as b:
        await replay(b, wl())
        registry = CollectorRegistry()
        register_prometheus(b, registry)
        text = generate_latest(registry).decode()
        hits = b.statistics().hits["remote"]
    assert hits > 0
    assert f'tiered_kv_cache_hit_blocks_total{{tier="remote"}} {float(hits)}' in text
    assert 'tiered_kv_remote_blocks_total{outcome="get"}' in text
    assert 'tiered_kv_remote_bytes_total{op="get"}' in text
    assert 'tiered_kv_remote_batch_seconds_bucket{le="+Inf",op="get"}' in text
    assert "tiered_kv_remote_available 1.0" in text


@pytest.mark.timeout(300)
def test_docs_remote_example_runs():
    import pathlib
    import re

    text = (pathlib.Path(__file__).resolve().parent.parent / "docs" / "integrations.md").read_text()
    block = re.search(r"<!-- remote-example -->\s*```python\n(.*?)```", text, re.S)
    assert block, "docs/integrations.md's remote tier section must keep its example after <!-- remote-example -->"
    p = subprocess.run([sys.executable, "-c", block.group(1)], capture_output=True, text=True, env=ENV, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
