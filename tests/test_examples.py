"""The examples run: the HTTP server answers real requests on a loopback port; the NVMe example round-trips."""

from __future__ import annotations

import pathlib
import sys

import pytest
import torch

aiohttp = pytest.importorskip("aiohttp", reason="the server example needs the [test] extra (aiohttp)")
from aiohttp import web  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "examples"))

from async_server import ServerConfig, make_app  # noqa: E402
from load_client import run_load  # noqa: E402

from tiered_kv import KVLayout, TieredKVCache  # noqa: E402


async def test_server_answers_real_http_requests_and_reuses_prefixes():
    layout = KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, tokens_per_block=16, dtype=torch.float16)
    async with TieredKVCache(layout, gpu_blocks=1024, host_blocks=2048, device="cpu", max_seqs=64) as cache:
        runner = web.AppRunner(make_app(cache, ServerConfig(prefill_us_per_token=1, decode_ms_per_token=0.1)))
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)  # a free loopback port
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        url = f"http://127.0.0.1:{port}"
        try:
            async with aiohttp.ClientSession() as session:
                async with session.get(f"{url}/healthz") as r:
                    assert r.status == 200
                prompt = list(range(1, 60))
                async with session.post(f"{url}/generate", json={"prompt": prompt, "max_new_tokens": 4}) as r:
                    first = await r.json()
                async with session.post(f"{url}/generate", json={"prompt": prompt, "max_new_tokens": 4}) as r:
                    second = await r.json()
                assert first["tokens_reused"] == 0
                assert second["tokens_reused"] >= 48 and second["mismatched_tokens"] == 0
                assert second["output"] == first["output"]
                bad: object
                for bad in (
                    {"prompt": []},
                    {"prompt": [1, -2]},
                    {"prompt": "abc"},
                    {"prompt": [1], "max_new_tokens": -1},
                    [1, 2],
                ):
                    async with session.post(f"{url}/generate", json=bad) as r:
                        assert r.status == 400, bad
                async with session.post(f"{url}/generate", data=b"not json") as r:
                    assert r.status == 400
                async with session.get(f"{url}/stats") as r:
                    assert r.status == 200 and "hits" in await r.text()

            result = await run_load(url, requests=48, concurrency=8, max_new_tokens=2)
            assert result.errors == 0 and result.mismatched_tokens == 0
            assert result.reused_tokens > 0 and result.p99_ms >= result.p50_ms > 0
        finally:
            await runner.cleanup()
        assert cache.statistics() is not None


async def test_server_back_pressure_waits_for_room_instead_of_failing():
    import asyncio
    import time

    layout = KVLayout(num_layers=1, num_kv_heads=1, head_dim=16, tokens_per_block=16, dtype=torch.float16)
    # room for one 100-token prompt (7 blocks) at a time, not two
    async with TieredKVCache(layout, gpu_blocks=10, device="cpu", max_seqs=4) as cache:
        runner = web.AppRunner(make_app(cache, ServerConfig(prefill_us_per_token=2000, decode_ms_per_token=0)))
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"  # type: ignore[union-attr]
        try:
            async with aiohttp.ClientSession() as session:

                async def post(prompt):
                    t0 = time.perf_counter()
                    async with session.post(f"{url}/generate", json={"prompt": prompt, "max_new_tokens": 0}) as r:
                        return r.status, time.perf_counter() - t0

                (s1, t1), (s2, t2) = await asyncio.gather(post(list(range(1, 101))), post(list(range(1001, 1101))))
                assert (s1, s2) == (200, 200)
                assert max(t1, t2) >= 0.38  # the second waited for the first's ~0.2 s prefill, then ran its own
                async with session.post(f"{url}/generate", json={"prompt": list(range(200)), "max_new_tokens": 0}) as r:
                    assert r.status == 400  # longer than a sequence may ever be: bad request, not a wait
        finally:
            await runner.cleanup()


async def test_offload_to_nvme_example_round_trips(tmp_path):
    from offload_to_nvme import run

    rows = await run(str(tmp_path), blocks=8, device="cpu", chunk=3, quiet=True)
    assert rows[0]["stage"] == "gpu->host (offload)" and len(rows) == 6
    assert all(r["GB/s"] > 0 for r in rows)
