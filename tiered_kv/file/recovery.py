"""Opening the slab: the writer lock, creation or reuse, and the scan that rebuilds the index (warm restart).

Primitives:

* :func:`take_lock` -- an exclusive ``flock`` on ``<name>.lock``: one writer per slab.
* :func:`open_slab` -- create (preallocate, superblock) or reopen (check the superblock, resize, scan) the
  slab; recovered slots go into the :class:`~tiered_kv.file.index.SlotIndex`. Returns an :class:`OpenReport`.
* :class:`OpenReport` -- what opening found.

Recovery rules: a slot is indexed only if its header verifies (magic, checksum, format, this layout's
fingerprint, its own slot number, payload length) -- and its payload too with ``verify_on_open="full"``.
For a key found in several slots the newest generation whose payload verifies wins, so a write torn by a
crash never shadows an intact older copy.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import fcntl
import logging
import os
import time

from ..backends.posix import create_file, preallocate
from ..errors import LayoutMismatchError, SlabInUseError, StorageError
from ..layout import KVLayout
from ..slab import HEADER_SIZE, Key, SlotHeader, Superblock, layout_text, payload_checksum, unpack_header
from .config import FileTierConfig, SlabGeometry
from .index import SlotIndex
from .place import open_owned, storage_error

__all__ = ["OpenReport", "open_slab", "take_lock"]

log = logging.getLogger(__name__)


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


def take_lock(config: FileTierConfig, path: str) -> int:
    """Hold an exclusive ``flock`` on ``<name>.lock`` for the tier's lifetime: one writer per slab; its fd."""
    lock_path = os.path.join(os.fspath(config.directory), f"{config.name}.lock")
    fd = open_owned(lock_path, os.O_RDWR | os.O_CREAT)  # never through a symlink, never another user's file
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise SlabInUseError(
            f"{path} is in use by another file tier (this or another process); close it first"
        ) from None
    return fd


def open_slab(
    path: str, layout: KVLayout, geometry: SlabGeometry, config: FileTierConfig, index: SlotIndex
) -> OpenReport:
    """Create or reopen the slab at ``path``; recovered slots go into ``index``.

    Raises:
        LayoutMismatchError: the slab was written for another layout (or is not a slab) and
            ``config.discard_mismatch`` is false.
        OSError: the file cannot be created (ENOSPC while preallocating, permissions).
    """
    try:
        return _Opener(path, layout, geometry, config, index).open()
    except StorageError:
        raise
    except OSError as exc:  # ENOSPC while preallocating, EIO, ...: a sentence with the path and the size
        raise storage_error(exc, path, "create or open the slab", geometry.offset(geometry.num_slots)) from None


class _Opener:
    def __init__(
        self, path: str, layout: KVLayout, geometry: SlabGeometry, config: FileTierConfig, index: SlotIndex
    ) -> None:
        self.path = path
        self.layout = layout
        self.config = config
        self.index = index
        self.num_blocks = geometry.num_slots
        self.slot_size = geometry.slot_size
        self.payload_bytes = geometry.payload_bytes
        self._fingerprint = geometry.fingerprint
        self.offset = geometry.offset

    def open(self) -> OpenReport:
        t0 = time.perf_counter()
        cfg = self.config
        want = Superblock(
            self._fingerprint, self.num_blocks, self.slot_size, self.payload_bytes, layout_text(self.layout)
        )
        size = HEADER_SIZE + self.num_blocks * self.slot_size
        discarded = False
        existing = os.path.lexists(self.path)
        if existing:  # never through a symlink, never another user's file
            fd = open_owned(self.path, os.O_RDONLY)
            try:
                existing = os.fstat(fd).st_size > 0
                raw = os.pread(fd, HEADER_SIZE, 0)
            finally:
                os.close(fd)
        rewrite = False
        if existing:
            sb = Superblock.unpack(raw)
            problem = None
            if not any(raw):
                # A zeroed superblock: a creation that crashed between preallocating and writing it (then no slot
                # was ever written), or damage to a slab whose slots are intact. Either way it is treated as
                # damage, not as an empty slab: every slot verifies itself (magic, checksum, this layout's
                # fingerprint, its own slot number), so the scan below keeps exactly the verified slots of this
                # layout and the superblock is written again.
                slots_on_disk = max(0, (os.path.getsize(self.path) - HEADER_SIZE) // self.slot_size)
                log.warning(
                    "%s has a zeroed superblock; keeping the slots that verify (%d on disk) and rewriting it",
                    self.path,
                    slots_on_disk,
                )
                sb = Superblock(self._fingerprint, slots_on_disk, self.slot_size, self.payload_bytes, want.layout)
                rewrite = True
            elif isinstance(sb, str):
                problem = f"{self.path} is not a tiered_kv slab: {sb}"
            elif (
                sb.fingerprint != self._fingerprint
                or sb.slot_size != self.slot_size
                or sb.payload_length != self.payload_bytes
            ):
                problem = (
                    f"{self.path} was written for another layout ({sb.layout}, fingerprint {sb.fingerprint.hex()}); "
                    f"this tier has {want.layout} (fingerprint {self._fingerprint.hex()})"
                )
            if problem is not None:
                if not cfg.discard_mismatch:
                    raise LayoutMismatchError(
                        f"{problem}. Pass discard_mismatch=True (or TIERED_KV_FILE_DISCARD=1) to discard it."
                    )
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

        fd = open_owned(self.path, os.O_RDWR)  # ours (checked above, again here: no swap in between)
        try:
            mode = os.fstat(fd).st_mode & 0o777
            if mode & 0o077:
                log.warning("%s has mode %o; setting it to 0600", self.path, mode)
                os.fchmod(fd, 0o600)
            assert isinstance(sb, Superblock)
            old_slots = sb.num_slots
            if old_slots != self.num_blocks or rewrite:
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
        created = rewrite and recovered == 0  # a zeroed superblock over nothing: an interrupted creation
        return OpenReport(
            self.path,
            created,
            False,
            "existing",
            scanned,
            recovered,
            empty,
            bad,
            foreign,
            stale,
            time.perf_counter() - t0,
        )

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
            if payload is not None and (
                len(payload) < self.payload_bytes or payload_checksum(payload[: self.payload_bytes]) != h.checksum
            ):
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
        # payload, and must not shadow the intact older copy (the crash harness found this: a SIGKILL in the
        # middle of a spill left such a header).
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
        self.index.recover(((i, key, headers[i].generation) for key, i in best.items()), max_gen + 1)
        return nslots, len(best), empty, bad, foreign, stale

    def _payload_verifies(self, fd: int, slot: int, h: SlotHeader) -> bool:
        data = os.pread(fd, self.payload_bytes, self.offset(slot) + HEADER_SIZE)
        return len(data) == self.payload_bytes and payload_checksum(data) == h.checksum

    # ------------------------------------------------------------------------------------ index
