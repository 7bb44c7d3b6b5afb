"""GPU pool kinds: the per-layer KV layouts inference engines keep, as chunked pools.

A block of such a pool is a fixed list of *chunks* ``(buffer, byte offset of block 0, block stride, bytes)``
scattered over one or more storage buffers (views that share one buffer, as vLLM >= 0.29 keeps its layers,
are one buffer); block ``b``'s chunk ``c`` starts at ``offset[c] + b * stride[c]``. The host and file tiers
keep a block contiguous: its chunks back to back, in chunk order. Every copy between a chunked pool and
another pool is one ``tiered_kv::copy_chunk_blocks`` call over the pair's fixed chunk table and the call's
block indices (one kernel launch, or batched DMA issued in C++; the CPU reference on the emulated device),
never a Python loop per chunk.

Primitives:

* :class:`ChunkedPool` -- the pool (a :class:`~tiered_kv.LayerMajorPool`: the engine, the file tier's staging
  and ``engine.block`` treat it like one), with :attr:`ChunkedPool.signature` naming its byte order.
* constructors, one per kind: :func:`flash_attn` ``L x (2, N, T, H, D)``, :func:`flashinfer`
  ``L x (N, 2, T, H, D)``, :func:`split_kv` ``2L x (N, T, H, D)``, :func:`vllm_views` ``L x [N, H, T, K||V]``
  any strides, :func:`sglang_token_major` ``L x (tokens, H, D)`` K and V with a page size, :func:`mla`
  ``L x (N, T, D)``, :func:`pages` opaque ``(N, page_bytes)`` views (vLLM's canonical views);
  :func:`from_views` for any list of per-block views.
* :func:`as_gpu_pool` -- what ``TransferEngine(gpu_pool=[...])`` does with a list of tensors: the classic
  layer-major shapes, else the one kind whose shapes match.
* :func:`block_table` -- the per-chunk table of a pair of pools (what the engine's copies take, with the
  block indices of a call); :func:`chunk_table` -- the ``(src, src offset, dst, dst offset, bytes)`` table of
  one copy (``tiered_kv::copy_chunks``).

Host bytes are in the pool's physical order (a chunk is a dense run of memory, whatever the logical order of
its dimensions), so a block written by one kind reads back bit-exact into a pool of the same
:attr:`~ChunkedPool.signature`; integrations salt their content keys with it. Partial copies
(``num_tokens``) are not supported for chunked pools (``ValueError``).

Size: a little over 500 lines: the engine layout kinds are short classes over one chunk-table scheme.
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Sequence

import numpy as np
import torch

from .layer_major import LayerMajorPool
from .layout import KVLayout
from .pools import BlockPool, Tier

__all__ = [
    "KINDS",
    "ChunkedPool",
    "as_gpu_pool",
    "block_table",
    "chunk_table",
    "flash_attn",
    "flashinfer",
    "from_views",
    "mla",
    "pages",
    "sglang_token_major",
    "split_kv",
    "vllm_views",
]

#: The pool kinds :func:`as_gpu_pool` recognises (besides the classic layer-major shapes).
KINDS = ("flash_attn", "flashinfer", "split_kv", "vllm", "sglang", "mla", "pages")


def _storage_key(t: torch.Tensor) -> tuple[str, int]:
    return (str(t.device), t.untyped_storage().data_ptr())


def _dense_runs(view: torch.Tensor) -> tuple[int, list[int]]:
    """``(run elements, run starts in elements from the block's first element)`` of block 0 of ``view``.

    The block ``view[0]`` is cut into runs that are contiguous in memory, ordered by address (dimensions
    sorted by stride), so a block in "head-major" or "token-major" physical order gives whole dense runs.

    Raises:
        ValueError: the innermost dimension is not contiguous, or the block overlaps itself.
    """
    dims = [(st, sz) for sz, st in zip(view.shape[1:], view.stride()[1:], strict=True) if sz != 1]
    dims.sort(key=lambda x: x[0], reverse=True)
    if not dims:
        return 1, [0]
    if dims[-1][0] != 1:
        raise ValueError("a chunked pool needs each block's innermost dimension to be contiguous (stride 1)")
    for (outer_st, _), (inner_st, inner_sz) in itertools.pairwise(dims):
        if outer_st < inner_st * inner_sz:
            raise ValueError("a block of a chunked pool must not overlap itself (strides interleave)")
    run = 1
    while dims and dims[-1][0] == run:  # merge contiguous dimensions from the innermost
        run *= dims.pop()[1]
    starts = np.zeros(1, dtype=np.int64)
    for st, sz in reversed(dims):  # outer dimensions enumerate the runs, in address order
        starts = (np.arange(sz, dtype=np.int64)[:, None] * st + starts[None, :]).reshape(-1)
    return run, starts.tolist()


class ChunkedPool(LayerMajorPool):
    """A GPU pool whose blocks are lists of byte chunks over one or more storage buffers.

    Use a constructor of this module (or :func:`from_views`). The pool keeps the caller's tensors alive and
    copies in place: nothing is reallocated.

    Args:
        layout: block geometry; ``layout.bytes_per_block`` must equal the bytes of one block's chunks.
        tensors: the caller's tensors (kept; :meth:`layer` returns them).
        buffers: 1-D uint8 tensors, each a whole storage the chunks point into.
        chunk_buffer / chunk_offset / chunk_stride / chunk_bytes: ``int64 [chunks]`` each, per chunk: its
            buffer, byte offset in block 0, bytes between consecutive blocks, and size.
        num_blocks: blocks in the pool.
        kind: the constructor's name (part of :attr:`signature`).
        tier: the tier the pool serves (``Tier.GPU``).

    Raises:
        ValueError: chunks that do not add up to a block, or that reach past their buffer.
    """

    def __init__(
        self,
        layout: KVLayout,
        tensors: Sequence[torch.Tensor],
        buffers: Sequence[torch.Tensor],
        chunk_buffer: np.ndarray,
        chunk_offset: np.ndarray,
        chunk_stride: np.ndarray,
        chunk_bytes: np.ndarray,
        num_blocks: int,
        kind: str,
        tier: Tier = Tier.GPU,
    ) -> None:
        total = int(chunk_bytes.sum())
        if total != layout.bytes_per_block:
            raise ValueError(
                f"a {kind} block holds {total} bytes but the layout's block is {layout.bytes_per_block} bytes"
                f" (layout {layout.block_shape} of {layout.dtype})"
            )
        if num_blocks > 0:
            ends = chunk_offset + (num_blocks - 1) * chunk_stride + chunk_bytes
            sizes = np.array([b.numel() for b in buffers], dtype=np.int64)
            if bool((chunk_offset < 0).any()) or bool((ends > sizes[chunk_buffer]).any()):
                raise ValueError(f"a {kind} pool chunk reaches outside its storage")
        self.tier = tier
        self.name = tier.value
        self.layout = layout
        self.tensors = list(tensors)
        self.split_kv = False
        self.num_blocks = int(num_blocks)
        self.kind = kind
        self.buffers = list(buffers)
        self.chunk_buffer = chunk_buffer.astype(np.int64)
        self.chunk_offset = chunk_offset.astype(np.int64)
        self.chunk_stride = chunk_stride.astype(np.int64)
        self.chunk_bytes = chunk_bytes.astype(np.int64)
        self.host_offset = np.concatenate(([0], np.cumsum(self.chunk_bytes)[:-1])).astype(np.int64)

    @property
    def device(self) -> torch.device:
        """The device of the pool's buffers."""
        return self.buffers[0].device

    @property
    def num_chunks(self) -> int:
        """Chunks per block."""
        return int(self.chunk_bytes.size)

    @property
    def min_chunk_bytes(self) -> int:
        """The smallest chunk: the piece size the copy path is chosen by."""
        return int(self.chunk_bytes.min())

    @property
    def signature(self) -> str:
        """A stable digest of the kind and each chunk's size and position within a block's storage pattern.

        Two pools with the same signature store a block's bytes in the same order on the host and file tiers.
        """
        text = f"{self.kind}|{self.layout.fingerprint}|" + ",".join(map(str, self.chunk_bytes.tolist()))
        return hashlib.blake2b(text.encode(), digest_size=8).hexdigest()

    def block(self, index: int) -> torch.Tensor:
        """A *copy* of one block's bytes in host order, viewed as ``layout.block_shape`` of the layout dtype."""
        if isinstance(index, bool) or not isinstance(index, (int, np.integer)):
            raise TypeError(f"block index must be an int, got {type(index).__name__}")
        if not 0 <= index < self.num_blocks:
            raise ValueError(
                f"block index {index} is out of range for the {self.name} pool of {self.num_blocks} blocks"
            )
        out = torch.empty(self.layout.bytes_per_block, dtype=torch.uint8, device=self.device)
        table = chunk_table(self, np.array([index]), _Flat(out), np.array([0]))
        from . import ops  # lazy: ops registers torch operators

        ops.copy_chunks([out], self.buffers, torch.from_numpy(table))
        return out.view(self.layout.dtype).view(self.layout.block_shape)

    def __repr__(self) -> str:
        return (
            f"<ChunkedPool {self.kind} {self.name} blocks={self.num_blocks} chunks/block={self.num_chunks}"
            f" buffers={len(self.buffers)} device={self.device}>"
        )


class _Flat:
    """A contiguous destination of whole blocks (a bare tensor, for :meth:`ChunkedPool.block`)."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


def _side(pool: object) -> tuple[list[torch.Tensor], int]:
    """(tensors, block bytes) of a contiguous block-major side."""
    if isinstance(pool, BlockPool):
        return [pool.tensor], pool.layout.bytes_per_block
    if isinstance(pool, _Flat):
        return [pool.tensor], pool.tensor.numel() * pool.tensor.element_size()
    raise TypeError(
        f"a chunked pool copies to or from a block-major pool or another chunked pool, not {type(pool).__name__}"
    )


def chunk_table(src: object, s: np.ndarray, dst: object, d: np.ndarray) -> np.ndarray:
    """The ``int64 [n * chunks, 5]`` table ``(src tensor, src offset, dst tensor, dst offset, bytes)`` of a copy.

    At least one side is a :class:`ChunkedPool`; the other is a chunked pool with the same chunk sizes, or
    a contiguous block-major pool (block ``i`` at ``i * bytes_per_block``, chunks back to back).
    """
    s = s.astype(np.int64, copy=False)
    d = d.astype(np.int64, copy=False)
    ref = src if isinstance(src, ChunkedPool) else dst
    assert isinstance(ref, ChunkedPool)
    n, c = s.size, ref.num_chunks
    out = np.empty((n, c, 5), dtype=np.int64)
    for col, pool, idx in ((0, src, s), (2, dst, d)):
        if isinstance(pool, ChunkedPool):
            out[:, :, col] = pool.chunk_buffer[None, :]
            out[:, :, col + 1] = pool.chunk_offset[None, :] + idx[:, None] * pool.chunk_stride[None, :]
        else:
            _tensors, block_bytes = _side(pool)
            out[:, :, col] = 0
            out[:, :, col + 1] = idx[:, None] * block_bytes + ref.host_offset[None, :]
    out[:, :, 4] = ref.chunk_bytes[None, :]
    return out.reshape(n * c, 5)


def block_table(src: object, dst: object) -> np.ndarray:
    """The ``int64 [chunks, 7]`` per-chunk table of copies between two pools, fixed for the pair.

    Row ``(src tensor, src offset, src block stride, dst tensor, dst offset, dst block stride, bytes)``: chunk
    ``c`` of block ``b`` is at ``offset + b * stride`` of its tensor on each side (``tiered_kv::copy_chunk_blocks``
    takes it with the block indices of a call). Chunks that continue each other on both sides (same tensors and
    strides, each starting where the last ends) are merged into one row: a block whose chunks are one dense run
    on both sides (vLLM's cross-layer buffer, canonical pages) is one row, and its piece size is the whole block.
    """
    ref = src if isinstance(src, ChunkedPool) else dst
    assert isinstance(ref, ChunkedPool)
    c = ref.num_chunks
    out = np.empty((c, 7), dtype=np.int64)
    for col, pool in ((0, src), (3, dst)):
        if isinstance(pool, ChunkedPool):
            out[:, col] = pool.chunk_buffer
            out[:, col + 1] = pool.chunk_offset
            out[:, col + 2] = pool.chunk_stride
        else:
            _tensors, block_bytes = _side(pool)
            out[:, col] = 0
            out[:, col + 1] = ref.host_offset
            out[:, col + 2] = block_bytes
    out[:, 6] = ref.chunk_bytes
    rows: list[list[int]] = []
    for r in out.tolist():
        last = rows[-1] if rows else None
        if (
            last is not None
            and r[0] == last[0]
            and r[3] == last[3]
            and r[2] == last[2]
            and r[5] == last[5]
            and r[1] == last[1] + last[6]
            and r[4] == last[4] + last[6]
        ):
            last[6] += r[6]
        else:
            rows.append(r)
    return np.array(rows, dtype=np.int64).reshape(-1, 7)


def chunk_tensors(pool: object) -> list[torch.Tensor]:
    """The tensor list the table's tensor indices refer to, for one side of a copy."""
    if isinstance(pool, ChunkedPool):
        return pool.buffers
    return _side(pool)[0]


# ------------------------------------------------------------------------------------------ constructors


def from_views(
    layout: KVLayout,
    views: Sequence[torch.Tensor],
    *,
    kind: str = "views",
    tensors: Sequence[torch.Tensor] | None = None,
) -> ChunkedPool:
    """A chunked pool from per-block views: ``views[i][b]`` is block ``b``'s part ``i`` (any shape, any strides).

    Each view's first dimension indexes blocks; all views have the same number of blocks and the layout's
    dtype (or int8/uint8 for opaque pages). A block is the views' parts in order, each cut into its dense
    memory runs.

    Raises:
        ValueError: no views, block counts differ, devices differ, a part with a non-contiguous innermost
            dimension, or the parts do not add up to ``layout.bytes_per_block``.
        TypeError: a view is not a tensor.
    """
    views = list(views)
    if not views:
        raise ValueError(f"a {kind} pool needs at least one tensor")
    for v in views:
        if not isinstance(v, torch.Tensor):
            raise TypeError(f"a {kind} pool is made of tensors, got {type(v).__name__}")
        if v.dim() < 1:
            raise ValueError(f"a {kind} pool tensor needs a block dimension, got a scalar")
    num_blocks = views[0].shape[0]
    device = views[0].device
    buffers: list[torch.Tensor] = []
    where: dict[tuple[str, int], int] = {}
    cb: list[int] = []
    co: list[int] = []
    cs: list[int] = []
    cn: list[int] = []
    for v in views:
        if v.shape[0] != num_blocks:
            raise ValueError(
                f"every {kind} tensor must hold the same number of blocks ({num_blocks}), got {v.shape[0]}"
            )
        if v.device != device:
            raise ValueError(f"every {kind} tensor must be on one device ({device}), got {v.device}")
        key = _storage_key(v)
        if key not in where:
            where[key] = len(buffers)
            buffers.append(torch.empty(0, dtype=torch.uint8, device=device).set_(v.untyped_storage()))
        e = v.element_size()
        run, starts = _dense_runs(v)
        base = int(v.storage_offset()) * e
        for st in starts:
            cb.append(where[key])
            co.append(base + st * e)
            cs.append(v.stride(0) * e)
            cn.append(run * e)
    return ChunkedPool(
        layout,
        views if tensors is None else tensors,
        buffers,
        np.array(cb, dtype=np.int64),
        np.array(co, dtype=np.int64),
        np.array(cs, dtype=np.int64),
        np.array(cn, dtype=np.int64),
        num_blocks,
        kind,
    )


def _check(
    layout: KVLayout,
    tensors: Sequence[torch.Tensor],
    count: int,
    shape: tuple[int, ...],
    kind: str,
    pattern: str,
    block_dim: int = 0,
) -> int:
    """Check ``count`` tensors of ``shape`` (``-1`` = the block count) and the layout dtype; return the block count."""
    tensors = list(tensors)
    if len(tensors) != count:
        raise ValueError(f"a {kind} pool needs {count} tensors {pattern}, got {len(tensors)}")
    blocks = -1
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"a {kind} pool is made of tensors, got {type(t).__name__}")
        if t.dtype != layout.dtype:
            raise TypeError(f"{kind} tensor dtype {t.dtype} does not match the layout dtype {layout.dtype}")
        got = tuple(t.shape)
        n = got[block_dim] if len(got) == len(shape) else -2
        want = tuple(n if x == -1 else x for x in shape)
        if got != want or (blocks >= 0 and n != blocks):
            raise ValueError(f"{kind} tensors must be {pattern} = {list(shape)} (-1: blocks), got {list(got)}")
        blocks = n
    return blocks


def flash_attn(layout: KVLayout, tensors: Sequence[torch.Tensor]) -> ChunkedPool:
    """FlashAttention's per-layer ``(2, N, T, H, D)`` (K and V outermost): 2 chunks per layer and block."""
    L, kv, H, T, D = layout.block_shape
    if kv != 2:
        raise ValueError("the flash_attn kind holds K and V; use mla() for a kv_factor=1 layout")
    _check(layout, tensors, L, (2, -1, T, H, D), "flash_attn", "[2, N, T, H, D]", block_dim=1)
    return from_views(layout, [t[i] for t in tensors for i in range(2)], kind="flash_attn", tensors=tensors)


def flashinfer(layout: KVLayout, tensors: Sequence[torch.Tensor]) -> ChunkedPool:
    """FlashInfer's per-layer ``(N, 2, T, H, D)``: 1 chunk per layer and block."""
    L, kv, H, T, D = layout.block_shape
    if kv != 2:
        raise ValueError("the flashinfer kind holds K and V; use mla() for a kv_factor=1 layout")
    _check(layout, tensors, L, (-1, 2, T, H, D), "flashinfer", "[N, 2, T, H, D]")
    return from_views(layout, tensors, kind="flashinfer")


def split_kv(layout: KVLayout, tensors: Sequence[torch.Tensor]) -> ChunkedPool:
    """Separate K and V tensors ``(N, T, H, D)``, ordered (layer 0 K, layer 0 V, layer 1 K, ...)."""
    L, kv, H, T, D = layout.block_shape
    if kv != 2:
        raise ValueError("the split_kv kind holds K and V; use mla() for a kv_factor=1 layout")
    _check(layout, tensors, 2 * L, (-1, T, H, D), "split_kv", "[N, T, H, D]")
    return from_views(layout, tensors, kind="split_kv")


def vllm_views(layout: KVLayout, tensors: Sequence[torch.Tensor]) -> ChunkedPool:
    """VLLM >= 0.29 per-layer logical ``[N, H, T, C]`` views (C = K||V = 2D, or D for MLA), any strides.

    Layers may share one storage buffer (one group's layers do); each block's part of a layer must be dense
    in memory in some dimension order (every ``KVCacheLayout`` vLLM defines is).
    """
    L, kv, H, T, D = layout.block_shape
    _check(layout, tensors, L, (-1, H, T, kv * D), "vllm", "[N, H, T, K||V]")
    return from_views(layout, tensors, kind="vllm")


def sglang_token_major(
    layout: KVLayout, k_buffers: Sequence[torch.Tensor], v_buffers: Sequence[torch.Tensor] | None = None
) -> ChunkedPool:
    """SGLang's token-major ``(tokens, H, D)`` per-layer K and V buffers as a pool.

    A page (block) is ``tokens_per_block`` consecutive tokens, page ``b`` = tokens ``[b * T, (b + 1) * T)``.
    MLA (``kv_factor=1``): ``k_buffers`` are the ``(tokens, 1, D)`` latent buffers and ``v_buffers`` is ``None``.
    Tokens past the last whole page (SGLang's padding) are not part of any block.
    """
    L, kv, H, T, D = layout.block_shape
    if (kv == 1) != (v_buffers is None):
        raise ValueError(
            "sglang_token_major takes K and V buffers for kv_factor=2, only the latent buffers for kv_factor=1"
        )
    bufs = (
        list(k_buffers) if v_buffers is None else [b for pair in zip(k_buffers, v_buffers, strict=True) for b in pair]
    )
    if len(list(k_buffers)) != L:
        raise ValueError(f"an sglang pool needs {L} per-layer buffers, got {len(list(k_buffers))}")
    _check(layout, bufs, L * kv, (-1, H, D), "sglang", "[tokens, H, D]")
    views = []
    for b in bufs:
        if b.shape[0] < T or b.stride(0) != H * D or b.stride(1) != D or b.stride(2) != 1:
            raise ValueError(f"sglang buffers must be contiguous [tokens >= {T}, {H}, {D}], got {list(b.shape)}")
        pages_ = b.shape[0] // T
        views.append(b[: pages_ * T].view(pages_, T, H, D))
    return from_views(layout, views, kind="sglang", tensors=bufs)


def mla(layout: KVLayout, tensors: Sequence[torch.Tensor]) -> ChunkedPool:
    """MLA latents ``(N, T, D)`` per layer (``kv_factor=1``, one head): 1 chunk per layer and block."""
    L, kv, H, T, D = layout.block_shape
    if kv != 1 or H != 1:
        raise ValueError("the mla kind needs a layout with kv_factor=1 and num_kv_heads=1")
    _check(layout, tensors, L, (-1, T, D), "mla", "[N, T, D]")
    return from_views(layout, tensors, kind="mla")


def pages_layout(page_bytes: Sequence[int]) -> KVLayout:
    """The opaque byte layout of a block made of pages of these sizes.

    ``uint8``; one "layer" per page when they are equal, else one of the total.
    """
    sizes = [int(x) for x in page_bytes]
    if not sizes or min(sizes) < 1:
        raise ValueError(f"page sizes must be positive, got {sizes}")
    if len(set(sizes)) == 1:
        return KVLayout(
            num_layers=len(sizes), num_kv_heads=1, head_dim=sizes[0], tokens_per_block=1, dtype=torch.uint8, kv_factor=1
        )
    return KVLayout(
        num_layers=1, num_kv_heads=1, head_dim=sum(sizes), tokens_per_block=1, dtype=torch.uint8, kv_factor=1
    )


def pages(tensors: Sequence[torch.Tensor], layout: KVLayout | None = None) -> ChunkedPool:
    """Opaque ``(N, page_bytes)`` int8/uint8 views (vLLM's ``CanonicalKVCaches.tensors``), any row stride.

    ``layout`` defaults to :func:`pages_layout` of the page sizes (a block = the pages back to back).
    """
    tensors = list(tensors)
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"a pages pool is made of tensors, got {type(t).__name__}")
        if t.dim() != 2 or t.dtype not in (torch.int8, torch.uint8) or (t.shape[0] and t.stride(1) != 1):
            raise ValueError(
                f"pages must be int8/uint8 (num_blocks, page_bytes) views with dense rows, "
                f"got {t.dtype} {list(t.shape)}"
            )
    if not tensors:
        raise ValueError("a pages pool needs at least one tensor")
    lay = pages_layout([t.shape[1] for t in tensors]) if layout is None else layout
    return from_views(lay, tensors, kind="pages")


