"""CachedGenerator with layer-by-layer loads: a prompt's forward runs each layer once that layer's reused blocks
have landed from host memory; what it returns is what plain transformers returns holding the same KV, bit for bit;
a load that fails its settle is admitted again and recomputed."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

from tiered_kv import TieredKVCache
from tiered_kv.device import stall_op
from tiered_kv.integrations.hf import (
    CachedGenerator,
    layout_for,
    random_causal_lm,
    reference_generate,
    tiny_llama_config,
)
from tiered_kv.integrations.hf.model import output_cache
from tiered_kv.pools import Tier

TPB = 16
VOCAB = 512


@pytest.fixture(scope="module", params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def model(request: pytest.FixtureRequest) -> Any:
    config = tiny_llama_config(layers=6, vocab=VOCAB)
    return random_causal_lm(config, dtype=torch.float32, device=request.param, seed=1)


def _tokens(seed: int, n: int) -> list[int]:
    tokens: list[int] = np.random.default_rng(seed).integers(0, VOCAB, n).tolist()
    return tokens


def _cache(model: Any) -> TieredKVCache:
    device = str(next(model.parameters()).device)
    return TieredKVCache(layout_for(model, TPB), gpu_blocks=32, host_blocks=32, device=device)


def _past(model: Any, prompt: list[int], r: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    device = next(model.parameters()).device
    with torch.inference_mode():
        out = model(torch.tensor([prompt], device=device), use_cache=True)
    return [(layer.keys[:, :, :r].clone(), layer.values[:, :, :r].clone()) for layer in output_cache(out).layers]


async def _first_then_host(gen: CachedGenerator, cache: TieredKVCache, first: list[int]) -> None:
    await gen.generate(first, max_new_tokens=2)
    await cache.evict(Tier.GPU, cache.blocks.capacity[Tier.GPU])
    gpu = cache.engine.pool(Tier.GPU).tensor
    gpu.zero_()  # every GPU slot is free now: KV the forward reads can only come from the loads
    if gpu.is_cuda:
        torch.cuda.synchronize()


@pytest.mark.parametrize(
    ("load_layers", "shared", "stall"), [(1, 53, 0.0), (2, 48, 0.0), (1, 48, 0.1), (2, 53, 0.1), (4, 64, 0.1)]
)
async def test_a_layerwise_host_hit_is_bitwise_equal_to_transformers_with_the_same_kv(
    model: Any, load_layers: int, shared: int, stall: float
) -> None:
    first = _tokens(1, 100)
    second = first[:shared] + _tokens(2, 40)
    async with _cache(model) as cache:
        gen = CachedGenerator(model, cache, load_layers=load_layers)
        try:
            await _first_then_host(gen, cache, first)
            if stall:  # the loads still running while the forward starts: each layer waits for its own
                onboard = cache.engine.stream("onboard")
                onboard.submit(stall_op(onboard, stall))
            out = await gen.generate(second, max_new_tokens=6, output_logits=True)
        finally:
            gen.close()
        assert out.tokens_reused == shared and out.blocks_from["host"] == shared // TPB
        assert "settle" in out.phases  # the layer-by-layer path ran
        assert not cache.blocks.live_sequences
    tokens, logits, _ = reference_generate(
        model, second, max_new_tokens=6, output_logits=True, past=_past(model, first, shared)
    )
    assert list(out.tokens) == tokens
    assert out.logits is not None and logits is not None and torch.equal(out.logits, logits)


async def test_a_changed_host_block_is_recomputed_and_never_served(model: Any) -> None:
    first = _tokens(3, 96)
    second = first[:80] + _tokens(4, 20)
    async with _cache(model) as cache:
        gen = CachedGenerator(model, cache, load_layers=2)
        try:
            await _first_then_host(gen, cache, first)
            block = cache.blocks.lookup(cache.hasher.chain(np.asarray(first))[2])
            assert block is not None and block.tier is Tier.HOST
            cache.engine.pool(Tier.HOST).tensor[block.slot, 5, 1, 0, 3, 2] += 1  # a stray write, last layer group
            out = await gen.generate(second, max_new_tokens=4, output_logits=True)
        finally:
            gen.close()
        assert cache.statistics().integrity_errors == 1
        assert out.tokens_reused == 2 * TPB  # the blocks before the changed one; the rest recomputed
        assert not cache.blocks.live_sequences
    tokens, logits, _ = reference_generate(
        model, second, max_new_tokens=4, output_logits=True, past=_past(model, first, 2 * TPB)
    )
    assert list(out.tokens) == tokens
    assert out.logits is not None and logits is not None and torch.equal(out.logits, logits)


async def test_a_cancelled_layerwise_request_frees_its_sequence(model: Any) -> None:
    first = _tokens(5, 96)
    async with _cache(model) as cache:
        gen = CachedGenerator(model, cache, load_layers=1)
        try:
            await _first_then_host(gen, cache, first)
            onboard = cache.engine.stream("onboard")
            onboard.submit(stall_op(onboard, 0.2))
            task = asyncio.ensure_future(gen.generate([*first[:90], 1, 2, 3], max_new_tokens=4))
            await asyncio.sleep(0.05)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await cache.engine.drain()
            assert not cache.blocks.live_sequences
            again = await gen.generate([*first[:90], 1, 2, 3], max_new_tokens=4)  # the blocks are intact
            assert again.tokens_reused >= 80
        finally:
            gen.close()


async def test_load_layers_is_checked() -> None:
    model = random_causal_lm(tiny_llama_config(layers=2, vocab=VOCAB), dtype=torch.float32, device="cpu", seed=1)
    async with TieredKVCache(layout_for(model, TPB), gpu_blocks=4, device="cpu") as cache:
        for bad in (-1, 1.5, True, "2"):
            with pytest.raises(ValueError, match="load_layers"):
                CachedGenerator(model, cache, load_layers=bad)  # type: ignore[arg-type]
