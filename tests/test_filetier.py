"""The file tier: round trips, fault injection, corruption, warm restart, permissions, layout changes."""

from __future__ import annotations

import asyncio
import errno
import importlib.util
import os
import stat
from typing import Any

import pytest
import torch
from helpers import flip_byte

from tiered_kv import (
    IntegrityError,
    KVLayout,
    LayoutMismatchError,
    SlabInUseError,
    Tier,
    Transfer,
    TransferEngine,
    TransferError,
)
from tiered_kv.file import FileTier, FileTierConfig
from tiered_kv.slab import HEADER_SIZE
from tiered_kv.testing import FaultyBackend, assert_blocks_equal, fill_random

HAS_KVIKIO = importlib.util.find_spec("kvikio") is not None


def _posix(path: str):
    from tiered_kv.backends.posix import PosixBackend

    return PosixBackend(path, threads=2)


@pytest.fixture(params=["posix", pytest.param("gds", marks=[pytest.mark.gpu, pytest.mark.gds])])
def backend(request: pytest.FixtureRequest) -> str:
    """posix everywhere; kvikio (compat mode where there is no nvidia-fs) on a CUDA machine with kvikio."""
    if request.param == "gds" and not HAS_KVIKIO:
        pytest.skip("kvikio is not installed")
    name: str = request.param
    return name


def make_engine(
    layout: KVLayout, directory, device: str = "cpu", backend: str = "posix", *, blocks: int = 16, **cfg
) -> TransferEngine:
    cfg.setdefault("gds", "off" if backend == "posix" else "auto")
    cfg.setdefault("io_threads", 2)
    cfg.setdefault("staging_blocks", 3)
    return TransferEngine(
        layout, gpu_blocks=8, host_blocks=8, device=device, file_config=FileTierConfig(directory, blocks, **cfg)
    )


def settle(eng: TransferEngine) -> None:
    """Blocks filled or zeroed directly (default stream) must land before the engine's streams read them."""
    if eng.device.is_cuda:
        torch.cuda.synchronize()


def keys(*names: object) -> list[bytes]:
    return [f"key-{n}".encode() for n in names]


# --------------------------------------------------------------------------------------------- round trips


async def test_round_trip_gpu_host_file_host_gpu(layout: KVLayout, tmp_path, device: str, backend: str) -> None:
    async with make_engine(layout, tmp_path, device, backend) as eng:
        src = [fill_random(eng.block(Tier.GPU, i)).clone() for i in range(4)]
        settle(eng)
        await eng.copy(Tier.GPU, [0, 1, 2, 3], Tier.HOST, [4, 6, 5, 7])
        await eng.copy(Tier.HOST, [4, 6, 5, 7], Tier.FILE, [9, 2, 3, 15], keys=keys(0, 1, 2, 3))
        for i in range(8):
            eng.block(Tier.HOST, i).zero_()
        await eng.copy(Tier.FILE, [9, 2, 3, 15], Tier.HOST, [0, 1, 2, 3])
        await eng.copy(Tier.HOST, [0, 1, 2, 3], Tier.GPU, [7, 6, 5, 4])
        for i in range(4):
            assert_blocks_equal(eng.block(Tier.GPU, 7 - i), src[i], f"gpu block {7 - i}")
        assert eng.file_tier.entries() == dict(zip(keys(0, 1, 2, 3), [9, 2, 3, 15], strict=True))
        s = eng.statistics()
        assert s.blocks_by_direction["host->file"] == 4 and s.blocks_by_direction["file->host"] == 4


async def test_round_trip_gpu_file_gpu(layout: KVLayout, tmp_path, device: str, backend: str) -> None:
    # 7 blocks through 3 staging buffers: the pipeline must recycle them.
    async with make_engine(layout, tmp_path, device, backend) as eng:
        src = [fill_random(eng.block(Tier.GPU, i)).clone() for i in range(7)]
        settle(eng)
        t = eng.copy(Tier.GPU, range(7), Tier.FILE, [10, 3, 4, 5, 0, 8, 1], keys=keys(*range(7)))
        res = await t
        assert res.num_blocks == 7 and res.nbytes == 7 * layout.bytes_per_block
        for i in range(8):
            eng.block(Tier.GPU, i).zero_()
        settle(eng)
        await eng.copy(Tier.FILE, [10, 3, 4, 5, 0, 8, 1], Tier.GPU, [1, 2, 3, 4, 5, 6, 7])
        for i in range(7):
            assert_blocks_equal(eng.block(Tier.GPU, i + 1), src[i], f"gpu block {i + 1}")
        assert eng.file_tier.statistics().integrity_failures == 0


@pytest.mark.gpu
@pytest.mark.gds
async def test_gds_device_buffers_round_trip(layout: KVLayout, tmp_path) -> None:
    """kvikio reading/writing CUDA tensors directly (what true GDS does; compat mode bounces inside kvikio)."""
    if not HAS_KVIKIO:
        pytest.skip("kvikio is not installed")
    from tiered_kv.backends.gds import GdsBackend

    cfg: dict[str, Any] = dict(backend_factory=lambda p: GdsBackend(p, device_io=True))
    async with make_engine(layout, tmp_path, "cuda", "gds", **cfg) as eng:
        assert eng.file_tier.backend.device_io
        src = [fill_random(eng.block(Tier.GPU, i)).clone() for i in range(5)]
        settle(eng)
        await eng.copy(Tier.GPU, range(5), Tier.FILE, range(5), keys=keys(*range(5)))
        await eng.copy(Tier.FILE, range(5), Tier.GPU, [3, 4, 5, 6, 7])
        for i in range(5):
            assert_blocks_equal(eng.block(Tier.GPU, i + 3), src[i])


