"""The tiered_kv ops against naive loop references, on fresh random data with the output poisoned first.

CPU runs the registered references (CI); the ``gpu`` cases run the CUDA kernels and DMA paths, with host
tensors in pinned memory.
"""

from __future__ import annotations

import pytest
import torch

from tiered_kv import _ext, ops
from tiered_kv.testing import assert_blocks_equal, fill_random

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.int8, torch.uint8]
# (where src lives, where dst lives): "cpu" = the reference; "cuda"/"pinned" = kernel cases
PLACEMENTS = [
    pytest.param(("cpu", "cpu"), id="cpu"),
    pytest.param(("cuda", "pinned"), id="d2h", marks=pytest.mark.gpu),
    pytest.param(("pinned", "cuda"), id="h2d", marks=pytest.mark.gpu),
    pytest.param(("cuda", "cuda"), id="d2d", marks=pytest.mark.gpu),
]
METHODS = [ops.METHOD_KERNEL, ops.METHOD_DMA]


def _alloc(shape: tuple[int, ...], dtype: torch.dtype, where: str) -> torch.Tensor:
    if where == "cuda":
        assert _ext.load(), f"the CUDA extension must build on a CUDA machine: {_ext.status()['error']}"
        return torch.empty(shape, dtype=dtype, device="cuda")
    return torch.empty(shape, dtype=dtype, pin_memory=where == "pinned")


def _poison(t: torch.Tensor) -> torch.Tensor:
    return fill_random(t)


# --------------------------------------------------------------------------------------------- gather


def _gather_loops(dst, src, idx, scale, v_offset, max_blocks, sentinel):
    out = dst.clone()
    pools, seqs, kv, _ = dst.shape
    for p in range(pools):
        for s in range(seqs):
            for k in range(kv):
                for j in range(max_blocks):
                    v = int(src[p, int(idx[s]), k, j])
                    if v != sentinel:
                        v = v * (int(scale[p]) if scale is not None else 1) + (
                            int(v_offset[p]) if (v_offset is not None and k == 1) else 0
                        )
                        v = (v + 2**31) % 2**32 - 2**31
                    out[p, s, k, j] = v
    return out


