"""The self-verifying slab format of the file tier.

One preallocated file per pool::

    offset 0                 superblock (4096 bytes): magic, format version, layout fingerprint and text,
                             slot count, slot size, payload length, superblock checksum
    offset 4096 + i * S      slot i: header (4096 bytes) + payload (bytes_per_block, zero-padded to 4096)

A slot header carries: magic, format version, layout fingerprint, slot index, generation, payload length,
payload checksum (xxh3-128), checksum algorithm, content key (type + bytes), and an xxh3-64 checksum of
the header itself in its last 8 bytes. An all-zero header is an empty slot (a fresh preallocated file
reads as zeros). Everything is little-endian.

Primitives: :class:`Superblock` (pack/unpack), :func:`pack_header` / :func:`unpack_header`,
:func:`payload_checksum`, :func:`encode_key` / :func:`decode_key`.
"""

from __future__ import annotations

import dataclasses
import struct

import numpy as np
import torch
import xxhash

from .layout import KVLayout

__all__ = [
    "HEADER_SIZE",
    "MAX_KEY_BYTES",
    "SLAB_VERSION",
    "Key",
    "SlotHeader",
    "Superblock",
    "decode_key",
    "encode_key",
    "layout_text",
    "pack_header",
    "payload_checksum",
    "slot_payload_size",
    "unpack_header",
]

#: Version of the slab format (superblock and slot headers).
SLAB_VERSION = 1
#: Bytes of the superblock and of every slot header; also the alignment of every slot.
HEADER_SIZE = 4096
#: Longest content key (after encoding).
MAX_KEY_BYTES = 1024

SLAB_MAGIC = b"TKVSLAB\x01"
SLOT_MAGIC = b"TKVSLOT\x01"
CHECKSUM_XXH3_128 = 1

Key = bytes | str | int
_KEY_BYTES, _KEY_STR, _KEY_INT = 1, 2, 3

# magic, version, header size, fingerprint, slot, generation, payload length, checksum, algo, key type, key length
_SLOT = struct.Struct("<8sII16sQQQ16sBBH")
# magic, version, header size, fingerprint, slots, slot size, payload length, text length
_SUPER = struct.Struct("<8sII16sQQQH")
_TAIL = struct.Struct("<Q")
_TAIL_AT = HEADER_SIZE - _TAIL.size
_ZEROS = bytes(HEADER_SIZE)