async def test_write_then_read_same_slot_is_ordered_by_fences(layout: KVLayout, tmp_path) -> None:
    slow: dict[str, Any] = dict(backend_factory=lambda p: FaultyBackend(_posix(p), stall_writes=0.2))
    async with make_engine(layout, tmp_path, **slow) as eng:
        a = fill_random(eng.block(Tier.HOST, 0)).clone()
        w = eng.copy(Tier.HOST, [0], Tier.FILE, [5], keys=keys("a"))
        assert eng.file_tier.is_pending(5) and eng.file_tier.lookup(b"key-a") is None
        r = eng.copy(Tier.FILE, [5], Tier.HOST, [1])  # enqueued behind the write, loop-side
        assert not w.done() and not r.done()
        await r
        assert w.done()
        assert_blocks_equal(eng.block(Tier.HOST, 1), a)
        # overwrite while a read of the old content is pending: the read sees the old block
        b = fill_random(eng.block(Tier.HOST, 2)).clone()
        r2 = eng.copy(Tier.FILE, [5], Tier.HOST, [3])
        w2 = eng.copy(Tier.HOST, [2], Tier.FILE, [5], keys=keys("b"))
        await asyncio.gather(r2, w2)
        assert_blocks_equal(eng.block(Tier.HOST, 3), a)
        assert eng.file_tier.lookup(b"key-b") == 5 and eng.file_tier.lookup(b"key-a") is None
        await eng.copy(Tier.FILE, [5], Tier.HOST, [4], keys=keys("b"))
        assert_blocks_equal(eng.block(Tier.HOST, 4), b)
        # the host source of a pending file write is fenced: overwriting it waits for the write
        w3 = eng.copy(Tier.HOST, [2], Tier.FILE, [6], keys=keys("c"))
        c = eng.copy(Tier.HOST, [0], Tier.HOST, [2])
        await c
        assert w3.done()
        await eng.copy(Tier.FILE, [6], Tier.HOST, [5])
        assert_blocks_equal(eng.block(Tier.HOST, 5), b)


async def test_bad_arguments_raise_before_enqueue(layout: KVLayout, tmp_path) -> None:
    async with make_engine(layout, tmp_path) as eng:
        with pytest.raises(ValueError, match="need keys"):
            eng.copy(Tier.HOST, [0], Tier.FILE, [0])
        with pytest.raises(ValueError, match="one content key per block"):
            eng.copy(Tier.HOST, [0, 1], Tier.FILE, [0, 1], keys=keys(1))
        with pytest.raises(ValueError, match="duplicates"):
            eng.copy(Tier.HOST, [0, 1], Tier.FILE, [0, 1], keys=keys(1, 1))
        with pytest.raises(ValueError, match="num_tokens"):
            eng.copy(Tier.HOST, [0], Tier.FILE, [0], keys=keys(1), num_tokens=2)
        with pytest.raises(ValueError, match="holds no block"):
            eng.copy(Tier.FILE, [3], Tier.HOST, [0])
        with pytest.raises(ValueError, match="out of range"):
            eng.copy(Tier.HOST, [0], Tier.FILE, [16], keys=keys(1))
        with pytest.raises(ValueError, match="only used by copies"):
            eng.copy(Tier.HOST, [0], Tier.GPU, [0], keys=keys(1))
        with pytest.raises(TypeError, match="content key"):
            eng.copy(Tier.HOST, [0], Tier.FILE, [0], keys=[1.5])
        with pytest.raises(TypeError, match="sequence of content keys"):
            eng.copy(Tier.HOST, [0], Tier.FILE, [0], keys=b"k")
        with pytest.raises(TypeError, match="sequence of content keys"):
            eng.copy(Tier.HOST, [0], Tier.FILE, [0], keys=7)  # type: ignore[arg-type]  # deliberately not keys
        with pytest.raises(TypeError, match="no in-memory view"):
            eng.block(Tier.FILE, 0)
        assert eng.statistics().submitted == 0
        assert eng.file_tier.free_slots() == list(range(16))
        assert (await eng.copy(Tier.HOST, [], Tier.FILE, [])).num_blocks == 0  # empty copies need no keys
        await eng.copy(Tier.HOST, [0], Tier.FILE, [0], keys=keys(1))
        with pytest.raises(ValueError, match="holds key"):
            eng.copy(Tier.FILE, [0], Tier.HOST, [1], keys=keys(2))


# --------------------------------------------------------------------------------------------- faults


