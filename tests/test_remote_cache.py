"""Remote tier in the prefix cache: sharing between caches and between processes, policies, faults, soak.

Every test checks every reused token against the per-token oracle of :mod:`tiered_kv.tools.workload`
(content derived from the token prefix): 0 wrong tokens, whatever the store does.
"""

from __future__ import annotations

import asyncio
import json
import pathlib
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
from remote_servers import mooncake_server, redis_server, server, store_url  # noqa: F401

from tiered_kv import KVLayout, Request, TieredKVCache
from tiered_kv.remote import RemoteTier, object_name, open_store
from tiered_kv.remote.servers import start_mooncake_master, start_redis
from tiered_kv.tools.workload import ChatWorkload, replay, verify_expected, write_expected

HERE = pathlib.Path(__file__).resolve().parent
LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, tokens_per_block=16, dtype=torch.float16)


def _workload(seed: int, conversations: int = 6) -> ChatWorkload:
    return ChatWorkload(seed=seed, conversations=conversations, system_prompts=2, system_tokens=160, turns=(1, 3))


def _cache(url: object, model: str, **kw: object) -> TieredKVCache:
    kw.setdefault("gpu_blocks", 96)
    kw.setdefault("host_blocks", 64)
    return TieredKVCache(LAYOUT, device="cpu", remote=url, model_id=model, **kw)  # type: ignore[arg-type]


def _model(name: str) -> str:
    return f"{name}-{time.time_ns()}"  # a fresh key space per test (the servers are shared by a module)


async def test_a_cold_cache_reuses_a_warm_caches_prefix_through_the_store(server):  # noqa: F811
    model = _model("share")
    async with _cache(store_url(server), model) as warm:
        r1 = await replay(warm, _workload(1))
        await warm.flush()
        assert r1.mismatched_tokens == 0 and r1.hits["remote"] == 0
        assert warm.statistics().remote.blocks["put"] > 0
        async with _cache(store_url(server), model) as cold:
            r2 = await replay(cold, _workload(1))
            s = cold.statistics()
    assert r2.mismatched_tokens == 0 and r2.verified_tokens == r2.reused_tokens
    assert r2.hits["remote"] > 0 and s.hits["remote"] == r2.hits["remote"]
    assert r2.reused_tokens > r1.reused_tokens  # the cold one starts with the warm one's prefixes
    assert s.remote.blocks["bad"] == 0 and s.remote.blocks["get"] >= r2.hits["remote"]


async def test_another_model_or_rank_never_sees_the_blocks(server):  # noqa: F811
    model = _model("isolation")
    async with _cache(store_url(server), model) as warm:
        await replay(warm, _workload(2))
        await warm.flush()
        async with (
            _cache(store_url(server), model + "-other") as other,
            _cache(store_url(server), model, remote_rank=1) as rank1,
        ):
            for cache in (other, rank1):
                r = await replay(cache, _workload(2))
                assert r.hits["remote"] == 0 and r.mismatched_tokens == 0


