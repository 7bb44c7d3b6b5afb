"""An OpenAI-compatible completion server whose handlers await a real transformers model through tiered_kv.

Every request is admitted to a :class:`~tiered_kv.TieredKVCache` (GPU, host and optionally file tiers): the
longest cached prefix of its prompt is brought back from whichever tier holds it and only the rest is run
through the model (:class:`~tiered_kv.integrations.hf.CachedGenerator`). ``--no-cache`` serves the
same model with plain transformers instead (a full-prompt prefill per request): the baseline the load
client compares against.

Run it (binds 127.0.0.1 by default; nothing is downloaded: the default model is a small Llama with random
weights built from a config, with a byte-level tokenizer and a ChatML chat template built in code
(:class:`~tiered_kv.integrations.hf.ByteTokenizer`); ``--model DIR`` loads a local model directory
and its tokenizer)::

    python examples/openai_server.py --port 8000 &
    python examples/openai_server.py --port 8001 --no-cache &
    python examples/chat_load_client.py --url http://127.0.0.1:8000 --baseline-url http://127.0.0.1:8001

Endpoints:

* ``POST /v1/completions`` -- ``{"prompt": [token ids] | "text", "max_tokens": 16, "temperature": 1.0,
  "top_p": 1.0, "seed": null, "stream": false}`` (absent or ``null``: these defaults). The answer is
  OpenAI's ``text_completion`` plus ``choices[0].token_ids`` and a ``tiered_kv`` object (``tokens_reused``,
  ``blocks_from``, ``ttft_ms``); ``usage.prompt_tokens_details.cached_tokens`` is the number of prompt tokens
  reused from the cache (OpenAI's and vLLM's field). ``"stream": true`` sends server-sent events, one
  ``text_completion`` chunk per token, the last with ``usage``, then ``data: [DONE]``.
* ``POST /v1/chat/completions`` -- ``messages`` through the tokenizer's chat template (a ``--model DIR``
  whose tokenizer has none: 404 with the reason).
* ``GET /v1/models``, ``GET /healthz``, ``GET /metrics`` (Prometheus text: requests by status, TTFT
  histogram, queue; the cache's metrics too when ``prometheus-client`` is installed).

Bad requests get ``400`` with a one-line reason (OpenAI's error object, :mod:`openai_protocol`); a ``model``
other than the served one ``404`` (``code: "model_not_found"``); a full queue ``429`` and a full GPU tier
``503``, both with ``Retry-After`` (back-pressure: at most ``--max-concurrency`` generations run,
``--max-queue`` wait).
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

import numpy as np
import torch
from aiohttp import web
from openai_protocol import (
    ApiError,
    Completion,
    ServerConfig,
    api_error_response,
    chat_prompt,
    check_model,
    chunk,
    error_response,
    event,
    json_body,
    parse_completion,
    usage,
)

from tiered_kv import CacheFullError, TieredKVCache, TieredKVError
from tiered_kv.integrations.hf import ByteTokenizer, CachedGenerator, layout_for, random_causal_lm, tiny_llama_config
from tiered_kv.integrations.hf.model import cache_kwargs

log = logging.getLogger("tiered_kv.examples.openai_server")

TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


# ------------------------------------------------------------------------------------------ generators


class PlainGenerator:
    """The same model through plain transformers (a full-prompt prefill per request): the ``--no-cache`` baseline."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.device = next(model.parameters()).device
        self._executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="plain-model")

    async def stream(
        self, prompt: np.ndarray, max_new_tokens: int, temperature: float, top_p: float, seed: int | None
    ) -> AsyncIterator[tuple[int, dict[str, Any]]]:
        from transformers.cache_utils import DynamicCache

        loop = asyncio.get_running_loop()
        kv = DynamicCache()
        generator = torch.Generator(device=self.device)
        if seed is not None:
            generator.manual_seed(seed)
        feed = torch.from_numpy(prompt).reshape(1, -1)
        for i in range(max_new_tokens):

            def step(feed: torch.Tensor = feed) -> int:
                with torch.inference_mode():
                    logits = self.model(
                        input_ids=feed.to(self.device), **cache_kwargs(self.model, kv), use_cache=True, logits_to_keep=1
                    ).logits[0, -1]
                    return _pick(logits, temperature, top_p, generator)

            token = await asyncio.shield(loop.run_in_executor(self._executor, step))
            yield token, {"tokens_reused": 0, "blocks_from": {}}
            if i + 1 < max_new_tokens:
                feed = torch.tensor([[token]])

    def close(self) -> None:
        self._executor.shutdown(wait=False)


