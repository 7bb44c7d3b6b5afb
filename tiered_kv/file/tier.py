"""The file tier: one self-verifying slab file per pool, its slot index, and the I/O into and out of it.

Primitives:

* :class:`FileTier` -- opens (or creates) the slab, rebuilds the index from the slot headers (warm restart,
  :mod:`~tiered_kv.file.recovery`), owns the backend, worker threads and staging ring the I/O pipeline
  (:mod:`~tiered_kv.file.pipeline`) works through, and answers index questions: :meth:`~FileTier.lookup`
  (content key -> slot), :meth:`~FileTier.key_of`, :meth:`~FileTier.is_valid`, :meth:`~FileTier.entries`,
  :meth:`~FileTier.free_slots`, :meth:`~FileTier.discard`. :meth:`~FileTier.read_batch` /
  :meth:`~FileTier.write_batch` make the :class:`~tiered_kv.file.pipeline.FileCopy` of one batch.
* :class:`FileTierStatistics` -- a frozen snapshot.

Guarantees:

* A write marks its slots *pending* at ``copy()`` time (lookups stop returning them) and *valid* only after
  every block of the transfer was written in full (and synced, per :class:`Durability`). Any failure
  (ENOSPC, EIO, short write, O_DIRECT EINVAL) fails the transfer with :class:`TransferError` and leaves every
  destination slot of it empty; the source blocks are untouched.
* Every block read is verified -- header checksum, magic, format version, layout fingerprint, slot index,
  content key and generation against the index, payload length and xxh3-128 payload checksum -- before the
  transfer succeeds. A mismatch (or a short read: a truncated file) raises :class:`IntegrityError` and drops
  the slot from the index; the destination block is not reported valid.
* Every backend call has a deadline (``FileTierConfig.timeout``, :mod:`~tiered_kv.file.deadline`): a call that
  hangs fails its transfer with ``FileTimeout`` within that time, and :meth:`FileTier.close` waits at most one
  more ``timeout`` for such calls before it leaves them behind (with the slab's descriptor, which they use).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import logging
import os
import threading
import warnings

import numpy as np
import torch

from ..backends import FileBackend
from ..backends.posix import aligned_empty
from ..copyops import Copier
from ..device import Device, Stream, resolve_device
from ..layer_major import LayerMajorPool
from ..layout import KVLayout
from ..pools import BlockPool, Tier, check_indices
from ..slab import Key
from .config import Durability, FileTierConfig, SlabGeometry
from .deadline import BouncePool, DeadlineBackend
from .index import SlotIndex, SlotState
from .pipeline import FileCopy, IoCounters, SlabIO
from .place import check_space, prepare_directory
from .recovery import OpenReport, open_slab, take_lock
from .ring import StagingRing, group_size, measure_legs, ring_depth

__all__ = ["FileTier", "FileTierStatistics"]

log = logging.getLogger(__name__)

_ABANDONED: list[FileBackend] = []  # backends left open at close(): a call past its deadline still uses them


@dataclasses.dataclass(frozen=True, slots=True)
class FileTierStatistics:
    """A snapshot of a :class:`FileTier`."""

    path: str
    backend: str
    direct: bool
    durability: str
    num_slots: int
    valid: int
    pending: int
    blocks_written: int
    blocks_read: int
    bytes_written: int
    bytes_read: int
    write_failures: int
    read_failures: int
    integrity_failures: int
    open_report: OpenReport
    timeouts: int = 0
    """Backend calls failed by the deadline (or refused while every I/O slot was held by such calls)."""


def _remove_dir_if_empty(directory: str | os.PathLike[str], created: bool) -> None:
    if created:
        with contextlib.suppress(OSError):
            os.rmdir(directory)


class FileTier:
    """A slab file of fixed-size, self-verifying slots and the index of what they hold.

    Args:
        layout: block geometry (its fingerprint guards every slot).
        config: where and how.
        device: the engine's device (staging memory is pinned on CUDA).

    Raises:
        LayoutMismatchError: the slab was written for another layout (or is not a slab) and
            ``discard_mismatch`` is false.
        BackendUnavailable: GDS mode ON where GDS is not available.
        OSError: the directory or file cannot be created (ENOSPC while preallocating, permissions).

    Notes:
        The tier is a medium of the engine (``name``, ``num_blocks``, ``check``): its slots are fenced like
        other pools' blocks. Index reads are thread-safe; the index (:class:`~tiered_kv.file.index.SlotIndex`)
        is changed by ``copy()`` (on the loop) and by completions (on I/O threads) under its lock.
    """

    tier = Tier.FILE
    name = "file"

    def __init__(self, layout: KVLayout, config: FileTierConfig, *, device: Device | None = None) -> None:
        self.layout = layout
        self.config = config
        self.device = device if device is not None else resolve_device("cpu")
        self.durability = Durability.coerce(config.durability)
        self.geometry = SlabGeometry.of(layout, config.num_blocks)
        self.num_blocks = config.num_blocks
        self.payload_bytes = self.geometry.payload_bytes
        self.slot_size = self.geometry.slot_size
        self.pad_bytes = self.geometry.pad_bytes
        # Checked before anything is created (tiered_kv.file.place).
        created_dir = prepare_directory(config.directory)
        self.path = os.path.join(os.fspath(config.directory), f"{config.name}.slab")
        try:
            existing = os.lstat(self.path).st_size
        except FileNotFoundError:
            existing = 0
        try:
            check_space(self.path, self.geometry.offset(self.num_blocks), self.num_blocks, existing)
            self.index = SlotIndex(self.num_blocks)
        except BaseException:
            _remove_dir_if_empty(config.directory, created_dir)
            raise
        self._counters = IoCounters()
        self._closed = False

        # Pick the backend before touching the file: GDS mode ON without GDS fails fast and leaves nothing.
        self._kind = "factory"
        if config.backend_factory is None:
            from ..backends.gds import select_backend

            self._kind, _ = select_backend(config.gds)
        lock_path = os.path.join(os.fspath(config.directory), f"{config.name}.lock")
        lock_existed = os.path.lexists(lock_path)
        try:
            self._lock_fd = take_lock(config, self.path)
        except BaseException:
            _remove_dir_if_empty(config.directory, created_dir)
            raise
        try:
            self.open_report = open_slab(self.path, layout, self.geometry, config, self.index)
            self.backend = self._make_backend()
        except BaseException:
            os.close(self._lock_fd)
            if not lock_existed:  # leave nothing behind: the lock file this open created goes too
                with contextlib.suppress(OSError):
                    os.unlink(lock_path)
            _remove_dir_if_empty(config.directory, created_dir)
            raise
        inner = getattr(self.backend, "inner", self.backend)  # see through test wrappers
        self.direct = bool(getattr(inner, "direct", False) or getattr(inner, "gds", False))
        self._workers = concurrent.futures.ThreadPoolExecutor(
            config.io_threads, thread_name_prefix="tiered_kv-filetier"
        )
        self._ring: StagingRing | None = None
        self._ring_lock = threading.Lock()
        # Padding after a payload whose size is not a multiple of 4096: zeros written, bytes read discarded.
        zero_pad = aligned_empty(self.pad_bytes).numpy() if self.pad_bytes else None
        if zero_pad is not None:
            zero_pad[:] = 0
        trash_pad = aligned_empty(self.pad_bytes).numpy() if self.pad_bytes else None
        self._deadline: DeadlineBackend | None = None
        if config.timeout is not None:  # a few calls per I/O thread in the backend, each on the clock
            self._deadline = DeadlineBackend(self.backend, config.timeout, limit=2 * config.io_threads)
        self._io = SlabIO(
            self.geometry,
            self._deadline if self._deadline is not None else self.backend,
            self._workers,
            self._staging_ring,
            self.durability,
            self.device,
            self.index,
            self._counters,
            zero_pad,
            trash_pad,
            reads_in_flight=4 * config.io_threads,  # a few queued per I/O thread (see FileCopy._pump)
            bounce=BouncePool(self.payload_bytes) if self._deadline is not None else None,
        )
        r = self.open_report
        log.info(
            "file tier %s: %d slots of %d bytes, backend %s (direct=%s), recovered %d, bad %d, foreign %d, %.3f s",
            self.path,
            self.num_blocks,
            self.slot_size,
            self.backend.name,
            self.direct,
            r.recovered,
            r.bad,
            r.foreign,
            r.seconds,
        )

    # ------------------------------------------------------------------------------------ opening

    @classmethod
    async def open_async(cls, layout: KVLayout, config: FileTierConfig, *, device: Device | None = None) -> FileTier:
        """Open off the event loop: directory, slab and scan on a worker thread.

        Cancellation: the open finishes in its thread; the tier it made is closed and dropped.
        """
        loop = asyncio.get_running_loop()
        fut = loop.run_in_executor(None, lambda: cls(layout, config, device=device))
        try:
            return await asyncio.shield(fut)
        except asyncio.CancelledError:
            fut.add_done_callback(lambda f: f.result().close() if not f.cancelled() and f.exception() is None else None)
            raise

    async def remove(self) -> None:
        """Close the tier and delete its slab file (off the event loop).

        Cancellation: the tier is closed; the file may or may not be removed.
        """
        self.close()
        with contextlib.suppress(FileNotFoundError):
            await asyncio.to_thread(os.remove, self.path)

    def _make_backend(self) -> FileBackend:
        cfg = self.config
        if cfg.backend_factory is not None:
            return cfg.backend_factory(self.path)
        from ..backends.gds import GdsBackend
        from ..backends.posix import PosixBackend

        if self._kind == "gds":
            return GdsBackend(self.path, mode=cfg.gds, threads=cfg.io_threads, direct=cfg.direct)
        return PosixBackend(self.path, threads=cfg.io_threads, direct=cfg.direct)

    # ------------------------------------------------------------------------------------ index

    def lookup(self, key: Key) -> int | None:
        """The slot holding a verified-at-open or completely written block with ``key``, or ``None``."""
        return self.index.lookup(key)

    def key_of(self, slot: int) -> Key | None:
        """The key of a valid slot, else ``None`` (pending and empty slots have none yet)."""
        return self.index.key_of(slot)

    def is_valid(self, slot: int) -> bool:
        """``slot`` holds a verified-at-open or completely written block."""
        return self.index.state(slot) is SlotState.VALID

    def is_pending(self, slot: int) -> bool:
        """A write into ``slot`` is in flight."""
        return self.index.state(slot) is SlotState.PENDING

    def entries(self) -> dict[Key, int]:
        """A copy of the index: content key -> valid slot."""
        return self.index.entries()

    def free_slots(self) -> list[int]:
        """Slots that hold nothing (neither valid nor pending), ascending."""
        return self.index.free_slots()

    def discard(self, slot: int) -> None:
        """Forget a valid slot (index only: the bytes stay and a restart may index them again).

        Raises:
            ValueError: the slot is pending (a write is in flight) or out of range.
        """
        self.index.discard(slot)

    # ------------------------------------------------------------------------------------ medium

    def check(self, indices: np.ndarray, what: str) -> None:
        """Raise ``ValueError`` unless every index is in ``[0, num_blocks)``."""
        check_indices(indices, self.num_blocks, what, f"the file tier of {self.num_blocks} slots")

    def block(self, index: int) -> torch.Tensor:
        """Not available: file slots have no in-memory view.

        Raises:
            TypeError: always.
        """
        raise TypeError("file slots have no in-memory view; copy the block to the host tier to inspect it")

    def offset(self, slot: int) -> int:
        """Byte offset of ``slot``'s header in the slab."""
        return self.geometry.offset(slot)

    # ------------------------------------------------------------------------------------ batches

    def write_batch(
        self,
        pool: BlockPool | LayerMajorPool,
        blocks: list[int],
        slots: list[int],
        keys: list[Key],
        stream: Stream | None,
        copier: Copier | None,
    ) -> FileCopy:
        """Claim ``slots`` for ``keys`` (pending from now on) and return the copy that writes ``blocks`` into them.

        Args:
            pool: the source pool (host, or GPU with ``stream`` = the offload stream).
            blocks: source blocks, one per slot.
            slots: destination slots (validated).
            keys: normalized content keys, one per slot.
            stream: the stream of the GPU->staging legs, ``None`` for a host pool.
            copier: the engine's copier (layer-major GPU pools).
        """
        gens = self.index.claim(slots, keys)
        return FileCopy(self._io, True, pool, blocks, slots, keys, gens, stream, copier)

    def read_batch(
        self,
        pool: BlockPool | LayerMajorPool,
        blocks: list[int],
        slots: list[int],
        stream: Stream | None,
        copier: Copier | None,
    ) -> FileCopy:
        """The copy that reads ``slots`` (checked readable) into ``blocks`` of ``pool``, verifying each."""
        keys, gens = self.index.expected(slots)
        return FileCopy(self._io, False, pool, blocks, slots, keys, gens, stream, copier)

    def _staging_ring(self) -> StagingRing:
        with self._ring_lock:
            if self._ring is None:
                depth, group = self._ring_depth()
                self._ring = StagingRing(self.device, self.layout, depth, group)
            return self._ring

    @property
    def staging_depth(self) -> int:
        """Blocks in the GPU<->file staging ring (sizes it now if no GPU copy has yet)."""
        return self._staging_ring().count

    @property
    def staging_group(self) -> int:
        """Blocks moved between the GPU and the staging ring in one stream op (sizes the ring now if needed)."""
        return self._staging_ring().group

    def _ring_depth(self) -> tuple[int, int]:
        """``(depth, group)``: the ring size and the blocks per host<->device stream op.

        The size is the configured one, or one from bandwidth x latency measured now (once per tier); the group
        is :func:`~tiered_kv.file.ring.group_size` of it.
        """
        bpb = self.layout.bytes_per_block
        if self.config.staging_blocks is not None:
            depth = self.config.staging_blocks
            return depth, group_size(bpb, depth)
        limit = max(2, self.config.staging_bytes // bpb)
        group = group_size(bpb, limit)
        disk_s, link_s = measure_legs(self.device, self.path, self.geometry.offset(0), self.slot_size)
        depth = ring_depth(disk_s, link_s, self.config.io_threads, limit=limit, group=group)
        group = group_size(bpb, depth)
        log.info(
            "file tier %s: staging ring of %d blocks, %d per stream op (one block: file %.0f us, host<->device "
            "%.0f us, %d I/O threads)",
            self.path,
            depth,
            group,
            disk_s * 1e6,
            link_s * 1e6,
            self.config.io_threads,
        )
        return depth, group

    # ------------------------------------------------------------------------------------ lifecycle

    def close(self) -> None:
        """Release the backend and threads (the engine calls this after draining). Idempotent.

        Bounded: calls past their deadline get one more ``timeout`` to return; after that the backend (its
        threads and the slab's descriptor, which they still use) is left open and a warning logged.
        """
        if self._closed:
            return
        self._closed = True
        self._workers.shutdown(wait=True)
        deadline = self._deadline
        if deadline is None:
            self.backend.close()
        elif deadline.settle(deadline.timeout):
            deadline.close()
        else:
            deadline.stop()
            _ABANDONED.append(self.backend)  # never closed under a call that may still return
            log.warning(
                "file tier %s: %d I/O calls still running %g s past their deadline; their threads and the slab's "
                "descriptor are left open",
                self.path,
                deadline.late,
                deadline.timeout,
            )
        self.index.events.deliver()  # transitions still queued for a loop that will not run them
        os.close(self._lock_fd)

    def __del__(self) -> None:
        if getattr(self, "_closed", True) or not hasattr(self, "_workers"):
            return
        warnings.warn(
            f"unclosed file tier {getattr(self, 'path', '?')}: close() it; releasing its threads and slab lock",
            ResourceWarning,
            stacklevel=2,
        )
        try:
            self.close()
        except Exception:  # interpreter shutdown: nothing more can be done
            pass

    @property
    def closed(self) -> bool:
        """The tier was closed."""
        return self._closed

    def statistics(self) -> FileTierStatistics:
        """A snapshot: index occupancy and I/O counters."""
        c = self._counters.snapshot()
        valid, pending = self.index.counts()
        return FileTierStatistics(
            self.path,
            self.backend.name,
            self.direct,
            self.durability.value,
            self.num_blocks,
            valid,
            pending,
            c["nw"],
            c["nr"],
            c["bw"],
            c["br"],
            c["wf"],
            c["rf"],
            c["if"],
            self.open_report,
            self._deadline.timeouts if self._deadline is not None else 0,
        )

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        s = self.statistics()
        return (
            f"<FileTier {self.path} [{state}, valid:{s.valid}, pending:{s.pending}, slots:{self.num_blocks}] "
            f"backend={self.backend.name} direct={self.direct}>"
        )