@pytest.mark.timeout(400)
@pytest.mark.parametrize("store", ["redis", "mooncake"])
def test_two_processes_share_a_prefix_through_the_store(store, request):
    srv = request.getfixturevalue(f"{store}_server")
    url = store_url(srv)
    env_cmd = [sys.executable, str(HERE / "remote_peer.py"), url]
    with subprocess.Popen([*env_cmd, "warm", "3"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                          stderr=subprocess.DEVNULL, text=True) as warm:
        try:
            assert warm.stdout is not None and warm.stdin is not None
            w = json.loads(warm.stdout.readline())
            cold = subprocess.run([*env_cmd, "cold", "3"], capture_output=True, text=True, timeout=120)
            assert cold.returncode == 0, cold.stderr[-2000:]
            c = json.loads(cold.stdout.strip().splitlines()[-1])
            warm.stdin.write("done\n")
            warm.stdin.flush()
            assert warm.wait(60) == 0
        finally:
            if warm.poll() is None:
                warm.kill()
    assert w["mismatched"] == 0 and w["hits"]["remote"] == 0 and w["remote"]["put"] > 0
    assert c["mismatched"] == 0 and c["verified"] == c["reused"]  # identical content, token by token
    assert c["hits"]["remote"] > 0 and c["reused"] > w["reused"]


@pytest.mark.parametrize("policy", ["evict", "off"])
async def test_policies(policy, redis_server):  # noqa: F811
    model = _model(policy)
    url = store_url(redis_server)
    async with _cache(url, model, host_blocks=16, remote_policy=policy) as warm:  # a small host tier: it evicts
        r1 = await replay(warm, _workload(4, conversations=10))
        await warm.flush()
        put = warm.statistics().remote.blocks["put"]
        dropped = warm.statistics().evictions.get("host->dropped", 0)
    assert r1.mismatched_tokens == 0
    if policy == "off":
        assert put == 0
    else:
        assert dropped > 0 and 0 < put
    async with _cache(url, model) as cold:
        r2 = await replay(cold, _workload(4, conversations=10))
    assert r2.mismatched_tokens == 0
    assert (r2.hits["remote"] > 0) == (policy == "evict")


def test_bad_remote_arguments(redis_server):  # noqa: F811
    with pytest.raises(ValueError, match="remote_policy"):
        _cache(store_url(redis_server), "m", remote_policy="always")
    with pytest.raises(ValueError, match="host tier"):
        _cache(store_url(redis_server), "m", host_blocks=0)
    with pytest.raises(ValueError, match="unknown remote store URL"):
        _cache("memcached://127.0.0.1:1", "m")


# ---------------------------------------------------------------------------------------------- faults


async def test_store_down_at_start_the_cache_runs_without_it(server):  # noqa: F811
    srv = start_redis() if server.kind == "redis" else start_mooncake_master()
    url = store_url(srv)
    srv.stop()
    async with _cache(url, _model("down")) as cache:
        t0 = time.perf_counter()
        r = await replay(cache, _workload(5))
        took = time.perf_counter() - t0
        await cache.flush()
        s = cache.statistics()
    assert r.mismatched_tokens == 0 and r.reused_tokens > 0 and r.hits["remote"] == 0
    assert not s.remote.available and took < 10


async def test_store_restarted_mid_run(server):  # noqa: F811
    srv = start_redis() if server.kind == "redis" else start_mooncake_master()
    try:
        url = store_url(srv, timeout=2)
        model = _model("restart")
        async with _cache(url, model) as a, _cache(url, model) as b:
            turns = list(_workload(6, conversations=8))
            half = len(turns) // 2
            ra = await replay(a, turns[:half])
            await a.flush()
            srv.restart()  # everything stored is gone; clients reconnect
            rb = await replay(b, turns)
            await b.flush()
            await a.flush()
            assert ra.mismatched_tokens == 0 and rb.mismatched_tokens == 0
            assert b.statistics().remote.blocks["bad"] == 0
    finally:
        srv.stop()


async def test_hung_store_bounds_admission_latency(server):  # noqa: F811
    srv = start_redis() if server.kind == "redis" else start_mooncake_master()
    try:
        url = store_url(srv, timeout=1)
        async with _cache(url, _model("hung")) as cache:
            await replay(cache, _workload(7, conversations=2))
            await cache.flush()
            srv.pause()
            try:
                latencies: list[float] = []
                r = await replay(cache, _workload(8, conversations=6), observe=lambda t, a, s: latencies.append(s))
            finally:
                srv.resume()
            assert r.mismatched_tokens == 0
            assert max(latencies) < 2.5  # one timeout at most ...
            assert sorted(latencies)[len(latencies) // 2] < 0.5  # ... then the tier backs off: no stall
            await cache.flush()
    finally:
        srv.stop()


async def test_corrupted_objects_are_recomputed_never_served(redis_server):  # noqa: F811
    model = _model("corrupt")
    url = store_url(redis_server)
    async with _cache(url, model) as warm:
        await replay(warm, _workload(9))
        await warm.flush()
    raw = open_store(url)
    await raw.connect()
    client = raw._require()
    names = [k async for k in client.scan_iter(match="tkv1/0/*")]
    rng = np.random.default_rng(9)
    corrupted = 0
    for name in names:
        value = bytearray(await client.get(name))
        value[int(rng.integers(len(value)))] ^= 1 << int(rng.integers(8))  # one bit anywhere: header or payload
        await client.set(name, bytes(value))
        corrupted += 1
    await raw.close()
    assert corrupted > 10
    async with _cache(url, model) as cold:
        r = await replay(cold, _workload(9))
        s = cold.statistics()
    assert r.mismatched_tokens == 0
    assert s.remote.blocks["bad"] > 0 and s.remote.blocks["get"] == 0 and r.hits["remote"] == 0


async def test_two_writers_of_the_same_prefixes_at_once(server):  # noqa: F811
    model = _model("writers")
    url = store_url(server)
    async with _cache(url, model) as a, _cache(url, model) as b:
        ra, rb = await asyncio.gather(replay(a, _workload(10)), replay(b, _workload(10)))
        await asyncio.gather(a.flush(), b.flush())
        async with _cache(url, model) as c:
            rc = await replay(c, _workload(10))
    assert ra.mismatched_tokens == rb.mismatched_tokens == rc.mismatched_tokens == 0
    assert rc.hits["remote"] > 0


@pytest.mark.timeout(400)
async def test_soak_random_caches_policies_and_store_faults(redis_server):  # noqa: F811
    """Randomized: several caches on one store, small tiers, random policies, store paused and restarted."""
    rng = np.random.default_rng(2026)
    srv = start_redis()
    try:
        model = _model("soak")
        url = store_url(srv, timeout=1)
        caches = [_cache(url, model, gpu_blocks=int(rng.integers(40, 80)), host_blocks=int(rng.integers(8, 40)),
                         remote_policy=str(rng.choice(["commit", "evict", "commit"]))) for _ in range(3)]
        for c in caches:
            await c.__aenter__()
        checked = wrong = 0
        tpb = LAYOUT.tokens_per_block
        prompts = [rng.integers(0, 50, int(rng.integers(tpb, 8 * tpb))) for _ in range(12)]
        for step in range(120):
            cache = caches[int(rng.integers(len(caches)))]
            base = prompts[int(rng.integers(len(prompts)))]
            prompt = np.concatenate([base, rng.integers(0, 50, int(rng.integers(0, 2 * tpb)))])
            [adm] = await cache.add_sequences([Request(prompt)])
            bad = verify_expected(cache, adm.seq_id, 0, adm.tokens_reused)
            checked += adm.tokens_reused
            wrong += len(bad)
            write_expected(cache, adm.seq_id, adm.tokens_reused)
            cache.commit(adm.seq_id)
            cache.free(adm.seq_id)
            if step == 40:
                srv.pause()
            elif step == 55:
                srv.resume()
            elif step == 80:
                srv.restart()
            elif step % 25 == 0:
                await cache.flush()
        remote_hits = sum(c.statistics().hits["remote"] for c in caches)
        for c in caches:
            await c.close()
        assert wrong == 0 and checked > 0
        assert remote_hits > 0
    finally:
        srv.stop()


async def test_remote_tier_object_can_be_passed_in(redis_server):  # noqa: F811
    from tiered_kv import TransferEngine

    async with TransferEngine(LAYOUT, gpu_blocks=96, host_blocks=64, device="cpu") as engine:
        tier = RemoteTier(engine, store_url(redis_server))
        async with TieredKVCache(
            LAYOUT, device="cpu", gpu_blocks=96, host_blocks=64, engine=engine, remote=tier
        ) as cache:
            assert cache.remote.tier is tier and tier.available
            r = await replay(cache, _workload(12))
            assert r.mismatched_tokens == 0
        with pytest.raises(ValueError, match="over the cache's engine"):
            async with TransferEngine(LAYOUT, gpu_blocks=96, host_blocks=64, device="cpu") as other:
                TieredKVCache(LAYOUT, device="cpu", gpu_blocks=96, host_blocks=64, engine=other, remote=tier)
    assert object_name(0, b"\x01") == "tkv1/0/01"


@pytest.mark.timeout(400)
@pytest.mark.parametrize("policy", ["commit", "evict"])
async def test_the_cache_soak_with_the_remote_tier_in_the_loop(server, policy):  # noqa: F811
    """tiered_kv.tools.cache_soak (stalls, file faults, cancellations, per-token oracle) with a real store."""
    from tiered_kv.tools.cache_soak import CacheSoakConfig, cache_soak

    report = await cache_soak(CacheSoakConfig(ops=300, tasks=8, seed=13, host_blocks=16, file_blocks=32,
                                              remote=store_url(server), remote_policy=policy))
    assert report.hits["remote"] > 0  # blocks dropped from every local tier came back from the store, verified


async def test_a_block_whose_source_copy_fails_is_never_put(redis_server):  # noqa: F811
    """Commit policy: a committed block whose data was still arriving by a copy is put only once that copy
    succeeded. The put used to be fenced behind the copy and issued at once: when the copy failed, the put read
    the slot's undefined bytes and stored them under a valid checksum, for other caches to be served."""
    from tiered_kv import Tier, TransferError

    async with _cache(store_url(redis_server), _model("source-failed")) as cache:
        tpb = LAYOUT.tokens_per_block
        [adm] = await cache.add_sequences([list(range(1, 2 * tpb + 2))])
        write_expected(cache, adm.seq_id, 0)
        first = cache.blocks.sequence_blocks(adm.seq_id)[0]
        assert first.tier is Tier.GPU
        # a copy of the cache's own (the engine belongs to the cache) into the first block's slot, still in
        # flight, that fails: the store has no such object
        failing = cache.engine._copy(Tier.REMOTE, [0], Tier.GPU, [first.slot], keys=[b"\x00" * 16])
        first.sources.append(failing)
        cache.commit(adm.seq_id)
        with pytest.raises(TransferError):
            await failing
        await cache.flush()
        blocks = cache.statistics().remote.blocks
        cache.free(adm.seq_id)
    assert blocks["put"] == 1, blocks  # the second block only: the first one's data came from a failed copy
