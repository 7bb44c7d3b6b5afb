"""Remote objects: one immutable, self-verifying object per KV block, named by its content key.

An object is a slab slot moved to a store: the slot header of :mod:`tiered_kv.slab` (magic, format version,
layout fingerprint, content key, payload length, xxh3-128 payload checksum, header checksum) followed by
the block's bytes. Its name is ``tkv/<rank>/<content key hex>``; the content key is the token-hash chain
salted with the model and the layout (:mod:`tiered_kv.keys`), and the rank (the tensor-parallel rank whose
KV shard the block is) is part of both the name and the header, so two ranks never read each other's shard.

Primitives: :func:`object_name`, :func:`object_size`, :func:`encode_object` (header + payload into one
buffer) and :func:`verify_object` (the payload, or the reason it is not the expected block).
"""

from __future__ import annotations

import numpy as np

from ..layout import KVLayout
from ..slab import HEADER_SIZE, SlotHeader, pack_header, payload_checksum, unpack_header

__all__ = ["NAME_PREFIX", "encode_object", "object_name", "object_size", "verify_object"]

#: Every object name starts with this (one namespace per object format version).
NAME_PREFIX = "tkv1"


def object_name(rank: int, key: bytes) -> str:
    """The store key of the block with content key ``key`` for tensor-parallel ``rank``."""
    return f"{NAME_PREFIX}/{rank}/{key.hex()}"


def object_size(layout: KVLayout) -> int:
    """Bytes of one object: the 4096-byte header and the block."""
    return HEADER_SIZE + layout.bytes_per_block


def encode_object(out: np.ndarray, fingerprint: bytes, rank: int, name: str, payload: np.ndarray) -> None:
    """Write the header for ``payload`` (already in ``out[HEADER_SIZE:]`` or copied there) into ``out``.

    Args:
        out: a uint8 buffer of :func:`object_size` bytes.
        fingerprint: the layout fingerprint (16 bytes).
        rank: tensor-parallel rank, stored in the header's slot field.
        name: the object name, stored as the header's key.
        payload: the block's bytes (uint8); copied into ``out`` unless it already is that memory.
    """
    body = out[HEADER_SIZE:]
    if payload.ctypes.data != body.ctypes.data:
        body[:] = payload
    pack_header(out[:HEADER_SIZE].data, fingerprint, rank, 0, name.encode(), len(body), payload_checksum(body))


def verify_object(raw: np.ndarray | memoryview | bytes, fingerprint: bytes, rank: int, name: str, length: int) -> np.ndarray | str:
    """The verified payload view of an object read back, or why it is not the block named ``name``.

    Everything is checked: size, header magic/version/checksum, layout fingerprint, rank, name, payload
    length and the payload's xxh3-128 checksum.
    """
    buf = np.frombuffer(raw, dtype=np.uint8) if not isinstance(raw, np.ndarray) else raw
    if buf.size != HEADER_SIZE + length:
        return f"object is {buf.size} bytes, expected {HEADER_SIZE + length}"
    header = unpack_header(buf[:HEADER_SIZE].data)
    if not isinstance(header, SlotHeader):
        return header or "empty header"
    if header.fingerprint != fingerprint:
        return "written for another block layout"
    if header.slot != rank or header.key != name.encode():
        return "header names another block"
    if header.payload_length != length:
        return f"payload length {header.payload_length}, expected {length}"
    payload = buf[HEADER_SIZE:]
    if payload_checksum(payload) != header.checksum:
        return "payload checksum mismatch"
    return payload