async def test_enospc_on_third_write(layout: KVLayout, tmp_path) -> None:
    holder: list[FaultyBackend] = []

    def factory(p: str) -> FaultyBackend:
        holder.append(FaultyBackend(_posix(p), enospc_on_write=3))
        return holder[0]

    async with make_engine(layout, tmp_path, backend_factory=factory) as eng:
        src = [fill_random(eng.block(Tier.HOST, i)).clone() for i in range(5)]
        await eng.copy(Tier.HOST, [0, 1], Tier.FILE, [0, 1], keys=keys(0, 1))  # writes 1 and 2
        t = eng.copy(Tier.HOST, [2, 3, 4], Tier.FILE, [2, 3, 4], keys=keys(2, 3, 4))  # write 3 fails
        with pytest.raises(TransferError) as info:
            await t
        assert not isinstance(info.value, IntegrityError)
        assert isinstance(info.value.__cause__, OSError) and info.value.__cause__.errno == errno.ENOSPC
        ft = eng.file_tier
        # no slot of the failed transfer is visible; the earlier transfer is untouched
        assert ft.entries() == {b"key-0": 0, b"key-1": 1}
        assert [ft.is_valid(i) for i in range(5)] == [True, True, False, False, False]
        assert ft.free_slots()[:3] == [2, 3, 4]
        assert holder[0].faults == 1
        st = ft.statistics()
        assert st.write_failures == 1 and st.valid == 2 and st.pending == 0
        assert eng.statistics().failed == 1
        for i in range(5):  # the source stays the owner, unchanged
            assert_blocks_equal(eng.block(Tier.HOST, i), src[i])
        with pytest.raises(ValueError, match="holds no block"):
            eng.copy(Tier.FILE, [2], Tier.HOST, [7])
        # the next attempt (writes 6..) succeeds and reads back
        await eng.copy(Tier.HOST, [2, 3, 4], Tier.FILE, [2, 3, 4], keys=keys(2, 3, 4))
        await eng.copy(Tier.FILE, [2, 3, 4], Tier.HOST, [5, 6, 7])
        for i in range(3):
            assert_blocks_equal(eng.block(Tier.HOST, 5 + i), src[2 + i])


async def test_read_queued_behind_a_failed_write_fails(layout: KVLayout, tmp_path) -> None:
    """Slot 0's block of a two-block spill reaches the disk, slot 1's hits ENOSPC: the transfer failed, so a read
    of slot 0 queued behind it must fail too (its bytes verify, but the copy that wrote them failed): the engine
    fails a copy whose source a failed copy was writing, before it reads anything."""
    cfg: dict[str, Any] = dict(
        backend_factory=lambda p: FaultyBackend(_posix(p), enospc_on_write=2, stall_writes=0.05), io_threads=1
    )
    async with make_engine(layout, tmp_path, **cfg) as eng:
        fill_random(eng.block(Tier.HOST, 0))
        fill_random(eng.block(Tier.HOST, 1))
        w = eng.copy(Tier.HOST, [0, 1], Tier.FILE, [0, 1], keys=keys(0, 1))
        r = eng.copy(Tier.FILE, [0], Tier.HOST, [2])
        with pytest.raises(TransferError, match="No space left"):
            await w
        with pytest.raises(TransferError, match="a copy this one reads from failed: writing file slot 1 failed"):
            await r
        assert eng.file_tier.entries() == {}
        await eng.copy(Tier.HOST, [0], Tier.FILE, [0], keys=keys(0))  # a successful rewrite clears it
        await eng.copy(Tier.FILE, [0], Tier.HOST, [2])
        assert_blocks_equal(eng.block(Tier.HOST, 2), eng.block(Tier.HOST, 0))


@pytest.mark.parametrize(("fault", "code"), [("eio_on_write", errno.EIO), ("einval_on_write", errno.EINVAL)])
async def test_write_errors_are_transfer_errors(layout: KVLayout, tmp_path, device: str, fault: str, code: int) -> None:
    cfg: dict[str, Any] = dict(backend_factory=lambda p: FaultyBackend(_posix(p), **{fault: 1}))
    async with make_engine(layout, tmp_path, device, **cfg) as eng:
        fill_random(eng.block(Tier.GPU, 0))
        settle(eng)
        with pytest.raises(TransferError) as info:
            await eng.copy(Tier.GPU, [0], Tier.FILE, [7], keys=keys(0))
        assert info.value.__cause__.errno == code  # type: ignore[union-attr]
        assert not eng.file_tier.is_valid(7) and eng.file_tier.lookup(b"key-0") is None


async def test_short_write_is_a_transfer_error_and_torn_slot_is_not_recovered(layout: KVLayout, tmp_path) -> None:
    cfg: dict[str, Any] = dict(backend_factory=lambda p: FaultyBackend(_posix(p), short_write_on=2))
    async with make_engine(layout, tmp_path, **cfg) as eng:
        for i in range(2):
            fill_random(eng.block(Tier.HOST, i))
        await eng.copy(Tier.HOST, [0], Tier.FILE, [0], keys=keys(0))
        with pytest.raises(TransferError, match="short write"):
            await eng.copy(Tier.HOST, [1], Tier.FILE, [1], keys=keys(1))
        assert eng.file_tier.entries() == {b"key-0": 0}
    # the torn slot (new header, half a payload) fails verification on restart
    async with make_engine(layout, tmp_path, verify_on_open="full") as eng:
        r = eng.file_tier.open_report
        assert (r.recovered, r.bad) == (1, 1)
        assert eng.file_tier.entries() == {b"key-0": 0}


