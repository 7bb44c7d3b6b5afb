"""Load client for ``examples/async_server.py``: N requests of the seeded chat workload, C at a time.

Prints throughput and latency percentiles, the share of prompt tokens the server reused, and any
mismatched (wrongly reused) tokens, which must be zero::

    python examples/load_client.py --url http://127.0.0.1:8080 --requests 200 --concurrency 16
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import statistics
import time

import aiohttp

from tiered_kv.tools.workload import ChatWorkload


@dataclasses.dataclass(frozen=True, slots=True)
class LoadResult:
    requests: int
    errors: int
    seconds: float
    p50_ms: float
    p90_ms: float
    p99_ms: float
    prompt_tokens: int
    reused_tokens: int
    mismatched_tokens: int

    @property
    def requests_per_second(self) -> float:
        return self.requests / self.seconds if self.seconds else 0.0


async def run_load(url: str, requests: int, concurrency: int, *, seed: int = 0, max_new_tokens: int = 8) -> LoadResult:
    """Send the first ``requests`` turns of ``ChatWorkload(seed)``; a conversation's turns go in order."""
    workload = ChatWorkload(seed=seed, conversations=max(4, requests // 3))
    turns = [t for _, t in zip(range(requests), workload, strict=False)]
    done_turn: dict[tuple[int, int], asyncio.Event] = {(t.conversation, t.turn): asyncio.Event() for t in turns}
    gate = asyncio.Semaphore(concurrency)
    latencies: list[float] = []
    totals = {"errors": 0, "prompt": 0, "reused": 0, "mismatched": 0}

    async def one(session: aiohttp.ClientSession, turn) -> None:
        previous = done_turn.get((turn.conversation, turn.turn - 1))
        if previous is not None:
            await previous.wait()  # a follow-up is sent after the reply it follows
        async with gate:
            t0 = time.perf_counter()
            body = {"prompt": [int(x) for x in turn.prompt], "max_new_tokens": max_new_tokens}
            try:
                async with session.post(f"{url}/generate", json=body) as response:
                    if response.status != 200:
                        totals["errors"] += 1
                        if totals["errors"] <= 3:
                            print(f"HTTP {response.status}: {(await response.text()).strip()[:200]}")
                    else:
                        data = await response.json()
                        totals["prompt"] += len(turn.prompt)
                        totals["reused"] += data["tokens_reused"]
                        totals["mismatched"] += data["mismatched_tokens"]
            except aiohttp.ClientError:
                totals["errors"] += 1
            latencies.append(time.perf_counter() - t0)
        done_turn[(turn.conversation, turn.turn)].set()

    t0 = time.perf_counter()
    async with aiohttp.ClientSession() as session:
        await asyncio.gather(*(one(session, t) for t in turns))
    seconds = time.perf_counter() - t0
    q = statistics.quantiles(latencies, n=100, method="inclusive") if len(latencies) > 1 else [latencies[0]] * 99
    return LoadResult(len(turns), totals["errors"], seconds, q[49] * 1e3, q[89] * 1e3, q[98] * 1e3,
                      totals["prompt"], totals["reused"], totals["mismatched"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:8080")
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    r = asyncio.run(run_load(args.url, args.requests, args.concurrency, seed=args.seed))
    print(f"{r.requests} requests ({r.errors} errors) in {r.seconds:.2f} s: {r.requests_per_second:.1f} req/s")
    print(f"latency p50 {r.p50_ms:.1f} ms, p90 {r.p90_ms:.1f} ms, p99 {r.p99_ms:.1f} ms")
    print(
        f"reused {r.reused_tokens} of {r.prompt_tokens} prompt tokens "
        f"({r.reused_tokens / max(1, r.prompt_tokens):.0%}); "
        f"mismatched tokens: {r.mismatched_tokens}"
    )
    raise SystemExit(1 if r.errors or r.mismatched_tokens else 0)


if __name__ == "__main__":
    main()
