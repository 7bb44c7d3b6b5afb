"""One engine process of the two-process sharing test: replay a seeded chat workload through a cache on a store.

    python tests/remote_peer.py URL warm|cold SEED

Prints one JSON line (hits per tier, reused/verified/mismatched tokens). ``warm`` then waits for a line on
stdin before closing (a Mooncake object lives in the memory of the process that put it).
"""

from __future__ import annotations

import asyncio
import json
import sys

import torch

from tiered_kv import KVLayout, TieredKVCache
from tiered_kv.tools.workload import ChatWorkload, replay

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, tokens_per_block=16, dtype=torch.float16)


async def main(url: str, role: str, seed: int) -> None:
    async with TieredKVCache(LAYOUT, gpu_blocks=96, host_blocks=64, device="cpu", remote=url, model_id=f"peer-{seed}") as cache:
        report = await replay(cache, ChatWorkload(seed=seed, conversations=6, system_prompts=2, system_tokens=160, turns=(1, 3)))
        await cache.flush()
        stats = cache.statistics()
        print(json.dumps({"role": role, "hits": report.hits, "reused": report.reused_tokens, "verified": report.verified_tokens,
                          "mismatched": report.mismatched_tokens, "remote": stats.remote.blocks}), flush=True)
        if role == "warm":
            sys.stdin.readline()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2], int(sys.argv[3])))