async def test_read_faults(layout: KVLayout, tmp_path) -> None:
    cfg: dict[str, Any] = dict(backend_factory=lambda p: FaultyBackend(_posix(p), eio_on_read=1, short_read_on=2))
    async with make_engine(layout, tmp_path, **cfg) as eng:
        a = fill_random(eng.block(Tier.HOST, 0)).clone()
        await eng.copy(Tier.HOST, [0], Tier.FILE, [4], keys=keys(0))
        with pytest.raises(TransferError) as info:  # read 1: EIO -> TransferError, the slot is kept
            await eng.copy(Tier.FILE, [4], Tier.HOST, [1])
        assert not isinstance(info.value, IntegrityError)
        assert eng.file_tier.is_valid(4)
        with pytest.raises(IntegrityError, match="short read"):  # read 2: short -> IntegrityError, slot dropped
            await eng.copy(Tier.FILE, [4], Tier.HOST, [1])
        assert not eng.file_tier.is_valid(4) and eng.file_tier.lookup(b"key-0") is None
        await eng.copy(Tier.HOST, [0], Tier.FILE, [4], keys=keys(0))
        await eng.copy(Tier.FILE, [4], Tier.HOST, [2])  # read 3: fine
        assert_blocks_equal(eng.block(Tier.HOST, 2), a)
        st = eng.file_tier.statistics()
        assert (st.read_failures, st.integrity_failures, st.blocks_read) == (2, 1, 1)


async def test_stalled_write_does_not_block_the_loop(layout: KVLayout, tmp_path) -> None:
    cfg: dict[str, Any] = dict(backend_factory=lambda p: FaultyBackend(_posix(p), stall_writes=0.3))
    async with make_engine(layout, tmp_path, **cfg) as eng:
        t = eng.copy(Tier.HOST, [0], Tier.FILE, [0], keys=keys(0))
        ticks = 0
        while not t.done():
            await asyncio.sleep(0.01)
            ticks += 1
        assert ticks >= 5  # the loop kept running while the write stalled
        await t


# --------------------------------------------------------------------------------------------- corruption


def _copy_slot(path: str, src: int, dst: int, slot_size: int) -> None:
    with open(path, "r+b") as f:
        f.seek(HEADER_SIZE + src * slot_size)
        data = f.read(slot_size)
        f.seek(HEADER_SIZE + dst * slot_size)
        f.write(data)


def _size(path: str) -> int:
    return os.stat(path).st_size


def _exists(path: str) -> bool:
    return os.access(path, os.F_OK)


@pytest.mark.parametrize("where", ["payload", "payload_last", "header_key", "header_generation", "header_tail"])
async def test_corruption_is_an_integrity_error(layout: KVLayout, tmp_path, device: str, where: str) -> None:
    async with make_engine(layout, tmp_path, device) as eng:
        src = fill_random(eng.block(Tier.GPU, 0)).clone()
        settle(eng)
        await eng.copy(Tier.GPU, [0], Tier.FILE, [3], keys=keys(0))
        ft = eng.file_tier
        base = ft.offset(3)
        where_at = {
            "payload": base + HEADER_SIZE + 17,
            "payload_last": base + HEADER_SIZE + layout.bytes_per_block - 1,
            "header_key": base + 77,
            "header_generation": base + 44,
            "header_tail": base + HEADER_SIZE - 1,
        }[where]
        flip_byte(ft.path, where_at)
        eng.block(Tier.GPU, 1).zero_()
        settle(eng)
        with pytest.raises(IntegrityError, match="file slot 3 failed verification"):
            await eng.copy(Tier.FILE, [3], Tier.GPU, [1])
        # never wrong data: the GPU destination was not written from a bad slot (staged path verifies first)
        assert not eng.block(Tier.GPU, 1).view(torch.uint8).any()
        assert ft.lookup(b"key-0") is None and not ft.is_valid(3)
        assert ft.statistics().integrity_failures == 1
        with pytest.raises(ValueError, match="holds no block"):
            eng.copy(Tier.FILE, [3], Tier.HOST, [0])
        # a fresh write of the slot heals it
        await eng.copy(Tier.GPU, [0], Tier.FILE, [3], keys=keys(0))
        await eng.copy(Tier.FILE, [3], Tier.GPU, [2])
        assert_blocks_equal(eng.block(Tier.GPU, 2), src)


async def test_truncated_file_is_an_integrity_error(layout: KVLayout, tmp_path) -> None:
    async with make_engine(layout, tmp_path) as eng:
        for i in range(3):
            fill_random(eng.block(Tier.HOST, i))
        await eng.copy(Tier.HOST, [0, 1, 2], Tier.FILE, [13, 14, 15], keys=keys(0, 1, 2))
        ft = eng.file_tier
        os.truncate(ft.path, ft.offset(14) + HEADER_SIZE + 100)  # cut slot 14's payload, drop slot 15
        with pytest.raises(IntegrityError, match="short read"):
            await eng.copy(Tier.FILE, [14], Tier.HOST, [5])
        with pytest.raises(IntegrityError):
            await eng.copy(Tier.FILE, [15], Tier.HOST, [5])
        await eng.copy(Tier.FILE, [13], Tier.HOST, [5])
        assert_blocks_equal(eng.block(Tier.HOST, 5), eng.block(Tier.HOST, 0))
        assert ft.entries() == {b"key-0": 13}


