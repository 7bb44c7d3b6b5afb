"""Configuration of the file tier.

Primitives:

* :class:`Durability` -- when a copy into the file tier counts as complete (none / flush / fsync).
* :class:`FileTierConfig` -- directory, slot count, GDS mode, durability, threads, the I/O deadline; ``from_env``
  overrides.
* :class:`SlabGeometry` -- what a layout and a slot count make of the slab: fingerprint, slot and payload
  sizes, offsets.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import os
from collections.abc import Callable
from typing import Any

from ..backends import FileBackend
from ..config import coerce_enum, env_int
from ..layout import KVLayout
from ..slab import HEADER_SIZE, slot_payload_size

__all__ = ["Durability", "FileTierConfig", "SlabGeometry"]


class Durability(enum.StrEnum):
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
        """Accept a :class:`Durability` or its name (``"none"``, ``"flush"``, ``"fsync"``)."""
        durability = coerce_enum(cls, value)
        if durability is not None:
            return durability
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
        staging_blocks: pinned staging blocks shared by GPU<->FILE copies (the pipeline depth). ``None``
            (default): sized at first use from bandwidth x latency, one block's file read and one block's
            host<->device copy measured once (:func:`~tiered_kv.file.ring.ring_depth`), at most
            ``staging_bytes``.
        staging_bytes: the memory cap of an automatically sized ring (default 256 MiB, at least 2 blocks).
        verify_on_open: ``"header"`` (default: index every slot whose header verifies; payloads are verified
            on every read) or ``"full"`` (also read and checksum every payload at open).
        discard_mismatch: reopening a slab written for another layout is an error unless this is true, in
            which case the old slab is discarded. Env ``TIERED_KV_FILE_DISCARD=1``.
        backend_factory: ``path -> FileBackend`` replacing the GDS/posix choice (tests: a
            :class:`~tiered_kv.testing.FaultyBackend`).
        timeout: seconds one file I/O call (a block's read or write, a sync) may take before it fails with
            :class:`~tiered_kv.file.deadline.FileTimeout` (a ``TransferError``: the copy fails, the cache
            recomputes), default 5 like the remote tier's ``?timeout=``. ``None``: no deadline, and reads land
            straight in their pool blocks (with a deadline they land in a bounce buffer first, so that a read
            that returns late can never write into a block handed out since). Env ``TIERED_KV_FILE_TIMEOUT``
            (``off`` for ``None``).
    """

    directory: str | os.PathLike[str]
    num_blocks: int
    name: str = "kv"
    gds: str = "auto"
    durability: str = "none"
    io_threads: int = 4
    direct: bool | None = None
    staging_blocks: int | None = None
    staging_bytes: int = 256 << 20
    verify_on_open: str = "header"
    discard_mismatch: bool = False
    backend_factory: Callable[[str], FileBackend] | None = None
    timeout: float | None = 5.0

    def __post_init__(self) -> None:
        for name in ("num_blocks", "io_threads", "staging_blocks", "staging_bytes"):
            v = getattr(self, name)
            if v is None and name == "staging_blocks":
                continue
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"FileTierConfig.{name} must be a positive int, got {v!r}")
        if not isinstance(self.name, str) or not self.name or "/" in self.name or self.name.startswith("."):
            raise ValueError(f"FileTierConfig.name must be a plain file name stem, got {self.name!r}")
        Durability.coerce(self.durability)
        from ..backends.gds import GdsMode

        GdsMode.coerce(self.gds)
        if self.verify_on_open not in ("header", "full"):
            raise ValueError(f"verify_on_open must be 'header' or 'full', got {self.verify_on_open!r}")
        t = self.timeout
        if t is not None and (isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 < t < math.inf):
            raise ValueError(f"FileTierConfig.timeout must be a positive number of seconds or None, got {t!r}")

    @classmethod
    def from_env(cls, directory: str | os.PathLike[str], num_blocks: int, **overrides: Any) -> FileTierConfig:
        """Defaults, then ``TIERED_KV_GDS`` / ``TIERED_KV_FILE_*`` environment variables, then ``overrides``."""
        from ..backends.gds import GdsMode

        values: dict[str, Any] = {}
        if "TIERED_KV_GDS" in os.environ:
            values["gds"] = GdsMode.from_env().value
        if "TIERED_KV_FILE_DURABILITY" in os.environ:
            values["durability"] = os.environ["TIERED_KV_FILE_DURABILITY"]
        if "TIERED_KV_FILE_THREADS" in os.environ:
            values["io_threads"] = env_int("TIERED_KV_FILE_THREADS")
        if os.environ.get("TIERED_KV_FILE_DISCARD", "").lower() in ("1", "true", "yes"):
            values["discard_mismatch"] = True
        if "TIERED_KV_FILE_TIMEOUT" in os.environ:
            values["timeout"] = env_timeout("TIERED_KV_FILE_TIMEOUT")
        values.update(overrides)
        return cls(directory, num_blocks, **values)


def env_timeout(name: str) -> float | None:
    """Seconds from the environment variable ``name``: a positive number, or ``off`` / ``none`` for no deadline."""
    text = os.environ[name].strip().lower()
    if text in ("off", "none"):
        return None
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 < value < math.inf:
        raise ValueError(f"{name} must be a positive number of seconds or 'off', got {os.environ[name]!r}")
    return value


@dataclasses.dataclass(frozen=True, slots=True)
class SlabGeometry:
    """The slab of one layout: a superblock, then ``num_slots`` slots of ``slot_size`` bytes.

    Attributes:
        fingerprint: the layout fingerprint every header carries.
        num_slots: slots in the slab.
        payload_bytes: one block's bytes.
        slot_size: header, payload and padding to a multiple of 4096.
    """

    fingerprint: bytes
    num_slots: int
    payload_bytes: int
    slot_size: int

    @classmethod
    def of(cls, layout: KVLayout, num_slots: int) -> SlabGeometry:
        """The geometry of ``num_slots`` slots of ``layout``."""
        slot_size = HEADER_SIZE + slot_payload_size(layout)
        return cls(bytes.fromhex(layout.fingerprint), num_slots, layout.bytes_per_block, slot_size)

    @property
    def pad_bytes(self) -> int:
        """Zero bytes after the payload, up to the slot size."""
        return self.slot_size - HEADER_SIZE - self.payload_bytes

    @property
    def file_size(self) -> int:
        """Bytes of the whole slab."""
        return HEADER_SIZE + self.num_slots * self.slot_size

    def offset(self, slot: int) -> int:
        """Byte offset of ``slot``'s header in the slab."""
        return HEADER_SIZE + slot * self.slot_size
