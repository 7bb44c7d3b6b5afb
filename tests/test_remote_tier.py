"""Remote tier, RemoteTier: fenced batched copies between engine pools and real stores, and its faults."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest
import torch
from helpers import fill_pool, same
from remote_servers import mooncake_server, redis_server, server, store_url  # noqa: F401

from tiered_kv import Tier, TransferEngine
from tiered_kv.errors import IntegrityError, RemoteStoreError
from tiered_kv.remote import RemoteTier, object_name, open_store
from tiered_kv.remote.objects import object_size
from tiered_kv.remote.servers import start_mooncake_master, start_redis
from tiered_kv.testing import stall


def _keys(n: int, salt: int) -> list[bytes]:
    rng = np.random.default_rng(salt + int(time.time_ns() % 1_000_000))
    return [rng.bytes(16) for _ in range(n)]


async def test_round_trip_gpu_host_in_batches(layout, device, server):  # noqa: F811
    async with TransferEngine(layout, gpu_blocks=16, host_blocks=16, device=device) as engine:
        gpu = fill_pool(engine, "gpu", 1)
        tier = RemoteTier(engine, store_url(server), staging_blocks=4)  # 10 blocks: 5 chunks of 2
        assert await tier.connect()
        keys = _keys(10, 1)
        put = tier.put(Tier.GPU, range(10), keys)
        await put
        assert put.found == [True] * 10
        get = tier.get([*keys, b"\x01" * 16], Tier.HOST, range(11))
        await get
        assert get.found == [True] * 10 + [False]
        assert same(engine.pool("host").tensor[:10].cpu(), gpu[:10])
        back = tier.get(keys[:3], Tier.GPU, [13, 14, 15])
        await back
        assert back.found == [True] * 3 and same(engine.pool("gpu").tensor[13:].cpu(), gpu[:3])
        s = tier.statistics()
        assert s.blocks["put"] == 10 and s.blocks["get"] == 13 and s.blocks["miss"] == 1
        assert s.batches["put"] == 5 and s.bytes["get"] == 13 * object_size(layout)
        await tier.close()


async def test_put_reads_the_block_before_a_later_engine_copy_overwrites_it(layout, device, server):  # noqa: F811
    async with TransferEngine(layout, gpu_blocks=4, host_blocks=4, device=device) as engine:
        fill_pool(engine, "gpu", 2)
        host = fill_pool(engine, "host", 3)
        tier = RemoteTier(engine, store_url(server))
        await tier.connect()
        keys = _keys(2, 2)
        put = tier.put(Tier.HOST, [0, 1], keys)
        overwrite = engine.copy(Tier.GPU, [0, 1], Tier.HOST, [0, 1])  # issued after the put: must wait for its read
        await asyncio.gather(put, overwrite)
        get = tier.get(keys, Tier.HOST, [2, 3])
        await get
        assert get.found == [True, True] and same(engine.pool("host").tensor[2:].cpu(), host[:2])
        await tier.close()


async def test_get_into_gpu_waits_for_a_pending_read_of_the_old_block(layout, device, server):  # noqa: F811
    async with TransferEngine(layout, gpu_blocks=4, host_blocks=4, device=device) as engine:
        gpu = fill_pool(engine, "gpu", 4)
        tier = RemoteTier(engine, store_url(server))
        await tier.connect()
        keys = _keys(1, 4)
        await tier.put(Tier.GPU, [1], keys)
        stall(engine.stream("offload"), 0.3)
        offload = engine.copy(Tier.GPU, [0], Tier.HOST, [0])  # stalled read of GPU block 0
        get = tier.get(keys, Tier.GPU, [0])  # overwrites GPU block 0: only after that read
        await asyncio.gather(offload, get)
        assert same(engine.pool("host").tensor[0].cpu(), gpu[0])
        assert same(engine.pool("gpu").tensor[0].cpu(), gpu[1])
        await tier.close()


async def test_corrupted_foreign_and_other_rank_objects_are_misses_and_leave_the_destination_alone(layout, server):  # noqa: F811
    async with TransferEngine(layout, gpu_blocks=4, host_blocks=4, device="cpu") as engine:
        fill_pool(engine, "gpu", 5)
        host = fill_pool(engine, "host", 6)
        tier = RemoteTier(engine, store_url(server))
        await tier.connect()
        keys = _keys(3, 5)
        await tier.put(Tier.GPU, [0, 1, 2], keys)
        raw = open_store(store_url(server))
        await raw.connect()
        size = object_size(layout)
        out = np.zeros((1, size), dtype=np.uint8)
        raw.register(out)
        await raw.get([object_name(0, keys[0])], [out[0]])
        if server.kind == "redis":  # overwrite in place: flip one payload bit
            out[0, -1] ^= 0x10
            r = raw._require()
            await r.set(object_name(0, keys[0]), out[0].tobytes())
        else:  # Mooncake objects are immutable: remove (after the read lease) and put the corrupted bytes
            out[0, -1] ^= 0x10
            deadline = time.monotonic() + 15
            while raw._require().remove(object_name(0, keys[0])) != 0 and time.monotonic() < deadline:  # noqa: ASYNC110
                await asyncio.sleep(0.5)  # the read lease (5 s) blocks removal
            assert await raw.put([object_name(0, keys[0])], [out[0]]) == [True]
        other_rank = RemoteTier(engine, store_url(server), route=False)
        other_rank.rank = 1
        get = tier.get(keys, Tier.HOST, [0, 1, 2])
        await get
        assert get.found == [False, True, True]
        assert same(engine.pool("host").tensor[0].cpu(), host[0])  # untouched
        s = tier.statistics()
        assert s.blocks["bad"] == 1 and s.bad_reasons == {"payload checksum mismatch": 1}
        await other_rank.connect()
        g2 = other_rank.get(keys[1:], Tier.HOST, [3, 2])
        await g2
        assert g2.found == [False, False]  # rank 1's names differ: rank 0's shard is never served to it
        await raw.close()  # (a Mooncake object lives in the memory of the client that put it: closed last)
        await tier.close()
        await other_rank.close()


async def test_store_down_at_start_is_a_miss_not_a_stall(layout, server):  # noqa: F811
    srv = start_redis() if server.kind == "redis" else start_mooncake_master()
    url = store_url(srv)
    srv.stop()
    async with TransferEngine(layout, gpu_blocks=4, host_blocks=4, device="cpu") as engine:
        tier = RemoteTier(engine, url, backoff=0.2)
        assert not await tier.connect()
        t0 = time.perf_counter()
        get = tier.get(_keys(2, 7), Tier.HOST, [0, 1])
        await get
        assert get.found == [False, False] and time.perf_counter() - t0 < 0.5
        put = tier.put(Tier.GPU, [0], _keys(1, 8))
        with pytest.raises(RemoteStoreError, match="unavailable"):
            await put
        assert not tier.statistics().available
        await tier.close()


async def test_hung_store_times_out_then_backs_off_then_recovers(layout, server):  # noqa: F811
    srv = start_redis() if server.kind == "redis" else start_mooncake_master()
    try:
        async with TransferEngine(layout, gpu_blocks=4, host_blocks=4, device="cpu") as engine:
            gpu = fill_pool(engine, "gpu", 9)
            tier = RemoteTier(engine, store_url(srv, timeout=1), backoff=0.5)
            assert await tier.connect()
            keys = _keys(2, 9)
            await tier.put(Tier.GPU, [0, 1], keys)
            srv.pause()
            try:
                t0 = time.perf_counter()
                get = tier.get(keys, Tier.HOST, [0, 1])
                try:  # Redis times out; a Mooncake client may time out or answer error codes (then: misses)
                    await get
                except RemoteStoreError as exc:
                    assert "longer than 1 s" in str(exc)
                assert time.perf_counter() - t0 < 2.5  # bounded by the timeout
                if get.found == [True, True]:
                    # a Mooncake client may serve objects of its own segment without its (hung) master: verified
                    assert server.kind == "mooncake" and same(engine.pool("host").tensor[:2].cpu(), gpu[:2])
                else:
                    assert get.found == [False, False] and tier.statistics().errors >= 1
                    t0 = time.perf_counter()
                    again = tier.get(keys, Tier.HOST, [2, 3])  # backing off: a miss at once, no second wait
                    await again
                    assert again.found == [False, False] and time.perf_counter() - t0 < 0.2
            finally:
                srv.resume()
            await asyncio.sleep(0.6)
            deadline = time.monotonic() + 20
            while True:
                g = tier.get(keys, Tier.HOST, [2, 3])
                try:
                    await g
                except RemoteStoreError:
                    pass
                if g.found == [True, True] or time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.6)
            assert g.found == [True, True]
            s = tier.statistics()
            assert s.blocks["bad"] == 0
            await tier.close()
    finally:
        srv.stop()


async def test_two_writers_of_one_key_leave_one_whole_valid_object(layout, server):  # noqa: F811
    async with (TransferEngine(layout, gpu_blocks=8, host_blocks=8, device="cpu") as a,
                TransferEngine(layout, gpu_blocks=8, host_blocks=8, device="cpu") as b):
        ga = fill_pool(a, "gpu", 10)
        gb = fill_pool(b, "gpu", 11)
        ta, tb = RemoteTier(a, store_url(server)), RemoteTier(b, store_url(server))
        await ta.connect()
        await tb.connect()
        keys = _keys(8, 10)
        for _ in range(3):
            await asyncio.gather(ta.put(Tier.GPU, range(8), keys), tb.put(Tier.GPU, range(8), keys))
        get = ta.get(keys, Tier.HOST, range(8))
        await get
        assert get.found == [True] * 8
        host = a.pool("host").tensor.cpu()
        for i in range(8):  # each object is one writer's block, whole (never a mix)
            assert same(host[i], ga[i]) or same(host[i], gb[i])
        await ta.close()
        await tb.close()


async def test_bad_arguments_are_refused_before_anything_runs(layout):
    async with TransferEngine(layout, gpu_blocks=2, host_blocks=2, device="cpu") as engine:
        with pytest.raises(ValueError, match="rank"):
            RemoteTier(engine, "redis://127.0.0.1:1/0", rank=-1)
        with pytest.raises(ValueError, match="staging_blocks"):
            RemoteTier(engine, "redis://127.0.0.1:1/0", staging_blocks=0)
        with pytest.raises(ValueError, match="unknown remote store URL"):
            RemoteTier(engine, "memcached://127.0.0.1:1")
        with pytest.raises(TypeError, match="TransferEngine"):
            RemoteTier(object(), "redis://127.0.0.1:1/0")  # type: ignore[arg-type]
        tier = RemoteTier(engine, "redis://127.0.0.1:1/0")
        with pytest.raises(ValueError, match="pair up"):
            tier.put(Tier.HOST, [0, 1], [b"k" * 16])
        with pytest.raises(ValueError, match="duplicates"):
            tier.get([b"a" * 16, b"b" * 16], Tier.HOST, [1, 1])
        with pytest.raises(ValueError, match="gpu and host tiers"):
            tier.put(Tier.FILE, [0], [b"k" * 16])
        with pytest.raises(TypeError, match="non-empty bytes"):
            tier.put(Tier.HOST, [0], ["text"])  # type: ignore[list-item]
        await tier.close()


async def test_engine_route_copies_through_the_handler(layout, device, server):  # noqa: F811
    async with TransferEngine(layout, gpu_blocks=8, host_blocks=8, device=device) as engine:
        gpu = fill_pool(engine, "gpu", 12)
        tier = RemoteTier(engine, store_url(server), staging_blocks=4)
        await tier.connect()
        keys = _keys(5, 12)
        await engine.copy(Tier.GPU, range(5), Tier.REMOTE, range(5), keys=keys)
        await engine.copy(Tier.REMOTE, range(5), Tier.HOST, [7, 6, 5, 4, 3], keys=keys)
        for i, h in enumerate([7, 6, 5, 4, 3]):
            assert same(engine.pool("host").tensor[h].cpu(), gpu[i])
        with pytest.raises(IntegrityError, match="1 of 2 blocks were not served"):
            await engine.copy(Tier.REMOTE, [0, 1], Tier.GPU, [6, 7], keys=[keys[0], b"\x02" * 16])
        with pytest.raises(ValueError, match="need keys"):
            engine.copy(Tier.HOST, [0], Tier.REMOTE, [0])
        with pytest.raises(ValueError, match="whole blocks"):
            engine.copy(Tier.HOST, [0], Tier.REMOTE, [0], num_tokens=1, keys=keys[:1])
        with pytest.raises(ValueError, match="already routed"):
            RemoteTier(engine, store_url(server))
        await tier.close()


async def test_a_lease_that_expires_mid_read_is_a_miss_never_wrong_data():
    """Mooncake: with a 1 ms read lease, objects of a large batch expire while being read (-707): misses only."""
    from tiered_kv import KVLayout

    big = KVLayout(num_layers=8, num_kv_heads=8, head_dim=128, tokens_per_block=16, dtype=torch.float16)  # 512 KiB
    with start_mooncake_master(lease_ms=1) as srv:
        async with TransferEngine(big, gpu_blocks=32, host_blocks=32, device="cpu") as engine:
            gpu = fill_pool(engine, "gpu", 13)
            host = fill_pool(engine, "host", 14)
            tier = RemoteTier(engine, store_url(srv, segment="128MiB"), staging_blocks=64)
            await tier.connect()
            keys = _keys(32, 13)
            await tier.put(Tier.GPU, range(32), keys)
            misses = 0
            for _ in range(3):
                get = tier.get(keys, Tier.HOST, range(32))
                await get
                for i, ok in enumerate(get.found):
                    assert same(engine.pool("host").tensor[i].cpu(), gpu[i] if ok else host[i])
                    if ok:
                        host[i] = gpu[i]
                misses += get.found.count(False)
            s = tier.statistics()
            assert misses > 0 and s.blocks["bad"] == 0 and s.errors == 0
            await tier.close()