# --------------------------------------------------------------------------------------------- restart


async def test_restart_recovers_verified_blocks_and_nothing_else(layout: KVLayout, tmp_path) -> None:
    data = {}
    async with make_engine(layout, tmp_path) as eng:
        for i in range(8):
            data[i] = fill_random(eng.block(Tier.HOST, i)).clone()
        slots = [0, 2, 4, 6, 8, 10, 12, 14]
        await eng.copy(Tier.HOST, range(8), Tier.FILE, slots, keys=keys(*range(8)))
        # key 7 rewritten into slot 15: slot 14's copy is superseded
        await eng.copy(Tier.HOST, [7], Tier.FILE, [15], keys=keys(7))
        assert eng.file_tier.lookup(b"key-7") == 15
        ft = eng.file_tier
        flip_byte(ft.path, ft.offset(2) + HEADER_SIZE + 5)  # payload of key-1
        flip_byte(ft.path, ft.offset(4) + 30)  # header of key-2
        path = ft.path
    _copy_slot(path, 6, 9, HEADER_SIZE + 4096)  # a slot copied to another position is foreign
    async with make_engine(layout, tmp_path) as eng:
        ft = eng.file_tier
        r = ft.open_report
        # header mode: key-1's payload damage is found on read; key-2's header damage at open
        assert (r.scanned, r.bad, r.foreign, r.stale) == (16, 1, 1, 1)
        expected = {b"key-0": 0, b"key-1": 2, b"key-3": 6, b"key-4": 8, b"key-5": 10, b"key-6": 12, b"key-7": 15}
        assert ft.entries() == expected
        with pytest.raises(IntegrityError, match="payload checksum"):
            await eng.copy(Tier.FILE, [2], Tier.HOST, [0])
        del expected[b"key-1"]
        for key, slot in expected.items():
            i = int(key.split(b"-")[1])
            await eng.copy(Tier.FILE, [slot], Tier.HOST, [1], keys=[key])
            assert_blocks_equal(eng.block(Tier.HOST, 1), data[i], f"key {key!r}")
        # new writes get generations above everything recovered
        await eng.copy(Tier.HOST, [1], Tier.FILE, [1], keys=keys("new"))
    async with make_engine(layout, tmp_path, verify_on_open="full") as eng:
        r = eng.file_tier.open_report
        assert r.recovered == 7 and r.bad == 2  # full mode also rejects key-1's payload at open
        assert eng.file_tier.lookup(b"key-1") is None and eng.file_tier.lookup(b"key-new") == 1


async def test_restart_with_more_and_fewer_slots(layout: KVLayout, tmp_path) -> None:
    async with make_engine(layout, tmp_path, blocks=8) as eng:
        await eng.copy(Tier.HOST, [0, 1], Tier.FILE, [1, 7], keys=keys(0, 1))
    async with make_engine(layout, tmp_path, blocks=32) as eng:
        assert eng.file_tier.entries() == {b"key-0": 1, b"key-1": 7}
        assert eng.file_tier.open_report.empty == 30
    async with make_engine(layout, tmp_path, blocks=4) as eng:
        assert eng.file_tier.entries() == {b"key-0": 1}
        assert _size(eng.file_tier.path) == HEADER_SIZE + 4 * eng.file_tier.slot_size


async def test_file_permissions_are_0600(layout: KVLayout, tmp_path) -> None:
    d = tmp_path / "new" / "dir"
    async with make_engine(layout, d) as eng:
        mode = stat.S_IMODE(os.stat(eng.file_tier.path).st_mode)
        assert mode == 0o600
        assert stat.S_IMODE(os.stat(d).st_mode) & 0o077 == 0
        assert sorted(os.listdir(d)) == ["kv.lock", "kv.slab"]  # the O_DIRECT probe left nothing behind
        assert stat.S_IMODE(os.stat(d / "kv.lock").st_mode) == 0o600


async def test_reopen_with_another_layout(layout: KVLayout, tmp_path) -> None:
    async with make_engine(layout, tmp_path) as eng:
        await eng.copy(Tier.HOST, [0], Tier.FILE, [0], keys=keys(0))
    other = KVLayout(num_layers=3, num_kv_heads=2, head_dim=16, tokens_per_block=8, dtype=torch.bfloat16)
    with pytest.raises(
        LayoutMismatchError, match=r"another layout \(layers=3 kv=2 heads=2 tokens=8 head_dim=16 dtype=float16"
    ):
        make_engine(other, tmp_path)
    with pytest.raises(ValueError, match="discard_mismatch=True"):
        FileTier(other, FileTierConfig(tmp_path, 16, gds="off"))
    async with make_engine(other, tmp_path, discard_mismatch=True) as eng:
        r = eng.file_tier.open_report
        assert r.discarded and r.created and eng.file_tier.entries() == {}
    (tmp_path / "junk.slab").write_bytes(b"hello" * 2000)
    with pytest.raises(LayoutMismatchError, match="not a tiered_kv slab"):
        FileTier(layout, FileTierConfig(tmp_path, 4, name="junk", gds="off"))


