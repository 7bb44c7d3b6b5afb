"""The file tier's verdicts on one slot: whether a read is served, and what a failed slot I/O is reported as.

* :func:`check_read_length` -- a read shorter than header plus payload is a truncated file: ``IntegrityError``.
* :func:`verify_slot` -- a read block is served only if its header matches the expected slot, geometry, key and
  generation, the copy that wrote that generation did not fail, and the payload matches its xxh3-128 checksum;
  anything else is ``IntegrityError`` (the caller drops the slot).
* :func:`slot_error` -- a failed backend call on a slot as the error the batch reports: a ``TransferError``
  as it is; a read of a slot past the end of a truncated slab an ``IntegrityError`` (on every backend); the rest
  a ``TransferError`` naming the slot.
"""

from __future__ import annotations

import os

import numpy as np
import torch

from ..backends import FileBackend
from ..errors import IntegrityError, TransferError
from ..slab import HEADER_SIZE, Key, payload_checksum, unpack_header
from .config import SlabGeometry
from .index import SlotIndex

__all__ = ["check_read_length", "slot_error", "verify_slot"]


def check_read_length(geometry: SlabGeometry, slot: int, n: int) -> None:
    """Raise ``IntegrityError`` if a read of ``slot`` returned ``n`` bytes, fewer than header plus payload."""
    if n < HEADER_SIZE + geometry.payload_bytes:
        raise IntegrityError(f"file slot {slot}: short read ({n} of {geometry.slot_size} bytes; the file is truncated)")


def verify_slot(
    geometry: SlabGeometry,
    index: SlotIndex,
    slot: int,
    key: Key,
    generation: int,
    hdr: np.ndarray,
    payload: torch.Tensor | np.ndarray,
) -> None:
    """Raise ``IntegrityError`` unless header ``hdr`` and ``payload`` read from ``slot`` may be served.

    Args:
        geometry: the slab's geometry (fingerprint, payload size).
        index: the slot index (the generation of a copy that failed).
        slot: the slot read.
        key: the content key expected.
        generation: the generation expected.
        hdr: the slot header as read.
        payload: the payload as read.
    """
    h = unpack_header(hdr.data)
    why = None
    if h is None:
        why = "the slot header is empty"
    elif isinstance(h, str):
        why = h
    elif h.fingerprint != geometry.fingerprint:
        why = "layout fingerprint mismatch"
    elif h.slot != slot:
        why = f"header names slot {h.slot}"
    elif h.payload_length != geometry.payload_bytes:
        why = f"payload length {h.payload_length} != {geometry.payload_bytes}"
    elif h.key != key:
        why = f"content key {h.key!r} != expected {key!r}"
    elif h.generation != generation:
        why = f"generation {h.generation} != expected {generation}"
    elif index.failed_generation(slot) == h.generation:
        why = "the copy that wrote it failed"
    elif payload_checksum(payload) != h.checksum:
        why = "payload checksum mismatch"
    if why is not None:
        raise IntegrityError(
            f"file slot {slot} failed verification: {why}; the slot was dropped and its data not served"
        )


def slot_error(
    write: bool, slot: int, exc: BaseException, backend: FileBackend, geometry: SlabGeometry
) -> BaseException:
    """The error a batch reports for ``exc``, raised by a write (``write``) or read of ``slot``."""
    if isinstance(exc, TransferError):
        return exc
    if not write:
        truncated = _truncation(backend, geometry, slot)
        if truncated is not None:
            # Backends disagree on a read past the end of the file (POSIX returns a short count, kvikio raises):
            # a truncated slab is damage, the same IntegrityError on every backend.
            err: BaseException = IntegrityError(
                f"file slot {slot}: short read ({truncated}); the slot was dropped and its data not served"
            )
            err.__cause__ = exc
            return err
    what = "writing" if write else "reading"
    err = TransferError(f"{what} file slot {slot} failed: {exc!r}")
    err.__cause__ = exc
    return err


def _truncation(backend: FileBackend, geometry: SlabGeometry, slot: int) -> str | None:
    """How the slab ends before ``slot`` does, or ``None`` (not truncated, or the size is unknown)."""
    path = getattr(getattr(backend, "inner", backend), "path", None)
    if path is None:
        return None
    try:
        size = os.stat(path).st_size
    except OSError:
        return None
    end = geometry.offset(slot) + geometry.slot_size
    return f"the file is truncated: {size} bytes, the slot ends at byte {end}" if size < end else None