_CONSTRUCTORS = {
    "flash_attn": flash_attn,
    "flashinfer": flashinfer,
    "split_kv": split_kv,
    "vllm": vllm_views,
    "mla": mla,
}


def as_gpu_pool(layout: KVLayout, tensors: Sequence[torch.Tensor], kind: str = "auto") -> LayerMajorPool:
    """A GPU pool over per-layer tensors as an engine keeps them.

    ``kind="auto"``: the classic layer-major shapes (``[N, kv, H, T, D]`` per layer, ``[N, H, T, D]`` per layer
    and K/V) give a :class:`~tiered_kv.LayerMajorPool`; otherwise the one kind of :data:`KINDS` whose shapes
    match (``ValueError`` naming the candidates if none or several do). SGLang's token-major buffers and opaque
    pages are never guessed: use :func:`sglang_token_major` / :func:`pages`.

    Raises:
        ValueError: an unknown kind, or shapes that fit no kind (or several).
        TypeError: a dtype that does not match the layout.
    """
    tensors = list(tensors)
    if kind != "auto":
        if kind not in _CONSTRUCTORS:
            raise ValueError(f"unknown GPU pool kind {kind!r}; use one of {', '.join(sorted(_CONSTRUCTORS))} or 'auto'")
        return _CONSTRUCTORS[kind](layout, tensors)
    try:
        return LayerMajorPool(layout, tensors)
    except ValueError as exc:
        classic = str(exc)
    fits: list[ChunkedPool] = []
    errors: list[str] = []
    for name, make in _CONSTRUCTORS.items():
        try:
            fits.append(make(layout, tensors))
        except (ValueError, TypeError) as exc:
            errors.append(f"{name}: {exc}")
    if len(fits) == 1:
        return fits[0]
    if not fits:
        raise ValueError(f"gpu_pool tensors fit no known layout ({classic}; " + "; ".join(errors) + ")")
    raise ValueError(f"gpu_pool tensors fit several layouts ({', '.join(p.kind for p in fits)}); pass one explicitly")


def piece_bytes(src: object, dst: object) -> int:
    """The contiguous piece size of a copy involving a chunked pool (its smallest chunk)."""
    sizes = [p.min_chunk_bytes for p in (src, dst) if isinstance(p, ChunkedPool)]
    return min(sizes) if sizes else 0


def check_compatible(src: object, dst: object) -> None:
    """Raise ``ValueError`` unless a copy between these pools is one chunk table (same chunk sizes)."""
    if isinstance(src, ChunkedPool) and isinstance(dst, ChunkedPool):
        if not np.array_equal(src.chunk_bytes, dst.chunk_bytes):
            raise ValueError(f"chunked pools {src.kind} and {dst.kind} cut a block into different chunks")
    for p in (src, dst):
        if isinstance(p, LayerMajorPool) and not isinstance(p, ChunkedPool):
            raise ValueError("a chunked pool copies to or from a block-major pool or another chunked pool")
