"""Issue 11: the file tier under damage, hostile directories and operational errors."""

from __future__ import annotations

import os
from pathlib import Path
from typing import cast

import pytest
import torch

from tiered_kv import KVLayout, StorageError, Tier, TieredKVError, TransferEngine
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
        await engine.copy(Tier.FILE, cast("list[int]", slots), Tier.HOST, [0, 1, 2])  # verified on the way
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


def leftovers(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir()) if directory.is_dir() else []


# ---------------------------------------------------------------------------------------- finding 6


def test_a_symlink_at_the_lock_is_never_followed(small: KVLayout, tmp_path: Path) -> None:
    target = tmp_path / "elsewhere"
    tier_dir = tmp_path / "kv"
    tier_dir.mkdir(mode=0o700)
    (tier_dir / "kv.lock").symlink_to(target)
    with pytest.raises(StorageError, match="symbolic link"):
        FileTier(small, FileTierConfig(tier_dir, 4))
    assert not target.exists(), "the process created a file through the planted symlink"
    (tier_dir / "kv.lock").unlink()
    (tier_dir / "kv.slab").symlink_to(target)
    with pytest.raises(StorageError, match="symbolic link"):
        FileTier(small, FileTierConfig(tier_dir, 4))
    assert not target.exists()


@pytest.mark.skipif(os.geteuid() != 0, reason="planting another user's file needs chown (root)")
def test_a_slab_or_lock_of_another_user_is_refused(small: KVLayout, tmp_path: Path) -> None:
    """Finding 6: a slab planted by another user was opened, chmod'ed and its bytes served as verified."""
    FileTier(small, FileTierConfig(tmp_path, 4)).close()
    slab = tmp_path / "kv.slab"
    os.chown(slab, 4321, 4321)
    os.chmod(slab, 0o666)
    with pytest.raises(StorageError, match="another user"):
        FileTier(small, FileTierConfig(tmp_path, 4))
    assert slab.stat().st_mode & 0o777 == 0o666, "a refused slab must not be chmod'ed"
    os.chown(slab, 0, 0)
    os.chown(tmp_path / "kv.lock", 4321, 4321)
    with pytest.raises(StorageError, match="another user"):
        FileTier(small, FileTierConfig(tmp_path, 4))


