"""The CUDA kernels' own code, run on the CPU lane by lane (tests/kernel_emulation.cpp), against the references.

This checks the kernels' index decoding, piece splitting, grid-stride loops and alignment paths in CI;
the ``gpu`` tests in test_ops.py run the same cases on the device.
"""

from __future__ import annotations

import ctypes
import math
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from test_ops import GEOM, KINDS, _logical, _make_side

from tiered_kv import _ext, ops
from tiered_kv.testing import assert_blocks_equal, fill_random

HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def emu(tmp_path_factory: pytest.TempPathFactory) -> ctypes.CDLL:
    root = _ext.find_cuda_home()
    cxx = shutil.which("g++") or shutil.which("c++")
    if root is None or cxx is None:
        pytest.skip("needs a C++ compiler and the CUDA headers")
    out = tmp_path_factory.mktemp("emu") / "libtkv_emu.so"
    cmd = [
        cxx,
        "-std=c++17",
        "-O1",
        "-shared",
        "-fPIC",
        f"-I{root}/include",
        str(HERE / "kernel_emulation.cpp"),
        "-o",
        str(out),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return ctypes.CDLL(str(out))


def _i64(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


def _ptr(t: torch.Tensor) -> ctypes.c_void_p:
    return ctypes.c_void_p(t.data_ptr())


def _geometry(dst: list[torch.Tensor], src: list[torch.Tensor], n: int, pairs: int) -> list[int]:
    """What kernels/copy_blocks.cpp computes (BlockCopyGeometry field order)."""
    s0, d0 = src[0], dst[0]
    isz = s0.element_size()
    tokens, head_dim = s0.shape[-2], s0.shape[-1]
    total = isz * math.prod(s0.shape[1:]) * len(src)
    groups = max(len(src), len(dst))
    group_bytes = total // groups
    if n == tokens:
        rows, pitch, width = 1, group_bytes, group_bytes
    else:
        pitch = tokens * head_dim * isz
        rows, width = group_bytes // pitch, n * head_dim * isz
    return [pairs, groups, rows, pitch, width, group_bytes, len(src), len(dst), s0.stride(0) * isz, d0.stride(0) * isz]


def _emu_copy_blocks(
    emu, dst, src, s, d, n, max_grid=0, index64=False, force_unaligned=False, use_inline=False
) -> None:
    geom = _i64(_geometry(dst, src, n, len(s)))
    if use_inline and use_inline != 3:  # runs (3): the caller checks with _runs_fit
        slots = emu.emu_inline_slots_large() if use_inline == 2 else emu.emu_inline_slots()
        assert len(src) + len(dst) + 2 * len(s) <= slots, "the case does not fit the kernel's parameters"
    bases = _i64([t.data_ptr() for t in src] + [t.data_ptr() for t in dst])
    s_t, d_t = _i64(s), _i64(d)  # named: a temporary would be freed before the call reads it
    emu.emu_copy_blocks(
        _ptr(geom),
        _ptr(bases),
        _ptr(s_t),
        _ptr(d_t),
        ctypes.c_int(max_grid),
        ctypes.c_int(index64),
        ctypes.c_int(force_unaligned),
        ctypes.c_int(use_inline),
    )


@pytest.mark.parametrize("src_kind", KINDS)
@pytest.mark.parametrize("dst_kind", KINDS)
@pytest.mark.parametrize("num_tokens", [None, 1, 3])
@pytest.mark.parametrize("pad", [0, 3])
@pytest.mark.parametrize("index64", [False, True])
@pytest.mark.parametrize("use_inline", [False, True])
def test_copy_blocks_kernel_matches_reference(emu, src_kind, dst_kind, num_tokens, pad, index64, use_inline) -> None:
    src, _ = _make_side(src_kind, GEOM["n"], torch.float16, "cpu", pad)
    dst, _ = _make_side(dst_kind, GEOM["n"] + 1, torch.float16, "cpu", pad)
    want = [t.clone() for t in dst]
    s, d = [0, 1, 2, 5, 4], [2, 3, 4, 0, 6]
    n = GEOM["T"] if num_tokens is None else num_tokens
    ops.copy_blocks(want, src, _i64(s), _i64(d), num_tokens=num_tokens)
    # two CTAs: every warp loops over many items; use_inline: bases and indices in the kernel's parameters
    _emu_copy_blocks(emu, dst, src, s, d, n, max_grid=2, index64=index64, use_inline=use_inline)
    assert_blocks_equal(
        _logical(dst_kind, dst), _logical(dst_kind, want), f"{src_kind}->{dst_kind} n={num_tokens} pad={pad}"
    )


@pytest.mark.parametrize("num_tokens", [None, 2])
def test_copy_blocks_kernel_inline_parameters_many_pairs(emu, num_tokens) -> None:
    # 40 pairs from a layer-and-K/V pool (6 tensors) into a block-major one: 7 bases + 80 indices, near the
    # 96 slots of the kernel's inline parameters; each pair must read its own slots
    src, _ = _make_side("layerkv", 48, torch.float16, "cpu")
    dst, _ = _make_side("block", 50, torch.float16, "cpu")
    want = [t.clone() for t in dst]
    s = list(range(47, 7, -1))
    d = [(7 * i + 3) % 50 for i in range(40)]
    n = GEOM["T"] if num_tokens is None else num_tokens
    ops.copy_blocks(want, src, _i64(s), _i64(d), num_tokens=num_tokens)
    _emu_copy_blocks(emu, dst, src, s, d, n, max_grid=3, use_inline=True)
    assert_blocks_equal(_logical("block", dst), _logical("block", want), f"inline n={num_tokens}")


@pytest.mark.parametrize("num_tokens", [None, 3])
@pytest.mark.parametrize("index64", [False, True])
def test_copy_blocks_kernel_large_inline_parameters_every_small_call(emu, num_tokens, index64) -> None:
    # the engine's largest small call: 256 pairs, from a layer-and-K/V pool (6 tensors) into a block-major one,
    # bases and indices all in the kernel's parameters (CUDA 12.1+: 5 KiB); each pair must read its own slots
    if emu.emu_inline_slots_large() == 0:
        pytest.skip("this CUDA runtime limits kernel parameters to 4 KiB")
    assert emu.emu_inline_slots_large() >= 2 * 256 + 7
    src, _ = _make_side("layerkv", 300, torch.float16, "cpu")
    dst, _ = _make_side("block", 260, torch.float16, "cpu")
    want = [t.clone() for t in dst]
    s = list(range(299, 43, -1))
    d = [(7 * i + 3) % 260 for i in range(256)]
    assert len(set(d)) == 256
    n = GEOM["T"] if num_tokens is None else num_tokens
    ops.copy_blocks(want, src, _i64(s), _i64(d), num_tokens=num_tokens)
    _emu_copy_blocks(emu, dst, src, s, d, n, max_grid=5, index64=index64, use_inline=2)
    assert_blocks_equal(_logical("block", dst), _logical("block", want), f"large inline n={num_tokens}")


def _runs_fit(emu, s, d, bases_count: int) -> bool:
    s_t, d_t = _i64(s), _i64(d)
    return bool(emu.emu_runs_fit(_ptr(s_t), _ptr(d_t), ctypes.c_int64(len(s)), ctypes.c_int64(bases_count)))


def _runs(rng, lengths: list[int], src_blocks: int, dst_blocks: int) -> tuple[list[int], list[int]]:
    """Pairs in runs of the given lengths, consecutive on both sides within a run; the runs laid out in one random
    order on the source side and another on the destination side, gaps between them (no block twice)."""

    def starts(order: list[int], blocks: int) -> dict[int, int]:
        gaps = sorted(int(x) for x in rng.choice(blocks - sum(lengths), len(order), replace=False))
        at, out = 0, {}
        for gap, i in zip(gaps, order, strict=True):
            out[i] = gap + at
            at += lengths[i]
        return out

    s_at = starts([int(i) for i in rng.permutation(len(lengths))], src_blocks)
    d_at = starts([int(i) for i in rng.permutation(len(lengths))], dst_blocks)
    s: list[int] = []
    d: list[int] = []
    for i in (int(i) for i in rng.permutation(len(lengths))):  # the pairs in a third order
        s += range(s_at[i], s_at[i] + lengths[i])
        d += range(d_at[i], d_at[i] + lengths[i])
    return s, d


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("index64", [False, True])
def test_copy_blocks_kernel_run_parameters_every_pair_finds_its_run(emu, seed, index64) -> None:
    # many pairs in a few runs consecutive on both sides (an in-order load): bases and runs in the small parameters
    # (RunMeta); each pair must find its own run by the binary search, first and last pair of each run included
    rng = np.random.default_rng(seed)
    lengths = [int(x) for x in rng.integers(2, 40, int(rng.integers(1, 20)))]
    src, _ = _make_side("layerkv", 900, torch.float16, "cpu")
    dst, _ = _make_side("block", 900, torch.float16, "cpu")
    s, d = _runs(rng, lengths, 900, 900)
    assert len(set(d)) == len(d) and len(set(s)) == len(s)
    n = [None, 1, 3][seed % 3]
    tokens = GEOM["T"] if n is None else n
    assert _runs_fit(emu, s, d, len(src) + len(dst)), (lengths, "must fit")
    want = [t.clone() for t in dst]
    ops.copy_blocks(want, src, _i64(s), _i64(d), num_tokens=n)
    _emu_copy_blocks(emu, dst, src, s, d, tokens, max_grid=4, index64=index64, use_inline=3)
    assert_blocks_equal(_logical("block", dst), _logical("block", want), f"runs {lengths} n={n}")


def test_run_parameters_are_taken_only_where_they_are_smaller_and_fit(emu) -> None:
    # 3 slots per run against 2 per pair, within the small parameters' 96 slots (the bases first)
    slots = emu.emu_inline_slots()
    assert _runs_fit(emu, list(range(200)), list(range(300, 500)), 7)  # one run of 200 pairs
    assert not _runs_fit(emu, [0, 5, 10, 15], [1, 6, 11, 16], 2)  # four runs of one pair: larger than the pairs
    runs = (slots - 7) // 3
    s = [10 * i + k for i in range(runs) for k in range(5)]
    assert _runs_fit(emu, s, s[::-1][::-1], 7) is True  # the same indices, `runs` runs of 5: fits exactly
    s_more = [10 * i + k for i in range(runs + 1) for k in range(5)]
    assert not _runs_fit(emu, s_more, s_more, 7)  # one run more than the slots hold
    assert not _runs_fit(emu, [], [], 2)


@pytest.mark.parametrize("num_tokens", [1, 2, 3, 4, 13, 16])
@pytest.mark.parametrize("max_grid", [0, 1, 3])
@pytest.mark.parametrize("index64", [False, True])
@pytest.mark.parametrize("force_unaligned", [False, True])
def test_copy_blocks_kernel_batches_short_rows(emu, num_tokens, max_grid, index64, force_unaligned) -> None:
    # fp16, 16 tokens x 32 dims: 1 KiB rows, width 64 B..1 KiB -> 4..64 rows per 4 KiB item, the last batch short
    # (rows = 3 x 2 x 7 = 42 per block); 16-byte aligned, so the unrolled vector path runs unless forced off
    L, kv, H, T, D = 3, 2, 7, 16, 32
    src = [fill_random(torch.empty(5, L, kv, H, T, D, dtype=torch.float16))]
    dst = [fill_random(torch.empty(L * kv, 6, H, T, D, dtype=torch.float16)[i]) for i in range(L * kv)]
    want = [t.clone() for t in dst]
    s, d = [4, 0, 2, 1], [5, 1, 0, 3]
    ops.copy_blocks(want, src, _i64(s), _i64(d), num_tokens=num_tokens)
    _emu_copy_blocks(emu, dst, src, s, d, num_tokens, max_grid, index64, force_unaligned)
    for got, ref in zip(dst, want, strict=True):
        assert_blocks_equal(got, ref, f"n={num_tokens}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.uint8])
@pytest.mark.parametrize("num_tokens", [None, 7, 64])
@pytest.mark.parametrize("max_grid", [0, 1])
def test_copy_blocks_kernel_large_rows_split_into_pieces(emu, dtype, num_tokens, max_grid) -> None:
    # 2 layers x K/V x 3 heads x 64 tokens x 64 dims: a (layer) group is 96 KiB of fp32 -> several 16 KiB pieces
    L, kv, H, T, D = 2, 2, 3, 64, 64
    pad = 1 if dtype == torch.uint8 else 0  # uint8 + 1 byte of padding: source and destination misaligned mod 4
    raw_src = [fill_random(torch.empty(3, kv * H * T * D + pad, dtype=dtype)) for _ in range(L)]
    src = [r[:, : kv * H * T * D].unflatten(1, (kv, H, T, D)) for r in raw_src]
    dst = [fill_random(torch.empty(4, L, kv, H, T, D, dtype=dtype))]
    want = [dst[0].clone()]
    n = T if num_tokens is None else num_tokens
    ops.copy_blocks(want, src, _i64([2, 0]), _i64([1, 3]), num_tokens=num_tokens)
    _emu_copy_blocks(emu, dst, src, [2, 0], [1, 3], n, max_grid)
    assert_blocks_equal(dst[0], want[0])


@pytest.mark.parametrize("max_grid", [0, 1])
def test_copy_segments_kernel_any_alignment(emu, max_grid) -> None:
    g = torch.Generator().manual_seed(3)
    src = fill_random(torch.empty(200_000, dtype=torch.uint8), g)
    dst = fill_random(torch.empty(200_000, dtype=torch.uint8), g)
    want = dst.clone()
    rows, cursor = [], 0
    for nbytes in [0, 1, 15, 16, 17, 33, 100, 4096, 16 * 1024, 16 * 1024 + 7, 40_000]:
        so = int(torch.randint(0, 150_000, (1,), generator=g))
        do = cursor + int(torch.randint(0, 16, (1,), generator=g))
        rows.append((src.data_ptr() + so, dst.data_ptr() + do, nbytes))
        want[do : do + nbytes] = src[so : so + nbytes]
        cursor = do + nbytes
    # the binding splits chunks into pieces of at most kSegmentBytes before the launch
    segments = []
    for s_addr, d_addr, nbytes in rows:
        for off in range(0, nbytes, 16 * 1024):
            segments += [s_addr + off, d_addr + off, min(16 * 1024, nbytes - off)]
    table = _i64(segments)
    emu.emu_copy_segments(_ptr(table), ctypes.c_int64(len(segments) // 3), ctypes.c_int(max_grid))
    assert_blocks_equal(dst, want, "segments")


@pytest.mark.parametrize("max_grid", [0, 1, 3])
def test_copy_segments_kernel_aligned_segments_take_the_unrolled_path(emu, max_grid) -> None:
    # 16-byte aligned addresses and lengths (real pools): the unrolled 16-byte path, with lengths that end inside
    # an unrolled step (not a multiple of 32 lanes x 8 loads x 16 bytes); one unaligned segment among them
    g = torch.Generator().manual_seed(5)
    src = fill_random(torch.empty(400_000, dtype=torch.uint8), g)
    dst = fill_random(torch.empty(400_000, dtype=torch.uint8), g)
    want = dst.clone()
    base_s, base_d = (-src.data_ptr()) % 16, (-dst.data_ptr()) % 16
    segments, cursor = [], 0
    for nbytes in [16, 32, 4096, 4096 + 16, 8192 + 48, 16 * 1024, 16 * 1024 - 16, 4000 + 3]:
        so = base_s + 16 * int(torch.randint(0, 20_000, (1,), generator=g))
        do = base_d + cursor
        segments += [src.data_ptr() + so, dst.data_ptr() + do, nbytes]
        want[do : do + nbytes] = src[so : so + nbytes]
        cursor += (nbytes + 15) // 16 * 16 + 16 * int(torch.randint(0, 4, (1,), generator=g))
    table = _i64(segments)
    emu.emu_copy_segments(_ptr(table), ctypes.c_int64(len(segments) // 3), ctypes.c_int(max_grid))
    assert_blocks_equal(dst, want, "aligned segments")


def _emu_chunk_blocks(emu, dst, src, table, s, d, max_grid=0, index64=False, force_unaligned=False, use_inline=0):
    bases = _i64([t.data_ptr() for t in src] + [t.data_ptr() for t in dst])
    sb, db, t = _i64(s), _i64(d), table.contiguous()
    emu.emu_copy_chunk_blocks(
        _ptr(t),
        ctypes.c_int64(t.size(0)),
        _ptr(bases),
        ctypes.c_int64(len(src)),
        ctypes.c_int64(len(dst)),
        _ptr(sb),
        _ptr(db),
        ctypes.c_int64(len(s)),
        ctypes.c_int(max_grid),
        ctypes.c_int(int(index64)),
        ctypes.c_int(int(force_unaligned)),
        ctypes.c_int(use_inline),
    )


@pytest.mark.parametrize("aligned", [True, False])
@pytest.mark.parametrize(
    ("max_grid", "index64", "force_unaligned", "use_inline"),
    [(0, False, False, 0), (1, True, False, 0), (3, False, True, 0), (2, False, False, 1), (5, False, False, 2)],
)
def test_copy_chunk_blocks_kernel_matches_reference(
    emu, aligned, max_grid, index64, force_unaligned, use_inline
) -> None:
    # chunks of mixed sizes (pieces past a short chunk's end are skipped), each with its own tensor, offset and
    # block stride on the source side, block-major on the destination side; scattered pairs
    from tiered_kv import opdefs

    if use_inline == 2 and emu.emu_inline_slots_large() == 0:
        pytest.skip("the CUDA runtime of this toolkit caps kernel parameters at 4 KiB")
    g = torch.Generator().manual_seed(7 + max_grid)
    sizes = [16, 4096, 16 * 1024, 16 * 1024 + 32, 39_984, 48] if aligned else [1, 15, 17, 4096 + 3, 16 * 1024 + 7, 33]
    blocks, up = 7, (lambda x: (x + 15) // 16 * 16)
    rows, cursor = [], [0, 0]
    for c, nbytes in enumerate(sizes):
        buf = c % 2
        stride = up(nbytes) + 16 * int(torch.randint(0, 3, (1,), generator=g)) + (0 if aligned else 3)
        offset = cursor[buf] + (0 if aligned else 5)
        cursor[buf] = offset + (blocks - 1) * stride + nbytes + 16
        rows.append([buf, offset, stride, 0, 0, 0, nbytes])
    block_bytes = sum(up(n) for n in sizes) + 16
    at = 0
    for r, nbytes in zip(rows, sizes, strict=True):
        r[4], r[5], at = at + (0 if aligned else 1), block_bytes, at + up(nbytes)
    table = _i64([v for r in rows for v in r]).view(-1, 7)
    src = [
        fill_random(torch.empty(cursor[0] + 64, dtype=torch.uint8), g),
        fill_random(torch.empty(cursor[1] + 64, dtype=torch.uint8), g),
    ]
    dst = [fill_random(torch.empty(blocks * block_bytes + 64, dtype=torch.uint8), g)]
    s, d = [6, 0, 3, 3, 5], [1, 4, 0, 6, 2]
    want = [t.clone() for t in dst]
    opdefs.copy_chunk_blocks_ref(want, src, table, None, s, d, 0)
    _emu_chunk_blocks(emu, dst, src, table, s, d, max_grid, index64, force_unaligned, use_inline)
    assert_blocks_equal(dst[0], want[0], "chunk blocks")


@pytest.mark.parametrize("kind", ["flash_attn", "sglang", "vllm_head_outer", "pages"])
@pytest.mark.parametrize("direction", ["offload", "onboard"])
def test_copy_chunk_blocks_kernel_on_engine_layouts(emu, kind, direction) -> None:
    # the real tables of engine layouts (pool_kinds.block_table), whole blocks to and from a block-major pool
    from test_pool_kinds import _case, _chunked

    from tiered_kv import opdefs
    from tiered_kv import pool_kinds as pk
    from tiered_kv.pools import BlockPool, Tier

    gpu_pool, _phys, _ref, lay = _case(kind, "cpu")
    pool = _chunked(gpu_pool, lay)
    host = BlockPool(
        Tier.HOST, pool.layout, fill_random(torch.empty(4, *pool.layout.block_shape, dtype=pool.layout.dtype))
    )
    src, dst, s, d = (
        (pool, host, [5, 0, 3], [1, 3, 0]) if direction == "offload" else (host, pool, [1, 3, 0], [5, 0, 2])
    )
    table = torch.from_numpy(pk.block_table(src, dst))
    dst_t = [t.view(-1).view(torch.uint8) for t in pk.chunk_tensors(dst)]
    src_t = [t.view(-1).view(torch.uint8) for t in pk.chunk_tensors(src)]
    want = [t.clone() for t in dst_t]
    opdefs.copy_chunk_blocks_ref(want, src_t, table, None, s, d, 0)
    _emu_chunk_blocks(emu, dst_t, src_t, table, s, d, max_grid=2)
    for a, b in zip(dst_t, want, strict=True):
        assert torch.equal(a, b), kind


@pytest.mark.parametrize("kind", ["flash_attn", "sglang", "vllm_head_outer", "pages"])
@pytest.mark.parametrize(("s", "d"), [(range(6), range(2, 8)), ([3, 4, 5, 0, 1, 2], [0, 1, 2, 5, 6, 7])])
def test_copy_chunk_blocks_kernel_run_parameters_on_engine_layouts(emu, kind, s, d) -> None:
    # whole blocks of an engine layout offloaded in one or two runs: the chunk kernel with its pairs as runs
    from test_pool_kinds import _case, _chunked

    from tiered_kv import opdefs
    from tiered_kv import pool_kinds as pk
    from tiered_kv.pools import BlockPool, Tier

    s, d = list(s), list(d)
    gpu_pool, _phys, _ref, lay = _case(kind, "cpu")
    pool = _chunked(gpu_pool, lay)
    host = BlockPool(
        Tier.HOST, pool.layout, fill_random(torch.empty(8, *pool.layout.block_shape, dtype=pool.layout.dtype))
    )
    table = torch.from_numpy(pk.block_table(pool, host))
    dst_t = [t.view(-1).view(torch.uint8) for t in pk.chunk_tensors(host)]
    src_t = [t.view(-1).view(torch.uint8) for t in pk.chunk_tensors(pool)]
    assert _runs_fit(emu, s, d, len(src_t) + len(dst_t))
    want = [t.clone() for t in dst_t]
    opdefs.copy_chunk_blocks_ref(want, src_t, table, None, s, d, 0)
    _emu_chunk_blocks(emu, dst_t, src_t, table, s, d, max_grid=2, use_inline=3)
    for a, b in zip(dst_t, want, strict=True):
        assert torch.equal(a, b), kind


@pytest.mark.parametrize("idx_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize(("grid_x", "threads"), [(1, 64), (3, 256), (40, 128)])
def test_gather_kernel_matches_reference(emu, idx_dtype, grid_x, threads) -> None:
    g = torch.Generator().manual_seed(grid_x)
    pools, rows, seqs, kv, src_cols, dst_cols, max_blocks = 2, 9, 7, 2, 300, 280, 270
    src = torch.randint(-1, 5000, (pools, rows, kv, src_cols), dtype=torch.int32, generator=g)
    idx = torch.randint(0, rows, (seqs,), generator=g).to(idx_dtype)
    scale = torch.tensor([3, -2], dtype=torch.int32)
    v_off = torch.tensor([7, 100], dtype=torch.int32)
    dst = torch.randint(-(2**31), 2**31 - 1, (pools, seqs, kv, dst_cols), dtype=torch.int32, generator=g)
    want = dst.clone()
    ops.gather_block_offsets(want, src, idx, scale=scale, v_offset=v_off, max_blocks=max_blocks, sentinel=-1)
    emu.emu_gather(
        _ptr(dst), _ptr(src), _ptr(idx), ctypes.c_int(idx_dtype == torch.int64), _ptr(scale), _ptr(v_off),
        *(ctypes.c_int64(v) for v in (pools, seqs, kv, dst_cols, rows, src_cols, max_blocks)),
        ctypes.c_int32(-1), ctypes.c_int(grid_x), ctypes.c_int(threads),
    )  # fmt: skip
    torch.testing.assert_close(dst, want, rtol=0, atol=0)
    # no scale / offset: null pointers
    dst2 = dst.clone()
    want2 = dst.clone()
    ops.gather_block_offsets(want2, src, idx, max_blocks=5, sentinel=-1)
    emu.emu_gather(
        _ptr(dst2), _ptr(src), _ptr(idx), ctypes.c_int(idx_dtype == torch.int64), None, None,
        *(ctypes.c_int64(v) for v in (pools, seqs, kv, dst_cols, rows, src_cols, 5)),
        ctypes.c_int32(-1), ctypes.c_int(grid_x), ctypes.c_int(threads),
    )  # fmt: skip
    torch.testing.assert_close(dst2, want2, rtol=0, atol=0)


@pytest.mark.parametrize("idx_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize(("grid_x", "threads"), [(1, 64), (5, 128)])
@pytest.mark.parametrize(("src_cols", "dst_cols", "max_blocks"), [(132, 128, 128), (64, 72, 8), (256, 256, 256)])
def test_gather_kernel_vector_path(emu, idx_dtype, grid_x, threads, src_cols, dst_cols, max_blocks) -> None:
    # every row a multiple of 4 columns and the tables 16-byte aligned: the 4-column (int4) path; sentinels
    # and the V offset land in every lane of a vector
    g = torch.Generator().manual_seed(src_cols + grid_x)
    pools, rows, seqs, kv = 2, 11, 9, 2
    src = torch.randint(-1, 3, (pools, rows, kv, src_cols), dtype=torch.int32, generator=g)
    src[src == 2] = 1 << 30  # overflows when scaled: wraps like the reference
    idx = torch.randint(0, rows, (seqs,), generator=g).to(idx_dtype)
    scale = torch.tensor([3, -2], dtype=torch.int32)
    v_off = torch.tensor([7, 100], dtype=torch.int32)
    dst = torch.randint(-(2**31), 2**31 - 1, (pools, seqs, kv, dst_cols), dtype=torch.int32, generator=g)
    assert dst.data_ptr() % 16 == 0 and src.data_ptr() % 16 == 0
    want = dst.clone()
    ops.gather_block_offsets(want, src, idx, scale=scale, v_offset=v_off, max_blocks=max_blocks, sentinel=-1)
    emu.emu_gather(
        _ptr(dst), _ptr(src), _ptr(idx), ctypes.c_int(idx_dtype == torch.int64), _ptr(scale), _ptr(v_off),
        *(ctypes.c_int64(v) for v in (pools, seqs, kv, dst_cols, rows, src_cols, max_blocks)),
        ctypes.c_int32(-1), ctypes.c_int(grid_x), ctypes.c_int(threads),
    )  # fmt: skip
    torch.testing.assert_close(dst, want, rtol=0, atol=0)


def _raw_pool(
    g: torch.Generator, shape: tuple[int, ...], dtype: torch.dtype, pad: int = 0, offset: int = 0
) -> torch.Tensor:
    """A block-major pool ``[blocks, L, kv, H, T, D]`` of random bytes whose blocks are ``pad`` bytes apart beyond
    their size, starting ``offset`` bytes into its buffer (dense blocks, as the kernel reads them)."""
    isz = torch.empty(0, dtype=dtype).element_size()
    block = math.prod(shape[1:]) * isz
    stride = block + pad
    raw = torch.randint(0, 256, (offset + shape[0] * stride + 64,), dtype=torch.uint8, generator=g)
    typed = raw[offset : offset + shape[0] * stride].view(dtype)
    inner = [math.prod(shape[i + 1 :]) for i in range(1, len(shape))]
    return typed.as_strided(shape, (stride // isz, *inner))


def _emu_checksums(emu, pool: torch.Tensor, slots: list[int], use_inline=False, force_unaligned=False) -> torch.Tensor:
    isz = pool.element_size()
    geom = _i64([len(slots), math.prod(pool.shape[1:4]), pool.shape[4], pool.shape[5] * isz, pool.stride(0) * isz])
    out = torch.full((len(slots), pool.shape[4]), 12345, dtype=torch.int32)  # zeroed by the call, as by the launcher
    s = _i64(slots)
    emu.emu_token_checksums(
        _ptr(out), _ptr(pool), _ptr(geom), _ptr(s), ctypes.c_int(int(use_inline)), ctypes.c_int(int(force_unaligned))
    )
    return out


def _unit_bytes(emu, pool: torch.Tensor, aligned16: bool) -> int:
    isz = pool.element_size()
    geom = _i64([1, math.prod(pool.shape[1:4]), pool.shape[4], pool.shape[5] * isz, pool.stride(0) * isz])
    return int(emu.emu_checksum_unit_bytes(_ptr(geom), ctypes.c_int(int(aligned16))))


# (dtype, [blocks, L, kv, H, T, D], block padding in bytes, start offset in bytes, what the kernel loads at a time)
CHECKSUM_CASES = [
    (torch.bfloat16, (6, 4, 2, 3, 5, 64), 0, 0, 16),  # 128-byte rows: 16-byte loads, 12 lanes per token
    (torch.bfloat16, (6, 2, 2, 2, 16, 128), 32, 0, 16),  # an 8B-shaped head (256-byte rows), padded blocks
    (torch.bfloat16, (6, 4, 2, 5, 2, 128), 0, 0, 16),  # 40 lanes per token, rounded up to 2 warps of 10 units each
    (torch.float32, (6, 3, 2, 2, 4, 8), 0, 0, 16),  # the bench's stress shape: 2 loads per row
    (torch.float32, (6, 3, 2, 2, 4, 8), 16, 4, 4),  # its base 4 bytes off 16: one 32-bit word per load
    (torch.float32, (6, 2, 2, 3, 3, 3), 4, 0, 4),  # 12-byte rows
    (torch.float8_e4m3fn, (6, 2, 2, 2, 4, 12), 4, 0, 4),  # 12 one-byte elements: 32-bit words
    (torch.bfloat16, (6, 8, 2, 20, 2, 7), 2, 2, 2),  # 14-byte rows: int16 words, 18 lanes per token
    (torch.float16, (6, 2, 1, 3, 4, 5), 0, 0, 2),  # 10-byte rows, 1 lane per token
    (torch.bfloat16, (6, 1, 1, 1, 1, 1), 6, 0, 2),  # one element per token
    (torch.uint8, (6, 6, 2, 50, 2, 3), 1, 3, 1),  # 3-byte rows: bytes, 8 lanes per token
    (torch.uint8, (6, 2, 2, 5, 7, 13), 5, 1, 1),  # 13-byte rows
    (torch.float8_e5m2, (6, 3, 2, 1, 4, 1), 0, 0, 1),
]


@pytest.mark.parametrize(("dtype", "shape", "pad", "offset", "unit"), CHECKSUM_CASES)
@pytest.mark.parametrize("use_inline", [False, True])
def test_token_checksums_kernel_matches_reference(emu, dtype, shape, pad, offset, unit, use_inline) -> None:
    from tiered_kv import opdefs

    g = torch.Generator().manual_seed(sum(shape) + pad + offset)
    pool = _raw_pool(g, shape, dtype, pad, offset)
    assert _unit_bytes(emu, pool, pool.data_ptr() % 16 == 0) == unit, "the case must take the path it names"
    slots = [5, 0, 3, 3, 1, 5, 5, 2, 4]  # repeated slots: each row summed on its own
    slots += torch.randint(0, shape[0], (20,), generator=g).tolist()
    want = opdefs.token_checksums_ref(pool, _i64(slots))
    assert torch.equal(_emu_checksums(emu, pool, slots, use_inline), want), (dtype, shape, pad, offset)
    if unit == 16:  # the one-word path on the same bytes
        assert torch.equal(_emu_checksums(emu, pool, slots, use_inline, force_unaligned=True), want)


def test_token_checksums_kernel_many_slots_and_any_change(emu) -> None:
    # more slots than the kernel's parameters hold (the array path), then one changed byte per token: only that
    # token's checksum changes, in every row that names its block
    from tiered_kv import opdefs

    g = torch.Generator().manual_seed(11)
    pool = _raw_pool(g, (7, 2, 2, 2, 4, 16), torch.bfloat16)
    slots = torch.randint(0, 7, (300,), generator=g).tolist()  # the parameters hold 128 (kChecksumInlineSlots)
    before = _emu_checksums(emu, pool, slots)
    assert torch.equal(before, opdefs.token_checksums_ref(pool, _i64(slots)))
    raw = pool.view(torch.uint8)
    for t in range(4):
        b = slots[t]
        layer, k, h, byte = (int(torch.randint(0, n, (1,), generator=g)) for n in (2, 2, 2, 32))
        raw[b, layer, k, h, t, byte] ^= 1 << int(torch.randint(0, 8, (1,), generator=g))
        after = _emu_checksums(emu, pool, slots)
        named = torch.tensor([s == b for s in slots])
        changed = after != before
        assert torch.equal(changed[:, t], named) and not changed[:, [u for u in range(4) if u != t]].any()
        before = after
