"""The ``tiered_kv`` torch operators: typed wrappers over the schemas of :mod:`tiered_kv.opdefs`.

Primitives (namespace ``torch.ops.tiered_kv``):

* :func:`gather_block_offsets` -- ``dst[p, s, k, j] = scale[p] * src[p, idx[s], k, j] + (k == 1 ? v_offset[p] : 0)``
  for ``j < max_blocks``; a ``sentinel`` entry ("no block") passes through unchanged.
  :func:`unchecked_gather` -- the same op without the per-call checks, for a caller that made its arguments.
* :func:`copy_blocks` -- copy blocks (all tokens, or tokens ``[0, num_tokens)`` of every (layer, kv, head))
  between pools that are block-major (one tensor ``[N, layers, kv, heads, tokens, head_dim]``) or
  layer-major (one tensor per layer ``[N, kv, heads, tokens, head_dim]``, or per layer and K/V
  ``[N, heads, tokens, head_dim]``), by a copy kernel or by DMA.
* :func:`copy_chunks` -- many ``(src tensor, src byte offset, dst tensor, dst byte offset, nbytes)`` chunks
  in one call, any alignment, by a copy kernel or by DMA.

The schemas and the pure-torch CPU references are defined in :mod:`tiered_kv.opdefs`, so the operators exist
with or without the compiled extension; the extension (``kernels/*.cu``, built by :mod:`tiered_kv._ext`) adds CUDA
implementations with ``TORCH_LIBRARY_IMPL(tiered_kv, CUDA, m)``. Each wrapper validates its arguments
(dtypes, shapes, devices, index ranges where they are on the CPU) and raises ``ValueError``/``TypeError``
*before* anything is launched.

Notes:
    The CUDA implementations read and write pinned host tensors directly (unified addressing), so a host
    table or pool they read must stay unchanged until the launch has executed on its stream -- the staging
    rule of :mod:`tiered_kv.staging`. The wrappers do not copy their inputs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from . import _ext

__all__ = [
    "METHOD_DMA",
    "METHOD_KERNEL",
    "copy_blocks",
    "copy_chunks",
    "gather_block_offsets",
    "normalize_groups",
    "unchecked_gather",
]

from .opdefs import (
    METHOD_DMA,
    METHOD_KERNEL,
    copy_blocks_ref,
    copy_chunks_ref,
    gather_block_offsets_ref,
    normalize_groups,
)

_COPY_DTYPES = (
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
    torch.int8,
    torch.uint8,
)
_INDEX_DTYPES = (torch.int32, torch.int64)


def _check_host_readable(t: torch.Tensor, device: torch.device, what: str, *, reads: bool = True) -> None:
    """A CUDA launch on ``device`` can read ``t``: it lives there or in pinned host memory.

    With ``reads=False`` (the op reads nothing of ``t``) host memory of any kind is accepted, as on the CPU.
    """
    if device.type != "cuda":
        if t.device.type != "cpu":
            raise ValueError(f"{what} is on {t.device}, but the operation runs on the CPU")
        return
    if t.device.type == "cuda":
        if t.device != device:
            raise ValueError(f"{what} is on {t.device}, but the operation runs on {device}")
    elif t.device.type != "cpu" or (reads and t.numel() and not t.is_pinned()):
        where = "pageable host memory" if t.device.type == "cpu" else str(t.device)
        raise ValueError(f"{what} must be on {device} or in pinned host memory, got {where}")


def _check_index_device(t: torch.Tensor, device: torch.device, what: str) -> None:
    """Block indices may be on the CPU (any memory: the op ships them) or on the device the op runs on."""
    if t.device.type != "cpu" and t.device != device:
        raise ValueError(f"{what} is on {t.device}, but the operation runs on {device}")


def _run_device(tensors: Sequence[torch.Tensor]) -> torch.device:
    """Where an op runs: the first CUDA device among its tensors, else the CPU."""
    for t in tensors:
        if t.device.type == "cuda":
            return t.device
    return torch.device("cpu")


def _use_reference(device: torch.device) -> bool:
    """CUDA tensors but no compiled kernels (no toolkit, build failed): run the reference on them instead.

    The reference is plain torch, so it works on CUDA tensors too; it is slower and synchronizes where it
    crosses devices (which also makes it read host inputs at call time, never later).
    """
    if device.type != "cuda":
        return False
    return not _ext.load()


def _check_method(method: int) -> int:
    if method not in (METHOD_KERNEL, METHOD_DMA):
        raise ValueError(f"method must be METHOD_KERNEL (0) or METHOD_DMA (1), got {method!r}")
    return method


# --------------------------------------------------------------------------------------------- wrappers


def gather_block_offsets(
    dst: torch.Tensor,
    src: torch.Tensor,
    idx: torch.Tensor,
    *,
    scale: torch.Tensor | None = None,
    v_offset: torch.Tensor | None = None,
    max_blocks: int | None = None,
    sentinel: int = -1,
) -> torch.Tensor:
    """Gather rows of a block-offset table.

    ``dst[p, s, k, j] = scale[p] * src[p, idx[s], k, j] + (k == 1 ? v_offset[p] : 0)``.

    Args:
        dst: int32 ``[pools, seqs, kv, dst_cols]``, written in place (columns ``>= max_blocks`` untouched).
        src: int32 ``[pools, rows, kv, src_cols]``, typically a pinned host table.
        idx: int32 or int64 ``[seqs]``: the row of ``src`` for each sequence.
        scale: int32 ``[pools]`` multiplier per pool (``None``: 1).
        v_offset: int32 ``[pools]`` added to the V entries (``k == 1``) per pool (``None``: 0).
        max_blocks: columns to write, ``<= min(src_cols, dst_cols)`` (``None``: ``dst_cols``).
        sentinel: the "no block" value; a ``src`` entry equal to it is written unchanged (not scaled or offset).

    Returns:
        ``dst``.

    Raises:
        TypeError: a table is not int32 or ``idx`` is not int32/int64.
        ValueError: shapes disagree, ``max_blocks`` out of range, an index out of range (checked when
            ``idx`` is on the CPU), or a tensor the CUDA kernel would read in pageable host memory.

    Notes:
        An empty gather (no sequence, pool, K/V row or column) reads nothing: on every device it is checked by
        the same rules (host tensors in any memory, pageable too) and returns ``dst`` with nothing enqueued.
        On CUDA the kernel reads ``src``, ``idx``, ``scale`` and ``v_offset`` where they are (device or
        pinned host memory) when it *executes*; keep them unchanged until then (fresh snapshot per call).
        The arithmetic is int32 and wraps on overflow.
    """
    for name, t in (("dst", dst), ("src", src)):
        if t.dtype != torch.int32:
            raise TypeError(f"gather_block_offsets: {name} must be int32, got {t.dtype}")
        if t.dim() != 4:
            raise ValueError(
                f"gather_block_offsets: {name} must be [pools, seqs/rows, kv, max_blocks], got shape {list(t.shape)}"
            )
    if idx.dtype not in _INDEX_DTYPES or idx.dim() != 1:
        raise TypeError(
            f"gather_block_offsets: idx must be a 1-D int32/int64 tensor, got {idx.dtype} of shape {list(idx.shape)}"
        )
    pools, seqs, kv, dst_cols = dst.shape
    if src.shape[0] != pools or src.shape[2] != kv:
        raise ValueError(
            f"gather_block_offsets: src {list(src.shape)} and dst {list(dst.shape)} disagree on pools or kv"
        )
    if idx.shape[0] != seqs:
        raise ValueError(f"gather_block_offsets: idx has {idx.shape[0]} entries but dst has {seqs} sequences")
    for name, opt in (("scale", scale), ("v_offset", v_offset)):
        if opt is not None and (opt.dtype != torch.int32 or tuple(opt.shape) != (pools,)):
            raise TypeError(
                f"gather_block_offsets: {name} must be int32 [{pools}], got {opt.dtype} of shape {list(opt.shape)}"
            )
    cols = dst_cols if max_blocks is None else max_blocks
    if isinstance(cols, bool) or not isinstance(cols, int) or not 0 <= cols <= min(dst_cols, src.shape[3]):
        raise ValueError(
            f"gather_block_offsets: max_blocks must be in 0..{min(dst_cols, src.shape[3])}, got {max_blocks!r}"
        )
    if not -(2**31) <= sentinel < 2**31:
        raise ValueError(f"gather_block_offsets: sentinel must fit in int32, got {sentinel}")
    if not dst.is_contiguous() or not src.is_contiguous():
        raise ValueError("gather_block_offsets: src and dst must be contiguous")
    device = dst.device
    if _check_gather_inputs(src, idx, scale, v_offset, device, empty=0 in (pools, seqs, kv, cols)):
        return dst
    if _use_reference(device):
        gather_block_offsets_ref(dst, src, idx, scale, v_offset, cols, sentinel)
    else:
        torch.ops.tiered_kv.gather_block_offsets(dst, src, idx, scale, v_offset, cols, sentinel)
    return dst


def _check_gather_inputs(
    src: torch.Tensor,
    idx: torch.Tensor,
    scale: torch.Tensor | None,
    v_offset: torch.Tensor | None,
    device: torch.device,
    *,
    empty: bool,
) -> bool:
    """Where the gather's inputs live and ``idx``'s range, one rule per device; ``True``: nothing to gather."""
    for name, opt in (("src", src), ("idx", idx), ("scale", scale), ("v_offset", v_offset)):
        if opt is not None:
            _check_host_readable(opt, device, name, reads=not empty)
    if idx.device.type == "cpu" and idx.numel():
        lo, hi = int(idx.min()), int(idx.max())
        if lo < 0 or hi >= src.shape[1]:
            raise ValueError(
                f"gather_block_offsets: idx holds {lo if lo < 0 else hi}, out of range for {src.shape[1]} source rows"
            )
    return empty


GatherFn = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None, int, int], None
]
"""``(dst, src, idx, scale, v_offset, max_blocks, sentinel)``: the positional form of :func:`gather_block_offsets`."""


def unchecked_gather(device: torch.device) -> GatherFn:
    """:func:`gather_block_offsets` for tensors on ``device``, positional and without any per-call check.

    For a caller that builds every argument itself and checked them once (:mod:`tiered_kv.staging`): the
    checks of :func:`gather_block_offsets` cost a dozen tensor calls, two reductions over ``idx`` among them,
    on every call. What it still needs, the callable does not check: ``dst`` and ``src`` contiguous int32 of
    one geometry, ``idx`` in range, a host tensor pinned on CUDA (the CUDA implementation refuses pageable
    memory), ``max_blocks`` within both tables. Resolve it once (on CUDA this builds or loads the extension,
    and falls back to the reference when there is none).
    """
    if _use_reference(device):
        return gather_block_offsets_ref
    op: GatherFn = torch.ops.tiered_kv.gather_block_offsets.default
    return op


def _side_shape(tensors: Sequence[torch.Tensor], what: str) -> tuple[int, tuple[int, ...], torch.dtype, torch.device]:
    """Check one side of :func:`copy_blocks`; return (num_blocks, logical block shape, dtype, device)."""
    if not isinstance(tensors, (list, tuple)) or not tensors:
        raise TypeError(f"copy_blocks: {what} must be a non-empty list of tensors")
    first = tensors[0]
    if first.dtype not in _COPY_DTYPES:
        raise TypeError(f"copy_blocks: {what} dtype {first.dtype} is not supported")
    if first.dim() not in (4, 5, 6):
        raise ValueError(
            f"copy_blocks: {what} tensors must be [N, L, kv, H, T, D], [N, kv, H, T, D] or [N, H, T, D], "
            f"got {list(first.shape)}"
        )
    for t in tensors:
        if t.shape != first.shape or t.dtype != first.dtype or t.device != first.device or t.stride() != first.stride():
            raise ValueError(f"copy_blocks: every {what} tensor must share shape, strides, dtype and device")
        if not t[0].is_contiguous() if t.shape[0] else False:
            raise ValueError(f"copy_blocks: each block of a {what} tensor must be contiguous (inner dimensions dense)")
    n = len(tensors)
    shape = tuple(first.shape[1:])
    if first.dim() == 6:
        if n != 1:
            raise ValueError(f"copy_blocks: a block-major {what} pool is one tensor, got {n}")
        logical = shape
    elif first.dim() == 5:  # one tensor per layer, K and V inside
        logical = (n, *shape)
    else:  # one tensor per (layer, K/V): kv is unknown here, the other side fixes it
        logical = (n, *shape)
    return first.shape[0], logical, first.dtype, first.device


def _logical_elems(logical: tuple[int, ...]) -> int:
    out = 1
    for x in logical:
        out *= x
    return out


def copy_blocks(
    dst: Sequence[torch.Tensor],
    src: Sequence[torch.Tensor],
    src_blocks: torch.Tensor,
    dst_blocks: torch.Tensor,
    *,
    num_tokens: int | None = None,
    method: int = METHOD_KERNEL,
) -> None:
    """Copy blocks ``src_blocks`` of ``src`` into blocks ``dst_blocks`` of ``dst`` (all tokens or the first N).

    Each side is a block-major pool ``[one tensor [N, L, kv, H, T, D]]``, a layer-major pool
    ``[L tensors [N, kv, H, T, D]]`` or a layer-and-K/V-major pool ``[L*kv tensors [N, H, T, D]]``.
    Both sides hold the same block geometry and dtype.

    Args:
        dst: destination pool tensors (written in place).
        src: source pool tensors.
        src_blocks: int32/int64 ``[n]`` source block indices (CPU, pinned host or on the device).
        dst_blocks: int32/int64 ``[n]`` destination block indices, no duplicates.
        num_tokens: copy tokens ``[0, num_tokens)`` of every (layer, kv, head); the rest of the destination
            block is untouched. ``None`` copies whole blocks.
        method: :data:`METHOD_KERNEL` (one launch) or :data:`METHOD_DMA` (copy-engine calls issued in C++,
            one per contiguous run); CUDA only, the CPU reference ignores it.

    Raises:
        TypeError: unsupported dtype, mixed dtypes, non-integer indices.
        ValueError: the sides disagree on geometry, an index is out of range (checked when the indices are
            on the CPU), ``num_tokens`` outside ``1..tokens``, or a tensor the kernel cannot reach
            (pageable host memory, another GPU).

    Notes:
        Host tensors must be pinned on CUDA; the kernel reads and writes them through unified addressing at
        execution time. A partial copy by ``METHOD_DMA`` is one ``cudaMemcpy2DAsync`` per (block, group), or per
        (run of consecutive blocks, group) where the rows of one block go on into the next on both sides.
    """
    ns, s_logical, s_dtype, _s_dev = _side_shape(src, "src")
    nd, d_logical, d_dtype, _d_dev = _side_shape(dst, "dst")
    if s_dtype != d_dtype:
        raise TypeError(f"copy_blocks: src dtype {s_dtype} and dst dtype {d_dtype} differ")
    if _logical_elems(s_logical) != _logical_elems(d_logical) or s_logical[-2:] != d_logical[-2:]:
        raise ValueError(
            f"copy_blocks: src blocks {list(s_logical)} and dst blocks {list(d_logical)} have different geometry"
        )
    tokens = s_logical[-2]
    n = tokens if num_tokens is None else num_tokens
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= tokens:
        raise ValueError(f"copy_blocks: num_tokens must be in 1..{tokens}, got {num_tokens!r}")
    groups = max(len(src), len(dst))
    if groups % len(src) or groups % len(dst):
        raise ValueError(
            f"copy_blocks: {len(src)} source and {len(dst)} destination tensors do not split a block evenly"
        )
    for name, b in (("src_blocks", src_blocks), ("dst_blocks", dst_blocks)):
        if not isinstance(b, torch.Tensor) or b.dtype not in _INDEX_DTYPES or b.dim() != 1:
            raise TypeError(f"copy_blocks: {name} must be a 1-D int32/int64 tensor")
    if src_blocks.shape != dst_blocks.shape:
        raise ValueError(f"copy_blocks: {src_blocks.numel()} source blocks and {dst_blocks.numel()} destination blocks")
    device = _run_device([src[0], dst[0]])
    for name, t in (("src", src[0]), ("dst", dst[0])):
        _check_host_readable(t, device, name)
    for name, b in (("src_blocks", src_blocks), ("dst_blocks", dst_blocks)):
        _check_index_device(b, device, name)  # CPU indices (pageable too) are shipped by the op itself
    for name, b, limit in (("src_blocks", src_blocks, ns), ("dst_blocks", dst_blocks, nd)):
        if b.device.type == "cpu" and b.numel():
            lo, hi = int(b.min()), int(b.max())
            if lo < 0 or hi >= limit:
                raise ValueError(
                    f"copy_blocks: {name} holds {lo if lo < 0 else hi}, out of range for a pool of {limit} blocks"
                )
    _check_method(method)
    if device.type == "cuda" and method == METHOD_DMA and src_blocks.device.type != "cpu":
        raise ValueError(
            "copy_blocks: METHOD_DMA needs the block indices on the CPU (the copy calls are issued by the host)"
        )
    _check_method(method)
    if _use_reference(device):
        copy_blocks_ref(list(dst), list(src), src_blocks, dst_blocks, n, method)
    else:
        torch.ops.tiered_kv.copy_blocks(list(dst), list(src), src_blocks, dst_blocks, n, method)


def copy_chunks(
    dst: Sequence[torch.Tensor], src: Sequence[torch.Tensor], chunks: torch.Tensor, *, method: int = METHOD_KERNEL
) -> None:
    """Copy many byte ranges in one call.

    Row ``(si, so, di, do, nbytes)`` copies ``src[si]`` bytes ``[so, so + nbytes)`` to ``dst[di]`` bytes
    ``[do, do + nbytes)``.

    Args:
        dst: destination tensors (contiguous; written in place).
        src: source tensors (contiguous).
        chunks: int64 ``[n, 5]`` table on the CPU (any alignment, any sizes; destinations must not overlap).
        method: :data:`METHOD_KERNEL` or :data:`METHOD_DMA` (one ``cudaMemcpyAsync`` per run of chunks that
            are adjacent on both sides).

    Raises:
        TypeError: the table is not an int64 ``[n, 5]`` tensor.
        ValueError: a tensor index or byte range is out of bounds, or a tensor the kernel cannot reach.
    """
    if not isinstance(chunks, torch.Tensor) or chunks.dtype != torch.int64 or chunks.dim() != 2 or chunks.shape[1] != 5:
        raise TypeError(
            "copy_chunks: chunks must be an int64 tensor [n, 5] of (src, src_offset, dst, dst_offset, nbytes)"
        )
    if chunks.device.type != "cpu":
        raise ValueError("copy_chunks: the chunk table must be on the CPU (it is validated before launch)")
    if not src or not dst:
        raise TypeError("copy_chunks: src and dst must be non-empty lists of tensors")
    for t in (*src, *dst):
        if not t.is_contiguous():
            raise ValueError("copy_chunks: every tensor must be contiguous")
    device = _run_device([*src, *dst])
    for t in (*src, *dst):
        _check_host_readable(t, device, "a copy_chunks tensor")
    if chunks.numel():
        si, so, di, do, nb = chunks.unbind(1)
        if int(nb.min()) < 0 or int(so.min()) < 0 or int(do.min()) < 0:
            raise ValueError("copy_chunks: negative offset or size in the chunk table")
        if int(si.min()) < 0 or int(si.max()) >= len(src) or int(di.min()) < 0 or int(di.max()) >= len(dst):
            raise ValueError("copy_chunks: a tensor index in the chunk table is out of range")
        src_sizes = torch.tensor([t.numel() * t.element_size() for t in src], dtype=torch.int64)
        dst_sizes = torch.tensor([t.numel() * t.element_size() for t in dst], dtype=torch.int64)
        if bool(((so + nb) > src_sizes[si]).any()) or bool(((do + nb) > dst_sizes[di]).any()):
            raise ValueError("copy_chunks: a chunk reaches past the end of its tensor")
    _check_method(method)
    if _use_reference(device):
        copy_chunks_ref(list(dst), list(src), chunks, method)
    else:
        torch.ops.tiered_kv.copy_chunks(list(dst), list(src), chunks, method)
