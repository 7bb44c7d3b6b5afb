"""Issue 11, finding 9: the example server answers hostile input with a 400 and a one-line reason, never a 500."""

from __future__ import annotations

import pathlib
import sys

import pytest
import torch

aiohttp = pytest.importorskip("aiohttp", reason="the server example needs the [test] extra (aiohttp)")
from aiohttp import web  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "examples"))

from async_server import ServerConfig, make_app  # noqa: E402

from tiered_kv import KVLayout, TieredKVCache  # noqa: E402


async def test_hostile_requests_get_a_400_with_one_line() -> None:
    layout = KVLayout(num_layers=2, num_kv_heads=1, head_dim=8, tokens_per_block=4, dtype=torch.float16)
    async with TieredKVCache(layout, gpu_blocks=64, device="cpu", max_seqs=8, max_blocks_per_seq=8) as cache:
        runner = web.AppRunner(make_app(cache, ServerConfig(prefill_us_per_token=0, decode_ms_per_token=0)))
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        url = f"http://127.0.0.1:{port}/generate"
        try:
            async with aiohttp.ClientSession() as session:
                cases = {
                    "token >= 2**63": b'{"prompt": [1, 9223372036854775808]}',
                    "token >= 2**64": b'{"prompt": [1, 99999999999999999999999]}',
                    "deeply nested": b"[" * 100_000 + b"]" * 100_000,
                    "beyond a sequence": b'{"prompt": [1, 2, 3, 4, 5, 6, 7, 8, 9, 10], "max_new_tokens": 30}',
                    "prompt beyond a sequence": b'{"prompt": [' + b", ".join([b"1"] * 40) + b"]}",
                }
                for what, body in cases.items():
                    async with session.post(url, data=body, headers={"Content-Type": "application/json"}) as r:
                        text = await r.text()
                        assert r.status == 400, (what, r.status, text[:300])
                        assert text.count("\n") == 1 and text.strip(), (what, text)
                # the largest request that fits is served
                async with session.post(url, json={"prompt": list(range(1, 11)), "max_new_tokens": 22}) as r:
                    assert r.status == 200, await r.text()
            assert cache.blocks.live_sequences == ()
        finally:
            await runner.cleanup()
