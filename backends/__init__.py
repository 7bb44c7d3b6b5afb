"""Storage backends of tiered_kv (importable as ``tiered_kv.backends``).

Each backend is synchronous and non-blocking: it starts work and returns a completion with ``done()``,
``result()`` and ``add_done_callback()``; the engine is the only async layer. The host DRAM tier is
:class:`tiered_kv.pools.BlockPool` over pinned memory; file backends live in this package, one module each:

* :mod:`tiered_kv.backends.posix` -- ``os.preadv``/``os.pwritev`` (O_DIRECT where the filesystem allows it)
  on a bounded thread pool.
* :mod:`tiered_kv.backends.gds` -- kvikio ``CuFile`` (GPUDirect Storage, or kvikio's compat mode).

A file backend is bound to one open file and moves byte ranges between it and buffers (contiguous host
torch tensors or numpy arrays always, CUDA tensors when ``device_io`` is true). It knows nothing about slots,
headers or checksums: that is :mod:`tiered_kv.file`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol, runtime_checkable

import numpy as np
import torch

__all__ = ["Completion", "FileBackend"]


@runtime_checkable
class Completion(Protocol):
    """A started piece of backend work (``concurrent.futures.Future`` conforms)."""

    def done(self) -> bool:
        """True once the work has finished (successfully or not)."""
        ...

    def result(self, timeout: float | None = None) -> int:
        """Block until finished; return bytes moved or raise the error."""
        ...

    def add_done_callback(self, fn: Callable[[Completion], object]) -> None:
        """Call ``fn(self)`` once finished (from the thread that finished it, or at once if done)."""
        ...


@runtime_checkable
class FileBackend(Protocol):
    """Positional I/O on one open file.

    Attributes:
        name: ``"posix"``, ``"gds"`` or a test backend's name, for logs and statistics.
        device_io: whether ``pread``/``pwrite`` accept CUDA tensors (true GPUDirect Storage).

    Notes:
        Offsets and the total length of one call are multiples of 4096. A completion's result is the
        number of bytes moved; it may be *short* (end of file on a read, a device that took fewer bytes
        on a write) -- the caller checks it. Buffers must stay alive and unchanged until the completion
        is done: a backend does not promise to keep a reference.

        ``before``/``after`` let the caller fill a header (checksum the payload) just before the write, and
        verify what was read, on the thread that does the I/O: no extra thread hop per block. If they
        raise, the completion fails with that error (``before`` raising means nothing was written).
    """

    name: str
    device_io: bool

    def pwrite(
        self, buffers: Sequence[torch.Tensor | np.ndarray], offset: int, *, before: Callable[[], object] | None = None
    ) -> Completion:
        """Write ``buffers`` back to back at ``offset``; ``before()`` runs on the I/O thread first."""
        ...

    def pread(
        self, buffers: Sequence[torch.Tensor | np.ndarray], offset: int, *, after: Callable[[int], object] | None = None
    ) -> Completion:
        """Fill ``buffers`` back to back from ``offset``.

        ``after(nbytes)`` runs on the I/O thread once they are filled.
        """
        ...

    def sync(self, data_only: bool) -> Completion:
        """``fdatasync`` (``data_only``) or ``fsync`` the file."""
        ...

    def close(self) -> None:
        """Wait for started work, then release the file and threads (idempotent)."""
        ...