def slot_payload_size(layout: KVLayout) -> int:
    """Bytes reserved for a payload: ``bytes_per_block`` rounded up to 4096."""
    return -(-layout.bytes_per_block // HEADER_SIZE) * HEADER_SIZE


def layout_text(layout: KVLayout) -> str:
    """A human-readable layout description, stored in the superblock for error messages."""
    dtype = str(layout.dtype).removeprefix("torch.")
    return (
        f"layers={layout.num_layers} kv={layout.kv_factor} heads={layout.num_kv_heads} "
        f"tokens={layout.tokens_per_block} head_dim={layout.head_dim} dtype={dtype}"
    )


def encode_key(key: Key) -> tuple[int, bytes]:
    """``(type tag, bytes)`` of a content key.

    Raises:
        TypeError: not bytes, str or int (bool is refused).
        ValueError: empty or longer than :data:`MAX_KEY_BYTES` once encoded.
    """
    if isinstance(key, (bytes, bytearray, memoryview)):
        tag, raw = _KEY_BYTES, bytes(key)
    elif isinstance(key, str):
        tag, raw = _KEY_STR, key.encode()
    elif isinstance(key, int) and not isinstance(key, bool):
        tag, raw = _KEY_INT, key.to_bytes(key.bit_length() // 8 + 1, "little", signed=True)
    else:
        raise TypeError(f"a content key must be bytes, str or int, got {type(key).__name__}")
    if not raw:
        raise ValueError("a content key must not be empty")
    if len(raw) > MAX_KEY_BYTES:
        raise ValueError(f"a content key must be at most {MAX_KEY_BYTES} bytes, got {len(raw)}")
    return tag, raw


def decode_key(tag: int, raw: bytes) -> Key:
    """The key encoded as ``(tag, raw)`` by :func:`encode_key`."""
    if tag == _KEY_BYTES:
        return raw
    if tag == _KEY_STR:
        return raw.decode()
    if tag == _KEY_INT:
        return int.from_bytes(raw, "little", signed=True)
    raise ValueError(f"unknown key type {tag}")


def normalize_key(key: Key) -> Key:
    """The value a key decodes back to (bytearray/memoryview become bytes)."""
    tag, raw = encode_key(key)
    return decode_key(tag, raw)


def payload_checksum(payload: torch.Tensor | np.ndarray | memoryview | bytes) -> bytes:
    """xxh3-128 digest of a host payload (16 bytes)."""
    if isinstance(payload, torch.Tensor):
        payload = payload.reshape(-1).view(torch.uint8).numpy()
    if isinstance(payload, np.ndarray):
        payload = payload.data  # ndarray.data is the buffer (a memoryview) without a copy
    return xxhash.xxh3_128_digest(payload)


@dataclasses.dataclass(frozen=True, slots=True)
class SlotHeader:
    """A decoded slot header."""

    fingerprint: bytes
    slot: int
    generation: int
    payload_length: int
    checksum: bytes
    key: Key


def pack_header(
    out: memoryview, fingerprint: bytes, slot: int, generation: int, key: Key, payload_length: int, checksum: bytes
) -> None:
    """Write a slot header into ``out`` (a writable 4096-byte buffer)."""
    tag, raw = encode_key(key)
    out[:HEADER_SIZE] = _ZEROS  # a reused buffer's stale bytes would be hashed
    head = _SLOT.pack(
        SLOT_MAGIC,
        SLAB_VERSION,
        HEADER_SIZE,
        fingerprint,
        slot,
        generation,
        payload_length,
        checksum,
        CHECKSUM_XXH3_128,
        tag,
        len(raw),
    )
    end = len(head) + len(raw)
    out[: len(head)] = head
    out[len(head) : end] = raw
    out[_TAIL_AT:] = _TAIL.pack(xxhash.xxh3_64_intdigest(out[:_TAIL_AT]))


def unpack_header(raw: memoryview | bytes) -> SlotHeader | str | None:
    """Decode a header: a :class:`SlotHeader`, ``None`` for an empty (all-zero) slot, or a reason string."""
    raw = memoryview(raw)[:HEADER_SIZE]
    if len(raw) < HEADER_SIZE:
        return "truncated header"
    if bytes(raw[:8]) != SLOT_MAGIC:
        if not any(raw[:64]) and not any(raw[_TAIL_AT:]):
            return None
        return "bad magic"
    (stored,) = _TAIL.unpack(raw[_TAIL_AT:])
    if xxhash.xxh3_64_intdigest(raw[:_TAIL_AT]) != stored:
        return "header checksum mismatch"
    _, version, size, fp, slot, gen, length, checksum, algo, tag, klen = _SLOT.unpack_from(raw)
    if version != SLAB_VERSION or size != HEADER_SIZE or algo != CHECKSUM_XXH3_128:
        return f"unsupported slot format (version {version}, header {size}, checksum {algo})"
    if klen == 0 or klen > MAX_KEY_BYTES:
        return "bad key length"
    try:
        key = decode_key(tag, bytes(raw[_SLOT.size : _SLOT.size + klen]))
    except (ValueError, UnicodeDecodeError):
        return "bad key"
    return SlotHeader(fp, slot, gen, length, checksum, key)


@dataclasses.dataclass(frozen=True, slots=True)
class Superblock:
    """The first 4096 bytes of a slab file."""

    fingerprint: bytes
    num_slots: int
    slot_size: int
    payload_length: int
    layout: str

    def pack(self) -> bytes:
        """The superblock's bytes."""
        text = self.layout.encode()[:1024]
        head = _SUPER.pack(
            SLAB_MAGIC,
            SLAB_VERSION,
            HEADER_SIZE,
            self.fingerprint,
            self.num_slots,
            self.slot_size,
            self.payload_length,
            len(text),
        )
        body = bytearray(HEADER_SIZE)
        body[: len(head)] = head
        body[len(head) : len(head) + len(text)] = text
        body[_TAIL_AT:] = _TAIL.pack(xxhash.xxh3_64_intdigest(bytes(body[:_TAIL_AT])))
        return bytes(body)

    @classmethod
    def unpack(cls, raw: bytes) -> Superblock | str:
        """The superblock, or a reason it is not one."""
        if len(raw) < HEADER_SIZE:
            return "the file is shorter than a superblock"
        if raw[:8] != SLAB_MAGIC:
            return "it does not start with the tiered_kv slab magic"
        (stored,) = _TAIL.unpack(raw[_TAIL_AT:HEADER_SIZE])
        if xxhash.xxh3_64_intdigest(raw[:_TAIL_AT]) != stored:
            return "its superblock checksum does not match"
        _, version, size, fp, slots, slot_size, length, tlen = _SUPER.unpack_from(raw)
        if version != SLAB_VERSION or size != HEADER_SIZE:
            return f"it has slab format version {version} (this is {SLAB_VERSION})"
        text = raw[_SUPER.size : _SUPER.size + tlen].decode(errors="replace")
        return cls(fp, slots, slot_size, length, text)
