"""Issue 11: the file tier under damage, hostile directories and operational errors."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tiered_kv import KVLayout, Tier, TransferEngine
from tiered_kv.file import FileTier, FileTierConfig
from tiered_kv.slab import HEADER_SIZE
from tiered_kv.testing import assert_blocks_equal, fill_random

TPB = 4


@pytest.fixture
def small() -> KVLayout:
    return KVLayout(num_layers=2, num_kv_heads=1, head_dim=8, tokens_per_block=TPB, dtype=torch.float16)


async def spill(layout: KVLayout, directory: Path, n: int) -> list[torch.Tensor]:
    """Write ``n`` random host blocks into file slots 0..n-1 under keys k0..; returns their contents."""
    async with TransferEngine(layout, host_blocks=n, device="cpu", file_dir=directory, file_blocks=8) as engine:
        for i in range(n):
            fill_random(engine.block(Tier.HOST, i))
        await engine.copy(Tier.HOST, list(range(n)), Tier.FILE, list(range(n)), keys=[f"k{i}" for i in range(n)])
        return [engine.block(Tier.HOST, i).clone() for i in range(n)]


def zero_superblock(slab: Path) -> None:
    with open(slab, "r+b") as f:
        f.write(bytes(HEADER_SIZE))


# ---------------------------------------------------------------------------------------- finding 7


async def test_a_zeroed_superblock_keeps_the_verified_slots(small: KVLayout, tmp_path: Path) -> None:
    """Finding 7: a zeroed superblock silently discarded a slab whose slots were valid. It is damage: the
    slots that verify are kept (each verifies itself), the superblock is written again."""
    blocks = await spill(small, tmp_path, 3)
    slab = tmp_path / "kv.slab"
    zero_superblock(slab)
    async with TransferEngine(small, host_blocks=3, device="cpu", file_dir=tmp_path, file_blocks=8) as engine:
        tier = engine.file_tier
        assert not tier.open_report.created
        assert tier.open_report.recovered == 3
        slots = [tier.lookup(f"k{i}") for i in range(3)]
        assert slots == [0, 1, 2]
        await engine.copy(Tier.FILE, slots, Tier.HOST, [0, 1, 2])  # verified on the way
        for i in range(3):
            assert_blocks_equal(engine.block(Tier.HOST, i), blocks[i], f"block {i}")
    assert any(slab.read_bytes()[:HEADER_SIZE]), "the superblock was written again"
    # a zeroed superblock over a slab of nothing (an interrupted creation) is simply a fresh slab
    empty = tmp_path / "empty"
    empty.mkdir()
    FileTier(small, FileTierConfig(empty, 4)).close()
    zero_superblock(empty / "kv.slab")
    tier = FileTier(small, FileTierConfig(empty, 4))
    assert tier.open_report.created and tier.open_report.recovered == 0 and tier.entries() == {}
    tier.close()
