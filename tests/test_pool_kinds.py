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
        return pk.vllm_views(lay, [phys[i] for i in range(L)]), [phys], lambda b: _bytes(*[phys[i, b] for i in range(L)]), lay
    if kind == "vllm_cross_layer":  # BLHNC: a block holds every layer, block stride spans all layers
        phys = new(N, L, H, T, 2 * D)
        return pk.vllm_views(lay, [phys[:, i] for i in range(L)]), [phys], lambda b: _bytes(phys[b]), lay
    if kind == "vllm_head_outer":  # LHBNC: each block of a layer is H separate runs
        phys = new(L, H, N, T, 2 * D)
        views = [phys[i].permute(1, 0, 2, 3) for i in range(L)]
        return (pk.vllm_views(lay, views), [phys],
                lambda b: _bytes(*[phys[i, h, b] for i in range(L) for h in range(H)]), lay)
    if kind == "sglang":  # token-major (tokens, H, D) K and V buffers, one padding page at the end
        ks = [new(N * T + T, H, D) for _ in range(L)]
        vs = [new(N * T + T, H, D) for _ in range(L)]
        ref = lambda b: _bytes(*[x[b * T:(b + 1) * T] for pair in zip(ks, vs, strict=True) for x in pair])  # noqa: E731
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


KINDS = ["flash_attn", "flashinfer", "split_kv", "vllm_nhd", "vllm_hnd", "vllm_cross_layer", "vllm_head_outer",
         "sglang", "mla", "pages"]


def _dev(device: str) -> str:
    return "cuda" if device == "cuda" else "cpu"


def _snapshot(phys: list[torch.Tensor]) -> list[torch.Tensor]:
    return [p.detach().cpu().clone() for p in phys]


@pytest.mark.parametrize("kind", KINDS)
async def test_round_trip_bit_exact(device, kind, tmp_path) -> None:
    gpu_pool, phys, ref, lay = _case(kind, _dev(device))
    async with TransferEngine(lay, gpu_pool=gpu_pool, host_blocks=8, device=device, file_dir=tmp_path,
                              file_blocks=8) as engine:
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


async def test_readme_layouts_snippet_runs() -> None:
    import pathlib
    import re

    text = (pathlib.Path(__file__).resolve().parent.parent / "README.md").read_text()  # noqa: ASYNC240 -- a test
    block = re.search(r"<!-- layouts-snippet -->\s*```python\n(.*?)```", text, re.S)
    assert block, "README's layouts snippet is missing"
    code = "async def _snippet():\n" + "".join(f"    {line}\n" for line in block.group(1).splitlines())
    scope: dict[str, object] = {}
    exec(compile(code, "README-layouts", "exec"), scope)
    await scope["_snippet"]()  # type: ignore[operator]


async def test_layer_wise_copy_of_a_chunked_pool_is_refused_before_enqueue() -> None:
    gpu_pool, _phys, _ref, lay = _case("flash_attn", "cpu")
    async with TransferEngine(lay, gpu_pool=gpu_pool, host_blocks=4, device="cpu") as engine:
        with pytest.raises(ValueError, match="layer-wise copies"):
            engine.copy(Tier.GPU, [0], Tier.HOST, [0], layers=(0, 1))
        assert engine.statistics().in_flight == 0
