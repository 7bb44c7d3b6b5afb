"""OpenAI's dialect for ``openai_server.py``: request validation, error objects, usage and stream chunks.

What a request may hold (anything else OpenAI's clients send is accepted and ignored):

* ``model``: the served model's name, or left out; another name is ``404`` with OpenAI's
  ``model_not_found`` error.
* ``prompt`` (``/v1/completions``): a list of token ids or a string (through the server's tokenizer).
* ``messages`` (``/v1/chat/completions``): ``role`` (system, developer, user, assistant) and ``content``
  (a string, or a list of ``{"type": "text", "text": ...}`` parts), through the tokenizer's chat template.
* ``max_tokens`` (or ``max_completion_tokens``): 1 to the server's limit; absent or ``null``:
  :data:`DEFAULT_MAX_TOKENS`. ``temperature``, ``top_p``, ``seed``, ``n`` (1), ``stream``: absent or ``null``
  take their defaults.

Every refusal is an :class:`ApiError` (400 unless it says otherwise) answered as OpenAI's error object
``{"error": {"message", "type", "param", "code"}}`` with a one-line message.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import numpy as np
from aiohttp import web

MAX_JSON_DEPTH = 32
#: ``max_tokens`` when a request leaves it out or sends ``null`` (OpenAI's default for completions)
DEFAULT_MAX_TOKENS = 16
ROLES = ("system", "developer", "user", "assistant")


class ApiError(Exception):
    """A request the server refuses, with OpenAI's error fields.

    Args:
        message: one line saying why.
        status: the HTTP status (400: a bad request).
        kind: the error's ``type``. param: the request field at fault. code: a machine-readable code.
    """

    def __init__(
        self,
        message: str,
        status: int = 400,
        kind: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.kind, self.param, self.code = status, kind, param, code


BadRequest = ApiError


@dataclasses.dataclass(frozen=True, slots=True)
class ServerConfig:
    """Limits of the server.

    Attributes:
        model_name: the name answered in ``model`` fields (and accepted in requests).
        max_tokens_limit: largest ``max_tokens`` accepted.
        max_concurrency: generations running at once; ``max_queue``: requests waiting for one (then 429).
        max_context: prompt plus ``max_tokens`` at most (the model's positions and a sequence's blocks).
    """

    model_name: str = "tiered-kv-random-llama"
    max_tokens_limit: int = 1024
    max_concurrency: int = 8
    max_queue: int = 64
    max_context: int = 4096


def error_response(
    status: int,
    message: str,
    kind: str = "invalid_request_error",
    headers: dict[str, str] | None = None,
    param: str | None = None,
    code: str | None = None,
) -> web.Response:
    """OpenAI's error object."""
    return web.json_response(
        {"error": {"message": message, "type": kind, "param": param, "code": code}}, status=status, headers=headers
    )


def api_error_response(exc: ApiError) -> web.Response:
    """The response for a refused request."""
    return error_response(exc.status, str(exc), exc.kind, param=exc.param, code=exc.code)


def _depth(value: Any, limit: int) -> int:
    stack = [(value, 1)]
    deepest = 0
    while stack:
        item, d = stack.pop()
        deepest = max(deepest, d)
        if deepest > limit:
            return deepest
        if isinstance(item, dict):
            stack.extend((v, d + 1) for v in item.values())
        elif isinstance(item, list):
            stack.extend((v, d + 1) for v in item)
    return deepest


async def json_body(request: web.Request) -> dict[str, Any]:
    """The request's JSON object; ``ApiError`` when it is not one (or is nested too deeply)."""
    raw = await request.read()
    if raw.count(b"[") + raw.count(b"{") > 100_000:
        raise BadRequest("the JSON body has too many nested values")
    try:
        body = json.loads(raw)
    except RecursionError:
        raise BadRequest(f"the JSON body is nested too deeply (at most {MAX_JSON_DEPTH} levels)") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise BadRequest(f"the body is not valid JSON ({str(exc).splitlines()[0]})") from None
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object")
    if _depth(body, MAX_JSON_DEPTH) > MAX_JSON_DEPTH:
        raise BadRequest(f"the JSON body is nested too deeply (at most {MAX_JSON_DEPTH} levels)")
    return body


def _number(body: dict[str, Any], name: str, default: float, lo: float, hi: float, *, lo_open: bool = False) -> float:
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
        raise BadRequest(f"'{name}' must be a number", param=name)
    if value < lo or value > hi or (lo_open and value == lo):
        raise BadRequest(f"'{name}' must be in {'(' if lo_open else '['}{lo}, {hi}], got {value}", param=name)
    return float(value)


@dataclasses.dataclass(frozen=True, slots=True)
class Completion:
    """A validated request: the prompt's token ids and the sampling settings."""

    prompt: np.ndarray
    max_tokens: int
    temperature: float
    top_p: float
    seed: int | None
    stream: bool


def check_model(body: dict[str, Any], config: ServerConfig) -> None:
    """``404`` (OpenAI's ``model_not_found``) unless ``model`` is absent, ``null`` or the served model."""
    model = body.get("model")
    if model is not None and model != config.model_name:
        raise ApiError(
            f"The model '{str(model)[:80]}' does not exist (this server serves '{config.model_name}')",
            status=404,
            param="model",
            code="model_not_found",
        )


