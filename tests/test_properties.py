"""Property-based tests: a stateful model of the engine, and bad-input fuzzing of the public methods."""

from __future__ import annotations

import asyncio
import contextlib
import os
import tempfile

import hypothesis.strategies as st
import numpy as np
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from tiered_kv import EngineClosedError, KVLayout, Tier, Transfer, TransferEngine
from tiered_kv.testing import stall

LAYOUT = KVLayout(num_layers=1, num_kv_heads=2, head_dim=4, tokens_per_block=4, dtype=torch.float16)
BLOCKS = 6


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


class EngineMachine(RuleBasedStateMachine):
    """Random copies (awaited or not), stalls and drains; the pools must always match the shadow."""

    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.engine = TransferEngine(LAYOUT, gpu_blocks=BLOCKS, host_blocks=BLOCKS, device="cpu")
        gen = torch.Generator().manual_seed(0)
        self.shadow = {}
        for tier in (Tier.GPU, Tier.HOST):
            pool = self.engine.pool(tier).tensor
            pool.view(-1).view(torch.uint8).copy_(
                torch.randint(0, 256, (pool.numel() * 2,), dtype=torch.uint8, generator=gen)
            )
            self.shadow[tier] = pool.clone()
        self.pending: list[Transfer] = []

    def _run(self, coro):
        return self.loop.run_until_complete(coro)

    @rule(
        src=st.sampled_from([Tier.GPU, Tier.HOST]),
        dst=st.sampled_from([Tier.GPU, Tier.HOST]),
        data=st.data(),
        num_tokens=st.one_of(st.none(), st.integers(1, LAYOUT.tokens_per_block)),
        awaited=st.booleans(),
    )
    def copy(self, src, dst, data, num_tokens, awaited):
        n = data.draw(st.integers(1, BLOCKS // 2))
        dst_idx = data.draw(st.lists(st.integers(0, BLOCKS - 1), min_size=n, max_size=n, unique=True))
        allowed = [i for i in range(BLOCKS) if src is not dst or i not in dst_idx]
        src_idx = data.draw(st.lists(st.sampled_from(allowed), min_size=n, max_size=n))

        async def go():
            t = self.engine.copy(src, src_idx, dst, dst_idx, num_tokens=num_tokens)
            if awaited:
                await t
            else:
                self.pending.append(t)

        self._run(go())
        gathered = self.shadow[src][src_idx].clone()
        if num_tokens is None:
            self.shadow[dst][dst_idx] = gathered
        else:
            self.shadow[dst][dst_idx, :, :, :, :num_tokens] = gathered[:, :, :, :, :num_tokens]

    @rule(stream=st.sampled_from(["offload", "onboard", "local"]), ms=st.integers(0, 3))
    def stall_a_stream(self, stream, ms):
        stall(self.engine.stream(stream), ms / 1000)

    @precondition(lambda self: self.pending)
    @rule()
    def drain(self):
        self._run(self.engine.drain())
        assert all(t.done() for t in self.pending)
        self.pending.clear()
        stats = self.engine.statistics()
        assert stats.in_flight == 0 and stats.fences.fenced_blocks == 0 and stats.failed == 0
        for tier, expected in self.shadow.items():
            assert torch.equal(_bytes(self.engine.pool(tier).tensor), _bytes(expected)), (
                f"{tier} differs from the model"
            )

    @invariant()
    def accounting(self):
        stats = self.engine.statistics()
        assert stats.submitted == stats.completed + stats.in_flight

    def teardown(self):
        self._run(self.engine.close())
        for tier, expected in self.shadow.items():
            assert torch.equal(_bytes(self.engine.pool(tier).tensor), _bytes(expected)), f"{tier} differs at the end"
        self.loop.close()


TestEngineMachine = EngineMachine.TestCase
TestEngineMachine.settings = settings(
    max_examples=40, stateful_step_count=25, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


# ------------------------------------------------------------------------------------------ fuzzing

junk = st.one_of(
    st.none(),
    st.booleans(),
    st.floats(allow_nan=True),
    st.text(max_size=3),
    st.integers(-(2**70), 2**70),
    st.lists(st.one_of(st.integers(-(2**66), 2**66), st.floats(), st.text(max_size=1), st.none()), max_size=5),
    st.lists(st.integers(-3, 9), max_size=6),
    st.builds(lambda xs: np.array(xs, dtype=np.float32), st.lists(st.floats(-5, 5, width=32), max_size=4)),
    st.builds(lambda xs: torch.tensor(xs, dtype=torch.int64), st.lists(st.integers(-3, 9), max_size=4)),
)
tiers = st.one_of(st.sampled_from(list(Tier)), st.sampled_from(["gpu", "HOST", "file", "nvme", "", "Gpu"]), junk)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(src=tiers, src_idx=junk, dst=tiers, dst_idx=junk, num_tokens=st.one_of(st.none(), junk))
def test_copy_fuzz_only_documented_errors_and_no_state_change(src, src_idx, dst, dst_idx, num_tokens):
    async def go():
        async with TransferEngine(LAYOUT, gpu_blocks=BLOCKS, host_blocks=BLOCKS, device="cpu") as engine:
            for tier in (Tier.GPU, Tier.HOST):
                engine.pool(tier).tensor.view(torch.uint8).fill_(5)
            try:
                t = engine.copy(src, src_idx, dst, dst_idx, num_tokens=num_tokens)
            except (ValueError, TypeError):
                stats = engine.statistics()
                assert stats.submitted == 0 and len(engine.fences) == 0
                for tier in (Tier.GPU, Tier.HOST):
                    assert bool((engine.pool(tier).tensor.view(torch.uint8) == 5).all())
                return
            await t  # accepted input must be a valid copy

    asyncio.run(go())


@settings(max_examples=200, deadline=None)
@given(
    layers=st.one_of(st.integers(-2, 4), junk),
    heads=st.one_of(st.integers(-2, 4), junk),
    dim=st.one_of(st.integers(-2, 4), junk),
    tokens=st.one_of(st.integers(-2, 4), junk),
    dtype=st.sampled_from([torch.float16, torch.float32, torch.int64, torch.bool, torch.float8_e4m3fn, "fp16", None]),
    kv=st.one_of(st.integers(-1, 3), junk),
)
def test_layout_fuzz(layers, heads, dim, tokens, dtype, kv):
    try:
        layout = KVLayout(layers, heads, dim, tokens, dtype, kv)
    except ValueError:
        return
    assert layout.bytes_per_block > 0 and len(layout.fingerprint) == 32


@settings(max_examples=100, deadline=None)
@given(
    gpu=st.one_of(junk, st.integers(0, 2**70)),
    host=st.one_of(junk, st.integers(0, 2**70)),
    device=st.one_of(st.sampled_from(["cpu", "auto", "tpu", "cuda:x", ""]), junk),
)
def test_engine_constructor_fuzz(gpu, host, device):
    try:
        engine = TransferEngine(LAYOUT, gpu_blocks=gpu, host_blocks=host, device=device)
    except (ValueError, TypeError, MemoryError):
        return
    except Exception as exc:
        from tiered_kv import BackendUnavailable

        assert isinstance(exc, BackendUnavailable)  # asked for CUDA on a machine without it
        return
    asyncio.run(engine.close())
    try:
        engine.block("gpu", 0)
    except (ValueError, TypeError):
        pass
    assert isinstance(EngineClosedError("x"), RuntimeError)


# ------------------------------------------------------------------------------------------ cache + file fuzzing

# Directory arguments: relative ones are resolved inside a fresh temporary directory (the test chdirs
# there), absolute ones name places that must fail (never "/": this may run as root).
paths = st.one_of(
    st.sampled_from(["", "/proc/nonexistent/x", "/dev/null", "/etc/passwd", "relative/dir", "\x00bad", "a\x00b"]),
    st.text(alphabet="abcXYZ._-/ ", min_size=1, max_size=8).filter(lambda p: not p.startswith("/")),
    junk,
)


@contextlib.contextmanager
def _in_temp_dir():
    old = os.getcwd()
    with tempfile.TemporaryDirectory() as tmp:
        os.chdir(tmp)
        try:
            yield tmp
        finally:
            os.chdir(old)


@settings(max_examples=60, deadline=None)
@given(
    directory=paths,
    blocks=st.one_of(st.integers(-2, 4), junk),
    name=st.one_of(st.sampled_from(["kv", "", ".x", "a/b"]), junk),
)
def test_file_tier_config_fuzz(directory, blocks, name):
    from tiered_kv.file import FileTierConfig

    with _in_temp_dir():
        try:
            FileTierConfig(directory, blocks, name=name)
        except (ValueError, TypeError):
            pass


@settings(max_examples=25, deadline=None)
@given(directory=paths)
def test_engine_with_a_bad_file_dir_fails_cleanly(directory):
    import threading

    before = {t.ident for t in threading.enumerate()}
    with _in_temp_dir():
        try:
            engine = TransferEngine(
                LAYOUT, gpu_blocks=2, host_blocks=2, device="cpu", file_dir=directory, file_blocks=2
            )
        except (ValueError, TypeError, OSError):
            leaked = [t.name for t in threading.enumerate() if t.ident not in before and t.name.startswith("tiered_kv")]
            assert not leaked, leaked  # a failed constructor leaves no thread behind
            return
        asyncio.run(engine.close())


requests = st.one_of(
    junk,
    st.lists(st.one_of(junk, st.lists(st.integers(-5, 2**40), max_size=40)), max_size=3),
)


@settings(max_examples=150, deadline=None)
@given(
    batch=requests,
    seq=st.one_of(st.integers(-3, 5), junk),
    tokens=st.one_of(st.lists(st.integers(-3, 2**33), max_size=5), junk),
)
def test_cache_fuzz_only_documented_errors_and_no_state_change(batch, seq, tokens):
    from tiered_kv import CacheFullError, TieredKVCache

    async def go():
        async with TieredKVCache(LAYOUT, gpu_blocks=8, host_blocks=8, device="cpu", max_seqs=4) as cache:
            [adm] = await cache.add_sequences([list(range(9))])
            cache.commit(adm.seq_id)
            before = cache.statistics()
            table = cache.page_table(adm.seq_id)
            for call in (
                lambda: cache.add_sequences(batch),
                lambda: cache.append_tokens(seq, tokens),
            ):
                try:
                    await call()
                except (ValueError, TypeError, CacheFullError):
                    after = cache.statistics()
                    assert after.blocks.live_sequences == before.blocks.live_sequences
                    assert after.blocks.free == before.blocks.free
                    assert cache.page_table(adm.seq_id) == table
                    continue
                return  # accepted input: a valid call; state changed legitimately
            for bad in (lambda: cache.free(seq), lambda: cache.set_priority(seq, tokens)):
                try:
                    bad()
                except (ValueError, TypeError):
                    pass

    asyncio.run(go())
