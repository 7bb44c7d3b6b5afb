"""file -> host reads: a bounded window of reads in flight, every block verified before the copy succeeds.

The host read path starts at most ``reads_in_flight`` reads at once (not the whole batch: a thousand pending
futures outlive the young GC generations and set off full collections that stall every I/O thread), and
verifies each block on a tier worker. What must hold: a flipped byte anywhere in a slot is still an
IntegrityError that drops only that slot, an I/O error fails the copy without dropping slots, the window is
respected, and a backend that completes inline does not recurse.
"""

from __future__ import annotations

import concurrent.futures
import threading
from pathlib import Path
from typing import Any

import pytest
from helpers import flip_byte
from tiered_kv.backends.posix import PosixBackend

from tiered_kv import FileTierConfig, IntegrityError, KVLayout, Tier, TransferEngine, TransferError
from tiered_kv.slab import HEADER_SIZE
from tiered_kv.testing import FaultyBackend, assert_blocks_equal, fill_random

N = 40
THREADS = 2


class _Counting:
    """Wraps a backend; counts reads started and the most in flight at once (optionally completing inline)."""

    def __init__(self, inner: Any, *, inline: bool = False) -> None:
        self.inner = inner
        self.name = f"counting({inner.name})"
        self.device_io = inner.device_io
        self.inline = inline
        self._lock = threading.Lock()
        self.in_flight = 0
        self.peak = 0
        self.reads = 0

    def pwrite(self, buffers: Any, offset: int, *, before: Any = None) -> Any:
        return self.inner.pwrite(buffers, offset, before=before)

    def pread(self, buffers: Any, offset: int, *, after: Any = None) -> Any:
        with self._lock:
            self.reads += 1
            self.in_flight += 1
            self.peak = max(self.peak, self.in_flight)
        fut = self.inner.pread(buffers, offset, after=after)
        if self.inline:  # finished before the caller sees it: add_done_callback runs the callback at once
            done: concurrent.futures.Future[int] = concurrent.futures.Future()
            try:
                done.set_result(fut.result())
            except BaseException as exc:
                done.set_exception(exc)
            fut = done
        out: concurrent.futures.Future[int] = concurrent.futures.Future()

        def finished(f: Any) -> None:
            with self._lock:
                self.in_flight -= 1
            try:
                out.set_result(f.result())
            except BaseException as exc:
                out.set_exception(exc)

        fut.add_done_callback(finished)
        return out

    def sync(self, data_only: bool) -> Any:
        return self.inner.sync(data_only)

    def close(self) -> None:
        self.inner.close()


def _engine(layout: KVLayout, directory: Path, holder: list[Any], blocks: int = N, **backend: Any) -> TransferEngine:
    def factory(path: str) -> Any:
        inner: Any = PosixBackend(path, threads=THREADS)
        faults = {k: v for k, v in backend.items() if k != "inline"}
        if faults:
            inner = FaultyBackend(inner, **faults)
        b = _Counting(inner, inline=backend.get("inline", False))
        holder.append(b)
        return b

    cfg = FileTierConfig(directory, blocks, gds="off", io_threads=THREADS, backend_factory=factory)
    return TransferEngine(layout, gpu_blocks=0, host_blocks=blocks, device="cpu", file_config=cfg)


async def _fill(eng: TransferEngine, n: int) -> list[Any]:
    src = [fill_random(eng.block(Tier.HOST, i)).clone() for i in range(n)]
    await eng.copy(Tier.HOST, range(n), Tier.FILE, range(n), keys=[f"k{i}".encode() for i in range(n)])
    for i in range(n):
        eng.block(Tier.HOST, i).zero_()
    return src


async def test_window_bounds_reads_in_flight_and_every_block_lands(layout: KVLayout, tmp_path: Path) -> None:
    holder: list[_Counting] = []
    async with _engine(layout, tmp_path, holder) as eng:
        src = await _fill(eng, N)
        window = 4 * THREADS
        await eng.copy(Tier.FILE, range(N), Tier.HOST, range(N))
        for i in range(N):
            assert_blocks_equal(eng.block(Tier.HOST, i), src[i])
        b = holder[0]
        assert b.reads == N
        assert 1 <= b.peak <= window  # not all 40 at once
        st = eng.file_tier.statistics()
        assert (st.blocks_read, st.read_failures, st.integrity_failures) == (N, 0, 0)


@pytest.mark.parametrize("where", ["payload_first", "payload_last", "header_key", "header_tail"])
async def test_flipped_byte_in_one_block_of_a_batch_is_caught(layout: KVLayout, tmp_path: Path, where: str) -> None:
    holder: list[_Counting] = []
    async with _engine(layout, tmp_path, holder) as eng:
        await _fill(eng, N)
        ft = eng.file_tier
        bad = 29  # past the first window: started by a finished read, not by the launch
        base = ft.offset(bad)
        flip_byte(
            ft.path,
            {
                "payload_first": base + HEADER_SIZE,
                "payload_last": base + HEADER_SIZE + layout.bytes_per_block - 1,
                "header_key": base + 77,
                "header_tail": base + HEADER_SIZE - 1,
            }[where],
        )
        with pytest.raises(IntegrityError, match=f"file slot {bad} failed verification"):
            await eng.copy(Tier.FILE, range(N), Tier.HOST, range(N))
        assert not ft.is_valid(bad) and ft.lookup(f"k{bad}".encode()) is None
        assert all(ft.is_valid(s) for s in range(N) if s != bad)  # only the bad slot is dropped
        st = ft.statistics()
        assert st.integrity_failures == 1 and st.blocks_read < N
        # the good slots still read back
        await eng.copy(Tier.FILE, [0, 1], Tier.HOST, [0, 1])


async def test_flipped_byte_is_caught_when_the_backend_completes_inline(layout: KVLayout, tmp_path: Path) -> None:
    # every read is finished before pread returns, so each completion starts the next read at once: 1,500 of
    # them in a row must not recurse (and every block is still verified)
    n = 1500
    holder: list[_Counting] = []
    async with _engine(layout, tmp_path, holder, blocks=n, inline=True) as eng:
        src = await _fill(eng, n)
        await eng.copy(Tier.FILE, range(n), Tier.HOST, range(n))
        for i in (0, 777, n - 1):
            assert_blocks_equal(eng.block(Tier.HOST, i), src[i])
        flip_byte(eng.file_tier.path, eng.file_tier.offset(1234) + HEADER_SIZE + 5)
        with pytest.raises(IntegrityError, match="file slot 1234 failed verification"):
            await eng.copy(Tier.FILE, range(n), Tier.HOST, range(n))
        assert not eng.file_tier.is_valid(1234)


async def test_read_error_fails_the_copy_keeps_the_slots_and_stops_starting_reads(
    layout: KVLayout, tmp_path: Path
) -> None:
    holder: list[_Counting] = []
    async with _engine(layout, tmp_path, holder, eio_on_read=3, stall_reads=0.01) as eng:
        src = await _fill(eng, N)
        with pytest.raises(TransferError, match="reading file slot 2") as info:
            await eng.copy(Tier.FILE, range(N), Tier.HOST, range(N))
        assert not isinstance(info.value, IntegrityError)
        ft = eng.file_tier
        assert all(ft.is_valid(s) for s in range(N))  # an I/O error is not damage: nothing dropped
        assert holder[0].reads < N  # fail fast: reads not started before the failure are not started after
        await eng.copy(Tier.FILE, range(N), Tier.HOST, range(N))
        assert_blocks_equal(eng.block(Tier.HOST, N - 1), src[N - 1])