def parse_completion(body: dict[str, Any], prompt: Any, vocab: int, config: ServerConfig, tokenizer: Any) -> Completion:
    """Validate a completion request; ``ApiError`` with a one-line reason when it cannot be served."""
    check_model(body, config)
    if isinstance(prompt, str):
        if tokenizer is None:
            raise BadRequest("this server has no tokenizer: send 'prompt' as a list of token ids", param="prompt")
        ids = list(tokenizer.encode(prompt))
    elif isinstance(prompt, list):
        if prompt and isinstance(prompt[0], list):
            raise BadRequest("one prompt per request: 'prompt' must be a list of token ids or a string", param="prompt")
        ids = prompt
    else:
        raise BadRequest("'prompt' must be a list of token ids or a string", param="prompt")
    if not ids:
        raise BadRequest("'prompt' is empty", param="prompt")
    for t in ids:
        if isinstance(t, bool) or not isinstance(t, int):
            raise BadRequest(f"'prompt' must hold integer token ids, got {type(t).__name__}", param="prompt")
        if not 0 <= t < vocab:
            raise BadRequest(
                f"token id {t if abs(t) < 10**30 else str(t)[:30] + '...'} is outside the vocabulary [0, {vocab})",
                param="prompt",
            )
    max_tokens = body.get("max_tokens")
    if max_tokens is None:
        max_tokens = body.get("max_completion_tokens")
    if max_tokens is None:
        max_tokens = DEFAULT_MAX_TOKENS
    if (
        isinstance(max_tokens, bool)
        or not isinstance(max_tokens, int)
        or not 1 <= max_tokens <= config.max_tokens_limit
    ):
        raise BadRequest(f"'max_tokens' must be an integer in [1, {config.max_tokens_limit}]", param="max_tokens")
    if len(ids) + max_tokens > config.max_context:
        raise BadRequest(
            f"the prompt ({len(ids)} tokens) plus max_tokens ({max_tokens}) exceeds the context of "
            f"{config.max_context} tokens"
        )
    n = body.get("n")
    if n is not None and n != 1:
        raise BadRequest("'n' must be 1 (one completion per request)", param="n")
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise BadRequest("'stream' must be true or false", param="stream")
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63):
        raise BadRequest("'seed' must be an integer in [0, 2**63)", param="seed")
    return Completion(
        prompt=np.asarray(ids, dtype=np.int64),
        max_tokens=max_tokens,
        temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
        top_p=_number(body, "top_p", 1.0, 0.0, 1.0, lo_open=True),
        seed=seed,
        stream=bool(stream),
    )


def _text(content: Any) -> str | None:
    """A message's text: a string, or the concatenated ``text`` of a list of text parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(
        isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content
    ):
        return "".join(p["text"] for p in content)
    return None


def chat_prompt(tokenizer: Any, body: dict[str, Any]) -> list[int]:
    """The token ids of a chat request's ``messages`` through the tokenizer's chat template."""
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise BadRequest("this server has no tokenizer with a chat template; use /v1/completions with token ids")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' must be a non-empty list", param="messages")
    plain: list[dict[str, str]] = []
    for m in messages:
        text = _text(m.get("content")) if isinstance(m, dict) else None
        if text is None or m.get("role") not in ROLES:
            raise BadRequest(
                f"each message needs a 'role' ({', '.join(ROLES)}) and a 'content' string (or text parts)",
                param="messages",
            )
        plain.append({"role": m["role"], "content": text})
    try:
        ids = tokenizer.apply_chat_template(plain, add_generation_prompt=True, tokenize=True)
    except Exception as exc:  # a template that refuses these messages (a role it does not know, say)
        raise BadRequest(f"the chat template refused the messages: {str(exc).splitlines()[0][:200]}") from None
    if hasattr(ids, "keys"):  # transformers 5 returns a BatchEncoding
        ids = ids["input_ids"]
    return [int(i) for i in ids]


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    """OpenAI's ``usage``; ``prompt_tokens_details.cached_tokens``: prompt tokens served from the cache."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def chunk(
    cid: str,
    created: int,
    model: str,
    obj: str,
    token: int,
    text: str,
    finish: str | None,
    chat: bool,
    first: bool = False,
) -> dict[str, Any]:
    """One server-sent event's payload: a token (``token < 0``: none, the closing chunk)."""
    if chat:
        delta: dict[str, Any] = {"role": "assistant"} if first else {}
        if text:
            delta["content"] = text
        choice: dict[str, Any] = {
            "index": 0,
            "delta": delta,
            "token_ids": [token] if token >= 0 else [],
            "finish_reason": finish,
        }
    else:
        choice = {"index": 0, "text": text, "token_ids": [token] if token >= 0 else [], "finish_reason": finish}
    return {"id": cid, "object": obj, "created": created, "model": model, "choices": [choice]}


def event(payload: dict[str, Any]) -> bytes:
    """``data: <json>`` and the blank line that ends a server-sent event."""
    return f"data: {json.dumps(payload)}\n\n".encode()
