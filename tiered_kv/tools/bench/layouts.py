"""Benchmark rows for the GPU pool kinds (tiered_kv.pool_kinds): one row per engine layout and direction.

Each kind (FlashAttention, FlashInfer, split K/V, vLLM >= 0.29 views in two physical orders, SGLang
token-major, MLA, vLLM's canonical int8 pages) is built over ``blocks`` blocks whose smallest chunk is
``piece`` bytes; the engine offloads and onboards every block in one call, next to one contiguous copy of the
same bytes between the same memories in the same run, the two taking turns (``vs_contiguous`` = the median over
turns of contiguous time / engine time; target >= 0.85 at 64 KiB pieces on CUDA). Every row also round-trips the
pool through the host tier with random contents and reports whether it came back bit-exact.

Primitives: :func:`kind_pool` (a pool of one kind with a given piece size), :func:`rows` (the rows), :func:`run`.

Run alone: ``python -m tiered_kv.tools.bench.layouts [--quick] [--device cpu|cuda] [--json F]`` (the kernels
benchmark includes the same rows).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from ... import pool_kinds as pk
from ...engine import TransferEngine
from ...layout import KVLayout
from ...pools import BlockPool, Tier
from .common import bench_main, machine_info, offload_onboard_seconds, sync

__all__ = ["KINDS", "kind_pool", "main", "rows", "run"]

KINDS = ("flash_attn", "flashinfer", "split_kv", "vllm_nhd", "vllm_cross_layer", "sglang", "mla", "pages")


def kind_pool(
    kind: str, piece: int, layers: int, blocks: int, device: str
) -> tuple[pk.ChunkedPool, list[torch.Tensor]]:
    """A chunked pool of ``kind`` whose smallest chunk is ``piece`` bytes (fp16), and its physical tensors."""
    hd = piece // 64  # heads * head_dim at 32 tokens of fp16 per chunk
    heads = 8 if hd >= 1024 else 1
    dim = hd // heads
    f16 = torch.float16

    def lay(tokens: int, kv: int = 2, h: int = heads, d: int = dim) -> KVLayout:
        return KVLayout(num_layers=layers, num_kv_heads=h, head_dim=d, tokens_per_block=tokens, dtype=f16, kv_factor=kv)

    def new(*shape: int, dtype: torch.dtype = f16) -> torch.Tensor:
        return torch.empty(*shape, dtype=dtype, device=device)

    if kind == "flash_attn":
        ts = [new(2, blocks, 32, heads, dim) for _ in range(layers)]
        return pk.flash_attn(lay(32), ts), ts
    if kind == "flashinfer":  # a layer's block (K and V) is one chunk: 16 tokens make it `piece` bytes
        ts = [new(blocks, 2, 16, heads, dim) for _ in range(layers)]
        return pk.flashinfer(lay(16), ts), ts
    if kind == "split_kv":
        ts = [new(blocks, 32, heads, dim) for _ in range(2 * layers)]
        return pk.split_kv(lay(32), ts), ts
    if kind == "vllm_nhd":  # LBNHC, one buffer, logical [B, H, N, K||V] views
        phys = new(layers, blocks, 16, heads, 2 * dim)
        return pk.vllm_views(lay(16), [phys[i].permute(0, 2, 1, 3) for i in range(layers)]), [phys]
    if kind == "vllm_cross_layer":  # BLHNC
        phys = new(blocks, layers, heads, 16, 2 * dim)
        return pk.vllm_views(lay(16), [phys[:, i] for i in range(layers)]), [phys]
    if kind == "sglang":
        ks = [new(blocks * 32 + 32, heads, dim) for _ in range(layers)]
        vs = [new(blocks * 32 + 32, heads, dim) for _ in range(layers)]
        return pk.sglang_token_major(lay(32), ks, vs), [
            b[: blocks * 32] for b in ks + vs
        ]  # the padding page is no block
    if kind == "mla":
        ts = [new(blocks, 32, hd) for _ in range(layers)]
        return pk.mla(lay(32, kv=1, h=1, d=hd), ts), ts
    if kind == "pages":  # vLLM's canonical int8 (num_blocks, page_bytes) views over one buffer
        phys = new(blocks, layers, piece, dtype=torch.int8)
        return pk.pages([phys[:, i] for i in range(layers)]), [phys]
    raise ValueError(f"unknown kind {kind!r}; use one of {', '.join(KINDS)}")


def _random(t: torch.Tensor) -> None:
    flat = t.view(torch.uint8) if t.dtype == torch.int8 else t
    if flat.dtype == torch.uint8:
        flat.copy_(torch.randint(0, 256, flat.shape, dtype=torch.uint8, device=flat.device))
    else:  # fp16 bit patterns (NaNs included: compared bitwise)
        flat.view(torch.int16).copy_(torch.randint(-32768, 32767, flat.shape, dtype=torch.int16, device=flat.device))


async def _one(kind: str, device: str, piece: int, layers: int, blocks: int, repeat: int) -> list[dict[str, Any]]:
    cuda = device.startswith("cuda")
    pool, phys = kind_pool(kind, piece, layers, blocks, device if cuda else "cpu")
    idx = np.arange(blocks)
    async with TransferEngine(pool.layout, gpu_pool=pool, host_blocks=blocks, device=device) as engine:
        host = engine.pool(Tier.HOST)
        assert isinstance(host, BlockPool)
        for p in phys:
            _random(p)
        want = [p.clone() for p in phys]
        # the fills ran on the current stream: the engine's copy streams must wait for them (as for any KV the
        # compute stream writes before an offload)
        if cuda:
            engine.sync_with_compute(torch.cuda.current_stream())
        await engine.copy(Tier.GPU, idx, Tier.HOST, idx)
        for p in phys:
            p.zero_()
        if cuda:
            engine.sync_with_compute(torch.cuda.current_stream())
        await engine.copy(Tier.HOST, idx, Tier.GPU, idx)
        sync(cuda)
        exact = all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(phys, want, strict=True))
        del want

        nbytes = blocks * pool.layout.bytes_per_block
        # each engine copy next to one contiguous copy of the same bytes, taking turns (common.paired_seconds)
        timed = await offload_onboard_seconds(engine, idx, pool.device, repeat, cuda)
        (off, base_off, ratio_off), (on, base_on, ratio_on) = timed["offload"], timed["onboard"]
        path = ",".join(sorted(engine.copier.statistics().calls))
    out = []
    for direction, ours, base, ratio in (("offload", off, base_off, ratio_off), ("onboard", on, base_on, ratio_on)):
        target = cuda and pool.min_chunk_bytes >= 65536
        out.append(
            {
                "bench": "layouts",
                "device": "cuda" if cuda else "emulated",
                "kind": kind,
                "direction": direction,
                "piece_KiB": pool.min_chunk_bytes / 1024,
                "chunks_per_block": pool.num_chunks,
                "blocks": blocks,
                "path": path,
                "engine_GBps": nbytes / ours / 1e9,
                "contiguous_GBps": nbytes / base / 1e9,
                "vs_contiguous": ratio,
                "bit_exact": exact,
                "target": ">=0.85x contig" if target else "(no target: emulated or < 64 KiB)",
                "met": (ratio >= 0.85 and exact) if target else exact,
            }
        )
    return out


async def rows(device: str, piece: int, layers: int, blocks: int, repeat: int) -> list[dict[str, Any]]:
    """Rows for every kind (offload and onboard each)."""
    out: list[dict[str, Any]] = []
    for kind in KINDS:
        out.extend(await _one(kind, device, piece, layers, blocks, repeat))
    return out


def run(quick: bool = False, device: str = "auto") -> dict[str, Any]:
    """Every kind at 64 KiB pieces on CUDA (4 KiB, tiny, when emulated); ``{"name", "machine", "rows", "notes"}``."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda"):
        result = asyncio.run(rows(device, 64 << 10, 8 if quick else 32, 64 if quick else 128, 3 if quick else 10))
        notes = [
            "vs_contiguous = median over turns of one contiguous copy of the same bytes / the engine copy beside it "
            "(the two take turns); target >= 0.85"
        ]
    else:
        result = asyncio.run(rows(device, 4 << 10, 2, 4, 2))
        notes = ["emulated: CPU reference ops on the emulated device with small sizes; not GPU figures"]
    return {"name": "layouts", "machine": machine_info(device), "rows": result, "notes": notes}


def main(argv: Sequence[str] | None = None) -> int:
    """Command line entry point."""
    return bench_main("layouts", run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
