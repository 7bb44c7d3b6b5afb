"""One process of the long-prefix sharing test: a cache with a small host tier on a shared store.

    python tests/remote_long_peer.py URL warm|cold MODEL HOST_BLOCKS BLOCKS [BLOCKS ...]

``warm`` computes one prompt per ``BLOCKS`` (that many full blocks and one more token), writes the oracle's
content (:mod:`tiered_kv.tools.workload`), commits it and flushes the puts. ``cold`` admits the same prompts and
checks every reused token. Both print one JSON line: per prompt the tokens reused, the blocks per tier they came
from and the wrong tokens; and the remote tier's block counters.
"""

from __future__ import annotations

import asyncio
import json
import sys

import numpy as np
import torch

from tiered_kv import KVLayout, TieredKVCache
from tiered_kv.tools.workload import verify_expected, write_expected

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, tokens_per_block=16, dtype=torch.float16)


def prompt(blocks: int, salt: int) -> np.ndarray:
    """``blocks`` full blocks and one more token (the token the model computes), distinct per ``salt``."""
    rng = np.random.default_rng(1000 * salt + blocks)
    return rng.integers(0, 30000, blocks * LAYOUT.tokens_per_block + 1)


async def main(url: str, role: str, model: str, host_blocks: int, sizes: list[int]) -> None:
    out: dict[str, object] = {"role": role, "prompts": []}
    gpu_blocks = 2 * max(sizes) + 8
    async with TieredKVCache(
        LAYOUT, gpu_blocks=gpu_blocks, host_blocks=host_blocks, device="cpu", remote=url, model_id=model
    ) as cache:
        for i, n in enumerate(sizes):
            [adm] = await cache.add_sequences([prompt(n, i)])
            wrong = verify_expected(cache, adm.seq_id, 0, adm.tokens_reused)
            write_expected(cache, adm.seq_id, adm.tokens_reused)
            cache.commit(adm.seq_id)
            cache.free(adm.seq_id)
            out["prompts"].append(  # type: ignore[attr-defined]
                {"blocks": n, "reused": adm.tokens_reused, "from": adm.blocks_from, "wrong": len(wrong)}
            )
        await cache.flush()
        stats = cache.statistics()
        out["remote"] = stats.remote.blocks
        out["hits"] = stats.hits
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), [int(a) for a in sys.argv[5:]]))