def _pick(logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator) -> int:
    if temperature == 0:
        return int(logits.argmax().item())
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p < 1:
        sorted_probs, order = torch.sort(probs, descending=True)
        drop = sorted_probs.cumsum(0) - sorted_probs > top_p
        probs = torch.zeros_like(probs).scatter(0, order, sorted_probs.masked_fill(drop, 0.0))
    return int(torch.multinomial(probs, 1, generator=generator).item())


class CachedStream:
    """Adapts :meth:`CachedGenerator.stream` to the server's ``(token, info)`` stream."""

    def __init__(self, generator: CachedGenerator) -> None:
        self.generator = generator

    async def stream(
        self, prompt: np.ndarray, max_new_tokens: int, temperature: float, top_p: float, seed: int | None
    ) -> AsyncIterator[tuple[int, dict[str, Any]]]:
        stream = self.generator.stream(
            prompt, max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, seed=seed
        )
        info: dict[str, Any] = {}
        try:
            async for token in stream:
                yield token, info
            result = stream.result
            if result is not None:
                info.update(tokens_reused=result.tokens_reused, blocks_from=result.blocks_from)
        finally:
            await stream.aclose()

    def close(self) -> None:
        self.generator.close()


# ------------------------------------------------------------------------------------------ the app


class Server:
    """State behind the handlers: the generator, back-pressure and counters."""

    def __init__(
        self,
        source: CachedStream | PlainGenerator,
        model: Any,
        config: ServerConfig,
        tokenizer: Any = None,
        cache: TieredKVCache | None = None,
    ) -> None:
        self.source = source
        self.model = model
        self.config = config
        self.tokenizer = tokenizer
        self.cache = cache
        self.vocab = int(model.config.get_text_config(decoder=True).vocab_size)
        self.running = asyncio.Semaphore(config.max_concurrency)
        self.waiting = 0
        self.status_counts: dict[int, int] = {}
        self.ttft_counts = [0] * (len(TTFT_BUCKETS) + 1)
        self.ttft_sum = 0.0
        self.tokens_out = 0

    def count(self, status: int) -> None:
        self.status_counts[status] = self.status_counts.get(status, 0) + 1

    def observe_ttft(self, seconds: float) -> None:
        i = next((k for k, b in enumerate(TTFT_BUCKETS) if seconds <= b), len(TTFT_BUCKETS))
        self.ttft_counts[i] += 1
        self.ttft_sum += seconds


SERVER: web.AppKey[Server] = web.AppKey("server", Server)


async def _generate(request: web.Request, chat: bool) -> web.StreamResponse:
    server = request.app[SERVER]
    try:
        body = await json_body(request)
        check_model(body, server.config)
        if chat:
            prompt = chat_prompt(server.tokenizer, body)
        else:
            if "prompt" not in body:
                raise ApiError("'prompt' is required", param="prompt")
            prompt = body["prompt"]
        completion = parse_completion(body, prompt, server.vocab, server.config, server.tokenizer)
    except ApiError as exc:
        server.count(exc.status)
        return api_error_response(exc)
    if server.waiting >= server.config.max_queue:
        server.count(429)
        return error_response(
            429, f"server busy: {server.waiting} requests already waiting", "overloaded", {"Retry-After": "1"}
        )
    server.waiting += 1
    try:
        await server.running.acquire()
    finally:
        server.waiting -= 1
    try:
        return await _respond(request, server, completion, chat)
    finally:
        server.running.release()


