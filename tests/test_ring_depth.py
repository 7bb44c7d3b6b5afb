"""The file tier's staging ring: sized from bandwidth x latency, and kept full by the GPU<->file pipeline."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tiered_kv.backends.posix import PosixBackend

from tiered_kv import FileTierConfig, KVLayout, Tier, TransferEngine, resolve_device
from tiered_kv.file.ring import measure_legs, ring_depth
from tiered_kv.testing import FaultyBackend, assert_blocks_equal, fill_random


def test_ring_depth_is_bandwidth_times_latency() -> None:
    # disk-bound: 4 ms per request, 4 in flight -> one block per ms; a block is held 4.1 ms; twice that
    assert ring_depth(4e-3, 0.1e-3, 4, limit=256) == 9
    # disk-bound at any latency: the rate falls with it, so the depth stays ~2 x the requests in flight
    assert ring_depth(32e-3, 0.1e-3, 4, limit=256) == 9
    # a slow link leg (2 ms) paces the ring: 6 ms held per 2 ms period, twice that
    assert ring_depth(4e-3, 2e-3, 4, limit=256) == 6
    # link-bound: the link leg paces the ring, at least one block per I/O thread plus one
    assert ring_depth(1e-3, 1e-3, 4, limit=256) == 5
    assert ring_depth(0.0, 0.0, 2, limit=256) == 3
    assert ring_depth(32e-3, 0.1e-3, 16, limit=16) == 16  # the memory cap wins
    for bad in ((-1.0, 0.0, 1), (0.0, 0.0, 0)):
        with pytest.raises(ValueError):
            ring_depth(*bad, limit=4)


def test_measure_legs_times_a_real_file(tmp_path: Path) -> None:
    path = tmp_path / "f.bin"
    path.write_bytes(b"\1" * (3 << 20))
    disk_s, link_s = measure_legs(resolve_device("cpu"), str(path), 4096, 1 << 20)
    assert 0 < disk_s < 5 and 0 < link_s < 5


@pytest.mark.parametrize("staging_blocks", [None, 4])
async def test_gpu_file_pipeline_keeps_the_ring_full(
    layout: KVLayout, tmp_path: Path, device: str, staging_blocks: int | None
) -> None:
    """Slow writes: every staging block is in flight at once, and the data round-trips intact."""
    cfg = FileTierConfig(
        tmp_path,
        16,
        gds="off",
        io_threads=2,
        staging_blocks=staging_blocks,
        backend_factory=lambda p: FaultyBackend(PosixBackend(p, threads=2), stall_writes=0.02),
    )
    async with TransferEngine(layout, gpu_blocks=8, host_blocks=8, device=device, file_config=cfg) as eng:
        src = [fill_random(eng.block(Tier.GPU, i)).clone() for i in range(8)]
        if eng.device.is_cuda:
            torch.cuda.synchronize()
        await eng.copy(Tier.GPU, list(range(8)), Tier.FILE, list(range(8)), keys=[b"k%d" % i for i in range(8)])
        ring = eng.file_tier._staging_ring()
        if staging_blocks is not None:
            assert ring.count == staging_blocks
        else:
            assert 3 <= ring.count <= (256 << 20) // layout.bytes_per_block  # io_threads + 1 at least
        assert ring.peak_in_use == min(ring.count, 8), "the pipeline must fill the ring while the disk is slow"
        assert ring.in_use == 0
        for i in range(8):
            eng.block(Tier.GPU, i).zero_()
        await eng.copy(Tier.FILE, list(range(8)), Tier.GPU, list(range(7, -1, -1)))
        for i in range(8):
            assert_blocks_equal(eng.block(Tier.GPU, 7 - i), src[i], f"gpu block {7 - i}")


def test_staging_bytes_must_be_positive(tmp_path: Path) -> None:
    with pytest.raises(ValueError):
        FileTierConfig(tmp_path, 4, staging_bytes=0)
    with pytest.raises(ValueError):
        FileTierConfig(tmp_path, 4, staging_blocks=0)
