"""KV-cache block layout: shape, size and a stable fingerprint.

Primitives:

* :class:`KVLayout` -- block shape, bytes per block, partial bytes, fingerprint.
* :data:`FORMAT_VERSION` -- part of every fingerprint.

A block in a *block-major* pool is one contiguous region ``[layers, kv, heads, tokens, head_dim]``.
The fingerprint hashes every field plus :data:`FORMAT_VERSION`; anything persisted (file tier, content
keys) is guarded by it, so a change of dtype, head count or block size is never read as valid data.
"""

from __future__ import annotations

import dataclasses
import hashlib

import torch

__all__ = ["FORMAT_VERSION", "KVLayout"]

#: Bumped whenever the on-disk or in-memory meaning of a block changes.
FORMAT_VERSION = 1

# dtypes a KV cache is stored in; the name is part of the fingerprint, so keep names stable.
_DTYPES: dict[torch.dtype, str] = {
    torch.float32: "float32",
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
    torch.float8_e4m3fn: "float8_e4m3fn",
    torch.float8_e5m2: "float8_e5m2",
    torch.int8: "int8",
    torch.uint8: "uint8",
}


@dataclasses.dataclass(frozen=True, slots=True)
class KVLayout:
    """Geometry of one KV-cache block.

    Args:
        num_layers: transformer layers stored per block.
        num_kv_heads: KV heads per layer.
        head_dim: elements per head.
        tokens_per_block: tokens per block (the page size).
        dtype: element type (float32/16, bfloat16, float8 e4m3/e5m2, int8, uint8).
        kv_factor: 2 for separate K and V, 1 for MLA-style joint latents.

    Raises:
        ValueError: a field is not a positive integer or the dtype is not supported.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    tokens_per_block: int
    dtype: torch.dtype = torch.float16
    kv_factor: int = 2

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "tokens_per_block", "kv_factor"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"KVLayout.{name} must be an int, got {value!r}")
            if value < 1:
                raise ValueError(f"KVLayout.{name} must be >= 1, got {value}")
        if self.kv_factor not in (1, 2):
            raise ValueError(f"KVLayout.kv_factor must be 1 (MLA) or 2 (K and V), got {self.kv_factor}")
        if self.dtype not in _DTYPES:
            names = ", ".join(_DTYPES.values())
            raise ValueError(f"KVLayout.dtype {self.dtype!r} is not supported; use one of {names}")

    @property
    def block_shape(self) -> tuple[int, int, int, int, int]:
        """``(layers, kv, heads, tokens, head_dim)`` of one block-major block."""
        return (self.num_layers, self.kv_factor, self.num_kv_heads, self.tokens_per_block, self.head_dim)

    @property
    def itemsize(self) -> int:
        """Bytes per element."""
        return self.dtype.itemsize

    @property
    def elements_per_block(self) -> int:
        """Elements in one block."""
        n = 1
        for d in self.block_shape:
            n *= d
        return n

    @property
    def bytes_per_block(self) -> int:
        """Bytes in one block."""
        return self.elements_per_block * self.itemsize

    @property
    def chunk_bytes(self) -> int:
        """Bytes of one (layer, kv) chunk: what a layer-major pool stores contiguously per block."""
        return self.num_kv_heads * self.tokens_per_block * self.head_dim * self.itemsize

    def partial_bytes(self, num_tokens: int) -> int:
        """Bytes moved when only the first ``num_tokens`` tokens of a block are copied."""
        return self.bytes_per_block // self.tokens_per_block * num_tokens

    @property
    def fingerprint(self) -> str:
        """Stable hex digest of every field plus the format version (same on every machine and run)."""
        text = (
            f"tiered_kv/v{FORMAT_VERSION}|layers={self.num_layers}|kv={self.kv_factor}"
            f"|heads={self.num_kv_heads}|tokens={self.tokens_per_block}|head_dim={self.head_dim}"
            f"|dtype={_DTYPES[self.dtype]}"
        )
        return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()
