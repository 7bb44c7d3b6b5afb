"""A small KV-cache-backed HTTP service: each request awaits ``cache.add_sequences`` on one event loop.

The "model" is a stand-in: prefill sleeps in proportion to the prompt tokens the cache could not reuse,
each decode step sleeps a fixed time, and the KV content written for every computed token is the
deterministic pattern of :mod:`tiered_kv.tools.workload`, so every reused token is verified on the way in.

Run it (binds 127.0.0.1 by default) and drive it with ``examples/load_client.py``::

    python examples/async_server.py --port 8080 --device auto --host-blocks 4096 &
    python examples/load_client.py --url http://127.0.0.1:8080 --requests 200 --concurrency 16

Endpoints: ``POST /generate`` ``{"prompt": [ids], "max_new_tokens": n, "priority": p}`` ->
``{"seq_id", "tokens_reused", "blocks_from", "blocks_allocated", "mismatched_tokens", "output", "seconds"}``;
``GET /stats`` (cache statistics); ``GET /healthz``.

Why aiohttp: one well-kept asyncio-native package gives both the server and the load client, runs on
uvloop, and needs no ASGI layer in between.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import numpy as np
import torch
from aiohttp import web

from tiered_kv import CacheFullError, KVLayout, Request, TieredKVCache
from tiered_kv.keys import MAX_TOKEN_ID
from tiered_kv.tools.workload import verify_expected, write_expected

log = logging.getLogger("tiered_kv.examples.server")
T = TypeVar("T")

CACHE: web.AppKey[TieredKVCache] = web.AppKey("cache", TieredKVCache)
CONFIG: web.AppKey[ServerConfig] = web.AppKey("config", object)  # type: ignore[arg-type]
ROOM: web.AppKey[_Room] = web.AppKey("room", object)  # type: ignore[arg-type]


@dataclasses.dataclass(frozen=True, slots=True)
class ServerConfig:
    """The stand-in model's costs and limits."""

    prefill_us_per_token: float = 20.0  # recompute-time proxy: each token not reused costs this much
    decode_ms_per_token: float = 1.0
    max_prompt_tokens: int = 32_768
    max_new_tokens: int = 512
    verify: bool = True


def _reply_tokens(prompt: np.ndarray, n: int) -> list[int]:
    """Deterministic "generated" tokens (a function of the prompt), so repeated turns are cacheable."""
    rng = np.random.default_rng(int(prompt[-1]) * 1_000_003 + len(prompt))
    return rng.integers(0, 32_000, n).tolist()


def _bad_request(message: str) -> web.HTTPBadRequest:
    return web.HTTPBadRequest(text=message + "\n")


class _Room:
    """Back-pressure: a request that finds the cache full waits until a running request frees its blocks.

    If every other live request is itself waiting for room, nobody would ever free anything: the request
    that finds this is aborted with 503 (its blocks are freed, so the others proceed): a stand-in for the
    preemption a real server would do.
    """

    def __init__(self) -> None:
        self.freed = asyncio.Condition()
        self.waiting = 0

    async def run(self, cache: TieredKVCache, call: Callable[[], Awaitable[T]], *, live_self: int) -> T:
        while True:
            try:
                return await call()
            except CacheFullError as exc:
                running_others = len(cache.blocks.live_sequences) - live_self - self.waiting
                if running_others <= 0:
                    raise web.HTTPServiceUnavailable(text=f"cache full and nothing running can free it: {exc}\n") from None
                self.waiting += 1
                try:
                    async with self.freed:
                        await self.freed.wait()
                finally:
                    self.waiting -= 1

    async def notify(self) -> None:
        async with self.freed:
            self.freed.notify_all()