@pytest.mark.parametrize("placement", PLACEMENTS)
@pytest.mark.parametrize(
    ("pools", "rows", "seqs", "kv", "cols", "max_blocks"),
    [(2, 7, 5, 2, 9, 6), (1, 3, 3, 1, 4, 4), (3, 4, 0, 2, 5, 5), (2, 4, 3, 2, 5, 0)],
)
@pytest.mark.parametrize("idx_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("with_scale", [False, True])
def test_gather_block_offsets(placement, pools, rows, seqs, kv, cols, max_blocks, idx_dtype, with_scale) -> None:
    src_at, dst_at = placement
    src_at = "pinned" if dst_at == "cuda" else "cpu"
    g = torch.Generator().manual_seed(pools * 100 + seqs)
    src_cpu = torch.randint(-1, 1000, (pools, rows, kv, cols + 2), dtype=torch.int32, generator=g)
    idx_cpu = torch.randint(0, rows, (seqs,), dtype=idx_dtype, generator=g)
    scale = torch.randint(1, 5, (pools,), dtype=torch.int32, generator=g) if with_scale else None
    v_off = torch.randint(0, 100, (pools,), dtype=torch.int32, generator=g) if with_scale else None
    dst_cpu = torch.randint(-(2**31), 2**31 - 1, (pools, seqs, kv, cols), dtype=torch.int32, generator=g)  # poison
    expected = _gather_loops(dst_cpu, src_cpu, idx_cpu, scale, v_off, max_blocks, -1)

    src = _alloc(src_cpu.shape, torch.int32, src_at).copy_(src_cpu)
    idx = _alloc(idx_cpu.shape, idx_dtype, src_at).copy_(idx_cpu)
    scale_t = _alloc(scale.shape, torch.int32, src_at).copy_(scale) if scale is not None else None
    v_t = _alloc(v_off.shape, torch.int32, src_at).copy_(v_off) if v_off is not None else None
    dst = _alloc(dst_cpu.shape, torch.int32, dst_at).copy_(dst_cpu)
    out = ops.gather_block_offsets(dst, src, idx, scale=scale_t, v_offset=v_t, max_blocks=max_blocks, sentinel=-1)
    assert out is dst
    torch.testing.assert_close(dst.cpu(), expected, rtol=0, atol=0)


def test_gather_sentinel_passes_through_and_custom_sentinel() -> None:
    src = torch.tensor([[[[5, 7, 0, 7]], [[1, 2, 3, 4]]]], dtype=torch.int32).view(1, 2, 1, 4).repeat(1, 1, 2, 1)
    dst = torch.zeros(1, 2, 2, 4, dtype=torch.int32)
    ops.gather_block_offsets(
        dst,
        src,
        torch.tensor([0, 1], dtype=torch.int32),
        scale=torch.tensor([3], dtype=torch.int32),
        v_offset=torch.tensor([1], dtype=torch.int32),
        sentinel=7,
    )
    assert dst[0, 0, 0].tolist() == [15, 7, 0, 7]
    assert dst[0, 0, 1].tolist() == [16, 7, 1, 7]  # V row: offset added, sentinel untouched


def test_gather_bad_arguments_raise() -> None:
    src = torch.zeros(2, 4, 2, 8, dtype=torch.int32)
    dst = torch.zeros(2, 3, 2, 8, dtype=torch.int32)
    idx = torch.tensor([0, 1, 2], dtype=torch.int32)
    with pytest.raises(TypeError, match="int32"):
        ops.gather_block_offsets(dst, src.to(torch.int64), idx)
    with pytest.raises(TypeError, match="idx"):
        ops.gather_block_offsets(dst, src, idx.float())
    with pytest.raises(ValueError, match="sequences"):
        ops.gather_block_offsets(dst, src, idx[:2])
    with pytest.raises(ValueError, match="out of range"):
        ops.gather_block_offsets(dst, src, torch.tensor([0, 1, 4], dtype=torch.int32))
    with pytest.raises(ValueError, match="max_blocks"):
        ops.gather_block_offsets(dst, src, idx, max_blocks=9)
    with pytest.raises(ValueError, match="disagree"):
        ops.gather_block_offsets(dst, torch.zeros(1, 4, 2, 8, dtype=torch.int32), idx)
    with pytest.raises(TypeError, match="scale"):
        ops.gather_block_offsets(dst, src, idx, scale=torch.ones(3, dtype=torch.int32))
    assert not dst.any(), "nothing may be written when the arguments are rejected"


# --------------------------------------------------------------------------------------------- copy_blocks

GEOM = dict(n=6, L=3, kv=2, H=2, T=5, D=3)  # odd sizes: rows of 15 elements, unaligned for 16-byte access


def _make_side(
    kind: str, n: int, dtype: torch.dtype, where: str, pad: int = 0
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """A pool side of ``kind`` and a logical ``[n, L, kv, H, T, D]`` copy of its content (filled randomly).

    ``pad`` adds elements between blocks (a block stride larger than a block, like a strided view).
    """
    L, kv, H, T, D = (GEOM[k] for k in ("L", "kv", "H", "T", "D"))
    inner = {"block": (L, kv, H, T, D), "layer": (kv, H, T, D), "layerkv": (H, T, D)}[kind]
    count = {"block": 1, "layer": L, "layerkv": L * kv}[kind]
    per = 1
    for x in inner:
        per *= x
    tensors = []
    for _ in range(count):
        raw = _alloc((n, per + pad), dtype, where)
        _poison(raw)
        tensors.append(raw[:, :per].unflatten(1, inner))
    return tensors, _logical(kind, tensors)


def _logical(kind: str, tensors: list[torch.Tensor]) -> torch.Tensor:
    L, kv, _H, _T, _D = (GEOM[k] for k in ("L", "kv", "H", "T", "D"))
    cpu = [t.cpu() for t in tensors]
    if kind == "block":
        return cpu[0].clone()
    if kind == "layer":
        return torch.stack(cpu, dim=1)
    out: torch.Tensor = torch.stack(cpu, dim=1).unflatten(1, (L, kv))
    return out


KINDS = ["block", "layer", "layerkv"]


@pytest.mark.parametrize("placement", PLACEMENTS)
@pytest.mark.parametrize("src_kind", KINDS)
@pytest.mark.parametrize("dst_kind", KINDS)
@pytest.mark.parametrize("num_tokens", [None, 1, 3])
@pytest.mark.parametrize("method", METHODS)
def test_copy_blocks_matches_loops(placement, src_kind, dst_kind, num_tokens, method) -> None:
    _check_copy_blocks(placement, src_kind, dst_kind, num_tokens, method, torch.float16, pad=0)


@pytest.mark.parametrize("placement", PLACEMENTS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens", [None, 2])
@pytest.mark.parametrize("pad", [0, 3])
def test_copy_blocks_dtypes_and_strided_blocks(placement, dtype, num_tokens, pad) -> None:
    _check_copy_blocks(placement, "layer", "block", num_tokens, ops.METHOD_KERNEL, dtype, pad=pad)
    _check_copy_blocks(placement, "block", "layerkv", num_tokens, ops.METHOD_DMA, dtype, pad=pad)


def _check_copy_blocks(placement, src_kind, dst_kind, num_tokens, method, dtype, pad) -> None:
    src_at, dst_at = placement
    n = GEOM["n"]
    src, src_log = _make_side(src_kind, n, dtype, src_at, pad)
    dst, dst_log = _make_side(dst_kind, n + 1, dtype, dst_at, pad)
    s = torch.tensor([0, 1, 2, 5, 4], dtype=torch.int64)  # a run of three, then scattered
    d = torch.tensor([2, 3, 4, 0, 6], dtype=torch.int64)
    expected = dst_log.clone()
    t = GEOM["T"] if num_tokens is None else num_tokens
    for a, b in zip(s.tolist(), d.tolist(), strict=True):
        expected[b, :, :, :, :t] = src_log[a, :, :, :, :t]
    ops.copy_blocks(dst, src, s, d, num_tokens=num_tokens, method=method)
    if "cuda" in placement:
        torch.cuda.synchronize()
    assert_blocks_equal(_logical(dst_kind, dst), expected, f"{src_kind}->{dst_kind} n={num_tokens}")


def _pairs_of(shape: str) -> tuple[list[int], list[int]]:
    if shape == "3 runs of 40":  # runs in the kernel's small parameters (RunMeta)
        return [*range(0, 40), *range(300, 340), *range(100, 140)], [*range(200, 240), *range(0, 40), *range(380, 420)]
    if shape == "2 runs of 200":  # too many pairs for any parameters one by one: runs, not a staged copy
        return [*range(210, 410), *range(0, 200)], [*range(0, 200), *range(220, 420)]
    if shape == "40 runs of 3":  # more runs than the small parameters hold: pairs one by one
        s = [10 * i + k for i in range(40) for k in range(3)]
        return s, [x + 1 for x in reversed(s)]
    s = [(37 * i + 5) % 420 for i in range(400)]  # "scattered 400": staged indices
    return s, [(11 * i + 3) % 420 for i in range(400)]


@pytest.mark.parametrize("placement", PLACEMENTS)
@pytest.mark.parametrize("shape", ["3 runs of 40", "2 runs of 200", "40 runs of 3", "scattered 400"])
@pytest.mark.parametrize("num_tokens", [None, 3])
def test_copy_blocks_many_pairs_every_parameter_form(placement, shape, num_tokens) -> None:
    # the kernel takes block indices as runs (few runs of many pairs), one by one in its parameters, or staged in
    # device memory: each pair must land in its own block, whichever form the launcher picked
    src_at, dst_at = placement
    src, src_log = _make_side("layerkv", 420, torch.float16, src_at, 0)
    dst, dst_log = _make_side("block", 421, torch.float16, dst_at, 0)
    s_list, d_list = _pairs_of(shape)
    assert len(set(d_list)) == len(d_list)
    expected = dst_log.clone()
    t = GEOM["T"] if num_tokens is None else num_tokens
    for a, b in zip(s_list, d_list, strict=True):
        expected[b, :, :, :, :t] = src_log[a, :, :, :, :t]
    ops.copy_blocks(dst, src, torch.tensor(s_list), torch.tensor(d_list), num_tokens=num_tokens)
    if "cuda" in placement:
        torch.cuda.synchronize()
    assert_blocks_equal(_logical("block", dst), expected, f"{shape} n={num_tokens}")


def test_copy_blocks_empty_and_int32_indices() -> None:
    src, _ = _make_side("layer", 3, torch.float16, "cpu")
    dst, dst_log = _make_side("block", 3, torch.float16, "cpu")
    ops.copy_blocks(dst, src, torch.empty(0, dtype=torch.int64), torch.empty(0, dtype=torch.int64))
    assert_blocks_equal(_logical("block", dst), dst_log)
    ops.copy_blocks(dst, src, torch.tensor([2], dtype=torch.int32), torch.tensor([0], dtype=torch.int32))
    assert_blocks_equal(_logical("block", dst)[0], _logical("layer", src)[2])


def test_copy_blocks_bad_arguments_raise_before_writing() -> None:
    src, _ = _make_side("layer", 3, torch.float16, "cpu")
    dst, dst_log = _make_side("block", 3, torch.float16, "cpu")
    one = torch.tensor([0])
    with pytest.raises(TypeError, match="dtype"):
        ops.copy_blocks(dst, [t.to(torch.float32) for t in src], one, one)
    with pytest.raises(ValueError, match="geometry"):
        ops.copy_blocks(dst, src[:2], one, one)
    with pytest.raises(ValueError, match="out of range"):
        ops.copy_blocks(dst, src, torch.tensor([3]), one)
    with pytest.raises(ValueError, match="out of range"):
        ops.copy_blocks(dst, src, one, torch.tensor([-1]))
    with pytest.raises(ValueError, match="num_tokens"):
        ops.copy_blocks(dst, src, one, one, num_tokens=0)
    with pytest.raises(ValueError, match="num_tokens"):
        ops.copy_blocks(dst, src, one, one, num_tokens=GEOM["T"] + 1)
    with pytest.raises(ValueError, match="source blocks"):
        ops.copy_blocks(dst, src, torch.tensor([0, 1]), one)
    with pytest.raises(TypeError, match="int32/int64"):
        ops.copy_blocks(dst, src, one.float(), one)
    with pytest.raises(ValueError, match="method"):
        ops.copy_blocks(dst, src, one, one, method=7)
    with pytest.raises(ValueError, match="share"):
        ops.copy_blocks(dst, [src[0], src[1], src[2][:2]], one, one)
    assert_blocks_equal(_logical("block", dst), dst_log, "rejected calls must not write")


@pytest.mark.gpu
def test_copy_blocks_rejects_pageable_host_on_cuda() -> None:
    assert _ext.load(), _ext.status()["error"]
    src, _ = _make_side("layer", 3, torch.float16, "cuda")
    dst, _ = _make_side("block", 3, torch.float16, "cpu")  # pageable
    with pytest.raises(ValueError, match="pinned"):
        ops.copy_blocks(dst, src, torch.tensor([0]), torch.tensor([0]))


@pytest.mark.gpu
def test_refused_native_calls_raise_with_numbers_in_the_message() -> None:
    # a refused call whose message holds an integer crashed the process (SIGSEGV) on the GPU machine instead of
    # raising: the CUDA bindings build such messages with std::to_string (tkv_torch.h msg)
    assert _ext.load(), _ext.status()["error"]
    src, _ = _make_side("block", 4, torch.float16, "cuda")
    dst, _ = _make_side("block", 4, torch.float16, "cuda")
    before = [t.clone() for t in dst]
    op = torch.ops.tiered_kv.copy_blocks_list.default
    with pytest.raises(RuntimeError, match="src_blocks holds 9, out of range for a pool of 4 blocks"):
        op(dst, src, [9], [0], GEOM["T"], 0, 0)
    with pytest.raises(RuntimeError, match="dst_blocks holds -1"):
        op(dst, src, [0], [-1], GEOM["T"], 1, 0)
    with pytest.raises(RuntimeError, match="2 source and 1 destination blocks"):
        op(dst, src, [0, 1], [2], GEOM["T"], 0, 0)
    with pytest.raises(RuntimeError, match="got 7"):
        torch.ops.tiered_kv.dma_batch_mode(7)
    torch.cuda.synchronize()
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(dst, before, strict=True))


@pytest.mark.gpu
def test_copy_blocks_device_indices_kernel() -> None:
    assert _ext.load(), _ext.status()["error"]
    src, src_log = _make_side("layerkv", 4, torch.bfloat16, "cuda")
    dst, dst_log = _make_side("block", 4, torch.bfloat16, "pinned")
    ops.copy_blocks(
        dst, src, torch.tensor([3, 1], device="cuda"), torch.tensor([0, 2], device="cuda", dtype=torch.int32)
    )
    torch.cuda.synchronize()
    dst_log[0], dst_log[2] = src_log[3], src_log[1]
    assert_blocks_equal(_logical("block", dst), dst_log)


# --------------------------------------------------------------------------------------------- copy_chunks


@pytest.mark.parametrize("placement", PLACEMENTS)
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("sizes", [[1, 7, 16, 33, 4096 + 5], [64 * 1024, 64 * 1024, 3], [0, 0], [40_000]])
def test_copy_chunks_matches_loops(placement, method, sizes) -> None:
    src_at, dst_at = placement
    g = torch.Generator().manual_seed(len(sizes) * 7 + sum(sizes) % 97)
    total = sum(sizes) + 64
    srcs = [_poison(_alloc((total + 9,), torch.uint8, src_at)) for _ in range(2)]
    dsts = [_poison(_alloc((total + 5,), torch.uint8, dst_at)) for _ in range(2)]
    rows = []
    dst_cursor = [1, 3]  # unaligned starts
    for i, nbytes in enumerate(sizes):
        si, di = i % 2, (i + 1) % 2
        so = int(torch.randint(0, total + 9 - nbytes, (1,), generator=g))
        rows.append([si, so, di, dst_cursor[di], nbytes])
        dst_cursor[di] += nbytes + 1
    rows.append([0, 0, 0, dst_cursor[0], 2])  # two adjacent chunks on both sides: merged by DMA
    rows.append([0, 2, 0, dst_cursor[0] + 2, 5])
    table = torch.tensor(rows, dtype=torch.int64)
    expected = [t.cpu().clone() for t in dsts]
    src_cpu = [t.cpu() for t in srcs]
    for si, so, di, do, nb in rows:
        expected[di][do : do + nb] = src_cpu[si][so : so + nb]
    ops.copy_chunks(dsts, srcs, table, method=method)
    if "cuda" in placement:
        torch.cuda.synchronize()
    for got, exp in zip(dsts, expected, strict=True):
        assert_blocks_equal(got, exp, "copy_chunks")


def test_copy_chunks_mixed_dtypes_and_bad_tables() -> None:
    src = [fill_random(torch.empty(10, dtype=torch.float32))]
    dst = [torch.zeros(20, dtype=torch.float16)]
    ops.copy_chunks(dst, src, torch.tensor([[0, 4, 0, 2, 8]]))
    assert_blocks_equal(dst[0].view(torch.uint8)[2:10], src[0].view(torch.uint8)[4:12])
    with pytest.raises(ValueError, match="past the end"):
        ops.copy_chunks(dst, src, torch.tensor([[0, 38, 0, 0, 4]]))
    with pytest.raises(ValueError, match="out of range"):
        ops.copy_chunks(dst, src, torch.tensor([[1, 0, 0, 0, 4]]))
    with pytest.raises(ValueError, match="negative"):
        ops.copy_chunks(dst, src, torch.tensor([[0, -1, 0, 0, 4]]))
    with pytest.raises(TypeError, match=r"\[n, 5\]"):
        ops.copy_chunks(dst, src, torch.tensor([[0, 0, 0, 0]]))


# --------------------------------------------------------------------------------------------- opcheck


def test_opcheck_cpu() -> None:
    src, _ = _make_side("layer", 3, torch.float16, "cpu")
    dst, _ = _make_side("block", 3, torch.float16, "cpu")
    torch.library.opcheck(
        torch.ops.tiered_kv.copy_blocks.default, (dst, src, torch.tensor([0, 2]), torch.tensor([1, 0]), 3, 0)
    )
    torch.library.opcheck(
        torch.ops.tiered_kv.copy_chunks.default,
        ([torch.zeros(32, dtype=torch.uint8)], [torch.ones(16, dtype=torch.uint8)], torch.tensor([[0, 1, 0, 3, 9]]), 0),
    )
    table = torch.randint(0, 50, (2, 4, 2, 6), dtype=torch.int32)
    torch.library.opcheck(
        torch.ops.tiered_kv.gather_block_offsets.default,
        (
            torch.zeros(2, 3, 2, 6, dtype=torch.int32),
            table,
            torch.tensor([3, 0, 1], dtype=torch.int32),
            torch.tensor([2, 3], dtype=torch.int32),
            None,
            5,
            -1,
        ),
    )


@pytest.mark.gpu
def test_opcheck_cuda() -> None:
    assert _ext.load(), _ext.status()["error"]
    src, _ = _make_side("layer", 3, torch.float16, "cuda")
    dst, _ = _make_side("block", 3, torch.float16, "cuda")
    torch.library.opcheck(
        torch.ops.tiered_kv.copy_blocks.default, (dst, src, torch.tensor([0, 2]), torch.tensor([1, 0]), 3, 0)
    )
    table = torch.randint(0, 50, (2, 4, 2, 6), dtype=torch.int32, device="cuda")
    torch.library.opcheck(
        torch.ops.tiered_kv.gather_block_offsets.default,
        (
            torch.zeros(2, 3, 2, 6, dtype=torch.int32, device="cuda"),
            table,
            torch.tensor([3, 0, 1], dtype=torch.int32, device="cuda"),
            None,
            None,
            6,
            -1,
        ),
    )


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_an_empty_gather_is_checked_by_one_rule_on_every_device(device: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """An empty index array in pageable memory reads nothing: the CPU and CUDA validations both accept it and
    return before anything is enqueued (the CUDA case runs the CUDA rule on CPU tensors; no GPU is needed)."""
    src = torch.arange(2 * 4 * 2 * 8, dtype=torch.int32).view(2, 4, 2, 8)  # pageable
    idx = torch.tensor([1, 2, 3], dtype=torch.int64)[1:1]  # pageable, empty, a view into a live storage
    assert not src.is_pinned() and not idx.is_pinned()
    dev = torch.device(device)
    assert ops._check_gather_inputs(src, idx, None, None, dev, empty=True)
    assert not ops._check_gather_inputs(src, idx, None, None, torch.device("cpu"), empty=False)
    if device == "cuda":  # a gather that reads them still needs pinned host memory there
        with pytest.raises(ValueError, match="pageable"):
            ops._check_gather_inputs(src, torch.tensor([1]), None, None, dev, empty=False)
    enqueued: list[object] = []
    monkeypatch.setattr(ops, "gather_block_offsets_ref", lambda *a: enqueued.append(a))
    monkeypatch.setattr(ops, "_use_reference", lambda d: True)
    dst = torch.zeros(2, 0, 2, 8, dtype=torch.int32)
    assert ops.gather_block_offsets(dst, src, idx) is dst
    assert ops.gather_block_offsets(torch.zeros(2, 1, 2, 8, dtype=torch.int32), src, idx[:0].new_tensor([1]),
                                    max_blocks=0).sum() == 0
    assert not enqueued
    with pytest.raises(ValueError, match="out of range"):  # range is checked for an empty gather too
        ops.gather_block_offsets(torch.zeros(2, 1, 2, 8, dtype=torch.int32), src, torch.tensor([9]), max_blocks=0)