def test_a_directory_writable_by_others_must_be_sticky(small: KVLayout, tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    with pytest.raises(StorageError, match="writable by other users"):
        FileTier(small, FileTierConfig(shared, 4))
    assert leftovers(shared) == []
    os.chmod(shared, 0o1777)  # sticky, like /tmp: others cannot replace our files
    FileTier(small, FileTierConfig(shared, 4)).close()
    from tiered_kv.file.place import directory_problem

    os.chmod(shared, 0o777)
    assert "writable by other users" in (directory_problem(shared) or "")


# ---------------------------------------------------------------------------------------- finding 11


def test_operational_errors_are_sentences_and_leave_nothing(small: KVLayout, tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Finding 11: each failure is a TieredKVError naming the path, the size and what to do; no lock file, no
    half-created slab is left behind."""
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    with pytest.raises(StorageError, match="not a directory"):
        FileTier(small, FileTierConfig(a_file, 4))
    dangling = tmp_path / "dangling"
    dangling.symlink_to(tmp_path / "missing")
    with pytest.raises(StorageError, match="dangling symbolic link"):
        FileTier(small, FileTierConfig(dangling, 4))
    # too large for the disk, too large for memory: refused before anything is created
    big = tmp_path / "big"
    with pytest.raises(StorageError, match=r"free: free space there or lower file_blocks") as info:
        FileTier(KVLayout(num_layers=64, num_kv_heads=64, head_dim=256, tokens_per_block=64, dtype=torch.float32),
                 FileTierConfig(big, 2**20))
    assert str(big / "kv.slab") in str(info.value) and "GiB" in str(info.value)
    with pytest.raises(StorageError, match="memory"):
        FileTier(small, FileTierConfig(big, 10**15))
    assert not big.exists(), "the directory created for a refused tier was left behind"
    # ENOSPC while creating the slab
    import tiered_kv.file.recovery as recovery

    def full(fd: int, size: int) -> str:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(recovery, "preallocate", full)
    nospace = tmp_path / "nospace"
    with pytest.raises(StorageError, match="filesystem is full") as info:
        FileTier(small, FileTierConfig(nospace, 4))
    assert isinstance(info.value, TieredKVError) and isinstance(info.value, OSError)
    assert "kv.slab" in str(info.value) and "asked" in str(info.value)
    assert leftovers(nospace) == [], "a lock file or half-created slab was left"
    monkeypatch.undo()
    # a missing parent is created (0700); a directory that cannot be created is a sentence
    deep = tmp_path / "x" / "y"
    FileTier(small, FileTierConfig(deep, 4)).close()
    assert deep.stat().st_mode & 0o777 == 0o700

    def readonly(*args: object, **kwargs: object) -> None:
        raise OSError(30, "Read-only file system")

    monkeypatch.setattr(os, "makedirs", readonly)
    with pytest.raises(StorageError, match="read-only"):
        FileTier(small, FileTierConfig(tmp_path / "ro", 4))


async def test_the_cache_reports_a_bad_file_dir_and_retries_cleanly(small: KVLayout, tmp_path: Path) -> None:
    from tiered_kv import TieredKVCache

    a_file = tmp_path / "f"
    a_file.write_text("x")
    with pytest.raises(StorageError, match="not a directory"):
        TieredKVCache(small, gpu_blocks=4, host_blocks=4, file_blocks=4, file_dir=a_file, device="cpu")
    async with TieredKVCache(small, gpu_blocks=4, host_blocks=4, file_blocks=4, file_dir=tmp_path / "ok", device="cpu"):
        pass


def test_doctor_says_when_a_directory_is_not_safe(tmp_path: Path) -> None:
    import json
    import subprocess
    import sys

    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    out = subprocess.run(
        [sys.executable, "-m", "tiered_kv", "doctor", "--dir", str(shared), "--json", str(tmp_path / "d.json")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    checks = {c["check"]: c for c in json.loads((tmp_path / "d.json").read_text())}
    safe = checks["directory safe for a file tier"]
    assert not safe["ok"] and "writable by other users" in safe["found"], out.stdout


# ---------------------------------------------------------------------------------------- finding 10


class RaisingAtEof:
    """A backend that raises on a read past the end of the file, as kvikio does (POSIX returns a short count).

    kvikio needs a CUDA driver, so on CPU its end-of-file behaviour is modelled here over the real POSIX
    backend; ``test_truncated_slab_under_kvikio`` runs the real one on a GPU machine.
    """

    def __init__(self, path: str) -> None:
        from tiered_kv.backends.posix import PosixBackend

        self.inner = PosixBackend(path, direct=False)
        self.name = "eof-raising"
        self.device_io = False
        self.path = path

    def pread(self, buffers, offset, *, after=None):
        if offset + sum(int(b.nbytes) for b in buffers) > os.stat(self.path).st_size:
            import concurrent.futures

            fut: concurrent.futures.Future[int] = concurrent.futures.Future()
            fut.set_exception(RuntimeError("kvikio: posix read: unexpected end of file"))
            return fut
        return self.inner.pread(buffers, offset, after=after)

    def pwrite(self, buffers, offset, *, before=None):
        return self.inner.pwrite(buffers, offset, before=before)

    def sync(self, data_only):
        return self.inner.sync(data_only)

    def close(self) -> None:
        self.inner.close()


async def read_truncated(layout: KVLayout, directory: Path, factory: object) -> BaseException:
    from tiered_kv.errors import TransferError

    await spill(layout, directory, 3)
    slab = directory / "kv.slab"
    slot_size = (slab.stat().st_size - HEADER_SIZE) // 8
    os.truncate(slab, HEADER_SIZE + 2 * slot_size + HEADER_SIZE + 100)  # slot 2 keeps its header, loses its payload
    cfg = FileTierConfig(directory, 8, backend_factory=factory)  # type: ignore[arg-type]
    async with TransferEngine(layout, host_blocks=3, device="cpu", file_config=cfg) as engine:
        slot = engine.file_tier.lookup("k2")
        assert slot == 2
        with pytest.raises(TransferError) as info:
            await engine.copy(Tier.FILE, [slot], Tier.HOST, [0])
        assert engine.file_tier.lookup("k2") is None, "the damaged slot stays indexed"
        await engine.copy(Tier.FILE, [0], Tier.HOST, [1])  # the intact slots still read
    return info.value


async def test_a_truncated_slab_is_the_same_integrity_error_on_every_backend(small: KVLayout, tmp_path: Path) -> None:
    """Finding 10: a slab truncated under the kvikio backend raised TransferError where POSIX raises
    IntegrityError. Both are IntegrityError naming the truncation."""
    from tiered_kv.backends.posix import PosixBackend

    from tiered_kv.errors import IntegrityError

    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    posix = await read_truncated(small, tmp_path / "a", lambda p: PosixBackend(p, direct=False))
    raising = await read_truncated(small, tmp_path / "b", RaisingAtEof)
    assert isinstance(posix, IntegrityError), repr(posix)
    assert isinstance(raising, IntegrityError), repr(raising)
    assert "truncated" in str(posix) and "truncated" in str(raising)


@pytest.mark.gpu
async def test_truncated_slab_under_kvikio(small: KVLayout, tmp_path: Path) -> None:
    from tiered_kv.backends.gds import GdsBackend

    from tiered_kv.errors import IntegrityError

    pytest.importorskip("kvikio")
    error = await read_truncated(small, tmp_path, lambda p: GdsBackend(p, mode="auto"))
    assert isinstance(error, IntegrityError), repr(error)