async def _respond(request: web.Request, server: Server, c: Completion, chat: bool) -> web.StreamResponse:
    cid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
    created = int(time.time())
    obj = "chat.completion.chunk" if chat else "text_completion"
    model = server.config.model_name
    tok = server.tokenizer
    t0 = time.perf_counter()
    tokens: list[int] = []
    info: dict[str, Any] = {}
    response: web.StreamResponse | None = None
    ttft = 0.0
    try:
        async for token, step_info in server.source.stream(c.prompt, c.max_tokens, c.temperature, c.top_p, c.seed):
            info = step_info  # the last one carries the reuse figures
            if not tokens:
                ttft = time.perf_counter() - t0
                server.observe_ttft(ttft)
            tokens.append(token)
            if c.stream:
                if response is None:
                    response = web.StreamResponse(
                        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
                    )
                    await response.prepare(request)
                text = tok.decode([token]) if tok is not None else f" {token}"
                await response.write(event(chunk(cid, created, model, obj, token, text, None, chat, len(tokens) == 1)))
                if request.transport is None or request.transport.is_closing():
                    server.count(499)  # the client went away: stop generating (the sequence is freed)
                    return response
    except asyncio.CancelledError:
        server.count(499)  # the client went away and aiohttp cancelled the handler (the sequence is freed)
        raise
    except ConnectionError:  # a write to a client that went away: stop (leaving the loop freed the sequence)
        server.count(499)
        return response if response is not None else web.Response(status=499)
    except CacheFullError as exc:
        server.count(503)
        if response is None:
            return error_response(
                503, f"no room in the GPU tier now ({exc}); retry", "overloaded", {"Retry-After": "1"}
            )
        raise
    except TieredKVError as exc:
        server.count(500)
        if response is None:
            return error_response(500, f"{type(exc).__name__}: {exc}", "server_error")
        raise
    server.tokens_out += len(tokens)
    server.count(200)
    finish = "length"
    counts = usage(len(c.prompt), len(tokens), int(info.get("tokens_reused", 0)))
    extra = {
        "tokens_reused": info.get("tokens_reused", 0),
        "blocks_from": info.get("blocks_from", {}),
        "ttft_ms": ttft * 1e3,
    }
    if c.stream:
        assert response is not None
        last = chunk(cid, created, model, obj, -1, "", finish, chat)
        last["usage"] = counts
        last["tiered_kv"] = extra
        await response.write(event(last) + b"data: [DONE]\n\n")
        await response.write_eof()
        return response
    text = tok.decode(tokens) if tok is not None else "".join(f" {t}" for t in tokens)
    if chat:
        choice: dict[str, Any] = {
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "token_ids": tokens,
            "finish_reason": finish,
        }
    else:
        choice = {"index": 0, "text": text, "token_ids": tokens, "finish_reason": finish}
    return web.json_response(
        {
            "id": cid,
            "object": "chat.completion" if chat else "text_completion",
            "created": created,
            "model": model,
            "choices": [choice],
            "usage": counts,
            "tiered_kv": extra,
        }
    )


async def completions(request: web.Request) -> web.StreamResponse:
    """``POST /v1/completions``. Cancellation (the client went away): the generation stops, its sequence is freed."""
    return await _generate(request, chat=False)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    """``POST /v1/chat/completions`` (needs a tokenizer with a chat template). Cancellation: as completions."""
    server = request.app[SERVER]
    tok = server.tokenizer
    if tok is None or not getattr(tok, "chat_template", None):
        server.count(404)
        return error_response(
            404, "chat completions need a local tokenizer with a chat template (start with --model DIR)", "not_found"
        )
    return await _generate(request, chat=True)


async def models(request: web.Request) -> web.Response:
    """``GET /v1/models``."""
    name = request.app[SERVER].config.model_name
    model = {"id": name, "object": "model", "created": 0, "owned_by": "tiered_kv"}
    return web.json_response({"object": "list", "data": [model]})


async def healthz(request: web.Request) -> web.Response:
    """``GET /healthz``."""
    return web.json_response({"ok": True})


async def metrics(request: web.Request) -> web.Response:
    """``GET /metrics``: Prometheus text format."""
    s = request.app[SERVER]
    lines = [
        "# HELP tiered_kv_server_requests_total Requests answered, by HTTP status.",
        "# TYPE tiered_kv_server_requests_total counter",
    ]
    lines += [f'tiered_kv_server_requests_total{{status="{code}"}} {n}' for code, n in sorted(s.status_counts.items())]
    lines += [
        "# HELP tiered_kv_server_ttft_seconds Time to first token.",
        "# TYPE tiered_kv_server_ttft_seconds histogram",
    ]
    cumulative = 0
    for bound, n in zip((*TTFT_BUCKETS, float("inf")), s.ttft_counts, strict=True):
        cumulative += n
        le = "+Inf" if bound == float("inf") else repr(bound)
        lines.append(f'tiered_kv_server_ttft_seconds_bucket{{le="{le}"}} {cumulative}')
    lines += [
        f"tiered_kv_server_ttft_seconds_sum {s.ttft_sum}",
        f"tiered_kv_server_ttft_seconds_count {cumulative}",
        "# TYPE tiered_kv_server_queued gauge",
        f"tiered_kv_server_queued {s.waiting}",
        "# TYPE tiered_kv_server_generated_tokens_total counter",
        f"tiered_kv_server_generated_tokens_total {s.tokens_out}",
    ]
    text = "\n".join(lines) + "\n"
    if s.cache is not None:
        try:
            from prometheus_client import CollectorRegistry, generate_latest

            from tiered_kv.metrics import register_prometheus
        except ImportError:
            text += "# the cache's metrics need prometheus-client: pip install 'tiered-kv[metrics]'\n"
        else:
            registry = CollectorRegistry()
            register_prometheus(s.cache, registry=registry)
            text += generate_latest(registry).decode()
    return web.Response(text=text, content_type="text/plain")


