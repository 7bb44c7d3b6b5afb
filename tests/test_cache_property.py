"""Property test: random add / append / commit / free / evict on tiny tiers (GPU, host, in-memory file).

After every step: every block lives in exactly one (tier, slot), no slot is lost or shared, reference counts
are never negative and equal the sequences holding a block, LRUs hold exactly the unused cached blocks, and
every cached block is reachable from the root (``BlockManager.check``). On every admission: each request's
realized reuse equals what a lookup planned before the batch (claimed blocks are never evicted), and every
reused token's GPU content equals what was written for its prefix (deterministic content per key).
"""

from __future__ import annotations

import asyncio
import contextlib
import tempfile

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from tiered_kv import KVLayout, Tier, TransferEngine
from tiered_kv.blocks import CacheFullError, Request
from tiered_kv.cache import TieredKVCache
from tiered_kv.tools.workload import verify_expected, write_expected

TPB = 2
LAYOUT = KVLayout(num_layers=1, num_kv_heads=1, head_dim=4, tokens_per_block=TPB, dtype=torch.float16)

# a tiny alphabet, so prompts share prefixes and partial matches often
tokens_st = st.lists(st.integers(0, 2), min_size=1, max_size=11)
priority_st = st.sampled_from([10, 50, 90])


class CacheMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.stack = contextlib.ExitStack()
        self.cache: TieredKVCache | None = None
        self.live: dict[int, int] = {}  # seq id -> tokens written so far

    def run(self, coro):
        return self.loop.run_until_complete(coro)

    @initialize(gpu=st.integers(6, 12), host=st.integers(0, 6), file=st.integers(0, 4), drop=st.sampled_from([0, 30]))
    def open(self, gpu: int, host: int, file: int, drop: int) -> None:
        async def make() -> tuple[TransferEngine, TieredKVCache]:
            if file:
                tmp = self.stack.enter_context(tempfile.TemporaryDirectory(prefix="tiered_kv-prop-"))
                engine = TransferEngine(
                    LAYOUT, gpu_blocks=gpu, host_blocks=host, device="cpu", file_dir=tmp, file_blocks=file
                )
            else:
                engine = TransferEngine(LAYOUT, gpu_blocks=gpu, host_blocks=host, device="cpu")
            cache = TieredKVCache(
                LAYOUT,
                gpu_blocks=gpu,
                host_blocks=host,
                file_blocks=file,
                engine=engine,
                max_seqs=6,
                drop_below_priority=drop,
            )
            return engine, cache

        self.engine, self.cache = self.run(make())

    @rule(batch=st.lists(st.tuples(tokens_st, priority_st), min_size=1, max_size=3), data=st.data())
    def add(self, batch: list[tuple[list[int], int]], data: st.DataObject) -> None:
        cache = self.cache
        assert cache is not None
        planned = [cache.match(t) for t, _ in batch]
        before = cache.statistics().blocks
        try:
            adms = self.run(cache.add_sequences([Request(t, p) for t, p in batch]))
        except CacheFullError:
            assert cache.statistics().blocks == before, "a refused batch changed the cache"
            return
        for adm, (reuse, by_tier) in zip(adms, planned, strict=True):
            assert adm.tokens_reused == reuse and adm.blocks_from == by_tier, "a claimed block was lost in phase 2"
            assert verify_expected(cache, adm.seq_id, 0, adm.tokens_reused) == [], "a reused token has wrong content"
            write_expected(cache, adm.seq_id, adm.tokens_reused)
            cache.commit(adm.seq_id, data.draw(st.integers(adm.tokens_reused, adm.num_tokens), label="commit"))
            if data.draw(st.booleans(), label="keep"):
                self.live[adm.seq_id] = adm.num_tokens
            else:
                cache.free(adm.seq_id)  # a finished request: its blocks become cache at once

    @precondition(lambda self: self.live)
    @rule(data=st.data(), tokens=st.lists(st.integers(0, 2), min_size=1, max_size=4))
    def append(self, data: st.DataObject, tokens: list[int]) -> None:
        cache = self.cache
        assert cache is not None
        seq = data.draw(st.sampled_from(sorted(self.live)), label="seq")
        try:
            self.run(cache.append_tokens(seq, tokens))
        except (CacheFullError, ValueError):
            return  # full, or longer than a sequence may be: nothing changed
        write_expected(cache, seq, self.live[seq])
        self.live[seq] += len(tokens)
        cache.commit(seq)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        assert self.cache is not None
        seq = data.draw(st.sampled_from(sorted(self.live)), label="seq")
        self.cache.free(seq)
        del self.live[seq]
        with pytest.raises(ValueError, match="already freed"):
            self.cache.free(seq)

    @rule(tier=st.sampled_from([Tier.GPU, Tier.HOST, Tier.FILE]), count=st.integers(1, 4))
    def evict(self, tier: Tier, count: int) -> None:
        assert self.cache is not None
        self.run(self.cache.evict(tier, count))

    @invariant()
    def consistent(self) -> None:
        if self.cache is not None:
            self.cache.blocks.check()

    def teardown(self) -> None:
        try:
            if self.cache is not None:
                self.run(self.cache.close())
                self.run(self.engine.close())
        finally:
            self.stack.close()
            self.loop.close()


CacheMachine.TestCase.settings = settings(
    max_examples=40, stateful_step_count=30, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
test_cache_state_machine = CacheMachine.TestCase