async def test_one_tier_per_slab(layout: KVLayout, tmp_path) -> None:
    async with make_engine(layout, tmp_path) as eng:
        with pytest.raises(SlabInUseError, match="in use by another file tier"):
            make_engine(layout, tmp_path)
        other = FileTier(layout, FileTierConfig(tmp_path, 4, name="other", gds="off"))  # another name is fine
        other.close()
        assert eng.file_tier.open_report.created
    async with make_engine(layout, tmp_path) as eng:  # released on close
        assert not eng.file_tier.open_report.created


async def test_open_async_and_remove(layout: KVLayout, tmp_path) -> None:
    ft = await FileTier.open_async(layout, FileTierConfig(tmp_path / "a", 4, gds="off"))
    assert _exists(ft.path) and repr(ft).startswith("<FileTier")
    await ft.remove()
    assert not _exists(ft.path) and ft.closed


@pytest.mark.parametrize("durability", ["none", "flush", "fsync"])
async def test_durability_modes(layout: KVLayout, tmp_path, durability: str) -> None:
    async with make_engine(layout, tmp_path, durability=durability) as eng:
        a = fill_random(eng.block(Tier.HOST, 0)).clone()
        await eng.copy(Tier.HOST, [0], Tier.FILE, [0], keys=keys(0))
        await eng.copy(Tier.FILE, [0], Tier.HOST, [1])
        assert_blocks_equal(eng.block(Tier.HOST, 1), a)
        assert eng.file_tier.statistics().durability == durability


async def test_unaligned_block_size_and_key_types(tmp_path) -> None:
    # 3 * 1 * 3 * 5 * 7 * 4 bytes = 1260: not a multiple of 512; goes through the bounce path under O_DIRECT
    odd = KVLayout(num_layers=3, num_kv_heads=3, head_dim=7, tokens_per_block=5, dtype=torch.float32, kv_factor=1)
    async with make_engine(odd, tmp_path) as eng:
        src = [fill_random(eng.block(Tier.GPU, i)).clone() for i in range(3)]
        ks = [b"\x00raw", "text-\u00e9", -(2**100)]
        await eng.copy(Tier.GPU, [0, 1, 2], Tier.FILE, [0, 1, 2], keys=ks)
    async with make_engine(odd, tmp_path) as eng:
        assert eng.file_tier.entries() == {b"\x00raw": 0, "text-\u00e9": 1, -(2**100): 2}
        await eng.copy(Tier.FILE, [0, 1, 2], Tier.GPU, [5, 6, 7], keys=ks)
        for i in range(3):
            assert_blocks_equal(eng.block(Tier.GPU, 5 + i), src[i])


# --------------------------------------------------------------------------------------------- randomized ordering


@pytest.mark.parametrize("seed", [1, 2, 3])
async def test_random_mix_matches_a_sequential_model(layout: KVLayout, tmp_path, device: str, seed: int) -> None:
    """Random copies among GPU, host and file, issued without awaiting, with stalled file I/O: the fences must
    make the result equal to running them one by one in issue order."""
    import random

    rng = random.Random(seed)
    cfg: dict[str, Any] = dict(
        backend_factory=lambda p: FaultyBackend(_posix(p), stall_writes=0.01, stall_reads=0.005), staging_blocks=2
    )
    async with make_engine(layout, tmp_path, device, blocks=6, **cfg) as eng:
        sizes = {Tier.GPU: 8, Tier.HOST: 8, Tier.FILE: 6}
        model: dict[tuple[Tier, int], torch.Tensor | None] = {(t, i): None for t, n in sizes.items() for i in range(n)}
        for t in (Tier.GPU, Tier.HOST):
            for i in range(8):
                model[(t, i)] = fill_random(eng.block(t, i)).clone().cpu()
        settle(eng)
        pending = []
        routes = [(a, b) for a in sizes for b in sizes if a != b or a is not Tier.FILE]
        version = 0
        for _ in range(60):
            src_t, dst_t = rng.choice(routes)
            k = rng.randint(1, 3)
            candidates = [i for i in range(sizes[src_t]) if model[(src_t, i)] is not None]
            if len(candidates) < k:
                continue
            src = rng.sample(candidates, k)
            pool = [i for i in range(sizes[dst_t]) if src_t is not dst_t or i not in src]
            dst = rng.sample(pool, k)
            kw: dict[str, Any] = {}
            if dst_t is Tier.FILE:
                version += 1
                kw["keys"] = [f"v{version}-{j}".encode() for j in range(k)]
            pending.append(eng.copy(src_t, src, dst_t, dst, **kw))
            for a, b in zip(src, dst, strict=True):
                model[(dst_t, b)] = model[(src_t, a)]
            if rng.random() < 0.1:
                await pending[rng.randrange(len(pending))]
        await asyncio.gather(*pending)
        # read every file slot back through the host tier and compare everything with the model
        for t in (Tier.GPU, Tier.HOST):
            for i in range(8):
                expected = model[(t, i)]
                assert expected is not None
                assert_blocks_equal(eng.block(t, i), expected, f"{t.value} block {i}")
        for s in range(6):
            expected = model[(Tier.FILE, s)]
            if expected is not None:
                await eng.copy(Tier.FILE, [s], Tier.HOST, [0])
                assert_blocks_equal(eng.block(Tier.HOST, 0), expected, f"file slot {s}")
        assert eng.file_tier.statistics().integrity_failures == 0


