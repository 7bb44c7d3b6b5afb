"""The default server of examples/openai_server.py (random Llama, nothing downloaded) speaks OpenAI's dialect.

Checked with the official ``openai`` client where it is installed, and always with raw HTTP shaped like that
client's requests: text prompts and chat messages through the built-in byte-level tokenizer, ``"max_tokens":
null``, an unknown model (404, OpenAI's error object) and ``usage.prompt_tokens_details.cached_tokens``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import pathlib
import sys
from collections.abc import AsyncIterator
from typing import Any

import pytest

aiohttp = pytest.importorskip("aiohttp", reason="the server example needs the [test] extra (aiohttp)")
pytest.importorskip("transformers")

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "examples"))

from openai_server import serve  # noqa: E402

from tiered_kv.integrations.hf.tokenizer import IM_END, IM_START, ByteTokenizer  # noqa: E402

MODEL = "tiered-kv-random-llama"
SYSTEM = "You are a cache that remembers every prefix it has seen, block by block."  # > 4 blocks of 16 tokens
HEADERS = {"Content-Type": "application/json", "Authorization": "Bearer unused"}


@pytest.fixture
async def url() -> AsyncIterator[str]:
    args = argparse.Namespace(
        host="127.0.0.1", port=0, model=None, device="cpu", no_cache=False, gpu_blocks=64, host_blocks=64,
        file_blocks=0, dir=None, max_concurrency=2, max_queue=8,
    )
    ready: asyncio.Future[int] = asyncio.get_running_loop().create_future()
    task = asyncio.create_task(serve(args, ready.set_result))
    port = await asyncio.wait_for(ready, 120)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


def test_the_byte_tokenizer_round_trips_text_and_frames_a_chat() -> None:
    tok = ByteTokenizer()
    assert tok.decode(tok.encode("héllo <|im_end|>")) == "héllo <|im_end|>"
    assert IM_END not in tok.encode("<|im_end|>")  # text never encodes to a special token
    ids = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True)
    assert isinstance(ids, list)
    assert tok.decode(ids) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n" and ids[0] == IM_START
    assert tok.decode([4000]) == "\ufffd"
    with pytest.raises(ValueError, match="role"):
        tok.apply_chat_template([{"role": "robot", "content": "hi"}])


async def _post(session: Any, url: str, path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    async with session.post(f"{url}/v1/{path}", data=json.dumps(body), headers=HEADERS) as r:
        return r.status, await r.json()


async def test_raw_http_shaped_like_the_openai_client(url: str) -> None:
    tok = ByteTokenizer()
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Which blocks?"}]
    async with aiohttp.ClientSession() as session:
        status, text = await _post(session, url, "completions",
                                   {"model": MODEL, "prompt": SYSTEM, "max_tokens": None, "temperature": 0})
        assert status == 200, text
        assert text["usage"]["completion_tokens"] == 16  # null takes the default
        assert text["usage"]["prompt_tokens"] == len(SYSTEM.encode())
        assert text["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
        status, again = await _post(session, url, "completions",
                                    {"model": MODEL, "prompt": SYSTEM, "max_tokens": 2, "temperature": 0})
        reused = again["tiered_kv"]["tokens_reused"]
        assert status == 200 and reused >= 48 and again["usage"]["prompt_tokens_details"]["cached_tokens"] == reused

        body = {"model": MODEL, "messages": messages, "max_tokens": None, "max_completion_tokens": None,
                "temperature": 0, "stream": False}
        status, chat = await _post(session, url, "chat/completions", body)
        assert status == 200, chat
        assert chat["object"] == "chat.completion" and chat["choices"][0]["message"]["role"] == "assistant"
        assert chat["usage"]["prompt_tokens"] == len(tok.apply_chat_template(messages))
        assert chat["usage"]["completion_tokens"] == 16
        assert chat["choices"][0]["message"]["content"] == tok.decode(chat["choices"][0]["token_ids"])

        status, missing = await _post(session, url, "chat/completions", {**body, "model": "gpt-4o"})
        assert status == 404
        assert set(missing) == {"error"} and set(missing["error"]) == {"message", "type", "param", "code"}
        assert missing["error"]["code"] == "model_not_found" and missing["error"]["param"] == "model"
        assert missing["error"]["type"] == "invalid_request_error" and "gpt-4o" in missing["error"]["message"]


async def test_the_official_openai_client(url: str) -> None:
    openai = pytest.importorskip("openai")
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    try:
        models = await client.models.list()
        assert [m.id for m in models.data] == [MODEL]
        first = await client.completions.create(model=MODEL, prompt=SYSTEM, max_tokens=None, temperature=0)
        assert first.usage is not None and first.usage.completion_tokens == 16
        second = await client.completions.create(model=MODEL, prompt=SYSTEM + " Again.", max_tokens=3, temperature=0)
        assert second.usage is not None and second.usage.prompt_tokens_details is not None
        assert second.usage.prompt_tokens_details.cached_tokens >= 48

        messages: list[Any] = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hello?"}]
        chat = await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=None, temperature=0)
        assert chat.choices[0].message.role == "assistant" and isinstance(chat.choices[0].message.content, str)
        assert chat.usage is not None and chat.usage.completion_tokens == 16
        stream = await client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=4, temperature=0, stream=True,
            stream_options={"include_usage": True},
        )
        chunks = [c async for c in stream]
        assert sum(1 for c in chunks for ch in c.choices if ch.delta.content is not None) == 4
        last = chunks[-1].usage
        assert last is not None and last.prompt_tokens_details is not None
        assert last.prompt_tokens_details.cached_tokens >= 64  # the same chat again: its prompt came back

        with pytest.raises(openai.NotFoundError) as caught:
            await client.chat.completions.create(model="gpt-4o", messages=messages)
        assert caught.value.status_code == 404 and caught.value.code == "model_not_found"
    finally:
        await client.close()
