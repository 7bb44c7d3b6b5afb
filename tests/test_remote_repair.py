"""A corrupted object in the shared store is replaced by the next good put of it, on Redis and Mooncake, per rank.

Real servers on 127.0.0.1 (:mod:`remote_servers`). Every object the warm caches put is corrupted in place (one
flipped bit); a node that reads one recomputes the block and its put replaces the object; a third node then
reuses every such block, verified, with no warning.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import time
from typing import Any

import numpy as np
import pytest
import torch
from remote_servers import mooncake_server, redis_server, server, store_url  # noqa: F401

from tiered_kv import KVLayout, TieredKVCache
from tiered_kv.remote import object_name, open_store
from tiered_kv.remote.objects import object_size
from tiered_kv.remote.servers import LocalServer
from tiered_kv.remote.stores import KEPT, REPLACED, STORED
from tiered_kv.tools.workload import ChatWorkload, replay

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, tokens_per_block=16, dtype=torch.float16)
WORKLOAD = dict(seed=5, conversations=4, system_prompts=2, system_tokens=160, turns=(1, 2))


def _cache(url: str, model: str, rank: int) -> TieredKVCache:
    return TieredKVCache(LAYOUT, device="cpu", gpu_blocks=96, host_blocks=64, remote=url, model_id=model,
                         remote_rank=rank)


def _record_puts(cache: TieredKVCache, names: set[str], monkeypatch: pytest.MonkeyPatch) -> None:
    assert cache.remote is not None
    tier = cache.remote.tier
    put = tier.put

    def recording(src: Any, slots: Any, keys: Any) -> Any:
        names.update(object_name(tier.rank, bytes(k)) for k in keys)
        return put(src, slots, keys)

    monkeypatch.setattr(tier, "put", recording)


async def _corrupt(raw: Any, kind: str, names: list[str]) -> None:
    """Flip one bit of each object in place (Mooncake: an upsert of the flipped bytes)."""
    out = np.zeros((1, object_size(LAYOUT)), dtype=np.uint8)
    raw.register(out)
    rng = np.random.default_rng(5)
    for name in names:
        assert await raw.get([name], [out[0]]) == [out.shape[1]]
        out[0, int(rng.integers(out.shape[1]))] ^= 1 << int(rng.integers(8))  # header or payload
        if kind == "redis":
            await raw._require().set(name, out[0].tobytes())
        else:
            assert raw._require().batch_upsert_from([name], [out.ctypes.data], [out.shape[1]]) == [0]


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.levelno >= logging.WARNING and "failed verification" in r.getMessage()]


@pytest.mark.timeout(300)
async def test_a_corrupted_shared_object_is_reusable_again_after_one_node_recomputes_it(
    server: LocalServer, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch  # noqa: F811
) -> None:
    caplog.set_level(logging.WARNING, logger="tiered_kv")
    model = f"repair-{time.time_ns()}"
    url = store_url(server)
    async with contextlib.AsyncExitStack() as stack:  # Mooncake objects live in their writers' memory: all stay up
        names: dict[int, set[str]] = {0: set(), 1: set()}
        for rank in (0, 1):
            warm = await stack.enter_async_context(_cache(url, model, rank))
            _record_puts(warm, names[rank], monkeypatch)
            await replay(warm, ChatWorkload(**WORKLOAD))  # type: ignore[arg-type]
            await warm.flush()
            assert warm.statistics().remote.blocks["put"] == len(names[rank]) > 5
        raw = open_store(url)
        await raw.connect()
        stack.push_async_callback(raw.close)
        await _corrupt(raw, server.kind, sorted(names[0] | names[1]))

        for rank in (0, 1):
            caplog.clear()
            healer = await stack.enter_async_context(_cache(url, model, rank))
            r1 = await replay(healer, ChatWorkload(**WORKLOAD))  # type: ignore[arg-type]
            await healer.flush()
            s1 = healer.statistics().remote
            assert r1.mismatched_tokens == 0 and r1.hits["remote"] == 0
            assert s1.blocks["bad"] > 5 and s1.blocks["get"] == 0
            assert s1.blocks["replaced_corrupt"] == s1.blocks["bad"]  # every one it found bad, it replaced
            warned = _warnings(caplog)
            assert len(warned) == s1.blocks["bad"] and len(set(warned)) == len(warned)  # once per object

            caplog.clear()
            reader = await stack.enter_async_context(_cache(url, model, rank))
            r2 = await replay(reader, ChatWorkload(**WORKLOAD))  # type: ignore[arg-type]
            s2 = reader.statistics().remote
            assert r2.mismatched_tokens == 0 and r2.verified_tokens == r2.reused_tokens
            assert s2.blocks["bad"] == 0 and not _warnings(caplog)
            assert s2.blocks["get"] == s1.blocks["bad"] and r2.hits["remote"] == s2.blocks["get"]
            assert s2.blocks["replaced_corrupt"] == 0


async def test_redis_replace_is_a_compare_and_set_on_the_corrupted_bytes(redis_server: LocalServer) -> None:  # noqa: F811
    raw = open_store(store_url(redis_server))
    await raw.connect()
    try:
        prefix = f"tkv-test/{time.time_ns()}"
        good = np.full(64, 7, dtype=np.uint8)
        bad, other = b"\x01" * 64, b"\x02" * 64
        client = raw._require()
        await client.set(f"{prefix}/bad", bad)
        await client.set(f"{prefix}/other", other)
        await client.set(f"{prefix}/short", b"\x01" * 10)
        sha = hashlib.sha1(bad).hexdigest()
        outcomes = await raw.replace(
            [f"{prefix}/bad", f"{prefix}/other", f"{prefix}/short", f"{prefix}/absent"],
            [good] * 4,
            [sha, sha, None, sha],
        )
        assert outcomes == [REPLACED, KEPT, REPLACED, STORED]
        assert await client.get(f"{prefix}/bad") == good.tobytes()
        assert await client.get(f"{prefix}/other") == other  # another node's object: not overwritten
        assert await client.get(f"{prefix}/short") == good.tobytes()
        assert await client.get(f"{prefix}/absent") == good.tobytes()
        await raw.delete([f"{prefix}/{n}" for n in ("bad", "other", "short", "absent")])
    finally:
        await raw.close()
