"""The ``tiered_kv`` operator definitions: schemas, pure-torch CPU references, fake (meta) kernels.

The bottom of the ops stack: :mod:`tiered_kv._ext` (building and loading the CUDA implementations) and
:mod:`tiered_kv.ops` (the typed wrappers) both import this module, and it imports neither.

Primitives:

* The schemas of ``torch.ops.tiered_kv.gather_block_offsets``, ``copy_blocks``, ``copy_chunks``,
  ``copy_chunk_blocks`` (whole blocks of chunked pools: a pair's fixed chunk table and int-list indices) and
  ``copy_blocks_list`` (the engine's per-call path: int-list indices, an explicit stream handle), with their
  CPU implementations (the references) and fake kernels.
* The schema of ``torch.ops.tiered_kv.token_checksums`` (the per-token integrity checksums of blocks of a
  block-major pool, :func:`tiered_kv.integrity.token_checksums`), its CPU reference :func:`token_checksums_ref`
  and fake kernel.
* :data:`METHOD_KERNEL`, :data:`METHOD_DMA` -- the ``method`` argument of the copy ops.
* :func:`normalize_groups`, :func:`block_geometry` -- the (layer group, row) view of a pool the copy ops use.
* :func:`register_references` -- register the references under another dispatch key (CUDA without the
  compiled extension).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = [
    "METHOD_DMA",
    "METHOD_KERNEL",
    "block_geometry",
    "copy_blocks_list_ref",
    "copy_blocks_ref",
    "copy_chunk_blocks_ref",
    "copy_chunks_ref",
    "gather_block_offsets_ref",
    "normalize_groups",
    "token_checksums_ref",
]

#: ``method`` argument of :func:`copy_blocks` / :func:`copy_chunks`: one launch of the copy kernel.
METHOD_KERNEL = 0
#: ``method`` argument: DMA (``cudaMemcpyAsync`` / ``cudaMemcpy2DAsync``), merging contiguous runs, issued in C++.
METHOD_DMA = 1

# FRAGMENT, not DEF: other modules may add ops to the namespace (DEF can be used only once per namespace)
_lib = torch.library.Library("tiered_kv", "FRAGMENT")

_lib.define(
    "gather_block_offsets(Tensor(a!) dst, Tensor src, Tensor idx, Tensor? scale, Tensor? v_offset, "
    "int max_blocks, int sentinel) -> ()"
)
_lib.define(
    "copy_blocks(Tensor(a!)[] dst, Tensor[] src, Tensor src_blocks, Tensor dst_blocks, int num_tokens, "
    "int method) -> ()"
)
_lib.define("copy_chunks(Tensor(a!)[] dst, Tensor[] src, Tensor chunks, int method) -> ()")
# Whole blocks of chunked pools: a pair's fixed [chunks, 7] table (pool_kinds.block_table; table_dev, its copy on
# the device, saves shipping it per call) and the call's block indices as int lists.
_lib.define(
    "copy_chunk_blocks(Tensor(a!)[] dst, Tensor[] src, Tensor table, Tensor? table_dev, int[] src_blocks, "
    "int[] dst_blocks, int method) -> ()"
)
# The engine's per-call path: indices as int lists (no index tensors per call), an explicit raw stream handle
# (0 = the current stream); the CUDA version checks the indices against both pools and launches in one call.
_lib.define(
    "copy_blocks_list(Tensor(a!)[] dst, Tensor[] src, int[] src_blocks, int[] dst_blocks, int num_tokens, int method, "
    "int stream) -> ()"
)
# The extension's helpers, implemented in C++ only (one kernel for every device; without the extension they do not
# run): the native submission path's copy plans, the DMA calls a copy would make (for tests without a GPU), and the
# batched-DMA switch (for tests).
_lib.define("copy_plan(Tensor[] dst, Tensor[] src, int num_tokens, int method) -> int")
_lib.define("copy_plan_free(int plan) -> int")
_lib.define("dma_calls(Tensor[] dst, Tensor[] src, int[] src_blocks, int[] dst_blocks, int num_tokens) -> int[]")
_lib.define("dma_batch_mode(int mode) -> int")
# int32 [len(slots), tokens] checksums of blocks `slots` of a block-major pool (token_checksums_ref)
_lib.define("token_checksums(Tensor pool, Tensor slots) -> Tensor")


# --------------------------------------------------------------------------------------------- references


def gather_block_offsets_ref(
    dst: torch.Tensor,
    src: torch.Tensor,
    idx: torch.Tensor,
    scale: torch.Tensor | None,
    v_offset: torch.Tensor | None,
    max_blocks: int,
    sentinel: int,
) -> None:
    """CPU reference of ``gather_block_offsets`` (see :func:`tiered_kv.ops.gather_block_offsets`)."""
    if idx.numel() == 0 or max_blocks == 0:
        return
    rows = src.index_select(1, idx.to(device=src.device, dtype=torch.int64))[
        ..., :max_blocks
    ]  # [pools, seqs, kv, max_blocks]
    out = rows.clone()
    if scale is not None:
        out *= scale.to(out).view(-1, 1, 1, 1)
    if v_offset is not None and rows.shape[2] > 1:
        out[:, :, 1] += v_offset.to(out).view(-1, 1, 1)
    dst[..., :max_blocks] = torch.where(rows == sentinel, rows, out)


def normalize_groups(tensors: Sequence[torch.Tensor], groups: int, rows: int) -> list[torch.Tensor]:
    """Views ``[N, rows, row_elems...]`` of a pool side split into ``groups`` equal parts of each block.

    A side is one block-major tensor or one tensor per layer (or per layer and K/V); each tensor's
    per-block part is contiguous, so it splits into ``groups // len(tensors)`` consecutive groups.
    """
    per = groups // len(tensors)
    out: list[torch.Tensor] = []
    for t in tensors:
        v = t.view(t.shape[0], per, rows, -1)
        out.extend(v[:, j] for j in range(per))
    return out


def block_geometry(
    dst: Sequence[torch.Tensor], src: Sequence[torch.Tensor], num_tokens: int
) -> tuple[int, int, int, int]:
    """``(groups, rows per group, row elements, elements to copy per row)`` shared by both sides."""
    t = src[0]
    tokens, head_dim = t.shape[-2], t.shape[-1]
    per_block = math.prod(t.shape[1:])  # elements of one block in one tensor
    total = per_block * len(src)
    groups = max(len(src), len(dst))
    group_elems = total // groups
    if num_tokens == tokens:
        return groups, 1, group_elems, group_elems
    row = tokens * head_dim
    return groups, group_elems // row, row, num_tokens * head_dim


def copy_blocks_ref(
    dst: list[torch.Tensor],
    src: list[torch.Tensor],
    src_blocks: torch.Tensor,
    dst_blocks: torch.Tensor,
    num_tokens: int,
    method: int,
) -> None:
    """CPU reference of ``copy_blocks`` (see :func:`tiered_kv.ops.copy_blocks`)."""
    if src_blocks.numel() == 0:
        return
    groups, rows, _row, width = block_geometry(dst, src, num_tokens)
    s = src_blocks.to(torch.int64)
    d = dst_blocks.to(torch.int64)
    # One vectorized gather/scatter per group: a group is (a layer, or a layer and K/V), never a chunk.
    for sg, dg in zip(normalize_groups(src, groups, rows), normalize_groups(dst, groups, rows), strict=True):
        dg[d, :, :width] = sg[s, :, :width].to(dg.device)


def copy_blocks_list_ref(
    dst: list[torch.Tensor],
    src: list[torch.Tensor],
    src_blocks: list[int],
    dst_blocks: list[int],
    num_tokens: int,
    method: int,
    stream: int,
) -> None:
    """CPU reference of ``copy_blocks_list``: ``copy_blocks`` with int-list indices (``stream`` is unused)."""
    if len(src_blocks) != len(dst_blocks):
        raise ValueError(f"copy_blocks_list: {len(src_blocks)} source and {len(dst_blocks)} destination blocks")
    for name, blocks, limit in (
        ("src_blocks", src_blocks, src[0].shape[0]),
        ("dst_blocks", dst_blocks, dst[0].shape[0]),
    ):
        if blocks and (min(blocks) < 0 or max(blocks) >= limit):
            raise ValueError(f"copy_blocks_list: {name} holds an index out of range for a pool of {limit} blocks")
    s = torch.tensor(src_blocks, dtype=torch.int64)
    d = torch.tensor(dst_blocks, dtype=torch.int64)
    copy_blocks_ref(dst, src, s, d, num_tokens, method)


def _byte_view(t: torch.Tensor) -> torch.Tensor:
    return t.view(-1).view(torch.uint8) if t.numel() else t.new_empty(0, dtype=torch.uint8)


def copy_chunks_ref(dst: list[torch.Tensor], src: list[torch.Tensor], chunks: torch.Tensor, method: int) -> None:
    """CPU reference of ``copy_chunks`` (see :func:`tiered_kv.ops.copy_chunks`)."""
    if chunks.numel() == 0:
        return
    table = chunks.to(torch.int64).cpu()
    pair = table[:, 0] * len(dst) + table[:, 2]
    # One vectorized byte gather per (source tensor, destination tensor) pair present in the table.
    for key in torch.unique(pair).tolist():
        rows = table[pair == key]
        si, di = divmod(int(key), len(dst))
        sizes = rows[:, 4]
        starts = torch.cumsum(sizes, 0) - sizes
        within = torch.arange(int(sizes.sum())) - torch.repeat_interleave(starts, sizes)
        src_bytes = _byte_view(src[si])
        dst_bytes = _byte_view(dst[di])
        s_at = torch.repeat_interleave(rows[:, 1], sizes) + within
        d_at = torch.repeat_interleave(rows[:, 3], sizes) + within
        dst_bytes[d_at.to(dst_bytes.device)] = src_bytes[s_at.to(src_bytes.device)].to(dst_bytes.device)


def copy_chunk_blocks_ref(
    dst: list[torch.Tensor],
    src: list[torch.Tensor],
    table: torch.Tensor,
    table_dev: torch.Tensor | None,
    src_blocks: list[int],
    dst_blocks: list[int],
    method: int,
) -> None:
    """CPU reference of ``copy_chunk_blocks``: the per-call ``copy_chunks`` table of the blocks, then that op."""
    if len(src_blocks) != len(dst_blocks):
        raise ValueError(f"copy_chunk_blocks: {len(src_blocks)} source and {len(dst_blocks)} destination blocks")
    t = table.to(torch.int64).cpu()
    if t.dim() != 2 or t.size(1) != 7:
        raise ValueError("copy_chunk_blocks: table must be an int64 [chunks, 7] tensor")
    if t.numel() == 0 or not src_blocks:
        return
    s = torch.tensor(src_blocks, dtype=torch.int64)[:, None]
    d = torch.tensor(dst_blocks, dtype=torch.int64)[:, None]
    if int(s.min()) < 0 or int(d.min()) < 0:
        raise ValueError("copy_chunk_blocks: negative block index")
    n, c = len(src_blocks), t.size(0)
    chunks = torch.empty(n, c, 5, dtype=torch.int64)
    chunks[:, :, 0] = t[:, 0]
    chunks[:, :, 1] = t[:, 1] + s * t[:, 2]
    chunks[:, :, 2] = t[:, 3]
    chunks[:, :, 3] = t[:, 4] + d * t[:, 5]
    chunks[:, :, 4] = t[:, 6]
    flat = chunks.view(n * c, 5)
    sizes = [_byte_view(x).numel() for x in src], [_byte_view(x).numel() for x in dst]
    for col, side in ((0, 0), (2, 1)):
        idx = flat[:, col]
        if int(idx.min()) < 0 or int(idx.max()) >= len(sizes[side]):
            raise ValueError("copy_chunk_blocks: tensor index out of range in the table")
        ends = flat[:, col + 1] + flat[:, 4]
        if bool((ends > torch.tensor(sizes[side], dtype=torch.int64)[idx]).any()):
            raise ValueError("copy_chunk_blocks: a chunk reaches past the end of its tensor")
    copy_chunks_ref(dst, src, flat, method)


#: Bytes of temporaries one reference checksum call may make at once (the blocks are summed in chunks within it).
_CHECKSUM_CHUNK_BYTES = 256 << 20

_CHECKSUM_MULT = 0x9E3779B9 - (1 << 32)  # the 32-bit golden-ratio constant, as a signed int32

_CHECKSUM_WEIGHTS: dict[tuple[tuple[int, ...], torch.device], torch.Tensor] = {}


def _checksum_weights(shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """Odd int32 weights (a Weyl sequence) over one token's words ``[L, kv, H, 1, W]``, made once per shape."""
    w = _CHECKSUM_WEIGHTS.get((shape, device))
    if w is None:
        n = math.prod(shape)
        w = ((torch.arange(1, n + 1, dtype=torch.int64) * _CHECKSUM_MULT) | 1) & 0xFFFFFFFF
        w = torch.where(w >= 1 << 31, w - (1 << 32), w).to(torch.int32).view(shape)
        w = _CHECKSUM_WEIGHTS[(shape, device)] = w.to(device)
    return w


