"""Memory pools: tiers and block-major pools of KV blocks.

Primitives:

* :class:`Tier` -- GPU, HOST, FILE (a ``StrEnum``; ``Tier.coerce``).
* :class:`BlockPool` -- one block-major tensor ``[blocks, *block_shape]``.
* :func:`as_indices`, :func:`check_indices` -- index validation; :func:`merge_runs` -- runs contiguous on both sides.

A *memory-pool block index* addresses one block slot in one pool. Pools hand out cheap views; bounds and
index rules are checked here, at the public boundary, before anything is enqueued.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable

import numpy as np
import torch

from .config import coerce_enum
from .layout import KVLayout

__all__ = ["SMALL_CALL_BLOCKS", "BlockPool", "Tier", "as_indices", "check_indices", "merge_runs", "small_pairs"]

#: Up to this many block pairs a copy is validated on plain int lists (:func:`small_pairs`), without numpy.
SMALL_CALL_BLOCKS = 256


class Tier(enum.StrEnum):
    """Where a block lives."""

    GPU = "gpu"
    HOST = "host"
    FILE = "file"
    REMOTE = "remote"  #: a distributed store (tiered_kv.remote): content-keyed objects, no block indices

    @classmethod
    def coerce(cls, value: object) -> Tier:
        """Accept a :class:`Tier` or its name/value (``"gpu"``, ``"HOST"``)."""
        if isinstance(value, Tier):  # the common case first: every copy() coerces two tiers
            return value
        tier = coerce_enum(cls, value)
        if tier is not None:
            return tier
        raise ValueError(f"unknown tier {value!r}; use one of {', '.join(t.name for t in cls)}")


class BlockPool:
    """A block-major pool: one tensor ``[num_blocks, layers, kv, heads, tokens, head_dim]``.

    Args:
        tier: the tier this pool is.
        layout: block geometry.
        tensor: the storage; its shape and dtype must match ``layout``.
    """

    def __init__(self, tier: Tier, layout: KVLayout, tensor: torch.Tensor) -> None:
        expected = layout.block_shape
        if tensor.dim() != 6 or tuple(tensor.shape[1:]) != expected:
            raise ValueError(
                f"{tier.value} pool must have shape [num_blocks, *{list(expected)}], got {list(tensor.shape)}"
            )
        if tensor.dtype != layout.dtype:
            raise TypeError(f"{tier.value} pool dtype {tensor.dtype} does not match the layout dtype {layout.dtype}")
        if not tensor.is_contiguous():
            raise ValueError(f"{tier.value} pool tensor must be contiguous (block-major)")
        self.tier = tier
        self.name = tier.value
        self.layout = layout
        self.tensor = tensor
        self.num_blocks = tensor.shape[0]

    def block(self, index: int) -> torch.Tensor:
        """A view of one block, shape ``layout.block_shape``."""
        if isinstance(index, bool) or not isinstance(index, (int, np.integer)):
            raise TypeError(f"block index must be an int, got {type(index).__name__}")
        if not 0 <= index < self.num_blocks:
            raise ValueError(
                f"block index {index} is out of range for the {self.name} pool of {self.num_blocks} blocks"
            )
        return self.tensor[index]

    def check(self, indices: np.ndarray, what: str) -> None:
        """Raise ``ValueError`` unless every index is in ``[0, num_blocks)``."""
        check_indices(indices, self.num_blocks, what, f"the {self.name} pool of {self.num_blocks} blocks")

    def __repr__(self) -> str:
        return f"<BlockPool {self.name} blocks={self.num_blocks} device={self.tensor.device}>"


def check_indices(indices: np.ndarray, num_blocks: int, what: str, pool: str) -> None:
    """Raise ``ValueError`` unless every index is in ``[0, num_blocks)`` (``pool`` names the pool in the message)."""
    if indices.size == 0:
        return
    lo, hi = int(indices.min()), int(indices.max())
    if lo < 0:
        raise ValueError(f"{what} contain a negative block index ({lo})")
    if hi >= num_blocks:
        raise ValueError(f"{what} contain block index {hi}, out of range for {pool}")


def as_indices(value: Iterable[int] | np.ndarray | torch.Tensor, what: str) -> np.ndarray:
    """Convert block indices (list, range, numpy or CPU torch integer array) to a 1-D int64 array.

    Raises:
        TypeError: not a sequence of integers.
        ValueError: an integer too large for a block index (beyond int64, e.g. ``np.uint64(2**63)`` or ``2**70``).
    """
    if isinstance(value, torch.Tensor):
        if value.is_floating_point() or value.is_complex() or value.dtype == torch.bool:
            raise TypeError(f"{what} must be integers, got a tensor of {value.dtype}")
        arr = value.detach().to("cpu").numpy()
    elif isinstance(value, (int, np.integer, str, bytes)):
        raise TypeError(f"{what} must be a sequence of block indices, got {type(value).__name__}")
    else:
        try:
            arr = (
                value
                if isinstance(value, np.ndarray)
                else np.fromiter(value, dtype=np.int64)
                if isinstance(value, range)
                else np.asarray(list(value))
            )
        except TypeError as exc:
            raise TypeError(f"{what} must be a sequence of block indices, got {type(value).__name__}") from exc
    if arr.ndim != 1:
        raise TypeError(f"{what} must be one-dimensional, got shape {arr.shape}")
    if arr.size == 0:
        return arr.astype(np.int64)
    if arr.dtype == object:  # Python ints beyond int64 (``[2**70]``), or a mix of types
        return _object_indices(arr, what)
    if arr.dtype.kind not in "iu":
        raise TypeError(f"{what} must be integers, got {arr.dtype}")
    if arr.dtype.kind == "u" and arr.dtype.itemsize >= 8 and int(arr.max()) > _INT64_MAX:
        raise ValueError(_too_large(what, int(arr.max())))  # astype(int64) would wrap it to a negative index
    return arr.astype(np.int64, copy=False)


#: The largest block index: indices are int64.
_INT64_MAX = 2**63 - 1


def _too_large(what: str, value: int) -> str:
    return f"{what} contain block index {value}, out of range: too large for a block index (at most 2**63 - 1)"


def _object_indices(arr: np.ndarray, what: str) -> np.ndarray:
    """An object array of indices as int64.

    A non-integer is a ``TypeError`` naming its type, an integer beyond int64 a ``ValueError`` saying it is out of
    range (not "got object").
    """
    items = arr.tolist()
    for x in items:
        if isinstance(x, bool) or not isinstance(x, (int, np.integer)):
            raise TypeError(f"{what} must be integers, got {type(x).__name__}")
    values = [int(x) for x in items]
    lo, hi = min(values), max(values)
    if lo < 0:
        raise ValueError(f"{what} contain a negative block index ({lo})")
    if hi > _INT64_MAX:
        raise ValueError(_too_large(what, hi))
    return np.array(values, dtype=np.int64)


def small_pairs(
    src: object, dst: object, src_blocks: int, dst_blocks: int, same_pool: bool
) -> tuple[list[int], list[int], int] | None:
    """The per-call fast path of index validation: ``(src list, dst list, runs)`` when both are valid, else ``None``.

    Valid means: lists of plain ints (or 1-D integer numpy arrays) of the same length, 1..``SMALL_CALL_BLOCKS``
    pairs, every index in range, no duplicate destination and, when ``same_pool``, no block on both sides.
    ``None`` also for anything it does not handle: the caller then runs the general checks (:func:`as_indices`,
    :func:`check_indices`), which raise the descriptive errors. No numpy or torch call for lists. The lists
    returned are new ones: a caller may reuse its own as soon as the call returns. ``runs``: how many runs of pairs
    consecutive on both sides the call has (what the copier's path choice needs), counted in the same pass.
    """
    if type(src) is list and type(dst) is list:
        if len(src) == 1 and len(dst) == 1:  # one pair: the most frequent call, checked without loops or a set
            x, y = src[0], dst[0]
            if type(x) is int and type(y) is int and 0 <= x < src_blocks and 0 <= y < dst_blocks:
                return ([x], [y], 1) if not same_pool or x != y else None
            return None
        s, d = src.copy(), dst.copy()
        if not s or len(s) != len(d) or len(s) > SMALL_CALL_BLOCKS:
            return None
        runs = 0
        px = py = -2
        for x, y in zip(s, d, strict=True):  # the types and the runs in one pass
            if type(x) is not int or type(y) is not int:
                return None
            if x != px + 1 or y != py + 1:
                runs += 1
            px, py = x, y
    elif type(src) is np.ndarray and type(dst) is np.ndarray:
        if src.ndim != 1 or dst.ndim != 1 or not 0 < src.size <= SMALL_CALL_BLOCKS or src.size != dst.size:
            return None
        if src.dtype.kind not in "iu" or dst.dtype.kind not in "iu":
            return None
        s, d = src.tolist(), dst.tolist()
        size = len(s)
        s0, d0 = s[0], d[0]
        if size > 1 and s == list(range(s0, s0 + size)) and d == list(range(d0, d0 + size)):
            # one run on both sides (a prefix's blocks, a layer range): its ends bound it, no duplicate is possible
            if s0 < 0 or s0 + size > src_blocks or d0 < 0 or d0 + size > dst_blocks:
                return None
            if same_pool and s0 < d0 + size and d0 < s0 + size:
                return None
            return s, d, 1
        if size > 16:  # vectorized (a few numpy calls cost less than loops over the lists)
            a, b = src.astype(np.int64, copy=False), dst.astype(np.int64, copy=False)
            da, db = a[1:] - a[:-1], b[1:] - b[:-1]
            runs = 1 + int(np.count_nonzero((da != 1) | (db != 1)))
            if (db > 0).all():  # rising destinations: no duplicate, the extremes at the ends
                if d[0] < 0 or d[-1] >= dst_blocks or int(a.min()) < 0 or int(a.max()) >= src_blocks:
                    return None
                if same_pool and (da > 0).all():
                    disjoint = s[-1] < d[0] or d[-1] < s[0] or not np.isin(a, b, assume_unique=True).any()
                elif same_pool:
                    disjoint = not np.isin(a, b).any()
                else:
                    disjoint = True
                return (s, d, runs) if disjoint else None
        else:
            runs = 1 + sum(1 for i in range(1, len(s)) if s[i] != s[i - 1] + 1 or d[i] != d[i - 1] + 1)
    else:
        return None
    if min(s) < 0 or max(s) >= src_blocks or min(d) < 0 or max(d) >= dst_blocks:
        return None
    dset = set(d)
    if len(dset) != len(d) or (same_pool and not dset.isdisjoint(s)):
        return None
    return s, d, runs


def merge_runs(src: np.ndarray, dst: np.ndarray) -> list[tuple[int, int, int]]:
    """Group index pairs into ``(src_start, dst_start, length)`` runs contiguous on both sides.

    Vectorized: a copy of 4096 consecutive blocks becomes one run, so one DMA.
    """
    if src.size <= 1:
        return [(int(src[0]), int(dst[0]), 1)] if src.size else []
    breaks = np.flatnonzero((np.diff(src) != 1) | (np.diff(dst) != 1)) + 1
    starts = np.concatenate(([0], breaks))
    lengths = np.diff(np.concatenate((starts, [src.size])))
    return list(zip(src[starts].tolist(), dst[starts].tolist(), lengths.tolist(), strict=True))
