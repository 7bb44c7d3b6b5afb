"""GPU pool kinds (tiered_kv.pool_kinds): every engine layout round-trips bit-exact through host, file and GPU.

Each case builds the engine's tensors over a *physical* buffer and computes, with plain torch from that
buffer, the bytes a block must have on the host tier (the reference); the engine's copies are checked
against it and against the original GPU contents after a poison-and-reload.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import torch

from tiered_kv import KVLayout, Tier, TransferEngine
from tiered_kv import pool_kinds as pk
from tiered_kv.testing import fill_random

N = 6  # GPU blocks
L, H, T, D = 3, 2, 8, 16

Case = tuple[pk.ChunkedPool | list[torch.Tensor], list[torch.Tensor], Callable[[int], torch.Tensor], KVLayout]


def _bytes(*parts: torch.Tensor) -> torch.Tensor:
    return torch.cat([p.contiguous().reshape(-1).view(torch.uint8).cpu() for p in parts])


def _layout(kv: int = 2, heads: int = H) -> KVLayout:
    return KVLayout(num_layers=L, num_kv_heads=heads, head_dim=D, tokens_per_block=T, dtype=torch.float16, kv_factor=kv)


def _case(kind: str, dev: str) -> Case:
    """(gpu_pool argument, physical tensors, reference host bytes of block b, layout)."""
    lay = _layout()
    e = torch.float16

    def new(*shape: int) -> torch.Tensor:
        return fill_random(torch.empty(*shape, dtype=e, device=dev))

    if kind == "flash_attn":
        ts = [new(2, N, T, H, D) for _ in range(L)]
        return ts, ts, lambda b: _bytes(*[t[k, b] for t in ts for k in range(2)]), lay
    if kind == "flashinfer":
        ts = [new(N, 2, T, H, D) for _ in range(L)]
        return ts, ts, lambda b: _bytes(*[t[b] for t in ts]), lay
    if kind == "split_kv":
        ts = [new(N, T, H, D) for _ in range(2 * L)]
        return ts, ts, lambda b: _bytes(*[t[b] for t in ts]), lay
    if kind == "vllm_nhd":  # vLLM >= 0.29 LBNHC: one buffer, logical [B, H, N, K||V] views with permuted strides
        phys = new(L, N, T, H, 2 * D)
        views = [phys[i].permute(0, 2, 1, 3) for i in range(L)]
        return pk.vllm_views(lay, views), [phys], lambda b: _bytes(*[phys[i, b] for i in range(L)]), lay
    if kind == "vllm_hnd":  # LBHNC: per-block dense views
        phys = new(L, N, H, T, 2 * D)
        return (
            pk.vllm_views(lay, [phys[i] for i in range(L)]),
            [phys],
            lambda b: _bytes(*[phys[i, b] for i in range(L)]),
            lay,
        )
    if kind == "vllm_cross_layer":  # BLHNC: a block holds every layer, block stride spans all layers
        phys = new(N, L, H, T, 2 * D)
        return pk.vllm_views(lay, [phys[:, i] for i in range(L)]), [phys], lambda b: _bytes(phys[b]), lay
    if kind == "vllm_head_outer":  # LHBNC: each block of a layer is H separate runs
        phys = new(L, H, N, T, 2 * D)
        views = [phys[i].permute(1, 0, 2, 3) for i in range(L)]
        return (
            pk.vllm_views(lay, views),
            [phys],
            lambda b: _bytes(*[phys[i, h, b] for i in range(L) for h in range(H)]),
            lay,
        )
    if kind == "sglang":  # token-major (tokens, H, D) K and V buffers, one padding page at the end
        ks = [new(N * T + T, H, D) for _ in range(L)]
        vs = [new(N * T + T, H, D) for _ in range(L)]
        ref = lambda b: _bytes(*[x[b * T : (b + 1) * T] for pair in zip(ks, vs, strict=True) for x in pair])  # noqa: E731
        return pk.sglang_token_major(lay, ks, vs), ks + vs, ref, lay
    if kind == "mla":
        lay = _layout(kv=1, heads=1)
        ts = [new(N, T, D) for _ in range(L)]
        return ts, ts, lambda b: _bytes(*[t[b] for t in ts]), lay
    if kind == "pages":  # vLLM's canonical int8 (num_blocks, page_bytes) views, strided over one buffer
        page = H * T * 2 * D * 2
        phys = torch.randint(-128, 127, (N, L, page), dtype=torch.int8, device=dev)
        pool = pk.pages([phys[:, i] for i in range(L)])
        return pool, [phys], lambda b: _bytes(phys[b]), pool.layout
    raise AssertionError(kind)


KINDS = [
    "flash_attn",
    "flashinfer",
    "split_kv",
    "vllm_nhd",
    "vllm_hnd",
    "vllm_cross_layer",
    "vllm_head_outer",
    "sglang",
    "mla",
    "pages",
]


def _dev(device: str) -> str:
    return "cuda" if device == "cuda" else "cpu"


def _snapshot(phys: list[torch.Tensor]) -> list[torch.Tensor]:
    return [p.detach().cpu().clone() for p in phys]


@pytest.mark.parametrize("kind", KINDS)
async def test_round_trip_bit_exact(device, kind, tmp_path) -> None:
    gpu_pool, phys, ref, lay = _case(kind, _dev(device))
    async with TransferEngine(
        lay, gpu_pool=gpu_pool, host_blocks=8, device=device, file_dir=tmp_path, file_blocks=8
    ) as engine:
        pool = engine.pool(Tier.GPU)
        assert isinstance(pool, pk.ChunkedPool)
        expected = {b: ref(b) for b in range(N)}
        calls_before = sum(engine.copier.statistics().calls.values())
        await engine.copy(Tier.GPU, [0, 1, 2, 5], Tier.HOST, [3, 4, 5, 0])  # a run of three, then one
        assert sum(engine.copier.statistics().calls.values()) == calls_before + 1  # one batched call
        for g, h in ((0, 3), (1, 4), (2, 5), (5, 0)):
            host = engine.pool(Tier.HOST).tensor[h].reshape(-1).view(torch.uint8).cpu()
            assert torch.equal(host, expected[g]), f"host block {h} != reference of gpu block {g}"
            assert torch.equal(pool.block(g).reshape(-1).view(torch.uint8).cpu(), expected[g])
        await engine.copy(Tier.HOST, [4], Tier.FILE, [2], keys=[b"k"])  # spill, then read back into the GPU
        before = _snapshot(phys)
        for p in phys:
            fill_random(p)
        poisoned = {b: ref(b) for b in range(N)}
        await engine.copy(Tier.HOST, [3, 5, 0], Tier.GPU, [0, 2, 5])
        await engine.copy(Tier.FILE, [2], Tier.GPU, [1])
        for b in (0, 1, 2, 5):
            assert torch.equal(ref(b), expected[b]), f"{kind}: gpu block {b} not restored bit-exact"
        for b in (3, 4):
            assert torch.equal(ref(b), poisoned[b]), f"{kind}: gpu block {b} was touched"
        await engine.copy(Tier.GPU, [0], Tier.GPU, [3])  # GPU -> GPU within the pool
        assert torch.equal(ref(3), expected[0])
        assert before  # the snapshot was taken before the poison


@pytest.mark.parametrize("kind", ["flash_attn", "flashinfer", "split_kv", "mla"])
def test_auto_detects_each_kind(kind) -> None:
    gpu_pool, _phys, _ref, lay = _case(kind, "cpu")
    assert isinstance(gpu_pool, list)
    pool = pk.as_gpu_pool(lay, gpu_pool)
    assert isinstance(pool, pk.ChunkedPool) and pool.kind == kind


def test_classic_layer_major_shapes_stay_layer_major() -> None:
    lay = _layout()
    pool = pk.as_gpu_pool(lay, [torch.zeros(N, 2, H, T, D, dtype=torch.float16) for _ in range(L)])
    assert not isinstance(pool, pk.ChunkedPool)


def test_chunk_model_of_a_strided_view() -> None:
    lay = _layout()
    phys = torch.zeros(L, H, N, T, 2 * D, dtype=torch.float16)
    pool = pk.vllm_views(lay, [phys[i].permute(1, 0, 2, 3) for i in range(L)])
    assert len(pool.buffers) == 1 and pool.num_chunks == L * H
    assert pool.min_chunk_bytes == T * 2 * D * 2
    assert pool.chunk_stride.tolist() == [T * 2 * D * 2] * (L * H)  # next block = next N*C run


def test_bad_inputs_raise_sentences(tmp_path) -> None:
    lay = _layout()
    with pytest.raises(ValueError, match="fit no known layout"):
        pk.as_gpu_pool(lay, [torch.zeros(N, T, H, D + 1, dtype=torch.float16) for _ in range(L)])
    with pytest.raises(TypeError, match="dtype"):
        pk.flash_attn(lay, [torch.zeros(2, N, T, H, D, dtype=torch.float32) for _ in range(L)])
    with pytest.raises(ValueError, match="innermost"):
        pk.vllm_views(lay, [torch.zeros(N, H, T, 4 * D, dtype=torch.float16)[..., ::2] for _ in range(L)])
    with pytest.raises(ValueError, match="bytes"):
        pk.pages([torch.zeros(N, 100, dtype=torch.int8)], layout=lay)
    with pytest.raises(ValueError, match="unknown GPU pool kind"):
        pk.as_gpu_pool(lay, [], kind="paged")
    with pytest.raises(ValueError, match="split_kv tensors must be"):
        pk.split_kv(lay, [torch.zeros(N + (i == 1), T, H, D, dtype=torch.float16) for i in range(2 * L)])


async def test_partial_copy_of_a_chunked_pool_is_refused_before_enqueue() -> None:
    gpu_pool, _phys, _ref, lay = _case("flash_attn", "cpu")
    async with TransferEngine(lay, gpu_pool=gpu_pool, host_blocks=4, device="cpu") as engine:
        with pytest.raises(ValueError, match="partial copies"):
            engine.copy(Tier.GPU, [0], Tier.HOST, [0], num_tokens=3)
        assert engine.statistics().in_flight == 0


def test_chunk_table_shape() -> None:
    pool, _phys, _ref, lay = _case("vllm_hnd", "cpu")
    assert isinstance(pool, pk.ChunkedPool)
    table = pk.chunk_table(pool, np.array([1, 4]), pool, np.array([0, 2]))
    assert table.shape == (2 * L, 5)
    assert (table[:, 4] == lay.bytes_per_block // L).all()


async def test_bench_layout_rows_round_trip_every_kind(device) -> None:
    from tiered_kv.tools.bench import layouts

    rows = await layouts.rows(device, 4096, 2, 4, 1)
    assert {r["kind"] for r in rows} == set(layouts.KINDS) and len(rows) == 2 * len(layouts.KINDS)
    assert all(r["bit_exact"] for r in rows), [r["kind"] for r in rows if not r["bit_exact"]]
    assert all(r["piece_KiB"] == 4.0 for r in rows)


def test_docs_layouts_snippet_runs() -> None:
    import pathlib
    import re
    import subprocess
    import sys

    text = (pathlib.Path(__file__).resolve().parent.parent / "docs" / "api.md").read_text()
    block = re.search(r"<!-- layouts-snippet -->\s*```python\n(.*?)```", text, re.S)
    assert block, "docs/api.md's layouts snippet is missing"
    r = subprocess.run([sys.executable, "-c", block.group(1)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]


async def test_layer_wise_copy_of_a_chunked_pool_is_refused_before_enqueue() -> None:
    gpu_pool, _phys, _ref, lay = _case("flash_attn", "cpu")
    async with TransferEngine(lay, gpu_pool=gpu_pool, host_blocks=4, device="cpu") as engine:
        with pytest.raises(ValueError, match="layer-wise copies"):
            engine.copy(Tier.GPU, [0], Tier.HOST, [0], layers=(0, 1))
        assert engine.statistics().in_flight == 0


def _chunked(gpu_pool: pk.ChunkedPool | list[torch.Tensor], lay: KVLayout) -> pk.ChunkedPool:
    pool = gpu_pool if isinstance(gpu_pool, pk.ChunkedPool) else pk.as_gpu_pool(lay, gpu_pool)
    assert isinstance(pool, pk.ChunkedPool)
    return pool


@pytest.mark.parametrize("kind", KINDS)
def test_block_table_copies_what_the_chunk_table_copies(kind) -> None:
    # the engine's copies take the pair's fixed table (merged chunks) and the call's indices; the per-call
    # chunk table is the model: both must move the same bytes, both directions, any indices
    from tiered_kv import opdefs
    from tiered_kv.pools import BlockPool

    gpu_pool, _phys, _ref, lay = _case(kind, "cpu")
    pool = gpu_pool if isinstance(gpu_pool, pk.ChunkedPool) else pk.as_gpu_pool(lay, gpu_pool)
    assert isinstance(pool, pk.ChunkedPool)
    host = BlockPool(
        Tier.HOST, pool.layout, fill_random(torch.empty(5, *pool.layout.block_shape, dtype=pool.layout.dtype))
    )
    s, d = np.array([5, 0, 3]), np.array([1, 4, 2])
    for src, si, dst, di in ((pool, s, host, d), (host, d, pool, s), (pool, s, pool, np.array([1, 2, 4]))):
        a = [t.clone() for t in pk.chunk_tensors(dst)]
        b = [t.clone() for t in a]
        opdefs.copy_chunks_ref(a, pk.chunk_tensors(src), torch.from_numpy(pk.chunk_table(src, si, dst, di)), 0)
        table = torch.from_numpy(pk.block_table(src, dst))
        opdefs.copy_chunk_blocks_ref(b, pk.chunk_tensors(src), table, None, si.tolist(), di.tolist(), 0)
        assert all(torch.equal(x.view(torch.uint8), y.view(torch.uint8)) for x, y in zip(a, b, strict=True)), kind
    rows = pk.block_table(pool, host).shape[0]
    if kind in ("vllm_cross_layer", "pages"):  # a block is one dense run on both sides: one row, the whole block
        assert rows == 1 and pk.block_table(pool, host)[0, 6] == pool.layout.bytes_per_block
    elif kind == "vllm_head_outer":
        assert rows == L * H
    else:
        assert rows == pool.num_chunks


def test_block_table_rejects_a_call_past_the_pool() -> None:
    from tiered_kv import opdefs

    gpu_pool, _phys, _ref, lay = _case("flash_attn", "cpu")
    pool = _chunked(gpu_pool, lay)
    table = torch.from_numpy(pk.block_table(pool, pool))
    dst = [fill_random(t.clone()) for t in pk.chunk_tensors(pool)]
    before = [t.clone() for t in dst]
    with pytest.raises(ValueError, match="past the end"):
        opdefs.copy_chunk_blocks_ref(dst, pk.chunk_tensors(pool), table, None, [N], [0], 0)
    with pytest.raises(ValueError, match="negative block"):
        opdefs.copy_chunk_blocks_ref(dst, pk.chunk_tensors(pool), table, None, [0], [-1], 0)
    assert all(torch.equal(x.view(torch.uint8), y.view(torch.uint8)) for x, y in zip(dst, before, strict=True))


@pytest.mark.gpu
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("method", [0, 1], ids=["kernel", "dma"])
@pytest.mark.parametrize("pairs", [3, 60, 300], ids=["inline", "inline-large", "staged"])
def test_copy_chunk_blocks_on_the_device_matches_the_reference(kind, method, pairs) -> None:
    # the CUDA op against the CPU reference: kernel (bases and indices in the parameters, or staged past them;
    # the table on the device or shipped with the call) and batched DMA, both directions, scattered pairs
    from tiered_kv import _ext, opdefs
    from tiered_kv.pools import BlockPool

    assert _ext.load(), _ext.status()["error"]
    gpu_pool, _phys, _ref, lay = _case(kind, "cuda")
    pool = _chunked(gpu_pool, lay)
    shape, dtype = pool.layout.block_shape, pool.layout.dtype
    host = BlockPool(Tier.HOST, pool.layout, fill_random(torch.empty(400, *shape, dtype=dtype)).pin_memory())
    gen = torch.Generator().manual_seed(pairs + method)
    on_gpu = torch.randint(0, N, (pairs,), generator=gen).tolist()  # repeated sources are fine
    on_host = torch.randperm(400, generator=gen)[:pairs].tolist()  # destinations are distinct
    cases: list[tuple[object, list[int], object, list[int]]] = [(pool, on_gpu, host, on_host)]
    if pairs <= N:
        cases.append((host, on_host, pool, torch.randperm(N, generator=gen)[:pairs].tolist()))
    for src, s, dst, d in cases:
        table = torch.from_numpy(pk.block_table(src, dst))
        src_t, dst_t = pk.chunk_tensors(src), pk.chunk_tensors(dst)
        for table_dev in (table.cuda(), None):
            for t in dst_t:
                fill_random(t)
            want = [t.cpu().clone() for t in dst_t]
            opdefs.copy_chunk_blocks_ref(want, [t.cpu() for t in src_t], table, None, s, d, 0)
            with torch.cuda.stream(torch.cuda.Stream()):
                torch.ops.tiered_kv.copy_chunk_blocks(dst_t, src_t, table, table_dev, s, d, method)
            torch.cuda.synchronize()
            for a, b in zip(dst_t, want, strict=True):
                bad = (a.cpu().view(-1).view(torch.uint8) != b.view(-1).view(torch.uint8)).nonzero()
                assert bad.numel() == 0, f"{kind} method={method} pairs={pairs}: {bad.numel()} bytes differ"


@pytest.mark.gpu
def test_copy_chunk_blocks_refuses_bad_calls_before_any_copy() -> None:
    from tiered_kv import _ext

    assert _ext.load(), _ext.status()["error"]
    gpu_pool, _phys, _ref, lay = _case("flash_attn", "cuda")
    pool = _chunked(gpu_pool, lay)
    table = torch.from_numpy(pk.block_table(pool, pool))
    src = pk.chunk_tensors(pool)
    dst = [fill_random(t.clone()) for t in src]  # a second pool of the same kind (the engine checks its own calls)
    before = [t.clone() for t in dst]
    op = torch.ops.tiered_kv.copy_chunk_blocks.default
    for s, d, match in (([N], [0], "past the end"), ([0], [-1], "negative block"), ([0, 1], [2], "destination")):
        with pytest.raises(RuntimeError, match=match):
            op(dst, src, table, None, s, d, 0)
    bad = table.clone()
    bad[0, 3] = 9
    with pytest.raises(RuntimeError, match="tensor index"):
        op(dst, src, bad, None, [0], [1], 0)
    with pytest.raises(RuntimeError, match="table_dev"):
        op(dst, src, table, table[:1].cuda(), [0], [1], 0)
    torch.cuda.synchronize()
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(dst, before, strict=True))
