"""Hybrid prefill: a prefix in the file tier is partly computed while the rest loads; the output is a recompute's.

The generator's cost model is given rates (a block of 16 tokens computes in 1 ms and loads from the file tier in
1 ms), so a 10-block prefix splits 5/5: the first five blocks are computed by a forward on the model thread while
the admission reads the last five from the file tier.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

from tiered_kv import FileTierConfig, Tier, TieredKVCache, TransferEngine, TransferError
from tiered_kv.blocks import Match
from tiered_kv.cost_model import CostModel
from tiered_kv.integrations.hf import (
    CachedGenerator,
    layout_for,
    random_causal_lm,
    reference_generate,
    tiny_llama_config,
)
from tiered_kv.integrations.hf.kv import pool_views
from tiered_kv.integrations.hf.model import output_cache

TPB = 16
VOCAB = 512
FP32_TOL = 1e-4  # the documented bound against a full-prompt recompute (see tiered_kv.integrations.hf.generator)
KV_TOL = 1e-4


@pytest.fixture(scope="module")
def model() -> Any:
    return random_causal_lm(tiny_llama_config(), dtype=torch.float32, device="cpu", seed=1)


def _tokens(seed: int, n: int) -> list[int]:
    tokens: list[int] = np.random.default_rng(seed).integers(0, VOCAB, n).tolist()
    return tokens


PREFIX = _tokens(1, 10 * TPB)
PROMPT = PREFIX + _tokens(2, 20)


def _cost(cache: TieredKVCache) -> CostModel:
    return CostModel(cache, prefill_tokens_per_s=TPB * 1000, bandwidth={"file": cache.layout.bytes_per_block * 1000})


def _engine(model: Any, directory: Path, **faults: Any) -> TransferEngine:
    from tiered_kv.backends.posix import PosixBackend

    from tiered_kv.testing import FaultyBackend

    config = FileTierConfig(
        directory,
        128,
        gds="off",
        io_threads=2,
        backend_factory=lambda p: FaultyBackend(PosixBackend(p, threads=2), **faults),
    )
    return TransferEngine(layout_for(model, TPB), gpu_blocks=64, host_blocks=64, device="cpu", file_config=config)


def _cache(model: Any, tmp_path: Path, engine: TransferEngine | None = None) -> TieredKVCache:
    return TieredKVCache(
        layout_for(model, TPB),
        gpu_blocks=64,
        host_blocks=64,
        file_blocks=128,
        file_dir=None if engine is not None else tmp_path,
        device="cpu",
        engine=engine,
    )


async def _prefix_in_file(gen: CachedGenerator, cache: TieredKVCache) -> None:
    """The prefix computed once (with other new tokens), then every tier evicted down to the file tier."""
    first = await gen.generate(PREFIX + _tokens(3, 9), max_new_tokens=1)
    assert first.tokens_reused == 0
    await cache.evict(Tier.GPU, cache.blocks.capacity[Tier.GPU])
    await cache.evict(Tier.HOST, cache.blocks.capacity[Tier.HOST])
    assert cache.match(PROMPT) == (160, {"gpu": 0, "host": 0, "file": 10})


def _recompute_kv(model: Any, prompt: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    with torch.inference_mode():
        out = model(torch.tensor([prompt]), use_cache=True)
    return [(layer.keys[0], layer.values[0]) for layer in output_cache(out).layers]


async def test_a_file_prefix_is_split_and_the_output_equals_a_recompute(model: Any, tmp_path: Path) -> None:
    async with _cache(model, tmp_path) as cache:
        cost = _cost(cache)
        attended: list[list[tuple[torch.Tensor, torch.Tensor]]] = []
        gen = CachedGenerator(
            model,
            cache,
            cost_model=cost,
            on_reuse=lambda _, kv: attended.append([(k.clone(), v.clone()) for k, v in kv]),
        )
        views = pool_views(cache.engine.pool(Tier.GPU), model.config.num_hidden_layers)
        snapshots: list[list[tuple[torch.Tensor, torch.Tensor]]] = []
        commit = cache.commit

        def spy(seq_id: int, num_tokens: int | None = None) -> int:  # the sequence's blocks once the prompt is in
            done = commit(seq_id, num_tokens)
            if not snapshots and done >= len(PROMPT):
                table = list(cache.page_table(seq_id))
                snapshots.append([(k[table].clone(), v[table].clone()) for k, v in views])
            return done

        try:
            await _prefix_in_file(gen, cache)
            assert cache.blocks.free_blocks(Tier.GPU) == 64
            for k, v in views:  # every GPU block is free: garbage, so a block nobody writes cannot pass for right
                k.fill_(float("nan"))
                v.fill_(float("nan"))
            cache.commit = spy  # type: ignore[method-assign]
            out = await gen.generate(PROMPT, max_new_tokens=6, output_logits=True)
            cache.commit = commit  # type: ignore[method-assign]
            cache.blocks.check()
            assert cache.blocks.live_sequences == ()
            # a second request (no split) reuses the ORIGINAL file blocks for the head, the loaded ones for the rest
            plain = CachedGenerator(model, cache, cost_model=None)
            again = await plain.generate(PROMPT, max_new_tokens=6)
            plain.close()
        finally:
            gen.close()
    assert out.tokens_computed_first == 80 and out.tokens_reused == 80
    assert out.blocks_from["file"] == 5 and out.tokens_computed == 100
    assert out.phases["hybrid_compute"] > 0 and out.phases["hybrid_admit"] > 0
    s = cost.statistics()
    assert s.hybrid_decisions == 1 and s.hybrid_splits == 1 and s.hybrid_blocks_computed == 5
    tokens, logits, _ = reference_generate(model, PROMPT, max_new_tokens=6, output_logits=True)
    assert list(out.tokens) == tokens
    assert out.logits is not None and logits is not None
    assert out.logits.shape == (len(PROMPT) - 160 + 5, VOCAB)
    assert (out.logits - logits[160:]).abs().max().item() <= FP32_TOL
    # every prompt token's KV in the sequence's blocks (computed head, loaded middle, new tail) is a recompute's
    [blocks] = snapshots
    for (k_blocks, v_blocks), (k_ref, v_ref) in zip(blocks, _recompute_kv(model, PROMPT), strict=True):
        for got, ref in ((k_blocks, k_ref), (v_blocks, v_ref)):  # [blocks, heads, T, dim] vs [heads, tokens, dim]
            flat = got.permute(1, 0, 2, 3).reshape(got.shape[1], -1, got.shape[3])[:, : len(PROMPT)]
            assert (flat - ref).abs().max().item() <= KV_TOL
    # on_reuse shows the whole past the forward attends to: the computed head, then the loaded blocks
    [past] = attended
    for (k_past, v_past), (k_ref, v_ref) in zip(past, _recompute_kv(model, PROMPT), strict=True):
        for got, ref in ((k_past, k_ref), (v_past, v_ref)):
            assert got.shape[:3] == (1, ref.shape[0], 160)
            assert (got[0] - ref[:, :160]).abs().max().item() <= KV_TOL
    assert again.tokens_reused == len(PROMPT) - 1 and again.tokens_computed_first == 0  # all but the last token
    assert again.blocks_from == {"gpu": 6, "host": 0, "file": 5}  # the head from its original file blocks
    assert list(again.tokens) == tokens


async def test_fewer_blocks_matched_at_admission_than_computed_still_give_a_recompute(
    model: Any, tmp_path: Path
) -> None:
    """The cache changes between the peek and the admission: the match is cut after 3 blocks, 5 were computed."""

    class Shrinking(CostModel):
        def split(self, match: Match, num_tokens: int) -> int:
            c = super().split(match, num_tokens)
            if match.blocks and match.blocks[0].tier is Tier.FILE:
                self.cache.blocks.refuse(match.blocks[3])  # blocks 3.. leave the lookup for good
            return c

    async with _cache(model, tmp_path) as cache:
        gen = CachedGenerator(model, cache, cost_model=_cost(cache))
        try:
            await _prefix_in_file(gen, cache)
            gen.cost_model = Shrinking(
                cache, prefill_tokens_per_s=TPB * 1000, bandwidth={"file": cache.layout.bytes_per_block * 1000}
            )
            out = await gen.generate(PROMPT, max_new_tokens=6, output_logits=True)
            cache.blocks.check()
            assert cache.blocks.live_sequences == ()
        finally:
            gen.close()
    assert out.tokens_computed_first == 80 and out.tokens_reused == 0
    tokens, logits, _ = reference_generate(model, PROMPT, max_new_tokens=6, output_logits=True)
    assert list(out.tokens) == tokens
    assert out.logits is not None and logits is not None
    assert (out.logits - logits[80:]).abs().max().item() <= FP32_TOL


async def test_a_hopeless_slow_tier_is_recomputed_in_one_forward_and_its_blocks_stay_cached(
    model: Any, tmp_path: Path
) -> None:
    """Loading loses at every split: the whole prompt runs in ONE forward (not a head forward and then another one
    over its KV), nothing is read from the file tier, and the file blocks stay where they are."""
    async with _cache(model, tmp_path) as cache:
        gen = CachedGenerator(model, cache, cost_model=_cost(cache))
        forwards: list[int] = []
        hook = model.register_forward_pre_hook(lambda module, args: forwards.append(1))
        try:
            await _prefix_in_file(gen, cache)
            gen.cost_model = CostModel(cache, prefill_tokens_per_s=TPB * 1000, bandwidth={"file": 1.0})
            forwards.clear()
            out = await gen.generate(PROMPT, max_new_tokens=1, output_logits=True)
            cache.blocks.check()
            assert cache.blocks.live_sequences == ()
            assert cache.match(PROMPT)[1] == {"gpu": 1, "host": 0, "file": 10}  # the prefix: still the file's
        finally:
            hook.remove()
            gen.close()
    assert len(forwards) == 1
    assert out.tokens_reused == 0 and out.blocks_from["file"] == 0 and out.tokens_computed == len(PROMPT)
    assert out.tokens_computed_first == 160  # the whole match was computed, not loaded
    assert "hybrid_compute" not in out.phases
    tokens, logits, _ = reference_generate(model, PROMPT, max_new_tokens=1, output_logits=True)
    assert list(out.tokens) == tokens
    assert out.logits is not None and logits is not None
    assert (out.logits - logits).abs().max().item() <= FP32_TOL


async def test_cancelling_during_the_hybrid_step_frees_everything(model: Any, tmp_path: Path) -> None:
    async with _engine(model, tmp_path, stall_reads=0.3) as engine, _cache(model, tmp_path, engine) as cache:
        gen = CachedGenerator(model, cache, cost_model=_cost(cache))
        try:
            await _prefix_in_file(gen, cache)
            task = asyncio.create_task(gen.generate(PROMPT, max_new_tokens=4))
            while not cache.blocks.live_sequences:  # noqa: ASYNC110 - polls for the admission's sequence
                await asyncio.sleep(0.001)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert gen.cost_model is not None and gen.cost_model.statistics().hybrid_splits == 1
            assert cache.blocks.live_sequences == ()
            cache.blocks.check()
            again = await gen.generate(PROMPT, max_new_tokens=4)
            cache.blocks.check()
        finally:
            gen.close()
    tokens, _, _ = reference_generate(model, PROMPT, max_new_tokens=4)
    assert list(again.tokens) == tokens


async def test_a_failed_file_read_during_the_hybrid_admission_raises_and_a_retry_is_right(
    model: Any, tmp_path: Path
) -> None:
    async with _engine(model, tmp_path, eio_on_read={2}) as engine, _cache(model, tmp_path, engine) as cache:
        gen = CachedGenerator(model, cache, cost_model=_cost(cache))
        try:
            await _prefix_in_file(gen, cache)
            with pytest.raises(TransferError):
                await gen.generate(PROMPT, max_new_tokens=4)
            assert cache.blocks.live_sequences == ()
            cache.blocks.check()
            again = await gen.generate(PROMPT, max_new_tokens=4)
            cache.blocks.check()
        finally:
            gen.close()
    tokens, _, _ = reference_generate(model, PROMPT, max_new_tokens=4)
    assert list(again.tokens) == tokens


async def test_the_default_cost_model_is_made_for_a_slow_tier_only(model: Any, tmp_path: Path) -> None:
    async with _cache(model, tmp_path) as cache:
        gen = CachedGenerator(model, cache)
        assert isinstance(gen.cost_model, CostModel) and cache.blocks.reuse_limit is None  # made, not attached
        gen.close()
        assert CachedGenerator(model, cache, cost_model=None).cost_model is None
        with pytest.raises(ValueError, match="cost_model"):
            CachedGenerator(model, cache, cost_model="always")  # type: ignore[arg-type]
    async with TieredKVCache(layout_for(model, TPB), gpu_blocks=16, host_blocks=16, device="cpu") as memory_only:
        assert CachedGenerator(model, memory_only).cost_model is None


async def test_the_demo_checks_the_whole_past_of_a_hybrid_turn(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from tiered_kv.tools.demo import DemoConfig, run_demo

    splits: list[int] = []

    def half(self: CostModel, match: Match, num_tokens: int) -> int:  # every file-tier match computes its first half
        c = len(match.blocks) // 2 if match.blocks and match.blocks[0].tier is Tier.FILE else 0
        splits.append(c)
        return c

    monkeypatch.setattr(CostModel, "split", half)
    config = DemoConfig(
        device="cpu",
        conversations=6,
        system_tokens=64,
        max_new_tokens=4,
        gpu_blocks=24,
        host_blocks=4,
        layers=2,
        hidden=128,
        vocab=512,
        directory=str(tmp_path),
    )
    report = await run_demo(config)
    assert any(splits)  # some turn computed a head while its tail loaded
    assert report.verified_tokens >= report.reused_tokens + sum(splits) * 16  # the computed heads were checked too
    assert report.mismatched_tokens == 0 and report.first_token_agree == report.turns