@pytest.mark.parametrize("seed", [11, 13, 14, 16])
async def test_random_mix_with_faults_never_serves_wrong_data(
    layout: KVLayout, tmp_path, device: str, seed: int
) -> None:
    """Random copies with random ENOSPC/EIO/short writes and reads: every block whose whole history succeeded
    holds exactly what a sequential model says; a failed file write never leaves its slot valid."""
    import random

    rng = random.Random(seed)
    faults: dict[str, Any] = {
        # about one I/O call in ten fails: a copy that reads what a failed copy was writing fails whole, so more
        # would leave no block with a history that all succeeded
        "enospc_on_write": set(rng.sample(range(1, 120), 4)),
        "eio_on_write": set(rng.sample(range(1, 120), 2)),
        "short_write_on": set(rng.sample(range(1, 120), 2)),
        "eio_on_read": set(rng.sample(range(1, 120), 2)),
        "short_read_on": set(rng.sample(range(1, 120), 2)),
    }
    cfg: dict[str, Any] = dict(
        backend_factory=lambda p: FaultyBackend(_posix(p), stall_writes=0.003, **faults), staging_blocks=2
    )
    async with make_engine(layout, tmp_path, device, blocks=6, **cfg) as eng:
        sizes = {Tier.GPU: 8, Tier.HOST: 8, Tier.FILE: 6}
        # (tier, index) -> (content, transfers it depends on); None: never written
        model: dict[tuple[Tier, int], tuple[torch.Tensor, frozenset[int]] | None] = {
            (t, i): None for t, n in sizes.items() for i in range(n)
        }
        for t in (Tier.GPU, Tier.HOST):
            for i in range(8):
                model[(t, i)] = (fill_random(eng.block(t, i)).clone().cpu(), frozenset())
        settle(eng)
        transfers: list[Transfer] = []
        last_write: dict[int, int] = {}  # file slot -> transfer that last wrote it (at issue time)
        reads_from: dict[int, set[int]] = {}  # file->x transfer -> the writes whose data it reads
        read_slots: dict[int, dict[int, int]] = {}  # file->x transfer -> {slot: the write it expects there}
        routes = [(a, b) for a in sizes for b in sizes if a != b or a is not Tier.FILE]
        for step in range(80):
            src_t, dst_t = rng.choice(routes)
            k = rng.randint(1, 3)
            candidates = [i for i in range(sizes[src_t]) if model[(src_t, i)] is not None]
            if src_t is Tier.FILE:  # only slots the index still has (a failed write empties its slot)
                candidates = [i for i in candidates if eng.file_tier.is_valid(i) or eng.file_tier.is_pending(i)]
            if len(candidates) < k:
                continue
            src = rng.sample(candidates, k)
            dst = rng.sample([i for i in range(sizes[dst_t]) if src_t is not dst_t or i not in src], k)
            kw: dict[str, Any] = {"keys": [f"s{step}-{j}".encode() for j in range(k)]} if dst_t is Tier.FILE else {}
            tid = len(transfers)
            transfers.append(eng.copy(src_t, src, dst_t, dst, **kw))
            for a, b in zip(src, dst, strict=True):
                entry = model[(src_t, a)]
                assert entry is not None  # a candidate source was written
                content, deps = entry
                model[(dst_t, b)] = (content, deps | {tid})
            if src_t is Tier.FILE:
                reads_from[tid] = {last_write[a] for a in src}
                read_slots[tid] = {a: last_write[a] for a in src}
            if dst_t is Tier.FILE:
                last_write.update(dict.fromkeys(dst, tid))
            if rng.random() < 0.15:
                await asyncio.gather(transfers[rng.randrange(len(transfers))], return_exceptions=True)
        results = await asyncio.gather(*transfers, return_exceptions=True)
        failed = {i for i, r in enumerate(results) if isinstance(r, BaseException)}
        for r in results:
            assert not isinstance(r, BaseException) or isinstance(r, TransferError), r
        assert failed, "the fault plan should have failed some transfers"
        # never served: a file read succeeded only if every write it read from succeeded
        for reader, writes in reads_from.items():
            if reader not in failed:
                assert not writes & failed, (
                    f"transfer {reader} read slots whose writes {sorted(writes & failed)} failed"
                )
        # never visible: a slot whose last write failed is not valid
        for slot, w in last_write.items():
            if w in failed:
                assert not eng.file_tier.is_valid(slot), f"slot {slot}: its last write failed, yet it is valid"
        # A read that fails verification (a short read: a truncated file) drops the slot it read unless a write
        # has claimed the slot since: a slot whose every write succeeded may be empty, never wrong.
        dropped_by_read = {
            slot
            for tid, slots in read_slots.items()
            if tid in failed
            for slot, write in slots.items()
            if last_write[slot] == write
        }
        checked = 0
        for (t, i), entry in model.items():
            if entry is None or entry[1] & failed:
                continue  # undefined after a failure upstream (allowed), or never written
            content, _ = entry
            if t is Tier.FILE:
                if i in dropped_by_read and not eng.file_tier.is_valid(i):
                    assert eng.file_tier.statistics().integrity_failures > 0, f"slot {i}: dropped, no read failed"
                    continue
                assert eng.file_tier.is_valid(i), f"slot {i}: every write in its history succeeded, yet it is not valid"
                await eng.copy(Tier.FILE, [i], Tier.HOST, [0])
                assert_blocks_equal(eng.block(Tier.HOST, 0), content, f"file slot {i}")
                model[(Tier.HOST, 0)] = None  # overwritten by the check
            else:
                assert_blocks_equal(eng.block(t, i), content, f"{t.value} block {i}")
            checked += 1
        assert checked > 0
        st = eng.file_tier.statistics()
        assert st.pending == 0


