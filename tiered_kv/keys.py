"""Content keys of KV blocks: a hash chain over token ids, salted with the layout and the model.

Primitives:

* :class:`KeyHasher` -- holds the *root key* (the salt: layout fingerprint + model identity + key format
  version) and hashes blocks: ``block_key(parent, tokens)``, ``chain(tokens)`` for every full block of a
  token sequence.
* :data:`ContentKey` -- 16 bytes (xxh3-128). The file tier writes it into slot headers as is.

A block's key is ``xxh3_128(parent_key || len(tokens) || tokens as little-endian int64)``; the first
block's parent is the root key. So a key names one exact prefix (every token before the block and the
block's own tokens) under one model and one layout: two models, two dtypes or two block sizes never share
a key. The token count is hashed too, so a *partial* block (fewer than ``tokens_per_block`` tokens) never
collides with a full one, and ``block_key(parent, tokens[:j + 1])`` names the prefix that ends at token
``j`` -- what :mod:`tiered_kv.tools.workload` derives deterministic per-token content from.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import xxhash

from .layout import KVLayout

__all__ = ["KEY_FORMAT_VERSION", "MAX_TOKEN_ID", "ContentKey", "KeyHasher", "as_token_array"]

#: Bumped whenever the meaning of a content key changes (keys persisted in file slots are then stale).
KEY_FORMAT_VERSION = 1

ContentKey = bytes


#: Token ids are hashed as little-endian int64: they must be in ``[0, MAX_TOKEN_ID]``.
MAX_TOKEN_ID = 2**63 - 1


def as_token_array(tokens: Sequence[int] | np.ndarray, what: str = "tokens") -> np.ndarray:
    """Token ids as a 1-D little-endian int64 array.

    Raises:
        TypeError: not a 1-D sequence of integers.
        ValueError: an id is negative or above ``2**63 - 1`` (it would wrap and alias another prompt's key).
    """
    if isinstance(tokens, (str, bytes, int, np.integer)):
        raise TypeError(f"{what} must be a sequence of token ids, got {type(tokens).__name__}")
    try:
        arr = np.asarray(tokens)
    except (TypeError, ValueError, OverflowError) as exc:
        raise TypeError(f"{what} must be a sequence of token ids: {exc}") from exc
    if arr.ndim != 1:
        raise TypeError(f"{what} must be one-dimensional, got shape {arr.shape}")
    if not arr.size:
        return arr.astype("<i8")
    if arr.dtype.kind in "Of" and not isinstance(tokens, np.ndarray):
        # Python ints numpy could not type as int64/uint64 (beyond 2**64, or 2**63.. next to negatives): check each
        values = list(tokens)
        if not all(isinstance(t, (int, np.integer)) and not isinstance(t, bool) for t in values):
            raise TypeError(f"{what} must be integers, got {arr.dtype}")
        bad = [int(t) for t in values if not 0 <= t <= MAX_TOKEN_ID]
        if bad:
            raise ValueError(f"{what} must be token ids in 0..2**63-1, got {bad[0]}")
        arr = np.asarray(values, dtype="<i8")
    if arr.dtype.kind not in "iu":
        raise TypeError(f"{what} must be integers, got {arr.dtype}")
    if arr.dtype.kind == "u":
        if arr.dtype.itemsize >= 8 and int(arr.max()) > MAX_TOKEN_ID:
            raise ValueError(f"{what} must be token ids in 0..2**63-1, got {int(arr.max())}")
    elif int(arr.min()) < 0:
        raise ValueError(f"{what} must be token ids in 0..2**63-1, got {int(arr.min())}")
    return arr.astype("<i8", copy=False)


class KeyHasher:
    """Hashes token blocks into content keys under one (layout, model) salt.

    Args:
        layout: the block layout; its fingerprint and ``tokens_per_block`` are part of the salt.
        model_id: the model's identity (name, revision, anything that changes the KV values: LoRA id,
            quantization, rope scaling). Two caches share keys only if both are equal.

    Raises:
        TypeError: ``model_id`` is not a string, ``layout`` not a :class:`KVLayout`.
    """

    __slots__ = ("layout", "model_id", "root", "tokens_per_block")

    def __init__(self, layout: KVLayout, model_id: str) -> None:
        if not isinstance(layout, KVLayout):
            raise TypeError(f"layout must be a KVLayout, got {type(layout).__name__}")
        if not isinstance(model_id, str):
            raise TypeError(f"model_id must be a str, got {type(model_id).__name__}")
        self.layout = layout
        self.model_id = model_id
        self.tokens_per_block = layout.tokens_per_block
        salt = f"tiered_kv-key/v{KEY_FORMAT_VERSION}|layout={layout.fingerprint}|model={model_id}"
        self.root: ContentKey = xxhash.xxh3_128_digest(salt.encode())

    def block_key(self, parent: ContentKey, tokens: np.ndarray) -> ContentKey:
        """The key of a block holding ``tokens`` (int64 array, 1..tokens_per_block) after ``parent``."""
        h = xxhash.xxh3_128()
        h.update(parent)
        h.update(len(tokens).to_bytes(4, "little"))
        h.update(tokens.tobytes())
        return h.digest()

    def chain(self, tokens: np.ndarray, parent: ContentKey | None = None, limit: int | None = None) -> list[ContentKey]:
        """Keys of the full blocks of ``tokens`` (a trailing partial block gets none).

        Args:
            tokens: int64 token ids (see :func:`as_token_array`).
            parent: key of the block before ``tokens[0]``; the root key by default.
            limit: hash at most this many blocks.
        """
        tpb = self.tokens_per_block
        n = len(tokens) // tpb
        if limit is not None:
            n = min(n, limit)
        key = self.root if parent is None else parent
        out: list[ContentKey] = []
        digest = xxhash.xxh3_128_digest
        count = tpb.to_bytes(4, "little")
        raw = tokens[: n * tpb].tobytes()
        step = tpb * 8
        for i in range(n):
            key = digest(key + count + raw[i * step : (i + 1) * step])
            out.append(key)
        return out

    def __repr__(self) -> str:
        return (
            f"<KeyHasher model={self.model_id!r} tokens_per_block={self.tokens_per_block} "
            f"root={self.root.hex()[:12]}>"
        )
