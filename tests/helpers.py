"""Small helpers shared by the engine and cache tests."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from tiered_kv import Tier, TieredKVCache, TransferEngine


def fill_pool(engine: TransferEngine, tier: str, seed: int) -> torch.Tensor:
    """Fill every block of a pool with random bits; return a CPU copy of the whole pool."""
    pool = engine.pool(tier).tensor
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (pool.numel() * pool.element_size(),), dtype=torch.uint8, generator=g)
    pool.view(-1).view(torch.uint8).copy_(raw.to(pool.device))
    if pool.is_cuda:
        torch.cuda.synchronize(pool.device)
    return pool.detach().cpu().clone()


def snapshot(engine: TransferEngine, tier: str, index: int) -> torch.Tensor:
    block = engine.block(tier, index)
    if block.is_cuda:
        torch.cuda.synchronize(block.device)
    return block.detach().cpu().clone()


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-exact equality (random bits include NaN patterns, which == would call different)."""
    return bool((a.contiguous().view(torch.uint8) == b.contiguous().view(torch.uint8)).all())


def disable_fences(monkeypatch: Any) -> None:
    """Break the engine on purpose: no copy waits for another (pending reads and writes are still recorded).

    Both ways the engine asks the fence table are patched: ``dependencies`` (general calls) and ``fence`` (the
    per-call path of small copies).
    """
    from tiered_kv import FenceTable

    def fence(self: FenceTable, marker: Any, src_pool: str, s: list[int], dst_pool: str, d: list[int]) -> list[Any]:
        FenceTable.register(self, marker, [(src_pool, s)], [(dst_pool, d)])
        return []

    monkeypatch.setattr(FenceTable, "dependencies", lambda self, reads, writes, sources=None: set())
    monkeypatch.setattr(FenceTable, "fence", fence)


def flip_byte(path: str, offset: int) -> None:
    """Corrupt one byte of a file in place (bit 6 flipped): what a torn or rotten sector leaves behind."""
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x40]))


def random_tokens(seed: int, n: int) -> list[int]:
    """``n`` token ids in ``[0, 1000)``, the same for the same seed."""
    return [int(x) for x in np.random.default_rng(seed).integers(0, 1000, n)]


async def cached_in(cache: TieredKVCache, prompt: list[int], tier: str) -> None:
    """Admit ``prompt``, commit and free it, then evict its blocks down to ``tier`` (``gpu``, ``host`` or ``file``)."""
    [adm] = await cache.add_sequences([prompt])
    cache.commit(adm.seq_id)
    cache.free(adm.seq_id)
    if tier in ("host", "file"):
        await cache.evict(Tier.GPU, cache.blocks.capacity[Tier.GPU])
    if tier == "file":
        await cache.evict(Tier.HOST, cache.blocks.capacity[Tier.HOST])