# --------------------------------------------------------------------------------------------- index API and config


async def test_index_api(layout: KVLayout, tmp_path) -> None:
    slow: dict[str, Any] = dict(backend_factory=lambda p: FaultyBackend(_posix(p), stall_writes=0.1))
    async with make_engine(layout, tmp_path, **slow) as eng:
        ft = eng.file_tier
        fill_random(eng.block(Tier.HOST, 0))
        w = eng.copy(Tier.HOST, [0], Tier.FILE, [3], keys=[bytearray(b"k")])
        assert ft.is_pending(3) and not ft.is_valid(3) and ft.key_of(3) is None and 3 not in ft.free_slots()
        with pytest.raises(ValueError, match="write in flight"):
            ft.discard(3)
        await w
        # a bytearray key is accepted (normalised to bytes), outside the annotation: deliberately the wrong type
        assert (
            ft.lookup(b"k") == 3 and ft.lookup(bytearray(b"k")) == 3  # type: ignore[arg-type]
            and ft.key_of(3) == b"k"
        )
        ft.discard(3)
        assert ft.lookup(b"k") is None and 3 in ft.free_slots() and ft.entries() == {}
        with pytest.raises(ValueError, match="out of range"):
            ft.key_of(16)
        with pytest.raises(TypeError):
            ft.is_valid("3")  # type: ignore[arg-type]
        assert "valid:0" in repr(ft) and "pending:0" in repr(ft)
    assert ft.closed


async def test_engine_file_arguments_and_env(layout: KVLayout, tmp_path, monkeypatch) -> None:
    with pytest.raises(ValueError, match="both file_dir and file_blocks"):
        TransferEngine(layout, host_blocks=2, device="cpu", file_dir=tmp_path)
    monkeypatch.setenv("TIERED_KV_GDS", "off")
    monkeypatch.setenv("TIERED_KV_FILE_DURABILITY", "fsync")
    monkeypatch.setenv("TIERED_KV_FILE_THREADS", "3")
    async with TransferEngine(layout, host_blocks=2, device="cpu", file_dir=tmp_path, file_blocks=5) as eng:
        ft = eng.file_tier
        assert (ft.num_blocks, ft.durability.value, ft.backend.name, ft.config.io_threads) == (5, "fsync", "posix", 3)
        assert "file:5" in repr(eng)
    monkeypatch.setenv("TIERED_KV_FILE_THREADS", "many")
    with pytest.raises(ValueError, match="TIERED_KV_FILE_THREADS"):
        FileTierConfig.from_env(tmp_path, 4)
    with pytest.raises(ValueError, match="durability"):
        FileTierConfig(tmp_path, 4, durability="sometimes")
    with pytest.raises(ValueError, match="num_blocks"):
        FileTierConfig(tmp_path, 0)
    async with TransferEngine(layout, host_blocks=2, device="cpu") as eng:
        with pytest.raises(ValueError, match="no file tier"):
            eng.file_tier  # noqa: B018
        with pytest.raises(ValueError, match=r"has no file pool \(give it file_blocks\)"):
            eng.copy(Tier.HOST, [0], Tier.FILE, [0], keys=[b"x"])


@pytest.mark.parametrize("split_kv", [False, True])
async def test_layer_major_gpu_pool_round_trip(
    layout: KVLayout, tmp_path, device: str, backend: str, split_kv: bool
) -> None:
    """A vLLM-style GPU pool (one tensor per layer, or per layer and K/V): blocks are gathered into staging
    by the engine's copier, stored contiguously, and scattered back."""
    from tiered_kv import LayerMajorPool

    torch_device = "cuda" if device == "cuda" else "cpu"
    pool = LayerMajorPool.allocate(layout, 6, torch_device, split_kv=split_kv)
    for t in pool.tensors:
        fill_random(t)
    cfg = FileTierConfig(tmp_path, 8, gds="off" if backend == "posix" else "auto", io_threads=2, staging_blocks=2)
    async with TransferEngine(layout, gpu_pool=pool, host_blocks=4, device=device, file_config=cfg) as eng:
        settle(eng)
        src = [pool.block(i).cpu() for i in range(6)]
        await eng.copy(Tier.GPU, [0, 2, 4, 5], Tier.FILE, [7, 1, 0, 3], keys=keys(0, 2, 4, 5))
        await eng.copy(Tier.FILE, [7], Tier.HOST, [0])
        assert_blocks_equal(eng.block(Tier.HOST, 0), src[0], "host copy of a layer-major block")
        await eng.copy(Tier.FILE, [7, 1, 0, 3], Tier.GPU, [1, 3, 2, 0])
        for got, want in ((1, 0), (3, 2), (2, 4), (0, 5)):
            assert_blocks_equal(pool.block(got), src[want], f"gpu block {got}")