def token_checksums_ref(pool: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """CPU reference of ``token_checksums`` (see :func:`tiered_kv.integrity.token_checksums`), in torch ops.

    ``out[i, t]`` is the sum over the words of token ``t`` of block ``slots[i]`` of ``word * weight``, modulo 2**32.
    A token's row of ``D`` elements is read as words of 4 bytes when its size in bytes is a multiple of 4, else of 2
    bytes (sign-extended) when it is even, else of single bytes (zero-extended); word ``w`` of the row of
    ``(l, k, h)`` has the flat index ``f = ((l * kv + k) * H + h) * W + w`` and the weight
    ``((f + 1) * 0x9E3779B9) | 1`` modulo 2**32. Runs on any device (also the fallback on CUDA without the kernel).
    """
    if pool.dim() != 6:
        raise ValueError(f"token_checksums needs a block-major pool [blocks, L, kv, H, T, D], got {list(pool.shape)}")
    row_bytes = pool.shape[5] * pool.element_size()
    word = torch.int32 if row_bytes % 4 == 0 else torch.int16 if row_bytes % 2 == 0 else torch.uint8
    words = pool.view(torch.uint8).view(*pool.shape[:5], row_bytes).view(word)
    L, kv, H, _T, W = words.shape[1:]
    weights = _checksum_weights((L, kv, H, 1, W), pool.device)
    index = slots.to(pool.device, torch.int64, non_blocking=True)
    n = index.shape[0]
    out = torch.empty((n, pool.shape[4]), dtype=torch.int32, device=pool.device)
    step = max(1, _CHECKSUM_CHUNK_BYTES // max(1, 4 * math.prod(words.shape[1:])))
    for first in range(0, n, step):
        part = words.index_select(0, index[first : first + step])
        if word != torch.int32:
            part = part.to(torch.int32)
        # products and sums wrap modulo 2**32 (the outer sum is taken in int64 and cut to 32 bits): the same value on
        # every device, whatever order the reduction takes
        out[first : first + step] = (part * weights).sum(dim=5, dtype=torch.int32).sum(dim=(1, 2, 3)).to(torch.int32)
    return out


_lib.impl("gather_block_offsets", gather_block_offsets_ref, "CPU")
_lib.impl("copy_blocks", copy_blocks_ref, "CPU")
_lib.impl("copy_chunks", copy_chunks_ref, "CPU")
_lib.impl("copy_chunk_blocks", copy_chunk_blocks_ref, "CPU")
_lib.impl("copy_blocks_list", copy_blocks_list_ref, "CPU")
_lib.impl("token_checksums", token_checksums_ref, "CPU")


def _gather_fake(
    dst: Tensor, src: Tensor, idx: Tensor, scale: Tensor | None, v_offset: Tensor | None, max_blocks: int, sentinel: int
) -> None:
    return None


def _copy_blocks_fake(
    dst: list[Tensor], src: list[Tensor], src_blocks: Tensor, dst_blocks: Tensor, num_tokens: int, method: int
) -> None:
    return None


def _copy_blocks_list_fake(
    dst: list[Tensor],
    src: list[Tensor],
    src_blocks: list[int],
    dst_blocks: list[int],
    num_tokens: int,
    method: int,
    stream: int,
) -> None:
    return None


def _copy_chunks_fake(dst: list[Tensor], src: list[Tensor], chunks: Tensor, method: int) -> None:
    return None


def _copy_chunk_blocks_fake(
    dst: list[Tensor],
    src: list[Tensor],
    table: Tensor,
    table_dev: Tensor | None,
    src_blocks: list[int],
    dst_blocks: list[int],
    method: int,
) -> None:
    return None


def _token_checksums_fake(pool: Tensor, slots: Tensor) -> Tensor:
    return pool.new_empty((slots.shape[0], pool.shape[4]), dtype=torch.int32)


# fake (meta) kernels: the copy ops mutate their destinations in place and return nothing; token_checksums returns
# a new int32 [len(slots), tokens] tensor
torch.library.register_fake("tiered_kv::gather_block_offsets", _gather_fake, lib=_lib)
torch.library.register_fake("tiered_kv::copy_blocks", _copy_blocks_fake, lib=_lib)
torch.library.register_fake("tiered_kv::copy_chunks", _copy_chunks_fake, lib=_lib)
torch.library.register_fake("tiered_kv::copy_chunk_blocks", _copy_chunk_blocks_fake, lib=_lib)
torch.library.register_fake("tiered_kv::copy_blocks_list", _copy_blocks_list_fake, lib=_lib)
torch.library.register_fake("tiered_kv::token_checksums", _token_checksums_fake, lib=_lib)


# --------------------------------------------------------------------------------------------- validation