async def generate(request: web.Request) -> web.Response:
    cache = request.app[CACHE]
    config = request.app[CONFIG]
    try:
        body: Any = await request.json()
    except ValueError:
        raise _bad_request("body must be JSON") from None
    except RecursionError:  # hostile input: [[[[...]]]] deeper than the parser's stack
        raise _bad_request("body is nested too deeply") from None
    if not isinstance(body, dict):
        raise _bad_request("body must be a JSON object")
    prompt = body.get("prompt")
    if not isinstance(prompt, list) or not prompt or not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        raise _bad_request("prompt must be a non-empty list of token ids (integers)")
    if not all(0 <= t <= MAX_TOKEN_ID for t in prompt):
        raise _bad_request("prompt token ids must be in 0..2**63-1")
    if len(prompt) > config.max_prompt_tokens:
        raise _bad_request(f"prompt has {len(prompt)} tokens; at most {config.max_prompt_tokens}")
    max_new = body.get("max_new_tokens", 16)
    if not isinstance(max_new, int) or isinstance(max_new, bool) or not 0 <= max_new <= config.max_new_tokens:
        raise _bad_request(f"max_new_tokens must be an int in 0..{config.max_new_tokens}")
    tpb = cache.layout.tokens_per_block
    need = -(-(len(prompt) + max_new) // tpb)
    if need > cache.blocks.max_blocks_per_seq:
        raise _bad_request(f"prompt ({len(prompt)} tokens) + max_new_tokens ({max_new}) needs {need} blocks of {tpb} "
                           f"tokens; a sequence may hold {cache.blocks.max_blocks_per_seq}")
    priority = body.get("priority", 50)
    if not isinstance(priority, int) or isinstance(priority, bool) or not 0 <= priority <= 100:
        raise _bad_request("priority must be an int in 0..100")

    t0 = time.perf_counter()
    tokens = np.asarray(prompt, dtype=np.int64)
    room = request.app[ROOM]
    try:
        [adm] = await room.run(cache, lambda: cache.add_sequences([Request(tokens, priority)]), live_self=0)
    except (ValueError, TypeError) as exc:
        raise _bad_request(str(exc)) from None
    try:
        mismatched = len(verify_expected(cache, adm.seq_id, 0, adm.tokens_reused)) if config.verify else 0
        # prefill: only the tokens the cache could not give back cost compute
        write_expected(cache, adm.seq_id, adm.tokens_reused)
        await asyncio.sleep(config.prefill_us_per_token * adm.tokens_to_compute / 1e6)
        cache.commit(adm.seq_id)
        output = _reply_tokens(tokens, max_new)
        for token in output:  # decode, one token per step
            await asyncio.sleep(config.decode_ms_per_token / 1e3)
            await room.run(cache, lambda t=token: cache.append_tokens(adm.seq_id, [t]), live_self=1)
        if output:
            write_expected(cache, adm.seq_id, len(prompt), len(prompt) + len(output) - 1)
            cache.commit(adm.seq_id, len(prompt) + len(output) - 1)
    finally:
        cache.free(adm.seq_id)
        await room.notify()
    return web.json_response(
        {
            "seq_id": adm.seq_id,
            "tokens_reused": adm.tokens_reused,
            "blocks_from": adm.blocks_from,
            "blocks_allocated": adm.blocks_allocated,
            "mismatched_tokens": mismatched,
            "output": output,
            "seconds": time.perf_counter() - t0,
        }
    )


async def stats(request: web.Request) -> web.Response:
    s = request.app[CACHE].statistics()
    return web.json_response(dataclasses.asdict(s), dumps=lambda o: __import__("json").dumps(o, default=str))


async def healthz(request: web.Request) -> web.Response:
    return web.Response(text="ok\n")


def make_app(cache: TieredKVCache, config: ServerConfig | None = None) -> web.Application:
    """The aiohttp application over an open cache (the caller owns the cache's lifetime)."""
    app = web.Application(client_max_size=8 * 2**20)
    app[CACHE] = cache
    app[CONFIG] = config or ServerConfig()
    app[ROOM] = _Room()
    app.add_routes([web.post("/generate", generate), web.get("/stats", stats), web.get("/healthz", healthz)])
    return app


async def serve(args: argparse.Namespace) -> None:
    layout = KVLayout(num_layers=args.layers, num_kv_heads=4, head_dim=64, tokens_per_block=16, dtype=torch.float16)
    async with TieredKVCache(
        layout,
        gpu_blocks=args.gpu_blocks,
        host_blocks=args.host_blocks,
        file_blocks=args.file_blocks,
        file_dir=args.dir,
        device=args.device,
        max_seqs=args.max_seqs,
    ) as cache:
        runner = web.AppRunner(make_app(cache, ServerConfig(verify=not args.no_verify)))
        await runner.setup()
        site = web.TCPSite(runner, args.bind, args.port)
        await site.start()
        print(f"serving on http://{args.bind}:{args.port} ({cache.engine.device.kind}); Ctrl-C to stop", flush=True)
        try:
            await asyncio.Event().wait()
        finally:
            await runner.cleanup()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bind", default="127.0.0.1", help="address to bind (default: loopback only)")
    parser.add_argument("--port", type=int, default=8080)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--gpu-blocks", type=int, default=512)
    parser.add_argument("--host-blocks", type=int, default=2048)
    parser.add_argument("--file-blocks", type=int, default=0)
    parser.add_argument("--dir", default=None, help="directory of the file tier (with --file-blocks)")
    parser.add_argument("--max-seqs", type=int, default=256)
    parser.add_argument("--no-verify", action="store_true")
    args = parser.parse_args()
    try:
        import uvloop

        uvloop.run(serve(args))
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
