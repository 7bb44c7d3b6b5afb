"""A copy that reads what a failed copy was writing fails too: no transfer succeeds with bytes that never arrived.

The rule the engine keeps (``Marker.sources``: the pending writers of what a copy reads, when it is issued): when one
of them fails, the copy fails, whatever route it takes (on a stream, through the file tier, on the emulated device),
and so does every copy reading what it wrote. A copy that only waited for a failed one because it overwrites what that
one read or wrote is not affected. A file write failed before it starts gives back the slots it claimed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tiered_kv import FileTierConfig, KVLayout, Tier, TransferEngine, TransferError
from tiered_kv.testing import FaultyBackend, assert_blocks_equal, fill_random, stall


def _engine(layout: KVLayout, directory: Path, device: str, **faults: Any) -> TransferEngine:
    from tiered_kv.backends.posix import PosixBackend

    config = FileTierConfig(
        directory, 8, gds="off", io_threads=2, staging_blocks=3,
        backend_factory=lambda p: FaultyBackend(PosixBackend(p, threads=2), stall_writes=0.02, **faults),
    )
    return TransferEngine(layout, gpu_blocks=8, host_blocks=8, device=device, file_config=config)


async def test_a_chain_behind_a_failed_read_fails_and_an_overwrite_does_not(
    layout: KVLayout, tmp_path: Path, device: str
) -> None:
    """file -> GPU fails (EIO): the offload of that GPU block queued behind it fails, the spill of what the offload
    wrote fails (its file slot is left neither pending nor valid), and a copy that only overwrites the block the
    failed read was writing is not failed by it."""
    async with _engine(layout, tmp_path, device, eio_on_read={1}) as engine:
        fill_random(engine.block(Tier.HOST, 0))
        fill_random(engine.block(Tier.HOST, 5))
        await engine.copy(Tier.HOST, [0], Tier.FILE, [0], keys=[b"k0"])
        read = engine.copy(Tier.FILE, [0], Tier.GPU, [3])  # read #1 fails
        offload = engine.copy(Tier.GPU, [3], Tier.HOST, [4])  # reads what `read` was writing
        spill = engine.copy(Tier.HOST, [4], Tier.FILE, [1], keys=[b"k1"])  # reads what `offload` wrote
        overwrite = engine.copy(Tier.HOST, [5], Tier.GPU, [3])  # writes what `read` wrote, reads nothing of it
        with pytest.raises(TransferError, match="reading file slot 0 failed"):
            await read
        with pytest.raises(TransferError, match="a copy this one reads from failed: reading file slot 0"):
            await offload
        with pytest.raises(TransferError, match="a copy this one reads from failed: a copy this one reads from"):
            await spill
        await overwrite
        assert_blocks_equal(engine.block(Tier.GPU, 3), engine.block(Tier.HOST, 5))
        assert not engine.file_tier.is_valid(1) and not engine.file_tier.is_pending(1)
        assert engine.file_tier.statistics().pending == 0
        assert engine.file_tier.is_valid(0)  # the slot itself is fine: a later read of it succeeds
        await engine.copy(Tier.FILE, [0], Tier.HOST, [6])
        assert_blocks_equal(engine.block(Tier.HOST, 6), engine.block(Tier.HOST, 0))


async def test_a_copy_queued_on_a_stream_behind_a_failed_one_fails(
    layout: KVLayout, tmp_path: Path, device: str
) -> None:
    """A failed spill (ENOSPC) of a host block's new content: a read of that file slot queued behind it fails before
    it reads anything, and a GPU -> GPU copy chained on the stream behind a failed file read fails at completion."""
    async with _engine(layout, tmp_path, device, enospc_on_write={1}) as engine:
        fill_random(engine.block(Tier.HOST, 0))
        stall(engine.stream("onboard"), 0.05)
        write = engine.copy(Tier.HOST, [0], Tier.FILE, [2], keys=[b"k2"])  # write #1 fails
        read = engine.copy(Tier.FILE, [2], Tier.GPU, [1])
        local = engine.copy(Tier.GPU, [1], Tier.GPU, [2])
        for transfer, match in ((write, "No space left"), (read, "reads from failed: writing file slot 2"),
                                (local, "reads from failed: a copy this one reads from failed: writing")):
            with pytest.raises(TransferError, match=match):
                await transfer
        assert engine.file_tier.statistics().pending == 0
