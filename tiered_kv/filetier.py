"""The file tier: one self-verifying slab file per pool, its slot index, and the copies in and out of it.

Primitives:

* :class:`FileTierConfig` -- directory, slot count, GDS mode, durability, threads; env overrides.
* :class:`FileTier` -- opens (or creates) the slab, rebuilds the index from the slot headers (warm restart),
  and builds the engine's FILE copy ops. Index: :meth:`~FileTier.lookup` (content key -> slot),
  :meth:`~FileTier.key_of`, :meth:`~FileTier.is_valid`, :meth:`~FileTier.entries`, :meth:`~FileTier.free_slots`,
  :meth:`~FileTier.discard`.
* :class:`OpenReport`, :class:`FileTierStatistics` -- frozen snapshots.

How a copy runs. :meth:`FileTier.copy_op` validates and updates the index on the loop thread, then returns an
op whose ``start(done)`` only *starts* work: checksumming on the tier's worker threads, I/O on the backend's
threads, GPU<->staging copies on the engine's offload/onboard streams; ``done(error)`` is called from whichever
thread finishes last. No thread is parked waiting on another. GPU<->FILE without GDS goes through a shared
ring of pinned staging blocks, block by block, so disk and PCIe overlap (block k+1 is on the disk while
block k crosses PCIe).

Guarantees:

* A write marks its slots *pending* at ``copy()`` time (lookups stop returning them) and *valid* only after
  every block of the transfer was written in full (and synced, per :class:`Durability`). Any failure
  (ENOSPC, EIO, short write, O_DIRECT EINVAL) fails the transfer with :class:`TransferError` and leaves every
  destination slot of it empty; the source blocks are untouched.
* Every block read is verified -- header checksum, magic, format version, layout fingerprint, slot index,
  content key and generation against the index, payload length and xxh3-128 payload checksum -- before the
  transfer succeeds. A mismatch (or a short read: a truncated file) raises :class:`IntegrityError` and drops
  the slot from the index; the destination block is not reported valid.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import enum
import fcntl
import functools
import logging
import os
import threading
import time
import warnings
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
import torch

from .backends import Completion, FileBackend
from .backends.posix import aligned_empty, create_file, make_dir, preallocate, remove_file
from .config import env_int
from .copyops import Copier
from .device import Device, Stream
from .errors import IntegrityError, LayoutMismatchError, SlabInUseError, TransferError
from .layer_major import LayerMajorPool
from .layout import KVLayout
from .pools import BlockPool, Tier, check_indices
from .slab import (
    HEADER_SIZE,
    Key,
    SlotHeader,
    Superblock,
    layout_text,
    normalize_key,
    pack_header,
    payload_checksum,
    slot_payload_size,
    unpack_header,
)
from .slotstate import SlotEvent, SlotEvents

__all__ = ["Durability", "FileTier", "FileTierConfig", "FileTierStatistics", "OpenReport"]

log = logging.getLogger(__name__)

Done = Callable[[BaseException | None], None]
Buffer = torch.Tensor | np.ndarray

_EMPTY, _PENDING, _VALID = 0, 1, 2


class Durability(enum.Enum):
    """When a copy into the file tier counts as complete.

    * ``NONE`` (default): when every write call returned -- the bytes are in the device (O_DIRECT) or the
      page cache. Survives a crash of the process, not a power cut. Justification: the file tier is a
      *cache* whose every read is verified, so a block lost or torn by a power cut is detected and
      dropped on restart, never served; paying a flush per transfer would only protect data that can be
      recomputed.
    * ``FLUSH``: also ``fdatasync`` the slab once per transfer (the file is preallocated, so data is all
      that needs flushing).
    * ``FSYNC``: ``fsync`` once per transfer (data and metadata).
    """

    NONE = "none"
    FLUSH = "flush"
    FSYNC = "fsync"

    @classmethod
    def coerce(cls, value: object) -> Durability:
        if isinstance(value, Durability):
            return value
        if isinstance(value, str):
            try:
                return cls(value.strip().lower())
            except ValueError:
                pass
        raise ValueError(f"durability must be 'none', 'flush' or 'fsync', got {value!r}")


@dataclasses.dataclass(frozen=True, slots=True)
class FileTierConfig:
    """Knobs of the file tier.

    Attributes:
        directory: where the slab lives (created 0700 if missing). The slab is ``<directory>/<name>.slab``, 0600.
        num_blocks: slots in the slab.
        name: file name stem (one slab per pool).
        gds: ``"auto"`` / ``"on"`` / ``"off"`` (:class:`~tiered_kv.backends.gds.GdsMode`). Env ``TIERED_KV_GDS``.
        durability: ``"none"`` (default), ``"flush"`` or ``"fsync"`` (:class:`Durability`). Env
            ``TIERED_KV_FILE_DURABILITY``.
        io_threads: backend I/O threads, and checksum threads. Env ``TIERED_KV_FILE_THREADS``.
        direct: posix ``O_DIRECT``: ``None`` detects it once per directory.
        staging_blocks: pinned staging blocks shared by GPU<->FILE copies (the pipeline depth).
        verify_on_open: ``"header"`` (default: index every slot whose header verifies; payloads are verified
            on every read) or ``"full"`` (also read and checksum every payload at open).
        discard_mismatch: reopening a slab written for another layout is an error unless this is true, in
            which case the old slab is discarded. Env ``TIERED_KV_FILE_DISCARD=1``.
        backend_factory: ``path -> FileBackend`` replacing the GDS/posix choice (tests: a
            :class:`~tiered_kv.testing.FaultyBackend`).
    """

    directory: str | os.PathLike[str]
    num_blocks: int
    name: str = "kv"
    gds: str = "auto"
    durability: str = "none"
    io_threads: int = 4
    direct: bool | None = None
    staging_blocks: int = 8
    verify_on_open: str = "header"
    discard_mismatch: bool = False
    backend_factory: Callable[[str], FileBackend] | None = None

    def __post_init__(self) -> None:
        for name in ("num_blocks", "io_threads", "staging_blocks"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"FileTierConfig.{name} must be a positive int, got {v!r}")
        if not isinstance(self.name, str) or not self.name or "/" in self.name or self.name.startswith("."):
            raise ValueError(f"FileTierConfig.name must be a plain file name stem, got {self.name!r}")
        Durability.coerce(self.durability)
        from .backends.gds import GdsMode

        GdsMode.coerce(self.gds)
        if self.verify_on_open not in ("header", "full"):
            raise ValueError(f"verify_on_open must be 'header' or 'full', got {self.verify_on_open!r}")

    @classmethod
    def from_env(cls, directory: str | os.PathLike[str], num_blocks: int, **overrides: Any) -> FileTierConfig:
        """Defaults, then ``TIERED_KV_GDS`` / ``TIERED_KV_FILE_*`` environment variables, then ``overrides``."""
        values: dict[str, Any] = {}
        if "TIERED_KV_GDS" in os.environ:
            values["gds"] = os.environ["TIERED_KV_GDS"]
        if "TIERED_KV_FILE_DURABILITY" in os.environ:
            values["durability"] = os.environ["TIERED_KV_FILE_DURABILITY"]
        if "TIERED_KV_FILE_THREADS" in os.environ:
            values["io_threads"] = env_int("TIERED_KV_FILE_THREADS")
        if os.environ.get("TIERED_KV_FILE_DISCARD", "").lower() in ("1", "true", "yes"):
            values["discard_mismatch"] = True
        values.update(overrides)
        return cls(directory, num_blocks, **values)


@dataclasses.dataclass(frozen=True, slots=True)
class OpenReport:
    """What opening the slab found.

    Attributes:
        path: the slab file.
        created: a new slab was created (nothing to recover).
        discarded: an existing slab (other layout, or not a slab) was discarded because the config asked.
        preallocation: ``"fallocate"``, ``"truncate"`` (sparse fallback) or ``"existing"``.
        scanned: slots examined. recovered: slots indexed (verified, this layout).
        empty: never-written slots. bad: slots failing verification (torn, corrupt, truncated).
        foreign: verified slots of another layout fingerprint or slot index. stale: older duplicates of a key.
        seconds: time taken.
    """

    path: str
    created: bool
    discarded: bool
    preallocation: str
    scanned: int
    recovered: int
    empty: int
    bad: int
    foreign: int
    stale: int
    seconds: float


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


class _Staging:
    """A FIFO-fair pool of pinned staging blocks handed out by callback (nobody blocks waiting for one)."""

    def __init__(self, device: Device, layout: KVLayout, count: int) -> None:
        self.tensor = device.empty_host((count, layout.bytes_per_block), torch.uint8)
        # the same memory as a block-major host pool, for the engine's copier (layer-major GPU pools)
        self.pool = BlockPool(Tier.HOST, layout, self.tensor.view(layout.dtype).view(count, *layout.block_shape))
        self._free = list(range(count))
        self._waiters: list[Callable[[int], None]] = []
        self._lock = threading.Lock()

    def acquire(self, callback: Callable[[int], None]) -> None:
        with self._lock:
            if not self._free:
                self._waiters.append(callback)
                return
            i = self._free.pop()
        callback(i)

    def release(self, i: int) -> None:
        with self._lock:
            if not self._waiters:
                self._free.append(i)
                return
            callback = self._waiters.pop(0)
        callback(i)


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
        The tier looks like a block pool to the engine (``name``, ``num_blocks``, ``check``) and its slots
        are fenced like other pools' blocks. Index reads are thread-safe; the index is changed by ``copy()``
        (on the loop) and by completions (on I/O threads) under one lock.
    """

    tier = Tier.FILE
    name = "file"

    def __init__(self, layout: KVLayout, config: FileTierConfig, *, device: Device | None = None) -> None:
        from .device import resolve_device

        self.layout = layout
        self.config = config
        self.device = device if device is not None else resolve_device("cpu")
        self.durability = Durability.coerce(config.durability)
        self.num_blocks = config.num_blocks
        self.payload_bytes = layout.bytes_per_block
        self.slot_size = HEADER_SIZE + slot_payload_size(layout)
        self.pad_bytes = self.slot_size - HEADER_SIZE - self.payload_bytes
        self._fingerprint = bytes.fromhex(layout.fingerprint)
        os.makedirs(config.directory, mode=0o700, exist_ok=True)
        self.path = os.path.join(os.fspath(config.directory), f"{config.name}.slab")

        self._lock = threading.Lock()
        self._state = np.zeros(self.num_blocks, dtype=np.int8)  # slot -> _EMPTY / _PENDING / _VALID
        self._keys: list[Key | None] = [None] * self.num_blocks  # slot -> key (valid or pending)
        self._gens = [0] * self.num_blocks  # slot -> generation of the valid or pending content
        self._by_key: dict[Key, int] = {}  # content key -> valid slot
        self._failed_gen: dict[int, int] = {}  # slot -> generation of its last failed write (a tombstone)
        self._next_gen = 1
        self._counts = {"bw": 0, "br": 0, "nw": 0, "nr": 0, "wf": 0, "rf": 0, "if": 0}
        self._closed = False
        # SLOT STATE HOOK (issue 11): index changes decided on I/O threads reach the loop (and the block
        # manager listening there) in order, between two loop steps: see tiered_kv.slotstate.
        self.events = SlotEvents()

        # Pick the backend before touching the file: GDS mode ON without GDS fails fast and leaves nothing.
        self._kind = "factory"
        if config.backend_factory is None:
            from .backends.gds import select_backend

            self._kind, _ = select_backend(config.gds)
        self._lock_fd = self._take_lock()
        try:
            self.open_report = self._open()
            self.backend = self._make_backend()
        except BaseException:
            os.close(self._lock_fd)
            raise
        inner = getattr(self.backend, "inner", self.backend)  # see through test wrappers
        self.direct = bool(getattr(inner, "direct", False) or getattr(inner, "gds", False))
        self._workers = concurrent.futures.ThreadPoolExecutor(config.io_threads, thread_name_prefix="tiered_kv-filetier")
        self._staging: _Staging | None = None
        self._staging_lock = threading.Lock()
        # Padding after a payload whose size is not a multiple of 4096: zeros written, bytes read discarded.
        self._zero_pad = aligned_empty(self.pad_bytes).numpy() if self.pad_bytes else None
        if self._zero_pad is not None:
            self._zero_pad[:] = 0
        self._trash_pad = aligned_empty(self.pad_bytes).numpy() if self.pad_bytes else None
        r = self.open_report
        log.info(
            "file tier %s: %d slots of %d bytes, backend %s (direct=%s), recovered %d, bad %d, foreign %d, %.3f s",
            self.path, self.num_blocks, self.slot_size, self.backend.name, self.direct, r.recovered, r.bad, r.foreign, r.seconds,
        )

    # ------------------------------------------------------------------------------------ opening

    @classmethod
    async def open_async(cls, layout: KVLayout, config: FileTierConfig, *, device: Device | None = None) -> FileTier:
        """Open off the event loop: the directory through aiofiles, the scan on a worker thread.

        Cancellation: the open finishes in its thread; the tier it made is closed and dropped.
        """
        import asyncio

        await make_dir(config.directory)
        loop = asyncio.get_running_loop()
        fut = loop.run_in_executor(None, lambda: cls(layout, config, device=device))
        try:
            return await asyncio.shield(fut)
        except asyncio.CancelledError:
            fut.add_done_callback(lambda f: f.result().close() if not f.cancelled() and f.exception() is None else None)
            raise

    async def remove(self) -> None:
        """Close the tier and delete its slab file (through aiofiles).

        Cancellation: the tier is closed; the file may or may not be removed.
        """
        self.close()
        await remove_file(self.path)

    def _take_lock(self) -> int:
        """Hold an exclusive ``flock`` on ``<name>.lock`` for the tier's lifetime: one writer per slab."""
        lock_path = os.path.join(os.fspath(self.config.directory), f"{self.config.name}.lock")
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise SlabInUseError(f"{self.path} is in use by another file tier (this or another process); close it first") from None
        return fd

    def _make_backend(self) -> FileBackend:
        cfg = self.config
        if cfg.backend_factory is not None:
            return cfg.backend_factory(self.path)
        from .backends.gds import GdsBackend
        from .backends.posix import PosixBackend

        if self._kind == "gds":
            return GdsBackend(self.path, mode=cfg.gds, threads=cfg.io_threads)
        return PosixBackend(self.path, threads=cfg.io_threads, direct=cfg.direct)

    def _open(self) -> OpenReport:
        t0 = time.perf_counter()
        cfg = self.config
        want = Superblock(self._fingerprint, self.num_blocks, self.slot_size, self.payload_bytes, layout_text(self.layout))
        size = HEADER_SIZE + self.num_blocks * self.slot_size
        discarded = False
        existing = os.path.exists(self.path) and os.path.getsize(self.path) > 0
        if existing:
            with open(self.path, "rb") as f:
                raw = f.read(HEADER_SIZE)
            sb = Superblock.unpack(raw)
            problem = None
            if not any(raw):
                # A creation that crashed between preallocating and writing the superblock: the superblock is
                # synced before any slot is written, so nothing is lost by starting over.
                log.warning("%s has no superblock (its creation was interrupted); creating it again", self.path)
                existing = False
            elif isinstance(sb, str):
                problem = f"{self.path} is not a tiered_kv slab: {sb}"
            elif sb.fingerprint != self._fingerprint or sb.slot_size != self.slot_size or sb.payload_length != self.payload_bytes:
                problem = (
                    f"{self.path} was written for another layout ({sb.layout}, fingerprint {sb.fingerprint.hex()}); "
                    f"this tier has {want.layout} (fingerprint {self._fingerprint.hex()})"
                )
            if problem is not None:
                if not cfg.discard_mismatch:
                    raise LayoutMismatchError(f"{problem}. Pass discard_mismatch=True (or TIERED_KV_FILE_DISCARD=1) to discard it.")
                log.warning("%s; discarding it", problem)
                os.unlink(self.path)
                existing, discarded = False, True
        if not existing:
            if os.path.exists(self.path):
                os.unlink(self.path)  # an empty leftover file
            fd = create_file(self.path)
            try:
                how = preallocate(fd, size)
                os.pwrite(fd, want.pack(), 0)
                os.fdatasync(fd)
            except BaseException:
                os.close(fd)
                os.unlink(self.path)
                raise
            os.close(fd)
            return OpenReport(self.path, True, discarded, how, 0, 0, self.num_blocks, 0, 0, 0, time.perf_counter() - t0)

        mode = os.stat(self.path).st_mode & 0o777
        if mode & 0o077:
            log.warning("%s has mode %o; setting it to 0600", self.path, mode)
            os.chmod(self.path, 0o600)
        fd = os.open(self.path, os.O_RDWR | getattr(os, "O_CLOEXEC", 0))
        try:
            assert isinstance(sb, Superblock)
            old_slots = sb.num_slots
            if old_slots != self.num_blocks:
                log.info("%s: resizing from %d to %d slots", self.path, old_slots, self.num_blocks)
                if old_slots < self.num_blocks:
                    preallocate(fd, size)
                else:
                    os.ftruncate(fd, size)
                os.pwrite(fd, want.pack(), 0)
                os.fdatasync(fd)
            counts = self._scan(fd, min(old_slots, self.num_blocks))
        finally:
            os.close(fd)
        scanned, recovered, empty, bad, foreign, stale = counts
        empty += max(0, self.num_blocks - old_slots)
        return OpenReport(self.path, False, False, "existing", scanned, recovered, empty, bad, foreign, stale, time.perf_counter() - t0)

    def _scan(self, fd: int, nslots: int) -> tuple[int, int, int, int, int, int]:
        """Rebuild the index from slot headers (and payloads with ``verify_on_open="full"``)."""
        full = self.config.verify_on_open == "full"
        file_size = os.fstat(fd).st_size
        # Small slots (or full verification): contiguous 8 MiB windows, sequential I/O. Larger slots: one
        # pread per header. Either way ranges of slots are scanned on several threads (preads release the GIL;
        # on a cold NVMe, parallel 4 KiB reads are what makes 65,536 headers fast).
        windowed = full or self.slot_size <= (16 << 10)
        per_task = max(1, (8 << 20) // self.slot_size) if windowed else 1024

        def check(i: int, raw: memoryview, payload: memoryview | None) -> SlotHeader | str:
            h = unpack_header(raw)
            if h is None:
                return "empty"
            if isinstance(h, str):
                return "bad"
            if h.fingerprint != self._fingerprint or h.slot != i:
                return "foreign"
            if h.payload_length != self.payload_bytes:
                return "bad"
            if payload is not None and (len(payload) < self.payload_bytes or payload_checksum(payload[: self.payload_bytes]) != h.checksum):
                return "bad"
            return h

        def scan_range(first: int) -> list[tuple[int, SlotHeader | str]]:
            count = min(per_task, nslots - first)
            out: list[tuple[int, SlotHeader | str]] = []
            if windowed:
                data = memoryview(os.pread(fd, count * self.slot_size, HEADER_SIZE + first * self.slot_size))
                for j in range(count):
                    base = j * self.slot_size
                    if base + HEADER_SIZE > len(data):
                        out.append((first + j, "bad"))  # truncated file
                        continue
                    payload = data[base + HEADER_SIZE : base + self.slot_size] if full else None
                    out.append((first + j, check(first + j, data[base : base + HEADER_SIZE], payload)))
                return out
            for i in range(first, first + count):
                off = HEADER_SIZE + i * self.slot_size
                if off + HEADER_SIZE > file_size:
                    out.append((i, "bad"))
                    continue
                out.append((i, check(i, memoryview(os.pread(fd, HEADER_SIZE, off)), None)))
            return out

        counts = {"empty": 0, "bad": 0, "foreign": 0}
        headers: dict[int, SlotHeader] = {}
        threads = 2 if windowed else max(8, self.config.io_threads)  # windows: one reads while one parses
        with concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="tiered_kv-scan") as ex:
            for part in ex.map(scan_range, range(0, nslots, per_task)):
                for i, outcome in part:
                    if isinstance(outcome, str):
                        counts[outcome] += 1
                    else:
                        headers[i] = outcome
        empty, bad, foreign, stale = counts["empty"], counts["bad"], counts["foreign"], 0

        # Newest generation wins for a key seen twice (a crash between writing the new slot and reusing the old)
        # -- the newest whose payload verifies: a write torn by the crash may have left a new header over a bad
        # payload, and must not shadow the intact older copy (crash test, seeds 1 and 7).
        max_gen = max((h.generation for h in headers.values()), default=0)  # torn ones included: never reused
        by_key: dict[Key, list[int]] = {}
        for i, h in headers.items():
            by_key.setdefault(h.key, []).append(i)
        best: dict[Key, int] = {}
        for key, slots in by_key.items():
            if len(slots) == 1:
                best[key] = slots[0]
                continue
            slots.sort(key=lambda i: headers[i].generation, reverse=True)
            for n, i in enumerate(slots):
                if full or self._payload_verifies(fd, i, headers[i]):
                    best[key] = i
                    stale += len(slots) - n - 1
                    break
                bad += 1
                del headers[i]
        for key, i in best.items():
            h = headers[i]
            self._state[i] = _VALID
            self._keys[i] = key
            self._gens[i] = h.generation
            self._by_key[key] = i
        self._next_gen = max_gen + 1
        return nslots, len(best), empty, bad, foreign, stale

    def _payload_verifies(self, fd: int, slot: int, h: SlotHeader) -> bool:
        data = os.pread(fd, self.payload_bytes, self.offset(slot) + HEADER_SIZE)
        return len(data) == self.payload_bytes and payload_checksum(data) == h.checksum

    # ------------------------------------------------------------------------------------ index

    def lookup(self, key: Key) -> int | None:
        """The slot holding a verified-at-open or completely written block with ``key``, or ``None``."""
        with self._lock:
            return self._by_key.get(normalize_key(key))

    def key_of(self, slot: int) -> Key | None:
        """The key of a valid slot, else ``None`` (pending and empty slots have none yet)."""
        self._check_slot(slot)
        with self._lock:
            return self._keys[slot] if self._state[slot] == _VALID else None

    def is_valid(self, slot: int) -> bool:
        self._check_slot(slot)
        return bool(self._state[slot] == _VALID)

    def is_pending(self, slot: int) -> bool:
        """A write into ``slot`` is in flight."""
        self._check_slot(slot)
        return bool(self._state[slot] == _PENDING)

    def entries(self) -> dict[Key, int]:
        """A copy of the index: content key -> valid slot."""
        with self._lock:
            return dict(self._by_key)

    def free_slots(self) -> list[int]:
        """Slots that hold nothing (neither valid nor pending), ascending."""
        return np.flatnonzero(self._state == _EMPTY).tolist()

    def discard(self, slot: int) -> None:
        """Forget a valid slot (index only: the bytes stay and a restart may index them again).

        Raises:
            ValueError: the slot is pending (a write is in flight) or out of range.
        """
        self._check_slot(slot)
        with self._lock:
            if self._state[slot] == _PENDING:
                raise ValueError(f"file slot {slot} has a write in flight; await it before discarding the slot")
            key, gen = self._keys[slot], self._gens[slot]
            self._drop_locked(slot)
        if key is not None:
            self.events.emit(SlotEvent(slot, key, gen, "discarded"))

    def _drop_locked(self, slot: int) -> None:
        key = self._keys[slot]
        if key is not None and self._by_key.get(key) == slot:
            del self._by_key[key]
        self._state[slot] = _EMPTY
        self._keys[slot] = None

    def _check_slot(self, slot: int) -> None:
        if isinstance(slot, bool) or not isinstance(slot, (int, np.integer)):
            raise TypeError(f"a file slot must be an int, got {type(slot).__name__}")
        if not 0 <= slot < self.num_blocks:
            raise ValueError(f"file slot {slot} is out of range for the file tier of {self.num_blocks} slots")

    # BlockPool look-alike for the engine --------------------------------------------------

    def check(self, indices: np.ndarray, what: str) -> None:
        """Raise ``ValueError`` unless every index is in ``[0, num_blocks)``."""
        check_indices(indices, self.num_blocks, what, f"the file tier of {self.num_blocks} slots")

    def block(self, index: int) -> torch.Tensor:
        raise TypeError("file slots have no in-memory view; copy the block to the host tier to inspect it")

    # ------------------------------------------------------------------------------------ copies

    def validate(self, src_tier: Tier, s: np.ndarray, dst_tier: Tier, d: np.ndarray, num_tokens: int | None,
                 keys: Iterable[Key] | None) -> list[Key] | None:
        """Argument checks of a copy touching this tier (no side effects). Returns the normalized keys.

        Raises:
            ValueError / TypeError: with a sentence; see :meth:`TransferEngine.copy`.
        """
        if self._closed:
            raise ValueError("the file tier is closed")
        if src_tier is Tier.FILE and dst_tier is Tier.FILE:
            raise ValueError("copies from file to file are not supported")
        if num_tokens is not None:
            raise ValueError("num_tokens is not supported for copies to or from the file tier: file slots hold whole blocks")
        norm: list[Key] | None = None
        if keys is not None:
            if isinstance(keys, (bytes, bytearray, memoryview, str, int)) or not isinstance(keys, Iterable):
                raise TypeError(f"keys must be a sequence of content keys, one per block, got {type(keys).__name__}")
            norm = [normalize_key(k) for k in keys]
            if len(norm) != s.size:
                raise ValueError(f"got {len(norm)} keys for {s.size} blocks; give one content key per block")
        if dst_tier is Tier.FILE:
            if norm is None and s.size:
                raise ValueError("copies into the file tier need keys=[content key per block]: the key is written into "
                                 "each slot's header and is how the block is found again (also after a restart)")
            if norm is not None and len(set(norm)) != len(norm):
                raise ValueError("keys contain duplicates; one slot per content key")
        else:
            with self._lock:
                for j, slot in enumerate(s.tolist()):
                    if self._state[slot] == _EMPTY:
                        raise ValueError(f"file slot {slot} holds no block (never written, discarded or failed verification)")
                    if norm is not None and self._keys[slot] != norm[j]:
                        raise ValueError(f"file slot {slot} holds key {self._keys[slot]!r}, not {norm[j]!r}")
        return norm

    def copy_op(self, src_tier: Tier, src: Any, s: np.ndarray, dst_tier: Tier, dst: Any, d: np.ndarray,
                keys: list[Key] | None, streams: dict[str, Stream], copier: Copier | None = None) -> _FileOp:
        """The op for a validated copy; updates the index for writes (slots become pending).

        Args:
            src / dst: the pools (block-major :class:`BlockPool`, or a :class:`LayerMajorPool` on the GPU side,
                whose blocks are gathered into / scattered from staging by ``copier``).
            copier: the engine's :class:`~tiered_kv.copyops.Copier` (needed for layer-major pools).
        """
        if dst_tier is Tier.FILE:
            assert keys is not None
            slots = d.tolist()
            with self._lock:
                gens = []
                for slot, key in zip(slots, keys, strict=True):
                    self._drop_locked(slot)
                    gen = self._next_gen
                    self._next_gen += 1
                    self._state[slot] = _PENDING
                    self._keys[slot] = key
                    self._gens[slot] = gen
                    gens.append(gen)
            stream = streams["offload"] if src_tier is Tier.GPU else None
            return _FileOp(self, True, src, s.tolist(), slots, keys, gens, stream, copier)
        slots = s.tolist()
        with self._lock:
            expect = [self._keys[i] for i in slots]
            gens = [self._gens[i] for i in slots]
        stream = streams["onboard"] if dst_tier is Tier.GPU else None
        return _FileOp(self, False, dst, d.tolist(), slots, expect, gens, stream, copier)  # type: ignore[arg-type]

    def _staging_pool(self) -> _Staging:
        with self._staging_lock:
            if self._staging is None:
                self._staging = _Staging(self.device, self.layout, self.config.staging_blocks)
            return self._staging

    def _finish_write(self, slots: list[int], gens: list[int], ok: bool) -> None:
        """A write transfer ended (I/O thread): tombstones now, the index change on the loop (:attr:`events`)."""
        with self._lock:
            for slot, gen in zip(slots, gens, strict=True):
                if ok:
                    if self._failed_gen.get(slot, gen) < gen:
                        del self._failed_gen[slot]  # an older failed write of the slot is overwritten
                else:
                    # Reads enqueued behind this write (they expect ``gen``) must fail even if this slot's own
                    # block made it to disk: the transfer failed, so its slots hold nothing. A later write of
                    # the slot starts only after those reads, so one tombstone per slot is enough.
                    self._failed_gen[slot] = gen
        self.events.post(functools.partial(self._apply_write, slots, gens, ok))

    def _apply_write(self, slots: list[int], gens: list[int], ok: bool) -> list[SlotEvent]:
        dropped: list[SlotEvent] = []
        with self._lock:
            for slot, gen in zip(slots, gens, strict=True):
                if self._state[slot] != _PENDING or self._gens[slot] != gen:
                    continue  # a later copy has claimed the slot since
                key = self._keys[slot]
                assert key is not None
                if ok:
                    other = self._by_key.get(key)
                    if other is not None and other != slot:
                        self._drop_locked(other)  # the newest copy of a key wins
                    self._state[slot] = _VALID
                    self._by_key[key] = slot
                else:
                    self._drop_locked(slot)
                    dropped.append(SlotEvent(slot, key, gen, "write failed"))
        return dropped

    def _drop_if(self, slot: int, gen: int) -> None:
        """A read of ``slot`` failed verification (I/O thread): drop it, on the loop (:attr:`events`)."""
        self.events.post(functools.partial(self._apply_drop, slot, gen))

    def _apply_drop(self, slot: int, gen: int) -> list[SlotEvent]:
        with self._lock:
            if self._state[slot] == _EMPTY or self._gens[slot] != gen:
                return []
            key = self._keys[slot]
            self._drop_locked(slot)
        return [SlotEvent(slot, key, gen, "verification failed")] if key is not None else []

    def _count(self, **inc: int) -> None:
        with self._lock:
            for k, v in inc.items():
                self._counts[k] += v

    def offset(self, slot: int) -> int:
        """Byte offset of ``slot``'s header in the slab."""
        return HEADER_SIZE + slot * self.slot_size

    # ------------------------------------------------------------------------------------ lifecycle

    def close(self) -> None:
        """Release the backend and threads (the engine calls this after draining). Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._workers.shutdown(wait=True)
        self.backend.close()
        self.events.deliver()  # changes still queued for a loop that will not run them
        os.close(self._lock_fd)

    def __del__(self) -> None:
        if getattr(self, "_closed", True) or not hasattr(self, "_workers"):
            return
        warnings.warn(f"unclosed file tier {getattr(self, 'path', '?')}: close() it; releasing its threads and slab lock",
                      ResourceWarning, stacklevel=2)
        try:
            self.close()
        except Exception:  # interpreter shutdown: nothing more can be done
            pass

    @property
    def closed(self) -> bool:
        return self._closed

    def statistics(self) -> FileTierStatistics:
        with self._lock:
            c = dict(self._counts)
            valid = int((self._state == _VALID).sum())
            pending = int((self._state == _PENDING).sum())
        return FileTierStatistics(self.path, self.backend.name, self.direct, self.durability.value, self.num_blocks, valid,
                                  pending, c["nw"], c["nr"], c["bw"], c["br"], c["wf"], c["rf"], c["if"], self.open_report)

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        s = self.statistics()
        return (f"<FileTier {self.path} [{state}, valid:{s.valid}, pending:{s.pending}, slots:{self.num_blocks}] "
                f"backend={self.backend.name} direct={self.direct}>")


class _FileOp:
    """One engine copy into or out of the file tier; ``start(done)`` starts it and returns at once."""

    def __init__(self, tier: FileTier, write: bool, pool: BlockPool | LayerMajorPool, blocks: list[int], slots: list[int],
                 keys: list[Key], gens: list[int], stream: Stream | None, copier: Copier | None = None) -> None:
        self.tier = tier
        self.write = write
        # the HOST or GPU pool on the other side: its tensor when block-major, else the layer-major pool
        self.layer_major = pool if isinstance(pool, LayerMajorPool) else None
        self.pool = pool.tensor if self.layer_major is None else torch.empty(0)
        if self.layer_major is not None and copier is None:
            raise ValueError("copies between a layer-major pool and the file tier need the engine's copier")
        self.copier = copier
        self.blocks = blocks  # pool block index per job
        self.slots = slots  # file slot per job
        self.keys = keys  # content key to write / expected
        self.gens = gens  # generation to write / expected
        self.stream = stream  # offload/onboard stream for GPU<->staging copies; None for host pools
        # GDS straight from/to the GPU block: only for block-major pools (a layer-major block is not one region)
        self.direct_device = stream is not None and tier.backend.device_io and self.layer_major is None
        self._lock = threading.Lock()
        self._left = len(slots)
        self._error: BaseException | None = None
        self._done: Done | None = None

    # entry point ------------------------------------------------------------------------------

    def start(self, done: Done) -> None:
        """Hand the launch to a worker thread and return: the loop thread does O(1) work per transfer.

        Args:
            done: called once with ``None`` or the error, from whichever thread finishes last.
        """
        self._done = done
        if not self.slots:
            done(None)
            return
        self.tier._workers.submit(self._launch).add_done_callback(self._launch_failed)

    def _launch_failed(self, fut: concurrent.futures.Future[None]) -> None:
        exc = fut.exception()
        if exc is not None:  # only a bug or an allocation failure (staging) gets here
            with self._lock:
                started = self._left != len(self.slots) or self._error is not None
            if not started:
                if self.write:
                    self.tier._finish_write(self.slots, self.gens, False)
                assert self._done is not None
                self._done(TransferError(f"starting a file copy of {len(self.slots)} blocks failed: {exc!r}"))

    def _launch(self) -> None:
        staging = self.tier._staging_pool() if self.stream is not None else None
        n = len(self.slots)
        self._hdrs = aligned_empty(HEADER_SIZE * n).numpy().reshape(n, HEADER_SIZE)  # one aligned header per block
        if staging is None:
            self._pool_np = self.pool.reshape(self.pool.shape[0], -1).view(torch.uint8).numpy()  # block -> bytes
        for j in range(len(self.slots)):
            if staging is not None:
                staging.acquire(functools.partial(self._acquired, j))
            else:
                self._guard(j, None, self._run_host)

    def _acquired(self, j: int, buf: int) -> None:
        self._guard(j, buf, self._run_staged)

    def _guard(self, j: int, buf: int | None, fn: Callable[[int, int | None], None]) -> None:
        if self._error is not None:  # fail fast: do not start more blocks after one failed
            self._job_done(j, buf, None)
            return
        try:
            fn(j, buf)
        except BaseException as exc:  # reported through done()
            self._job_done(j, buf, exc)

    # host pools ---------------------------------------------------------------------------------

    def _payload(self, j: int) -> torch.Tensor:
        return self.pool[self.blocks[j]].reshape(-1).view(torch.uint8)

    def _run_host(self, j: int, buf: int | None) -> None:
        # numpy views: a few hundred ns per block, where torch indexing costs microseconds
        payload = self._pool_np[self.blocks[j]]
        hdr = self._hdrs[j]
        if self.write:
            # Checksum on the launcher thread (xxh3 runs at ~15 GB/s, above any single disk, and releases the
            # GIL), so the I/O threads only do I/O and keep as many requests in flight as raw pwritev would.
            self._write(j, buf, hdr, payload, payload, prehash=True)
        else:
            self._read(j, buf, hdr, payload, verify_with=payload, then=lambda: self._job_done(j, buf, None))

    # GPU pools through staging ---------------------------------------------------------------------

    def _run_staged(self, j: int, buf: int | None) -> None:
        assert buf is not None and self.stream is not None
        stream = self.stream
        staging_pool = self.tier._staging_pool()
        staging = staging_pool.tensor[buf]
        hdr = self._hdrs[j]
        lm = self.layer_major
        if lm is not None:
            # gather / scatter the block's layers*kv chunks with the engine's copier (one kernel or DMA batch)
            assert self.copier is not None
            at, sb = np.array([self.blocks[j]]), np.array([buf])
            gather = self.copier.build(lm, at, staging_pool.pool, sb, None)
            scatter = self.copier.build(staging_pool.pool, sb, lm, at, None)
            block = staging  # unused as an I/O buffer: direct_device is off for layer-major pools
        else:
            block = self._payload(j)

        def d2h() -> None:
            with self._cuda_device():
                if lm is not None:
                    gather()
                else:
                    staging.copy_(block, non_blocking=True)

        if self.write:
            # GPU block -> staging on the offload stream; then (stream waiter thread) start the write. With GDS
            # the payload goes from the GPU block itself; the staged copy is what the checksum is taken of.
            stream.submit(d2h)
            stream.notify(lambda: self._guard(j, buf, lambda j, buf: self._write(
                j, buf, hdr, block if self.direct_device else staging, staging)))
            return

        def h2d() -> None:
            def copy() -> None:
                with self._cuda_device():
                    if lm is not None:
                        scatter()
                    else:
                        block.copy_(staging, non_blocking=True)

            stream.submit(copy)
            stream.notify(lambda: self._job_done(j, buf, None))

        if not self.direct_device:
            # file -> staging, verified on the I/O thread, and only then staging -> GPU block: a block that fails
            # verification never reaches the GPU pool.
            self._read(j, buf, hdr, staging, verify_with=staging, then=lambda: self._guard(j, buf, lambda j, buf: h2d()))
            return

        def after_direct_read() -> None:  # GDS read the payload into the GPU block: bring a copy over to verify it
            stream.submit(d2h)
            stream.notify(lambda: self._guard(j, buf, lambda j, buf: self._then(
                self.tier._workers.submit(self._verify, j, hdr, staging), j, buf, lambda _: self._job_done(j, buf, None))))

        self._read(j, buf, hdr, block, verify_with=None, then=lambda: self._guard(j, buf, lambda j, buf: after_direct_read()))

    def _cuda_device(self) -> Any:
        import contextlib

        dev = self.tier.device
        return torch.cuda.device(dev.torch_device) if dev.is_cuda else contextlib.nullcontext()

    # steps -----------------------------------------------------------------------------------------

    def _write(self, j: int, buf: int | None, hdr: np.ndarray, payload: Buffer, host_payload: Buffer, prehash: bool = False) -> None:
        """Write slot ``j``; the header is filled (payload checksummed) now (``prehash``) or on the I/O thread."""
        tier = self.tier

        def fill_header() -> None:
            pack_header(hdr.data, tier._fingerprint, self.slots[j], self.gens[j], self.keys[j],
                        tier.payload_bytes, payload_checksum(host_payload))

        bufs = [hdr, payload] + ([tier._zero_pad] if tier._zero_pad is not None else [])
        if prehash:
            fill_header()
        fut = tier.backend.pwrite(bufs, tier.offset(self.slots[j]), before=None if prehash else fill_header)

        def written(n: int) -> None:
            if n != tier.slot_size:
                raise TransferError(f"short write to file slot {self.slots[j]}: {n} of {tier.slot_size} bytes")
            self._job_done(j, buf, None)

        self._then(fut, j, buf, written)

    def _read(self, j: int, buf: int | None, hdr: np.ndarray, payload: Buffer, *,
              verify_with: Buffer | None, then: Callable[[], None]) -> None:
        """Read slot ``j``; the length check runs on the I/O thread, verification (``verify_with``) on a worker."""
        tier = self.tier

        def check(n: int) -> None:
            if n < HEADER_SIZE + tier.payload_bytes:
                raise IntegrityError(f"file slot {self.slots[j]}: short read ({n} of {tier.slot_size} bytes; the file is truncated)")

        bufs = [hdr, payload] + ([tier._trash_pad] if tier._trash_pad is not None else [])
        fut = tier.backend.pread(bufs, tier.offset(self.slots[j]), after=check)
        if verify_with is None:
            self._then(fut, j, buf, lambda _: then())
            return
        # Verify on a tier worker, not on the I/O thread: the I/O threads keep as many reads in flight as raw
        # preadv would while earlier blocks are checksummed.
        self._then(fut, j, buf, lambda _: self._then(tier._workers.submit(self._verify, j, hdr, verify_with), j, buf, lambda _: then()))

    def _verify(self, j: int, hdr: np.ndarray, payload: Buffer) -> None:
        tier = self.tier
        slot = self.slots[j]
        h = unpack_header(hdr.data)
        why = None
        if h is None:
            why = "the slot header is empty"
        elif isinstance(h, str):
            why = h
        elif h.fingerprint != tier._fingerprint:
            why = "layout fingerprint mismatch"
        elif h.slot != slot:
            why = f"header names slot {h.slot}"
        elif h.payload_length != tier.payload_bytes:
            why = f"payload length {h.payload_length} != {tier.payload_bytes}"
        elif h.key != self.keys[j]:
            why = f"content key {h.key!r} != expected {self.keys[j]!r}"
        elif h.generation != self.gens[j]:
            why = f"generation {h.generation} != expected {self.gens[j]}"
        elif tier._failed_gen.get(slot) == h.generation:
            why = "the copy that wrote it failed"
        elif payload_checksum(payload) != h.checksum:
            why = "payload checksum mismatch"
        if why is not None:
            raise IntegrityError(f"file slot {slot} failed verification: {why}; the slot was dropped and its data not served")

    def _then(self, fut: Completion, j: int, buf: int | None, fn: Callable[[Any], None]) -> None:
        """When ``fut`` is done: ``fn(result)`` on success, else finish job ``j`` with the error."""

        def cb(f: Completion) -> None:
            try:
                value = f.result()
            except BaseException as exc:  # reported through done()
                self._job_done(j, buf, exc)
                return
            self._guard(j, buf, lambda j, buf: fn(value))

        fut.add_done_callback(cb)  # type: ignore[arg-type]

    # completion ------------------------------------------------------------------------------------

    def _job_done(self, j: int, buf: int | None, exc: BaseException | None) -> None:
        tier = self.tier
        slot = self.slots[j]
        if exc is not None:
            exc = self._wrap(slot, exc)
            if isinstance(exc, IntegrityError) and not self.write:
                tier._drop_if(slot, self.gens[j])
                tier._count(**{"if": 1, "rf": 1})
            else:
                tier._count(**({"wf": 1} if self.write else {"rf": 1}))
        elif self._error is None:
            # success of this block (the transfer may still fail on another one)
            tier._count(**({"nw": 1, "bw": tier.payload_bytes} if self.write else {"nr": 1, "br": tier.payload_bytes}))
        if buf is not None:
            tier._staging_pool().release(buf)
        with self._lock:
            if exc is not None and self._error is None:
                self._error = exc
            self._left -= 1
            last = self._left == 0
        if last:
            self._finish()

    def _wrap(self, slot: int, exc: BaseException) -> BaseException:
        if isinstance(exc, TransferError):
            return exc
        what = "writing" if self.write else "reading"
        err = TransferError(f"{what} file slot {slot} failed: {exc!r}")
        err.__cause__ = exc
        return err

    def _finish(self) -> None:
        tier = self.tier
        error = self._error
        assert self._done is not None
        if not self.write:
            self._done(error)
            return
        if error is not None or tier.durability is Durability.NONE:
            tier._finish_write(self.slots, self.gens, error is None)
            self._done(error)
            return

        def synced(f: Completion) -> None:
            err: BaseException | None = None
            try:
                f.result()
            except BaseException as exc:  # reported through done()
                err = self._wrap(self.slots[0], exc)
            tier._finish_write(self.slots, self.gens, err is None)
            assert self._done is not None
            self._done(err)

        try:
            tier.backend.sync(tier.durability is Durability.FLUSH).add_done_callback(synced)  # type: ignore[arg-type]
        except BaseException as exc:  # reported through done()
            tier._finish_write(self.slots, self.gens, False)
            self._done(self._wrap(self.slots[0], exc))

    def __repr__(self) -> str:
        return f"<_FileOp {'write' if self.write else 'read'} blocks:{len(self.slots)} left:{self._left}>"

