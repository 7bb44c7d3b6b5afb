"""examples/openai_server.py answers real HTTP with a real model; replies are identical with and without the cache."""

from __future__ import annotations

import asyncio
import pathlib
import sys
from collections.abc import AsyncIterator
from typing import Any

import pytest

aiohttp = pytest.importorskip("aiohttp", reason="the server example needs the [test] extra (aiohttp)")
pytest.importorskip("transformers")
from aiohttp import web  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "examples"))

from chat_load_client import ChatLoad, compare, run_load  # noqa: E402
from openai_server import CachedStream, PlainGenerator, Server, ServerConfig, make_app  # noqa: E402

from tiered_kv import TieredKVCache  # noqa: E402
from tiered_kv.integrations.hf import CachedGenerator, layout_for, random_causal_lm, tiny_llama_config  # noqa: E402  # noqa: E402

VOCAB = 512


@pytest.fixture(scope="module")
def model() -> Any:
    return random_causal_lm(tiny_llama_config(vocab=VOCAB), seed=3)


async def _start(server: Server) -> tuple[web.AppRunner, str]:
    runner = web.AppRunner(make_app(server))
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return runner, f"http://127.0.0.1:{port}"


@pytest.fixture
async def servers(model: Any) -> AsyncIterator[tuple[str, str, Server]]:
    config = ServerConfig(max_context=1024, max_concurrency=4)
    async with TieredKVCache(layout_for(model), gpu_blocks=128, host_blocks=256, device="cpu") as cache:
        cached = Server(CachedStream(CachedGenerator(model, cache)), model, config, cache=cache)
        plain = Server(PlainGenerator(model), model, config)
        (r1, url1), (r2, url2) = await _start(cached), await _start(plain)
        try:
            yield url1, url2, cached
        finally:
            await r1.cleanup()
            await r2.cleanup()
            cached.source.close()
            plain.source.close()


async def test_chat_load_replies_identically_with_and_without_the_cache(servers):
    url, baseline_url, _ = servers
    load = ChatLoad(
        conversations=4,
        turns=3,
        system_prompts=2,
        system_tokens=64,
        user_tokens=(8, 24),
        max_tokens=6,
        concurrency=2,
        vocab=VOCAB,
    )
    with_cache = await run_load(url, load)
    without = await run_load(baseline_url, load)
    assert with_cache.requests == without.requests == 12
    assert compare(with_cache, without) == []
    assert all(len(reply) == 6 for conv in with_cache.replies for reply in conv)
    assert with_cache.tokens_reused > 0 and without.tokens_reused == 0
    assert with_cache.summary()["reused_fraction"] > 0.3  # system prompts and earlier turns come back
    async with aiohttp.ClientSession() as session:
        async with session.get(f"{url}/metrics") as r:
            text = await r.text()
    assert r.status == 200 and 'tiered_kv_server_requests_total{status="200"} 12' in text
    assert "tiered_kv_server_ttft_seconds_count 12" in text and "tiered_kv_cache_hit_blocks_total" in text


async def test_a_plain_completion_and_the_small_endpoints(servers):
    url, _, _ = servers
    async with aiohttp.ClientSession() as session:
        body = {"prompt": list(range(40)), "max_tokens": 4, "temperature": 0}
        async with session.post(f"{url}/v1/completions", json=body) as r:
            first = await r.json()
        async with session.post(f"{url}/v1/completions", json=body) as r:
            second = await r.json()
        async with session.get(f"{url}/v1/models") as r:
            listed = await r.json()
        async with session.post(
            f"{url}/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]}
        ) as r:
            chat_status, chat = r.status, await r.json()
    assert first["object"] == "text_completion" and first["usage"]["completion_tokens"] == 4
    assert first["choices"][0]["token_ids"] == second["choices"][0]["token_ids"]
    assert first["choices"][0]["finish_reason"] == "length"
    assert first["tiered_kv"]["tokens_reused"] == 0 and second["tiered_kv"]["tokens_reused"] == 39
    assert listed["data"][0]["id"] == "tiered-kv-random-llama"
    assert chat_status == 404 and "chat template" in chat["error"]["message"]


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        (b"{not json", "not valid JSON"),
        (b"[1, 2]", "must be a JSON object"),
        (b'{"prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}", "nested too deeply"),
        (b'{"prompt": [1, 18446744073709551616]}', "outside the vocabulary"),
        (b'{"prompt": [1, 9223372036854775808]}', "outside the vocabulary"),
        (b'{"prompt": [-1]}', "outside the vocabulary"),
        (b'{"prompt": [512]}', "outside the vocabulary"),
        (b'{"prompt": [1.5]}', "integer token ids"),
        (b'{"prompt": [true]}', "integer token ids"),
        (b'{"prompt": []}', "is empty"),
        (b'{"prompt": "hello"}', "no tokenizer"),
        (b'{"max_tokens": 3}', "'prompt' is required"),
        (b'{"prompt": [1], "max_tokens": 0}', "'max_tokens' must be"),
        (b'{"prompt": [1, 2], "max_tokens": 1023}', "exceeds the context of 1024"),
        (b'{"prompt": [1], "n": 2}', "'n' must be 1"),
        (b'{"prompt": [1], "stream": "yes"}', "'stream' must be"),
        (b'{"prompt": [1], "temperature": 9}', "'temperature' must be in"),
        (b'{"prompt": [1], "top_p": 0}', "'top_p' must be in"),
        (b'{"prompt": [1], "seed": 18446744073709551616}', "'seed' must be"),
    ],
)
async def test_bad_requests_get_400_with_a_one_line_reason(servers, body, reason):
    url, _, server = servers
    async with aiohttp.ClientSession() as session:
        async with session.post(f"{url}/v1/completions", data=body, headers={"Content-Type": "application/json"}) as r:
            status, answer = r.status, await r.json()
    message = answer["error"]["message"]
    assert status == 400 and reason in message and "\n" not in message, message
    assert server.cache is not None and server.cache.statistics().requests == 0  # nothing was admitted


