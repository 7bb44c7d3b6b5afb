"""Remote tier, store layer: URLs, self-verifying objects, and both store clients against real servers."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest
import torch
from remote_servers import mooncake_server, redis_server, server, store_url  # noqa: F401

from tiered_kv import KVLayout
from tiered_kv.errors import RemoteStoreError
from tiered_kv.remote import PASSWORD_ENV, object_name, open_store, parse_store_url
from tiered_kv.remote.objects import encode_object, object_size, verify_object
from tiered_kv.remote.servers import free_port, start_redis
from tiered_kv.slab import HEADER_SIZE

# ---------------------------------------------------------------------------------------------- URLs


def test_urls_parse():
    u = parse_store_url("redis://127.0.0.1:6379/3?timeout=0.5&ttl=60", environ={PASSWORD_ENV: "pw"})
    assert (u.kind, u.host, u.port, u.db, u.timeout, u.ttl, u.password, u.tls) == (
        "redis",
        "127.0.0.1",
        6379,
        3,
        0.5,
        60,
        "pw",
        False,
    )
    assert "pw" not in repr(u) and str(u) == "redis://127.0.0.1:6379/3"
    assert parse_store_url("rediss://cache.internal:6380", environ={}).tls
    assert parse_store_url("redis+cluster://10.0.0.1:7000", environ={}).scheme == "redis+cluster"
    m = parse_store_url("mooncake://127.0.0.1:50051?segment=64MiB&protocol=rdma", environ={})
    assert (m.kind, m.segment, m.protocol, m.password) == ("mooncake", 64 * 2**20, "rdma", None)


@pytest.mark.parametrize(
    ("url", "error", "match"),
    [
        ("http://127.0.0.1:1", ValueError, "unknown remote store URL"),
        ("redis://127.0.0.1", ValueError, "needs a host and a port"),
        ("redis://:secret@127.0.0.1:6379", ValueError, "do not put the password in the URL"),
        ("redis://127.0.0.1:6379/x", ValueError, "database number"),
        ("mooncake://127.0.0.1:1/0", ValueError, "database number"),
        ("redis://127.0.0.1:6379?timeout=-1", ValueError, "timeout"),
        ("redis://127.0.0.1:6379?colour=red", ValueError, "unknown parameter"),
        ("mooncake://127.0.0.1:1?segment=lots", ValueError, "segment"),
        (6379, TypeError, "must be a str"),
    ],
)
def test_bad_urls_are_refused_with_a_sentence(url, error, match):
    with pytest.raises(error, match=match):
        parse_store_url(url, environ={})


# ---------------------------------------------------------------------------------------------- objects

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, tokens_per_block=8, dtype=torch.float16)
FP = bytes.fromhex(LAYOUT.fingerprint)


def _object(name: str, seed: int = 0) -> np.ndarray:
    obj = np.zeros(object_size(LAYOUT), dtype=np.uint8)
    payload = np.random.default_rng(seed).integers(0, 256, LAYOUT.bytes_per_block, dtype=np.uint8)
    encode_object(obj, FP, 0, name, payload)
    return obj


def test_object_round_trip_and_every_corruption_is_caught():
    name = object_name(0, b"k" * 16)
    obj = _object(name)
    payload = verify_object(obj, FP, 0, name, LAYOUT.bytes_per_block)
    assert isinstance(payload, np.ndarray) and payload.size == LAYOUT.bytes_per_block
    flipped = obj.copy()
    flipped[HEADER_SIZE + 100] ^= 1
    assert verify_object(flipped, FP, 0, name, LAYOUT.bytes_per_block) == "payload checksum mismatch"
    hdr = obj.copy()
    hdr[40] ^= 1
    assert verify_object(hdr, FP, 0, name, LAYOUT.bytes_per_block) == "header checksum mismatch"
    other = KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, tokens_per_block=8, dtype=torch.bfloat16)
    assert (
        verify_object(obj, bytes.fromhex(other.fingerprint), 0, name, LAYOUT.bytes_per_block)
        == "written for another block layout"
    )
    assert verify_object(obj, FP, 1, name, LAYOUT.bytes_per_block) == "header names another block"
    assert verify_object(obj, FP, 0, object_name(0, b"j" * 16), LAYOUT.bytes_per_block) == "header names another block"
    assert "expected" in verify_object(obj[:-1], FP, 0, name, LAYOUT.bytes_per_block)
    assert verify_object(np.zeros_like(obj), FP, 0, name, LAYOUT.bytes_per_block) == "empty header"


# ---------------------------------------------------------------------------------------------- clients


async def test_batch_put_get_missing_and_immutability(server):  # noqa: F811
    store = open_store(store_url(server))
    await store.connect()
    try:
        rng = np.random.default_rng(1)
        names = [f"test/{rng.integers(1 << 62)}/{i}" for i in range(5)]
        objs = rng.integers(0, 256, (5, 4096 + 512), dtype=np.uint8)
        out = np.zeros((6, 4096 + 512), dtype=np.uint8)
        store.register(objs)
        store.register(out)
        assert await store.put(names, list(objs)) == [True] * 5
        sizes = await store.get([*names, names[0] + "/absent"], list(out))
        assert sizes == [objs.shape[1]] * 5 + [-1]
        assert (out[:5] == objs).all()
        # a second writer of an existing name keeps the first value (immutable objects)
        assert await store.put(names[:1], [objs[1]]) == [True]
        out[:] = 0
        await store.get(names[:1], [out[0]])
        assert (out[0] == objs[0]).all()
        assert await store.ping() > 0
    finally:
        await store.close()


async def test_unreachable_store_fails_fast_with_remote_store_error(server):  # noqa: F811
    url = server.url.replace(str(server.port), str(free_port()))
    store = open_store(url + "?timeout=2")
    t0 = time.perf_counter()
    with pytest.raises(RemoteStoreError, match="cannot reach"):
        await store.connect()
    assert time.perf_counter() - t0 < 1.0
    await store.close()


async def test_redis_password_comes_from_the_environment(monkeypatch):
    with start_redis(password="s3cret-pw") as srv:
        monkeypatch.delenv(PASSWORD_ENV, raising=False)
        store = open_store(srv.url + "?timeout=30")  # generous: a loaded 2-core CI machine once took > 5 s to connect
        with pytest.raises(RemoteStoreError, match=r"(?i)auth"):
            await store.connect()
        await store.close()
        monkeypatch.setenv(PASSWORD_ENV, "s3cret-pw")
        store = open_store(srv.url + "?timeout=30")
        await store.connect()
        assert await store.put(["pw/a"], [np.ones(8, dtype=np.uint8)]) == [True]
        await store.close()
    assert os.environ.get(PASSWORD_ENV) == "s3cret-pw"
