"""POSIX file backend: aligned positional vectored I/O on a bounded thread pool.

Primitives:

* :class:`PosixBackend` -- ``pwrite``/``pread`` of tensor buffers at an offset (one ``os.pwritev`` /
  ``os.preadv`` per call, retried on partial transfers), ``sync``; work runs on ``threads`` threads and
  each call returns a ``concurrent.futures.Future`` (a :class:`~tiered_kv.backends.Completion`).
* :func:`direct_io_supported` -- whether a directory's filesystem takes ``O_DIRECT``; probed once per
  directory and cached.
* :func:`create_file` / :func:`preallocate` -- a 0600 file, preallocated with ``posix_fallocate`` and a
  sparse ``ftruncate`` fallback.

Notes:
    ``O_DIRECT`` needs the buffer address, its length and the file offset aligned to the device's logical
    block size; we require :data:`DIRECT_ALIGN` (4096), which is safe on every device. Calls whose buffers
    are all aligned go straight to the ``O_DIRECT`` descriptor (zero copy: a pinned host pool is page
    aligned); otherwise the bytes go through a per-thread aligned bounce buffer and still use ``O_DIRECT``.
    On a filesystem without ``O_DIRECT`` (tmpfs on older kernels, some FUSE mounts) the backend uses the
    page cache.
"""

from __future__ import annotations

import concurrent.futures
import errno
import logging
import os
import threading
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

__all__ = [
    "DIRECT_ALIGN",
    "Buffer",
    "PosixBackend",
    "aligned_empty",
    "create_file",
    "direct_io_supported",
    "preallocate",
]

log = logging.getLogger(__name__)

#: Alignment of buffers, lengths and offsets for O_DIRECT (and of every slab slot).
DIRECT_ALIGN = 4096

#: What backends read into and write from: contiguous host tensors or numpy arrays (CUDA tensors with GDS).
Buffer = torch.Tensor | np.ndarray

_O_DIRECT = getattr(os, "O_DIRECT", 0)
_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)

_direct_lock = threading.Lock()
_direct_cache: dict[str, bool] = {}  # real directory path -> O_DIRECT works there


def aligned_empty(nbytes: int, align: int = DIRECT_ALIGN) -> torch.Tensor:
    """A CPU ``uint8`` tensor of ``nbytes`` whose address is a multiple of ``align``."""
    raw = np.empty(nbytes + align, dtype=np.uint8)
    start = (-raw.ctypes.data) % align
    return torch.from_numpy(raw[start : start + nbytes])


