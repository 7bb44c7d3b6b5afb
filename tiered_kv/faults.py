"""A fault-injecting file backend for tests (re-exported by :mod:`tiered_kv.testing`).

Primitives:

* :class:`FaultyBackend` -- a :class:`~tiered_kv.backends.FileBackend` wrapper injecting ENOSPC, EIO, EINVAL,
  short transfers, stalls and hangs (a call that does not return until :meth:`~FaultyBackend.release`) on
  chosen calls.

:class:`FaultyBackend` wraps a real :class:`~tiered_kv.backends.FileBackend` and, on chosen calls, fails
with an ``OSError`` (ENOSPC, EIO, EINVAL as O_DIRECT gives it), transfers only part of the bytes, stalls
first, or hangs like a stalled disk or a hung NFS mount (the call does its I/O only once released, so a
late read still lands in its buffers). Calls are counted from 1 per direction, so a test can say *exactly*
which block fails::

    from tiered_kv.testing import FaultyBackend
    from tiered_kv.backends.posix import PosixBackend

    cfg = FileTierConfig(tmp_path, 16, backend_factory=lambda p: FaultyBackend(PosixBackend(p), enospc_on_write=3))
    # the 3rd slot written fails with ENOSPC -> the transfer raises TransferError, the slot stays invalid

The file tier writes one slot (header + payload) per ``pwrite`` and reads one per ``pread``, so "the k-th
write" is "the k-th block written".
"""

from __future__ import annotations

import concurrent.futures
import errno
import os
import random
import threading
import time
from collections.abc import Callable, Collection, Iterator, Sequence
from typing import Any

import numpy as np
import torch

from tiered_kv.backends import Completion, FileBackend
from tiered_kv.backends.posix import DIRECT_ALIGN, Buffer

__all__ = ["FaultSwitch", "FaultyBackend", "RandomFaults", "random_faults"]

Calls = int | Collection[int] | None


def _hits(spec: Calls, n: int) -> bool:
    if spec is None:
        return False
    if isinstance(spec, int):
        return n == spec
    return n in spec


def _truncate(buffers: Sequence[Buffer], nbytes: int) -> list[Buffer]:
    out: list[Buffer] = []
    for b in buffers:
        if nbytes <= 0:
            break
        flat = b.reshape(-1).view(np.uint8) if isinstance(b, np.ndarray) else b.reshape(-1).view(torch.uint8)
        out.append(flat[:nbytes] if flat.shape[0] > nbytes else flat)
        nbytes -= flat.shape[0]
    return out