async def test_a_full_queue_answers_429_and_a_client_that_leaves_frees_its_sequence(model):
    config = ServerConfig(max_context=1024, max_concurrency=1, max_queue=1)
    async with TieredKVCache(layout_for(model), gpu_blocks=128, device="cpu") as cache:
        server = Server(CachedStream(CachedGenerator(model, cache)), model, config, cache=cache)
        runner, url = await _start(server)
        try:
            async with aiohttp.ClientSession() as session:
                long = {"prompt": list(range(30)), "max_tokens": 400, "temperature": 0, "stream": True}
                running = await session.post(f"{url}/v1/completions", json=long)
                await running.content.readline()  # it streams: it holds the only generation slot
                waiting = asyncio.create_task(
                    session.post(f"{url}/v1/completions", json={"prompt": [1, 2], "max_tokens": 1})
                )
                while server.waiting < 1:  # noqa: ASYNC110 - polls the server's queue counter
                    await asyncio.sleep(0.005)
                async with session.post(f"{url}/v1/completions", json={"prompt": [1], "max_tokens": 1}) as r:
                    assert r.status == 429 and r.headers["Retry-After"] == "1"
                    assert "busy" in (await r.json())["error"]["message"]
                running.close()  # the client goes away mid-stream
                answer = await waiting
                assert answer.status == 200
                answer.close()
            for _ in range(3000):  # the server notices at its next write, then waits for the running forward
                if not cache.blocks.live_sequences:
                    break
                await asyncio.sleep(0.01)
            assert server.status_counts.get(499) == 1  # it stopped generating for the client that left
            assert cache.blocks.live_sequences == ()
        finally:
            await runner.cleanup()
            server.source.close()


def _word_tokenizer() -> Any:
    """An offline tokenizer with a chat template (word level, built here: nothing downloaded)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["[UNK]", "<|", "|>", "system", "user", "assistant", "hello", "there", "you", "are", "a", "cache", "."]
    words += [f"w{i}" for i in range(VOCAB - len(words))]
    core = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    template = "{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} {% endfor %}<|assistant|>"
    return PreTrainedTokenizerFast(tokenizer_object=core, unk_token="[UNK]", chat_template=template)


async def test_chat_completions_and_text_prompts_with_a_local_chat_template(model):
    tokenizer = _word_tokenizer()
    async with TieredKVCache(layout_for(model), gpu_blocks=64, device="cpu") as cache:
        server = Server(
            CachedStream(CachedGenerator(model, cache)), model, ServerConfig(max_context=1024), tokenizer, cache
        )
        runner, url = await _start(server)
        messages = [{"role": "system", "content": "you are a cache ."}, {"role": "user", "content": "hello there"}]
        try:
            async with aiohttp.ClientSession() as session:
                body = {"messages": messages, "max_tokens": 5, "temperature": 0}
                async with session.post(f"{url}/v1/chat/completions", json=body) as r:
                    first = await r.json()
                async with session.post(f"{url}/v1/chat/completions", json={**body, "stream": True}) as r:
                    chunks = [line for line in (await r.text()).splitlines() if line.startswith("data: ")]
                async with session.post(f"{url}/v1/completions", json={"prompt": "hello there", "max_tokens": 2,
                                                                       "temperature": 0}) as r:
                    text = await r.json()
                async with session.post(f"{url}/v1/chat/completions", json={"messages": [{"role": "x"}]}) as r:
                    bad = r.status, (await r.json())["error"]["message"]
        finally:
            await runner.cleanup()
            server.source.close()
    assert first["object"] == "chat.completion" and first["choices"][0]["message"]["role"] == "assistant"
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    assert first["usage"]["prompt_tokens"] == len(ids) and len(first["choices"][0]["token_ids"]) == 5
    assert first["choices"][0]["message"]["content"] == tokenizer.decode(first["choices"][0]["token_ids"])
    assert chunks[-1] == "data: [DONE]"
    streamed = [t for c in chunks[:-1] for t in __import__("json").loads(c[6:])["choices"][0]["token_ids"]]
    assert streamed == first["choices"][0]["token_ids"]  # the second request reused the first's prompt
    assert text["usage"]["prompt_tokens"] == 2 and len(text["choices"][0]["token_ids"]) == 2
    assert bad[0] == 400 and "role" in bad[1]
