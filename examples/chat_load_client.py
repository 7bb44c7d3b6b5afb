"""Load client for ``openai_server.py``: multi-turn chats with shared system prompts, with and without the cache.

Each conversation starts with one of a few shared system prompts; every turn sends the whole conversation
so far (the server's own earlier replies included) plus a new user message, streamed (server-sent events),
greedy (``temperature 0``) so the replies are deterministic. Conversations run concurrently; the turns of one
conversation one after another. It reports TTFT and per-request latency percentiles and throughput; with
``--baseline-url`` (a ``--no-cache`` server) it replays the same chats there and checks every reply is
identical::

    python examples/chat_load_client.py --url http://127.0.0.1:8000 --baseline-url http://127.0.0.1:8001
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import time
from typing import Any

import aiohttp
import numpy as np


@dataclasses.dataclass(frozen=True, slots=True)
class ChatLoad:
    """The chats to replay (the same seed gives the same user messages everywhere)."""

    conversations: int = 16
    turns: int = 3
    system_prompts: int = 2
    system_tokens: int = 256
    user_tokens: tuple[int, int] = (16, 64)
    max_tokens: int = 16
    concurrency: int = 4
    vocab: int = 4096
    seed: int = 0


@dataclasses.dataclass(frozen=True, slots=True)
class LoadReport:
    """One replay: per-request figures and every reply (``replies[conversation][turn]``)."""

    url: str
    requests: int
    seconds: float
    ttft_s: list[float]
    latency_s: list[float]
    tokens_out: int
    tokens_reused: int
    prompt_tokens: int
    replies: list[list[list[int]]]

    def summary(self) -> dict[str, Any]:
        """Percentiles and throughput."""

        def pct(values: list[float], q: int) -> float:
            return float(np.percentile(values, q)) if values else float("nan")

        return {
            "url": self.url,
            "requests": self.requests,
            "seconds": round(self.seconds, 3),
            "ttft_ms_p50": pct(self.ttft_s, 50) * 1e3,
            "ttft_ms_p90": pct(self.ttft_s, 90) * 1e3,
            "ttft_ms_p99": pct(self.ttft_s, 99) * 1e3,
            "latency_ms_p50": pct(self.latency_s, 50) * 1e3,
            "latency_ms_p99": pct(self.latency_s, 99) * 1e3,
            "requests_per_s": self.requests / self.seconds,
            "tokens_out_per_s": self.tokens_out / self.seconds,
            "reused_fraction": self.tokens_reused / self.prompt_tokens if self.prompt_tokens else 0.0,
        }


async def _one(
    session: aiohttp.ClientSession, url: str, prompt: list[int], max_tokens: int
) -> tuple[list[int], float, float, int]:
    """Stream one completion: ``(tokens, ttft, latency, tokens_reused)``."""
    t0 = time.perf_counter()
    ttft = 0.0
    tokens: list[int] = []
    reused = 0
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    async with session.post(f"{url}/v1/completions", json=body) as r:
        if r.status != 200:
            raise RuntimeError(f"{url}: HTTP {r.status}: {await r.text()}")
        async for raw in r.content:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            ids = chunk["choices"][0]["token_ids"]
            if ids and not tokens:
                ttft = time.perf_counter() - t0
            tokens.extend(ids)
            if "tiered_kv" in chunk:
                reused = int(chunk["tiered_kv"]["tokens_reused"])
    return tokens, ttft, time.perf_counter() - t0, reused


async def run_load(url: str, load: ChatLoad) -> LoadReport:
    """Replay the chats against ``url``; raises on any HTTP error."""
    rng = np.random.default_rng(load.seed)
    systems = [rng.integers(0, load.vocab, load.system_tokens).tolist() for _ in range(load.system_prompts)]
    users = [
        [
            rng.integers(0, load.vocab, int(rng.integers(load.user_tokens[0], load.user_tokens[1] + 1))).tolist()
            for _ in range(load.turns)
        ]
        for _ in range(load.conversations)
    ]
    replies: list[list[list[int]]] = [[] for _ in range(load.conversations)]
    ttfts: list[float] = []
    latencies: list[float] = []
    counts = {"out": 0, "reused": 0, "prompt": 0}
    gate = asyncio.Semaphore(load.concurrency)

    async def conversation(session: aiohttp.ClientSession, c: int) -> None:
        async with gate:
            history = list(systems[c % load.system_prompts])
            for turn in range(load.turns):
                prompt = history + users[c][turn]
                tokens, ttft, latency, reused = await _one(session, url, prompt, load.max_tokens)
                replies[c].append(tokens)
                ttfts.append(ttft)
                latencies.append(latency)
                counts["out"] += len(tokens)
                counts["reused"] += reused
                counts["prompt"] += len(prompt)
                history = prompt + tokens

    t0 = time.perf_counter()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:
        await asyncio.gather(*(conversation(session, c) for c in range(load.conversations)))
    seconds = time.perf_counter() - t0
    return LoadReport(
        url, len(latencies), seconds, ttfts, latencies, counts["out"], counts["reused"], counts["prompt"], replies
    )


def compare(cached: LoadReport, baseline: LoadReport) -> list[str]:
    """Conversations/turns whose replies differ (empty when every reply is identical)."""
    return [
        f"conversation {c} turn {t}"
        for c, (a, b) in enumerate(zip(cached.replies, baseline.replies, strict=True))
        for t, (x, y) in enumerate(zip(a, b, strict=True))
        if x != y
    ]


def print_reports(reports: list[LoadReport]) -> None:
    rows = [r.summary() for r in reports]
    keys = list(rows[0])
    widths = {
        k: max(len(k), *(len(f"{row[k]:.2f}" if isinstance(row[k], float) else str(row[k])) for row in rows))
        for k in keys
    }
    print("  ".join(k.rjust(widths[k]) for k in keys))
    for row in rows:
        print("  ".join((f"{row[k]:.2f}" if isinstance(row[k], float) else str(row[k])).rjust(widths[k]) for k in keys))
    if len(rows) == 2 and rows[0]["ttft_ms_p50"] > 0:
        print(f"TTFT p50 without / with the cache: {rows[1]['ttft_ms_p50'] / rows[0]['ttft_ms_p50']:.2f}x")


async def _main(args: argparse.Namespace) -> int:
    load = ChatLoad(
        conversations=args.conversations,
        turns=args.turns,
        system_tokens=args.system_tokens,
        max_tokens=args.max_tokens,
        concurrency=args.concurrency,
        vocab=args.vocab,
        seed=args.seed,
    )
    reports = [await run_load(args.url, load)]
    if args.baseline_url:
        reports.append(await run_load(args.baseline_url, load))
    print_reports(reports)
    if args.baseline_url:
        diff = compare(reports[0], reports[1])
        if diff:
            print(f"error: {len(diff)} replies differ from the baseline's: {', '.join(diff[:5])}")
            return 1
        print(f"all {reports[0].requests} replies identical with and without the cache")
    return 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--baseline-url", help="a server started with --no-cache: replay there too and compare replies")
    parser.add_argument("--conversations", type=int, default=16)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--system-tokens", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=4096, help="token ids are drawn from [0, vocab)")
    parser.add_argument("--seed", type=int, default=0)
    raise SystemExit(asyncio.run(_main(parser.parse_args())))


if __name__ == "__main__":
    main()
