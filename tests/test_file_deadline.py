"""A deadline on every file I/O call: a hung read or write fails its copy in bounded time, never a wrong byte later."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tiered_kv import KVLayout, Tier, TransferEngine, TransferError
from tiered_kv.file import FileTierConfig, FileTimeout
from tiered_kv.file.deadline import DEFAULT_TIMEOUT
from tiered_kv.testing import FaultyBackend, assert_blocks_equal, fill_random

EVERY_CALL = range(1, 1 << 30)


def _faulty(holder: list[FaultyBackend], **faults: object) -> Callable[[str], FaultyBackend]:
    from tiered_kv.backends.posix import PosixBackend

    def factory(path: str) -> FaultyBackend:
        holder.append(FaultyBackend(PosixBackend(path, threads=2), **faults))  # type: ignore[arg-type]
        return holder[-1]

    return factory


def _engine(
    layout: KVLayout, directory: object, factory: Callable[[str], FaultyBackend], **cfg: object
) -> TransferEngine:
    cfg.setdefault("io_threads", 2)
    cfg.setdefault("staging_blocks", 4)
    config = FileTierConfig(directory, 8, gds="off", backend_factory=factory, **cfg)  # type: ignore[arg-type]
    return TransferEngine(layout, gpu_blocks=4, host_blocks=4, device="cpu", file_config=config)


async def _until(what: Callable[[], bool], seconds: float = 10.0) -> None:
    end = time.monotonic() + seconds
    while not what():
        assert time.monotonic() < end, "timed out waiting"
        await asyncio.sleep(0.01)


def test_the_default_deadline_is_finite() -> None:
    assert FileTierConfig("/tmp/x", 1).timeout == DEFAULT_TIMEOUT == 5.0
    for bad in (0, -1, float("inf"), float("nan"), "5", True):
        with pytest.raises(ValueError, match="timeout"):
            FileTierConfig("/tmp/x", 1, timeout=bad)  # type: ignore[arg-type]
    assert FileTierConfig("/tmp/x", 1, timeout=None).timeout is None


def test_the_deadline_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TIERED_KV_FILE_TIMEOUT", "0.5")
    assert FileTierConfig.from_env("/tmp/x", 1).timeout == 0.5
    monkeypatch.setenv("TIERED_KV_FILE_TIMEOUT", "off")
    assert FileTierConfig.from_env("/tmp/x", 1).timeout is None
    monkeypatch.setenv("TIERED_KV_FILE_TIMEOUT", "0")
    with pytest.raises(ValueError, match="TIERED_KV_FILE_TIMEOUT"):
        FileTierConfig.from_env("/tmp/x", 1)


async def test_a_stalled_file_read_ends_within_the_default_deadline(layout: KVLayout, tmp_path: Path) -> None:
    holder: list[FaultyBackend] = []
    eng = _engine(layout, tmp_path, _faulty(holder, hang_on_read=EVERY_CALL))
    try:
        block = fill_random(eng.block(Tier.HOST, 0)).clone()
        await eng.copy(Tier.HOST, [0], Tier.FILE, [0], keys=[b"k0"])
        t0 = time.monotonic()
        with pytest.raises(FileTimeout, match="took longer than 5 s"):
            await eng.copy(Tier.FILE, [0], Tier.HOST, [1])
        elapsed = time.monotonic() - t0
        assert DEFAULT_TIMEOUT * 0.9 <= elapsed <= DEFAULT_TIMEOUT + 2.0, elapsed
        assert isinstance(FileTimeout("x"), TransferError)
        # the failed copy's block is reused for other data; the hung read then returns: not one byte of it lands
        other = fill_random(eng.block(Tier.HOST, 1)).clone()
        holder[0].release()
        await _until(lambda: holder[0].hung == 0 and eng.file_tier.statistics().timeouts == 1)
        await asyncio.sleep(0.1)
        assert_blocks_equal(eng.block(Tier.HOST, 1), other, "the block the late read targeted")
        assert eng.file_tier.is_valid(0)  # a timed-out read says nothing about the slot
        await eng.copy(Tier.FILE, [0], Tier.HOST, [2])
        assert_blocks_equal(eng.block(Tier.HOST, 2), block)
    finally:
        holder[0].release()
        await eng.close()


async def test_a_hung_write_fails_and_its_slot_waits_for_it(layout: KVLayout, tmp_path: Path) -> None:
    holder: list[FaultyBackend] = []
    async with _engine(layout, tmp_path, _faulty(holder, hang_on_write=1), timeout=0.3) as eng:
        src = fill_random(eng.block(Tier.HOST, 0)).clone()
        t0 = time.monotonic()
        with pytest.raises(FileTimeout):
            await eng.copy(Tier.HOST, [0], Tier.FILE, [0], keys=[b"k0"])
        assert time.monotonic() - t0 < 2.0
        assert not eng.file_tier.is_valid(0) and eng.file_tier.lookup(b"k0") is None
        # the slot is not written again while the late write may still land on it
        with pytest.raises(TransferError, match="still runs"):
            await eng.copy(Tier.HOST, [0], Tier.FILE, [0], keys=[b"k0"])
        await eng.copy(Tier.HOST, [0], Tier.FILE, [1], keys=[b"k1"])  # other slots are written as usual
        holder[0].release()
        await _until(lambda: holder[0].hung == 0)
        await _until(lambda: eng.file_tier._deadline is not None and eng.file_tier._deadline.late == 0)
        await eng.copy(Tier.HOST, [0], Tier.FILE, [0], keys=[b"k0"])
        await eng.copy(Tier.FILE, [0], Tier.HOST, [3])
        assert_blocks_equal(eng.block(Tier.HOST, 3), src)


async def test_a_hung_staged_read_holds_its_staging_block(layout: KVLayout, tmp_path: Path) -> None:
    holder: list[FaultyBackend] = []
    async with _engine(layout, tmp_path, _faulty(holder, hang_on_read=1), timeout=0.3) as eng:
        fill_random(eng.block(Tier.GPU, 0))
        await eng.copy(Tier.GPU, [0], Tier.FILE, [0], keys=[b"k0"])
        target = fill_random(eng.block(Tier.GPU, 1)).clone()
        with pytest.raises(FileTimeout):
            await eng.copy(Tier.FILE, [0], Tier.GPU, [1])
        ring = eng.file_tier._staging_ring()
        assert ring.held == 1  # the late read may still write into it
        assert_blocks_equal(eng.block(Tier.GPU, 1), target)
        await eng.copy(Tier.FILE, [0], Tier.GPU, [2])  # the ring's other blocks carry on
        holder[0].release()
        await _until(lambda: ring.held == 0)
        assert_blocks_equal(eng.block(Tier.GPU, 1), target)


async def test_every_slot_hung_fails_new_reads_at_once(layout: KVLayout, tmp_path: Path) -> None:
    holder: list[FaultyBackend] = []
    async with _engine(layout, tmp_path, _faulty(holder, hang_on_read=EVERY_CALL), timeout=0.3, io_threads=1) as eng:
        for i in range(4):
            fill_random(eng.block(Tier.HOST, i))
        await eng.copy(Tier.HOST, [0, 1, 2, 3], Tier.FILE, [0, 1, 2, 3], keys=[b"a", b"b", b"c", b"d"])
        t0 = time.monotonic()
        with pytest.raises(FileTimeout):
            await eng.copy(Tier.FILE, [0, 1, 2], Tier.HOST, [0, 1, 2])  # two I/O slots: the third never starts
        assert time.monotonic() - t0 < 2.0
        t0 = time.monotonic()
        with pytest.raises(FileTimeout, match="slots are held"):
            await eng.copy(Tier.FILE, [3], Tier.HOST, [3])
        assert time.monotonic() - t0 < 0.2
        holder[0].release()


async def test_close_is_bounded_while_a_read_hangs(
    layout: KVLayout, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    holder: list[FaultyBackend] = []
    eng = _engine(layout, tmp_path, _faulty(holder, hang_on_read=EVERY_CALL), timeout=0.3)
    try:
        fill_random(eng.block(Tier.HOST, 0))
        await eng.copy(Tier.HOST, [0], Tier.FILE, [0], keys=[b"k0"])
        read = eng.copy(Tier.FILE, [0], Tier.HOST, [1])
        t0 = time.monotonic()
        await eng.close()
        assert time.monotonic() - t0 < 3.0
        with pytest.raises(FileTimeout):
            await read
        assert "past their deadline" in caplog.text and holder[0].hung == 1
    finally:
        holder[0].release()


def test_close_ends_the_watchdog_thread_before_it_returns() -> None:
    """A soak saw a ``tiered_kv-file-deadline`` thread still alive right after close() (it only had been told to
    stop): close() now waits for it."""
    import concurrent.futures
    import threading
    from types import SimpleNamespace

    from tiered_kv.file.deadline import DeadlineBackend

    def done(*args: object, **kwargs: object) -> concurrent.futures.Future[int]:
        f: concurrent.futures.Future[int] = concurrent.futures.Future()
        f.set_result(0)
        return f

    inner = SimpleNamespace(name="stub", device_io=False, path="/stub", pwrite=done, pread=done, close=lambda: None)
    for _ in range(20):
        backend = DeadlineBackend(inner, timeout=5.0, limit=2)
        backend.pwrite([], 0).result()  # the first call starts the watchdog
        assert any(t.name == "tiered_kv-file-deadline" for t in threading.enumerate())
        backend.close()
        alive = [t for t in threading.enumerate() if t.name == "tiered_kv-file-deadline"]
        assert alive == [], alive
