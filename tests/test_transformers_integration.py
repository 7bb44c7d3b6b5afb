"""CachedGenerator on a real transformers Llama (random weights from a config): the tokens and logits of no cache.

Bitwise: the generator's logits equal plain transformers holding the same earlier KV in a DynamicCache (so the
tiers, blocks, partial copies and the file round trip change nothing). Against a full-prompt recompute: logits
within rounding, greedy tokens equal except at near-ties in bf16 (see the module docstring of
tiered_kv.integrations.hf; tests/test_dtype_claims.py checks each dtype).
"""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

from tiered_kv import KVLayout, Tier, TieredKVCache
from tiered_kv.integrations.hf import (
    CachedGenerator,
    layout_for,
    random_causal_lm,
    reference_generate,
    tiny_llama_config,
)
from tiered_kv.integrations.hf.model import output_cache

TPB = 16
VOCAB = 512
FP32_TOL = 1e-4  # |logit| <= ~5 (1 ulp at 4 is 4.8e-7): rounding of other kernel shapes; a wrong block is O(0.1-1) off


@pytest.fixture(scope="module", params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def model32(request: pytest.FixtureRequest) -> Any:
    return random_causal_lm(tiny_llama_config(), dtype=torch.float32, device=request.param, seed=1)


def _tokens(seed: int, n: int) -> list[int]:
    tokens: list[int] = np.random.default_rng(seed).integers(0, VOCAB, n).tolist()
    return tokens


def _cache(model: Any, tmp_path: Any, gpu: int = 64, host: int = 64, file: int = 128, **kw: Any) -> TieredKVCache:
    device = str(next(model.parameters()).device)
    return TieredKVCache(
        layout_for(model, TPB),
        gpu_blocks=gpu,
        host_blocks=host,
        file_blocks=file,
        file_dir=tmp_path if file else None,
        device="cpu" if device == "cpu" else device,
        **kw,
    )


def _past(model: Any, prompt: list[int], r: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Plain transformers: the KV of ``prompt``'s first ``r`` tokens from a forward over the whole prompt."""
    device = next(model.parameters()).device
    with torch.inference_mode():
        out = model(torch.tensor([prompt], device=device), use_cache=True)
    return [(layer.keys[:, :, :r].clone(), layer.values[:, :, :r].clone()) for layer in output_cache(out).layers]


async def _move_all(cache: TieredKVCache, tier: str) -> None:
    if tier in ("host", "file"):
        await cache.evict(Tier.GPU, cache.blocks.capacity[Tier.GPU])
    if tier == "file":
        await cache.evict(Tier.HOST, cache.blocks.capacity[Tier.HOST])


@pytest.mark.parametrize(("tier", "shared"), [("gpu", 48), ("gpu", 53), ("host", 53), ("file", 48), ("file", 53)])
async def test_reuse_from_every_tier_is_bitwise_equal_to_transformers_with_the_same_kv(model32, tmp_path, tier, shared):
    """Prompt 2 shares ``shared`` tokens with prompt 1 (53: three blocks + a partial block of 5)."""
    first = _tokens(1, 100)
    second = first[:shared] + _tokens(2, 40)
    async with _cache(model32, tmp_path) as cache:
        gen = CachedGenerator(model32, cache)
        try:
            out1 = await gen.generate(first, max_new_tokens=3)
            assert out1.tokens_reused == 0
            await _move_all(cache, tier)
            out2 = await gen.generate(second, max_new_tokens=6, output_logits=True)
        finally:
            gen.close()
        # the file tier brings whole blocks only (no partial read): the 5 extra tokens are recomputed there
        expect_reused = shared if tier != "file" else shared // TPB * TPB
        assert out2.tokens_reused == expect_reused
        assert out2.blocks_from[tier] == shared // TPB
        assert out2.partial_tokens == (shared % TPB if tier != "file" else 0)
        assert cache.statistics().hits[tier] == shared // TPB
    tokens, logits, _ = reference_generate(
        model32, second, max_new_tokens=6, output_logits=True, past=_past(model32, first, expect_reused)
    )
    assert list(out2.tokens) == tokens
    assert out2.logits is not None and logits is not None
    assert out2.logits.shape == (len(second) - expect_reused + 5, VOCAB)
    assert torch.equal(out2.logits, logits), (out2.logits - logits).abs().max()
    # against a recompute of the whole prompt without any cache: same tokens, logits within rounding
    full_tokens, full_logits, _ = reference_generate(model32, second, max_new_tokens=6, output_logits=True)
    assert list(out2.tokens) == full_tokens
    assert full_logits is not None
    assert (out2.logits - full_logits[expect_reused:]).abs().max().item() <= FP32_TOL


async def test_a_later_turn_reuses_the_decoded_reply(model32, tmp_path):
    """Turn 2 resends turn 1 and its reply: the reply's KV (written while decoding) is reused."""
    turn1 = _tokens(5, 70)
    async with _cache(model32, tmp_path) as cache:
        gen = CachedGenerator(model32, cache)
        try:
            out1 = await gen.generate(turn1, max_new_tokens=12)
            assert out1.tokens_stored == 70 + 11  # the last token's KV is never computed
            turn2 = turn1 + list(out1.tokens) + _tokens(6, 20)
            await _move_all(cache, "host")
            out2 = await gen.generate(turn2, max_new_tokens=8, output_logits=True)
        finally:
            gen.close()
    assert out2.tokens_reused == 70 + 11
    tokens, logits, _ = reference_generate(model32, turn2, max_new_tokens=8, output_logits=True)
    assert list(out2.tokens) == tokens
    assert logits is not None and out2.logits is not None
    assert (out2.logits - logits[out2.tokens_reused :]).abs().max().item() <= FP32_TOL


async def test_a_fully_cached_prompt_computes_its_last_token_only(model32, tmp_path):
    prompt = _tokens(7, 64)
    async with _cache(model32, tmp_path) as cache:
        gen = CachedGenerator(model32, cache)
        try:
            out1 = await gen.generate(prompt, max_new_tokens=4, output_logits=True)
            out2 = await gen.generate(prompt, max_new_tokens=4, output_logits=True)
        finally:
            gen.close()
    assert out2.tokens_reused == 63 and out2.tokens_computed == 1
    assert out2.tokens == out1.tokens
    tokens, logits, _ = reference_generate(
        model32, prompt, max_new_tokens=4, output_logits=True, past=_past(model32, prompt, 63)
    )
    assert logits is not None
    assert list(out2.tokens) == tokens and out2.logits is not None and torch.equal(out2.logits, logits)


async def test_the_time_to_first_token_is_split_into_its_phases(model32, tmp_path):
    """``Generation.phases``: admission, gathering the reused KV, the forward (the KV writes within it), commit and
    sampling; together they are the time to first token (the KV writes counted once, inside the forward)."""
    prompt = _tokens(8, 80)
    async with _cache(model32, tmp_path) as cache:
        gen = CachedGenerator(model32, cache)
        try:
            cold = await gen.generate(prompt, max_new_tokens=2)
            hit = await gen.generate([*prompt, 5], max_new_tokens=2)
        finally:
            gen.close()
    for out in (cold, hit):
        assert set(out.phases) == {"admit", "preload", "forward", "kv_write", "commit", "sample"}
        assert all(v >= 0 for v in out.phases.values())
        assert 0 < out.phases["kv_write"] <= out.phases["forward"]
        total = sum(v for k, v in out.phases.items() if k != "kv_write")
        assert total == pytest.approx(out.ttft_s, rel=0.05, abs=2e-3)
    assert hit.tokens_reused == 80


async def test_a_batch_equals_each_prompt_alone(model32, tmp_path):
    system = _tokens(8, 40)
    prompts = [system + _tokens(9, 30), system + _tokens(10, 30), system + _tokens(11, 45)]
    async with _cache(model32, tmp_path) as cache:
        gen = CachedGenerator(model32, cache)
        try:
            await gen.generate(system + _tokens(12, 5), max_new_tokens=1)  # caches the system prompt
            batch = await gen.generate_batch(prompts, max_new_tokens=5, output_logits=True)
        finally:
            gen.close()
    assert [b.tokens_reused for b in batch] == [40, 40, 40]
    past = _past(model32, system + _tokens(12, 5), 40)
    for i, (prompt, got) in enumerate(zip(prompts, batch, strict=True)):
        tokens, logits, _ = reference_generate(model32, prompt, max_new_tokens=5, output_logits=True, past=past)
        assert list(got.tokens) == tokens
        assert got.logits is not None and logits is not None
        if i == 2:  # alone in its group (another length): the shapes of its solo run
            assert torch.equal(got.logits, logits)
        else:  # prompts 0 and 1 ran as a batch of two: two-row products round differently from one-row ones
            assert (got.logits - logits).abs().max().item() <= FP32_TOL


async def test_stop_tokens_streaming_and_an_early_close(model32, tmp_path):
    prompt = _tokens(13, 50)
    async with _cache(model32, tmp_path) as cache:
        gen = CachedGenerator(model32, cache)
        try:
            full = await gen.generate(prompt, max_new_tokens=6)
            stopped = await gen.generate(prompt, max_new_tokens=6, stop_token_ids=[full.tokens[1]])
            assert stopped.tokens == full.tokens[:2] and stopped.finish_reason == "stop"
            stream = gen.stream(prompt, max_new_tokens=6)
            got = [t async for t in stream]
            assert tuple(got) == full.tokens and stream.result is not None and stream.result.tokens == full.tokens
            early = gen.stream(prompt, max_new_tokens=6)
            async for _ in early:
                break
            await early.aclose()
            assert cache.blocks.live_sequences == ()
        finally:
            gen.close()


async def test_cancelling_waits_for_the_forward_then_frees(model32, tmp_path):
    prompt = _tokens(14, 80)
    async with _cache(model32, tmp_path) as cache:
        gen = CachedGenerator(model32, cache)
        try:
            task = asyncio.create_task(gen.generate(prompt, max_new_tokens=200))
            while gen.statistics().generated_tokens < 3:  # noqa: ASYNC110 - polls the generator's counter
                await asyncio.sleep(0.001)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert cache.blocks.live_sequences == ()
            cache.blocks.check()
            again = await gen.generate(prompt, max_new_tokens=4)  # the committed KV is intact and reused
        finally:
            gen.close()
    assert again.tokens_reused == 79
    tokens, _, _ = reference_generate(model32, prompt, max_new_tokens=4)
    assert list(again.tokens) == tokens


async def test_a_full_gpu_tier_while_decoding_stops_storing_not_generating(model32, tmp_path):
    prompt = _tokens(15, 60)  # 4 blocks
    async with _cache(model32, tmp_path, gpu=10, host=0, file=0) as cache:
        [other] = await cache.add_sequences([_tokens(22, 80)])  # another live sequence holds 5 of the 10 blocks
        gen = CachedGenerator(model32, cache)
        try:
            out = await gen.generate(prompt, max_new_tokens=30)
        finally:
            gen.close()
        cache.free(other.seq_id)
    assert len(out.tokens) == 30 and out.tokens_stored == 80  # 5 blocks: 20 of the 29 decoded tokens stored
    tokens, _, _ = reference_generate(model32, prompt, max_new_tokens=30)
    assert list(out.tokens) == tokens


async def test_a_batch_row_that_stops_storing_mid_reply_and_a_row_that_stops_early_keep_their_tokens(model32, tmp_path):
    """Row 0 gets the GPU tier's last block at position 64, row 1 does not: row 0 still stores, row 1 goes on
    unstored; later row 1 meets its stop token and leaves the batch."""
    prompts = [_tokens(30, 60), _tokens(31, 60)]  # 4 blocks each
    refs = [reference_generate(model32, p, max_new_tokens=24)[0] for p in prompts]
    k = next(i for i in range(8, 24) if refs[1][i] not in refs[1][:i] and refs[1][i] not in refs[0])
    stop = refs[1][k]
    async with _cache(model32, tmp_path, gpu=10, host=0, file=0) as cache:
        [other] = await cache.add_sequences([_tokens(32, 8)])  # holds 1 block: 9 left for the batch
        gen = CachedGenerator(model32, cache)
        try:
            batch = await gen.generate_batch(prompts, max_new_tokens=24, stop_token_ids=[stop])
        finally:
            gen.close()
        cache.free(other.seq_id)
        cache.blocks.check()
    assert [b.tokens_stored for b in batch] == [80, 64]  # row 0: its 5th block, full at 80; row 1: none more
    assert list(batch[1].tokens) == refs[1][: k + 1] and batch[1].finish_reason == "stop"
    assert list(batch[0].tokens) == refs[0] and batch[0].finish_reason == "length"


async def test_bad_arguments_are_refused_before_anything_is_admitted(model32, tmp_path):
    async with _cache(model32, tmp_path, gpu=8, host=0, file=0) as cache:
        gen = CachedGenerator(model32, cache)
        try:
            for bad, what in (
                ([], "empty"),
                ([VOCAB], "vocabulary"),
                ([-1, 2], r"vocabulary|0\.\.2\*\*63-1"),
                (list(range(120)), "more than"),
            ):
                with pytest.raises(ValueError, match=what):
                    await gen.generate(bad, max_new_tokens=10)
            with pytest.raises(ValueError, match="max_new_tokens"):
                await gen.generate([1, 2], max_new_tokens=0)
            with pytest.raises(ValueError, match="top_p"):
                await gen.generate([1, 2], temperature=1.0, top_p=0)
            with pytest.raises(TypeError):
                await gen.generate([1.5, 2])  # type: ignore[list-item]  # deliberately not token ids
            assert cache.statistics().requests == 0
        finally:
            gen.close()


async def test_seeded_sampling_is_reproducible(model32, tmp_path):
    prompt = _tokens(16, 40)
    async with _cache(model32, tmp_path) as cache:
        gen = CachedGenerator(model32, cache)
        try:
            a = await gen.generate(prompt, max_new_tokens=8, temperature=0.9, top_k=50, top_p=0.9, seed=7)
            b = await gen.generate(prompt, max_new_tokens=8, temperature=0.9, top_k=50, top_p=0.9, seed=7)
        finally:
            gen.close()
    assert a.tokens == b.tokens and b.tokens_reused == 39


async def test_the_model_and_the_cache_must_fit(model32, tmp_path):
    layout = layout_for(model32, TPB)
    wrong = KVLayout(
        num_layers=layout.num_layers + 1,
        num_kv_heads=layout.num_kv_heads,
        head_dim=layout.head_dim,
        tokens_per_block=TPB,
        dtype=layout.dtype,
    )
    device = str(next(model32.parameters()).device)
    async with TieredKVCache(wrong, gpu_blocks=4, device="cpu" if device == "cpu" else device) as cache:
        with pytest.raises(ValueError, match="layout_for"):
            CachedGenerator(model32, cache)
    with pytest.raises(TypeError):
        CachedGenerator(model32, object())  # type: ignore[arg-type]
    from transformers import MistralConfig

    sliding = random_causal_lm(
        MistralConfig(
            vocab_size=64,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            sliding_window=8,
        )
    )
    async with TieredKVCache(layout_for(sliding, TPB), gpu_blocks=4, device="cpu") as cache:
        with pytest.raises(ValueError, match="full attention"):
            CachedGenerator(sliding, cache)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
async def test_bf16_equal_to_transformers_with_the_same_kv_and_argmax_to_a_recompute_but_at_near_ties(tmp_path, device):
    model = random_causal_lm(tiny_llama_config(), dtype=torch.bfloat16, device=device, seed=2)
    first = _tokens(17, 90)
    second = first[:53] + _tokens(18, 30)
    async with _cache(model, tmp_path) as cache:
        gen = CachedGenerator(model, cache)
        try:
            await gen.generate(first, max_new_tokens=2)
            await _move_all(cache, "host")
            out = await gen.generate(second, max_new_tokens=6, output_logits=True)
        finally:
            gen.close()
    assert out.tokens_reused == 53
    tokens, logits, _ = reference_generate(
        model, second, max_new_tokens=6, output_logits=True, past=_past(model, first, 53)
    )
    assert logits is not None
    assert list(out.tokens) == tokens and out.logits is not None and torch.equal(out.logits, logits)
    _, full, _ = reference_generate(model, second, max_new_tokens=1, output_logits=True)
    assert full is not None
    prompt_rows = len(second) - 53
    diff = (out.logits[:prompt_rows] - full[53:]).abs()
    # bf16 keeps 8 bits of mantissa: logits of magnitude ~4 round to steps of 1/32; a wrong block is O(1) off
    assert diff.max().item() <= 0.25, diff.max()
    # the argmax may differ only at a near-tie: where the recompute's two best logits are within twice that bound
    parted = out.logits[:prompt_rows].argmax(-1) != full[53:].argmax(-1)
    top = full[53:][parted].float().topk(2, dim=-1).values
    assert bool(((top[:, 0] - top[:, 1]) <= 0.5).all()), top


async def _generate_after_a_block_swap(model: Any, tmp_path: Any, integrity: bool) -> tuple[list[int], Any, int]:
    """Cache two prompts, put the second block of the other one in the first one's slot (right shape, wrong
    content), then generate a prompt sharing the first one's 48 tokens: ``(that prompt, its output, integrity
    errors)``."""
    first, other = _tokens(19, 64), _tokens(20, 64)
    second = first[:48] + _tokens(21, 30)
    async with _cache(model, tmp_path, integrity=integrity) as cache:
        gen = CachedGenerator(model, cache)
        try:
            await gen.generate(first, max_new_tokens=1)
            await gen.generate(other, max_new_tokens=1)
            pool = cache.engine.pool(Tier.GPU).tensor
            a = cache.blocks.lookup(cache.hasher.chain(np.asarray(first, dtype=np.int64))[1])
            b = cache.blocks.lookup(cache.hasher.chain(np.asarray(other, dtype=np.int64))[1])
            assert a is not None and b is not None
            pool[a.slot] = pool[b.slot]
            out = await gen.generate(second, max_new_tokens=1, output_logits=True)
            return second, out, cache.statistics().integrity_errors
        finally:
            gen.close()


async def test_the_equality_checks_catch_one_wrong_block(model32, tmp_path):
    """The bound above is far below what one block of someone else's KV does to the logits.

    The cache's integrity checks are off here: they would refuse the swapped block (the test below).
    """
    second, out, _ = await _generate_after_a_block_swap(model32, tmp_path, integrity=False)
    assert out.tokens_reused == 48
    _, logits, _ = reference_generate(
        model32, second, max_new_tokens=1, output_logits=True, past=_past(model32, second, 48)
    )
    assert logits is not None and out.logits is not None
    assert (out.logits - logits).abs().max().item() > 100 * FP32_TOL


async def test_integrity_checks_refuse_a_swapped_block_and_the_generator_recomputes_it(model32, tmp_path):
    """With the checks on (the default), the same swap is caught: the block is recomputed and the output equals a
    run without the cache."""
    second, out, errors = await _generate_after_a_block_swap(model32, tmp_path, integrity=True)
    assert errors == 1
    assert out.tokens_reused == 16  # the first block only: the swapped one and what follows are recomputed
    _, logits, _ = reference_generate(model32, second, max_new_tokens=1, output_logits=True)
    assert logits is not None and out.logits is not None
    assert (out.logits - logits[out.tokens_reused :]).abs().max().item() <= FP32_TOL


async def test_the_cost_model_is_fed_by_the_generator_and_its_choice_keeps_the_output(model32, tmp_path):
    from tiered_kv.cost_model import CostModel

    prompt = _tokens(23, 96)
    async with _cache(model32, tmp_path) as cache:
        cost = CostModel(cache, bandwidth={"host": 1e3}).attach()  # an absurdly slow host tier: recompute wins
        gen = CachedGenerator(model32, cache, cost_model=cost)
        try:
            await gen.generate(prompt, max_new_tokens=2)
            assert cost.prefill_seconds_per_token() is not None  # fed by the generator's prefill
            await _move_all(cache, "host")
            out = await gen.generate(prompt, max_new_tokens=4)
        finally:
            gen.close()
    assert out.tokens_reused == 0 and cost.statistics().skipped_blocks == {"host": 5}
    assert cost.statistics().saved_vs_reuse_all_s > 0
    tokens, _, _ = reference_generate(model32, prompt, max_new_tokens=4)
    assert list(out.tokens) == tokens