class FaultyBackend:
    """Wrap ``inner`` and inject faults on chosen calls (1-based, counted per direction).

    Args:
        inner: the backend that does the real I/O.
        enospc_on_write / eio_on_write / einval_on_write: write calls that raise ``OSError`` with that errno
            and write nothing.
        eio_on_read: read calls that raise ``OSError(EIO)``.
        short_write_on: write calls that write only the first half (rounded down to 4096, at least 4096
            bytes) and report that count.
        short_read_on: read calls that read only the first half and report that count.
        stall_writes / stall_reads: seconds every write / read waits before it starts (on a worker thread;
            the caller never blocks).
        hang_on_write / hang_on_read: write / read calls that block until :meth:`release` (or :meth:`close`),
            then do their I/O.

    Attributes:
        writes / reads: calls seen so far. ``faults``: faults injected so far. ``hung``: calls hanging now.
    """

    def __init__(
        self,
        inner: FileBackend,
        *,
        enospc_on_write: Calls = None,
        eio_on_write: Calls = None,
        einval_on_write: Calls = None,
        eio_on_read: Calls = None,
        short_write_on: Calls = None,
        short_read_on: Calls = None,
        stall_writes: float = 0.0,
        stall_reads: float = 0.0,
        hang_on_write: Calls = None,
        hang_on_read: Calls = None,
    ) -> None:
        self.inner = inner
        self.name = f"faulty({inner.name})"
        self.device_io = inner.device_io
        self._write_errors = (
            (enospc_on_write, errno.ENOSPC),
            (eio_on_write, errno.EIO),
            (einval_on_write, errno.EINVAL),
        )
        self._read_errors = ((eio_on_read, errno.EIO),)
        self._short_write_on = short_write_on
        self._short_read_on = short_read_on
        self._stall_writes = stall_writes
        self._stall_reads = stall_reads
        self._hang_on_write = hang_on_write
        self._hang_on_read = hang_on_read
        self._released = threading.Event()
        self._lock = threading.Lock()
        self._pool = concurrent.futures.ThreadPoolExecutor(8, thread_name_prefix="tiered_kv-faulty")
        self.writes = 0
        self.reads = 0
        self.faults = 0
        self.hung = 0

    def release(self) -> None:
        """Let every hung call (and every later one that would hang) go on with its I/O."""
        self._released.set()

    def _run(self, write: bool, buffers: Sequence[Buffer], offset: int, hook: Any) -> concurrent.futures.Future[int]:
        with self._lock:
            if write:
                self.writes += 1
                n = self.writes
            else:
                self.reads += 1
                n = self.reads
        errors = self._write_errors if write else self._read_errors
        code = next((c for spec, c in errors if _hits(spec, n)), None)
        short = _hits(self._short_write_on if write else self._short_read_on, n)
        stall = self._stall_writes if write else self._stall_reads
        hang = _hits(self._hang_on_write if write else self._hang_on_read, n)
        if code is not None or short or hang:
            with self._lock:
                self.faults += 1
        keep = tuple(buffers)

        def work() -> int:
            if stall:
                time.sleep(stall)
            if hang and not self._released.is_set():
                with self._lock:
                    self.hung += 1
                self._released.wait()
                with self._lock:
                    self.hung -= 1
            if code is not None:
                raise OSError(code, f"{os.strerror(code)} (injected on {'write' if write else 'read'} #{n})")
            bufs = list(keep)
            if short:
                total = sum(int(b.nbytes) for b in bufs)
                bufs = _truncate(bufs, max(DIRECT_ALIGN, total // 2 // DIRECT_ALIGN * DIRECT_ALIGN))
            fut = self.inner.pwrite(bufs, offset, before=hook) if write else self.inner.pread(bufs, offset, after=hook)
            return fut.result()

        return self._pool.submit(work)

    def pwrite(
        self,
        buffers: Sequence[Buffer],
        offset: int,
        *,
        before: Callable[[], object] | None = None,
    ) -> concurrent.futures.Future[int]:
        """Write through the wrapped backend, with the faults configured for this call."""
        return self._run(True, buffers, offset, before)

    def pread(
        self,
        buffers: Sequence[Buffer],
        offset: int,
        *,
        after: Callable[[int], object] | None = None,
    ) -> concurrent.futures.Future[int]:
        """Read through the wrapped backend, with the faults configured for this call."""
        return self._run(False, buffers, offset, after)

    def sync(self, data_only: bool) -> Completion:
        """Sync the wrapped backend."""
        return self.inner.sync(data_only)

    def close(self) -> None:
        """Release hung calls, stop the fault threads and close the wrapped backend."""
        self.release()
        self._pool.shutdown(wait=True)
        self.inner.close()

    def __repr__(self) -> str:
        return f"<FaultyBackend writes:{self.writes} reads:{self.reads} faults:{self.faults} inner={self.inner!r}>"


class RandomFaults:
    """A seeded, stateless set of 1-based call numbers: ``n in faults`` for about ``rate`` of all ``n``.

    Pass it as a :class:`FaultyBackend` call set (``eio_on_write=RandomFaults(seed, 0.01, "eio-w")``): which calls
    fail is a function of ``(seed, salt, n)`` alone, so a soak's faults replay with its seed.
    """

    def __init__(self, seed: int, rate: float, salt: str) -> None:
        self._seed = seed
        self._rate = rate
        self._salt = salt

    def __contains__(self, n: object) -> bool:
        return isinstance(n, int) and random.Random(f"{self._seed}:{self._salt}:{n}").random() < self._rate

    def __iter__(self) -> Iterator[int]:  # a Collection for FaultyBackend's type; never iterated
        return iter(())

    def __len__(self) -> int:
        return 0


class FaultSwitch:
    """A call set that holds every call while :attr:`on` is set (``hang_on_read=switch``: the disk stalls on demand)."""

    def __init__(self) -> None:
        self.on = False

    def __contains__(self, n: object) -> bool:
        return self.on

    def __iter__(self) -> Iterator[int]:  # a Collection for FaultyBackend's type; never iterated
        return iter(())

    def __len__(self) -> int:
        return 0


def random_faults(inner: FileBackend, seed: int, rate: float) -> FaultyBackend:
    """``inner`` with about ``rate`` of its calls failing: EIO, ENOSPC, short writes; EIO, short reads."""
    r = rate / 3  # three kinds per direction
    return FaultyBackend(
        inner,
        eio_on_write=RandomFaults(seed, r, "eio-w"),
        enospc_on_write=RandomFaults(seed, r, "enospc-w"),
        short_write_on=RandomFaults(seed, r, "short-w"),
        eio_on_read=RandomFaults(seed, r, "eio-r"),
        short_read_on=RandomFaults(seed, r, "short-r"),
    )