def direct_io_supported(directory: str | os.PathLike[str]) -> bool:
    """Whether files in ``directory`` can be opened and written with ``O_DIRECT`` (cached per directory).

    The probe creates a hidden 0600 file, writes one aligned 4 KiB block with ``O_DIRECT`` and removes it.
    """
    if not _O_DIRECT:
        return False
    key = os.path.realpath(directory)
    with _direct_lock:
        cached = _direct_cache.get(key)
        if cached is not None:
            return cached
        probe = os.path.join(key, f".tiered_kv-direct-probe-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        ok = False
        try:
            fd = os.open(probe, os.O_RDWR | os.O_CREAT | os.O_EXCL | _O_DIRECT | _O_CLOEXEC, 0o600)
        except OSError as exc:
            log.info("O_DIRECT is not available in %s (%s); using the page cache", key, exc)
        else:
            try:
                buf = aligned_empty(DIRECT_ALIGN).numpy()
                buf[:] = 0
                ok = os.pwrite(fd, buf.data, 0) == DIRECT_ALIGN
            except OSError as exc:
                log.info("O_DIRECT writes fail in %s (%s); using the page cache", key, exc)
            finally:
                os.close(fd)
                os.unlink(probe)
        _direct_cache[key] = ok
        return ok


def create_file(path: str | os.PathLike[str]) -> int:
    """Create ``path`` (it must not exist) with mode 0600 and return a read/write descriptor."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | _O_CLOEXEC, 0o600)
    os.fchmod(fd, 0o600)  # explicit: the umask can only remove bits, but be sure of the result
    return fd


def preallocate(fd: int, size: int) -> str:
    """Reserve ``size`` bytes for ``fd``: ``"fallocate"`` if the filesystem did it, else ``"truncate"`` (sparse).

    Raises:
        OSError: ENOSPC and other real failures (not "unsupported").
    """
    try:
        os.posix_fallocate(fd, 0, size)
        return "fallocate"
    except OSError as exc:
        if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
            raise
    os.ftruncate(fd, size)
    return "truncate"


def _host_views(buffers: Sequence[Buffer]) -> list[memoryview]:
    views = []
    for b in buffers:
        if isinstance(b, np.ndarray):
            if not b.flags.c_contiguous:
                raise ValueError("buffers must be contiguous")
            views.append(b.data.cast("B"))
            continue
        if not isinstance(b, torch.Tensor):
            raise TypeError(f"buffers must be torch tensors or numpy arrays, got {type(b).__name__}")
        if b.device.type != "cpu":
            raise TypeError(f"the posix backend needs host buffers, got one on {b.device}")
        if not b.is_contiguous():
            raise ValueError("buffers must be contiguous")
        views.append(b.reshape(-1).view(torch.uint8).numpy().data)
    return views


def _aligned(buffers: Sequence[Buffer]) -> bool:
    for b in buffers:
        ptr, nbytes = (b.ctypes.data, b.nbytes) if isinstance(b, np.ndarray) else (b.data_ptr(), b.nbytes)
        if ptr % DIRECT_ALIGN or nbytes % DIRECT_ALIGN:
            return False
    return True


def _advance(views: list[memoryview], n: int) -> list[memoryview]:
    """The part of ``views`` after the first ``n`` bytes."""
    out = []
    for v in views:
        if n >= len(v):
            n -= len(v)
            continue
        out.append(v[n:] if n else v)
        n = 0
    return out


class PosixBackend:
    """``os.pwritev`` / ``os.preadv`` on one file, on a bounded thread pool.

    Args:
        path: an existing file.
        threads: I/O threads (requests in flight at once).
        direct: use ``O_DIRECT``; ``None`` probes the file's directory once (:func:`direct_io_supported`).

    Notes:
        Every call keeps references to its buffers until its future is done. A short result happens only
        at end of file (read) or when the kernel accepts no more bytes (write); partial transfers are
        retried until then.
    """

    name = "posix"
    device_io = False

    def __init__(self, path: str | os.PathLike[str], *, threads: int = 4, direct: bool | None = None) -> None:
        if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
            raise ValueError(f"threads must be a positive int, got {threads!r}")
        self.path = os.fspath(path)
        if direct is None:
            direct = direct_io_supported(os.path.dirname(os.path.abspath(self.path)))
        self.direct = bool(direct and _O_DIRECT)
        self._fd = os.open(self.path, os.O_RDWR | _O_CLOEXEC)
        self._dfd = os.open(self.path, os.O_RDWR | _O_DIRECT | _O_CLOEXEC) if self.direct else -1
        self._pool = concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="tiered_kv-posix")
        self._local = threading.local()  # per-thread aligned bounce buffer
        self._closed = False
        self.threads = threads
        self.bounced = 0  # calls that went through the bounce buffer (unaligned buffers with O_DIRECT)

    # -------------------------------------------------------------------------------- public

    def pwrite(
        self, buffers: Sequence[Buffer], offset: int, *, before: Callable[[], object] | None = None
    ) -> concurrent.futures.Future[int]:
        """Write ``buffers`` back to back at ``offset``; the future's result is the bytes written.

        ``before()`` runs on the I/O thread just before the write (e.g. to fill a header).
        """
        views = _host_views(buffers)
        direct = self.direct and _aligned(buffers)
        return self._submit(self._write, views, offset, direct, (tuple(buffers), before))

    def pread(
        self, buffers: Sequence[Buffer], offset: int, *, after: Callable[[int], object] | None = None
    ) -> concurrent.futures.Future[int]:
        """Fill ``buffers`` back to back from ``offset``; the future's result is the bytes read.

        ``after(nbytes)`` runs on the I/O thread once the buffers are filled (e.g. to verify them).
        """
        views = _host_views(buffers)
        direct = self.direct and _aligned(buffers)
        return self._submit(self._read, views, offset, direct, (tuple(buffers), after))

    def sync(self, data_only: bool) -> concurrent.futures.Future[int]:
        """``fdatasync`` (``data_only``) or ``fsync``; the result is 0."""

        def run() -> int:
            (os.fdatasync if data_only else os.fsync)(self._fd)
            return 0

        if self._closed:
            raise RuntimeError("the posix backend is closed")
        return self._pool.submit(run)

    def close(self) -> None:
        """Wait for started work, then release the file and threads (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self._pool.shutdown(wait=True)
        os.close(self._fd)
        if self._dfd >= 0:
            os.close(self._dfd)

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return (
            f"<PosixBackend {self.path} [{state}, direct:{self.direct}, threads:{self.threads}, "
            f"bounced:{self.bounced}]>"
        )

    # -------------------------------------------------------------------------------- internals

    def _submit(self, fn, views, offset, direct, keep) -> concurrent.futures.Future[int]:  # type: ignore[no-untyped-def]
        if self._closed:
            raise RuntimeError("the posix backend is closed")
        if offset < 0:
            raise ValueError(f"offset must be >= 0, got {offset}")
        # ``keep`` = (tensors, hook): the tensors stay referenced until the worker is done with their memory.
        return self._pool.submit(fn, views, offset, direct, keep)

    def _bounce(self, nbytes: int) -> memoryview:
        buf = getattr(self._local, "buf", None)
        if buf is None or len(buf) < nbytes:
            size = -(-nbytes // (1 << 20)) << 20  # grow in MiB steps
            self._local.tensor = aligned_empty(size)
            buf = self._local.buf = memoryview(self._local.tensor.numpy())
        return buf[:nbytes]

    def _write(self, views: list[memoryview], offset: int, direct: bool, keep: tuple[object, Any]) -> int:
        if keep[1] is not None:
            keep[1]()
        total = sum(len(v) for v in views)
        fd = self._fd
        # O_DIRECT only for whole aligned blocks of the file; anything else goes through the page cache.
        if self.direct and total % DIRECT_ALIGN == 0 and offset % DIRECT_ALIGN == 0:
            fd = self._dfd
            if not direct:  # unaligned buffers: gather into an aligned bounce buffer, still O_DIRECT
                self.bounced += 1
                bounce = self._bounce(total)
                pos = 0
                for v in views:
                    bounce[pos : pos + len(v)] = v
                    pos += len(v)
                views = [bounce]
        done = 0
        todo = views
        while done < total:
            n = os.pwritev(fd, todo, offset + done)
            if n <= 0:
                break
            done += n
            todo = _advance(todo, n)
        return min(done, total)

    def _read(self, views: list[memoryview], offset: int, direct: bool, keep: tuple[object, Any]) -> int:
        total = sum(len(v) for v in views)
        fd = self._fd
        targets = views
        bounce = None
        if self.direct and total % DIRECT_ALIGN == 0 and offset % DIRECT_ALIGN == 0:
            fd = self._dfd
            if not direct:
                self.bounced += 1
                bounce = self._bounce(total)
                targets = [bounce]
        done = 0
        todo = targets
        while done < total:
            n = os.preadv(fd, todo, offset + done)
            if n <= 0:  # end of file
                break
            done += n
            todo = _advance(todo, n)
        done = min(done, total)
        if bounce is not None:
            pos = 0
            for v in views:
                k = max(0, min(len(v), done - pos))
                v[:k] = bounce[pos : pos + k]
                pos += len(v)
        if keep[1] is not None:
            keep[1](done)
        return done