def make_app(server: Server) -> web.Application:
    """The aiohttp application (bodies up to 1 MiB)."""
    app = web.Application(client_max_size=1 << 20)
    app[SERVER] = server
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/metrics", metrics)
    return app


def load_model(path: str | None, device: torch.device, seed: int = 0) -> tuple[Any, Any]:
    """``(model, tokenizer)``: a local model directory (no download), or the default random Llama.

    The default model's tokenizer is a :class:`ByteTokenizer` (UTF-8 bytes and a ChatML chat template).
    """
    if path is None:
        return random_causal_lm(
            tiny_llama_config(layers=4, hidden=256, heads=4, kv_heads=2, intermediate=512, vocab=4096),
            device=device,
            seed=seed,
        ), ByteTokenizer()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True).to(device).eval()
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError):
        tokenizer = None
    return model, tokenizer


async def serve(args: argparse.Namespace, ready: Callable[[int], None] | None = None) -> None:
    """Run the server until cancelled. Cancellation: the site stops, the cache closes."""
    device = torch.device(
        "cuda"
        if args.device == "auto" and torch.cuda.is_available()
        else ("cpu" if args.device == "auto" else args.device)
    )
    model, tokenizer = load_model(args.model, device)
    config = ServerConfig(
        max_concurrency=args.max_concurrency,
        max_queue=args.max_queue,
        max_context=min(args.gpu_blocks * 16, int(getattr(model.config, "max_position_embeddings", 4096))),
    )
    cache: TieredKVCache | None = None
    if args.no_cache:
        source: CachedStream | PlainGenerator = PlainGenerator(model)
    else:
        cache = TieredKVCache(
            layout_for(model),
            gpu_blocks=args.gpu_blocks,
            host_blocks=args.host_blocks,
            file_blocks=args.file_blocks,
            file_dir=args.dir if args.file_blocks else None,
            device=str(device) if device.type == "cuda" else "cpu",
            max_seqs=max(64, args.max_concurrency),
        )
        await cache.__aenter__()
        source = CachedStream(CachedGenerator(model, cache))
    runner = web.AppRunner(make_app(Server(source, model, config, tokenizer, cache)))
    await runner.setup()
    site = web.TCPSite(runner, args.host, args.port)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    log.warning("serving on http://%s:%d (%s)", args.host, port, "no cache" if args.no_cache else "tiered_kv cache")
    if ready is not None:
        ready(port)
    try:
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()
        source.close()
        if cache is not None:
            await cache.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--model", help="a local transformers model directory (default: a random Llama from a config)")
    parser.add_argument("--device", default="auto", help="auto | cpu | cuda[:N]")
    parser.add_argument("--no-cache", action="store_true", help="plain transformers, no tiered_kv (the baseline)")
    parser.add_argument("--gpu-blocks", type=int, default=512)
    parser.add_argument("--host-blocks", type=int, default=2048)
    parser.add_argument("--file-blocks", type=int, default=0)
    parser.add_argument("--dir", help="directory of the file tier (with --file-blocks)")
    parser.add_argument("--max-concurrency", type=int, default=8)
    parser.add_argument("--max-queue", type=int, default=64)
    args = parser.parse_args()
    if args.file_blocks and not args.dir:
        parser.error("--file-blocks needs --dir")
    try:
        import uvloop

        uvloop.run(serve(args))
    except ImportError:
        asyncio.run(serve(args))
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
